"""Which processes belong to an engine session, and who ends them when edge itself is killed?

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
process and exits, so the same sequence holds for both layouts.

The reaper runs by path, not with ``python -m``: it imports the standard
library and psutil only (no ``edge_core``, no vLLM), and starts in a fraction
of a second. It never signals a process without the marker.
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="End an edge session's engine processes when its front dies.")
    parser.add_argument("--front", type=int, required=True, help="the front process's pid")
    parser.add_argument("--front-start", type=float, required=True, help="its start time (psutil create_time)")
    parser.add_argument("--session", required=True, help="the session marker's value")
    args = parser.parse_args(argv)
    pidfd = watch(args.front)
    # Checked after the pidfd is open: the pidfd then refers to the front itself, not a later holder of its pid.
    front_alive = is_same_process(args.front, args.front_start)
    try:
        print("watching" if front_alive else "front gone", flush=True)
        sys.stdout.close()
    except OSError:
        pass  # the front is gone and took the pipe with it
    if front_alive:
        wait_for_exit(args.front, args.front_start, pidfd)
    end_marked(args.session)
    return 0


class SessionReaper:
    """While inside, processes this process starts carry a fresh session marker, and a reaper watches it.

    Entering starts the reaper (and waits until it is watching, so its own
    memory is in a baseline taken after), then sets the marker; leaving puts
    the environment back and ends the reaper — the session's own stop has
    ended the engine by then. ``watching`` is False when the reaper could not
    start; the session then runs unguarded, as before. Nested sessions each
    get their own marker.
    """

    def __init__(self) -> None:
        #: The marker's value: ``EDGE_SESSION_ID`` in every engine process this session starts.
        self.session_id = uuid.uuid4().hex
        self.process: subprocess.Popen[bytes] | None = None
        self.watching = False
        self._previous: dict[str, str | None] = {}

    def __enter__(self) -> SessionReaper:
        env = {key: value for key, value in os.environ.items() if key != MARKER}
        started = start_time(os.getpid())
        try:
            self.process = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--front", str(os.getpid()),
                 "--front-start", repr(started), "--session", self.session_id],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True, env=env)
        except OSError:
            self.process = None
        if self.process is not None and self.process.stdout is not None:
            ready, _, _ = select.select([self.process.stdout], [], [], READY_TIMEOUT_S)
            self.watching = bool(ready) and self.process.stdout.readline().strip() == b"watching"
            self.process.stdout.close()
        for key, value in {MARKER: self.session_id, **KEEP_ENVIRON}.items():
            self._previous[key] = os.environ.get(key)
            os.environ[key] = value
        return self

    def __exit__(self, *exc: object) -> None:
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
        self.watching = False

    def processes(self) -> list[tuple[int, float]]:
        """(pid, start time) of this session's live engine processes (:func:`marked_processes`)."""
        return marked_processes(self.session_id)


if __name__ == "__main__":
    sys.exit(main())
