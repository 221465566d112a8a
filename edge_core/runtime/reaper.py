"""Which processes belong to an engine session, and when edge itself is killed, who ends them and says how it died?

Edge starts vLLM's engine processes in a process group of their own
(:mod:`.processes`), so a ``kill -9`` or the OOM killer ending edge leaves
them running, reparented to init (issue 13: the engine core and worker,
1.5 GB RSS on the demo, for good). SIGTERM, SIGHUP and Ctrl-C are
handled in edge; a SIGKILL cannot be. So every session is bound to its front
process from outside:

* the session's marker, ``EDGE_SESSION_ID=<uuid>``, is put in ``os.environ``
  while the engine starts, so every process it spawns, and theirs, carries
  it in ``/proc/PID/environ`` (the kernel's copy, which no ``putenv`` moves);
* ``SPT_NOENV=1`` beside it: vLLM titles its processes with setproctitle
  (``VLLM::EngineCore``), which otherwise writes zeros over that copy
  (docs/vllm-cpu-facts.md, "setproctitle and the session marker");
* a reaper, this file run as a script in a session of its own, waits for the
  front to die (a pidfd where the kernel has them, else the pid polled with
  its start time, so a reused pid is never taken for the front); then it
  sends SIGTERM to every process of this user carrying the marker, SIGKILL to
  what is left after :data:`GRACE_S`, and exits. When the session stops
  normally the front ends the reaper itself (:class:`SessionReaper`).

An engine that runs inside edge's own process (one vLLM CPU rank, the plan's
``execution.in_process``) dies with it: the reaper then finds no marked
process to end, so the same sequence holds for both layouts, and names the
death (below).

The reaper runs by path, not with ``python -m``: it imports the standard
library and psutil only (no ``edge_core``, no vLLM), and starts in a fraction
of a second. It never signals a process without the marker.

**The front's own death, named.** An engine inside edge's process dies with
it, and the OOM killer's victim is then edge itself: nothing in edge is left
to say why, and the shell says "Killed". The reaper, which sees the front die
without having been ended by it, says why, once, on the front's stderr (it
inherits the descriptor, and holds it until it exits): :class:`FrontDeath`,
in the words :mod:`.deaths` uses for an engine process (they live here, the
one module both processes run). What it reads:

* the front's **note** (:class:`FrontNote`, an anonymous file the reaper
  inherits): what the front knew before it could die — its memory cgroup's
  ``oom_kill`` counter files with their counts at the start and the limit
  files (found by :mod:`.deaths`, not here), the plan's admission, the engine
  log — and the sampler's last reading;
* the **kernel log** (``/dev/kmsg``, opened at the reaper's start, where
  readable): its ``Killed process <front pid>`` line;
* the front's **wait status**, from its zombie's ``/proc/<pid>/stat`` the
  moment it ends: a non-parent can read it only until the parent reaps it
  (a shell waiting on the front usually wins), and the account says when it
  could not.

A front that ends on purpose without stopping its sessions (``edge serve``'s
forced stop, which says so itself) marks the note first (:func:`leaving`):
the reaper then ends the engine processes and says nothing.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import psutil

#: The environment variable that names the session every engine process belongs to.
MARKER = "EDGE_SESSION_ID"
#: Set beside the marker while an engine starts: setproctitle leaves ``/proc/PID/environ`` alone (see above).
KEEP_ENVIRON = {"SPT_NOENV": "1"}
#: How much of ``/proc/PID/environ`` is read. Linux caps one process's arguments plus environment at a
#: quarter of its stack limit (2 MiB by default); a marker beyond this is missed, never mistaken.
ENVIRON_LIMIT_BYTES = 4 << 20
#: Seconds between liveness checks where no pidfd can be opened.
POLL_S = 0.2
#: Seconds a terminated engine process has to exit before it is killed; vLLM's engine core shuts its
#: worker down on SIGTERM in well under that, the resource tracker ignores SIGTERM and is killed.
GRACE_S = 3.0
#: Seconds the front waits for the reaper to say it is watching (an interpreter start, on a loaded host).
READY_TIMEOUT_S = 10.0
#: Two start times closer than this are the same process: psutil derives them from clock ticks (1/100 s).
START_TIME_TOLERANCE_S = 0.01
#: The kernel's log, one record per read.
KMSG_PATH = "/dev/kmsg"
#: The most kernel-log records one read takes (a host whose log floods still answers).
KMSG_READ_LIMIT = 100_000
#: cgroup v1 reports "no limit" as a huge page-aligned number; anything above this is unlimited.
CGROUP_UNLIMITED = 1 << 60


def start_time(pid: int) -> float | None:
    """``pid``'s start time (seconds since the epoch, psutil's ``create_time``); None if it has ended."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return float(proc.create_time())
    except psutil.Error:
        return None


def is_same_process(pid: int, started: float) -> bool:
    """True while the process that started at ``started`` still runs as ``pid`` (False once it ended or the pid
    belongs to another process)."""
    now = start_time(pid)
    return now is not None and abs(now - started) < START_TIME_TOLERANCE_S


def has_marker(pid: int, session_id: str) -> bool:
    """True if ``pid`` belongs to this user and its environment names ``session_id``."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            return False
        with open(f"/proc/{pid}/environ", "rb") as handle:
            environ = handle.read(ENVIRON_LIMIT_BYTES)
    except OSError:
        return False
    return f"{MARKER}={session_id}".encode() in environ.split(b"\0")


def pids() -> Iterator[int]:
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if name.isdigit():
            yield int(name)


def marked_processes(session_id: str) -> list[tuple[int, float]]:
    """(pid, start time) of every live process of this user that carries ``session_id``'s marker.

    Any process may ask (a host ledger, a test): the marker is in the kernel's
    copy of each engine process's environment. The start time (psutil's
    ``create_time``) tells a later process with the same pid apart.
    """
    out = []
    for pid in pids():
        if pid != os.getpid() and has_marker(pid, session_id):
            started = start_time(pid)
            if started is not None:
                out.append((pid, started))
    return out


def watch(pid: int) -> int | None:
    """A pidfd for ``pid`` (readable once it ends), or None where the kernel or Python has none."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None  # already gone: the start-time check says so
    except (AttributeError, OSError):
        return None


def wait_for_exit(pid: int, started: float, pidfd: int | None, poll_s: float = POLL_S) -> None:
    """Return once the process that started at ``started`` as ``pid`` has ended."""
    if pidfd is not None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        while not poller.poll():
            pass
        return
    while is_same_process(pid, started):
        time.sleep(poll_s)


def end_marked(session_id: str, grace_s: float = GRACE_S, rounds: int = 3) -> tuple[list[int], list[int]]:
    """SIGTERM every process carrying ``session_id``'s marker, SIGKILL what is left after ``grace_s``.

    Returns (terminated, killed) pids. Repeats while marked processes remain
    (one may have spawned another while it died), at most ``rounds`` times.
    psutil refuses to signal a pid that now belongs to another process.
    """
    terminated: list[int] = []
    killed: list[int] = []
    for _ in range(rounds):
        procs = []
        for pid, _started in marked_processes(session_id):
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                continue
        if not procs:
            break
        for proc in procs:
            try:
                proc.terminate()
                terminated.append(proc.pid)
            except psutil.Error:
                continue
        alive = still_running(procs, grace_s)
        for proc in alive:
            try:
                proc.kill()
                killed.append(proc.pid)
            except psutil.Error:
                continue
        still_running(alive, grace_s)
    return terminated, killed


def still_running(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of ``procs`` still running after up to ``timeout_s``. A zombie has ended: orphans wait for init
    to collect them, and where init does not (some containers), psutil's own wait would hang to its timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for proc in procs:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.Error:
                continue
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


# ---------------------------------------------------------------- a death, read from outside the process


def zombie_returncode(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """A dead process's wait status as Popen's returncode (-N: signal N), read from its zombie's ``stat`` (field 52,
    ``exit_code``, Linux >= 3.5); None when it is not a zombie (still running, or its parent has reaped it)."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), encoding="ascii", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    if ")" not in text:
        return None
    fields = text[text.rindex(")") + 2:].split()
    if len(fields) < 50 or fields[0] not in ("Z", "X") or not fields[49].lstrip("-").isdigit():
        return None
    status = int(fields[49])
    return -(status & 0x7F) if status & 0x7F else (status >> 8) & 0xFF


def signal_name(code: int | None) -> str | None:
    """``SIGKILL`` for a returncode of -9; None for an exit code or an unknown status."""
    if code is None or code >= 0:
        return None
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


#: The kernel's OOM-kill line: "Memory cgroup out of memory: Killed process 4122 (VLLM::Worker) total-vm:...".
KERNEL_KILL = re.compile(r"(?P<scope>Memory cgroup out of memory|Out of memory)[^:]*: Killed process (?P<pid>\d+) "
                         r"\((?P<name>[^)]*)\)")
#: The kernel's summary line before it: "oom-kill:constraint=...,oom_memcg=/a/b,task_memcg=/a/b,task=x,pid=4122,...".
KERNEL_OOM_MEMCG = re.compile(r"oom-kill:.*\boom_memcg=(?P<memcg>[^,]*),.*\bpid=(?P<pid>\d+)")


class KernelKill(NamedTuple):
    """One OOM kill the kernel logged."""

    pid: int
    #: The kernel's name for the process (its ``comm``: at most 15 characters, e.g. ``VLLM::EngineCor``).
    name: str
    #: ``cgroup`` (a memory cgroup hit its limit) or ``host`` (the whole machine ran out).
    scope: str
    #: The cgroup whose limit was hit, where the kernel said (``oom_memcg=``).
    memcg: str | None
    line: str

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "name": self.name, "scope": self.scope, "memcg": self.memcg, "line": self.line}


class KernelLog:
    """The kernel's OOM-kill records written after this was opened (``/dev/kmsg``), where the log is readable.

    ``unreadable`` says why not (``/dev/kmsg: Operation not permitted`` under ``dmesg_restrict``). With
    ``from_end=False`` every record still in the ring is read (an account made without a watch).
    """

    def __init__(self, path: str = KMSG_PATH, *, from_end: bool = True):
        self.path = path
        self.unreadable: str | None = None
        self._fd: int | None = None
        self._kills: dict[int, KernelKill] = {}
        self._memcg: dict[int, str] = {}
        self._partial = ""
        self._lock = threading.Lock()
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            self.unreadable = f"{path}: {exc.strerror or exc}"
            return
        if from_end:
            try:
                os.lseek(fd, 0, os.SEEK_END)
            except OSError:
                pass
        self._fd = fd

    def kills(self) -> dict[int, KernelKill]:
        """Every OOM kill logged since this was opened, by pid."""
        with self._lock:
            if self._fd is not None:
                self._read_new()
            return dict(self._kills)

    def _read_new(self) -> None:
        assert self._fd is not None
        for _ in range(KMSG_READ_LIMIT):
            try:
                data = os.read(self._fd, 16384)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # the ring overwrote records we had not read: go on from the oldest
                    continue
                self.unreadable = f"{self.path}: {exc.strerror or exc}"
                break
            if not data:
                break
            text = self._partial + data.decode("utf-8", errors="replace")
            lines = text.split("\n")
            self._partial = lines.pop()
            for line in lines:
                self._parse(line)
        if self._partial and ";" in self._partial:  # a file without a last newline: take it as a record
            self._parse(self._partial)
            self._partial = ""

    def _parse(self, record: str) -> None:
        if not record or record.startswith(" "):  # a record's continuation (KEY=value) lines
            return
        message = record.split(";", 1)[1] if ";" in record.split(" ", 1)[0] else record
        memcg = KERNEL_OOM_MEMCG.search(message)
        if memcg:
            self._memcg[int(memcg["pid"])] = memcg["memcg"]
        kill = KERNEL_KILL.search(message)
        if kill:
            pid = int(kill["pid"])
            self._kills[pid] = KernelKill(pid=pid, name=kill["name"], memcg=self._memcg.get(pid),
                                          scope="cgroup" if kill["scope"].startswith("Memory cgroup") else "host",
                                          line=message.strip())

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


# ---------------------------------------------------------------- the words a death is named in


MIB = 1 << 20
#: Signals a process dies of: what each usually means here, and what to do.
SIGNAL_MEANINGS = {
    "SIGILL": "an instruction the CPU refused; on AMX CPUs vLLM CPU's kernels without AMX permission: keep edge-cpu "
              "installed in this venv (its vLLM plugin asks for it) and VLLM_PLUGINS naming edge_cpu_amx if set",
    "SIGKILL": "killed from outside: the OOM killer, a cgroup memory limit, or a user",
    "SIGSEGV": "a crash in native code; report it to vLLM with the engine log",
    "SIGABRT": "native code aborted (an assertion in a kernel or library); the engine log names it",
    "SIGBUS": "a bad memory access, often a truncated memory-mapped checkpoint file; re-download the weights",
}
#: How a session gets smaller, in every OOM remedy.
SMALLER_SESSION = "a shorter --max-model-len or fewer --max-num-seqs shrink the KV pool; `edge plan` shows what fits"


def mib(value: int | None) -> str:
    return "?" if value is None else f"{value / MIB:,.0f} MiB"


def oom_words(name: str, signame: str | None, *, kill: KernelKill | None, cgroup: str, limit_bytes: int | None,
              rise: tuple[str, int, int] | None, failcnt: int | None, kernel_log_unreadable: str | None) -> str:
    """``pid 4122 (VLLM::Worker) was killed by the kernel's OOM killer (SIGKILL): memory cgroup /a hit its limit
    of 1,536 MiB (oom_kill 0 -> 1 during this session, failcnt 12); the kernel log: "..."``. ``cgroup`` is named
    where the kernel's line does not name the one whose limit was hit."""
    by = f" ({signame})" if signame else ""
    evidence = []
    if rise is not None:
        evidence.append(f"oom_kill {rise[1]} -> {rise[2]} during this session")
    if failcnt:
        evidence.append(f"failcnt {failcnt:,}")
    if kill is not None and kill.scope == "host":
        where = "the host ran out of memory"
    else:
        limit = f"its limit of {mib(limit_bytes)}" if limit_bytes is not None else "its limit"
        where = f"memory cgroup {kill.memcg if kill is not None and kill.memcg else cgroup} hit {limit}"
    text = (f"{name} was killed by the kernel's OOM killer{by}: {where}"
            + (f" ({', '.join(evidence)})" if evidence else ""))
    if kill is not None:
        text += f"; the kernel log: \"{kill.line[:240]}\""
    elif kernel_log_unreadable:
        text += f" (the kernel log is not readable here: {kernel_log_unreadable})"
    return text


def not_oom_evidence(count: int | None, *, has_cgroup: bool | None, kernel_log_unreadable: str | None) -> str:
    """`` (the evidence)`` that a death was not the OOM killer's: the cgroup's unchanged count (``has_cgroup``
    None: its cgroup is not known here), and the kernel log's silence or why it was not read."""
    if has_cgroup is None:
        counted = "its memory cgroup is not known here"
    elif not has_cgroup:
        counted = "this process has no memory cgroup"
    else:
        counted = (f"the cgroup's oom_kill count stayed {count}" if count is not None
                   else "the cgroup shows no oom_kill count")
    if kernel_log_unreadable:
        return (f" ({counted}; the kernel log, which would name an OOM kill, is not readable here: "
                f"{kernel_log_unreadable})")
    return f" ({counted}, and the kernel log names no OOM kill of it)"


def oom_remedy(*, host: bool, limit_bytes: int | None, admission_bytes: int | None, held_bytes: int | None,
               headroom_bytes: int | None, usage_before_bytes: int | None) -> str:
    """What to do after an OOM kill: the plan's admission against the limit that was hit, or a smaller session."""
    if host:
        return f"remedy: free memory on this host (stop other processes) or plan a smaller session: {SMALLER_SESSION}"
    if admission_bytes is None or limit_bytes is None:
        return f"remedy: raise the memory limit or plan a smaller session: {SMALLER_SESSION}"
    admitted = f"the plan admitted {mib(admission_bytes)} (held peak {mib(held_bytes)} + headroom {mib(headroom_bytes)})"
    if admission_bytes > limit_bytes:
        return (f"remedy: {admitted}, more than this limit of {mib(limit_bytes)}: raise the cgroup's memory limit to "
                f"at least {mib(admission_bytes)}, or plan a smaller session: {SMALLER_SESSION}")
    return (f"remedy: {admitted}, within this limit of {mib(limit_bytes)}; the cgroup already held "
            f"{mib(usage_before_bytes)} before this session: stop what else runs in it, or plan a smaller session: "
            f"{SMALLER_SESSION}; if nothing else ran there the plan under-predicted: report it with `edge plan --json`")


def last_measured_words(age_s: float, tree_pss_bytes: int | None, tree_rss_bytes: int | None, title: str | None,
                        own_pss_bytes: int | None) -> str:
    """``last measured 0.3 s before it ended: the session's process tree at 1,410 MiB PSS, 1,702 MiB RSS,
    VLLM::Worker 812 MiB``."""
    own = f", {title or 'it'} {mib(own_pss_bytes)}" if own_pss_bytes else ""
    return (f"last measured {max(0.0, age_s):.1f} s before it ended: the session's process tree at "
            f"{mib(tree_pss_bytes)} PSS, {mib(tree_rss_bytes)} RSS{own}")


# ---------------------------------------------------------------- the front's note and its death


class FrontNote:
    """What the front leaves its reaper, to be read only if it dies: JSON documents in an anonymous file.

    The front writes each slot in place — ``facts`` once a session's death
    watch knows them (:func:`~edge_core.runtime.deaths.front_facts`),
    ``reading`` at every memory sample, ``leaving`` before it ends on purpose
    without stopping — and the reaper, which inherits the descriptor, reads them
    once, after the front has ended. A memfd (else an unlinked temporary file):
    no path, nothing left behind. A slot is one write of at most a few pages
    padded to its size, so a front killed mid-write leaves the slot whole or
    unreadable, never another slot damaged.
    """

    #: slot -> (offset, size in bytes).
    SLOTS = {"facts": (0, 12288), "reading": (12288, 1024), "leaving": (13312, 1024)}
    SIZE_BYTES = 14336

    def __init__(self, fd: int):
        self.fd = fd
        self._lock = threading.Lock()

    @classmethod
    def create(cls) -> FrontNote | None:
        """A new note; None where no anonymous file can be made (the reaper then names the death with less)."""
        try:
            fd = os.memfd_create("edge-front-note", getattr(os, "MFD_CLOEXEC", 0))
        except (AttributeError, OSError):
            import tempfile  # only here: the reaper itself never needs it, and it costs its start

            try:
                with tempfile.TemporaryFile() as handle:
                    fd = os.dup(handle.fileno())
            except OSError:
                return None
        try:
            os.ftruncate(fd, cls.SIZE_BYTES)
        except OSError:
            os.close(fd)
            return None
        return cls(fd)

    def write(self, slot: str, value: Any) -> bool:
        """Put ``value`` (JSON) in ``slot``; False when it does not fit or cannot be written."""
        offset, size = self.SLOTS[slot]
        data = json.dumps(value, separators=(",", ":")).encode()
        if len(data) > size:
            return False
        with self._lock:
            if self.fd < 0:
                return False
            try:
                os.pwrite(self.fd, data.ljust(size, b" "), offset)
            except OSError:
                return False
        return True

    @classmethod
    def read(cls, fd: int) -> dict[str, Any]:
        """Every slot that holds a whole document, by name."""
        out = {}
        for slot, (offset, size) in cls.SLOTS.items():
            try:
                raw = os.pread(fd, size, offset).strip(b"\0 ")
            except OSError:
                continue
            if raw:
                try:
                    out[slot] = json.loads(raw)
                except ValueError:
                    continue
        return out

    def close(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def keyed_counts(text: str | None) -> dict[str, int]:
    """``key value`` lines (``memory.oom_control``, ``memory.events``, ``memory.stat``) as integers."""
    out = {}
    for line in (text or "").splitlines():
        key, _, value = line.strip().partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _limit(text: str | None) -> int | None:
    """A limit file's bytes: v1's ``memory.limit_in_bytes`` or v2's ``memory.max`` (None: no limit)."""
    text = (text or "").strip()
    return int(text) if text.isdigit() and int(text) < CGROUP_UNLIMITED else None


class FrontDeath(NamedTuple):
    """How the front ended, as its reaper tells from outside, and the one sentence it says about it.

    Made from the front's note (``facts``: see :func:`~edge_core.runtime.deaths.front_facts`;
    ``reading``: the sampler's last), the counter and limit files the facts
    name, read again now, and the kernel log the reaper opened at its start.
    """

    pid: int
    #: Popen's returncode (-N: signal N) read from its zombie; None when its parent took the status first.
    returncode: int | None
    facts: Mapping[str, Any]
    reading: Mapping[str, Any] | None
    #: (cgroup path, ``oom_kill`` count now) for each counter the facts name, and those that rose since the start.
    counts: tuple[tuple[str, int], ...]
    rises: tuple[tuple[str, int, int], ...]
    #: The limit that binds now (the least of the levels the facts name) and whose it is.
    limit_bytes: int | None
    limit_path: str | None
    failcnt: int | None
    #: The kernel log's OOM kill of the front, and any other kills it logged since the reaper started.
    kill: KernelKill | None
    others: tuple[KernelKill, ...]
    kernel_log_unreadable: str | None
    #: Monotonic seconds when the front was found ended.
    at_s: float
    #: (pid, title) of the session's engine processes the reaper ended after it.
    ended: tuple[tuple[int, str | None], ...] = ()

    @classmethod
    def read(cls, pid: int, returncode: int | None, note: Mapping[str, Any], kernel_log: KernelLog | None,
             at_s: float) -> FrontDeath:
        facts = note.get("facts") or {}
        cgroup = facts.get("cgroup") or {}
        counts, rises = [], []
        for path, file, before in cgroup.get("oom_kill") or ():
            now = keyed_counts(_read_text(file)).get("oom_kill")
            if now is not None:
                counts.append((path, now))
                if now > before:
                    rises.append((path, before, now))
        limits = [(path, value) for path, file in cgroup.get("limits") or ()
                  if (value := _limit(_read_text(file))) is not None]
        limit_path, limit_bytes = min(limits, key=lambda item: item[1]) if limits else (None, None)
        failcnt = None
        if cgroup.get("failcnt"):
            file, key = cgroup["failcnt"]
            text = (_read_text(file) or "").strip()
            failcnt = keyed_counts(text).get(key) if key else (int(text) if text.isdigit() else None)
        kills = kernel_log.kills() if kernel_log is not None else {}
        return cls(pid=pid, returncode=returncode, facts=facts, reading=note.get("reading"), counts=tuple(counts),
                   rises=tuple(rises), limit_bytes=limit_bytes, limit_path=limit_path, failcnt=failcnt,
                   kill=kills.get(pid), others=tuple(k for p, k in kills.items() if p != pid),
                   kernel_log_unreadable=kernel_log.unreadable if kernel_log is not None else None, at_s=at_s)

    @property
    def name(self) -> str:
        return f"pid {self.pid} ({self.facts.get('name') or 'edge'})"

    @property
    def oom(self) -> bool:
        """The OOM killer's: the kernel log names the front, or (the log silent on it and on everyone else, or not
        readable) the cgroup's count rose. Never for a status that is not SIGKILL."""
        if self.returncode is not None and self.returncode != -signal.SIGKILL:
            return False
        return self.kill is not None or (bool(self.rises) and not self.others)

    def describe(self) -> str:
        """The death in words: how, the last reading, its engine processes, the remedy, the engine log."""
        parts = [self._how()]
        reading = self.reading
        if reading:
            parts.append(last_measured_words(self.at_s - float(reading.get("at_s", self.at_s)),
                                             reading.get("tree_pss_bytes"), reading.get("tree_rss_bytes"),
                                             self.facts.get("name"), reading.get("own_pss_bytes")))
        if self.ended:
            parts.append("its engine processes were ended: "
                         + ", ".join(f"pid {pid} ({title or 'engine process'})" for pid, title in self.ended))
        elif self.facts.get("in_process"):
            parts.append("vLLM's engine ran inside it and ended with it")
        parts.append(self._remedy())
        log = self.facts.get("engine_log")
        return "; ".join(p for p in parts if p) + (f". The engine log is {log}" if log else "")

    def _how(self) -> str:
        running = self.facts.get("running")
        name = self.name
        if self.oom:
            signame = signal_name(self.returncode) or ("SIGKILL" if self.kill is not None else None)
            cgroup = self.facts.get("cgroup") or {}
            return oom_words(name, signame, kill=self.kill, cgroup=self.limit_path or cgroup.get("path") or "?",
                             limit_bytes=self.limit_bytes, rise=self.rises[0] if self.rises else None,
                             failcnt=self.failcnt, kernel_log_unreadable=self.kernel_log_unreadable)
        what = f", running {running}," if running else ""
        code = self.returncode
        signame = signal_name(code)
        if code is None:
            return (f"{name}{what} ended without stopping its session: not by the OOM killer{self._not_oom()}; "
                    "killed by a signal this watcher cannot see (a SIGKILL from someone else: a user's kill -9, a "
                    "supervisor or a container runtime; or a crash): its exit status went to its parent, which this "
                    "watcher is not, before it could be read")
        if signame == "SIGKILL":
            return (f"{name}{what} was killed by SIGKILL from outside edge: not by the OOM killer{self._not_oom()}, "
                    "so by a user's kill -9, a supervisor or a container runtime")
        if signame is not None:
            return f"{name}{what} was killed by {signame} ({SIGNAL_MEANINGS.get(signame, 'a signal')})"
        return (f"{name}{what} exited with code {code} without stopping its session: something in it ended the "
                "process past edge's own cleanup")

    def _not_oom(self) -> str:
        if self.rises and self.others:
            _, before, after = self.rises[0]
            victims = ", ".join(f"pid {k.pid} ({k.name})" for k in self.others[:3])
            return f" (the cgroup's oom_kill count rose {before} -> {after}, but the kernel log names another victim: " \
                   f"{victims})"
        has_cgroup = None if "cgroup" not in self.facts else self.facts["cgroup"] is not None
        return not_oom_evidence(self.counts[0][1] if self.counts else None, has_cgroup=has_cgroup,
                                kernel_log_unreadable=self.kernel_log_unreadable)

    def _remedy(self) -> str:
        if self.oom:
            plan = self.facts.get("plan") or {}
            return oom_remedy(host=self.kill is not None and self.kill.scope == "host", limit_bytes=self.limit_bytes,
                              admission_bytes=plan.get("admission_bytes"), held_bytes=plan.get("held_bytes"),
                              headroom_bytes=plan.get("headroom_bytes"),
                              usage_before_bytes=(self.facts.get("cgroup") or {}).get("usage_before_bytes"))
        signame = signal_name(self.returncode)
        if self.returncode is None or signame == "SIGKILL":
            return "remedy: find what ended it and start again"
        if signame is not None:
            return "remedy: see the meaning above; the engine log has the engine's last words"
        return "remedy: report it with the engine log"


def title_of(pid: int) -> str | None:
    """The process's title: vLLM's setproctitle writes ``VLLM::EngineCore`` over its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            first = handle.read(4096).split(b"\0", 1)[0].decode("utf-8", errors="replace").strip()
    except OSError:
        return None
    return first or None


def say(text: str) -> None:
    """Write one line on stderr (the front's, inherited); nothing if it is gone."""
    data = text.encode("utf-8", errors="replace")
    try:
        while data:
            data = data[os.write(2, data):]
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="End an edge session's engine processes when its front dies.")
    parser.add_argument("--front", type=int, required=True, help="the front process's pid")
    parser.add_argument("--front-start", type=float, required=True, help="its start time (psutil create_time)")
    parser.add_argument("--session", required=True, help="the session marker's value")
    parser.add_argument("--note", type=int, help="the front's note, an inherited file descriptor (FrontNote)")
    parser.add_argument("--kernel-log", default=KMSG_PATH, help="the kernel log to read an OOM kill from")
    args = parser.parse_args(argv)
    pidfd = watch(args.front)
    # Checked after the pidfd is open: the pidfd then refers to the front itself, not a later holder of its pid.
    front_alive = is_same_process(args.front, args.front_start)
    kernel_log = KernelLog(args.kernel_log) if front_alive else None  # from here on: the front's kill comes later
    try:
        print("watching" if front_alive else "front gone", flush=True)
        sys.stdout.close()
    except OSError:
        pass  # the front is gone and took the pipe with it
    death = None
    if front_alive:
        wait_for_exit(args.front, args.front_start, pidfd)
        ended_at = time.monotonic()
        returncode = zombie_returncode(args.front)  # at once: its parent may reap it any moment
        note = FrontNote.read(args.note) if args.note is not None else {}
        if not note.get("leaving"):
            death = FrontDeath.read(args.front, returncode, note, kernel_log, ended_at)
    titles = {pid: title_of(pid) for pid, _ in marked_processes(args.session)}
    terminated, killed = end_marked(args.session)
    if death is not None:
        ended = tuple((pid, titles.get(pid)) for pid in dict.fromkeys(terminated + killed))
        say("edge: " + death._replace(ended=ended).describe() + "\n")
    return 0


#: The reapers this process has started and not yet ended, innermost last.
_ACTIVE: list[SessionReaper] = []


def leaving(why: str) -> None:
    """This process ends now on purpose without stopping its sessions (a forced stop, which says so itself): their
    reapers end the engine processes as always and say nothing about it."""
    for reaper in _ACTIVE:
        reaper.tell("leaving", why)


class SessionReaper:
    """While inside, processes this process starts carry a fresh session marker, and a reaper watches it.

    Entering starts the reaper (and waits until it is watching, so its own
    memory is in a baseline taken after), then sets the marker; leaving puts
    the environment back and ends the reaper — the session's own stop has
    ended the engine by then. ``watching`` is False when the reaper could not
    start; the session then runs unguarded, as before. Nested sessions each
    get their own marker. The reaper shares this process's stderr, to name
    its death there (:class:`FrontDeath`); :meth:`tell` writes its note.
    ``kernel_log`` replaces ``/dev/kmsg`` (tests use a file).
    """

    def __init__(self, *, kernel_log: str = KMSG_PATH) -> None:
        #: The marker's value: ``EDGE_SESSION_ID`` in every engine process this session starts.
        self.session_id = uuid.uuid4().hex
        self.kernel_log = kernel_log
        self.process: subprocess.Popen[bytes] | None = None
        self.watching = False
        self.note: FrontNote | None = None
        self._previous: dict[str, str | None] = {}

    def __enter__(self) -> SessionReaper:
        env = {key: value for key, value in os.environ.items() if key != MARKER}
        started = start_time(os.getpid())
        self.note = FrontNote.create()
        note = ["--note", str(self.note.fd)] if self.note is not None else []
        try:
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--front", str(os.getpid()),
                 "--front-start", repr(started), "--session", self.session_id, "--kernel-log", self.kernel_log,
                 *note],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True, close_fds=True,
                pass_fds=(self.note.fd,) if self.note is not None else (), env=env)
        except OSError:
            self.process = None
        if self.process is not None and self.process.stdout is not None:
            ready, _, _ = select.select([self.process.stdout], [], [], READY_TIMEOUT_S)
            self.watching = bool(ready) and self.process.stdout.readline().strip() == b"watching"
            self.process.stdout.close()
        for key, value in {MARKER: self.session_id, **KEEP_ENVIRON}.items():
            self._previous[key] = os.environ.get(key)
            os.environ[key] = value
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        for key, value in self._previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._previous = {}
        process, self.process = self.process, None
        if process is not None:
            process.terminate()
            try:
                process.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.note is not None:
            self.note.close()
            self.note = None
        self.watching = False

    def tell(self, slot: str, value: Any) -> None:
        """Write ``value`` in the note's ``slot`` (:class:`FrontNote`) for the reaper to read if this process dies."""
        if self.note is not None:
            self.note.write(slot, value)

    def processes(self) -> list[tuple[int, float]]:
        """(pid, start time) of this session's live engine processes (:func:`marked_processes`)."""
        return marked_processes(self.session_id)


if __name__ == "__main__":
    sys.exit(main())
