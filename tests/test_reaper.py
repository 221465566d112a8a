"""The session's reaper (edge_core/runtime/reaper.py): engine processes die with the front, whatever kills it.

The hermetic tests run a tiny front script that does what a session does —
enter :class:`SessionReaper`, spawn a fake engine through the same own-group
spawner vLLM's processes take, which spawns a titled fake worker — and then
kill it with SIGKILL. Every process here is started by the test and ended by
the fixture; nothing else on the host is signalled. The ``vllm`` test does the
same to a real ``edge run``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from edge_core.artifact import DEMO_MODEL
from edge_core.runtime.reaper import (
    MARKER,
    end_marked,
    has_marker,
    is_same_process,
    marked_processes,
    start_time,
    wait_for_exit,
)

NEEDS = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]
REAPER = Path(__file__).resolve().parents[1] / "edge_core" / "runtime" / "reaper.py"
#: Generous: the reaper's own grace is 3 s, and this 2-core host may be running an engine beside the test.
DEADLINE_S = 20.0

#: The fake engine: like vLLM's engine core, it spawns a worker that titles itself (setproctitle, when
#: installed, would overwrite /proc/PID/environ without SPT_NOENV), prints both pids, and waits forever.
FAKE_ENGINE = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", '''
try:
    import setproctitle
    setproctitle.setproctitle("VLLM::Worker")
except ImportError:
    pass
import time
print("titled", flush=True)
time.sleep(600)
'''], stdout=subprocess.PIPE)
worker.stdout.readline()
print(worker.pid, flush=True)
time.sleep(600)
"""

FRONT = """
import json, os, subprocess, sys, time
from edge_core.runtime.processes import spawnv_passfds_own_group
from edge_core.runtime.reaper import SessionReaper

bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
read, write = os.pipe()
reaper = SessionReaper().__enter__()
engine = spawnv_passfds_own_group(sys.executable, [sys.executable, "-c", {engine!r}], [], output_fd=write)
os.close(write)
worker = int(os.fdopen(read).readline())
print(json.dumps({{"engine": engine, "worker": worker, "bystander": bystander.pid, "session": reaper.session_id,
                  "reaper": reaper.process.pid, "watching": reaper.watching,
                  "listed": sorted(pid for pid, _ in reaper.processes())}}), flush=True)
if {normal!r} == "stop":
    os.kill(engine, 9); os.waitpid(engine, 0); os.kill(worker, 9)
    reaper.__exit__()
    print("stopped", flush=True)
elif {normal!r} == "exit":
    os.kill(engine, 9); os.waitpid(engine, 0); os.kill(worker, 9)
    os._exit(0)  # no stop: the reaper must notice the front is gone and find nothing to end
time.sleep(600)
"""


class Started:
    """Processes a test started, by (pid, start time): ended at teardown, never a reused pid."""

    def __init__(self) -> None:
        self.procs: list[tuple[int, float]] = []

    def add(self, pid: int) -> int:
        started = start_time(pid)
        if started is not None:
            self.procs.append((pid, started))
        return pid

    def end(self) -> None:
        for pid, started in self.procs:
            if is_same_process(pid, started):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass


@pytest.fixture
def started():
    mine = Started()
    try:
        yield mine
    finally:
        mine.end()


def running(pid: int, started: float | None = None) -> bool:
    """True while ``pid`` runs (a zombie has ended), and is still the process that started at ``started``."""
    now = start_time(pid)
    return now is not None and (started is None or abs(now - started) < 0.01)


def gone_within(pids: list[int], seconds: float = DEADLINE_S) -> list[int]:
    """The pids still running after waiting up to ``seconds`` for all of them to end."""
    first = {pid: start_time(pid) for pid in pids}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = [pid for pid in pids if first[pid] is not None and running(pid, first[pid])]
        if not left:
            return []
        time.sleep(0.2)
    return [pid for pid in pids if first[pid] is not None and running(pid, first[pid])]


def start_front(tmp_path: Path, started: Started, normal: str = "") -> tuple[subprocess.Popen[str], dict]:
    script = tmp_path / "front.py"
    script.write_text(FRONT.format(engine=FAKE_ENGINE, normal=normal), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REAPER.parents[2]), os.environ.get("PYTHONPATH", "")])}
    env.pop(MARKER, None)
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             text=True, env=env, start_new_session=True)
    started.add(front.pid)
    line = front.stdout.readline() if front.stdout else ""
    assert line, "the front script printed nothing"
    info = json.loads(line)
    for key in ("engine", "worker", "bystander", "reaper"):
        started.add(info[key])
    return front, info


def test_kill_9_of_the_front_ends_its_engine_and_nothing_else(tmp_path, started):
    front, info = start_front(tmp_path, started)
    assert info["watching"], "the reaper said it was watching before the engine started"
    assert sorted(info["listed"]) == sorted([info["engine"], info["worker"]])  # the session lists its processes
    assert has_marker(info["worker"], info["session"]), "the titled worker kept its marker (SPT_NOENV)"
    assert os.getpgid(info["engine"]) != os.getpgid(front.pid)  # out of the front's group, like vLLM's
    outsider = started.add(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)

    front.send_signal(signal.SIGKILL)
    front.wait()

    assert gone_within([info["engine"], info["worker"], info["reaper"]]) == []
    assert marked_processes(info["session"]) == []
    assert running(info["bystander"]), "an unmarked process the front started before the session survives"
    assert running(outsider), "an unrelated process survives"


def test_a_stopped_session_leaves_no_reaper(tmp_path, started):
    front, info = start_front(tmp_path, started, normal="stop")
    assert front.stdout is not None and front.stdout.readline().strip() == "stopped"
    assert not running(info["reaper"])  # ended and waited for by the session's stop
    front.kill()
    front.wait()


def test_a_front_that_exits_without_stopping_leaves_no_reaper(tmp_path, started):
    front, info = start_front(tmp_path, started, normal="exit")
    front.wait()
    assert gone_within([info["reaper"]]) == []
    assert running(info["bystander"])


def test_a_reused_pid_is_not_the_front(started):
    """A live process whose start time is not the front's is a later holder of the pid: the front is gone."""
    me = os.getpid()
    assert is_same_process(me, start_time(me) or 0.0)
    assert not is_same_process(me, (start_time(me) or 0.0) - 1.0)
    assert not is_same_process(2**22 + 1, 0.0)  # above Linux's pid_max: no such process
    wait_for_exit(me, (start_time(me) or 0.0) - 1.0, pidfd=None)  # returns at once: not the front's pid

    # the reaper itself, told a live unmarked process is the front with the wrong start time: it takes the
    # front for gone, ends the session's marked process, and leaves the pid's real owner alone
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    started.add(holder.pid)
    session = "test" + os.urandom(8).hex()
    marked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              env={**os.environ, MARKER: session})
    started.add(marked.pid)
    deadline = time.monotonic() + DEADLINE_S
    while not has_marker(marked.pid, session) and time.monotonic() < deadline:
        time.sleep(0.05)  # until the child has exec'd with its environment
    reaper = subprocess.run(
        [sys.executable, str(REAPER), "--front", str(holder.pid), "--front-start",
         repr((start_time(holder.pid) or 0.0) - 5.0), "--session", session],
        capture_output=True, text=True, timeout=60)
    assert reaper.returncode == 0 and reaper.stdout.strip() == "front gone", reaper.stderr
    assert marked.wait(DEADLINE_S) == -signal.SIGTERM
    assert holder.poll() is None


def test_end_marked_kills_what_ignores_sigterm(started):
    session = "test" + os.urandom(8).hex()
    stubborn = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                               "print('ready', flush=True); time.sleep(600)"],
        env={**os.environ, MARKER: session}, stdout=subprocess.PIPE, text=True)
    started.add(stubborn.pid)
    assert stubborn.stdout is not None and stubborn.stdout.readline().strip() == "ready"
    terminated, killed = end_marked(session, grace_s=0.5)
    assert terminated == [stubborn.pid] and killed == [stubborn.pid]
    assert not running(stubborn.pid)  # psutil waited for it: it was this test's child


def test_marked_processes_names_only_the_session():
    assert marked_processes("no-such-session-" + os.urandom(8).hex()) == []
    assert not has_marker(os.getpid(), "anything")


# ---------------------------------------------------------------- real vLLM CPU

def is_reaper(cmd: list[str]) -> bool:
    """The reaper's command line, wherever edge_core is installed (the checkout, or a wheel under nox)."""
    return "--front" in cmd and any(Path(arg).name == "reaper.py" for arg in cmd)


def tree_of(pid: int) -> list[tuple[int, float, list[str]]]:
    """(pid, start time, command line) of ``pid``'s live descendants."""
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            out.append((child.pid, child.create_time(), child.cmdline()))
        except psutil.Error:
            continue
    return out


@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(bool(NEEDS), reason=f"needs the real vLLM CPU build and edge-cpu; missing: {NEEDS}")
def test_kill_9_of_edge_run_leaves_no_engine_process(started):
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_core", "run", "--model", str(DEMO_MODEL), "--max-tokens", "2000",
         "--ignore-eos", "--prompt", "Hello"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    started.add(proc.pid)
    assert proc.stdout is not None and proc.stderr is not None
    err: list[bytes] = []
    threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, b"")), daemon=True).start()
    try:
        seen = b""
        while not seen.partition(b"nothing loaded")[2].strip():  # the plan, then streamed text: the engine is up
            chunk = proc.stdout.read1(4096)
            assert chunk, "stdout closed before any token: " + b"".join(err).decode()[-3000:]
            seen += chunk
        tree = tree_of(proc.pid)
        reaper = next(cmd for _pid, _t, cmd in tree if is_reaper(cmd))
        session = reaper[reaper.index("--session") + 1]
        engine = [(pid, t) for pid, t, cmd in tree if not is_reaper(cmd)]
        started.procs.extend(engine)
        assert len(engine) >= 2, tree  # vLLM's engine core and worker, at least
        assert {pid for pid, _ in engine} <= {pid for pid, _ in marked_processes(session)}, \
            "every engine process carries the session's marker, titled ones too"

        os.kill(proc.pid, signal.SIGKILL)  # the front only, as the OOM killer would
        proc.wait(30)
        killed_at = time.monotonic()

        deadline = killed_at + DEADLINE_S
        while time.monotonic() < deadline and (marked_processes(session)
                                               or any(running(pid, t) for pid, t in engine)):
            time.sleep(0.2)
        print(f"engine gone {time.monotonic() - killed_at:.1f} s after kill -9 of the front")
        assert marked_processes(session) == []
        assert [pid for pid, t in engine if running(pid, t)] == []
    finally:
        if proc.poll() is None:
            proc.kill()
