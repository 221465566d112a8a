"""Which tables does the installed vLLM's CPU source hold? One ``ast`` reader per table, and the parse of them all.

Which ``quant_method`` values vLLM registers, the CPU platform's own list, the
CPU kernels each linear-layer family tries in order and the host features
their ``is_supported`` probes (AMX, AMX-FP8), the weight types the CPU
mixed-precision path accepts, GPTQ's and AWQ's type maps, whether GPTQ's
``desc_act`` is rejected, the CPU MXFP4 MoE backend, and the model registry
(:data:`SOURCES` names each file and symbol). A piece that cannot be read is
reported in :attr:`VllmSource.unread` and left None. Found and cached by
:mod:`._vllm_support`.
"""

from __future__ import annotations

import ast
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge_core.kit.vllm_source import (
    MODEL_REGISTRY,
    MULTIMODAL_TABLE,
    SourceTree,
    Unreadable,
    assigned,
    class_def,
    dotted_module,
    find_class,
    function_def,
    imported_from,
    name_of,
    read_model_registry,
)

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

#: Calls inside a kernel's ``is_supported`` / ``can_implement`` that test the host, and the
#: ``/proc/cpuinfo`` flag (or feature) each stands for. ``torch.cpu._is_amx_tile_supported``
#: is the AMX tile check; ``ops.cpu_has_amx_fp8`` the AMX-FP8 one (Diamond Rapids);
#: ``is_zen_cpu`` gates the zentorch kernels, which also need vLLM's optional ``zen`` extra.
HOST_PROBES = {"_is_amx_tile_supported": "amx_tile", "cpu_has_amx_fp8": "amx_fp8", "is_zen_cpu": "zen"}
#: Methods of a kernel class whose host probes decide whether it is chosen.
_PROBED_METHODS = ("is_supported", "can_implement", "_supports_current_device")


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


def parse_all(root: Path, distribution: str | None, version: str | None) -> VllmSource:
    """Every table of the vLLM package at ``root``; a piece that cannot be read is named in ``unread``."""
    tree = SourceTree(root)
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
        except Unreadable as exc:
            unread[piece] = f"{exc} (wanted: {SOURCES[piece][1]})"
        except Exception as exc:  # noqa: BLE001 — a shape no rule above foresaw: unread, never a crash
            unread[piece] = f"{SOURCES[piece][0]}: unexpected shape ({type(exc).__name__}: {exc})"
    try:
        models, problems, previously, oot = read_model_registry(tree)
        values.update(models=models, previously_supported=previously, out_of_tree=oot)
        unread.update(problems)
    except Unreadable as exc:
        unread["models"] = f"{exc} (wanted: {SOURCES['models'][1]})"
    except Exception as exc:  # noqa: BLE001 — as above
        unread["models"] = f"{MODEL_REGISTRY}: unexpected shape ({type(exc).__name__}: {exc})"
    return VllmSource(distribution, version, str(root), unread=unread, files=tuple(tree.files), **values)


def _strings(node: ast.AST | None, where: str) -> list[str]:
    items = node.elts if isinstance(node, (ast.List, ast.Tuple, ast.Set)) else [node]
    out = []
    for item in items:
        if not (isinstance(item, ast.Constant) and isinstance(item.value, str)):
            raise Unreadable(f"{where}: holds something other than string constants")
        out.append(item.value)
    return out


def _scalar_type(node: ast.AST, where: str) -> str:
    # vLLM names weight types as attributes of vllm.scalar_type.scalar_types (uint4b8, uint4, ...).
    if isinstance(node, ast.Attribute) and name_of(node.value) == "scalar_types":
        return node.attr
    raise Unreadable(f"{where}: a weight type is not a scalar_types.<name> attribute")


def _scalar_types(node: ast.AST | None, where: str) -> tuple[str, ...]:
    if not isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        raise Unreadable(f"{where}: is not a list of scalar_types")
    return tuple(_scalar_type(e, where) for e in node.elts)


def _quant_methods(tree: SourceTree) -> tuple[str, ...]:
    module = tree.module(QUANT_REGISTRY)
    literal = assigned(module.body, "QuantizationMethods")
    if not (isinstance(literal, ast.Subscript) and name_of(literal.value) == "Literal"):
        raise Unreadable(f"{QUANT_REGISTRY}: QuantizationMethods is not a Literal[...] of method names")
    names = set(_strings(literal.slice, f"{QUANT_REGISTRY}: QuantizationMethods"))
    # get_quantization_config's method_to_config also maps checkpoint names ("mxfp8") that the Literal lacks.
    getter = function_def(module, "get_quantization_config")
    for node in ast.walk(getter) if getter is not None else ():
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(name_of(t) == "method_to_config" for t in targets) and isinstance(node.value, ast.Dict):
                names.update(k.value for k in node.value.keys
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
    if not names:
        raise Unreadable(f"{QUANT_REGISTRY}: QuantizationMethods names no method")
    return tuple(sorted(names))


def _platform_quantization(tree: SourceTree) -> tuple[str, ...]:
    module = tree.module(CPU_PLATFORM)
    platform = next((n for n in module.body if isinstance(n, ast.ClassDef)
                     and any(name_of(b) == "Platform" for b in n.bases)), None)
    if platform is None:
        raise Unreadable(f"{CPU_PLATFORM}: no class derived from Platform")
    value = assigned(platform.body, "supported_quantization")
    # Absent: the Platform default [], which verify_quantization reads as "no restriction".
    return () if value is None else tuple(_strings(value, f"{CPU_PLATFORM}: {platform.name}.supported_quantization"))


def _requirements(tree: SourceTree, dotted: str, module: ast.Module, cls: ast.ClassDef, hops: int = 3) -> set[str]:
    """Host features the class's probed methods test, following base classes for methods it inherits."""
    found: set[str] = set()
    have = set()
    for item in cls.body:
        if isinstance(item, ast.FunctionDef) and item.name in _PROBED_METHODS:
            have.add(item.name)
            for node in ast.walk(item):
                if isinstance(node, ast.Call) and name_of(node.func) in HOST_PROBES:
                    found.add(HOST_PROBES[str(name_of(node.func))])
                if isinstance(node, ast.Attribute) and node.attr == "X86" and name_of(node.value) == "CpuArchEnum":
                    found.add("x86")
    if hops > 0 and set(_PROBED_METHODS) - have:
        imports = imported_from(module, dotted)
        for base in cls.bases:
            base_name = name_of(base)
            if base_name is None:
                continue
            local = class_def(module, base_name)
            try:
                if local is not None:
                    found |= _requirements(tree, dotted, module, local, hops - 1)
                elif imports.get(base_name, "").startswith("vllm."):
                    where, base_module, base_cls = find_class(tree, imports[base_name], base_name)
                    found |= _requirements(tree, where, base_module, base_cls, hops - 1)
            except Unreadable:
                continue  # a base outside the files we can read (MPLinearKernel, ...) probes nothing of the host
    return found


def _resolve(tree: SourceTree, dotted: str, module: ast.Module, cls: ast.ClassDef, node: ast.AST) -> ast.AST | None:
    """The literal a name in a kernel class refers to: a class attribute, a module constant, or an import."""
    if isinstance(node, ast.Attribute) and name_of(node.value) in ("cls", "self", cls.name):
        return assigned(cls.body, node.attr)
    if isinstance(node, ast.Name):
        local = assigned(module.body, node.id)
        if local is not None:
            return local
        source = imported_from(module, dotted).get(node.id)
        if source and source.startswith("vllm."):
            return assigned(tree.module(tree.module_file(source)).body, node.id)
    return None


def _accepted_types(tree: SourceTree, dotted: str, module: ast.Module, cls: ast.ClassDef) -> tuple[str, ...] | None:
    """The weight types ``can_implement`` checks ``c.weight_type not in <types>`` against, if it does."""
    method = next((m for m in cls.body if isinstance(m, ast.FunctionDef) and m.name == "can_implement"), None)
    for node in ast.walk(method) if method is not None else ():
        if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute)
                and node.left.attr == "weight_type" and isinstance(node.ops[0], ast.NotIn)):
            literal = _resolve(tree, dotted, module, cls, node.comparators[0])
            return _scalar_types(literal, f"{tree.module_file(dotted)}: {cls.name}.can_implement weight types")
    return None


def _kernel(tree: SourceTree, name: str, dotted: str | None) -> Kernel:
    if not dotted or not dotted.startswith("vllm."):
        raise Unreadable(f"{LINEAR_KERNELS}: kernel {name} is not imported from a vllm module")
    where, module, cls = find_class(tree, dotted, name)
    return Kernel(name, where, tuple(sorted(_requirements(tree, where, module, cls))),
                  _accepted_types(tree, where, module, cls))


def _cpu_kernels(tree: SourceTree) -> dict[str, tuple[Kernel, ...]]:
    module = tree.module(LINEAR_KERNELS)
    imports = imported_from(module, dotted_module(LINEAR_KERNELS), is_package=LINEAR_KERNELS.endswith("__init__.py"))
    tables: dict[str, tuple[Kernel, ...]] = {}
    for stmt in module.body:
        target = stmt.targets[0] if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else (
            stmt.target if isinstance(stmt, ast.AnnAssign) else None)
        if not (isinstance(target, ast.Name) and target.id.startswith("_POSSIBLE_")
                and isinstance(stmt.value, ast.Dict)):
            continue
        cpu = next((v for k, v in zip(stmt.value.keys, stmt.value.values)
                    if isinstance(k, ast.Attribute) and k.attr == "CPU" and name_of(k.value) == "PlatformEnum"), None)
        if cpu is None:
            tables[target.id] = ()  # the table lists no CPU kernel at all
            continue
        if not isinstance(cpu, ast.List):
            raise Unreadable(f"{LINEAR_KERNELS}: {target.id}[PlatformEnum.CPU] is not a list of kernel classes")
        names = [name_of(e) for e in cpu.elts]
        if any(n is None for n in names):
            raise Unreadable(f"{LINEAR_KERNELS}: {target.id}[PlatformEnum.CPU] holds something other than names")
        tables[target.id] = tuple(_kernel(tree, str(n), imports.get(str(n))) for n in names)
    if not tables:
        raise Unreadable(f"{LINEAR_KERNELS}: no _POSSIBLE_*_KERNELS table")
    return tables


def _cpu_marlin_types(tree: SourceTree) -> dict[str, tuple[str, ...]]:
    # GPTQ's linear method calls verify_marlin_supported on every platform; on the CPU that
    # asks _query_cpu_marlin_supported_quant_types: `if has_zp: return [...]` else `res = [...]`.
    fn = function_def(tree.module(MARLIN_UTILS), "_query_cpu_marlin_supported_quant_types")
    where = f"{MARLIN_UTILS}: _query_cpu_marlin_supported_quant_types"
    if fn is None:
        raise Unreadable(f"{MARLIN_UTILS}: no function _query_cpu_marlin_supported_quant_types")
    for node in ast.walk(fn):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "has_zp":
            zp = next((s.value for s in node.body if isinstance(s, ast.Return)), None)
            no_zp = assigned(node.orelse, "res") or next(
                (s.value for s in node.orelse if isinstance(s, ast.Return)), None)
            return {"zp": _scalar_types(zp, where), "no_zp": _scalar_types(no_zp, where)}
    raise Unreadable(f"{where}: no `if has_zp:` branch")


def _type_map(tree: SourceTree, rel: str, owner: str | None, name: str) -> ast.Dict:
    module = tree.module(rel)
    body = module.body
    if owner is not None:
        cls = class_def(module, owner)
        if cls is None:
            raise Unreadable(f"{rel}: no class {owner}")
        body = cls.body
    value = assigned(body, name)
    if not isinstance(value, ast.Dict):
        raise Unreadable(f"{rel}: {owner + '.' if owner else ''}{name} is not a dict literal")
    return value


def _int_constant(node: ast.AST | None, where: str) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    raise Unreadable(f"{where}: a key is not an integer constant")


def _gptq_types(tree: SourceTree) -> dict[str, str]:
    where = f"{GPTQ_CONFIG}: AutoGPTQConfig.TYPE_MAP"
    out = {}
    mapping = _type_map(tree, GPTQ_CONFIG, "AutoGPTQConfig", "TYPE_MAP")
    for key, value in zip(mapping.keys, mapping.values):
        if not (isinstance(key, ast.Tuple) and len(key.elts) == 2 and isinstance(key.elts[1], ast.Constant)
                and isinstance(key.elts[1].value, bool)):
            raise Unreadable(f"{where}: a key is not (bits, sym)")
        bits = _int_constant(key.elts[0], where)
        out[f"{bits}:{'sym' if key.elts[1].value else 'asym'}"] = _scalar_type(value, where)
    return out


def _awq_types(tree: SourceTree) -> dict[str, str]:
    where = f"{AWQ_CONFIG}: AutoAWQConfig.TYPE_MAP"
    mapping = _type_map(tree, AWQ_CONFIG, "AutoAWQConfig", "TYPE_MAP")
    return {str(_int_constant(k, where)): _scalar_type(v, where) for k, v in zip(mapping.keys, mapping.values)}


def _ct_wna16_types(tree: SourceTree) -> dict[str, str]:
    out = {}
    for name, kind in (("WNA16_SUPPORTED_TYPES_MAP", "sym"), ("WNA16_ZP_SUPPORTED_TYPES_MAP", "asym")):
        where = f"{CT_WNA16}: {name}"
        mapping = _type_map(tree, CT_WNA16, None, name)
        out.update({f"{_int_constant(k, where)}:{kind}": _scalar_type(v, where)
                    for k, v in zip(mapping.keys, mapping.values)})
    return out


def _gptq_desc_act(tree: SourceTree) -> dict[str, bool]:
    # The function reads `if desc_act and group_size == -1: desc_act = False` (a no-op per channel),
    # then `if desc_act: raise ValueError("... is no longer supported ...")`.
    fn = function_def(tree.module(GPTQ_UTILS), "normalize_and_validate_gptq_desc_act")
    if fn is None:
        raise Unreadable(f"{GPTQ_UTILS}: no function normalize_and_validate_gptq_desc_act")
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


def _mxfp4_moe(tree: SourceTree) -> Kernel | None:
    # fused_moe/oracle/mxfp4.py: `elif backend == Mxfp4MoeBackend.CPU:
    #     from ...experts.cpu_moe import CPUExpertsMxfp4; return [CPUExpertsMxfp4]` (other CPU
    # branches import weight-preparation helpers, which return no list of classes).
    module = tree.module(MXFP4_MOE_ORACLE)
    for node in ast.walk(module):
        if not (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                and any(isinstance(c, ast.Attribute) and c.attr == "CPU" and name_of(c.value) == "Mxfp4MoeBackend"
                        for c in node.test.comparators)):
            continue
        imported = {alias.asname or alias.name: stmt.module for stmt in node.body
                    if isinstance(stmt, ast.ImportFrom) and stmt.module for alias in stmt.names}
        returned = [name_of(e) for stmt in node.body if isinstance(stmt, ast.Return)
                    and isinstance(stmt.value, ast.List) for e in stmt.value.elts]
        for name in returned:
            if name in imported:
                return _kernel(tree, name, imported[name])
    return None
