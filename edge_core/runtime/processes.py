"""Which processes did this stage start, and how do they all end with it?

The engine processes vLLM spawns are edge's to end: started in a process
group of their own (so a terminal's Ctrl-C reaches edge first, which cancels
in order), found by walking this process's children, and reaped — waited
for, then terminated, then killed — when the stage stops. Their own group
also means nothing the kernel does to edge reaches them: when edge is killed
outright (SIGKILL, the OOM killer) the session's reaper (:mod:`.reaper`)
ends them instead, found by the session marker they inherit.
"""

from __future__ import annotations

import os
from typing import Any

import psutil

#: Seconds to wait for a terminated process before killing it.
KILL_GRACE_S = 5.0


def spawnv_passfds_own_group(path: str, args: list[str], passfds: Any, output_fd: int | None = None) -> int:
    """``multiprocessing.util.spawnv_passfds`` with the child in a process group of its own.

    Same contract as the original (exec ``path`` with ``args``, pass exactly
    ``passfds`` besides stdio, return the pid for multiprocessing to wait on),
    through ``os.posix_spawn`` with ``setpgroup=0``. With ``output_fd`` the
    child's stdout and stderr are that descriptor (the session's engine log).
    """
    keep = {0, 1, 2, *map(int, passfds)}
    actions: list[tuple[Any, ...]] = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep and fd != output_fd:
            try:
                if os.get_inheritable(fd):
                    actions.append((os.POSIX_SPAWN_CLOSE, fd))
            except OSError:
                continue  # the listing's own descriptor, already closed
    if output_fd is not None:
        actions += [(os.POSIX_SPAWN_DUP2, output_fd, 1), (os.POSIX_SPAWN_DUP2, output_fd, 2)]
    made_inheritable = []
    try:
        for fd in sorted(keep - {0, 1, 2}):
            if not os.get_inheritable(fd):
                os.set_inheritable(fd, True)
                made_inheritable.append(fd)
        return os.posix_spawn(path, list(args), os.environ, file_actions=actions, setpgroup=0)
    finally:
        for fd in made_inheritable:
            os.set_inheritable(fd, False)


class OwnProcessGroup:
    """While starting the engine, spawn vLLM's processes outside edge's process group.

    vLLM's engine core and worker install SIGINT handlers that shut them down,
    and a terminal's Ctrl-C goes to the whole foreground process group: the
    engine died under the request (EngineDeadError) before edge could abort
    it. In a group of their own they never see the terminal's SIGINT; edge
    cancels in order and stop() ends them. A blocked signal mask does not
    work: CPython's subprocess spawner resets the child's mask (both in
    docs/vllm-cpu-facts.md, "Ctrl-C and the engine's process group"). multiprocessing spawns the engine core and its resource tracker
    through ``util.spawnv_passfds``; the worker is spawned by the engine core
    and inherits its group. Only POSIX systems with ``os.posix_spawn``.
    """

    def __init__(self, output_fd: int | None = None) -> None:
        #: Where the spawned processes' stdout/stderr go (the engine log); None keeps the terminal.
        self.output_fd = output_fd

    def __enter__(self) -> OwnProcessGroup:
        from multiprocessing import util

        self._util = util
        self._original = util.spawnv_passfds
        if hasattr(os, "posix_spawn") and os.path.isdir("/proc/self/fd"):
            output_fd = self.output_fd

            def spawn(path: str, args: list[str], passfds: Any) -> int:
                return spawnv_passfds_own_group(path, args, passfds, output_fd)

            util.spawnv_passfds = spawn  # type: ignore[assignment]  # same contract, str path
        return self

    def __exit__(self, *exc: object) -> None:
        self._util.spawnv_passfds = self._original



def children() -> dict[int, psutil.Process]:
    try:
        return {p.pid: p for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return {}


def stop_resource_tracker(pids: tuple[int, ...]) -> None:
    """Stop multiprocessing's resource tracker if this stage started it.

    vLLM's spawn of the engine core starts the interpreter's resource tracker
    (``python -B -c 'from multiprocessing.resource_tracker import main...'``),
    which ignores SIGINT and SIGTERM and would otherwise outlive the stage
    until the interpreter exits. Closing its pipe is how multiprocessing itself
    ends it; the next user of multiprocessing starts a new one.
    """
    try:
        from multiprocessing import resource_tracker

        tracker = resource_tracker._resource_tracker
        if getattr(tracker, "_pid", None) in pids and hasattr(tracker, "_stop"):
            tracker._stop()
    except Exception:  # noqa: BLE001 — private API: if it moved, reap ends the process instead
        pass


def reap(pids: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """Wait for the stage's processes; terminate, then kill, what vLLM's shutdown left. Returns
    (still alive after all that, terminated, killed)."""
    stop_resource_tracker(pids)
    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                procs.append(proc)
        except psutil.Error:
            continue
    if not procs:
        return (), (), ()
    _, alive = psutil.wait_procs(procs, timeout=KILL_GRACE_S)
    terminated = tuple(p.pid for p in alive)
    for proc in alive:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=KILL_GRACE_S)
    killed = tuple(p.pid for p in alive)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=KILL_GRACE_S)
    return tuple(p.pid for p in alive), terminated, killed



def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie has ended)."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def children_alive() -> list[int]:
    """Pids of this process's live descendants."""
    try:
        return [p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []
