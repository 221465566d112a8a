"""What every live edge session on this host has been admitted to hold, whatever venv or interpreter runs it.

A plan is made against the memory the machine shows *now*; a session that was
admitted and is still loading holds bytes the host does not show yet, and one
in another venv is invisible to this process. The ledger is a directory shared
by all edge processes of this user on this host — ``$XDG_RUNTIME_DIR/edge``,
else ``edge-<uid>`` under the temp directory, created 0700 — holding one small
JSON record per live session (and per graph stage a process runs outside a
session of its own). No daemon: whoever plans reads it.

- **Admission under a lock.** :func:`admission` takes an exclusive ``fcntl``
  lock on the directory's lock file; the caller reads the live records, plans
  with them, registers its own record, and releases. Two sessions started at
  the same instant are serialised: the second sees the first's record.
- **Committed, not yet visible.** A record counts on each pool for what the
  host does not already show as used: on the shared RAM pool, its reservation
  minus what it has measurably taken so far (never below zero: a loaded session
  is in ``MemAvailable`` already, a loading one is not yet); on a private pool
  whose capacity is its total (VRAM), its whole reservation.
- **Crash safety.** A record names its processes with their start times; it is
  live while any of them is. A record whose processes are all gone (SIGKILL,
  the OOM killer, a reboot) or whose pid now belongs to another process is
  stale: ignored, and removed by the next reader. Nothing needs cleaning by hand.
- **Hostile content is skipped, never trusted.** The directory must be the
  user's own, a real directory, mode 0700; records are opened with
  ``O_NOFOLLOW``, must be regular files of this user under
  :data:`MAX_RECORD_BYTES`, and are parsed as JSON into plain fields; anything
  else is skipped with a warning. Records are written to a temporary file
  created exclusively and renamed into place (atomic).

Standard library only: ``edge plan`` reads it on every call.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import stat
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import UsageError

SCHEMA = "edge.ledger_record"
#: 2: ``reserved_bytes`` is the held peak plus headroom (file pages left out), and the record carries
#: ``held_peak_bytes``, ``kv_pool_bytes`` and ``kv_cache_usage``; a version-1 record still reads (those as 0 / null).
SCHEMA_VERSION = 2
#: A record is a few hundred bytes; anything much larger is not one of ours.
MAX_RECORD_BYTES = 64 * 1024
#: Records kept per directory listing; a flood of files is not read past this.
MAX_RECORDS = 256
LOCK_NAME = ".lock"
#: The shared RAM pool's key in ``reserved_bytes``; private pools are keyed by device id.
HOST_POOL = "host_ram"


@dataclass(frozen=True)
class SessionRecord:
    """One live session as the ledger stores it (docs/json.md, ``edge.ledger_record``).

    ``processes`` lists ``[pid, start_time]`` pairs (start time as
    ``psutil.Process.create_time()`` reports it, rounded to 0.01 s): the front
    first, then every engine process it started. ``reserved_bytes`` maps a pool
    (``host_ram``, or the device id of a private pool) to the admitted bytes:
    held peak plus headroom. ``predicted_peak_bytes`` is what its tree PSS may
    read (file pages included), ``held_peak_bytes`` what it must hold.
    ``measured_current_bytes`` / ``measured_peak_bytes`` are the session's
    own host-RAM figures (tree PSS), updated while it runs, and
    ``measured_held_bytes`` the tree PSS less its file pages (None where not
    measured: a graph stage, a version-1 record). ``kv_pool_bytes``
    is its KV pool as planned (every rank on its device), ``kv_cache_usage``
    the share of it in use (0..1, the engine's ``vllm:kv_cache_usage_perc``)
    where the session reports it (``edge serve``), else None.
    """

    session_id: str
    pid: int
    processes: tuple[tuple[int, float], ...]
    command: str
    interpreter: str
    venv: str | None
    model: str
    artifact_id: str | None
    device_ids: tuple[str, ...]
    reserved_bytes: Mapping[str, int]
    predicted_peak_bytes: int
    headroom_bytes: int
    started_at: float
    state: str = "loading"
    measured_current_bytes: int = 0
    measured_peak_bytes: int = 0
    updated_at: float = 0.0
    uid: int = field(default_factory=os.getuid)
    held_peak_bytes: int = 0
    kv_pool_bytes: int = 0
    kv_cache_usage: float | None = None
    measured_held_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "session_id": self.session_id, "pid": self.pid,
            "processes": [list(p) for p in self.processes], "command": self.command,
            "interpreter": self.interpreter, "venv": self.venv, "model": self.model, "artifact_id": self.artifact_id,
            "device_ids": list(self.device_ids), "reserved_bytes": dict(self.reserved_bytes),
            "predicted_peak_bytes": self.predicted_peak_bytes, "headroom_bytes": self.headroom_bytes,
            "started_at": self.started_at, "state": self.state,
            "measured_current_bytes": self.measured_current_bytes, "measured_peak_bytes": self.measured_peak_bytes,
            "updated_at": self.updated_at, "uid": self.uid, "held_peak_bytes": self.held_peak_bytes,
            "kv_pool_bytes": self.kv_pool_bytes, "kv_cache_usage": self.kv_cache_usage,
            "measured_held_bytes": self.measured_held_bytes,
        }

    @classmethod
    def from_dict(cls, doc: Any) -> SessionRecord:
        """Parse a record; ValueError naming the field for anything not of the documented shape."""
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise ValueError("not an edge ledger record")

        def integer(name: str, minimum: int = 0) -> int:
            value = doc.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
            return value

        def number(name: str) -> float:
            value = doc.get(name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: expected a non-negative number, got {value!r}")
            return float(value)

        def text(name: str, optional: bool = False) -> Any:
            value = doc.get(name)
            if value is None and optional:
                return None
            if not isinstance(value, str) or len(value) > 4096:
                raise ValueError(f"{name}: expected a string, got {type(value).__name__}")
            return value

        processes = doc.get("processes")
        if not isinstance(processes, list) or not processes or len(processes) > 1024:
            raise ValueError("processes: expected a non-empty list of [pid, start_time]")
        pairs = []
        for item in processes:
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], int)
                    or isinstance(item[0], bool) or item[0] <= 0 or not isinstance(item[1], (int, float))):
                raise ValueError(f"processes: {item!r} is not [pid, start_time]")
            pairs.append((item[0], float(item[1])))
        reserved = doc.get("reserved_bytes")
        if not isinstance(reserved, dict) or not all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for k, v in reserved.items()):
            raise ValueError("reserved_bytes: expected {pool: non-negative int}")
        devices = doc.get("device_ids")
        if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
            raise ValueError("device_ids: expected a list of strings")
        usage = doc.get("kv_cache_usage")
        if usage is not None and (not isinstance(usage, (int, float)) or isinstance(usage, bool) or not 0 <= usage <= 1):
            raise ValueError(f"kv_cache_usage: expected a fraction from 0 to 1, or null; got {usage!r}")
        return cls(
            session_id=text("session_id"), pid=integer("pid", 1), processes=tuple(pairs), command=text("command"),
            interpreter=text("interpreter"), venv=text("venv", optional=True), model=text("model"),
            artifact_id=text("artifact_id", optional=True), device_ids=tuple(devices), reserved_bytes=dict(reserved),
            predicted_peak_bytes=integer("predicted_peak_bytes"), headroom_bytes=integer("headroom_bytes"),
            started_at=number("started_at"), state=text("state"),
            measured_current_bytes=integer("measured_current_bytes"),
            measured_peak_bytes=integer("measured_peak_bytes"), updated_at=number("updated_at"), uid=integer("uid"),
            # A version-1 record has neither.
            held_peak_bytes=integer("held_peak_bytes") if "held_peak_bytes" in doc else 0,
            kv_pool_bytes=integer("kv_pool_bytes") if "kv_pool_bytes" in doc else 0,
            kv_cache_usage=float(usage) if usage is not None else None,
            measured_held_bytes=integer("measured_held_bytes") if doc.get("measured_held_bytes") is not None else None,
        )

    def unseen_bytes(self, pool: str) -> int:
        """What this session holds on ``pool`` that the pool's capacity figure does not show as used yet.

        On host RAM the reservation (held peak + headroom) less what the session
        measurably holds so far: its tree PSS less file pages, which available
        memory still counts as free (the whole PSS for a record without it).
        """
        reserved = int(self.reserved_bytes.get(pool, 0))
        if pool == HOST_POOL:
            taken = self.measured_held_bytes if self.measured_held_bytes is not None else self.measured_current_bytes
            return max(reserved - taken, 0)
        return reserved  # a private pool's capacity is its total: nothing it holds is "visible"

    def describe(self) -> str:
        """``edge serve pid 4121 (Qwen2.5-7B, started 10:02:11, 4.1 GiB loaded so far)``."""
        started = time.strftime("%H:%M:%S", time.localtime(self.started_at))
        loaded = f"{self.measured_current_bytes / 2**30:.1f} GiB loaded so far" if self.measured_current_bytes \
            else "nothing measured yet"
        return f"`{self.command}` pid {self.pid} ({self.model}, started {started}, {self.state}, {loaded})"


@dataclass(frozen=True)
class LedgerView:
    """The live records one read found, and what it skipped or removed (for ``edge ps`` and the plan's notes)."""

    records: tuple[SessionRecord, ...] = ()
    warnings: tuple[str, ...] = ()
    removed_stale: tuple[str, ...] = ()
    directory: str | None = None

    def committed_bytes(self, pool: str) -> int:
        return sum(r.unseen_bytes(pool) for r in self.records)

    def holders(self, pool: str) -> tuple[SessionRecord, ...]:
        return tuple(r for r in self.records if r.unseen_bytes(pool) > 0)


# --------------------------------------------------------------------------- the directory


def ledger_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$EDGE_LEDGER_DIR``, else ``$XDG_RUNTIME_DIR/edge``, else ``<tmp>/edge-<uid>``."""
    env = os.environ if environ is None else environ
    if env.get("EDGE_LEDGER_DIR"):
        return Path(env["EDGE_LEDGER_DIR"])
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "edge"
    return Path(tempfile.gettempdir()) / f"edge-{os.getuid()}"


def _checked_dir(path: Path, create: bool) -> Path:
    """``path`` as a private directory of this user; UsageError naming what is wrong otherwise."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise UsageError(f"cannot create the session ledger {path}: {exc.strerror}") from None
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UsageError(f"cannot read the session ledger {path}: {exc.strerror}") from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise UsageError(f"the session ledger {path} is not a directory (a symlink or a file is in its place); "
                         "remove it, or set EDGE_LEDGER_DIR to a private directory")
    if info.st_uid != os.getuid():
        raise UsageError(f"the session ledger {path} belongs to uid {info.st_uid}, not to you; "
                         "set EDGE_LEDGER_DIR to a private directory")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise UsageError(f"the session ledger {path} is readable by others (mode {stat.S_IMODE(info.st_mode):o}); "
                         "chmod 700 it, or set EDGE_LEDGER_DIR to a private directory")
    return path


def _read_record(directory: Path, name: str) -> SessionRecord:
    fd = os.open(directory / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        if info.st_uid != os.getuid():
            raise ValueError(f"written by uid {info.st_uid}, not by you")
        if info.st_size > MAX_RECORD_BYTES:
            raise ValueError(f"{info.st_size} bytes (a record is under {MAX_RECORD_BYTES})")
        data = os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)
    record = SessionRecord.from_dict(json.loads(data))
    if record.uid != os.getuid():
        raise ValueError(f"claims uid {record.uid}")
    return record


def _boot_time() -> float | None:
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"btime "):
                    return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


_BOOT_TIME = _boot_time()


def start_time(pid: int) -> float | None:
    """The process's start time as ``psutil.Process.create_time()`` reports it, rounded to 0.01 s; None if gone.

    On Linux read from ``/proc/<pid>/stat`` (boot time + start ticks, psutil's
    own formula) without importing psutil, which would cost ``edge plan`` 60 ms.
    """
    if _BOOT_TIME is not None:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                raw = f.read()
            fields = raw[raw.rindex(b")") + 2:].split()
            if fields[0] == b"Z":
                return None  # a zombie has ended; only its exit status is left
            return round(_BOOT_TIME + int(fields[19]) / os.sysconf("SC_CLK_TCK"), 2)
        except (OSError, ValueError, IndexError):
            return None
    import psutil

    try:
        return round(float(psutil.Process(pid).create_time()), 2)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, ValueError):
        return None


def is_live(record: SessionRecord) -> bool:
    """True while any of the record's processes runs with the start time it was recorded with."""
    return any(start_time(pid) == created for pid, created in record.processes)


def read_ledger(directory: Path | None = None, clean: bool = True) -> LedgerView:
    """The live records; stale ones are removed when ``clean``, hostile ones skipped with a warning."""
    path = ledger_dir() if directory is None else directory
    try:
        _checked_dir(path, create=False)
    except FileNotFoundError:
        return LedgerView(directory=str(path))
    records, warnings, removed = [], [], []
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(".json"))
    except OSError as exc:
        return LedgerView(warnings=(f"cannot list {path}: {exc.strerror}",), directory=str(path))
    if len(names) > MAX_RECORDS:
        warnings.append(f"{path} holds {len(names)} records; read the first {MAX_RECORDS}")
        names = names[:MAX_RECORDS]
    for name in names:
        try:
            record = _read_record(path, name)
        except FileNotFoundError:
            continue  # its session just ended
        except (OSError, ValueError, UnicodeDecodeError, RecursionError) as exc:
            warnings.append(f"skipped {path / name}: {exc}")
            continue
        if is_live(record):
            records.append(record)
            continue
        if clean:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path / name)
        removed.append(record.session_id)
    return LedgerView(records=tuple(records), warnings=tuple(warnings), removed_stale=tuple(removed),
                      directory=str(path))


# --------------------------------------------------------------------------- writing


def _write_record(directory: Path, record: SessionRecord) -> None:
    data = json.dumps(record.to_dict(), indent=1).encode()
    tmp = directory / f".{record.session_id}.{uuid.uuid4().hex[:8]}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, directory / f"{record.session_id}.json")


#: Seconds between a registration's updates of its tree PSS and processes.
WATCH_PERIOD_S = 1.0


def tree_pss_bytes(root: int, pids: list[int]) -> int:
    """PSS of ``root`` and ``pids`` from ``/proc/<pid>/smaps_rollup`` (0 for a process that is gone)."""
    return tree_memory(root, pids)[0]


def tree_memory(root: int, pids: list[int]) -> tuple[int, int]:
    """(PSS, PSS less file pages) of ``root`` and ``pids`` from ``/proc/<pid>/smaps_rollup``.

    The second is what the tree holds (``Pss`` less ``Pss_File``: anonymous
    memory and shmem), the part of the PSS an admission counts; a kernel without
    ``Pss_File`` gives the whole PSS for it.
    """
    total = held = 0
    for pid in (root, *pids):
        try:
            with open(f"/proc/{pid}/smaps_rollup", "rb") as f:
                pss = file_pages = 0
                for line in f:
                    if line.startswith(b"Pss:"):
                        pss = int(line.split()[1]) * 1024
                    elif line.startswith(b"Pss_File:"):
                        file_pages = int(line.split()[1]) * 1024
                        break
        except (OSError, ValueError, IndexError):
            continue
        total += pss
        held += max(pss - file_pages, 0)
    return total, held


class Registration:
    """This process's record: updated while the session runs (its processes and tree PSS), removed at exit.

    A watcher thread lists every process this one started (so the record stays
    live while an engine process outlives a killed front, until it is reaped)
    and the tree's current and peak PSS, every :data:`WATCH_PERIOD_S` seconds.
    """

    def __init__(self, directory: Path, record: SessionRecord):
        self.directory, self.record = directory, record
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self) -> None:
        """Start the watcher thread and remove the record when this process exits."""
        atexit.register(self.remove)
        self._thread = threading.Thread(target=self._watch, name="edge-ledger", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(WATCH_PERIOD_S):
            try:
                children = [p.pid for p in me.children(recursive=True)]
            except psutil.Error:
                continue
            current, held = tree_memory(me.pid, children)
            self.add_processes(children)
            self.update(measured_current_bytes=current, measured_held_bytes=held,
                        measured_peak_bytes=max(current, self.record.measured_peak_bytes))

    def update(self, **changes: Any) -> None:
        """Rewrite the record with ``changes`` (state, PSS figures, processes); never raises for I/O."""
        with self._lock:
            if self._stop.is_set():
                return  # removed: never write it back
            self.record = replace(self.record, updated_at=time.time(), **changes)
            with contextlib.suppress(OSError):
                _write_record(self.directory, self.record)

    def add_processes(self, pids: list[int]) -> None:
        """List the engine processes too, so the session counts as live while any of them runs."""
        known = {pid for pid, _ in self.record.processes}
        extra = [(pid, created) for pid in pids if pid not in known
                 for created in [start_time(pid)] if created is not None]
        if extra:
            self.update(processes=self.record.processes + tuple(extra))

    def remove(self) -> None:
        """Take the record out (the session ended); later updates are ignored."""
        global _CURRENT
        with self._lock:
            self._stop.set()
            with contextlib.suppress(OSError):
                os.unlink(self.directory / f"{self.record.session_id}.json")
        if _CURRENT is self:
            _CURRENT = None


class Admission:
    """Inside :func:`admission`: the live records to plan against, and :meth:`register` for an admitted plan."""

    def __init__(self, directory: Path, view: LedgerView):
        self.directory, self.view = directory, view

    def register(self, *, command: str, model: str, artifact_id: str | None, device_ids: tuple[str, ...],
                 reserved_bytes: Mapping[str, int], predicted_peak_bytes: int, headroom_bytes: int,
                 session: bool = True, held_peak_bytes: int = 0, kv_pool_bytes: int = 0) -> Registration:
        """Write an admitted plan's record and return its registration.

        A ``session`` (an edge command: one per process) is this process's
        record: watched, removed at exit, and the one :func:`set_state` and
        :func:`current` speak of. A part of a process that holds memory of its
        own, such as a graph stage run in it, registers with ``session=False``:
        its holder updates the PSS figures and removes the record when the
        part ends; if the process dies first, the record goes stale with it.
        """
        pid = os.getpid()
        created = start_time(pid)
        record = SessionRecord(
            session_id=uuid.uuid4().hex, pid=pid,
            processes=((pid, created if created is not None else 0.0),), command=command,
            interpreter=os.path.abspath(sys.executable),  # the venv's, as `edge devices --json` names it
            venv=sys.prefix if sys.prefix != sys.base_prefix else os.environ.get("VIRTUAL_ENV"),
            model=model, artifact_id=artifact_id, device_ids=device_ids, reserved_bytes=dict(reserved_bytes),
            predicted_peak_bytes=predicted_peak_bytes, headroom_bytes=headroom_bytes, started_at=time.time(),
            updated_at=time.time(), held_peak_bytes=held_peak_bytes, kv_pool_bytes=kv_pool_bytes)
        _write_record(self.directory, record)
        registration = Registration(self.directory, record)
        if session:
            global _CURRENT
            _CURRENT = registration
            registration.watch()
        return registration


#: This process's registration (one edge command = one session), for the runtime to report its state.
_CURRENT: Registration | None = None


def current() -> Registration | None:
    """This process's session registration while its record is live (None before, after, or without one)."""
    return _CURRENT


def set_state(state: str) -> None:
    """Say what this process's registered session is doing (``loading``, ``running``, ``serving``); no-op if none."""
    if _CURRENT is not None:
        _CURRENT.update(state=state)


@contextlib.contextmanager
def admission(directory: Path | None = None) -> Iterator[Admission]:
    """Hold the ledger's exclusive lock: read the live records, plan, register, release."""
    import fcntl

    path = _checked_dir(ledger_dir() if directory is None else directory, create=True)
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield Admission(path, read_ledger(path))
    finally:
        os.close(fd)  # closing releases the lock
