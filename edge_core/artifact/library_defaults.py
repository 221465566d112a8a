"""Values a config leaves to its library, filled from transformers' configuration source.

Some published configs name only what differs from their library's defaults
(gemma-3-4b-it's ``text_config`` has six fields; its heads, KV heads, head_dim
and sliding pattern are ``Gemma3TextConfig``'s defaults). When the attention
geometry is missing, :func:`fill_library_defaults` reads them from the
installed transformers' *source* for that ``model_type``
(:mod:`.transformers_source` finds the class, :mod:`.config_class` reads it,
:mod:`.derivation` replicates its layer pattern): literals only -- nothing
imported or executed, never modeling code, never ``trust_remote_code`` -- and
the manifest lists every value that came from there.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from ..services.source_tree import SourceTree, Unreadable
from .config_class import NO_VALUE, PER_LAYER_CONFIG, ConfigSource, NotReadable
from .derivation import DERIVED_FIELDS, derive_field
from .families import ATTENTION_FREE_MODEL_TYPES
from .fields import ATTENTION_HEAD_FIELDS, DEFAULTABLE_FIELDS, HIDDEN_FIELDS, LAYER_COUNT_FIELDS, is_set
from .transformers_source import text_config_source, transformers_dir, transformers_version


@dataclass(frozen=True)
class LibraryDefaults:
    """Values a config left to its library, as transformers' configuration source states them.

    ``values`` maps each filled field to its value (empty when none was filled);
    ``source`` names the class and version that gave them, or why none could
    be filled; None when the config did not need any. ``files`` lists the
    configuration source files the class was read from (relative to the
    transformers package), so a test can check that only configuration was.
    """

    values: dict[str, Any] = field(default_factory=dict)
    source: str | None = None
    files: tuple[str, ...] = ()


def needs_library_defaults(text: dict[str, Any]) -> bool:
    """Whether the text config lacks attention geometry the KV arithmetic cannot infer.

    Heads are the tell: every attention model names them unless it relies on
    its class's defaults; MLA (``kv_lora_rank``) and attention-free families
    need none. The config must still state the checkpoint's own shape (layer
    count and hidden size), which no default may supply. A config naming its
    heads reads no transformers source at all.
    """
    if is_set(text, ATTENTION_HEAD_FIELDS) or text.get("kv_lora_rank") is not None:
        return False
    if not (is_set(text, LAYER_COUNT_FIELDS) and is_set(text, HIDDEN_FIELDS)):
        return False
    return text.get("model_type") not in ATTENTION_FREE_MODEL_TYPES


def fill_library_defaults(text: dict[str, Any], raw: dict[str, Any],
                          text_key: str | None) -> tuple[dict[str, Any], LibraryDefaults]:
    """The text config with the fields it leaves to transformers' defaults filled in, and what was filled.

    Only when :func:`needs_library_defaults` says so; without transformers the
    config comes back as it was (the KV arithmetic then refuses
    ``config_unreadable``, its remedy naming transformers). The values are
    read from the installed transformers' *source* (:func:`read_library_defaults`),
    never imported: importing ``configuration_utils`` pulls in torch and costs
    seconds, against half a second for a whole plan
    (docs/benchmarks.md#reading-transformers-configuration-source).
    """
    if not needs_library_defaults(text):
        return text, LibraryDefaults()
    package = transformers_dir()
    if package is None:
        return text, LibraryDefaults(source="not filled: transformers is not installed")
    found = read_library_defaults(package, text, raw, text_key)
    return {**text, **copy.deepcopy(found.values)}, found


def read_library_defaults(package: str, text: dict[str, Any], raw: dict[str, Any],
                          text_key: str | None) -> LibraryDefaults:
    """What the transformers source under ``package`` says ``text`` leaves to its configuration class.

    The class is found as ``AutoConfig`` finds it (``CONFIG_MAPPING_NAMES`` and
    ``model_type_to_module_name`` in ``models/auto/configuration_auto.py``;
    a wrapper's ``sub_configs`` when the text config names no model_type), its
    module ``models/<name>/configuration_<name>.py`` parsed with :mod:`ast`.
    A field's default is taken only when it is a literal (``ast.literal_eval``)
    that no method of the class reassigns; the layer pattern is derived as
    :func:`derive_field` says. Nothing is imported or executed.
    """
    try:
        version = transformers_version(package)
        tree = SourceTree(package, package="transformers", label="transformers", version=version)
        source = text_config_source(tree, text, raw, text_key)
    except NotReadable as why:
        return LibraryDefaults(source=f"not filled: {why}")
    except (Unreadable, OSError, SyntaxError, UnicodeDecodeError, ValueError, RecursionError, MemoryError) as exc:
        return LibraryDefaults(source=f"not filled: transformers' source under {package} could not be read ({exc})")
    if source.per_layer or text.get(PER_LAYER_CONFIG) is not None:
        return LibraryDefaults(source=f"not filled: transformers {version} {source.name} gives layers their own "
                                      f"geometry ({PER_LAYER_CONFIG}), which edge does not replicate",
                               files=source.files)
    values = class_values(source, text)
    if not values:
        return LibraryDefaults(source=f"not filled: transformers {version} {source.name}'s source states no "
                                      "literal default for the fields the config leaves out", files=source.files)
    return LibraryDefaults(values=values, source=f"transformers {version} {source.name} defaults, read from its source",
                           files=source.files)


def class_values(source: ConfigSource, text: dict[str, Any]) -> dict[str, Any]:
    """field -> value for every :data:`DEFAULTABLE_FIELDS` group ``text`` leaves unset that ``source`` fills.

    Each group is looked up under transformers' canonical name (its first),
    through the class's ``attribute_map`` as ``getattr`` on the class would; a
    published field the map names answers first, then a derivation edge
    replicates (:data:`DERIVED_FIELDS`), then a literal default that no method
    reassigns. None is never a value.
    """
    published = {source.attribute_map.get(k, k): v for k, v in text.items()}
    values: dict[str, Any] = {}
    for group in DEFAULTABLE_FIELDS:
        if is_set(text, group):
            continue
        name = source.attribute_map.get(group[0], group[0])
        value = published.get(name)
        if value is None and name in DERIVED_FIELDS:
            value = derive_field(source, name, text)
        if value is None and name not in published and not source.computed(name):
            value = source.defaults.get(name)
        value = _json_value(value)
        if value is not None and value is not NO_VALUE:
            values[group[0]] = value
    return values


def _json_value(value: Any) -> Any:
    """``value`` as JSON holds it (tuples as lists), or ``NO_VALUE`` when JSON cannot."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else NO_VALUE
    if isinstance(value, (list, tuple)):
        items = [_json_value(v) for v in value]
        return NO_VALUE if any(v is NO_VALUE for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        entries = {k: _json_value(v) for k, v in value.items()}
        return NO_VALUE if any(v is NO_VALUE for v in entries.values()) else entries
    return NO_VALUE
