"""Reading files that a model directory names, safely: regular files only, bounded JSON, names kept inside.

Every reader in :mod:`edge_core.artifact` goes through these: a FIFO or a
device named as a shard is refused without being opened (it could block the
reader forever), JSON is capped in size and rejects duplicate keys, and a name
that points outside the model directory is refused by its spelling.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from typing import Any, BinaryIO

from ..errors import ArtifactError

#: Real config.json and index files are kilobytes to a few MiB.
MAX_JSON_BYTES = 64 * 1024 * 1024
DIGEST_CHUNK_BYTES = 8 * 1024 * 1024


@contextlib.contextmanager
def open_regular(path: str, what: str, code: str, root: str) -> Iterator[tuple[BinaryIO, int]]:
    """Open a file for reading only if it is a regular file; yields (file, size_bytes).

    The stat comes first so a FIFO or device is refused without being opened;
    the open is non-blocking and re-checked with fstat in case the path was
    swapped between the two calls.
    """
    regular_file(path, what, code, root)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ArtifactError(code, f"{what} ({path}) cannot be opened: {exc.strerror}",
                            "check the file's permissions", root) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise not_regular(path, what, code, root, st)
    with os.fdopen(fd, "rb") as f:
        yield f, st.st_size


def regular_file(path: str, what: str, code: str, root: str | None = None) -> os.stat_result:
    try:
        st = os.stat(path)  # follows links: HF cache shards are links into blobs/
    except FileNotFoundError:
        raise ArtifactError(code, f"{what} ({path}) is missing" + (" or a dangling link" if os.path.islink(path) else ""),
                            "download the complete model into the directory", root or path) from None
    except OSError as exc:
        raise ArtifactError(code, f"{what} ({path}) cannot be examined: {exc.strerror}",
                            "check the file's permissions", root or path) from None
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, what, code, root or path, st)
    return st


def not_regular(path: str, what: str, code: str, root: str, st: os.stat_result) -> ArtifactError:
    kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a directory" if stat.S_ISDIR(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
            else "not a regular file")
    return ArtifactError(code, f"{what} ({path}) is {kind}; reading it could block or never end, so edge does not open it",
                         "replace it with the real file from the model's source", root)


def read_json(path: str, what: str, code: str, root: str) -> tuple[Any, int]:
    data, size = read_bounded(path, what, code, root)
    return parse_json(data, what, code, root), size


def read_bounded(path: str, what: str, code: str, root: str) -> tuple[bytes, int]:
    """A JSON file's bytes (at most :data:`MAX_JSON_BYTES`) and its size, unparsed."""
    with open_regular(path, what, code, root) as (f, size):
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise ArtifactError(code, f"{what} in {root} is larger than {MAX_JSON_BYTES} bytes",
                            "restore the file from the model's source", root)
    return data, size


_FAST: list[Any] = []  # msgspec's decoder, made on first use (msgspec costs ~5-10 ms to import)


def _fast_decoder() -> Any:
    if not _FAST:
        import msgspec

        _FAST.append(msgspec.json.Decoder())
    return _FAST[0]


def loads(data: bytes) -> Any:
    """The JSON document in ``data`` (UTF-8), as :func:`json.loads` reads it.

    msgspec's decoder parses it, about twice as fast on the largest headers
    (docs/benchmarks.md#the-two-largest-cold-msgspecs-decoder-where-it-is-installed). It builds the
    same dicts, lists, strings and numbers; anything it does not take (a
    byte-order mark, NaN, an integer past 64 bits, bad input) goes to
    ``json.loads``, which accepts or refuses it in its own words.
    """
    try:
        return _fast_decoder().decode(data)
    except Exception:  # noqa: BLE001 - msgspec.DecodeError and friends: json.loads decides
        return json.loads(data.decode("utf-8-sig"))


def parse_json(data: bytes, what: str, code: str, root: str) -> Any:
    if not data.strip():
        raise ArtifactError(code, f"{what} in {root} is empty", "restore the file from the model's source", root)
    try:
        return loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ArtifactError(code, f"{what} in {root} is not valid JSON: {exc}",
                            "restore the file from the model's source", root) from None


def listdir(root: str) -> set[str]:
    try:
        return set(os.listdir(root))
    except OSError as exc:
        raise ArtifactError("artifact_invalid", f"{root} cannot be listed: {exc.strerror}",
                            "check the directory's permissions", root) from None


def reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s ``object_pairs_hook``: a dict, or ValueError naming a key that appears twice."""
    out = dict(pairs)  # one C call per object: a 90,000-tensor header has 90,000 of them
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]
        raise ValueError(f"key {twice!r} appears twice")
    return out



def check_contained(root: str, name: str, source: str) -> None:
    # The check is on the *name*: the Hugging Face cache links shards into
    # ../../blobs/, so where a link resolves to says nothing about intent.
    parts = name.replace("\\", "/").split("/")
    if (not name or "\0" in name or os.path.isabs(name) or name.startswith(("/", "\\"))
            or os.path.splitdrive(name)[0] or ".." in parts or "" in parts):
        raise ArtifactError("artifact_invalid",
                            f"{root}/{source} names {name!r}, which is outside the model directory",
                            "keep every file the artifact names inside its directory, named relative to it "
                            "(e.g. model-00001-of-00002.safetensors)", root)



def content_digest(root: str, names: list[str]) -> str:
    """sha256 over each named file's name and every byte, in name order, read in chunks."""
    digest = hashlib.sha256(b"edge-content-v1\0")
    for name in sorted(names):
        digest.update(name.encode("utf-8", "surrogatepass") + b"\0")
        with open_regular(os.path.join(root, name), name, "artifact_invalid", root) as (f, _):
            while chunk := f.read(DIGEST_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()



def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()
