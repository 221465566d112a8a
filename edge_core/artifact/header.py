"""Is this safetensors header one the loader would accept, and which tensors does it hold?

A shard is an 8-byte length, a JSON header and a data section. The header is
checked as the safetensors loader checks it (known dtypes, offsets inside the
data section, each tensor's bytes matching its shape, the tensors tiling the
data section exactly) and refused with a named error otherwise. Nothing here
reads a tensor's bytes.

Most of a large checkpoint's first plan is spent here (DeepSeek-V3: 90,369
tensors in 12 MB of header JSON), so the fast pass (:func:`fast_columns`)
has msgspec decode the header straight into typed entries, which checks each
field's type and range in C as it parses (a known dtype, non-negative integer
dimensions and offsets, at most 64 dimensions), and then asks the remaining
questions of whole columns (the tiling, elements times bits against bytes):
~0.12-0.19 s for DeepSeek-V3's four headers where parsing them into dicts
and checking those took ~0.20-0.36 s, on the 2-core VM of
docs/benchmarks.md. That fast pass only ever *accepts*; whenever it cannot (a
bad entry, an odd shape, a gap, metadata anywhere but first) the careful
pass (:func:`careful_header`) parses the header as JSON and walks the tensors
one at a time, naming the first problem, as it always has.
``tests/test_header_speed_equivalence.py`` holds the two to the same
verdicts. Both run with the cyclic garbage collector paused
(:func:`check_header`), which saved more than the column checks did.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import operator
import os
import re
from collections.abc import Callable, Iterator, Sequence
from itertools import chain, compress, islice, repeat
from typing import Annotated, Any, Literal, NamedTuple, NoReturn

from ..errors import ArtifactError
from ._files import loads, open_regular, reject_duplicates

#: The safetensors reader's own cap on the JSON header; a larger length prefix
#: is a lie or an attack, and honouring it would allocate that much memory.
MAX_HEADER_BYTES = 100_000_000
#: safetensors dtype code -> (bits per element, torch-style name). Sub-byte
#: types pack elements; a tensor must still end on a byte boundary.
SAFETENSORS_DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (8, "bool"),
    "U8": (8, "uint8"),
    "I8": (8, "int8"),
    "F8_E5M2": (8, "float8_e5m2"),
    "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    "I16": (16, "int16"),
    "U16": (16, "uint16"),
    "F16": (16, "float16"),
    "BF16": (16, "bfloat16"),
    "I32": (32, "int32"),
    "U32": (32, "uint32"),
    "F32": (32, "float32"),
    "C64": (64, "complex64"),
    "F64": (64, "float64"),
    "I64": (64, "int64"),
    "U64": (64, "uint64"),
    "F4": (4, "float4_e2m1"),
    "F6_E2M3": (6, "float6_e2m3"),
    "F6_E3M2": (6, "float6_e3m2"),
}
_BITS = {code: bits for code, (bits, _) in SAFETENSORS_DTYPES.items()}
#: The fast pass leaves longer shapes and larger dimensions to the careful one, which
#: stops multiplying before a hostile shape builds a huge integer; real tensors have
#: a handful of dimensions, each far below 2**63.
FAST_MAX_DIMS = 64
FAST_DIM_LIMIT = 1 << 63
#: The keys of a tensor entry; a header whose text (past a leading ``__metadata__``) names each exactly once per
#: tensor has no duplicates of them.
_ENTRY_KEYS = (b'"dtype"', b'"shape"', b'"data_offsets"')
_DTYPE, _SHAPE, _OFFSETS = (operator.attrgetter(k) for k in ("dtype", "shape", "data_offsets"))
_JSON_SPACE = rb"[ \t\n\r]*+"
_JSON_STRING = rb'"(?:[^"\\]++|\\.)*+"'
#: ``{"__metadata__": {...},`` at the start of a header, as the safetensors writer puts it: group 1 is the map
#: (its keys and values strings; what they say is checked by parsing it), the match ends past the comma (or
#: before the closing brace). It only locates the map; every byte of the header is still parsed.
_METADATA_FIRST = re.compile(
    _JSON_SPACE + rb'\{' + _JSON_SPACE + rb'"__metadata__"' + _JSON_SPACE + rb':' + _JSON_SPACE
    + rb'(\{' + _JSON_SPACE + rb'(?:' + _JSON_STRING + _JSON_SPACE + rb':' + _JSON_SPACE + _JSON_STRING
    + _JSON_SPACE + rb',?' + _JSON_SPACE + rb')*+\})' + _JSON_SPACE + rb'(?:,|(?=\}))')
_ABSENT = object()


class TensorInfo(NamedTuple):
    """One tensor as its shard's header describes it."""

    name: str
    #: The safetensors dtype code (``BF16``, ``F8_E4M3``); :data:`SAFETENSORS_DTYPES` maps it.
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    #: The shard file holding it, relative to the checkpoint directory.
    file: str


class ShardHeader(NamedTuple):
    """A shard's raw header as read (``raw`` excludes the 8-byte length prefix); ``size_bytes`` is the file's."""

    name: str
    size_bytes: int
    raw: bytes

    @property
    def data_bytes(self) -> int:
        return self.size_bytes - 8 - len(self.raw)


class ShardTensors(NamedTuple):
    """A checked header's tensors as columns, in header order (each list has one item per tensor).

    Shapes are kept flat (``ndims`` per tensor, ``dims`` end to end), the form the
    header cache stores; :attr:`shapes` regroups them. (This and the other
    small records here are NamedTuples, not dataclasses: a dataclass costs
    ~1.5 ms to create at import on this VM, and every ``edge plan`` imports them.)
    """

    name: str
    names: list[str]
    dtypes: list[str]
    nbytes: list[int]
    ndims: list[int]
    dims: list[int]
    #: dtype code -> bytes of the tensors stored in it.
    dtype_bytes: dict[str, int]

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """Each tensor's shape, regrouped from ``dims`` on every call."""
        dims = iter(self.dims)
        return [tuple(islice(dims, n)) for n in self.ndims]


class TensorTable:
    """Every tensor of a checkpoint as :class:`TensorInfo`, in shard-name then header order.

    ``len()`` is free. :meth:`shards` gives the columns the reader checked; when
    the reader took its verdict from the header cache it parsed nothing, and
    the first call loads the columns the cache kept (``load``) or else parses
    and checks the header bytes read then (not the files as they are now).
    ``keep`` is handed the columns the first time they are asked for, so the
    cache holds them only for checkpoints whose tensors someone reads.
    """

    def __init__(self, root: str, headers: Sequence[ShardHeader], checked: Sequence[ShardTensors] | None,
                 count: int, load: Callable[[], list[ShardTensors] | None] | None = None,
                 keep: Callable[[list[ShardTensors]], None] | None = None) -> None:
        self._root = root
        self._headers = tuple(headers)
        self._checked: list[ShardTensors] | None = list(checked) if checked is not None else None
        self._count = count
        self._load, self._keep, self._asked = load, keep, False

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"TensorTable({self._count} tensors in {len(self._headers)} files)"

    def shards(self) -> list[ShardTensors]:
        """Each shard's columns, in shard-name order."""
        checked = self._checked
        if checked is None:
            checked = self._load() if self._load is not None else None
            if checked is None:
                checked = [check_header(self._root, header) for header in self._headers]
            else:
                self._asked = True  # loaded from the cache: nothing to keep
            self._checked = checked
        if not self._asked:
            self._asked = True
            if self._keep is not None:
                self._keep(checked)
        return checked

    def __iter__(self) -> Iterator[TensorInfo]:
        for shard in self.shards():
            yield from map(TensorInfo._make, zip(shard.names, shard.dtypes, shard.shapes, shard.nbytes,
                                                 repeat(shard.name)))


def read_header(root: str, name: str) -> ShardHeader:
    """The raw header of shard ``name`` under ``root``, its length checked against the file's size."""
    path = os.path.join(root, name)
    with open_regular(path, f"shard {name}", "artifact_invalid", root) as (f, size):
        prefix = f.read(8)
        if len(prefix) < 8:
            bad(root, name, f"is {size} bytes, too short for the 8-byte header length")
        header_len = int.from_bytes(prefix, "little")
        if header_len > MAX_HEADER_BYTES:
            bad(root, name, f"claims a {header_len}-byte header (limit {MAX_HEADER_BYTES})")
        if 8 + header_len > size:
            bad(root, name, f"claims a {header_len}-byte header but the file is only {size} bytes (truncated?)")
        raw = f.read(header_len)
    if len(raw) != header_len:
        bad(root, name, "changed size while being read")
    return ShardHeader(name=name, size_bytes=size, raw=raw)


def check_header(root: str, shard: ShardHeader) -> ShardTensors:
    """Parse and check one shard's header; its tensors, or :class:`ArtifactError` naming the first problem."""
    with _collector_paused():
        return _check_header(root, shard)


def _check_header(root: str, shard: ShardHeader) -> ShardTensors:
    found = fast_columns(shard.name, shard.raw, shard.data_bytes)
    return found if found is not None else careful_header(root, shard.name, shard.raw, shard.data_bytes)


def fast_columns(name: str, raw: bytes, data_bytes: int) -> ShardTensors | None:
    """The tensors of header ``raw`` when every check passes; None when any might fail.

    None is not a refusal: :func:`careful_header` then decides, and names the
    problem. The checks together are the careful ones. The typed decode takes
    only JSON whose every entry has a dtype the loader knows, a shape of at
    most :data:`FAST_MAX_DIMS` integers in ``[0, FAST_DIM_LIMIT)`` and two
    non-negative integer offsets (never a bool or a float); the columns then
    show the ranges tiling ``[0, data_bytes)`` end to end and each tensor's
    elements times its bits equal to its bytes times 8 (so no size is
    negative, none ends mid-byte). Counting each entry key in the text shows
    no tensor or field was named twice (a decoder keeps the last of two).
    ``__metadata__``, a map of strings, does not fit a typed entry: it is
    taken only where writers put it, first, located by :data:`_METADATA_FIRST`
    and parsed on its own; anywhere else, the careful pass reads it.
    """
    entries_decoder, decode_error = _typed_decoder()
    body = raw
    metadata = _METADATA_FIRST.match(raw)
    if metadata is not None:
        if not _strings_only(metadata.group(1)):
            return None
        body = b"{" + raw[metadata.end():]
    try:
        entries = entries_decoder.decode(body)
    except decode_error:
        return None
    tensors = len(entries)
    if not tensors or "__metadata__" in entries or not all(body.count(key) == tensors for key in _ENTRY_KEYS):
        return None
    infos = list(entries.values())
    dtypes, shapes = list(map(_DTYPE, infos)), list(map(_SHAPE, infos))
    begins, ends = zip(*map(_OFFSETS, infos))
    if not _tiles(begins, ends, data_bytes):
        return None
    nbytes = list(map(operator.sub, ends, begins))
    if not all(map(operator.eq, map(operator.mul, map(math.prod, shapes), map(_BITS.__getitem__, dtypes)),
                   map(operator.lshift, nbytes, repeat(3)))):
        return None
    return ShardTensors(name=name, names=list(entries), dtypes=dtypes, nbytes=nbytes, ndims=list(map(len, shapes)),
                        dims=list(chain.from_iterable(shapes)),
                        dtype_bytes=_bytes_by_dtype(set(dtypes), dtypes, nbytes, data_bytes))


_TYPED: list[tuple[Any, type[Exception]]] = []  # the decoder and its error, made on first use


def _typed_decoder() -> tuple[Any, type[Exception]]:
    """msgspec's decoder of a header's tensor entries, and the error it raises on what it does not take.

    Made on first use: msgspec costs ~5-10 ms to import, and only plans of
    a checkpoint read headers.
    """
    if not _TYPED:
        import msgspec

        dim = Annotated[int, msgspec.Meta(ge=0, le=FAST_DIM_LIMIT - 1)]
        entry = msgspec.defstruct("Entry", [
            ("dtype", Literal[tuple(SAFETENSORS_DTYPES)]),
            ("shape", Annotated[list[dim], msgspec.Meta(max_length=FAST_MAX_DIMS)]),
            ("data_offsets", tuple[dim, dim]),
        ], gc=False)  # gc=False: parsed entries hold no cycles
        # A struct made at run time (its dtype literal is the table above) is no type to mypy.
        _TYPED.append((msgspec.json.Decoder(dict[str, entry]), msgspec.DecodeError))  # type: ignore[valid-type]
    return _TYPED[0]


def _strings_only(metadata: bytes) -> bool:
    """Whether ``metadata`` (one JSON object) maps each key to a string, as the loader's map of strings must.

    A key named twice is not refused: the loader keeps the last, as the careful pass does.
    """
    try:
        return _is_string_map(json.loads(metadata.decode("utf-8")))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return False


def _is_string_map(metadata: Any) -> bool:
    """Whether a parsed ``__metadata__`` is what the loader takes: a map of strings to strings."""
    return isinstance(metadata, dict) and all(isinstance(value, str) for value in metadata.values())


def _tiles(begins: Sequence[int], ends: Sequence[int], data_bytes: int) -> bool:
    """Whether each range begins where the previous one ends, from 0 to ``data_bytes``.

    With every range's end at or past its begin (the size check), that is the
    careful pass's tiling. Writers list tensors in offset order, so the
    header's own order is tried first; any other is sorted by (begin, end), as
    the careful pass sorts.
    """
    if begins[0] == 0 and ends[-1] == data_bytes and begins[1:] == ends[:-1]:
        return True
    begins, ends = zip(*sorted(zip(begins, ends)))
    return begins[0] == 0 and ends[-1] == data_bytes and begins[1:] == ends[:-1]


def _bytes_by_dtype(kinds: set[str], dtypes: list[str], nbytes: list[int], data_bytes: int) -> dict[str, int]:
    first, *others = sorted(kinds)
    totals = {kind: sum(compress(nbytes, map(kind.__eq__, dtypes))) for kind in others}
    # The tensors tile the data section, so the first dtype holds what the others do not.
    totals[first] = data_bytes - sum(totals.values())
    return dict(sorted(totals.items()))


def careful_header(root: str, name: str, raw: bytes, data_bytes: int) -> ShardTensors:
    """The tensors of header ``raw``, parsed as JSON and checked one at a time.

    :class:`ArtifactError` names the first problem.
    """
    try:
        header = _parse_header(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        bad(root, name, f"has a header that is not JSON ({exc})")
    if not isinstance(header, dict):
        bad(root, name, "has a header that is not a JSON object")
    metadata = header.pop("__metadata__", _ABSENT)
    if metadata is not _ABSENT and not _is_string_map(metadata):
        bad(root, name, "has __metadata__ that is not a map of strings")
    return careful_columns(root, name, header, data_bytes)


def careful_columns(root: str, name: str, entries: dict[str, Any], data_bytes: int) -> ShardTensors:
    """The tensors of ``entries``, checked one at a time; :class:`ArtifactError` names the first problem."""
    dtypes: list[str] = []
    nbytes: list[int] = []
    ndims: list[int] = []
    dims: list[int] = []
    ranges: list[tuple[int, int, str]] = []
    for key, info in entries.items():
        dtype, size, begin, end = _tensor_entry(root, name, key, info, data_bytes)
        dtypes.append(dtype)
        nbytes.append(size)
        ndims.append(len(info["shape"]))
        dims.extend(info["shape"])
        ranges.append((begin, end, key))
    # The safetensors loader requires tensors to tile the data section exactly;
    # anything else is a file it would refuse at load time.
    cursor, previous = 0, None
    for begin, end, key in sorted(ranges):
        if begin < cursor:
            bad(root, name, f"has overlapping tensors {previous!r} and {key!r}")
        if begin > cursor:
            bad(root, name, f"has bytes [{cursor}, {begin}) that belong to no tensor")
        cursor, previous = end, key
    if cursor != data_bytes:
        bad(root, name, f"has {data_bytes - cursor} trailing bytes after the last tensor")
    totals: dict[str, int] = {}
    for dtype, size in zip(dtypes, nbytes):
        totals[dtype] = totals.get(dtype, 0) + size
    return ShardTensors(name=name, names=list(entries), dtypes=dtypes, nbytes=nbytes, ndims=ndims, dims=dims,
                        dtype_bytes=dict(sorted(totals.items())))


def _parse_header(raw: bytes) -> Any:
    """The header as JSON, refusing duplicate keys (a duplicated tensor or field would be silently dropped).

    Checking duplicates with ``object_pairs_hook`` costs a Python call per
    object, doubling the parse of a 90,000-tensor header. The fast path parses
    plainly, then counts each entry key in the raw text: when every count equals
    the number of tensors parsed, no tensor name or entry field appeared twice.
    Any difference (a duplicate, an escaped key, a key quoted inside metadata)
    re-parses with the hook, which names the duplicate.
    """
    header = loads(raw) if not raw.startswith(b"\xef\xbb\xbf") else None  # a BOM: not JSON, as json says
    if isinstance(header, dict):
        tensors = len(header) - ("__metadata__" in header)
        if all(raw.count(key) == tensors for key in _ENTRY_KEYS):
            return header
    return json.loads(raw.decode("utf-8"), object_pairs_hook=reject_duplicates)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a header is parsed and checked.

    A 22,000-tensor header parses into 66,000 dicts and lists; every 700 new
    ones start a collection, and the older ones pass through each generation
    again. Parsed JSON holds no cycles, so those collections find nothing, and
    the parse is freed (by reference count) before the collector restarts:
    with it running, DeepSeek-V3's four headers spent ~0.11-0.25 s in ~380
    collections here; paused, none. It is restarted only if it was running
    (the caller, or another thread, may have stopped it on purpose).
    """
    running = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if running:
            gc.enable()


def _tensor_entry(root: str, name: str, key: str, info: Any, data_bytes: int) -> tuple[str, int, int, int]:
    if type(info) is not dict:
        bad(root, name, f"describes tensor {key!r} with a {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(dtype) is not str or dtype not in SAFETENSORS_DTYPES:
        bad(root, name, f"gives tensor {key!r} unknown dtype {dtype!r}")
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
            or type(offsets[1]) is not int or offsets[0] < 0 or offsets[0] > offsets[1]):
        bad(root, name, f"gives tensor {key!r} data_offsets {offsets!r}; expected [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_bytes:
        bad(root, name, f"places tensor {key!r} at bytes [{begin}, {end}) but the data section has only "
                        f"{data_bytes} bytes (truncated download?)")
    if type(shape) is not list:
        bad(root, name, f"gives tensor {key!r} shape {shape!r}; expected a list of non-negative integers")
    budget_bits = (end - begin) * 8
    elements_bits, empty = SAFETENSORS_DTYPES[dtype][0], False
    for dim in shape:
        if type(dim) is not int or dim < 0:
            bad(root, name, f"gives tensor {key!r} shape {shape!r}; expected a list of non-negative integers")
        if dim == 0:
            empty = True
        elif elements_bits <= budget_bits:  # stop multiplying before a hostile shape builds a huge integer
            elements_bits *= dim
    if empty:
        elements_bits = 0
    if elements_bits % 8:
        bad(root, name, f"gives sub-byte tensor {key!r} ({dtype}, shape {shape}) a size that is not whole bytes")
    if elements_bits != budget_bits:
        bad(root, name, f"gives tensor {key!r} ({dtype}, shape {shape}) {end - begin} bytes; "
                        f"its shape needs {'more' if elements_bits > budget_bits else elements_bits // 8}")
    return dtype, end - begin, begin, end


def bad(root: str, name: str, what: str) -> NoReturn:
    raise ArtifactError("artifact_invalid", f"safetensors file {name} in {root} {what}",
                        "re-download the file (or re-save it with safetensors); edge reads only valid headers", root)
