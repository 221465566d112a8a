"""The model's ``config.json``: read safely, the text model's part resolved, its identity named.

Multimodal wrappers nest the language model under ``text_config`` (or a
sibling key); the planner reads one dict either way. Never ``trust_remote_code``:
the file is JSON and nothing else.

Some published configs name only what differs from their library's defaults
(gemma-3-4b-it's ``text_config`` has six fields; its heads, KV heads, head_dim
and sliding pattern are ``Gemma3TextConfig``'s defaults). When the attention
geometry is missing, :func:`fill_library_defaults` reads them from the
installed transformers' *source* for that ``model_type``: its configuration
module, parsed with :mod:`ast`, literals only -- nothing imported or executed,
never modeling code, never ``trust_remote_code`` -- and the manifest lists
every value that came from there.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import math
import operator
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ArtifactError
from ._files import read_json

CONFIG_NAME = "config.json"
#: Multimodal wrappers nest the language model's config under one of these.
TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")

# How published configs spell the geometry the KV arithmetic (plan/kv.py) reads;
# the first name of each group is transformers' canonical one.
LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
ATTENTION_HEAD_FIELDS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
KV_HEAD_FIELDS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model")
HEAD_DIM_FIELDS = ("head_dim", "kv_channels")
CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
#: Every per-layer pattern vocabulary the installed vLLM and transformers read
#: (plan/kv.py says which family reads which); any one of them states the pattern.
LAYER_PATTERN_FIELDS = ("layer_types", "layers_block_type", "hybrid_override_pattern", "full_attention_interval",
                        "sliding_window_pattern", "attn_layer_indices", "attn_layer_period", "attn_type_list",
                        "full_attn_idxs", "no_rope_layers")
#: Model types with no attention at all: no heads to miss.
ATTENTION_FREE_MODEL_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba"})

#: Fields a configuration class's defaults may fill, as alias groups (filled
#: under the first name, and only when no name of the group is set). The layer
#: count and hidden size are not among them: they are the checkpoint's shape,
#: and a library default (``LlamaConfig`` says 32 layers for every Llama) would
#: plan a model the weights do not describe -- a missing one stays a refusal.
DEFAULTABLE_FIELDS: tuple[tuple[str, ...], ...] = (
    ATTENTION_HEAD_FIELDS, KV_HEAD_FIELDS, HEAD_DIM_FIELDS, CONTEXT_FIELDS,
    LAYER_PATTERN_FIELDS, ("sliding_window",), ("attention_chunk_size",),
    ("intermediate_size",), ("vocab_size",),
    ("kv_lora_rank",), ("qk_rope_head_dim",),
    ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads"), ("mamba_d_head", "mamba_head_dim", "mamba_headdim"),
    ("mamba_d_state", "ssm_state_size", "state_size"), ("mamba_d_conv", "conv_kernel"),
    ("mamba_n_groups", "n_groups", "mamba_ngroups"), ("mamba_expand", "expand"), ("mamba_d_ssm",),
    ("linear_num_key_heads",), ("linear_num_value_heads",), ("linear_key_head_dim",), ("linear_value_head_dim",),
    ("linear_conv_kernel_dim",), ("conv_L_cache",),
)

#: What a missing field's refusal adds when transformers is absent.
DEFAULTS_REMEDY = ("or install transformers in this venv (pip install transformers): edge then fills the fields "
                   "a config leaves to its library's defaults from the source of transformers' configuration "
                   "class for its model_type (read, not imported: no model code, no trust_remote_code)")


def read_config(root: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw ``config.json`` of a model directory as a dict; ``config_unreadable`` otherwise."""
    return read_config_sized(os.path.abspath(os.fspath(root)))[0]


def read_config_sized(root: str) -> tuple[dict[str, Any], int]:
    config, size = read_json(os.path.join(root, CONFIG_NAME), "config.json", "config_unreadable", root)
    if not isinstance(config, dict):
        raise ArtifactError("config_unreadable",
                            f"{root}/config.json holds a JSON {type(config).__name__}, not an object",
                            "restore the model's config.json from its source", root)
    return config, size


def resolve_text_config(raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The language model's config and the key it was nested under (None when top-level).

    Multimodal wrappers (Llava, Gemma 3, Mistral 3, ...) keep the decoder's
    geometry in ``text_config`` but often write ``quantization_config`` and the
    dtype only on the wrapper; those are carried in so one dict answers both.
    """
    for key in TEXT_CONFIG_KEYS:
        nested = raw.get(key)
        if isinstance(nested, dict):
            text = copy.deepcopy(nested)
            for carried in ("quantization_config", "compression_config", "torch_dtype", "dtype"):
                if carried not in text and carried in raw:
                    text[carried] = copy.deepcopy(raw[carried])
            return text, key
    return copy.deepcopy(raw), None


def identity(raw: dict[str, Any]) -> tuple[str | None, str | None]:
    """(architecture, model_type) as the loader dispatches on them: the outer config's."""
    archs = raw.get("architectures")
    architecture = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    model_type = raw.get("model_type")
    return architecture, model_type if isinstance(model_type, str) else None



def quantization_of(config: dict[str, Any]) -> Any:
    # compressed-tensors checkpoints from before 2024 wrote "compression_config".
    for key in ("quantization_config", "compression_config"):
        if config.get(key) is not None:
            return config[key]
    for key in TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and nested.get("quantization_config") is not None:
            return nested["quantization_config"]
    return None


# ------------------------------------------------------------ library defaults

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


def is_set(config: dict[str, Any], names: tuple[str, ...]) -> bool:
    """Whether the config sets any of ``names`` (a null counts as unset, as vLLM and the KV arithmetic read it)."""
    return any(config.get(name) is not None for name in names)


def transformers_dir() -> str | None:
    """The installed transformers package's directory, found without importing it (None: not installed).

    ``find_spec`` of a top-level name imports nothing; it answers None for a
    None entry in ``sys.modules``, which is how a test hides transformers.
    """
    try:
        spec = importlib.util.find_spec("transformers")
    except (ImportError, ValueError):
        return None
    for location in (spec.submodule_search_locations or ()) if spec is not None else ():
        if os.path.isfile(os.path.join(location, AUTO_CONFIG_SOURCE)):
            return os.path.realpath(location)
    return None


def transformers_installed() -> bool:
    """Whether a transformers package with readable configuration source is installed (a lookup, not an import)."""
    return transformers_dir() is not None


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


def defaults_remedy(name: str) -> str | None:
    """The install hint for a missing field edge could fill from transformers, when transformers is absent."""
    fillable = any(name in group for group in DEFAULTABLE_FIELDS)
    return DEFAULTS_REMEDY if fillable and not transformers_installed() else None


def fill_library_defaults(text: dict[str, Any], raw: dict[str, Any],
                          text_key: str | None) -> tuple[dict[str, Any], LibraryDefaults]:
    """The text config with the fields it leaves to transformers' defaults filled in, and what was filled.

    Only when :func:`needs_library_defaults` says so; without transformers the
    config comes back as it was (the KV arithmetic then refuses
    ``config_unreadable``, its remedy naming transformers). The values are
    read from the installed transformers' *source* (:func:`read_library_defaults`),
    never imported: transformers 5.19's ``configuration_utils`` imports torch
    whenever it is installed (3.8 s measured here), and a child interpreter
    hiding torch still took 3 s, against half a second for a whole plan.
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
        source = _text_config_source(_SourceReader(package, version), text, raw, text_key)
    except _NotReadable as why:
        return LibraryDefaults(source=f"not filled: {why}")
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError, RecursionError, MemoryError) as exc:
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


def transformers_version(package: str) -> str:
    """``transformers.__version__`` as its ``__init__.py`` writes it (read, not imported)."""
    with open(os.path.join(package, "__init__.py"), encoding="utf-8") as f:
        found = _VERSION_LINE.search(f.read())
    if found is None:
        raise _NotReadable(f"{package}/__init__.py states no __version__")
    return found.group(2)


_VERSION_LINE = re.compile(r"""^__version__\s*=\s*(["'])([^"'\n]+)\1""", re.MULTILINE)
#: configuration_auto's mapping from model_type to class name, and where it lives.
AUTO_CONFIG_SOURCE = "models/auto/configuration_auto.py"
_AUTO_NAMES = ("CONFIG_MAPPING_NAMES", "SPECIAL_MODEL_TYPE_TO_MODULE_NAME", "DEPRECATED_MODELS")
#: The base every configuration class ends at; its own fields (dtype, labels) are not geometry.
_ROOT_CONFIGS = frozenset({"PreTrainedConfig", "PretrainedConfig"})
#: How deep a chain of configuration base classes edge follows (5.19's deepest is 2).
MAX_BASE_DEPTH = 8
#: transformers' per-layer overrides (HeterogeneousConfigMixin): a class or config using them is not filled.
PER_LAYER_CONFIG = "per_layer_config"


class _NotReadable(Exception):
    """Why transformers' source gave no class to read defaults from (the manifest's source line says it)."""


@dataclass(frozen=True)
class ConfigSource:
    """What a configuration class's source says, read with :mod:`ast`; nothing of it was executed.

    ``defaults`` holds each field's literal default (class-level annotated
    fields in transformers 5.x, ``__init__`` keywords passed through to
    ``self.<name>`` in 4.x); ``assigned`` counts the places its methods assign
    ``self.<name>`` otherwise (``"*"``: a ``setattr`` with a computed name), so
    such a default is not final. ``bodies`` are the ``__init__`` /
    ``__post_init__`` bodies, most-derived class first, each with its keyword
    defaults; ``sub_configs`` maps a wrapper's sub-config key to the (file,
    class) it names. ``per_layer``: its code builds a ``per_layer_config``
    (Gemma4TextConfig: full-attention layers get their own head_dim), so no
    one value of a geometry field describes every layer. ``opaque``: names
    whose value no code edge follows gives (properties, plain class attributes
    over a field).
    """

    name: str
    files: tuple[str, ...]
    defaults: dict[str, Any]
    fields: frozenset[str]
    attribute_map: dict[str, str]
    assigned: dict[str, int]
    bodies: tuple[tuple[dict[str, Any], tuple[ast.stmt, ...]], ...]
    sub_configs: dict[str, tuple[str, str]]
    per_layer: bool = False
    opaque: frozenset[str] = frozenset()

    def computed(self, name: str) -> bool:
        """Whether code of the class may give ``name`` another value than its declared default."""
        return self.assigned.get(name, 0) > 0 or self.assigned.get("*", 0) > 0


#: Parsed auto mappings per (package, version) and classes per (package,
#: version, model_type or file and class): a process reads each source once. No
#: disk cache: reading gemma-3's class costs 35-50 ms in a fresh process here
#: (25 ms of it parsing configuration_auto and its generated auto_mappings), well
#: inside the plan's half second, and a cache file would need invalidating on
#: every in-place upgrade and writing from a command that otherwise writes nothing.
_MAPPINGS: dict[tuple[str, str], dict[str, Any]] = {}
_CLASSES: dict[tuple[str, str, str, str], ConfigSource] = {}
_BY_MODEL_TYPE: dict[tuple[str, str, str], ConfigSource | str] = {}


class _SourceReader:
    """Parses files of one transformers package (paths relative to it); a file is parsed once per reader."""

    def __init__(self, package: str, version: str) -> None:
        self.package, self.version = package, version
        self._trees: dict[str, ast.Module] = {}

    def exists(self, rel: str) -> bool:
        return os.path.isfile(os.path.join(self.package, rel))

    def tree(self, rel: str) -> ast.Module:
        if rel not in self._trees:
            with open(os.path.join(self.package, rel), encoding="utf-8") as f:
                self._trees[rel] = ast.parse(f.read(), filename=rel)
        return self._trees[rel]


def _text_config_source(reader: _SourceReader, text: dict[str, Any], raw: dict[str, Any],
                        text_key: str | None) -> ConfigSource:
    model_type = text.get("model_type")
    if isinstance(model_type, str):
        return _model_type_source(reader, model_type)
    wrapper_type = raw.get("model_type")
    if text_key is None or not isinstance(wrapper_type, str):
        raise _NotReadable("the config names no model_type")
    wrapper = _model_type_source(reader, wrapper_type)
    where = wrapper.sub_configs.get(text_key)
    if where is None:
        raise _NotReadable(f"transformers {reader.version} {wrapper.name} names no class for its {text_key}")
    return _class_source(reader, *where)


def _model_type_source(reader: _SourceReader, model_type: str) -> ConfigSource:
    key = (reader.package, reader.version, model_type)
    if key not in _BY_MODEL_TYPE:
        try:
            _BY_MODEL_TYPE[key] = _class_source(reader, *_config_module(reader, model_type))
        except _NotReadable as why:
            _BY_MODEL_TYPE[key] = str(why)
    found = _BY_MODEL_TYPE[key]
    if isinstance(found, str):
        raise _NotReadable(found)
    return found


def _config_module(reader: _SourceReader, model_type: str) -> tuple[str, str]:
    """(file, class name) of ``model_type``'s configuration class, as ``AutoConfig`` resolves it."""
    key = (reader.package, reader.version)
    if key not in _MAPPINGS:
        _MAPPINGS[key] = _module_constants(reader, AUTO_CONFIG_SOURCE, _AUTO_NAMES)
    mapping = _MAPPINGS[key]
    names, special = mapping.get("CONFIG_MAPPING_NAMES"), mapping.get("SPECIAL_MODEL_TYPE_TO_MODULE_NAME", {})
    deprecated = mapping.get("DEPRECATED_MODELS", [])
    if not isinstance(names, dict) or not isinstance(special, dict) or not isinstance(deprecated, list):
        raise _NotReadable(f"transformers {reader.version}'s {AUTO_CONFIG_SOURCE} has no CONFIG_MAPPING_NAMES "
                           "edge can read")
    class_name = names.get(model_type)
    if not isinstance(class_name, str):
        raise _NotReadable(f"transformers {reader.version} has no configuration class for model_type {model_type!r}")
    # configuration_auto.model_type_to_module_name, replicated.
    module = special[model_type] if model_type in special else model_type.replace("-", "_")
    if module in deprecated:
        module = f"deprecated.{module}"
    if not isinstance(module, str) or not re.fullmatch(r"\w+(\.\w+)?", module, re.ASCII):
        raise _NotReadable(f"transformers {reader.version} maps model_type {model_type!r} to module {module!r}")
    leaf = module.rsplit(".", 1)[-1]
    return f"models/{module.replace('.', '/')}/configuration_{leaf}.py", class_name


def _module_constants(reader: _SourceReader, rel: str, names: tuple[str, ...], depth: int = 0) -> dict[str, Any]:
    """The module-level values ``rel`` gives ``names``, as far as literals say.

    Handled: a literal, ``OrderedDict(...)`` / ``dict(...)`` of literals and
    ``**`` of names already read, ``NAME.update(<literal>)``, and names imported
    from a sibling module (5.x keeps the mapping in a generated
    ``auto_mappings.py``). Any other assignment forgets the name.
    """
    env: dict[str, Any] = {}
    for stmt in reader.tree(rel).body:
        if isinstance(stmt, ast.ImportFrom) and stmt.level and depth < 2:
            wanted = [alias for alias in stmt.names if (alias.asname or alias.name) in names]
            target = _import_target(reader, rel, stmt) if wanted else None
            if target is not None:
                found = _module_constants(reader, target, tuple(alias.name for alias in wanted), depth + 1)
                env.update({alias.asname or alias.name: found[alias.name] for alias in wanted if alias.name in found})
        elif (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
              and stmt.targets[0].id in names):
            try:
                env[stmt.targets[0].id] = _constant(stmt.value, env)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                env.pop(stmt.targets[0].id, None)
        elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
              and isinstance(stmt.value.func, ast.Attribute) and stmt.value.func.attr == "update"
              and isinstance(stmt.value.func.value, ast.Name) and stmt.value.func.value.id in env
              and len(stmt.value.args) == 1 and not stmt.value.keywords):
            name = stmt.value.func.value.id
            try:
                env[name] = {**env[name], **dict(_constant(stmt.value.args[0], env))}
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                env.pop(name, None)
    return env


def _constant(node: ast.expr, env: dict[str, Any]) -> Any:
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise ValueError(f"{node.id} is not a constant read here")
        return copy.deepcopy(env[node.id])
    if isinstance(node, ast.Call) and _dotted_tail(node.func) in ("OrderedDict", "dict"):
        out: dict[Any, Any] = {}
        for arg in node.args:
            out.update(dict(_constant(arg, env)))
        for keyword in node.keywords:
            if keyword.arg is None:
                out.update(dict(_constant(keyword.value, env)))
            else:
                out[keyword.arg] = ast.literal_eval(keyword.value)
        return out
    return ast.literal_eval(node)


def _dotted_tail(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else None


def _import_target(reader: _SourceReader, rel: str, stmt: ast.ImportFrom) -> str | None:
    """The package-relative file a relative ``from ... import`` reads (None: outside the package or absent)."""
    if not stmt.module or not stmt.level:
        return None
    base = os.path.dirname(rel)
    for _ in range(stmt.level - 1):
        if not base:
            return None
        base = os.path.dirname(base)
    target = os.path.normpath(os.path.join(base, *stmt.module.split(".")))
    if target.startswith("..") or os.path.isabs(target):
        return None
    for candidate in (f"{target}.py", os.path.join(target, "__init__.py")):
        if reader.exists(candidate):
            return candidate.replace(os.sep, "/")
    return None


def _class_source(reader: _SourceReader, rel: str, name: str, depth: int = 0) -> ConfigSource:
    """What configuration class ``name`` in file ``rel`` declares, its bases' declarations merged in."""
    key = (reader.package, reader.version, rel, name)
    if key in _CLASSES:
        return _CLASSES[key]
    if depth > MAX_BASE_DEPTH:
        raise _NotReadable(f"{name}'s configuration base classes nest deeper than {MAX_BASE_DEPTH}")
    tree = reader.tree(rel)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    if name not in classes and rel.endswith("/__init__.py"):
        # `from ..siglip import SiglipVisionConfig`: a lazy package re-exports its configuration module.
        leaf = os.path.basename(os.path.dirname(rel))
        sibling = f"{os.path.dirname(rel)}/configuration_{leaf}.py"
        if reader.exists(sibling):
            return _class_source(reader, sibling, name, depth)
    node = classes.get(name)
    if node is None:
        raise _NotReadable(f"transformers {reader.version}'s {rel} defines no class {name}")
    imports: dict[str, tuple[str, str]] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and (module := _import_target(reader, rel, stmt)) is not None:
            imports.update({alias.asname or alias.name: (module, alias.name) for alias in stmt.names})

    def locate(expr: ast.expr) -> tuple[str, str] | None:
        if not isinstance(expr, ast.Name) or expr.id in _ROOT_CONFIGS:
            return None
        return (rel, expr.id) if expr.id in classes else imports.get(expr.id)

    # Bases edge cannot locate (mixins from outside transformers) add nothing.
    bases = [_class_source(reader, *where, depth + 1) for where in map(locate, node.bases) if where is not None]
    defaults: dict[str, Any] = {}
    fields: set[str] = set()
    assigned: dict[str, int] = {}
    attribute_map: dict[str, str] = {}
    sub_configs: dict[str, tuple[str, str]] = {}
    opaque: set[str] = set()
    for base in reversed(bases):  # the leftmost base wins, as in the MRO of these flat hierarchies
        defaults.update(base.defaults)
        fields |= base.fields
        for attr, n in base.assigned.items():
            assigned[attr] = assigned.get(attr, 0) + n
        attribute_map = base.attribute_map or attribute_map
        sub_configs.update(base.sub_configs)
        opaque |= base.opaque
    bodies: list[tuple[dict[str, Any], tuple[ast.stmt, ...]]] = []

    def add_sites(sites: dict[str, int]) -> None:
        for attr, n in sites.items():
            assigned[attr] = assigned.get(attr, 0) + n

    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            declared = stmt.target.id
            annotation = stmt.annotation.value if isinstance(stmt.annotation, ast.Subscript) else stmt.annotation
            if _dotted_tail(annotation) == "ClassVar":
                attribute_map, sub_configs = _class_attribute(declared, stmt.value, attribute_map, sub_configs,
                                                              locate)
                continue
            fields.add(declared)
            defaults.pop(declared, None)
            literal = _literal(stmt.value) if stmt.value is not None else _NO_VALUE
            if literal is not _NO_VALUE:
                defaults[declared] = literal
        elif isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    attribute_map, sub_configs = _class_attribute(target.id, stmt.value, attribute_map,
                                                                  sub_configs, locate)
                    if target.id in fields:  # a plain class attribute over an inherited field: not its default
                        defaults.pop(target.id, None)
                        add_sites({target.id: 1})
                        opaque.add(target.id)
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if any(_dotted_tail(d) in ("property", "cached_property", "setter") for d in stmt.decorator_list):
                add_sites({stmt.name: 1})
                opaque.add(stmt.name)
            sites = _self_assignments(stmt)
            params: dict[str, Any] = {}
            if stmt.name == "__init__":
                params = _keyword_defaults(stmt.args)
                for attr in _passed_through(stmt, params):  # `self.x = x`: how a 4.x field is set, not a derivation
                    fields.add(attr)
                    defaults.pop(attr, None)
                    if params[attr] is not _NO_VALUE:
                        defaults[attr] = params[attr]
                    sites[attr] -= 1
                for local in _rebound_names(stmt) & set(params):  # `if x is None: x = ...` before `self.x = x`
                    sites[local] = sites.get(local, 0) + 1
            add_sites(sites)
            if stmt.name in ("__init__", "__post_init__"):
                bodies.append((params, tuple(stmt.body)))
    source = ConfigSource(
        name=name,
        files=tuple(dict.fromkeys([rel, *(f for base in bases for f in base.files)])),
        defaults=defaults, fields=frozenset(fields), attribute_map=attribute_map, assigned=assigned,
        bodies=(*bodies, *(body for base in bases for body in base.bodies)), sub_configs=sub_configs,
        opaque=frozenset(opaque),
        per_layer=any(base.per_layer for base in bases) or any(
            _dotted_tail(n) == PER_LAYER_CONFIG or (isinstance(n, ast.Constant) and n.value == PER_LAYER_CONFIG)
            for stmt in node.body if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
            for n in ast.walk(stmt) if isinstance(n, ast.expr)))
    _CLASSES[key] = source
    return source


_NO_VALUE = object()


def _literal(node: ast.expr) -> Any:
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO_VALUE


def _class_attribute(attr: str, value: ast.expr | None, attribute_map: dict[str, str],
                     sub_configs: dict[str, tuple[str, str]],
                     locate: Callable[[ast.expr], tuple[str, str] | None],
                     ) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """``attribute_map`` (literal) and ``sub_configs`` (key -> class name) as a class body declares them."""
    if value is None:
        return attribute_map, sub_configs
    if attr == "attribute_map":
        literal = _literal(value)
        if isinstance(literal, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in literal.items()):
            return literal, sub_configs
    if attr == "sub_configs" and isinstance(value, ast.Dict):
        found: dict[str, tuple[str, str]] = {}
        for k, v in zip(value.keys, value.values):
            where = locate(v)
            if isinstance(k, ast.Constant) and isinstance(k.value, str) and where is not None:
                found[k.value] = where
        return attribute_map, found
    return attribute_map, sub_configs


def _self_assignments(func: ast.AST) -> dict[str, int]:
    """attribute -> how many places ``func`` (a method or a statement) assigns or mutates ``self.<attribute>``.

    Mutation counts: ``self.layer_types[-1] = ...`` (Gemma4TextConfig) or
    ``self.layer_types.append(...)`` changes what a default or derivation gave.
    ``"*"``: a ``setattr`` with a computed name, which may assign anything.
    """
    sites: dict[str, int] = {}

    def add(attr: str) -> None:
        sites[attr] = sites.get(attr, 0) + 1

    for node in ast.walk(func):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and _dotted_tail(node.func) == "setattr" and len(node.args) >= 2:
            attr = node.args[1]
            add(attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str) else "*")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = _self_root(node.func.value)  # self.x.append(...), self.x[i].update(...)
            if owner is not None:
                add(owner)
        while targets:
            target = targets.pop()
            if isinstance(target, (ast.Tuple, ast.List)):
                targets.extend(target.elts)
            elif isinstance(target, ast.Starred):
                targets.append(target.value)
            elif (owner := _self_root(target)) is not None:
                add(owner)
    return sites


def _self_root(node: ast.expr) -> str | None:
    """``x`` for ``self.x``, ``self.x[i]``, ``self.x.y``: the attribute of self an expression reaches into."""
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr
        node = node.value
    return None


def _keyword_defaults(args: ast.arguments) -> dict[str, Any]:
    """``__init__``'s parameters -> literal default (``_NO_VALUE``: none, or not a literal)."""
    params: dict[str, Any] = {arg.arg: _NO_VALUE for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs)}
    params.pop("self", None)
    positional = [*args.posonlyargs, *args.args]
    for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
        params[arg.arg] = _literal(default)
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults):
        if kw_default is not None:
            params[arg.arg] = _literal(kw_default)
    return params


def _passed_through(func: ast.FunctionDef | ast.AsyncFunctionDef, params: dict[str, Any]) -> list[str]:
    return [stmt.targets[0].attr for stmt in func.body
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Attribute)
            and isinstance(stmt.targets[0].value, ast.Name) and stmt.targets[0].value.id == "self"
            and isinstance(stmt.value, ast.Name) and stmt.value.id == stmt.targets[0].attr and stmt.value.id in params]


def _rebound_names(func: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


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
        if value is not None and value is not _NO_VALUE:
            values[group[0]] = value
    return values


def _json_value(value: Any) -> Any:
    """``value`` as JSON holds it (tuples as lists), or ``_NO_VALUE`` when JSON cannot."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _NO_VALUE
    if isinstance(value, (list, tuple)):
        items = [_json_value(v) for v in value]
        return _NO_VALUE if any(v is _NO_VALUE for v in items) else items
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        entries = {k: _json_value(v) for k, v in value.items()}
        return _NO_VALUE if any(v is _NO_VALUE for v in entries.values()) else entries
    return _NO_VALUE


# ------------------------------------------------------ replicated derivations
#
# The one derivation edge replicates is the layer pattern: transformers 5.x
# classes write `if self.layer_types is None: self.layer_types = <expression>`
# in __post_init__ (4.x: in __init__), from the layer count and a pattern
# (Gemma3TextConfig: every sliding_window_pattern-th layer full, pattern from
# kwargs.get("sliding_window_pattern", 6)). Heads, KV heads and head_dim
# derivations (`num_key_value_heads = num_attention_heads`, `head_dim = hidden
# // heads`) are not replicated: the KV arithmetic applies the same rules to a
# field left unset. The guard's statements are evaluated over a whitelist --
# literals, the config's fields, kwargs.get/pop with literal defaults,
# arithmetic, comparisons, conditional expressions, bool/int/len/min/max/range,
# list literals and comprehensions, sizes bounded -- so nothing is executed;
# anything else, or a second place that assigns the field, leaves it unfilled.

#: Fields edge derives as the class's code would (see above).
DERIVED_FIELDS = ("layer_types",)
#: The longest list, string or range a derivation may build (layer counts are in the hundreds).
MAX_DERIVED_ITEMS = 1 << 16


class _Unevaluable(Exception):
    """The derivation uses code outside edge's whitelist; the field stays unfilled."""


_UNKNOWN = object()
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}
_CALLS: dict[str, Callable[..., Any]] = {"bool": bool, "int": int, "len": len, "min": min, "max": max, "abs": abs,
                                         "range": range, "list": list}


def derive_field(source: ConfigSource, name: str, text: dict[str, Any]) -> Any:
    """``name`` as the class's unset-guard derivation computes it from ``text``; None when edge cannot say.

    Exactly one ``if self.<name> is None:`` guard among the class's
    ``__init__`` / ``__post_init__`` bodies, and no other code assigning
    ``name``; the statements before it are followed as far as the whitelist
    reaches (anything they assign otherwise becomes unknown). A layer list
    must have one string per layer of the config.
    """
    guards = [(params, body, i) for params, body in source.bodies for i, stmt in enumerate(body)
              if _is_unset_guard(stmt, name)]
    if len(guards) != 1:
        return None
    params, body, index = guards[0]
    guard = body[index]
    assert isinstance(guard, ast.If)
    if source.assigned.get("*", 0) or source.assigned.get(name, 0) != _self_assignments(guard).get(name, 0):
        return None
    # Code outside the guard's body runs before it only through a call in the
    # body's prefix (followed as opaque); a guard in a base's body also runs
    # after the subclass's code, so what any other body assigns is unknown there.
    body_sites = _self_assignments(ast.Module(body=list(body), type_ignores=[]))
    unknowable = set(source.opaque)
    if guards[0][1] is not source.bodies[0][1]:
        unknowable |= {attr for attr, n in source.assigned.items() if n > body_sites.get(attr, 0)}
    scope = _Derivation(source, text, params, frozenset(unknowable))
    try:
        for stmt in body[:index]:
            scope.follow(stmt)
        for stmt in guard.body:
            scope.run(stmt)
        value = scope.env.get(f"self.{name}")
    except (_Unevaluable, TypeError, ValueError, ArithmeticError, LookupError, RecursionError, MemoryError):
        return None
    layers = next((text[n] for n in LAYER_COUNT_FIELDS if text.get(n) is not None), None)
    if name == "layer_types" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)
                                      and len(value) == layers):
        return None
    return value


def _is_unset_guard(stmt: ast.stmt, name: str) -> bool:
    test = stmt.test if isinstance(stmt, ast.If) else None
    return (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Is)
            and _is_self_attribute(test.left, name) and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None)


def _is_self_attribute(node: ast.expr, name: str | None = None) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and (name is None or node.attr == name))


class _Derivation:
    """The state a derivation reads: locals and ``self.<attr>`` assigned so far, the config, the class defaults."""

    def __init__(self, source: ConfigSource, text: dict[str, Any], params: dict[str, Any],
                 unknowable: frozenset[str]) -> None:
        self.source, self.text, self.unknowable = source, text, unknowable
        self.published = {source.attribute_map.get(k, k): v for k, v in text.items()}
        # 4.x __init__: a parameter holds the published value, else its literal default.
        self.env: dict[str, Any] = {p: text[p] if p in text else (_UNKNOWN if d is _NO_VALUE else d)
                                    for p, d in params.items()}
        self.declared = source.fields | set(params)

    def follow(self, stmt: ast.stmt) -> None:
        """A statement before the guard, followed as far as the whitelist reaches.

        A simple assignment is evaluated, an ``if`` whose test evaluates follows
        its branch (Exaone4: ``if self.sliding_window is None:
        self.sliding_window_pattern = 0``); anything else makes what it assigns unknown.
        """
        key = _assignment_key(stmt)
        if key is not None and isinstance(stmt, ast.Assign):
            try:
                self.env[key] = self.eval(stmt.value, {})
            except (_Unevaluable, TypeError, ValueError, ArithmeticError, LookupError):
                self.env[key] = _UNKNOWN
            return
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return
        if isinstance(stmt, ast.If):
            try:
                taken = self.eval(stmt.test, {})
            except (_Unevaluable, TypeError, ValueError, ArithmeticError, LookupError):
                taken = _UNKNOWN
            if taken is not _UNKNOWN:
                for inner in stmt.body if taken else stmt.orelse:
                    self.follow(inner)
                return
        # A call edge cannot follow (a method, super().__post_init__) may assign anything the class assigns.
        opaque = any(isinstance(node, ast.Call) and not self._whitelisted(node) for node in ast.walk(stmt))
        for attr in self.source.assigned if opaque else _self_assignments(stmt):
            self.env[f"self.{attr}"] = _UNKNOWN
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                self.env[node.id] = _UNKNOWN

    def run(self, stmt: ast.stmt) -> None:
        """A statement inside the guard: only simple assignments (and docstrings) are allowed."""
        key = _assignment_key(stmt)
        if key is not None and isinstance(stmt, ast.Assign):
            self.env[key] = self.eval(stmt.value, {})
        elif not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)):
            raise _Unevaluable(type(stmt).__name__)

    def self_value(self, attr: str) -> Any:
        """``self.<attr>`` at this point: as assigned before the guard, else published, else the literal default."""
        canonical = self.source.attribute_map.get(attr, attr)
        if attr in self.unknowable or canonical in self.unknowable:
            raise _Unevaluable(f"self.{attr}")
        for key in (f"self.{attr}", f"self.{canonical}"):
            if key in self.env:
                return self._known(self.env[key])
        if canonical in self.published:
            return self.published[canonical]
        if canonical not in self.source.defaults:
            raise _Unevaluable(f"self.{attr}")
        return self.source.defaults[canonical]

    def _whitelisted(self, node: ast.Call) -> bool:
        func = node.func
        if isinstance(func, ast.Name):
            return func.id in _CALLS
        return (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "kwargs"
                and func.attr in ("get", "pop"))

    @staticmethod
    def _known(value: Any) -> Any:
        if value is _UNKNOWN:
            raise _Unevaluable("a value the code before the guard computed")
        return value

    @staticmethod
    def _sized(value: Any) -> Any:
        if isinstance(value, (list, tuple, str, range)) and len(value) > MAX_DERIVED_ITEMS:
            raise _Unevaluable(f"a sequence longer than {MAX_DERIVED_ITEMS}")
        return value

    def eval(self, node: ast.expr, names: dict[str, Any]) -> Any:
        if isinstance(node, ast.Constant):
            if node.value is None or isinstance(node.value, (bool, int, float, str)):
                return node.value
        elif isinstance(node, ast.Name):
            if node.id in names:
                return names[node.id]
            if node.id in self.env:
                return self._known(self.env[node.id])
        elif isinstance(node, ast.Attribute) and _is_self_attribute(node):
            return self.self_value(node.attr)
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return self._binary(node, names)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
            value = self.eval(node.operand, names)
            if isinstance(node.op, ast.Not):
                return not value
            if not isinstance(value, (int, float)):
                raise _Unevaluable("a sign on a non-number")
            return -value if isinstance(node.op, ast.USub) else value
        elif isinstance(node, ast.BoolOp):
            result: Any = None
            for operand in node.values:
                result = self.eval(operand, names)
                if bool(result) == isinstance(node.op, ast.Or):
                    return result
            return result
        elif isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            left = self.eval(node.left, names)
            for op, comparator in zip(node.ops, node.comparators):
                right = self.eval(comparator, names)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        elif isinstance(node, ast.IfExp):
            return self.eval(node.body if self.eval(node.test, names) else node.orelse, names)
        elif isinstance(node, ast.Call) and self._whitelisted(node) and not node.keywords:
            return self._call(node, names)
        elif isinstance(node, (ast.List, ast.Tuple)) and not any(isinstance(e, ast.Starred) for e in node.elts):
            items = [self.eval(e, names) for e in node.elts]
            return items if isinstance(node, ast.List) else tuple(items)
        elif isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            container, index = self.eval(node.value, names), self.eval(node.slice, names)
            if isinstance(container, (list, tuple, dict, str)):
                return container[index]
        elif isinstance(node, ast.ListComp):
            out: list[Any] = []
            self._comprehend(node.elt, node.generators, names, out)
            return out
        raise _Unevaluable(type(node).__name__)

    def _binary(self, node: ast.BinOp, names: dict[str, Any]) -> Any:
        left, right = self.eval(node.left, names), self.eval(node.right, names)
        numbers = (int, float)
        if isinstance(left, numbers) and isinstance(right, numbers):
            return _BINARY[type(node.op)](left, right)
        if isinstance(node.op, ast.Add) and type(left) is type(right) and isinstance(left, (list, str)):
            return self._sized(left + right)
        if isinstance(node.op, ast.Mult) and isinstance(left, (list, str)) and type(right) is int:
            left, right = right, left
        if isinstance(node.op, ast.Mult) and type(left) is int and isinstance(right, (list, str)):
            if left * len(right) > MAX_DERIVED_ITEMS:
                raise _Unevaluable(f"a sequence longer than {MAX_DERIVED_ITEMS}")
            return left * right
        raise _Unevaluable(f"{type(node.op).__name__} on {type(left).__name__} and {type(right).__name__}")

    def _call(self, node: ast.Call, names: dict[str, Any]) -> Any:
        func = node.func
        if isinstance(func, ast.Attribute):  # kwargs.get / kwargs.pop: a published field the class does not declare
            if not 1 <= len(node.args) <= 2 or not isinstance(node.args[0], ast.Constant):
                raise _Unevaluable("kwargs lookup")
            key = node.args[0].value
            if isinstance(key, str) and key in self.text and key not in self.declared:
                return self.text[key]
            return self.eval(node.args[1], names) if len(node.args) == 2 else None
        assert isinstance(func, ast.Name)
        args = [self._sized(self.eval(arg, names)) for arg in node.args]
        if func.id == "range" and not all(type(a) is int for a in args):
            raise _Unevaluable("range over a non-integer")
        if func.id == "int" and not all(isinstance(a, (bool, int, float)) for a in args):
            raise _Unevaluable("int of a non-number")
        return self._sized(_CALLS[func.id](*args))

    def _comprehend(self, elt: ast.expr, generators: list[ast.comprehension], names: dict[str, Any],
                    out: list[Any]) -> None:
        if not generators:
            out.append(self.eval(elt, names))
            if len(out) > MAX_DERIVED_ITEMS:
                raise _Unevaluable(f"a list longer than {MAX_DERIVED_ITEMS}")
            return
        first = generators[0]
        if first.is_async or not isinstance(first.target, ast.Name):
            raise _Unevaluable("comprehension target")
        iterable = self._sized(self.eval(first.iter, names))
        if not isinstance(iterable, (list, tuple, range, str)):
            raise _Unevaluable("iteration over a non-sequence")
        for item in iterable:
            scope = {**names, first.target.id: item}
            if all(self.eval(condition, scope) for condition in first.ifs):
                self._comprehend(elt, generators[1:], scope, out)


def _assignment_key(stmt: ast.stmt) -> str | None:
    """``"name"`` or ``"self.attr"`` for a one-target assignment, else None."""
    if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
        return None
    target = stmt.targets[0]
    if isinstance(target, ast.Name):
        return target.id
    return f"self.{target.attr}" if _is_self_attribute(target) and isinstance(target, ast.Attribute) else None
