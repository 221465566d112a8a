"""Tests for edge_core.runtime.deaths: every engine death named, with the cgroup, the kernel log and the last reading.

Hermetic tests build fake roots (``proc/self/cgroup``, ``proc/self/mountinfo``
and the cgroup files of v1's memory controller or v2), a fake kernel log (a
file of ``/dev/kmsg`` records) and fake exit records; two read real zombies.
The engine test at the end runs ``edge run`` on SmolLM2 in a child memory
cgroup of this process's own, lowers the limit once the engine's worker is
up, and checks that the error names the OOM kill, the process and the limit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from fake_cgroups import MIB, FakePlan, bump_v1, kmsg_record, mib, oom_lines, v1_root, v2_root, write

from edge_core.errors import EngineDied, StageError
from edge_core.runtime import deaths
from edge_core.runtime.deaths import (
    DeathWatch,
    Exit,
    KernelLog,
    account,
    failure,
    read_cgroup_memory,
    zombie_returncode,
)
from edge_core.runtime.measure import SeenProcess

HANG_GUARD_S = 30.0


class FakeSampler:
    """What the session's sampler hands the watch: the processes it saw and the listener slot."""

    def __init__(self, seen: dict[int, SeenProcess]):
        self._seen = seen
        self.on_new_process = None

    def seen(self) -> dict[int, SeenProcess]:
        return dict(self._seen)


class FakeExits:
    """Exit records as the recorder would have read them from each zombie."""

    def __init__(self, exits: list[Exit]):
        self._exits = {e.pid: e for e in exits}
        self.watched: list[int] = []

    def watch(self, pid: int) -> None:
        self.watched.append(pid)

    def exits(self) -> dict[int, Exit]:
        return dict(self._exits)

    def close(self) -> None:
        pass


def seen(pid: int, title: str, *, at: float, pss: int, tree_pss: int, tree_rss: int) -> SeenProcess:
    return SeenProcess(pid=pid, title=title, first_seen_s=at - 30, last_seen_s=at, pss_bytes=pss, rss_bytes=pss,
                       tree_pss_bytes=tree_pss, tree_rss_bytes=tree_rss)


# ---------------------------------------------------------------- the cgroup

def test_v1_reads_the_processes_own_memory_cgroup_and_the_limit_that_binds(tmp_path):
    root = v1_root(tmp_path, limit=None, parent_limit=3000 * MIB, oom_kill=2, under_oom=1, failcnt=41)
    cgroup = read_cgroup_memory(root)
    assert cgroup is not None and cgroup.version == 1
    assert cgroup.path == "/process_api/abc/edge"
    assert cgroup.directory == str(root / "sys/fs/cgroup/memory/process_api/abc/edge")
    # Its own limit is v1's "unlimited"; its parent's binds.
    assert (cgroup.limit_bytes, cgroup.limit_path) == (3000 * MIB, "/process_api/abc")
    assert cgroup.oom_kill_count() == 2 and cgroup.under_oom is True and cgroup.failcnt == 41
    assert cgroup.usage_bytes == 700 * MIB and cgroup.max_usage_bytes == 710 * MIB


def test_v1_its_own_limit_binds_when_it_is_the_smaller(tmp_path):
    cgroup = read_cgroup_memory(v1_root(tmp_path, limit=1536 * MIB, parent_limit=3000 * MIB))
    assert (cgroup.limit_bytes, cgroup.limit_path) == (1536 * MIB, "/process_api/abc/edge")


def test_v1_without_a_mountinfo_uses_the_usual_mount(tmp_path):
    cgroup = read_cgroup_memory(v1_root(tmp_path, mountinfo=False))
    assert cgroup is not None and cgroup.limit_bytes == 1536 * MIB


def test_v1_mounted_at_the_containers_own_cgroup(tmp_path):
    # A container sees its cgroup's folder mounted as the hierarchy: mountinfo's root names it.
    root = v1_root(tmp_path, own="/docker/c0ffee/edge", mount_root="/docker/c0ffee")
    cgroup = read_cgroup_memory(root)
    assert cgroup.directory == str(root / "sys/fs/cgroup/memory/edge")
    assert cgroup.limit_path == "/docker/c0ffee/edge"


def test_v2_counts_at_its_cgroup_and_each_ancestor_and_a_rise_is_this_sessions(tmp_path):
    root = v2_root(tmp_path, own_kills=0, parent_kills=3)
    before = read_cgroup_memory(root)
    assert before.version == 2 and before.path == "/user.slice/edge"
    assert before.oom_kills == (("/user.slice/edge", 0), ("/user.slice", 3))
    assert (before.limit_bytes, before.limit_path) == (2 << 30, "/user.slice")
    assert before.failcnt == 7 and before.usage_bytes == 300 * MIB and before.max_usage_bytes == 400 * MIB
    v2_root(tmp_path, own_kills=1, parent_kills=4)
    after = read_cgroup_memory(root)
    assert after.rises_since(before) == [("/user.slice/edge", 0, 1), ("/user.slice", 3, 4)]
    assert after.rises_since(None) == []


def test_v2_where_only_an_ancestor_shows_the_memory_controller(tmp_path):
    cgroup = read_cgroup_memory(v2_root(tmp_path, own_events=False, parent_kills=5))
    assert cgroup.oom_kills == (("/user.slice", 5),) and cgroup.oom_kill_count() == 5


def test_v2_without_the_memory_controller_is_none(tmp_path):
    write(tmp_path / "proc/self/cgroup", "0::/\n")
    write(tmp_path / "proc/self/mountinfo", "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    write(tmp_path / "sys/fs/cgroup/unified/cgroup.controllers", "")
    assert read_cgroup_memory(tmp_path) is None


def test_the_real_cgroup_of_this_process_reads_where_it_has_one():
    cgroup = read_cgroup_memory()
    if cgroup is None:
        pytest.skip("this process has no memory cgroup edge can read (no v1 memory controller, no v2 memory.events)")
    assert cgroup.version in (1, 2) and Path(cgroup.directory).is_dir()
    assert cgroup.usage_bytes is None or cgroup.usage_bytes > 0


# ---------------------------------------------------------------- the kernel log

def test_the_kernel_log_reads_only_what_was_written_after_it_was_opened(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text(oom_lines(111, "python3", "/other", seq=10))  # someone else's, before the session
    log = KernelLog(str(kmsg))
    with open(kmsg, "a") as handle:
        handle.write(kmsg_record(20, "random: crng init done"))
        handle.write(oom_lines(4122, "VLLM::Worker", "/process_api/abc/edge", seq=21))
    kills = log.kills()
    assert list(kills) == [4122]
    kill = kills[4122]
    assert (kill.name, kill.scope, kill.memcg) == ("VLLM::Worker", "cgroup", "/process_api/abc/edge")
    assert kill.line.startswith("Memory cgroup out of memory: Killed process 4122 (VLLM::Worker)")
    assert log.kills() == kills  # read once, kept
    log.close()


def test_a_host_oom_is_told_from_a_cgroups(tmp_path):
    kmsg = tmp_path / "kmsg"
    kmsg.write_text("")
    log = KernelLog(str(kmsg))
    kmsg.write_text(kmsg_record(3, "Out of memory: Killed process 77 (VLLM::EngineCor) total-vm:1kB, anon-rss:1kB"))
    assert log.kills()[77].scope == "host" and log.kills()[77].name == "VLLM::EngineCor"


def test_an_unreadable_kernel_log_says_why(tmp_path):
    log = KernelLog(str(tmp_path / "no-such-kmsg"))
    assert log.kills() == {}
    assert log.unreadable == f"{tmp_path / 'no-such-kmsg'}: No such file or directory"


# ---------------------------------------------------------------- exit statuses

def test_a_zombies_wait_status_is_read_from_its_stat(tmp_path):
    def stat(pid: int, state: str, status: int) -> None:
        rest = " ".join(["0"] * 48)
        write(tmp_path / str(pid) / "stat", f"{pid} (VLLM::Worker) {state} {rest} {status}\n")

    stat(10, "Z", signal.SIGKILL)
    stat(11, "Z", signal.SIGSEGV | 0x80)  # a core was dumped
    stat(12, "Z", 3 << 8)
    stat(13, "S", 0)
    assert zombie_returncode(10, tmp_path) == -signal.SIGKILL
    assert zombie_returncode(11, tmp_path) == -signal.SIGSEGV
    assert zombie_returncode(12, tmp_path) == 3
    assert zombie_returncode(13, tmp_path) is None  # still running
    assert zombie_returncode(14, tmp_path) is None  # reaped


def test_the_recorder_reads_a_grandchilds_signal_before_its_parent_reaps_it():
    # The grandchild's parent never waits (it has exec'd into sleep), as vLLM's engine core holds its worker
    # until its own poll: the status is the zombie's, read through the pidfd the recorder holds.
    if not hasattr(os, "pidfd_open"):
        pytest.skip("this Python or kernel has no pidfd_open")
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; exec sleep 60"], stdout=subprocess.PIPE, text=True)
    recorder = deaths.ExitRecorder()
    try:
        grandchild = int(parent.stdout.readline())
        recorder.watch(grandchild)
        os.kill(grandchild, signal.SIGSEGV)
        deadline = time.monotonic() + HANG_GUARD_S
        while grandchild not in recorder.exits() and time.monotonic() < deadline:
            time.sleep(0.02)
        found = recorder.exits()[grandchild]
    finally:
        recorder.close()
        parent.kill()
        parent.wait()
    assert (found.returncode, found.source) == (-signal.SIGSEGV, "its zombie's status")


def test_the_recorder_says_unknown_when_the_status_is_gone(tmp_path):
    # Reading through an empty /proc stands for a parent that reaped first.
    if not hasattr(os, "pidfd_open"):
        pytest.skip("this Python or kernel has no pidfd_open")
    child = subprocess.Popen(["sleep", "60"])
    recorder = deaths.ExitRecorder(proc_root=tmp_path)
    try:
        recorder.watch(child.pid)
        child.kill()
        deadline = time.monotonic() + HANG_GUARD_S
        while child.pid not in recorder.exits() and time.monotonic() < deadline:
            time.sleep(0.02)
        found = recorder.exits()[child.pid]
    finally:
        recorder.close()
        child.wait()
    assert (found.returncode, found.source) == (None, "unknown") and found.at_s is not None


# ---------------------------------------------------------------- the account

PLAN = FakePlan(predicted=2080 * MIB, headroom=616 * MIB)
WORKER, CORE = 4122, 4100


def watch_with(tmp_path, exits: list[Exit], seen_by_pid: dict[int, SeenProcess], *, kmsg_text: str = "",
               kmsg: bool = True, plan=PLAN, **cgroup) -> tuple[DeathWatch, Path]:
    root = v1_root(tmp_path / "root", **cgroup)
    kmsg_path = tmp_path / "kmsg"
    if kmsg:
        kmsg_path.write_text("")
    watch = DeathWatch(plan, FakeSampler(seen_by_pid), root=root, kmsg_path=str(kmsg_path),
                       recorder=FakeExits(exits)).__enter__()
    if kmsg and kmsg_text:
        with open(kmsg_path, "a") as handle:
            handle.write(kmsg_text)
    return watch, root


def engine_seen(at: float) -> dict[int, SeenProcess]:
    return {WORKER: seen(WORKER, "VLLM::Worker", at=at, pss=812 * MIB, tree_pss=1410 * MIB, tree_rss=1702 * MIB),
            CORE: seen(CORE, "VLLM::EngineCore", at=at, pss=400 * MIB, tree_pss=1410 * MIB, tree_rss=1702 * MIB)}


def test_an_oom_kill_names_the_process_the_cgroup_its_limit_and_count_the_kernels_line_and_the_remedy(tmp_path):
    t = 1000.0
    watch, root = watch_with(
        tmp_path, [Exit(WORKER, -signal.SIGKILL, t + 0.3, "its zombie's status"),
                   Exit(CORE, 1, t + 0.8, "its zombie's status")], engine_seen(t),
        kmsg_text=oom_lines(WORKER, "VLLM::Worker", "/process_api/abc/edge"), limit=1536 * MIB)
    bump_v1(root, oom_kill=1, failcnt=12)
    found = watch.account()
    watch.__exit__(None, None, None)
    assert [d.pid for d in found.deaths] == [WORKER, CORE] and found.oom and found.violent
    text = found.describe()
    assert text.startswith(f"pid {WORKER} (VLLM::Worker) was killed by the kernel's OOM killer (SIGKILL): memory "
                           f"cgroup /process_api/abc/edge hit its limit of {mib(1536 * MIB)} (oom_kill 0 -> 1 during "
                           "this session, failcnt 12)"), text
    assert f'the kernel log: "Memory cgroup out of memory: Killed process {WORKER} (VLLM::Worker)' in text
    assert (f"last measured 0.3 s before it ended: the session's process tree at {mib(1410 * MIB)} PSS, "
            f"{mib(1702 * MIB)} RSS, VLLM::Worker {mib(812 * MIB)}") in text
    assert f"then pid {CORE} (VLLM::EngineCore) exited with code 1" in text
    admission = PLAN.peak.admission_bytes
    assert (f"the plan admitted {mib(admission)} (held peak {mib(PLAN.peak.held_bytes)} + headroom "
            f"{mib(PLAN.peak.headroom_bytes)}), more than this limit of {mib(1536 * MIB)}: raise the cgroup's memory "
            f"limit to at least {mib(admission)}") in text
    assert "--max-model-len" in text and "`edge plan`" in text


def test_an_oom_known_only_by_the_cgroups_count_where_the_kernel_log_is_closed(tmp_path):
    # The worker's parent took its status first, and the kernel log cannot be read: the count still says OOM.
    t = 50.0
    watch, root = watch_with(tmp_path, [Exit(WORKER, None, t + 0.1, "unknown")], engine_seen(t), kmsg=False)
    bump_v1(root, oom_kill=1)
    found = watch.account()
    watch.__exit__(None, None, None)
    text = found.describe()
    assert text.startswith(f"pid {WORKER} (VLLM::Worker) was killed by the kernel's OOM killer: memory cgroup "
                           f"/process_api/abc/edge hit its limit of {mib(1536 * MIB)} (oom_kill 0 -> 1 during this "
                           "session)"), text
    assert f"(the kernel log is not readable here: {tmp_path / 'kmsg'}: No such file or directory)" in text


def test_an_oom_whose_plan_fit_the_limit_points_at_the_cgroups_other_tenants(tmp_path):
    t = 50.0
    watch, root = watch_with(tmp_path, [Exit(WORKER, -signal.SIGKILL, t + 0.1, "its zombie's status")],
                             engine_seen(t), limit=4096 * MIB, usage=2500 * MIB)
    bump_v1(root, oom_kill=3)
    text = watch.account().describe()
    watch.__exit__(None, None, None)
    assert f"within this limit of {mib(4096 * MIB)}; the cgroup already held {mib(2500 * MIB)} before" in text
    assert "report it with `edge plan --json`" in text


def test_sigkill_from_someone_else_is_not_called_an_oom(tmp_path):
    t = 9.0
    watch, _ = watch_with(tmp_path, [Exit(WORKER, -signal.SIGKILL, t + 2.0, "its zombie's status")], engine_seen(t))
    found = watch.account()
    watch.__exit__(None, None, None)
    assert not found.oom and found.violent
    assert found.describe().startswith(
        f"pid {WORKER} (VLLM::Worker) was killed by SIGKILL from outside edge and vLLM: not by the OOM killer (the "
        "cgroup's oom_kill count stayed 0, and the kernel log names no OOM kill of it), so by a user's kill -9")
    assert "last measured 2.0 s before it ended" in found.describe()


def test_a_status_taken_by_the_parent_with_no_oom_says_so_and_why_the_kernel_log_is_silent(tmp_path):
    watch, _ = watch_with(tmp_path, [Exit(WORKER, None, 3.0, "unknown")], engine_seen(2.5), kmsg=False)
    text = watch.account().describe()
    watch.__exit__(None, None, None)
    assert text.startswith(
        f"pid {WORKER} (VLLM::Worker) ended under the engine, its exit status collected before edge could read it; "
        "not by the OOM killer (the cgroup's oom_kill count stayed 0; the kernel log, which would name an OOM kill, is not "
        f"readable here: {tmp_path / 'kmsg'}: No such file or directory)"), text


@pytest.mark.parametrize("signum, meaning", [
    (signal.SIGSEGV, "a crash in native code"),
    (signal.SIGILL, "an instruction the CPU refused"),
    (signal.SIGBUS, "a bad memory access"),
    (signal.SIGABRT, "native code aborted"),
])
def test_a_crash_signal_is_named_with_what_it_means(tmp_path, signum, meaning):
    watch, _ = watch_with(tmp_path, [Exit(WORKER, -signum, 5.0, "its zombie's status")], engine_seen(4.0))
    text = watch.account().describe()
    watch.__exit__(None, None, None)
    assert text.startswith(f"pid {WORKER} (VLLM::Worker) was killed by {signal.Signals(signum).name} ({meaning}")


def test_clean_exits_and_other_programs_errors_are_not_deaths(tmp_path):
    helper = seen(900, "/usr/bin/lscpu", at=1.0, pss=MIB, tree_pss=MIB, tree_rss=MIB)
    watch, _ = watch_with(tmp_path, [Exit(CORE, 0, 2.0, "its zombie's status"),
                                     Exit(900, 1, 2.0, "its zombie's status")], {**engine_seen(1.0), 900: helper})
    found = watch.account()
    watch.__exit__(None, None, None)
    assert not found and found.deaths == ()


def test_an_exit_code_keeps_the_engine_logs_cause_lines_and_the_traceback_hint(tmp_path):
    watch, _ = watch_with(tmp_path, [Exit(CORE, 1, 2.0, "its zombie's status")], engine_seen(1.0))
    found = watch.account()
    watch.__exit__(None, None, None)
    error = failure("vLLM could not start on cpu", RuntimeError("Engine core initialization failed"), found,
                    ". From the engine log (x.log):\n    ValueError: bad config", "x.log")
    assert isinstance(error, EngineDied) and error.traceback_helps
    assert str(error) == (f"vLLM could not start on cpu: pid {CORE} (VLLM::EngineCore) exited with code 1; last "
                          f"measured 1.0 s before it ended: the session's process tree at {mib(1410 * MIB)} PSS, "
                          f"{mib(1702 * MIB)} RSS, VLLM::EngineCore {mib(400 * MIB)}; remedy: the engine log has the "
                          "process's own error. vLLM said: RuntimeError: Engine core initialization failed. From the "
                          "engine log (x.log):\n    ValueError: bad config")
    assert error.account["deaths"][0]["returncode"] == 1


def test_a_signal_death_points_at_the_log_not_its_traceback(tmp_path):
    watch, _ = watch_with(tmp_path, [Exit(WORKER, -signal.SIGSEGV, 2.0, "its zombie's status")], engine_seen(1.0))
    error = failure("the vLLM engine on cpu died during request r1 (EngineDeadError)", None, watch.account(),
                    ". From the engine log (x.log):\n    RuntimeError: cancelled", "x.log")
    watch.__exit__(None, None, None)
    assert isinstance(error, EngineDied) and not error.traceback_helps
    assert str(error).endswith(". The engine log is x.log") and "cancelled" not in str(error)


def test_no_death_found_keeps_vllms_words(tmp_path):
    watch, _ = watch_with(tmp_path, [], engine_seen(1.0))
    error = failure("vLLM could not start on cpu", ValueError("max_model_len too large"), watch.account(),
                    ". The engine log is x.log")
    watch.__exit__(None, None, None)
    assert type(error) is StageError
    assert str(error) == "vLLM could not start on cpu: ValueError: max_model_len too large. The engine log is x.log"


def test_the_engine_logs_code_fills_a_workers_unknown_status(tmp_path):
    log_path = tmp_path / "engine.log"
    log_path.write_text("ERROR 2026-12-07 02:12:32,672 28286 vllm.v1.executor.multiproc_executor: Worker proc "
                        "VllmWorker-0 died unexpectedly (exit code: -11), shutting down executor.\n")
    from edge_core.runtime.logs import EngineLog

    watch, _ = watch_with(tmp_path, [Exit(WORKER, None, 2.0, "unknown")], engine_seen(1.0))
    found = watch.account(engine_log=EngineLog(str(log_path)))
    watch.__exit__(None, None, None)
    assert (found.deaths[0].returncode, found.deaths[0].source) == (-signal.SIGSEGV, "the engine log")


def test_the_kernel_log_gives_the_signal_of_a_victim_whose_status_its_parent_took(tmp_path):
    watch, root = watch_with(tmp_path, [Exit(WORKER, None, 2.0, "unknown")], engine_seen(1.0),
                             kmsg_text=oom_lines(WORKER, "VLLM::Worker", "/process_api/abc/edge"))
    bump_v1(root, oom_kill=1)
    found = watch.account()
    watch.__exit__(None, None, None)
    assert [(d.pid, d.returncode, d.source, d.at_s) for d in found.deaths] == \
        [(WORKER, -signal.SIGKILL, "the kernel log", 2.0)]
    assert found.describe().startswith(f"pid {WORKER} (VLLM::Worker) was killed by the kernel's OOM killer (SIGKILL)")


def test_the_kernel_logs_victim_counts_even_without_an_exit_record(tmp_path):
    watch, root = watch_with(tmp_path, [], engine_seen(1.0),
                             kmsg_text=oom_lines(WORKER, "VLLM::Worker", "/process_api/abc/edge"))
    bump_v1(root, oom_kill=1)
    found = watch.account()
    watch.__exit__(None, None, None)
    assert [(d.pid, d.returncode, d.source, d.oom) for d in found.deaths] == \
        [(WORKER, -signal.SIGKILL, "the kernel log", True)]


def test_an_oom_with_no_process_identified_still_says_so(tmp_path):
    watch, root = watch_with(tmp_path, [], {})
    bump_v1(root, oom_kill=2)
    found = watch.account()
    watch.__exit__(None, None, None)
    assert found and found.oom
    assert found.describe().startswith("the OOM killer killed 2 process(es) in this session's memory cgroup "
                                       f"/process_api/abc/edge (oom_kill 0 -> 2), at a limit of {mib(1536 * MIB)}")


def test_without_a_plan_the_oom_remedy_is_general(tmp_path):
    watch, root = watch_with(tmp_path, [Exit(WORKER, -signal.SIGKILL, 2.0, "x")], engine_seen(1.0), plan=None)
    bump_v1(root, oom_kill=1)
    text = watch.account().describe()
    watch.__exit__(None, None, None)
    assert "remedy: raise the memory limit or plan a smaller session: a shorter --max-model-len" in text


def test_the_watch_hands_every_process_the_sampler_finds_to_the_recorder(tmp_path):
    exits = FakeExits([])
    sampler = FakeSampler(engine_seen(1.0))
    with DeathWatch(None, sampler, root=v1_root(tmp_path), kmsg_path=str(tmp_path / "none"), recorder=exits):
        assert deaths.current() is not None
        sampler.on_new_process(5555)  # the sampler finding a new process later
    assert sorted(exits.watched) == sorted([WORKER, CORE, 5555])
    assert sampler.on_new_process is None and deaths.current() is None


def test_outside_any_watch_the_account_has_no_baseline():
    assert deaths.current() is None
    found = account({})
    assert found.cgroup_before is None and found.oom_rises == [] and not found


def test_the_sampler_remembers_each_process_its_title_and_last_reading(tmp_path):
    from edge_core.runtime.measure import ProcessTreeSampler

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        proc_root = tmp_path / "proc"
        for pid, title in ((os.getpid(), "pytest"), (child.pid, "VLLM::Worker")):
            write(proc_root / str(pid) / "cmdline", f"{title}\0--flag\0")
            write(proc_root / str(pid) / "smaps_rollup", "Rss: 2000 kB\nPss: 1000 kB\n")
        write(proc_root / "meminfo", "MemAvailable: 100 kB\n")
        found: list[int] = []
        sampler = ProcessTreeSampler(os.getpid(), proc_root=proc_root, on_new_process=found.append, pss_max_age_s=0)
        sampler.sample_once()
        sampler.sample_once()
        seen_now = sampler.seen()
    finally:
        child.kill()
        child.wait()
    assert found.count(child.pid) == 1  # once, the first time
    record = seen_now[child.pid]
    assert record.title == "VLLM::Worker" and record.pss_bytes == 1000 * 1024
    assert record.tree_pss_bytes >= 2 * 1000 * 1024 and record.last_seen_s >= record.first_seen_s


def test_the_cli_offers_no_traceback_for_a_death_that_is_its_own_cause(monkeypatch, capsys):
    import edge_core.cli.plan as plan_command
    from edge_core.cli import main

    def dying_plan(args):
        try:
            raise RuntimeError("Engine core initialization failed")
        except RuntimeError as exc:
            raise EngineDied("vLLM could not start on cpu: pid 1 (VLLM::Worker) was killed by the kernel's OOM "
                             "killer", {}, traceback_helps=False) from exc

    monkeypatch.setattr(plan_command, "cmd_plan", dying_plan)
    monkeypatch.delenv("EDGE_DEBUG", raising=False)
    assert main(["plan"]) == 1
    err = capsys.readouterr().err
    assert "OOM killer" in err and "EDGE_DEBUG" not in err


def test_a_stream_hands_an_engine_death_on_as_it_is():
    from edge_core.runtime.stream_run import StreamRun

    died = EngineDied("the vLLM engine on cpu died during request r1 (EngineDeadError): pid 2 (VLLM::Worker) was "
                      "killed by SIGSEGV", {})

    def events():
        raise died
        yield  # pragma: no cover

    run = StreamRun(events(), lambda: False, request_id="r1", epoch=0, label="vllm:cpu on cpu")
    with pytest.raises(EngineDied) as caught:
        list(run)
    assert caught.value is died


# ---------------------------------------------------------------- one engine, OOM-killed under a real cgroup limit

SMOLLM2 = Path("/work/models/smollm2-135m-instruct")
#: What the limit leaves above what the cgroup holds and cannot reclaim when it is lowered: less than the weights
#: still to load (257 MiB) and the KV pool, so loading goes on past it.
OOM_MARGIN_BYTES = 64 * MIB


def v2_mount() -> Path | None:
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        if " - cgroup2 " in line:
            return Path(line.split()[4])
    return None


class ChildMemoryCgroup:
    """A memory cgroup of the test's own, a child of this process's (cgroup v1's memory controller, or v2's), that
    a child process enters before it execs (:meth:`enter`); removed, once its processes have left, on exit."""

    def __init__(self, version: int):
        self.version = version
        self.directory = self.parent() / f"edge-oom-test-{os.getpid()}"

    def parent(self) -> Path:
        if self.version == 1:
            cgroup = read_cgroup_memory()
            assert cgroup is not None and cgroup.version == 1
            return Path(cgroup.directory)
        mount = v2_mount()
        assert mount is not None
        own = next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        return mount / own.strip("/")

    @classmethod
    def reason(cls, version: int) -> str | None:
        """Why no such cgroup can be made here (None: it can)."""
        if version == 1:
            cgroup = read_cgroup_memory()
            if cgroup is None or cgroup.version != 1:
                return "this process has no cgroup v1 memory controller"
            if not os.access(cgroup.directory, os.W_OK):
                return (f"cannot make a child memory cgroup under {cgroup.directory} (not writable: needs root or a "
                        "delegated cgroup)")
            return None
        mount = v2_mount()
        if mount is None:
            return "no cgroup v2 hierarchy is mounted"
        controllers = (mount / "cgroup.controllers").read_text().split() \
            if (mount / "cgroup.controllers").exists() else []
        if "memory" not in controllers:
            return f"cgroup v2 at {mount} has no memory controller (cgroup.controllers: {' '.join(controllers) or 'empty'})"
        parent = cls(2).parent()
        enabled = (parent / "cgroup.subtree_control").read_text().split() \
            if (parent / "cgroup.subtree_control").exists() else []
        if "memory" not in enabled:
            return f"the memory controller is not enabled for the children of {parent} (cgroup.subtree_control)"
        if not os.access(parent, os.W_OK):
            return f"{parent} is not writable"
        return None

    def __enter__(self) -> ChildMemoryCgroup:
        self.directory.mkdir()
        return self

    def __exit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                self.directory.rmdir()
                return
            except OSError:  # its last processes are still leaving
                time.sleep(0.5)

    def enter(self) -> None:
        """Move the calling process in (a ``preexec_fn``)."""
        (self.directory / "cgroup.procs").write_text(str(os.getpid()))

    def stat(self) -> dict[str, int]:
        return {key: int(value) for key, value in
                (line.split() for line in (self.directory / "memory.stat").read_text().splitlines())}

    def unreclaimable_bytes(self) -> int:
        """What the cgroup holds and cannot reclaim now: anonymous memory and mapped files (the page cache can go)."""
        stat = self.stat()
        if self.version == 1:
            return stat["total_rss"] + stat["total_mapped_file"]
        return stat["anon"] + stat["file_mapped"]

    def lower_limit(self, limit_bytes: int) -> None:
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        (self.directory / name).write_text(str(limit_bytes))

    def oom_kills(self) -> int:
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        return int(dict(line.split() for line in (self.directory / name).read_text().splitlines())["oom_kill"])


def needs_engine() -> str | None:
    import importlib.util

    missing = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]
    if missing:
        return f"needs the real vLLM CPU build and edge-cpu; missing: {', '.join(missing)}"
    if not (SMOLLM2 / "config.json").exists():
        return f"needs the SmolLM2 checkpoint at {SMOLLM2}"
    return None


def titles_of(pid: int) -> dict[int, str]:
    out = {}
    try:
        for proc in psutil.Process(pid).children(recursive=True):
            try:
                out[proc.pid] = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()
            except OSError:
                continue
    except psutil.Error:
        pass
    return out


def assert_the_kernel_log_is_named(message: str, pid: int, name: str | None = None) -> None:
    """Readable here, the kernel log names the victim (so its signal); not readable, the message says why."""
    kernel_log = KernelLog(from_end=True)
    try:
        if kernel_log.unreadable is None:
            assert "(SIGKILL): memory cgroup" in message and f"Killed process {pid} ({name or ''}" in message, message
        else:
            assert f"the kernel log is not readable here: {kernel_log.unreadable}" in message, message
    finally:
        kernel_log.close()


@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_an_engine_oom_killed_under_a_cgroup_limit_is_named_oom_with_the_process_and_the_limit(tmp_path, version):
    # vLLM's worker in a process of its own (--distributed-executor-backend mp, as `edge serve`, parallel layouts
    # and nodes run it): edge names the death (deaths.py). The in-process layout, one rank's default, is the next test.
    # The plan admits at the cgroup's limit (unlimited when edge plans), then the limit is lowered to what the
    # cgroup holds and cannot reclaim plus a margin once the worker is up: loading goes on past it (the weights
    # alone are 257 MiB) and the kernel kills the worker.
    # This stays valid when the plan reads nested limits (it then refuses below its admission): the limit moves
    # only after admission. The worker is made the OOM killer's first choice (oom_score_adj 1000), so the kill
    # is the engine's, not edge's front (which imports vLLM too and is as large until the weights load).
    if why := ChildMemoryCgroup.reason(version) or needs_engine():
        pytest.skip(why)
    limit = None
    from servers import short_tmp

    short = short_tmp("edge-oom-")  # vLLM's ZMQ sockets go under TMPDIR: a unix socket's path fits 107 bytes
    try:
        with ChildMemoryCgroup(version) as child:
            env = {**os.environ, "TMPDIR": str(short), "EDGE_LEDGER_DIR": str(tmp_path / "ledger")}
            proc = subprocess.Popen(
                [sys.executable, "-m", "edge_core", "run", "--model", str(SMOLLM2), "--max-model-len", "2048",
                 "--max-tokens", "8", "--prompt", "Hi", "--distributed-executor-backend", "mp"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=child.enter)
            try:
                deadline = time.monotonic() + 600
                worker = None
                while proc.poll() is None and time.monotonic() < deadline:
                    worker = next((pid for pid, title in titles_of(proc.pid).items()
                                   if title.startswith("VLLM::Worker")), None)
                    if worker is not None:
                        Path(f"/proc/{worker}/oom_score_adj").write_text("1000")
                        limit = child.unreclaimable_bytes() + OOM_MARGIN_BYTES
                        child.lower_limit(limit)
                        break
                    time.sleep(0.1)
                out, err = proc.communicate(timeout=600)
                oom_kills = child.oom_kills()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    finally:
        shutil.rmtree(short, ignore_errors=True)
    assert worker is not None and limit is not None, err[-3000:]
    assert oom_kills >= 1, f"the worker was not OOM-killed (oom_kill {oom_kills}): {err[-3000:]}"
    assert proc.returncode == 1, err[-3000:]
    message = err[err.index("edge: vLLM could not start"):] if "edge: vLLM could not start" in err else err
    print(message)  # the report shows it with -rP
    assert f"pid {worker} (VLLM::Worker) was killed by the kernel's OOM killer" in message, message
    assert_the_kernel_log_is_named(message, worker, "VLLM::Worker")
    assert f"hit its limit of {mib(limit)}" in message, message
    assert "oom_kill 0 -> 1 during this session" in message, message
    assert "remedy:" in message and "EDGE_DEBUG" not in message
    assert "Traceback" not in err
    assert f"pid {proc.pid} (edge run)" not in err, "the front survived: its reaper said nothing of it"


@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_edge_run_oom_killed_with_its_engine_inside_is_named_oom_by_its_reaper(tmp_path, version):
    # One rank's default: vLLM's engine core and worker inside edge's own process (execution.in_process), so the
    # OOM killer's victim is edge itself and its session's reaper names the death (reaper.py, FrontDeath) on the
    # stderr it shares. The limit is lowered once vLLM's engine core begins ("Initializing a V1 LLM engine" in the
    # engine log: vLLM imported, the weights not loaded) to what the cgroup holds and cannot reclaim plus a margin;
    # edge, not its reaper, is made the OOM killer's first choice (oom_score_adj 1000). No engine finishes starting.
    if why := ChildMemoryCgroup.reason(version) or needs_engine():
        pytest.skip(why)
    engine_log = tmp_path / "engine.log"
    limit = None
    with ChildMemoryCgroup(version) as child:
        env = {**os.environ, "EDGE_LEDGER_DIR": str(tmp_path / "ledger")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "edge_core", "run", "--model", str(SMOLLM2), "--max-model-len", "2048",
             "--max-tokens", "8", "--prompt", "Hi", "--engine-log", str(engine_log)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL, env=env,
            preexec_fn=child.enter)
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                if engine_log.exists() and "Initializing a V1 LLM engine" in engine_log.read_text(errors="replace"):
                    Path(f"/proc/{proc.pid}/oom_score_adj").write_text("1000")
                    limit = child.unreclaimable_bytes() + OOM_MARGIN_BYTES
                    child.lower_limit(limit)
                    break
                time.sleep(0.05)
            out, err = proc.communicate(timeout=600)  # to the reaper's end: it holds edge's stderr until it exits
            oom_kills = child.oom_kills()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert limit is not None, err[-3000:]
    assert oom_kills >= 1, f"edge was not OOM-killed (oom_kill {oom_kills}): {err[-3000:]}"
    assert proc.returncode == -signal.SIGKILL, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith(f"edge: pid {proc.pid} ")]
    assert len(said) == 1, err[-3000:]
    message = said[0]
    print(message)  # the report shows it with -rP
    assert message.startswith(f"edge: pid {proc.pid} (edge run) was killed by the kernel's OOM killer"), message
    assert_the_kernel_log_is_named(message, proc.pid)
    assert f"hit its limit of {mib(limit)}" in message and child.directory.name in message, message
    assert "oom_kill 0 -> 1 during this session" in message, message
    assert "last measured" in message and "vLLM's engine ran inside it and ended with it" in message, message
    assert "; remedy: the plan admitted " in message and message.endswith(f". The engine log is {engine_log}")
    assert "Traceback" not in err
