"""The session's reaper (edge_core/runtime/reaper.py): engine processes die with the front, whatever kills it.

The hermetic tests run a tiny front script that does what a session does —
enter :class:`SessionReaper`, spawn a fake engine through the same own-group
spawner vLLM's processes take, which spawns a titled fake worker — and then
kill it with SIGKILL. Every process here is started by the test and ended by
the fixture; nothing else on the host is signalled. The ``vllm`` test does the
same to a real ``edge run``.

The front's own death, named: a front that enters the reaper and a
:class:`~edge_core.runtime.deaths.DeathWatch` on a fake cgroup root
(tests/fake_cgroups.py) and a fake kernel log is killed after the test has
moved the fake ``oom_kill`` count and written the kernel's line; the reaper's
one sentence comes back on the front's stderr, through a pipe it holds until
it exits. The real OOM kill of ``edge run`` in a child memory cgroup is in
tests/test_deaths.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from fake_cgroups import MIB, FakePlan, bump_v1, kmsg_record, mib, oom_lines, v1_root, v2_root

from edge_core.artifact import DEMO_MODEL
from edge_core.runtime.deaths import front_facts, read_cgroup_memory
from edge_core.runtime.reaper import (
    MARKER,
    FrontDeath,
    FrontNote,
    KernelLog,
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

bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True,
                             stderr=subprocess.DEVNULL)  # the front's stderr is the reaper's to hold, and the test's
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
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             stdin=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    started.add(front.pid)
    line = front.stdout.readline() if front.stdout else ""
    assert line, "the front script printed nothing"
    info = json.loads(line)
    for key in ("engine", "worker", "bystander", "reaper"):
        started.add(info[key])
    return front, info


def stderr_of(front: subprocess.Popen[str]) -> str:
    """The front's stderr to its end: the reaper holds it until it exits. Read before the front is waited for, so
    its zombie is there for the reaper to read its status from, as a parent that is not a shell leaves it."""
    assert front.stderr is not None
    err = front.stderr.read()
    front.wait(60)
    return err


def test_kill_9_of_the_front_ends_its_engine_and_nothing_else(tmp_path, started):
    front, info = start_front(tmp_path, started)
    assert info["watching"], "the reaper said it was watching before the engine started"
    assert sorted(info["listed"]) == sorted([info["engine"], info["worker"]])  # the session lists its processes
    assert has_marker(info["worker"], info["session"]), "the titled worker kept its marker (SPT_NOENV)"
    assert os.getpgid(info["engine"]) != os.getpgid(front.pid)  # out of the front's group, like vLLM's
    outsider = started.add(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)

    front.send_signal(signal.SIGKILL)
    err = stderr_of(front)

    assert gone_within([info["engine"], info["worker"], info["reaper"]]) == []
    assert marked_processes(info["session"]) == []
    assert running(info["bystander"]), "an unmarked process the front started before the session survives"
    assert running(outsider), "an unrelated process survives"
    # The front told its reaper nothing (no death watch here): it still says what it saw, and what it ended.
    assert err.count("\n") == 1, err  # one line
    assert err.startswith(f"edge: pid {front.pid} (edge) was killed by SIGKILL from outside edge: not by the OOM killer "
                          "(its memory cgroup is not known here"), err
    ended = err[err.index("its engine processes were ended: "):]
    assert f"pid {info['engine']} (" in ended and f"pid {info['worker']} (" in ended, err


def test_a_stopped_session_leaves_no_reaper(tmp_path, started):
    front, info = start_front(tmp_path, started, normal="stop")
    assert front.stdout is not None and front.stdout.readline().strip() == "stopped"
    assert not running(info["reaper"])  # ended and waited for by the session's stop
    front.kill()
    err = stderr_of(front)
    assert err == ""  # a front killed after its session stopped: no reaper left to speak of it


def test_a_front_that_exits_without_stopping_leaves_no_reaper(tmp_path, started):
    front, info = start_front(tmp_path, started, normal="exit")
    err = stderr_of(front)
    assert gone_within([info["reaper"]]) == []
    assert running(info["bystander"])
    assert err.startswith(f"edge: pid {front.pid} (edge) exited with code 0 without stopping its session: something "
                          "in it ended the process past edge's own cleanup;"), err


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


# ---------------------------------------------------------------- the front's own death, named

#: A front whose session has a death watch on a fake cgroup root and a fake kernel log (paths in argv), and one
#: memory sample; it prints its pid and waits (``wait``), stops its session (``stop``) or ends on purpose (``leave``).
WATCHED_FRONT = """
import json, os, sys, time
from pathlib import Path
from edge_core.runtime.deaths import DeathWatch
from edge_core.runtime.measure import Sample
from edge_core.runtime.reaper import SessionReaper, leaving
from fake_cgroups import MIB, FakePlan

root, kmsg, mode = sys.argv[1], sys.argv[2], sys.argv[3]

class Sampler:  # the session's sampler as the watch sees it: listener slots, and the processes seen
    on_new_process = on_sample = None
    def seen(self):
        return {{}}

reaper = SessionReaper(kernel_log=kmsg).__enter__()
sampler = Sampler()
watch = DeathWatch(FakePlan({predicted}, {headroom}), sampler, root=root, kmsg_path=kmsg, reaper=reaper).__enter__()
sampler.on_sample(Sample(monotonic_s=time.monotonic(), process_count=2, tree_rss_bytes={tree_rss},
                         tree_pss_bytes={tree_pss}, pss_fallback_processes=0, host_available_bytes=None,
                         device_bytes=None, process_pss_bytes=((os.getpid(), {own_pss}),)))
print(json.dumps({{"pid": os.getpid(), "reaper": reaper.process.pid, "watching": reaper.watching}}), flush=True)
if mode == "stop":
    watch.__exit__(None, None, None)
    reaper.__exit__()
    sys.exit(0)
if mode == "leave":
    leaving("a forced stop")
    os._exit(130)
time.sleep(600)
"""
PREDICTED, HEADROOM = 2080 * MIB, 616 * MIB
TREE_PSS, TREE_RSS, OWN_PSS = 1000 * MIB, 1200 * MIB, 900 * MIB
ENGINE_LOG = "/tmp/edge-logs-test/session.log"


def start_watched_front(tmp_path: Path, started: Started, root: Path, kmsg: Path,
                        mode: str = "wait") -> tuple[subprocess.Popen[str], dict]:
    script = tmp_path / "watched_front.py"
    script.write_text(WATCHED_FRONT.format(predicted=PREDICTED, headroom=HEADROOM, tree_pss=TREE_PSS,
                                           tree_rss=TREE_RSS, own_pss=OWN_PSS), encoding="utf-8")
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "EDGE_ENGINE_LOG": ENGINE_LOG,
           "PYTHONPATH": os.pathsep.join([str(REAPER.parents[2]), str(tests), os.environ.get("PYTHONPATH", "")])}
    env.pop(MARKER, None)
    front = subprocess.Popen([sys.executable, str(script), str(root), str(kmsg), mode], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env,
                             start_new_session=True)
    started.add(front.pid)
    line = front.stdout.readline() if front.stdout else ""
    assert line, "the front printed nothing: " + (front.stderr.read() if front.stderr else "")
    info = json.loads(line)
    started.add(info["reaper"])
    assert info["watching"]
    return front, info


def killed(front: subprocess.Popen[str]) -> str:
    """SIGKILL the front; its stderr, read to the end (the reaper's exit)."""
    front.send_signal(signal.SIGKILL)
    _, err = front.communicate(timeout=60)
    assert front.returncode == -signal.SIGKILL
    return err


def admission_words() -> str:
    # FakePlan's admission: the held peak (predicted less 256 MiB of file pages) + headroom.
    held = PREDICTED - 256 * MIB
    return f"the plan admitted {mib(held + HEADROOM)} (held peak {mib(held)} + headroom {mib(HEADROOM)})"


def test_an_oom_killed_front_is_named_by_its_reaper_with_the_cgroup_its_limit_count_and_kernel_line(tmp_path, started):
    root = v1_root(tmp_path / "root", limit=1536 * MIB)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(oom_lines(4242, "python3", "/process_api/abc/edge", seq=1))  # before the session: not its
    front, info = start_watched_front(tmp_path, started, root, kmsg)
    bump_v1(root, oom_kill=1, failcnt=12)
    with open(kmsg, "a") as handle:
        handle.write(oom_lines(front.pid, "python3", "/process_api/abc/edge", seq=600))
    err = killed(front)
    assert err.count("\n") == 1 and err.endswith("\n"), err  # one line
    line = f'Memory cgroup out of memory: Killed process {front.pid} (python3) total-vm:4261640kB'
    assert err.startswith(
        f"edge: pid {front.pid} (edge) was killed by the kernel's OOM killer (SIGKILL): memory cgroup "
        f"/process_api/abc/edge hit its limit of {mib(1536 * MIB)} (oom_kill 0 -> 1 during this session, failcnt 12); "
        f'the kernel log: "{line}'), err
    assert re.search(r"; last measured \d+\.\d s before it ended: the session's process tree at "
                     + re.escape(f"{mib(TREE_PSS)} PSS, {mib(TREE_RSS)} RSS, edge {mib(OWN_PSS)}; "), err), err
    assert "; vLLM's engine ran inside it and ended with it; " in err
    assert err.rstrip().endswith(
        f"; remedy: {admission_words()}, more than this limit of {mib(1536 * MIB)}: raise the cgroup's memory limit "
        f"to at least {mib(PREDICTED - 256 * MIB + HEADROOM)}, or plan a smaller session: a shorter --max-model-len or "
        f"fewer --max-num-seqs shrink the KV pool; `edge plan` shows what fits. The engine log is {ENGINE_LOG}"), err
    assert gone_within([info["reaper"]]) == []


def test_on_cgroup_v2_with_the_kernel_log_closed_the_count_names_the_oom(tmp_path, started):
    root = v2_root(tmp_path / "root", own_kills=0, parent_kills=3, parent_max=str(4096 * MIB))
    front, _ = start_watched_front(tmp_path, started, root, tmp_path / "no-kmsg")
    v2_root(tmp_path / "root", own_kills=1, parent_kills=4, parent_max=str(1024 * MIB))  # lowered while it ran
    err = killed(front)
    assert err.startswith(
        f"edge: pid {front.pid} (edge) was killed by the kernel's OOM killer (SIGKILL): memory cgroup /user.slice hit "
        f"its limit of {mib(1024 * MIB)} (oom_kill 0 -> 1 during this session, failcnt 7) (the kernel log is not "
        f"readable here: {tmp_path / 'no-kmsg'}: No such file or directory); last measured"), err
    assert f"remedy: {admission_words()}, more than this limit of {mib(1024 * MIB)}" in err


def test_a_front_killed_by_someone_else_is_not_called_an_oom(tmp_path, started):
    root = v1_root(tmp_path / "root", oom_kill=2)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    front, _ = start_watched_front(tmp_path, started, root, kmsg)
    err = killed(front)  # its parent, this test, reaps it only after the reaper has read its zombie
    assert err.startswith(
        f"edge: pid {front.pid} (edge), running SmolLM2-135M-Instruct on cpu, was killed by SIGKILL from outside "
        "edge: not by the OOM killer (the cgroup's oom_kill count stayed 2, and the kernel log names no OOM kill of "
        "it), so by a user's kill -9, a supervisor or a container runtime; last measured"), err
    assert err.rstrip().endswith(f"; remedy: find what ended it and start again. The engine log is {ENGINE_LOG}")


@pytest.mark.parametrize("mode", ["stop", "leave"])
def test_a_front_that_stops_its_session_or_leaves_on_purpose_gets_no_word(tmp_path, started, mode):
    root = v1_root(tmp_path / "root")
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    front, info = start_watched_front(tmp_path, started, root, kmsg, mode)
    _, err = front.communicate(timeout=60)
    assert front.returncode == (0 if mode == "stop" else 130)
    assert gone_within([info["reaper"]]) == []
    assert err == ""


def front_death(tmp_path: Path, returncode: int | None, *, kmsg_text: str = "", oom_kill: int = 0,
                limit: int = 1536 * MIB, usage: int = 700 * MIB) -> FrontDeath:
    """The reaper's account of pid 4100's death, from a note the front's death watch would write and fake files."""
    root = v1_root(tmp_path / "root", limit=limit, usage=usage)
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    note = FrontNote.create()
    assert note is not None
    try:
        note.write("facts", front_facts(FakePlan(PREDICTED, HEADROOM), read_cgroup_memory(root)))
        note.write("reading", {"at_s": 10.0, "tree_pss_bytes": TREE_PSS, "tree_rss_bytes": TREE_RSS,
                               "own_pss_bytes": OWN_PSS})
        log = KernelLog(str(kmsg))
        bump_v1(root, oom_kill=oom_kill)
        with open(kmsg, "a") as handle:
            handle.write(kmsg_text)
        return FrontDeath.read(4100, returncode, FrontNote.read(note.fd), log, at_s=10.4)
    finally:
        note.close()


def test_a_status_its_parent_took_first_is_said_to_be_unknown_not_guessed(tmp_path):
    text = front_death(tmp_path, None).describe()
    assert text.startswith(
        "pid 4100 (edge), running SmolLM2-135M-Instruct on cpu, ended without stopping its session: not by the OOM "
        "killer (the cgroup's oom_kill count stayed 0, and the kernel log names no OOM kill of it); killed by a signal "
        "this watcher cannot see (a SIGKILL from someone else"), text
    assert "its exit status went to its parent, which this watcher is not, before it could be read" in text
    assert (f"; last measured 0.4 s before it ended: the session's process tree at {mib(TREE_PSS)} PSS, "
            f"{mib(TREE_RSS)} RSS, edge {mib(OWN_PSS)}; ") in text


def test_a_crash_of_the_front_is_named_with_what_the_signal_means(tmp_path):
    text = front_death(tmp_path, -signal.SIGSEGV).describe()
    assert text.startswith("pid 4100 (edge), running SmolLM2-135M-Instruct on cpu, was killed by SIGSEGV (a crash in "
                           "native code; report it to vLLM with the engine log)"), text


def test_a_rise_the_kernel_log_gives_to_another_process_is_not_the_fronts(tmp_path):
    death = front_death(tmp_path, None, oom_kill=1, kmsg_text=oom_lines(777, "python3", "/process_api/abc/edge"))
    assert not death.oom
    assert "not by the OOM killer (the cgroup's oom_kill count rose 0 -> 1, but the kernel log names another " \
           "victim: pid 777 (python3))" in death.describe()


def test_an_oom_within_the_limit_points_at_the_cgroups_other_tenants(tmp_path):
    death = front_death(tmp_path, None, oom_kill=1, limit=4096 * MIB, usage=2500 * MIB,
                        kmsg_text=oom_lines(4100, "python3", "/process_api/abc/edge"))
    assert death.oom
    assert (f"remedy: {admission_words()}, within this limit of {mib(4096 * MIB)}; the cgroup already held "
            f"{mib(2500 * MIB)} before this session: stop what else runs in it") in death.describe()


def test_a_host_oom_of_the_front_says_the_host_ran_out(tmp_path):
    line = kmsg_record(9, "Out of memory: Killed process 4100 (python3) total-vm:1kB, anon-rss:1kB")
    text = front_death(tmp_path, None, oom_kill=1, kmsg_text=line).describe()
    assert text.startswith("pid 4100 (edge) was killed by the kernel's OOM killer (SIGKILL): the host ran out of "
                           "memory (oom_kill 0 -> 1 during this session)"), text
    assert "remedy: free memory on this host (stop other processes)" in text


def test_the_note_keeps_each_slot_whole_and_says_nothing_of_an_unwritten_one():
    note = FrontNote.create()
    assert note is not None
    try:
        assert note.write("reading", {"at_s": 1.0, "tree_pss_bytes": 5})
        assert note.write("reading", {"at_s": 2.0})  # shorter: the rest of the slot is padding
        assert not note.write("leaving", "x" * 2000)  # too long for its slot: refused, not spilled
        assert FrontNote.read(note.fd) == {"reading": {"at_s": 2.0}}
    finally:
        note.close()
    assert not note.write("reading", {})  # closed


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
    # vLLM's engine core and worker in processes of their own (--distributed-executor-backend mp, as `edge serve`
    # and every parallel layout run them), so there is something for the reaper to end; an engine in edge's own
    # process (one rank's default) dies with it.
    proc = subprocess.Popen(
        [sys.executable, "-m", "edge_core", "run", "--model", str(DEMO_MODEL), "--max-tokens", "2000",
         "--ignore-eos", "--prompt", "Hello", "--distributed-executor-backend", "mp"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True)
    started.add(proc.pid)
    assert proc.stdout is not None and proc.stderr is not None
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.extend(iter(proc.stderr.readline, b"")), daemon=True)
    reader.start()
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
        reader.join(DEADLINE_S)  # to EOF: the reaper, the last holder of edge's stderr, has exited
        said = [line.decode() for line in err if line.startswith(f"edge: pid {proc.pid} (edge run)".encode())]
        assert len(said) == 1, b"".join(err).decode()[-3000:]
        print(said[0])
        # This test reaps edge at once, so the reaper may or may not have read its signal first; either way, no OOM.
        assert "not by the OOM killer (the cgroup's oom_kill count stayed " in said[0], said[0]
        assert all(f"pid {pid} (" in said[0].partition("its engine processes were ended: ")[2] for pid, _ in engine)
    finally:
        if proc.poll() is None:
            proc.kill()
