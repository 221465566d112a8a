"""`edge import`: a GGUF file becomes a safetensors checkpoint vLLM loads, written whole or not at all.

The conversion is planned from the header alone
(:func:`edge_core.artifact.gguf_map.plan_conversion`: config, names, shapes,
refusals), then the bytes move one tensor at a time, in row chunks, so the
importer holds one chunk and never the model: each tensor's blocks are
dequantized by gguf-py (llama.cpp's own Python package), q/k rows un-permuted
for the Llama family, rounded to the output dtype (round to nearest even, as
torch rounds) and streamed into safetensors shards. The tokenizer and its chat
template come from transformers' GGUF reader. Everything is written into a
hidden folder beside the output and renamed at the end: a failure or Ctrl-C
leaves nothing half-written. numpy, gguf and transformers are imported when
an import runs, never by the planner.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..artifact.gguf import GGML_TYPES, read_gguf_header
from ..artifact.gguf_map import W4_GROUP, Conversion, TensorMove, llama3_rope_scaling, plan_conversion
from ..errors import ArtifactError, UsageError

if TYPE_CHECKING:
    import numpy as np

    from .session import Observer

#: Largest safetensors shard written (vLLM and transformers read any number; 2 GiB keeps each file
#: comfortably under filesystems' and tools' 4 GiB limits).
SHARD_BYTES = 2 << 30
#: Float32 bytes dequantized at once: bounds the importer's memory whatever the model's size.
CHUNK_BYTES = 64 << 20
#: GGUF tensor types that are floats already (read, not dequantized).
FLOAT_TYPES = ("F32", "F16", "BF16")
#: Written beside the checkpoint: where it came from and how (read by `edge import` on a second run, by people).
PROVENANCE = "edge-import.json"
#: Free space kept beyond the checkpoint's bytes when checking the disk (config, tokenizer, filesystem slack).
DISK_SLACK_BYTES = 64 << 20


@dataclass(frozen=True)
class ImportResult:
    """What one import wrote."""

    source: str
    out: str
    dtype: str
    bits: int
    weight_bytes: int
    files: tuple[str, ...]
    tensors: int
    source_types: dict[str, int]
    rope_scaling: dict[str, Any] | None
    seconds: float

    def _method(self, name: str) -> str:
        if self.bits == 4 and name in ("Q4_0", "Q4_1"):
            return ("linear layers: the file's own 4-bit values and scales kept"
                    + (" (zero point 8: exact)" if name == "Q4_0" else ", each block's minimum rounded to a whole "
                       "zero point") + f"; other tensors dequantized by gguf-py, written as {self.dtype}")
        if self.bits == 4:
            return (f"linear layers: dequantized by gguf-py, then rounded to nearest per group of {W4_GROUP} "
                    f"(4-bit, zero point); other tensors written as {self.dtype}")
        return (f"read as {name}" if name in FLOAT_TYPES else f"dequantized from {name} by gguf-py") + \
            f", written as {self.dtype}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "out": self.out,
            "dtype": self.dtype,
            "bits": self.bits,
            "weight_bytes": self.weight_bytes,
            "files": list(self.files),
            "tensors": self.tensors,
            "source_types": dict(self.source_types),
            "method": {name: self._method(name) for name in self.source_types},
            "rope_scaling": self.rope_scaling,
            "seconds": round(self.seconds, 3),
        }


def default_out(source: str | os.PathLike[str], dtype: str = "bfloat16", bits: int = 16) -> Path:
    """``./<file stem>-<dtype>`` in the current directory: ``SmolLM2-135M-Instruct.Q4_1.gguf`` ->
    ``SmolLM2-135M-Instruct-bf16`` (``-w4a16`` with ``bits=4``)."""
    stem = Path(source).name
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    base = stem.split(".")[0] if "." in stem else stem
    short = "w4a16" if bits == 4 else {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}[dtype]
    return Path.cwd() / f"{base}-{short}"


def _require_runtime() -> None:
    """numpy, gguf and transformers, or a named refusal saying how to get them."""
    missing = []
    for module in ("numpy", "gguf", "transformers"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ArtifactError("runtime_dependency_missing",
                            f"edge import needs {', '.join(missing)}, which this venv does not have",
                            "pip install edge-cpu (it brings them), or pip install gguf transformers", None)


def import_gguf(source: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
                dtype: str = "bfloat16", bits: int = 16, observer: Observer | None = None,
                on_plan: Callable[[Conversion, Path], None] | None = None) -> ImportResult:
    """Convert the GGUF file ``source`` into a checkpoint directory ``out`` (made here; it must not exist).

    ``on_plan`` is called with the planned conversion and the output path
    before anything is written (the CLI says the size there). Raises
    :class:`ArtifactError` (exit 2) for a file it cannot convert and
    :class:`UsageError` (exit 64) for an output it cannot write.
    """
    started = time.perf_counter()
    header = read_gguf_header(source)
    conversion = plan_conversion(header, dtype, bits)
    target = Path(out) if out is not None else default_out(source, dtype, bits)
    target = target.absolute()
    _check_target(target, conversion)
    _require_runtime()
    if on_plan is not None:
        on_plan(conversion, target)
    partial = target.parent / f".{target.name}.partial-{os.getpid()}"
    partial.mkdir(mode=0o755)
    try:
        config = dict(conversion.config)
        rope = _rope_scaling(conversion)
        if rope is not None:
            config["rope_scaling"] = rope
        files = _write_weights(conversion, partial, observer)
        _write_json(partial / "config.json", config)
        if conversion.generation_config:
            _write_json(partial / "generation_config.json", conversion.generation_config)
        with (observer.step("building the tokenizer and its chat template (transformers' GGUF reader)")
              if observer is not None else contextlib.nullcontext()):
            _write_tokenizer(conversion, partial)
        result = ImportResult(source=header.path, out=str(target), dtype=dtype, bits=bits,
                              weight_bytes=conversion.weight_bytes,
                              files=tuple(sorted([*(p.name for p in partial.iterdir()), PROVENANCE])),
                              tensors=len(conversion.moves),
                              source_types=conversion.source_types(), rope_scaling=rope,
                              seconds=time.perf_counter() - started)
        _write_json(partial / PROVENANCE, {"edge_import": result.to_dict(), "source_bytes": header.file_bytes,
                                           "source_describe": header.describe(), "weight_files": files})
        os.rename(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return replace(result, seconds=time.perf_counter() - started)


def _check_target(target: Path, conversion: Conversion) -> None:
    if target.exists() or target.is_symlink():
        raise UsageError(f"{target} already exists; pass another --out, or remove it first")
    if not target.parent.is_dir():
        raise UsageError(f"{target.parent} does not exist; make it first or pass another --out")
    if not os.access(target.parent, os.W_OK):
        raise UsageError(f"{target.parent} is not writable; pass another --out")
    free = shutil.disk_usage(target.parent).free
    need = conversion.weight_bytes + DISK_SLACK_BYTES
    if free < need:
        raise ArtifactError("disk_space_insufficient",
                            f"{target.parent} has {free / 2**20:,.0f} MiB free; the checkpoint needs "
                            f"{need / 2**20:,.0f} MiB", "free space there, or pass --out on a disk with room",
                            str(target))


def _rope_scaling(conversion: Conversion) -> dict[str, Any] | None:
    """Llama 3's rope_scaling from its frequency-factor tensor; a file whose factors fit no known setting is refused."""
    tensor = conversion.rope_freqs
    if tensor is None:
        return None
    factors = _dequantized(conversion, tensor.offset, tensor.type_id, (1, tensor.elements), tensor.shape[0])
    scaling = llama3_rope_scaling([float(x) for x in factors.reshape(-1)], float(conversion.config["rope_theta"]),
                                  int(conversion.config["head_dim"]))
    if scaling is None:
        raise ArtifactError("architecture_unsupported",
                            f"{conversion.header.path}: its rope frequency factors (rope_freqs.weight) match no "
                            "Llama 3 rope scaling edge knows", "use the model's original checkpoint",
                            conversion.header.path)
    return scaling


def _raw(conversion: Conversion, offset: int, nbytes: int) -> np.ndarray:
    import numpy as np

    return np.memmap(conversion.header.path, dtype=np.uint8, mode="r",
                     offset=conversion.header.data_offset + offset, shape=(nbytes,))


def _dequantized(conversion: Conversion, offset: int, type_id: int, rows_shape: tuple[int, int], row: int
                 ) -> np.ndarray:
    """Rows of one tensor as float32: ``rows_shape`` is (rows, elements per row) of the slice at ``offset``."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    _, block, size = GGML_TYPES[type_id]
    row_bytes = row // block * size
    raw = _raw(conversion, offset, rows_shape[0] * row_bytes).reshape(rows_shape[0], row_bytes)
    out = dequantize(raw, GGMLQuantizationType(type_id))
    return out.reshape(rows_shape).astype("float32", copy=False)


def _rows(move: TensorMove) -> tuple[int, int]:
    row = move.source.shape[0]
    return move.source.elements // row, row


def _chunks(move: TensorMove) -> Iterator[tuple[int, int]]:
    """(first row, rows) slices of a tensor to dequantize at once; a permuted q/k tensor is one slice."""
    rows, row = _rows(move)
    if move.unpermute_heads:
        yield 0, rows
        return
    step = max(1, CHUNK_BYTES // (row * 4))
    for first in range(0, rows, step):
        yield first, min(step, rows - first)


def _tensor_values(conversion: Conversion, move: TensorMove) -> Iterator[np.ndarray]:
    """The tensor's values, row chunk by row chunk, as float32 in the checkpoint's (row-major) orientation."""
    _, block, size = GGML_TYPES[move.source.type_id]
    rows, row = _rows(move)
    row_bytes = row // block * size
    for first, count in _chunks(move):
        values = _dequantized(conversion, move.source.offset + first * row_bytes, move.source.type_id,
                              (count, row), row)
        if move.unpermute_heads:
            values = unpermute(values, move.unpermute_heads)
        yield values


def unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, its interleaved halves back in order.

    llama.cpp's converter reshapes a (heads x head_dim, ...) projection to
    (heads, 2, head_dim / 2, ...) and swaps the middle two axes; the inverse
    reshapes to (heads, head_dim / 2, 2, ...) and swaps them back.
    """
    shape = rows.shape
    half = shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def to_dtype_bytes(values: np.ndarray, dtype: str) -> bytes:
    """float32 values as the output dtype's little-endian bytes; bfloat16 rounds to nearest even, as torch does."""
    import numpy as np

    if dtype in ("float32", "float16"):
        return bytes(np.ascontiguousarray(values, dtype="<f4" if dtype == "float32" else "<f2").tobytes())
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    out = rounded.astype("<u2")
    nan = np.isnan(values)
    if nan.any():
        out[nan.reshape(out.shape)] = 0x7FC0
    return bytes(out.tobytes())


def _shards(moves: tuple[TensorMove, ...], dtype: str) -> list[list[TensorMove]]:
    """Moves grouped into shards of at most :data:`SHARD_BYTES` (a move's entries stay in one shard)."""
    shards: list[list[TensorMove]] = [[]]
    filled = 0
    for move in moves:
        nbytes = sum(out[3] for out in move.outputs(dtype))
        if shards[-1] and filled + nbytes > SHARD_BYTES:
            shards.append([])
            filled = 0
        shards[-1].append(move)
        filled += nbytes
    return shards


def _move_bytes(conversion: Conversion, move: TensorMove) -> Iterator[bytes]:
    """The bytes of ``move``'s safetensors entries, in :meth:`TensorMove.outputs` order."""
    if not move.quantized:
        for values in _tensor_values(conversion, move):
            yield to_dtype_bytes(values, conversion.dtype)
        return
    packed, scales, zeros = w4_groups(conversion, move)
    yield packed.tobytes()
    yield to_dtype_bytes(scales, conversion.dtype)
    yield zeros.tobytes()
    yield struct.pack("<2q", *move.shape)


def _write_weights(conversion: Conversion, folder: Path, observer: Observer | None) -> list[str]:
    """The safetensors shards (and their index when there are several); returns the file names."""
    shards = _shards(conversion.moves, conversion.dtype)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    total = conversion.weight_bytes
    written, shown = 0, -1
    weight_map = {}
    for name, shard in zip(names, shards, strict=True):
        header, offset = {}, 0
        for move in shard:
            for entry, dtype, shape, nbytes in move.outputs(conversion.dtype):
                header[entry] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
                offset += nbytes
                weight_map[entry] = name
        header["__metadata__"] = {"format": "pt", "source": "edge import"}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        with open(folder / name, "wb") as handle:
            handle.write(len(encoded).to_bytes(8, "little"))
            handle.write(encoded)
            for move in shard:
                for data in _move_bytes(conversion, move):
                    handle.write(data)
                    written += len(data)
                percent = 100 * written // max(total, 1)
                if observer is not None and percent // 5 != shown:
                    shown = percent // 5
                    observer.progress(written >> 20, total >> 20, "MiB written")
            if handle.tell() != 8 + len(encoded) + offset:
                raise RuntimeError(f"{name}: wrote {handle.tell()} bytes, the header promised {8 + len(encoded) + offset}")
    if len(shards) > 1:
        _write_json(folder / "model.safetensors.index.json",
                    {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))})
    return names


def w4_groups(conversion: Conversion, move: TensorMove) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One linear weight as W4A16: (packed int32 [rows, cols/8], scales [rows, groups], packed zero points
    [rows/8, groups]), 4-bit values unsigned 0-15 with ``w = scale * (q - zero)``.

    A Q4_0 tensor maps exactly: its blocks are ``d * (q - 8)``, kept as they
    are (zero point 8). Any other type (Q4_1's ``d * q + m`` included: its
    minimum is rarely a whole number of steps) is dequantized and rounded to
    nearest per group (:func:`round_to_nearest_w4`).
    """
    import numpy as np

    rows, cols = move.shape
    if move.source.type_name == "Q4_0":
        _, block, size = GGML_TYPES[move.source.type_id]
        raw = np.asarray(_raw(conversion, move.source.offset, move.source.nbytes)).reshape(rows, cols // block, size)
        scale = raw[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        nibbles = raw[:, :, 2:]
        q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=2).reshape(rows, cols)
        zero = np.full(scale.shape, 8, dtype=np.int32)
    else:
        values = np.concatenate(list(_tensor_values(conversion, replace(move, unpermute_heads=0))))
        q, scale, zero = round_to_nearest_w4(values)
    if move.unpermute_heads:  # whole rows move: their values, scales and zeros together
        q, scale, zero = (unpermute(a, move.unpermute_heads) for a in (q, scale, zero))
    packed = _pack_nibbles(np.ascontiguousarray(q, dtype=np.uint32), axis=1)
    zeros = _pack_nibbles(np.ascontiguousarray(zero, dtype=np.uint32), axis=0)
    return packed, scale.astype(np.float32), zeros


def round_to_nearest_w4(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of float weights as 4-bit (q, scale, zero) per group of :data:`W4_GROUP`, ``w ~ scale * (q - zero)``.

    For each group the five whole zero points around min-max rounding's are
    tried: the scale that covers the group's range with it, the values
    rounded to nearest, then the scale refit by least squares to those
    values; the pair with the least squared error is kept. (Min-max alone
    shifts a group by up to half a step when its minimum falls between two
    steps; the search spreads that error.) Row chunks bound the memory.
    """
    import numpy as np

    rows, cols = values.shape
    groups_per_row = cols // W4_GROUP
    q_out = np.empty((rows, cols), dtype=np.uint8)
    scale_out = np.empty((rows, groups_per_row), dtype=np.float32)
    zero_out = np.empty((rows, groups_per_row), dtype=np.int32)
    step = max(1, (8 << 20) // cols)
    for first in range(0, rows, step):
        t = values[first:first + step].astype(np.float32).reshape(-1, groups_per_row, W4_GROUP)
        low = np.minimum(t.min(axis=2), 0.0)
        high = np.maximum(t.max(axis=2), 0.0)
        span = np.maximum(high - low, 1e-12)
        start = np.clip(np.rint(-low * 15 / span), 0, 15)[..., None]
        zeros = np.clip(start + np.arange(-2, 3, dtype=np.float32), 0, 15)  # [r, g, 5]
        with np.errstate(divide="ignore", invalid="ignore"):
            scale = np.maximum(np.where(zeros > 0, -low[..., None] / zeros, 0.0),
                               np.where(zeros < 15, high[..., None] / (15 - zeros), 0.0))
        scale = np.where(scale > 0, scale, 1e-12)
        q = np.clip(np.rint(t[..., None, :] / scale[..., None]) + zeros[..., None], 0, 15)  # [r, g, 5, 32]
        centred = q - zeros[..., None]
        denom = (centred * centred).sum(axis=3)
        fitted = np.where(denom > 0, (centred * t[..., None, :]).sum(axis=3) / np.where(denom > 0, denom, 1), scale)
        error = ((fitted[..., None] * centred - t[..., None, :]) ** 2).sum(axis=3)
        best = error.argmin(axis=2)[..., None]
        count = t.shape[0]
        q_out[first:first + count] = np.take_along_axis(q, best[..., None], axis=2)[:, :, 0, :].reshape(count, cols)
        scale_out[first:first + count] = np.take_along_axis(fitted, best, axis=2)[..., 0]
        zero_out[first:first + count] = np.take_along_axis(zeros, best, axis=2)[..., 0].astype(np.int32)
    return q_out, scale_out, zero_out


def _pack_nibbles(values: np.ndarray, axis: int) -> np.ndarray:
    """Eight 4-bit values per little-endian int32 along ``axis``, the first in the lowest bits (compressed-tensors'
    ``pack_to_int32``)."""
    import numpy as np

    moved = np.moveaxis(values, axis, -1)
    eight = moved.reshape(*moved.shape[:-1], moved.shape[-1] // 8, 8)
    words = np.zeros(eight.shape[:-1], dtype=np.uint32)
    for i in range(8):
        words |= (eight[..., i] & 0xF) << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(words, -1, axis)).view("<i4")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _write_tokenizer(conversion: Conversion, folder: Path) -> None:
    """The tokenizer and chat template, through transformers' GGUF reader (it builds tokenizer.json from the
    file's vocabulary and merges)."""
    source = Path(conversion.header.path)
    with _quiet_transformers():
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; each is a refusal here
            raise ArtifactError("architecture_unsupported",
                                f"{source}: transformers could not build its tokenizer ({type(exc).__name__}: "
                                f"{str(exc)[:200]})", "use the model's original checkpoint, which carries "
                                "tokenizer.json", str(source)) from None
        tokenizer.save_pretrained(str(folder))


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' GGUF reader logs every key it does not map at INFO and warns on non-writable arrays."""
    import logging
    import warnings

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
