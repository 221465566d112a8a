"""A fake of the Hugging Face Hub's HTTP API, served on 127.0.0.1, for tests that must not touch the network.

It answers the subset huggingface_hub 2.x really calls for ``model_info``, ``list_repo_tree``/``list_repo_files``,
``file_exists``, ``hf_hub_download``, ``snapshot_download`` and ``get_safetensors_metadata``, with the headers and
``X-Error-Code`` values the real Hub sends, so huggingface_hub raises its own exceptions exactly as it would there:

* ``GET /api/models/{repo}[/revision/{rev}][?blobs=true]``: repo info (``sha``, ``siblings``).
* ``GET /api/models/{repo}/tree/{rev}[/{path}][?recursive=true]``: entries (type, path, size, oid, lfs).
* ``GET|HEAD /{repo}/resolve/{rev}/{path}``: a git-stored file is served directly (``ETag`` = its git blob id);
  an LFS file (a weights suffix, or over 10 MB) answers ``302`` to a second "CDN" server on another port, carrying
  ``X-Linked-Etag`` (sha256) and ``X-Linked-Size``, as the Hub does. The other origin matters: huggingface_hub stops
  its HEAD at a cross-origin redirect and drops the token before downloading from it.

Files are served by seek + read in chunks, so sparse multi-GB checkpoints cost nothing. Single byte ranges are
honoured (206 with ``Content-Range``, 416 when unsatisfiable) unless a repo sets ``ignore_range``. Every revision of
a repo serves the same directory. No Xet headers are sent: repos look like classic LFS repos.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from types import TracebackType
from urllib.parse import parse_qs, unquote, urlsplit

#: The Hub refuses git-stored files over 10 MB: anything larger is LFS.
LFS_THRESHOLD = 10 * 1000 * 1000
#: Suffixes the Hub's default ``.gitattributes`` sends to LFS whatever their size.
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".pkl", ".npz")
#: LFS files up to this size get their real sha256; bigger (sparse) ones a stable stand-in, to avoid reading them.
HASH_LIMIT = 64 << 20
CHUNK = 1 << 20
RECORDED_HEADERS = ("Range", "Authorization", "Accept-Encoding")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")
_TIMESTAMP = "2024-07-23T16:12:09.000Z"


@dataclass
class FakeRepo:
    """One model repo: ``directory``'s files at every revision. FakeHub fills in ``commit`` and ``revisions``."""

    directory: Path
    commit: str = ""  # "" -> sha1 of the repo id
    revisions: dict[str, str] | None = None  # branch/tag -> commit; None -> {"main": commit}
    gated: bool = False  # files answer 401 GatedRepo without FakeHub.token; info and tree stay public, as on the Hub
    ignore_range: bool = False  # resolve/ GETs (and their CDN) answer 200 with the whole file, whatever the Range
    private: bool = False  # every call answers 401 RepoNotFound without FakeHub.token, like a missing repo


@dataclass(frozen=True)
class _Blob:
    """What git and LFS know of one file."""

    size: int
    oid: str  # git object id: of the content, or of the LFS pointer
    lfs_sha256: str | None = None
    pointer_size: int = 0


def _digest(file: Path, algorithm: str, prefix: bytes = b"") -> str:
    h = hashlib.new(algorithm, prefix)
    with file.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _blob(file: Path) -> _Blob:
    """Git blob id for git-stored files; sha256 and pointer id for LFS ones (stand-in sha256 past HASH_LIMIT)."""
    stat = file.stat()
    size = stat.st_size
    if size <= LFS_THRESHOLD and not file.name.endswith(LFS_SUFFIXES):
        return _Blob(size, _digest(file, "sha1", b"blob %d\0" % size))
    if size <= HASH_LIMIT:
        sha256 = _digest(file, "sha256")
    else:
        sha256 = hashlib.sha256(f"{file.resolve()}\0{size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    oid = hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()
    return _Blob(size, oid, sha256, len(pointer))


def _lfs_json(blob: _Blob, sha_key: str) -> dict[str, object]:
    return {"size": blob.size, sha_key: blob.lfs_sha256, "pointerSize": blob.pointer_size}


def _parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(first, last) of a single byte range, last clipped to the file; None to ignore it (absent or invalid).

    ``first >= size`` means unsatisfiable.
    """
    match = _RANGE.match((header or "").strip())
    if match is None or match.groups() == ("", ""):
        return None
    first, last = match.groups()
    if first == "":  # suffix range: the last N bytes
        return (max(size - int(last), 0) if int(last) else size), size - 1
    if last != "" and int(last) < int(first):
        return None
    return int(first), min(int(last), size - 1) if last else size - 1


class _Handler(BaseHTTPRequestHandler):
    """Answers one connection for ``hub``: its API and resolve/ routes, or (``cdn``) its LFS objects."""

    protocol_version = "HTTP/1.1"
    hub: FakeHub
    cdn: bool

    def setup(self) -> None:
        super().setup()
        with self.hub._lock:
            self.hub._connections.add(self.connection)

    def finish(self) -> None:
        with self.hub._lock:
            self.hub._connections.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: pytest shows failures, not access logs."""

    def do_GET(self) -> None:
        self._answer()

    def do_HEAD(self) -> None:
        self._answer()

    def _answer(self) -> None:
        self.hub._record(self.command, self.path, {k: v for k in RECORDED_HEADERS if (v := self.headers.get(k))})
        with self.hub._lock:
            self.hub._answering += 1
        try:
            if self.hub.delay_s:
                time.sleep(self.hub.delay_s)
            if self.cdn:
                self._serve_lfs()
            else:
                self._route()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left mid-answer
        finally:
            with self.hub._lock:
                self.hub._answering -= 1

    # ---------------------------------------------------------------- routing

    def _route(self) -> None:
        url = urlsplit(self.path)
        api = url.path.startswith("/api/models/")
        found = self.hub._match_repo(url.path[len("/api/models/"):] if api else url.path[1:])
        authorized = self.headers.get("Authorization") == f"Bearer {self.hub.token}"
        if found is None or (found[1].private and not authorized):
            status = 404 if authorized else 401  # the Hub does not tell an anonymous caller which repos exist
            return self._error(status, "RepoNotFound", "Repository not found")
        repo_id, repo, rest = found
        kind, _, tail = rest.partition("/")
        if api and kind in ("", "revision"):
            raw_revision, path = tail or "main", ""
        elif (api and kind == "tree") or (not api and kind == "resolve"):
            raw_revision, _, path = tail.partition("/")
        else:
            return self._error(404, None, "Not Found")
        revision, path = unquote(raw_revision), unquote(path)
        revisions = repo.revisions or {}
        commit = revisions.get(revision) or (revision if revision in revisions.values() else None)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if kind == "resolve":
            if repo.gated and not authorized:
                return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have "
                                   "access to it and be authenticated to access it. Please log in.")
            return self._resolve(repo, commit, path)
        if kind == "tree":
            recursive = parse_qs(url.query).get("recursive", ["false"])[0].lower() in ("true", "1")
            return self._tree(repo, commit, path, recursive)
        blobs = parse_qs(url.query).get("blobs", ["false"])[0].lower() in ("true", "1")
        return self._json(self._model_info(repo_id, repo, commit, blobs))

    # ---------------------------------------------------------------- API

    def _model_info(self, repo_id: str, repo: FakeRepo, commit: str, blobs: bool) -> dict[str, object]:
        root = repo.directory
        siblings: list[dict[str, object]] = []
        for file in sorted(p for p in root.rglob("*") if p.is_file()):
            sibling: dict[str, object] = {"rfilename": file.relative_to(root).as_posix()}
            if blobs:
                blob = _blob(file)
                sibling.update(blobId=blob.oid, size=blob.size)
                if blob.lfs_sha256:
                    sibling["lfs"] = _lfs_json(blob, "sha256")
            siblings.append(sibling)
        return {
            "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24], "id": repo_id, "modelId": repo_id,
            "author": repo_id.split("/")[0] if "/" in repo_id else None, "sha": commit,
            "lastModified": _TIMESTAMP, "createdAt": _TIMESTAMP, "private": repo.private,
            "gated": "manual" if repo.gated else False, "disabled": False, "downloads": 0, "likes": 0,
            "tags": [], "siblings": siblings,
        }

    def _tree(self, repo: FakeRepo, commit: str, path: str, recursive: bool) -> None:
        root = repo.directory
        base = self._entry(root, path) if path else root
        if base is None or not base.is_dir():
            return self._error(404, "EntryNotFound", f"{path} does not exist on {commit}", commit)
        entries: list[dict[str, object]] = []
        for item in sorted(base.rglob("*") if recursive else base.iterdir()):
            rel = item.relative_to(root).as_posix()
            if item.is_dir():
                entries.append({"type": "directory", "oid": hashlib.sha1(rel.encode()).hexdigest(), "size": 0,
                                "path": rel})
            elif item.is_file():
                blob = _blob(item)
                entry: dict[str, object] = {"type": "file", "oid": blob.oid, "size": blob.size, "path": rel}
                if blob.lfs_sha256:
                    entry["lfs"] = _lfs_json(blob, "oid")
                entries.append(entry)
        self._json(entries)

    # ---------------------------------------------------------------- files

    @staticmethod
    def _entry(root: Path, path: str) -> Path | None:
        """The file or folder at repo path ``path``; None if absent or ``..`` climbs out (symlinks are followed)."""
        parts = PurePosixPath(path).parts
        if not parts or parts[0] == "/" or ".." in parts:
            return None
        target = root.joinpath(*parts)
        return target if target.exists() else None

    def _resolve(self, repo: FakeRepo, commit: str, path: str) -> None:
        file = self._entry(repo.directory, path)
        if file is None or not file.is_file():
            return self._error(404, "EntryNotFound", "Entry not found", commit)
        blob = _blob(file)
        if blob.lfs_sha256 is None:
            return self._send_file(file, repo.ignore_range, {"ETag": f'"{blob.oid}"', "X-Repo-Commit": commit})
        self.hub._lfs_objects[blob.lfs_sha256] = (file, repo.ignore_range)
        self._head(302, {"Location": f"{self.hub._cdn_endpoint}/lfs/{blob.lfs_sha256}", "ETag": f'"{blob.oid}"',
                         "X-Linked-Etag": f'"{blob.lfs_sha256}"', "X-Linked-Size": str(blob.size),
                         "X-Repo-Commit": commit, "Content-Length": "0"})

    def _serve_lfs(self) -> None:
        """The CDN side: a signed-URL store, so it asks for no token."""
        url = urlsplit(self.path).path
        found = self.hub._lfs_objects.get(url.removeprefix("/lfs/")) if url.startswith("/lfs/") else None
        if found is None or not found[0].is_file():
            return self._error(404, None, "NoSuchKey")
        file, ignore_range = found
        self._send_file(file, ignore_range, {"ETag": f'"{url.removeprefix("/lfs/")}"'})

    def _send_file(self, file: Path, ignore_range: bool, headers: dict[str, str]) -> None:
        size = file.stat().st_size
        span = None if ignore_range else _parse_range(self.headers.get("Range"), size)
        headers = {**headers, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if span is not None and span[0] >= size:
            return self._head(416, {**headers, "Content-Range": f"bytes */{size}", "Content-Length": "0"})
        first, last = span if span is not None else (0, size - 1)
        if span is not None:
            headers["Content-Range"] = f"bytes {first}-{last}/{size}"
        self._head(206 if span is not None else 200, {**headers, "Content-Length": str(last - first + 1)})
        if self.command == "HEAD":
            return
        with file.open("rb") as f:
            f.seek(first)
            remaining = last - first + 1
            while remaining > 0 and (chunk := f.read(min(CHUNK, remaining))):
                self._write(chunk)
                remaining -= len(chunk)

    # ---------------------------------------------------------------- plumbing

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def _write(self, data: bytes) -> None:
        """Send ``data``, counting each piece the kernel accepted (``wfile`` is unbuffered here, so the two mix):
        a client that hangs up mid-chunk is counted for what reached its socket, not for the whole chunk or none."""
        view = memoryview(data)
        while view:
            sent = self.connection.send(view)
            self.hub._count(sent)
            view = view[sent:]

    def _json(self, payload: object, headers: dict[str, str] | None = None, status: int = 200) -> None:
        body = json.dumps(payload).encode()
        self._head(status, {**(headers or {}), "Content-Type": "application/json", "Content-Length": str(len(body))})
        if self.command != "HEAD":
            self._write(body)

    def _error(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        """An error the way the Hub words it: X-Error-Code/X-Error-Message headers and an ``{"error"}`` body."""
        headers = {"X-Error-Message": message}
        if code is not None:
            headers["X-Error-Code"] = code
        if commit is not None:
            headers["X-Repo-Commit"] = commit
        self._json({"error": message}, headers, status)


class FakeHub:
    """A threaded fake Hub on 127.0.0.1 (random ports): a context manager; ``endpoint`` is set once started."""

    endpoint: str

    def __init__(self, repos: dict[str, FakeRepo], token: str = "hf_test_token", delay_s: float = 0.0):
        for repo_id, repo in repos.items():
            repo.directory = Path(repo.directory)
            repo.commit = repo.commit or hashlib.sha1(repo_id.encode()).hexdigest()
            repo.revisions = {"main": repo.commit} if repo.revisions is None else repo.revisions
        self.repos, self.token, self.delay_s = repos, token, delay_s
        self._lock = threading.Lock()
        self._bytes_sent = 0
        self._answering = 0
        self._requests: list[tuple[str, str, dict[str, str]]] = []
        self._lfs_objects: dict[str, tuple[Path, bool]] = {}
        self._connections: set[socket.socket] = set()
        self._servers: list[ThreadingHTTPServer] = []

    @property
    def bytes_sent(self) -> int:
        """Response body bytes handed to clients' sockets so far, both servers.

        Waits (up to 2 s) for answers still being written: a client can hold a
        whole body before the server thread has counted its last chunk.
        """
        deadline = time.monotonic() + 2.0
        while True:
            with self._lock:
                if self._answering == 0 or time.monotonic() > deadline:
                    return self._bytes_sent
            time.sleep(0.005)

    @property
    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        """(method, path with query, recorded headers) of every request so far, in arrival order.

        Requests to the CDN side are those whose path starts with ``/lfs/``.
        """
        with self._lock:
            return list(self._requests)

    def reset_counters(self) -> None:
        with self._lock:
            self._bytes_sent = 0
            self._requests.clear()

    def start(self) -> FakeHub:
        for cdn in (False, True):
            handler = type("_FakeHubHandler", (_Handler,), {"hub": self, "cdn": cdn})
            server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
            self._servers.append(server)
        hub, cdn = (f"http://127.0.0.1:{server.server_address[1]}" for server in self._servers)
        self.endpoint, self._cdn_endpoint = hub, cdn
        return self

    def stop(self) -> None:
        """Stop both servers and cut open connections, so idle keep-alive handler threads end with the fake."""
        for server in self._servers:
            server.shutdown()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for server in self._servers:
            server.server_close()
        self._servers.clear()

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _match_repo(self, raw_path: str) -> tuple[str, FakeRepo, str] | None:
        """(repo id, repo, rest of the path) for the known repo ``raw_path`` starts with."""
        for repo_id in sorted(self.repos, key=len, reverse=True):
            if raw_path == repo_id or raw_path.startswith(repo_id + "/"):
                return repo_id, self.repos[repo_id], raw_path[len(repo_id) + 1:]
        return None

    def _record(self, method: str, path: str, headers: dict[str, str]) -> None:
        with self._lock:
            self._requests.append((method, path, headers))

    def _count(self, n: int) -> None:
        with self._lock:
            self._bytes_sent += n


class SilentEndpoint:
    """A Hub that accepts every connection and never answers a byte: a context manager; ``endpoint`` once started.

    What a hung proxy or a half-dead mirror looks like to a client: connect succeeds, every read waits.
    ``connections`` counts the clients' connections (a retrying client makes more than one).
    """

    endpoint: str

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._held: list[socket.socket] = []
        self._stopped = threading.Event()

    @property
    def connections(self) -> int:
        return len(self._held)

    def __enter__(self) -> SilentEndpoint:
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, name="silent-endpoint", daemon=True).start()
        return self

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            self._held.append(conn)

    def __exit__(self, *exc: object) -> None:
        self._stopped.set()
        self._listener.close()
        for conn in self._held:
            conn.close()
