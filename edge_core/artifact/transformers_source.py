"""Where the installed transformers is, and which configuration class a ``model_type`` names.

Found as ``AutoConfig`` finds it (``CONFIG_MAPPING_NAMES`` and
``model_type_to_module_name`` in ``models/auto/configuration_auto.py``; a
wrapper's ``sub_configs`` when the text config names no model_type), with
every file read by :class:`~edge_core.services.source_tree.SourceTree`: located and
parsed, never imported.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import os
import re
from typing import Any

from ..services.source_tree import SourceTree
from .config_class import ConfigSource, NotReadable, class_source, dotted_tail, import_target

_VERSION_LINE = re.compile(r"""^__version__\s*=\s*(["'])([^"'\n]+)\1""", re.MULTILINE)
#: configuration_auto's mapping from model_type to class name, and where it lives.
AUTO_CONFIG_SOURCE = "models/auto/configuration_auto.py"
_AUTO_NAMES = ("CONFIG_MAPPING_NAMES", "SPECIAL_MODEL_TYPE_TO_MODULE_NAME", "DEPRECATED_MODELS")

#: Auto mappings per (package, version) and classes per model_type: a process
#: reads each source once. No disk cache: a class costs tens of milliseconds to
#: read (docs/benchmarks.md#reading-transformers-configuration-source), and a
#: cache file would need invalidating on every in-place upgrade.
_MAPPINGS: dict[tuple[str, str | None], dict[str, Any]] = {}
_BY_MODEL_TYPE: dict[tuple[str, str | None, str], ConfigSource | str] = {}


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


def transformers_version(package: str) -> str:
    """``transformers.__version__`` as its ``__init__.py`` writes it (read, not imported)."""
    with open(os.path.join(package, "__init__.py"), encoding="utf-8") as f:
        found = _VERSION_LINE.search(f.read())
    if found is None:
        raise NotReadable(f"{package}/__init__.py states no __version__")
    return found.group(2)


def text_config_source(reader: SourceTree, text: dict[str, Any], raw: dict[str, Any],
                       text_key: str | None) -> ConfigSource:
    """The configuration class of the text config: its own model_type's, else the wrapper's sub-config's."""
    model_type = text.get("model_type")
    if isinstance(model_type, str):
        return _model_type_source(reader, model_type)
    wrapper_type = raw.get("model_type")
    if text_key is None or not isinstance(wrapper_type, str):
        raise NotReadable("the config names no model_type")
    wrapper = _model_type_source(reader, wrapper_type)
    where = wrapper.sub_configs.get(text_key)
    if where is None:
        raise NotReadable(f"transformers {reader.version} {wrapper.name} names no class for its {text_key}")
    return class_source(reader, *where)


def _model_type_source(reader: SourceTree, model_type: str) -> ConfigSource:
    key = (str(reader.root), reader.version, model_type)
    if key not in _BY_MODEL_TYPE:
        try:
            _BY_MODEL_TYPE[key] = class_source(reader, *_config_module(reader, model_type))
        except NotReadable as why:
            _BY_MODEL_TYPE[key] = str(why)
    found = _BY_MODEL_TYPE[key]
    if isinstance(found, str):
        raise NotReadable(found)
    return found


def _config_module(reader: SourceTree, model_type: str) -> tuple[str, str]:
    """(file, class name) of ``model_type``'s configuration class, as ``AutoConfig`` resolves it."""
    key = (str(reader.root), reader.version)
    if key not in _MAPPINGS:
        _MAPPINGS[key] = _module_constants(reader, AUTO_CONFIG_SOURCE, _AUTO_NAMES)
    mapping = _MAPPINGS[key]
    names, special = mapping.get("CONFIG_MAPPING_NAMES"), mapping.get("SPECIAL_MODEL_TYPE_TO_MODULE_NAME", {})
    deprecated = mapping.get("DEPRECATED_MODELS", [])
    if not isinstance(names, dict) or not isinstance(special, dict) or not isinstance(deprecated, list):
        raise NotReadable(f"transformers {reader.version}'s {AUTO_CONFIG_SOURCE} has no CONFIG_MAPPING_NAMES "
                           "edge can read")
    class_name = names.get(model_type)
    if not isinstance(class_name, str):
        raise NotReadable(f"transformers {reader.version} has no configuration class for model_type {model_type!r}")
    # configuration_auto.model_type_to_module_name, replicated.
    module = special[model_type] if model_type in special else model_type.replace("-", "_")
    if module in deprecated:
        module = f"deprecated.{module}"
    if not isinstance(module, str) or not re.fullmatch(r"\w+(\.\w+)?", module, re.ASCII):
        raise NotReadable(f"transformers {reader.version} maps model_type {model_type!r} to module {module!r}")
    leaf = module.rsplit(".", 1)[-1]
    return f"models/{module.replace('.', '/')}/configuration_{leaf}.py", class_name


def _module_constants(reader: SourceTree, rel: str, names: tuple[str, ...], depth: int = 0) -> dict[str, Any]:
    """The module-level values ``rel`` gives ``names``, as far as literals say.

    Handled: a literal, ``OrderedDict(...)`` / ``dict(...)`` of literals and
    ``**`` of names already read, ``NAME.update(<literal>)``, and names imported
    from a sibling module (5.x keeps the mapping in a generated
    ``auto_mappings.py``). Any other assignment forgets the name.
    """
    env: dict[str, Any] = {}
    for stmt in reader.module(rel).body:
        if isinstance(stmt, ast.ImportFrom) and stmt.level and depth < 2:
            wanted = [alias for alias in stmt.names if (alias.asname or alias.name) in names]
            target = import_target(reader, rel, stmt) if wanted else None
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
    if isinstance(node, ast.Call) and dotted_tail(node.func) in ("OrderedDict", "dict"):
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
