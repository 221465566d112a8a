"""What is in a GGUF file — llama.cpp's format — read from its header without touching a weight.

A GGUF file is a header (metadata key/values, then one record per tensor:
name, shape, ggml type, offset) followed by the tensor data, aligned. vLLM 0.32
has no GGUF loader, so edge does not plan a GGUF file as a checkpoint: it says
what the file is and how `edge import` turns it into one
(:mod:`edge_core.runtime.gguf_import`). This module reads the header with the
standard library only (no gguf-py, no numpy): `edge plan --model FILE.gguf`
decides in milliseconds, and a malformed or lying header is an
:class:`~edge_core.errors.ArtifactError`, never a traceback.

The layout read here is GGUF versions 2 and 3, little-endian, as llama.cpp's
``docs/gguf.md`` specifies it.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import IO, Any

from ..errors import ArtifactError

MAGIC = b"GGUF"
#: Versions whose layout this reader knows (1 used 32-bit counts and is long gone).
VERSIONS = (2, 3)
#: Data alignment when ``general.alignment`` does not say.
DEFAULT_ALIGNMENT = 32

#: ggml tensor types: id -> (name, elements per block, bytes per block) (ggml.h, gguf-py's GGML_QUANT_SIZES).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}
#: The types `edge import` turns into floats: the float types, and every block type gguf-py (llama.cpp's own
#: Python package) dequantizes; Q8_1 and Q8_K are llama.cpp's activation formats, never a stored weight.
DEQUANTIZABLE = frozenset({
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_M", "IQ1_S", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ3_S", "IQ3_XXS", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0",
    "MXFP4", "NVFP4",
})

#: Metadata value types: id -> struct format (strings and arrays are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
#: Longest key or string value read (a chat template is a few KiB; a lying length must not allocate gigabytes).
MAX_STRING_BYTES = 16 << 20
#: Arrays longer than this are kept as a count only (token tables: a vocabulary is ~32k-260k entries).
KEEP_ARRAY_ITEMS = 64
#: Most dimensions a tensor may have (ggml's GGML_MAX_DIMS).
MAX_DIMS = 4


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array kept as its element type and length (the tokenizer's tables)."""

    item_type: int
    length: int


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor record: ``shape`` in ggml order (fastest-varying first, as the file stores it)."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type_id][0] if self.type_id in GGML_TYPES else f"type {self.type_id}"

    @property
    def elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the file (whole blocks of its type)."""
        _, block, size = GGML_TYPES[self.type_id]
        return self.elements // block * size


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's header: its metadata (big arrays as :class:`ArrayInfo`), tensors and where their data starts."""

    path: str
    version: int
    metadata: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]
    data_offset: int
    file_bytes: int
    type_counts: dict[str, int] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        value = self.metadata.get("general.architecture")
        return value if isinstance(value, str) else "unknown"

    @property
    def name(self) -> str | None:
        value = self.metadata.get("general.name")
        return value if isinstance(value, str) else None

    @property
    def parameters(self) -> int:
        """Elements over every tensor: the parameter count."""
        return sum(t.elements for t in self.tensors)

    def describe(self) -> str:
        """'llama, 135M parameters, Q4_1 x210, F32 x61, Q8_0 x1' — what a person needs to recognise the file."""
        counts = ", ".join(f"{name} x{n}" for name, n in sorted(self.type_counts.items(), key=lambda kv: -kv[1]))
        return f"{self.architecture}, {_count(self.parameters)} parameters, {counts}"


def _count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True for a regular file that starts with the GGUF magic (a ``.gguf`` name alone is not enough)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == MAGIC
    except OSError:
        return False


class _Reader:
    """Bounded little-endian reads of the header, from memory filled in growing chunks; a read past the end of
    the file is a named refusal."""

    #: First read; a header is ~2 MiB for a 50k-token vocabulary, more for larger ones.
    CHUNK = 4 << 20

    def __init__(self, handle: IO[bytes], path: str, size: int):
        self.handle, self.path, self.size = handle, path, size
        self.buffer = b""
        self.pos = 0

    def bad(self, what: str) -> ArtifactError:
        return ArtifactError("artifact_invalid", f"{self.path}: not a readable GGUF file ({what})",
                             "check the download is complete (compare its size or sha256 with the source's), or "
                             "download it again", self.path)

    def _have(self, count: int) -> None:
        end = self.pos + count
        if count < 0 or end > self.size:
            raise self.bad(f"a field of {count} bytes runs past the end of the {self.size}-byte file")
        if end > len(self.buffer):
            want = max(end, min(self.size, 2 * len(self.buffer) or self.CHUNK)) - len(self.buffer)
            more = self.handle.read(want)
            self.buffer += more
            if len(self.buffer) < end:
                raise self.bad("the file ended early")

    def take(self, count: int) -> bytes:
        self._have(count)
        data = self.buffer[self.pos:self.pos + count]
        self.pos += count
        return data

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._have(size)
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += size
        return value

    def _length(self) -> int:
        length = int(self.scalar("<Q"))
        if length > MAX_STRING_BYTES:
            raise self.bad(f"a string of {length} bytes, over the {MAX_STRING_BYTES >> 20} MiB this reader accepts")
        return length

    def string(self) -> str:
        return self.take(self._length()).decode("utf-8", errors="replace")

    def skip(self, count: int) -> None:
        self._have(count)
        self.pos += count

    def _skip_strings(self, count: int) -> None:
        """Step over ``count`` length-prefixed strings (a vocabulary: ~10^5 of them, so no call per string)."""
        unpack = _U64.unpack_from
        for _ in range(count):
            if self.pos + 8 > len(self.buffer):
                self._have(8)
            (length,) = unpack(self.buffer, self.pos)
            if length > MAX_STRING_BYTES:
                raise self.bad(f"a string of {length} bytes, over the {MAX_STRING_BYTES >> 20} MiB this reader "
                               "accepts")
            self.pos += 8
            if self.pos + length > len(self.buffer):
                self._have(length)
            self.pos += length

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, length = self.scalar("<I"), self.scalar("<Q")
            if length > self.size:  # every item takes at least a byte
                raise self.bad(f"an array of {length} items in a {self.size}-byte file")
            if length <= KEEP_ARRAY_ITEMS:
                return [self.value(item) for _ in range(length)]
            if item in _SCALARS:
                self.skip(length * struct.calcsize(_SCALARS[item]))
            elif item == _STRING:
                self._skip_strings(length)
            else:
                raise self.bad(f"a {length}-item array of type {item}, which no known key holds")
            return ArrayInfo(item, length)
        raise self.bad(f"metadata value type {kind} is not one GGUF defines")


def read_gguf_header(path: str | os.PathLike[str]) -> GGUFHeader:
    """Read a GGUF file's header; :class:`ArtifactError` for anything that is not a sound GGUF file."""
    where = os.path.abspath(os.fspath(path))
    try:
        with open(where, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            return _read(_Reader(handle, where, size), where, size)
    except OSError as exc:
        raise ArtifactError("artifact_invalid", f"{where}: could not be read: {exc}",
                            "check the file exists and is readable", where) from None


def _read(reader: _Reader, path: str, size: int) -> GGUFHeader:
    if reader.take(4) != MAGIC:
        raise reader.bad("it does not start with the GGUF magic")
    version = reader.scalar("<I")
    if version not in VERSIONS:
        raise reader.bad(f"GGUF version {version}; this reader knows versions {', '.join(map(str, VERSIONS))}")
    tensor_count, kv_count = reader.scalar("<Q"), reader.scalar("<Q")
    if tensor_count > size // 24 or kv_count > size // 12:  # the smallest record of each is that long
        raise reader.bad(f"it claims {tensor_count} tensors and {kv_count} metadata keys in {size} bytes")
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("<I"))
    tensors = []
    counts: dict[str, int] = {}
    for _ in range(tensor_count):
        name = reader.string()
        dims = reader.scalar("<I")
        if not 1 <= dims <= MAX_DIMS:
            raise reader.bad(f"tensor {name!r} has {dims} dimensions")
        shape = tuple(reader.scalar("<Q") for _ in range(dims))
        type_id, offset = reader.scalar("<I"), reader.scalar("<Q")
        tensor = GGUFTensor(name, shape, type_id, offset)
        if type_id not in GGML_TYPES:
            raise reader.bad(f"tensor {name!r} has ggml type {type_id}, which this reader does not know")
        if tensor.elements % GGML_TYPES[type_id][1]:
            raise reader.bad(f"tensor {name!r} ({tensor.elements} elements) is not whole {tensor.type_name} blocks")
        tensors.append(tensor)
        counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0:
        raise reader.bad(f"general.alignment is {alignment!r}")
    here = reader.pos
    data_offset = -(-here // alignment) * alignment
    for tensor in tensors:
        end = data_offset + tensor.offset + tensor.nbytes
        if end > size:
            raise reader.bad(f"tensor {tensor.name!r} ends at byte {end}, past the end of the {size}-byte file")
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=tuple(tensors), data_offset=data_offset,
                      file_bytes=size, type_counts=counts)
