"""What the installed vLLM CUDA build executes on which GPU: read from its files, never imported.

The quantization gates rest on vLLM's own numbers (:data:`SOURCES`): each
scheme's ``get_min_capability()`` (the native W8A8 schemes for int8 and fp8,
WNA16, AutoGPTQ, AutoAWQ, MXFP4), the Marlin floor the 4-bit formats run
through (``query_marlin_supported_quant_types``), the CUDA int8 kernels in the
order vLLM tries them, and the SM ceiling of the CUTLASS int8 path, which lives
only in the CUDA build's compiled extension: its ``dispatch_scaled_mm`` raises
"Int8 not supported on SM<n>. Use FP8 quantization instead, or run on older
arch (SM < 100)." and that sentence is read out of the ``.so``.

The parsing is :mod:`edge_core.kit.vllm_source`'s (its ``ast`` helpers and disk
cache): one JSON file per installed vLLM under ``~/.cache/edge``, invalidated
when a file it was read from changes. A piece that cannot be read is in
``unread`` with the file and symbol, and the gate falls back to the hand-kept
rule in :mod:`._capability` for it (and says so in the plan's debug log).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from edge_core.kit.vllm_source import (
    SourceTree,
    Unreadable,
    assigned,
    cache_file,
    class_def,
    default_cache_dir,
    files_unchanged,
    function_def,
    installed_vllm,
    name_of,
    write_json,
)

_SCHEMES = "model_executor/layers/quantization/compressed_tensors/schemes/"
#: edge format -> (file, class whose ``get_min_capability()`` vLLM checks when it loads that format).
#: fp8 counts the native W8A8 scheme: below SM 8.9 vLLM runs fp8 checkpoints weight-only through Marlin,
#: which edge does not plan as fp8 (docs/vllm-cuda-facts.md, 'The hand-kept format rules').
MIN_CAPABILITY_SOURCES = {
    "compressed-tensors:int8": (_SCHEMES + "compressed_tensors_w8a8_int8.py", "CompressedTensorsW8A8Int8"),
    "compressed-tensors:fp8": (_SCHEMES + "compressed_tensors_w8a8_fp8.py", "CompressedTensorsW8A8Fp8"),
    "fp8": (_SCHEMES + "compressed_tensors_w8a8_fp8.py", "CompressedTensorsW8A8Fp8"),
    "compressed-tensors:w4a16": (_SCHEMES + "compressed_tensors_wNa16.py", "CompressedTensorsWNA16"),
    "gptq": ("model_executor/layers/quantization/auto_gptq.py", "AutoGPTQConfig"),
    "awq": ("model_executor/layers/quantization/auto_awq.py", "AutoAWQConfig"),
    "mxfp4": ("model_executor/layers/quantization/mxfp4.py", "Mxfp4Config"),
}
#: The 4-bit formats run through Marlin: vLLM's type query returns nothing below its floor.
MARLIN_FORMATS = ("compressed-tensors:w4a16", "gptq", "awq")
MARLIN_UTILS = "model_executor/layers/quantization/utils/marlin_utils.py"
MARLIN_QUERY = "query_marlin_supported_quant_types"
LINEAR_KERNELS = "model_executor/kernels/linear/__init__.py"
INT8_TABLE = "_POSSIBLE_INT8_KERNELS"
#: The int8 kernel whose compiled dispatch has the SM ceiling.
CUTLASS_INT8 = "CutlassInt8ScaledMMLinearKernel"
#: The compiled extension that holds vLLM's CUTLASS scaled_mm dispatch (the CUDA build only).
EXTENSION = "_C_stable_libtorch.abi3.so"
#: The tail of that message (the compiler keeps "Int8 not supported on SM" as a separate string).
CEILING_MESSAGE = re.compile(rb"Use FP8 quantization instead, or run on older arch \(SM < (\d+)\)")
#: The extension is read in pieces this large (overlapping by the message's length).
CHUNK_BYTES = 8 << 20
MAX_EXTENSION_BYTES = 1 << 30

SOURCES = {
    "min_capability": ("model_executor/layers/quantization/...", "each scheme's get_min_capability()"),
    "marlin_floor": (MARLIN_UTILS, f"{MARLIN_QUERY}: the `if device_capability < N: return []`"),
    "int8_kernels": (LINEAR_KERNELS, f"{INT8_TABLE}[PlatformEnum.CUDA]"),
    "int8_ceiling": (EXTENSION, "dispatch_scaled_mm's 'run on older arch (SM < N)'"),
}
CACHE_SCHEMA = 1


@dataclass(frozen=True)
class CudaSupport:
    """vLLM CUDA's own numbers for the format gates; a piece is None when it could not be read."""

    distribution: str | None
    version: str | None
    root: str | None
    unread: dict[str, str] = field(default_factory=dict)
    #: format -> the SM number (``major * 10 + minor``) its scheme asks for.
    min_capability: dict[str, int] | None = None
    #: Below this SM Marlin supports no weight type.
    marlin_floor: int | None = None
    #: The CUDA int8 kernels, in the order vLLM tries them.
    int8_kernels: tuple[str, ...] | None = None
    #: SM numbers at or above this have no CUTLASS int8 kernel (None: no CUDA build here to read it from).
    int8_ceiling: int | None = None
    files: tuple[tuple[str, int, int], ...] = ()

    @property
    def label(self) -> str:
        return f"{self.distribution or 'vllm'} {self.version or '(version unknown)'}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CudaSupport:
        mins = data["min_capability"]
        kernels = data["int8_kernels"]
        found = cls(
            distribution=data["distribution"], version=data["version"], root=data["root"],
            unread={str(k): str(v) for k, v in data["unread"].items()},
            min_capability=None if mins is None else {str(k): int(v) for k, v in mins.items()},
            marlin_floor=None if data["marlin_floor"] is None else int(data["marlin_floor"]),
            int8_kernels=None if kernels is None else tuple(str(k) for k in kernels),
            int8_ceiling=None if data["int8_ceiling"] is None else int(data["int8_ceiling"]),
            files=tuple((str(p), int(s), int(m)) for p, s, m in data["files"]),
        )
        return found


_MEMO: dict[tuple[str, str | None], CudaSupport] = {}
_LOCK = threading.Lock()


def installed_support(cache_dir: Path | None = None) -> CudaSupport:
    """The numbers of the vLLM installed here (memoised, and cached on disk per version)."""
    distribution, version, root = installed_vllm()
    if root is None:
        return CudaSupport(distribution, version, None,
                           unread={piece: "vLLM is not installed in this interpreter" for piece in SOURCES})
    key = (str(root), version)
    with _LOCK:
        cached = _MEMO.get(key)
    if cached is not None:
        return cached
    found = read_support(root, distribution=distribution, version=version,
                         cache_dir=default_cache_dir() if cache_dir is None else cache_dir)
    with _LOCK:
        _MEMO[key] = found
    return found


def _reader_digest() -> str:
    from edge_core.kit import vllm_source

    digest = hashlib.sha256()
    try:
        for path in (__file__, vllm_source.__file__):
            digest.update(Path(path).read_bytes())
    except OSError:
        return "unknown"
    return digest.hexdigest()[:16]


def read_support(root: Path | str, *, distribution: str | None = None, version: str | None = None,
                 cache_dir: Path | None = None) -> CudaSupport:
    """Read the vLLM package at ``root`` (through a cache file under ``cache_dir`` when given). Never raises."""
    root = Path(root)
    key = {"schema": CACHE_SCHEMA, "reader": _reader_digest(), "root": str(root),
           "distribution": distribution, "version": version}
    path = cache_file(cache_dir, "vllm-cuda-support", root, distribution, version) if cache_dir else None
    if path is not None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("key") == key:
                found = CudaSupport.from_json(data["support"])
                if files_unchanged(root, found.files):
                    return found
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    found = _read_all(root, distribution, version)
    if path is not None and found.files:
        write_json(path, {"key": key, "support": found.to_json()})
    return found


def _read_all(root: Path, distribution: str | None, version: str | None) -> CudaSupport:
    tree = SourceTree(root)
    values: dict[str, Any] = {}
    unread: dict[str, str] = {}
    readers = {"min_capability": _min_capabilities, "marlin_floor": _marlin_floor, "int8_kernels": _int8_kernels}
    for piece, reader in readers.items():
        try:
            values[piece] = reader(tree)
        except Unreadable as exc:
            unread[piece] = f"{exc} (wanted: {SOURCES[piece][1]})"
        except Exception as exc:  # noqa: BLE001 — a shape no rule foresaw: unread, never a crash
            unread[piece] = f"{SOURCES[piece][0]}: unexpected shape ({type(exc).__name__}: {exc})"
    files = list(tree.files)
    try:
        values["int8_ceiling"], stat = _int8_ceiling(root)
        files.append(stat)
    except Unreadable as exc:
        unread["int8_ceiling"] = str(exc)
    return CudaSupport(distribution, version, str(root), unread=unread, files=tuple(files), **values)


def _returned_int(function: ast.FunctionDef | ast.AsyncFunctionDef, where: str) -> int:
    returns = [n for n in ast.walk(function) if isinstance(n, ast.Return)]
    if len(returns) != 1 or not isinstance(returns[0].value, ast.Constant) or type(returns[0].value.value) is not int:
        raise Unreadable(f"{where}: does not return one integer constant")
    return returns[0].value.value


def _min_capabilities(tree: SourceTree) -> dict[str, int]:
    out: dict[str, int] = {}
    for fmt, (rel, cls_name) in MIN_CAPABILITY_SOURCES.items():
        cls = class_def(tree.module(rel), cls_name)
        method = next((n for n in (cls.body if cls else ()) if isinstance(n, ast.FunctionDef)
                       and n.name == "get_min_capability"), None)
        if method is None:
            raise Unreadable(f"{rel}: {cls_name} has no get_min_capability")
        out[fmt] = _returned_int(method, f"{rel}: {cls_name}.get_min_capability")
    return out


def _marlin_floor(tree: SourceTree) -> int:
    function = function_def(tree.module(MARLIN_UTILS), MARLIN_QUERY)
    for node in ast.walk(function) if function is not None else ():
        if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1
                and isinstance(node.test.ops[0], ast.Lt) and name_of(node.test.left) == "device_capability"
                and isinstance(node.test.comparators[0], ast.Constant)
                and any(isinstance(s, ast.Return) and isinstance(s.value, ast.List) and not s.value.elts
                        for s in node.body)):
            return int(node.test.comparators[0].value)
    raise Unreadable(f"{MARLIN_UTILS}: {MARLIN_QUERY} has no `if device_capability < N: return []`")


def _int8_kernels(tree: SourceTree) -> tuple[str, ...]:
    table = assigned(tree.module(LINEAR_KERNELS).body, INT8_TABLE)
    if not isinstance(table, ast.Dict):
        raise Unreadable(f"{LINEAR_KERNELS}: {INT8_TABLE} is not a dict literal")
    for k, v in zip(table.keys, table.values):
        if isinstance(k, ast.Attribute) and k.attr == "CUDA" and isinstance(v, ast.List):
            names = tuple(n for n in (name_of(e) for e in v.elts) if n)
            if names:
                return names
    raise Unreadable(f"{LINEAR_KERNELS}: {INT8_TABLE} has no PlatformEnum.CUDA list of kernel classes")


def _int8_ceiling(root: Path) -> tuple[int, tuple[str, int, int]]:
    path = root / EXTENSION
    try:
        st = path.stat()
        if st.st_size > MAX_EXTENSION_BYTES:
            raise Unreadable(f"{EXTENSION}: {st.st_size} bytes is not vLLM's extension")
        with path.open("rb") as f:
            tail = b""
            while chunk := f.read(CHUNK_BYTES):
                found = CEILING_MESSAGE.search(tail + chunk)
                if found:
                    return int(found.group(1)), (EXTENSION, st.st_size, st.st_mtime_ns)
                tail = chunk[-512:]
    except OSError as exc:
        raise Unreadable(f"{EXTENSION}: not in this vLLM ({exc.strerror or exc}; a CUDA build ships it)") from None
    raise Unreadable(f"{EXTENSION}: holds no 'run on older arch (SM < N)' message")
