"""When an engine process dies, which one was it, of what, and what should the user do?

Every command that starts an engine (``run``, ``serve``, ``accept``, ``parity``,
``chat``, a headless node) names a death the same way: a :class:`DeathWatch`
is entered with the session, before the engine starts, and every place that
finds the engine gone (a start that fails, ``EngineDeadError`` under a
request, a server whose engine stopped, a node's workers) asks it for one
:class:`EngineDeaths` account. The watch gathers what each source can tell:

* **the exit status** of every engine process: vLLM's worker is the engine
  core's child, not edge's, and its parent takes its status first; so
  :class:`ExitRecorder` holds a pidfd on each process the memory sampler finds
  and reads the wait status from the zombie's ``/proc/<pid>/stat`` the moment
  it ends (a direct child's status also comes from waiting on it);
* **titles and the last reading**: the sampler's record of each process
  (vLLM titles them ``VLLM::EngineCore``, ``VLLM::Worker``) and the tree's PSS
  and RSS the last time it was seen alive (:class:`~.measure.SeenProcess`);
* **the memory cgroup** of this process (:func:`read_cgroup_memory`: the v1
  ``memory`` line of ``/proc/self/cgroup`` — ``memory.oom_control``'s
  ``oom_kill`` and ``under_oom``, ``memory.failcnt`` — or v2's
  ``memory.events`` at the process's cgroup and its ancestors), read when the
  watch starts and again at the death: a count that rose during the session
  is this session's OOM kill;
* **the kernel's log** (``/dev/kmsg``, read from where it stood when the watch
  started): its ``Killed process PID (name)`` line names the OOM killer's
  victim. Often not readable (``dmesg_restrict``, containers): the account
  says so.

:meth:`EngineDeaths.describe` is the sentence an error carries: the process
(pid and title), the signal or exit, the cgroup's limit and OOM count when it
was the OOM killer, what was measured last, and the remedy.

An engine inside this process (one vLLM CPU rank) dies with it, and then
nothing here is left to speak: the session's reaper names that death
(:class:`~.reaper.FrontDeath`). The watch leaves it what it knows first
(:func:`front_facts`: the cgroup's counter and limit files, found here, the
plan's admission) and every memory reading after; the kernel-log reader, the
zombie's status and the words are the reaper's, which imports nothing of edge.
"""

from __future__ import annotations

import os
import re
import select
import signal
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from ..errors import EngineDied, StageError
from ..services.host_ledger import current as current_registration
from .logs import EngineLog
from .reaper import (
    CGROUP_UNLIMITED,
    KMSG_PATH,
    SIGNAL_MEANINGS,
    KernelKill,
    KernelLog,
    keyed_counts,
    last_measured_words,
    mib,
    not_oom_evidence,
    oom_remedy,
    oom_words,
    signal_name,
    zombie_returncode,
)

if TYPE_CHECKING:
    from ..plans import Plan
    from .measure import ProcessTreeSampler, Sample, SeenProcess
    from .reaper import SessionReaper

#: vLLM's executor reporting a worker's death (docs/vllm-cpu-facts.md, "A worker's death").
WORKER_DEATH = re.compile(r"Worker proc (?P<name>\S+) died unexpectedly \(exit code: (?P<code>-?\d+|None)\)")

def describe_exit_code(code: int) -> str:
    """``exit 1``, or for a negative code ``killed by SIGILL (what that usually means)``."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            return f"killed by signal {-code}"
        return f"killed by {name} ({SIGNAL_MEANINGS.get(name, 'a signal')})"
    return f"exit {code}"


# ---------------------------------------------------------------- the memory cgroup


@dataclass(frozen=True)
class CgroupMemory:
    """This process's memory cgroup at one moment (cgroup v1's memory controller, or v2's)."""

    version: int
    #: The cgroup as ``/proc/<pid>/cgroup`` names it, e.g. ``/process_api/4f2e``.
    path: str
    #: Where its files are.
    directory: str
    #: The limit that binds: the smallest of its own and its ancestors' (None: unlimited), and whose it is.
    limit_bytes: int | None
    limit_path: str | None
    usage_bytes: int | None
    #: The high-water mark of ``usage_bytes`` (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``).
    max_usage_bytes: int | None
    #: (cgroup path, its ``oom_kill`` count): the cgroup itself first, then (v2) each ancestor that shows one.
    oom_kills: tuple[tuple[str, int], ...]
    #: v1: the cgroup is at its limit and its OOM handling is under way now (``under_oom``).
    under_oom: bool | None = None
    #: Times usage hit the limit (v1 ``memory.failcnt``, v2 ``memory.events`` ``max``).
    failcnt: int | None = None
    #: Where each figure is read, so another process can read it again (the session's reaper,
    #: :func:`front_facts`): (cgroup path, file) of each ``oom_kill`` count, in ``oom_kills``' order; of each
    #: level's limit file, nearest first; and (file, key or None for a bare number) of ``failcnt``.
    oom_kill_files: tuple[tuple[str, str], ...] = ()
    limit_files: tuple[tuple[str, str], ...] = ()
    failcnt_file: tuple[str, str | None] | None = None

    def oom_kill_count(self, path: str | None = None) -> int | None:
        """The ``oom_kill`` count of ``path`` (default: the cgroup itself, else the nearest ancestor that shows one)."""
        for name, count in self.oom_kills:
            if path is None or name == path:
                return count
        return None

    def rises_since(self, before: CgroupMemory | None) -> list[tuple[str, int, int]]:
        """(cgroup path, count before, count now) for every ``oom_kill`` count that rose since ``before``."""
        if before is None:
            return []
        earlier = dict(before.oom_kills)
        return [(path, earlier[path], count) for path, count in self.oom_kills
                if path in earlier and count > earlier[path]]

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "path": self.path, "directory": self.directory,
                "limit_bytes": self.limit_bytes, "limit_path": self.limit_path, "usage_bytes": self.usage_bytes,
                "max_usage_bytes": self.max_usage_bytes, "oom_kills": dict(self.oom_kills),
                "under_oom": self.under_oom, "failcnt": self.failcnt}


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None


def _int(text: str | None) -> int | None:
    text = (text or "").strip()
    return int(text) if text.isdigit() else None


def _unescape(text: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)


def cgroup_mounts(root: Path, pid: str = "self") -> dict[str, tuple[str, str]]:
    """``{"v1": (mount root, mount point), "v2": (...)}`` for the v1 memory controller and the v2 hierarchy,
    from ``/proc/<pid>/mountinfo``; the usual places when it cannot be read."""
    found: dict[str, tuple[str, str]] = {}
    for line in (_read(root / "proc" / pid / "mountinfo") or "").splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        mount_root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        if tail[0] == "cgroup" and "memory" in tail[2].split(",") and "v1" not in found:
            found["v1"] = (mount_root, mount_point)
        elif tail[0] == "cgroup2" and "v2" not in found:
            found["v2"] = (mount_root, mount_point)
    if not found:
        found = {"v1": ("/", "/sys/fs/cgroup/memory"), "v2": ("/", "/sys/fs/cgroup")}
    return found


def _cgroup_paths(root: Path, pid: str) -> dict[str, str]:
    """``{"v1": path of the memory controller's line, "v2": path of the ``0::`` line}`` from ``/proc/<pid>/cgroup``."""
    out = {}
    for line in (_read(root / "proc" / pid / "cgroup") or "").splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            out["v2"] = parts[2] or "/"
        elif "memory" in parts[1].split(","):
            out["v1"] = parts[2] or "/"
    return out


def _lineage(root: Path, mount: tuple[str, str], path: str) -> list[tuple[str, Path]]:
    """(cgroup path, directory) of ``path`` and each of its ancestors up to the mount's root, nearest first."""
    mount_root, mount_point = mount
    relative = path
    if mount_root not in ("", "/") and (path == mount_root or path.startswith(mount_root.rstrip("/") + "/")):
        relative = path[len(mount_root.rstrip("/")):]
    parts = [p for p in relative.split("/") if p]
    base = root / mount_point.lstrip("/")
    out = []
    for depth in range(len(parts), -1, -1):
        name = "/".join(parts[:depth])
        cgroup = (mount_root.rstrip("/") + "/" + name).rstrip("/") or "/"
        if not cgroup.startswith("/"):
            cgroup = "/" + cgroup
        out.append((cgroup, base.joinpath(*parts[:depth]) if depth else base))
    return out


def read_cgroup_memory(root: str | os.PathLike[str] = "/", pid: str = "self") -> CgroupMemory | None:
    """The memory cgroup of ``pid`` (v1's memory controller where it is mounted, else v2's), None where there is none.

    ``root`` replaces ``/`` (tests use a fake tree with ``proc/self/cgroup``, ``proc/self/mountinfo`` and
    the cgroup files).
    """
    base = Path(root)
    paths = _cgroup_paths(base, pid)
    mounts = cgroup_mounts(base, pid)
    if "v1" in paths and "v1" in mounts:
        lineage = _lineage(base, mounts["v1"], paths["v1"])
        own_path, own = lineage[0]
        control = keyed_counts(_read(own / "memory.oom_control"))
        if control or _read(own / "memory.usage_in_bytes") is not None:
            levels = [(p, d / "memory.limit_in_bytes") for p, d in lineage]
            limits = [(p, value) for p, f in levels if (value := _int(_read(f))) is not None and value < CGROUP_UNLIMITED]
            binding = min(limits, key=lambda item: item[1]) if limits else (None, None)
            return CgroupMemory(
                version=1, path=paths["v1"], directory=str(own), limit_bytes=binding[1], limit_path=binding[0],
                usage_bytes=_int(_read(own / "memory.usage_in_bytes")),
                max_usage_bytes=_int(_read(own / "memory.max_usage_in_bytes")),
                oom_kills=((own_path, control["oom_kill"]),) if "oom_kill" in control else (),
                under_oom=bool(control["under_oom"]) if "under_oom" in control else None,
                failcnt=_int(_read(own / "memory.failcnt")),
                oom_kill_files=((own_path, str(own / "memory.oom_control")),) if "oom_kill" in control else (),
                limit_files=tuple((p, str(f)) for p, f in levels if f.exists()),
                failcnt_file=(str(own / "memory.failcnt"), None))
    if "v2" in paths and "v2" in mounts:
        lineage = _lineage(base, mounts["v2"], paths["v2"])
        shown = [(p, d, events) for p, d in lineage if (events := _read(d / "memory.events")) is not None]
        if not shown:
            return None  # v2 without the memory controller
        limits = []
        for p, d in lineage:
            raw = (_read(d / "memory.max") or "").strip()
            if raw.isdigit():
                limits.append((p, int(raw)))
        binding = min(limits, key=lambda item: item[1]) if limits else (None, None)
        own_path, own = lineage[0]
        own_events = keyed_counts(shown[0][2]) if shown[0][0] == own_path else {}
        counted = [(p, d, counts["oom_kill"]) for p, d, events in shown if "oom_kill" in (counts := keyed_counts(events))]
        return CgroupMemory(
            version=2, path=paths["v2"], directory=str(own), limit_bytes=binding[1], limit_path=binding[0],
            usage_bytes=_int(_read(own / "memory.current")), max_usage_bytes=_int(_read(own / "memory.peak")),
            oom_kills=tuple((p, count) for p, _, count in counted),
            failcnt=own_events.get("max"),
            oom_kill_files=tuple((p, str(d / "memory.events")) for p, d, _ in counted),
            limit_files=tuple((p, str(d / "memory.max")) for p, d in lineage if (d / "memory.max").exists()),
            failcnt_file=(str(own / "memory.events"), "max") if own_events else None)
    return None


# ---------------------------------------------------------------- exit statuses


@dataclass(frozen=True)
class Exit:
    """How one process ended: ``returncode`` as Popen's (None: its parent took the status first)."""

    pid: int
    returncode: int | None
    #: Monotonic seconds when it was found ended (None: not known).
    at_s: float | None
    source: str


class ExitRecorder:
    """Each watched process's wait status, read from its zombie the moment it ends.

    vLLM's worker is its engine core's child; the engine core reaps it at
    once, so nothing above it could learn how it died. A pidfd
    (``os.pidfd_open``, Linux >= 5.3) becomes readable when the process ends,
    before its parent reaps it; one thread polls them all and reads the
    status then. Where pidfds are missing, ``available`` is False and only
    direct children's statuses are known (by waiting on them).
    """

    def __init__(self, proc_root: str | os.PathLike[str] = "/proc"):
        self.proc_root = proc_root
        self.available = hasattr(os, "pidfd_open")
        self._lock = threading.Lock()
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._exits: dict[int, Exit] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch(self, pid: int) -> None:
        """Record ``pid``'s exit from now on (a no-op for this process and for pids already watched)."""
        if not self.available or pid == os.getpid():
            return
        with self._lock:
            if self._closed or pid in self._fds.values() or pid in self._exits:
                return
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                return  # gone already, or not allowed
            self._fds[fd] = pid
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="edge-exit-recorder", daemon=True)
                self._thread.start()
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the thread has wakes to read already

    def exits(self) -> dict[int, Exit]:
        with self._lock:
            return dict(self._exits)

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        registered: set[int] = set()
        while True:
            with self._lock:
                if self._closed:
                    return
                for fd in set(self._fds) - registered:
                    poller.register(fd, select.POLLIN)
                    registered.add(fd)
            for fd, _ in poller.poll():
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                code = None
                with self._lock:
                    pid = self._fds.pop(fd, None)
                if pid is not None:
                    code = zombie_returncode(pid, self.proc_root)
                    with self._lock:
                        self._exits[pid] = Exit(pid, code, time.monotonic(),
                                                "its zombie's status" if code is not None else "unknown")
                poller.unregister(fd)
                registered.discard(fd)
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake()
        if self._thread is not None:
            self._thread.join(5)
        with self._lock:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
        os.close(self._wake_r)
        os.close(self._wake_w)


def child_exits(pids: Iterable[int]) -> dict[int, int]:
    """The returncodes of those of ``pids`` that are this process's children and have ended (waited on, so reaped).

    Only where the stage has failed: waiting takes the status from whoever else would read it (vLLM's
    ``multiprocessing`` handles).
    """
    out = {}
    for pid in pids:
        try:
            code = psutil.Process(pid).wait(timeout=0)
        except (psutil.TimeoutExpired, psutil.Error):
            continue
        if code is not None:
            out[pid] = int(code)
    return out


def worker_exits_in_log(engine_log: EngineLog | None) -> list[tuple[str, int | None]]:
    """(vLLM's name for the worker, its exit code or None) for each worker death vLLM's executor logged."""
    if engine_log is None or engine_log.path is None:
        return []
    try:
        with open(engine_log.path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()[-1_000_000:]
    except OSError:
        return []
    return [(m["name"], None if m["code"] == "None" else int(m["code"])) for m in WORKER_DEATH.finditer(text)]


# ---------------------------------------------------------------- the account


@dataclass(frozen=True)
class ProcessDeath:
    """One engine process that ended: who, how, and how it is known."""

    pid: int | None
    title: str | None
    returncode: int | None
    at_s: float | None
    #: Where ``returncode`` came from: its exit status, its zombie's status, the engine log, or unknown.
    source: str
    kernel_kill: KernelKill | None = None
    seen: SeenProcess | None = None
    #: True when the OOM killer ended it (the kernel log names it, or the cgroup's count rose for it).
    oom: bool = False

    @property
    def name(self) -> str:
        title = self.title or "engine process"
        if "/" in title:
            title = title.rsplit("/", 1)[1]
        return f"pid {self.pid} ({title})" if self.pid is not None else title

    @property
    def signal(self) -> str | None:
        return signal_name(self.returncode)

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "title": self.title, "returncode": self.returncode, "signal": self.signal,
                "source": self.source, "oom": self.oom,
                "kernel_kill": self.kernel_kill.to_dict() if self.kernel_kill else None,
                "last_seen": self.seen.to_dict() if self.seen else None}


@dataclass(frozen=True)
class EngineDeaths:
    """What a :class:`DeathWatch` found when the engine failed: the processes that died, first to die first."""

    deaths: tuple[ProcessDeath, ...]
    cgroup_before: CgroupMemory | None
    cgroup_after: CgroupMemory | None
    #: Why the kernel log could not be read (None: it was).
    kernel_log_unreadable: str | None
    #: The plan's admission, predicted peak, held peak (what admission adds the headroom to) and headroom, in bytes
    #: (None without a plan).
    admission_bytes: int | None = None
    predicted_bytes: int | None = None
    headroom_bytes: int | None = None
    held_bytes: int | None = None
    at_s: float = field(default_factory=time.monotonic)

    def __bool__(self) -> bool:
        return bool(self.deaths) or bool(self.oom_rises)

    @property
    def oom_rises(self) -> list[tuple[str, int, int]]:
        return self.cgroup_after.rises_since(self.cgroup_before) if self.cgroup_after is not None else []

    @property
    def oom(self) -> bool:
        return any(d.oom for d in self.deaths) or bool(self.oom_rises)

    @property
    def violent(self) -> bool:
        """True unless every death is an exit code: a signal, the OOM killer, or a status nobody could read."""
        return self.oom or any(d.returncode is None or d.returncode < 0 for d in self.deaths)

    # -- the sentence ------------------------------------------------------------

    def describe(self) -> str:
        """The death in words: the first process to die and how, the cgroup, what was measured last, then the
        others that ended after it, then the remedy."""
        parts = []
        first = self.deaths[0] if self.deaths else None
        if first is not None:
            parts.append(self._how(first))
            measured = self._last_measured(first)
            if measured:
                parts.append(measured)
        elif self.oom_rises:
            path, before, after = self.oom_rises[0]
            parts.append(f"the OOM killer killed {after - before} process(es) in this session's memory cgroup {path} "
                         f"(oom_kill {before} -> {after}){self._limit_clause()}")
        later = [f"{d.name} {self._outcome(d)}" for d in self.deaths[1:5]]
        if later:
            parts.append("then " + ", ".join(later))
        parts.append(self.remedy())
        return "; ".join(p for p in parts if p)

    def _outcome(self, death: ProcessDeath) -> str:
        if death.returncode is None:
            return "ended (its exit status was collected before edge could read it)"
        name = death.signal
        if name is None:
            return f"exited with code {death.returncode}"
        return f"was killed by {name}"

    def _how(self, death: ProcessDeath) -> str:
        if death.oom:
            after = self.cgroup_after
            rises = self.oom_rises
            return oom_words(death.name, death.signal, kill=death.kernel_kill,
                             cgroup="?" if after is None else after.limit_path or after.path,
                             limit_bytes=after.limit_bytes if after is not None else None,
                             rise=rises[0] if rises else None, failcnt=after.failcnt if after is not None else None,
                             kernel_log_unreadable=self.kernel_log_unreadable)
        name = death.signal
        if death.returncode is None:
            return (f"{death.name} ended under the engine, its exit status collected before edge could read it; not "
                    "by the OOM killer" + self._not_oom_clause())
        if name == "SIGKILL":
            return (f"{death.name} was killed by SIGKILL from outside edge and vLLM: not by the OOM killer"
                    + self._not_oom_clause() + ", so by a user's kill -9, a supervisor or a container runtime "
                    "(edge sends SIGKILL only on a forced stop, a second Ctrl-C)")
        if name is not None:
            return f"{death.name} was killed by {name} ({SIGNAL_MEANINGS.get(name, 'a signal')})"
        return f"{death.name} exited with code {death.returncode}"

    def _not_oom_clause(self) -> str:
        """`` (the evidence)``: the cgroup's unchanged count, and the kernel log's silence or why it was not read."""
        after = self.cgroup_after
        return not_oom_evidence(after.oom_kill_count() if after is not None else None, has_cgroup=after is not None,
                                kernel_log_unreadable=self.kernel_log_unreadable)

    def _limit_clause(self) -> str:
        after = self.cgroup_after
        return "" if after is None or after.limit_bytes is None else f", at a limit of {mib(after.limit_bytes)}"

    def _last_measured(self, death: ProcessDeath) -> str:
        seen = death.seen
        if seen is None:
            return ""
        return last_measured_words((death.at_s or self.at_s) - seen.last_seen_s, seen.tree_pss_bytes,
                                   seen.tree_rss_bytes, death.title, seen.pss_bytes)

    def remedy(self) -> str:
        """What to do, for the first death's cause."""
        first = self.deaths[0] if self.deaths else None
        if self.oom:
            kill = first.kernel_kill if first is not None else None
            return oom_remedy(host=kill is not None and kill.scope == "host",
                              limit_bytes=self.cgroup_after.limit_bytes if self.cgroup_after is not None else None,
                              admission_bytes=self.admission_bytes, held_bytes=self.held_bytes,
                              headroom_bytes=self.headroom_bytes,
                              usage_before_bytes=self.cgroup_before.usage_bytes if self.cgroup_before else None)
        if first is None:
            return ""
        name = first.signal
        if name == "SIGKILL" or first.returncode is None:
            return "remedy: find what ended it and start again; the engine log has vLLM's side"
        if name is not None:
            return "remedy: see the meaning above; the engine log has the process's last words"
        return "remedy: the engine log has the process's own error"

    def to_dict(self) -> dict[str, Any]:
        return {
            "deaths": [d.to_dict() for d in self.deaths],
            "oom": self.oom,
            "oom_rises": [{"cgroup": p, "before": b, "after": a} for p, b, a in self.oom_rises],
            "cgroup_before": self.cgroup_before.to_dict() if self.cgroup_before else None,
            "cgroup_after": self.cgroup_after.to_dict() if self.cgroup_after else None,
            "kernel_log_unreadable": self.kernel_log_unreadable,
            "admission_bytes": self.admission_bytes,
            "predicted_bytes": self.predicted_bytes,
            "held_bytes": self.held_bytes,
        }


def front_facts(plan: Plan | None, cgroup: CgroupMemory | None) -> dict[str, Any]:
    """What the session's reaper needs to name this process's own death (:class:`~.reaper.FrontDeath`), as JSON.

    ``name`` (the command, ``edge run``, as the host ledger records it),
    ``running`` (the model and device) and ``in_process`` (the engine runs in
    this process), the memory ``cgroup`` — its path, each ``oom_kill`` counter
    file with its count now, each level's limit file, the ``failcnt`` file,
    what it held before the session (``usage_before_bytes``) — the ``plan``'s
    admission, and the ``engine_log``. The reaper reads the files again when
    this process dies; it finds none of them itself.
    """
    registration = current_registration()
    facts: dict[str, Any] = {"name": registration.record.command if registration is not None else "edge",
                             "running": None, "in_process": False, "cgroup": None, "plan": None,
                             "engine_log": EngineLog.from_environ().path}
    if plan is not None:
        device = plan.selected_device
        facts["running"] = f"{Path(plan.model_path).name}" + (f" on {device.device_id}" if device is not None else "")
        facts["in_process"] = bool(plan.execution is not None and plan.execution.in_process)
        if plan.peak is not None:
            facts["plan"] = {"admission_bytes": plan.peak.admission_bytes, "held_bytes": plan.peak.held_bytes,
                             "headroom_bytes": plan.peak.headroom_bytes}
    if cgroup is not None:
        facts["cgroup"] = {
            "path": cgroup.path,
            "oom_kill": [[path, file, count] for (path, file), (_, count) in zip(cgroup.oom_kill_files,
                                                                                 cgroup.oom_kills)],
            "limits": [list(level) for level in cgroup.limit_files],
            "failcnt": list(cgroup.failcnt_file) if cgroup.failcnt_file is not None else None,
            "usage_before_bytes": cgroup.usage_bytes}
    return facts


class DeathWatch:
    """What a session knows before its engine can die, so a death can be named; use as a context manager.

    Entering reads the memory cgroup's counters, opens the kernel log at its
    end and starts the :class:`ExitRecorder` (``recorder``, default a new one)
    on every process ``sampler`` finds. With the session's ``reaper``, it also
    leaves the reaper what it needs to name this process's own death
    (:func:`front_facts`, then the sampler's every reading): an engine inside
    this process dies with it. ``root``, ``kmsg_path`` and ``proc_root``
    replace ``/``, ``/dev/kmsg`` and ``/proc`` (tests use fakes). :meth:`account`
    (or the module's :func:`account`, which asks the innermost watch) is the
    one way a death is described.
    """

    def __init__(self, plan: Plan | None = None, sampler: ProcessTreeSampler | None = None, *,
                 root: str | os.PathLike[str] = "/", kmsg_path: str = KMSG_PATH,
                 proc_root: str | os.PathLike[str] = "/proc", baseline: bool = True,
                 recorder: ExitRecorder | None = None, reaper: SessionReaper | None = None):
        self.plan = plan
        self.sampler = sampler
        self.root = root
        self.kmsg_path = kmsg_path
        self.proc_root = proc_root
        self.baseline = baseline
        self.reaper = reaper
        self.cgroup_before: CgroupMemory | None = None
        self.kernel_log: KernelLog | None = None
        self.recorder: ExitRecorder | None = recorder
        self._previous_listener: Any = None
        self._previous_on_sample: Any = None

    def __enter__(self) -> DeathWatch:
        self.cgroup_before = read_cgroup_memory(self.root) if self.baseline else None
        self.kernel_log = KernelLog(self.kmsg_path, from_end=self.baseline)
        if self.recorder is None:
            self.recorder = ExitRecorder(self.proc_root)
        reaper = self.reaper
        if reaper is not None:
            reaper.tell("facts", front_facts(self.plan, self.cgroup_before))
        sampler = self.sampler
        if sampler is not None:
            previous = self._previous_listener = sampler.on_new_process
            recorder = self.recorder

            def listener(pid: int) -> None:
                recorder.watch(pid)
                if previous is not None:
                    previous(pid)

            sampler.on_new_process = listener
            for pid in sampler.seen():
                recorder.watch(pid)
            if reaper is not None:
                previous_on_sample = self._previous_on_sample = sampler.on_sample

                def on_sample(sample: Sample) -> None:
                    reaper.tell("reading", reading_of(sample))
                    if previous_on_sample is not None:
                        previous_on_sample(sample)

                sampler.on_sample = on_sample
        _WATCHES.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _WATCHES:
            _WATCHES.remove(self)
        if self.sampler is not None:
            self.sampler.on_new_process = self._previous_listener
            if self.reaper is not None:
                self.sampler.on_sample = self._previous_on_sample
        if self.recorder is not None:
            self.recorder.close()
        if self.kernel_log is not None:
            self.kernel_log.close()

    def account(self, exits: Mapping[int, int] | None = None, engine_log: EngineLog | None = None,
                titles: Mapping[int, str] | None = None) -> EngineDeaths:
        """Every engine process that has ended abnormally so far, first to die first, with the cgroup and the
        kernel's word. ``exits`` adds statuses the caller took by waiting on its children; ``titles`` names
        processes the sampler did not see."""
        now = time.monotonic()
        seen = self.sampler.seen() if self.sampler is not None else {}
        recorded = self.recorder.exits() if self.recorder is not None else {}
        kills = self.kernel_log.kills() if self.kernel_log is not None else {}
        cgroup_after = read_cgroup_memory(self.root)
        found: dict[int, Exit] = dict(recorded)
        for pid, code in (exits or {}).items():
            if pid not in found or found[pid].returncode is None:
                found[pid] = Exit(pid, code, found[pid].at_s if pid in found else None, "its exit status")
        for pid in kills:  # the OOM killer's victims died of SIGKILL, whoever took their status
            if pid in seen and (pid not in found or found[pid].returncode is None):
                found[pid] = Exit(pid, -signal.SIGKILL, found[pid].at_s if pid in found else None, "the kernel log")
        names = {**(titles or {}), **{pid: s.title for pid, s in seen.items() if s.title}}
        deaths = [ProcessDeath(pid=e.pid, title=names.get(e.pid), returncode=e.returncode, at_s=e.at_s, source=e.source,
                               kernel_kill=kills.get(e.pid), seen=seen.get(e.pid))
                  for e in found.values() if self._counts(e, names.get(e.pid), kills)]
        deaths = self._fill_from_log(deaths, engine_log)
        deaths.sort(key=lambda d: (d.at_s is None, d.at_s or 0.0, d.returncode is not None and d.returncode >= 0))
        deaths = self._mark_oom(deaths, cgroup_after)
        plan = self.plan
        peak = plan.peak if plan is not None else None
        return EngineDeaths(
            deaths=tuple(deaths), cgroup_before=self.cgroup_before, cgroup_after=cgroup_after,
            kernel_log_unreadable=self.kernel_log.unreadable if self.kernel_log is not None else None,
            admission_bytes=peak.admission_bytes if peak is not None else None,
            predicted_bytes=peak.predicted_bytes if peak is not None else None,
            headroom_bytes=peak.headroom_bytes if peak is not None else None,
            held_bytes=peak.held_bytes if peak is not None else None, at_s=now)

    @staticmethod
    def _counts(found: Exit, title: str | None, kills: Mapping[int, KernelKill]) -> bool:
        """A death worth naming: the OOM killer's, a signal's, or an engine process's (vLLM titles its own with
        ``::``; the caller's children are its own) that ended with an error or with its status unknown."""
        code = found.returncode
        if found.pid in kills or (code is not None and code < 0):
            return True
        if code == 0:
            return False
        return (title is not None and "::" in title) or found.source == "its exit status"

    @staticmethod
    def _fill_from_log(deaths: list[ProcessDeath], engine_log: EngineLog | None) -> list[ProcessDeath]:
        """A worker whose status its parent took first gets the code vLLM's executor logged, where it logged one."""
        logged = [code for _, code in worker_exits_in_log(engine_log) if code is not None]
        if not logged:
            return deaths
        out = []
        for death in deaths:
            if death.returncode is None and logged and "Worker" in (death.title or ""):
                death = ProcessDeath(pid=death.pid, title=death.title, returncode=logged.pop(0), at_s=death.at_s,
                                     source="the engine log", kernel_kill=death.kernel_kill, seen=death.seen)
            out.append(death)
        return out

    def _mark_oom(self, deaths: list[ProcessDeath], after: CgroupMemory | None) -> list[ProcessDeath]:
        """The kernel log's victims are OOM kills; with none named, a rise of the cgroup's count goes to the first
        process that died of SIGKILL or of an unknown status (one per kill counted)."""
        rises = after.rises_since(self.cgroup_before) if after is not None else []
        unexplained = sum(now - then for _, then, now in rises[:1]) - sum(1 for d in deaths if d.kernel_kill)
        out = []
        for death in deaths:
            oom = death.kernel_kill is not None
            if not oom and unexplained > 0 and death.returncode in (None, -signal.SIGKILL):
                oom, unexplained = True, unexplained - 1
            out.append(ProcessDeath(pid=death.pid, title=death.title, returncode=death.returncode, at_s=death.at_s,
                                    source=death.source, kernel_kill=death.kernel_kill, seen=death.seen, oom=oom))
        return out


#: The watches entered in this process, innermost last.
_WATCHES: list[DeathWatch] = []


def current() -> DeathWatch | None:
    """The innermost :class:`DeathWatch` this process has entered, None outside any session."""
    return _WATCHES[-1] if _WATCHES else None


def account(exits: Mapping[int, int] | None = None, engine_log: EngineLog | None = None) -> EngineDeaths:
    """The innermost watch's account; outside any watch, one without a baseline (the cgroup's counts since it was
    made, the kernel log's whole ring) of ``exits`` alone."""
    watch = current()
    if watch is not None:
        return watch.account(exits, engine_log)
    with DeathWatch(baseline=False) as bare:
        return bare.account(exits, engine_log)


def reading_of(sample: Sample) -> dict[str, Any]:
    """One sample as the reaper's note keeps it: when (monotonic seconds), the tree's PSS and RSS, this process's PSS."""
    return {"at_s": sample.monotonic_s, "tree_pss_bytes": sample.tree_pss_bytes,
            "tree_rss_bytes": sample.tree_rss_bytes, "own_pss_bytes": dict(sample.process_pss_bytes).get(os.getpid())}


@contextmanager
def sampled_watch(plan: Plan | None = None, reaper: SessionReaper | None = None) -> Iterator[DeathWatch]:
    """A :class:`DeathWatch` with a memory sampler of its own on this process's tree, for an engine started
    outside :class:`~edge_core.runtime.session.StageSession` (a headless node's ranks, parity's reference);
    ``reaper``, the session's, is told what names this process's own death."""
    from .measure import DEFAULT_PERIOD_S, ProcessTreeSampler

    sampler = ProcessTreeSampler(os.getpid(), DEFAULT_PERIOD_S)
    sampler.baseline()
    sampler.start()
    try:
        with DeathWatch(plan, sampler, reaper=reaper) as watch:
            yield watch
    finally:
        sampler.stop()


def failure(what: str, exc: BaseException | None, deaths: EngineDeaths, detail: str = "",
            log_path: str | None = None) -> StageError:
    """The error a failed engine raises.

    With a death to name, :class:`~edge_core.errors.EngineDied`: the death first, vLLM's own words after
    it; for a signal or the OOM killer the engine log's path (its lines are vLLM's side of it: a traceback
    of the executor noticing), for an exit code the log's cause lines (``detail``), which say why. Without
    one, a :class:`StageError` with vLLM's words and ``detail``.
    """
    said = f"{type(exc).__name__}: {exc}" if exc is not None else None
    if not deaths:
        return StageError(f"{what}: {said or 'the engine is gone'}" + detail)
    tail = (f". The engine log is {log_path}" if log_path else "") if deaths.violent else detail
    return EngineDied(f"{what}: {deaths.describe()}" + (f". vLLM said: {said}" if said else "") + tail,
                      deaths.to_dict(), traceback_helps=not deaths.violent)
