"""Were these exact safetensors headers checked before? A verdict kept by the content it was reached on.

Parsing and checking the headers of DeepSeek-V3 (90,369 tensors, 12 MB of
header JSON and an 8.6 MB index) costs ~0.5-0.65 s of CPU on the 2-core VM of
docs/benchmarks.md, most of it ``json.loads``; the verdict itself is a few
numbers. So the checkpoint reader keeps it, for header sets of at least
:data:`MIN_CACHED_BYTES`, as one small JSON file under
``$XDG_CACHE_HOME/edge/headers`` (default ``~/.cache/edge/headers``).

Nothing is trusted on a file's size or mtime. An entry is found by a sha256 of
the index file's bytes (or, without an index, of the shard names) and of the
checks' own source, and it lists every shard's name, file size and a sha256
of its header: a hit holds only when the headers read now hash the same, so
the verdict is the one the checks would reach again on the same bytes.
A hit reads and hashes the index and headers (~30 ms of ``read_manifest``'s
~45 ms for DeepSeek-V3) and parses nothing. The tensor columns
(names, dtypes, bytes, shapes) go to a binary file beside the entry the first
time someone reads them (:class:`.header.TensorTable`), tied to the same
header digests. A file that is unreadable, malformed, or written by other
checks is ignored, and one that cannot be written is skipped: the plan never
depends on the cache.
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import os
import stat
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .header import SAFETENSORS_DTYPES, ShardHeader, ShardTensors

#: Header and index bytes below which nothing is written: checking a megabyte of them costs
#: ~30 ms here, a lookup well under one, and small checkpoints need no files in the cache.
MIN_CACHED_BYTES = 1 << 20
#: Checkpoints kept, the least recently planned dropped first; and a cap on the
#: bytes they take (a verdict is under 1 KiB, DeepSeek-V3's tensor columns 6.5 MB).
MAX_ENTRIES = 64
MAX_CACHE_BYTES = 256 << 20
#: A temporary file older than this was left by a writer that died.
STALE_TMP_S = 3600.0
ENTRY_FORMAT = "edge-header-verdict-v1"
TABLE_MAGIC = b"edge-tensor-columns-v1\n"
#: The source of the checks a verdict depends on (a change to any of them makes every entry a miss).
_READER_FILES = ("header.py", "header_cache.py", "checkpoint.py", "_files.py")
#: A dtype code's index in the stored columns (one byte per tensor).
_CODES = tuple(sorted(SAFETENSORS_DTYPES))
_CODE_INDEX = {code: i for i, code in enumerate(_CODES)}
#: The columns of one shard, in file order: the names (UTF-8, NUL between them), then
#: nbytes, dtype indices, ndims and dims as arrays of these type codes.
_INT_SECTIONS = ("q", "B", "I", "q")


class Verdict(NamedTuple):
    """What the checks concluded about a checkpoint's headers, and the bytes they concluded it on."""

    #: (shard name, file size in bytes, sha256 hex of its header), in the order read.
    shards: tuple[tuple[str, int, str], ...]
    #: dtype code -> bytes of the tensors stored in it, over all shards.
    dtype_bytes: dict[str, int]
    tensor_count: int

    @property
    def shard_names(self) -> list[str]:
        return [name for name, _, _ in self.shards]

    def holds_for(self, headers: Sequence[ShardHeader]) -> bool:
        """Whether ``headers`` are the shards, sizes and header bytes this verdict was reached on.

        Its bytes per dtype must also add up to the data sections the headers
        frame (the tensors tile them), which an entry edited by hand may not.
        """
        return (len(headers) == len(self.shards)
                and sum(self.dtype_bytes.values()) == sum(h.data_bytes for h in headers)
                and all((h.name, h.size_bytes) == (name, size) and header_digest(h.raw) == digest
                        for h, (name, size, digest) in zip(headers, self.shards)))

    def to_dict(self) -> dict[str, Any]:
        return {"shards": [list(s) for s in self.shards], "dtype_bytes": self.dtype_bytes,
                "tensor_count": self.tensor_count}


def header_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def verdict_for(headers: Sequence[ShardHeader], dtype_bytes: dict[str, int], tensor_count: int) -> Verdict:
    return Verdict(shards=tuple((h.name, h.size_bytes, header_digest(h.raw)) for h in headers),
                   dtype_bytes=dict(dtype_bytes), tensor_count=tensor_count)


#: Where the verdicts go instead of ``$XDG_CACHE_HOME/edge/headers`` (the test suite points it at a temp dir).
CACHE_DIR_ENV = "EDGE_HEADER_CACHE_DIR"


def default_cache_dir() -> Path:
    """``$EDGE_HEADER_CACHE_DIR``, else ``$XDG_CACHE_HOME/edge/headers``; read at each call (as the other edge caches are)."""
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edge" / "headers"


def cache_key(index_raw: bytes | None, shard_names: Sequence[str]) -> str | None:
    """The entry's key: the index's bytes, else the shard names, and the checks' source; None: no cache."""
    reader = _reader()
    if reader is None:
        return None
    digest = hashlib.sha256(f"{ENTRY_FORMAT}\0{reader}\0".encode())
    if index_raw is not None:
        digest.update(b"index\0" + index_raw)
    else:
        digest.update(b"names\0" + "\0".join(sorted(shard_names)).encode("utf-8", "surrogatepass"))
    return digest.hexdigest()


def load(key: str | None, cache_dir: Path | None = None) -> Verdict | None:
    """The verdict stored under ``key``, or None when there is none or it is not one these checks wrote."""
    if key is None:
        return None
    path = _path(key, ".json", cache_dir)
    try:
        verdict = _verdict_from(json.loads(_read_regular(path)), key)
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None
    if verdict is not None:
        try:
            os.utime(path)  # marks it used, for the eviction order
        except OSError:
            pass
    return verdict


def store(key: str | None, verdict: Verdict, cache_dir: Path | None = None) -> None:
    """Write ``verdict`` under ``key``; a failure is ignored."""
    if key is not None:
        body = json.dumps({"format": ENTRY_FORMAT, "key": key, **verdict.to_dict()}).encode()
        _write(_path(key, ".json", cache_dir), body)


def store_table(key: str, verdict: Verdict, shards: Sequence[ShardTensors], cache_dir: Path | None = None) -> None:
    """Write the tensor columns of the shards ``verdict`` describes; skipped when they do not fit the format."""
    meta: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    try:
        for shard in shards:
            names = "\0".join(shard.names)
            if names.count("\0") != max(0, len(shard.names) - 1):
                return  # a name holding NUL (JSON allows it) would not split back
            parts = [names.encode("utf-8", "surrogatepass"), array.array("q", shard.nbytes).tobytes(),
                     bytes(map(_CODE_INDEX.__getitem__, shard.dtypes)), array.array("I", shard.ndims).tobytes(),
                     array.array("q", shard.dims).tobytes()]
            meta.append({"name": shard.name, "count": len(shard.names), "dtype_bytes": shard.dtype_bytes,
                         "sizes": [len(p) for p in parts]})
            blobs.extend(parts)
    except (OverflowError, ValueError, KeyError):
        return  # a dimension past 2**63 (an empty tensor may have one): not worth a format
    blob = b"".join(blobs)
    head = json.dumps({"format": ENTRY_FORMAT, "key": key, "byteorder": sys.byteorder, "verdict": verdict.to_dict(),
                       "shards": meta, "sha256": hashlib.sha256(blob).hexdigest()}).encode()
    _write(_path(key, ".tensors", cache_dir), TABLE_MAGIC + len(head).to_bytes(8, "little") + head + blob)


def load_table(key: str, verdict: Verdict, headers: Sequence[ShardHeader],
               cache_dir: Path | None = None) -> list[ShardTensors] | None:
    """The columns kept for the shards ``verdict`` describes (already checked against ``headers``), or None."""
    try:
        data = _read_regular(_path(key, ".tensors", cache_dir))
        return _table_from(data, key, verdict, headers)
    except (OSError, ValueError, TypeError, KeyError, IndexError, RecursionError, UnicodeDecodeError):
        return None


def _table_from(data: bytes, key: str, verdict: Verdict, headers: Sequence[ShardHeader]) -> list[ShardTensors] | None:
    """Columns from a table file, only when every length and sum agrees with the verdict and the headers."""
    if not data.startswith(TABLE_MAGIC):
        return None
    at = len(TABLE_MAGIC)
    head_len = int.from_bytes(data[at:at + 8], "little")
    head = json.loads(data[at + 8:at + 8 + head_len])
    if (not isinstance(head, dict) or head.get("format") != ENTRY_FORMAT or head.get("key") != key
            or head.get("byteorder") != sys.byteorder or head.get("verdict") != verdict.to_dict()):
        return None
    meta = head["shards"]
    at += 8 + head_len
    # The lengths and sums below catch a table that does not fit the verdict; the digest, a
    # flipped bit that would still fit (a wrong dimension).
    if not isinstance(meta, list) or len(meta) != len(headers) or hashlib.sha256(data[at:]).hexdigest() != head["sha256"]:
        return None
    out: list[ShardTensors] = []
    for entry, header in zip(meta, headers):
        sizes, count, dtype_bytes = entry["sizes"], entry["count"], entry["dtype_bytes"]
        if (entry["name"] != header.name or not _count(count) or not isinstance(sizes, list) or len(sizes) != 5
                or not all(map(_count, sizes)) or not isinstance(dtype_bytes, dict)
                or not all(k in _CODE_INDEX and _count(v) for k, v in dtype_bytes.items())
                or sum(dtype_bytes.values()) != header.data_bytes):
            return None
        chunks = []
        for size in sizes:
            chunks.append(data[at:at + size])
            at += size
        if any(len(chunk) != size for chunk, size in zip(chunks, sizes)):
            return None
        if not count and sizes[0]:
            return None
        names = chunks[0].decode("utf-8", "surrogatepass").split("\0") if count else []
        nbytes, dtype_index, ndims, dims = (_ints(code, chunk) for code, chunk in zip(_INT_SECTIONS, chunks[1:]))
        if not (len(names) == len(nbytes) == len(dtype_index) == len(ndims) == count and len(dims) == sum(ndims)):
            return None
        if count and (min(nbytes) < 0 or sum(nbytes) != header.data_bytes or max(dtype_index) >= len(_CODES)
                      or (dims and min(dims) < 0)):
            return None
        out.append(ShardTensors(name=header.name, names=names, dtypes=list(map(_CODES.__getitem__, dtype_index)),
                                nbytes=nbytes, ndims=ndims, dims=dims, dtype_bytes=dtype_bytes))
    if at != len(data) or sum(len(s.names) for s in out) != verdict.tensor_count:
        return None
    return out


def _ints(code: str, chunk: bytes) -> list[int]:
    column = array.array(code)
    column.frombytes(chunk)  # ValueError when the size is not a whole number of items
    return column.tolist()


def _read_regular(path: Path) -> bytes:
    """A cache file's bytes; OSError for anything but a regular file (a FIFO left there must not block a plan)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CACHE_BYTES:
            raise OSError(f"{path} is not a cache file")
        return f.read()


def _path(key: str, suffix: str, cache_dir: Path | None) -> Path:
    return (default_cache_dir() if cache_dir is None else cache_dir) / f"{key[:40]}{suffix}"


def _write(path: Path, body: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(body)
        os.replace(tmp, path)
        _evict(path.parent)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # a read-only home is no reason to fail a plan; the next one parses again


def _evict(where: Path) -> None:
    """Drop the least recently used checkpoints past :data:`MAX_ENTRIES` or :data:`MAX_CACHE_BYTES`."""
    groups: dict[str, list[tuple[str, int, int]]] = {}
    now = time.time()
    for entry in os.scandir(where):
        if not entry.is_file(follow_symlinks=False):
            continue
        st = entry.stat(follow_symlinks=False)
        if entry.name.endswith(".tmp"):
            if now - st.st_mtime > STALE_TMP_S:
                os.unlink(entry.path)
            continue
        stem, _, suffix = entry.name.partition(".")
        if suffix in ("json", "tensors"):
            groups.setdefault(stem, []).append((suffix, st.st_mtime_ns, st.st_size))
    # A table without its verdict is never read; a checkpoint's age is its verdict's last use.
    order = sorted(groups, key=lambda stem: max((m for s, m, _ in groups[stem] if s == "json"), default=-1))
    total = sum(size for files in groups.values() for _, _, size in files)
    kept = len(groups)
    for stem in order:
        orphan = all(s != "json" for s, _, _ in groups[stem])
        if not orphan and kept <= MAX_ENTRIES and total <= MAX_CACHE_BYTES:
            break
        for suffix, _, size in groups[stem]:
            os.unlink(where / f"{stem}.{suffix}")
            total -= size
        kept -= 1


def _verdict_from(data: Any, key: str) -> Verdict | None:
    """A :class:`Verdict` from an entry file, only in the exact shape :func:`store` writes."""
    if not isinstance(data, dict) or data.get("format") != ENTRY_FORMAT or data.get("key") != key:
        return None
    shards, dtype_bytes, count = data["shards"], data["dtype_bytes"], data["tensor_count"]
    if not (isinstance(shards, list) and shards and all(
            isinstance(s, list) and len(s) == 3 and isinstance(s[0], str) and _count(s[1])
            and isinstance(s[2], str) and len(s[2]) == 64 for s in shards)):
        return None
    if not (isinstance(dtype_bytes, dict) and all(k in _CODE_INDEX and _count(v) for k, v in dtype_bytes.items())
            and _count(count) and count > 0):
        return None
    return Verdict(shards=tuple((s[0], s[1], s[2]) for s in shards), dtype_bytes=dict(sorted(dtype_bytes.items())),
                   tensor_count=count)


def _count(value: Any) -> bool:
    return type(value) is int and value >= 0


@functools.cache
def _reader() -> str | None:
    """A digest of the checks' own source: an entry written by other checks is never read as theirs."""
    digest = hashlib.sha256()
    here = Path(__file__).resolve().parent
    try:
        for name in _READER_FILES:
            digest.update((here / name).read_bytes())
    except OSError:
        return None
    return digest.hexdigest()
