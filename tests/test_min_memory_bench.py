"""bench/min_memory.py's parts that decide a figure: the bisection, the outcome, the cgroup files, the report.

No engine and no real cgroup: a fake cgroup tree under tmp_path (the control files the kernel would show), and a
fake probe that runs at and above a threshold. The wrapper that moves a child into a cgroup runs for real, with
a plain file standing in for ``cgroup.procs``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parent.parent / "bench" / "min_memory.py"
_spec = importlib.util.spec_from_file_location("min_memory", BENCH)
assert _spec is not None and _spec.loader is not None
mm = importlib.util.module_from_spec(_spec)
sys.modules["min_memory"] = mm
_spec.loader.exec_module(mm)

MIB = 1 << 20
RES = 128 * MIB


def bisect(need: int, start: int, ceiling: int | None = None) -> tuple[object, list[int]]:
    b = mm.Bisection(start=start, ceiling=ceiling)
    tried = []
    while (limit := b.next()) is not None:
        assert limit % RES == 0 and limit not in tried
        tried.append(limit)
        b.record(limit, limit >= need)
    return b, tried


@settings(max_examples=300, deadline=None)
@given(need=st.integers(1, 20 << 30), start=st.integers(1, 20 << 30))
def test_bisection_finds_the_least_grid_limit_at_or_above_the_need(need, start):
    b, tried = bisect(need, start, ceiling=24 << 30)
    least = math.ceil(need / RES) * RES
    assert b.hi == least
    assert b.lo is None if least == RES else b.lo == least - RES
    # bracketing doubles its step (512 MiB, 1 GiB, ...) and halving then needs log2(bracket / 128 MiB) more
    gap = abs(least - math.ceil(start / RES) * RES) // RES + 1
    assert len(tried) <= 2 * math.ceil(math.log2(gap + 4)) + 3


def test_bisection_from_the_steady_state_costs_few_probes():
    # issue 36's reference: edge's engine ran under 3,840 MiB and died at 3,584; steady state ~4.3 GiB
    b, tried = bisect(need=3700 * MIB, start=4300 * MIB)
    assert (b.hi, b.lo) == (3712 * MIB, 3584 * MIB)
    assert [t // MIB for t in tried] == [4352, 4096, 3584, 3840, 3712]
    b, tried = bisect(need=3700 * MIB, start=3500 * MIB)  # a start below the need steps up
    assert (b.hi, b.lo) == (3712 * MIB, 3584 * MIB)
    assert [t // MIB for t in tried] == [3584, 3840, 3712]


def test_a_resumed_bisection_tries_its_start_before_stepping_down_from_what_ran():
    b = mm.Bisection(start=4312 * MIB)
    b.record(6144 * MIB, True)  # an earlier run's probe from the unlimited peak
    assert b.next() == 4352 * MIB
    b.record(4352 * MIB, True)
    assert b.next() == 4096 * MIB


def test_bisection_gives_up_at_the_ceiling():
    b, tried = bisect(need=10 << 30, start=2 << 30, ceiling=4 << 30)
    assert b.hi is None and b.lo == 4 << 30 and tried[-1] == 4 << 30


def test_a_failure_above_a_run_is_reported_not_hidden():
    b = mm.Bisection(start=2 << 30)
    b.record(2 << 30, True)
    b.record(3 << 30, False)
    assert b.hi == 2 << 30 and b.non_monotone == [3 << 30]


@pytest.mark.parametrize(("rc", "timed_out", "refused", "oom", "decode", "outcome"), [
    (0, False, False, 0, 10.0, "runs"),
    (0, False, False, 0, 8.0, "runs"),       # exactly 0.8x: normal speed
    (0, False, False, 0, 7.9, "slow"),       # thrashing: it "runs", it does not count
    (1, False, False, 1, None, "oom_killed"),
    (1, False, False, 0, None, "failed"),
    (0, False, False, 0, None, "failed"),    # exit 0 without a decode figure is not a run
    (None, True, False, 0, None, "timeout"),
    (None, True, False, 2, None, "oom_killed"),  # plain vLLM's front end hangs on an OOM-killed worker
    (2, False, True, 0, None, "refused"),
])
def test_outcome(rc, timed_out, refused, oom, decode, outcome):
    assert mm.classify(rc, timed_out, refused, oom, decode, baseline_decode=10.0) == outcome


def test_least_limits_alternates_subjects_and_reruns_a_slow_probe():
    """A fake session: edge runs from 3,900 MiB, plain from 5,000; edge is slow (thrashing) below 4,200 MiB
    except on a retry at 4,096 (a busy machine, not a thrash)."""
    need = {"edge": 3900 * MIB, "plain": 5000 * MIB}
    calls: list[tuple[str, int]] = []
    written: list[dict] = []

    def run(subject: str, limit: int) -> dict:
        calls.append((subject, limit))
        if limit < need[subject]:
            return {"outcome": "oom_killed", "decode_tok_s": None}
        if subject == "edge" and limit < 4200 * MIB:
            retry = calls.count((subject, limit)) > 1
            return {"outcome": "runs", "decode_tok_s": 9.0} if retry and limit == 4096 * MIB else \
                {"outcome": "slow", "decode_tok_s": 5.0}
        return {"outcome": "runs", "decode_tok_s": 10.0}

    bis = mm.least_limits({"edge": 4600 * MIB, "plain": 5600 * MIB}, run, order=["edge", "plain"],
                          slow_retries=1, write=written.append)
    assert bis["edge"].hi == 4096 * MIB and bis["edge"].lo == 3968 * MIB
    assert bis["plain"].hi == 5120 * MIB and bis["plain"].lo == 4992 * MIB
    # one probe per subject in turn while both are bisecting (a retry stays with its subject)
    firsts = [s for i, (s, lim) in enumerate(calls) if i == 0 or calls[i - 1] != (s, lim)]
    assert firsts[:6] == ["edge", "plain"] * 3
    # every slow run that was retried is written and marked; the counted record is the better one
    superseded = [r for r in written if r.get("superseded")]
    assert superseded and all(r["outcome"] == "slow" for r in superseded)
    assert sum(1 for r in written if not r.get("superseded")) == len(bis["edge"].results) + len(bis["plain"].results)


# ---------------------------------------------------------------- the cgroup files


def fake_root(tmp_path: Path, cgroup: str, unified_controllers: str | None = None, v1: bool = True) -> Path:
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    if v1:
        d = root / "sys/fs/cgroup/memory/process_api/abc"
        d.mkdir(parents=True)
        (d / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    if unified_controllers is not None:
        u = root / "sys/fs/cgroup/unified"
        u.mkdir(parents=True)
        (u / "cgroup.controllers").write_text(unified_controllers + "\n")
    return root


# /proc/self/cgroup on this host kind (v1 nested, v2 mounted at unified without the memory controller)
HOST = "9:name=systemd:/\n8:pids:/\n4:memory:/process_api/abc\n3:cpuset:/\n0::/\n"


def test_nested_v1_memory_cgroup_is_found_at_the_process_own_path(tmp_path):
    root = fake_root(tmp_path, HOST, unified_controllers="hugetlb")
    assert mm.own_memory_cgroup(root) == (1, root / "sys/fs/cgroup/memory/process_api/abc")


def test_v2_without_the_memory_controller_is_named(tmp_path):
    root = fake_root(tmp_path, "0::/\n", unified_controllers="hugetlb", v1=False)
    with pytest.raises(mm.CgroupError, match="no v1 memory line.*unified.*without the memory controller"):
        mm.own_memory_cgroup(root)


def test_v2_with_memory(tmp_path):
    root = tmp_path / "root"
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text("0::/user.slice/bench.scope\n")
    (root / "sys/fs/cgroup/user.slice/bench.scope").mkdir(parents=True)
    (root / "sys/fs/cgroup/cgroup.controllers").write_text("cpu io memory pids\n")
    assert mm.own_memory_cgroup(root) == (2, root / "sys/fs/cgroup/user.slice/bench.scope")


def test_v1_child_limit_covers_swap_and_reads_back_the_counters(tmp_path):
    parent = tmp_path / "memory/process_api/abc"
    parent.mkdir(parents=True)
    cg = mm.MemoryCgroup.create((1, parent), "minmem-1")
    (cg.path / "memory.memsw.limit_in_bytes").write_text("9223372036854771712\n")  # the kernel shows it
    cg.set_limit(3840 * MIB)
    assert (cg.path / "memory.limit_in_bytes").read_text() == str(3840 * MIB)
    assert (cg.path / "memory.memsw.limit_in_bytes").read_text() == str(3840 * MIB)
    (cg.path / "memory.max_usage_in_bytes").write_text(f"{3840 * MIB}\n")
    (cg.path / "memory.failcnt").write_text("6971\n")
    (cg.path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    (cg.path / "memory.stat").write_text("cache 4096\nrss 0\npgmajfault 295\ntotal_pgmajfault 300\n")
    assert cg.stats() == {"max_usage_bytes": 3840 * MIB, "failcnt": 6971, "oom_kill": 1, "pgmajfault": 295,
                          "limit_bytes": 3840 * MIB}


def test_v2_child_limit_and_no_swap(tmp_path):
    parent = tmp_path / "bench.scope"
    parent.mkdir()
    (parent / "cgroup.subtree_control").write_text("")
    cg = mm.MemoryCgroup.create((2, parent), "minmem-1")
    assert (parent / "cgroup.subtree_control").read_text() == "+memory"  # delegated to the child
    (cg.path / "memory.swap.max").write_text("max\n")
    cg.set_limit(4096 * MIB)
    assert (cg.path / "memory.max").read_text() == str(4096 * MIB)
    assert (cg.path / "memory.swap.max").read_text() == "0"
    (cg.path / "memory.events").write_text("low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\n")
    (cg.path / "memory.peak").write_text(f"{4096 * MIB}\n")
    assert cg.stats()["oom_kill"] == 1 and cg.stats()["failcnt"] == 12 and cg.stats()["max_usage_bytes"] == 4096 * MIB


def test_v2_parent_that_cannot_delegate_is_named_and_leaves_nothing(tmp_path):
    parent = tmp_path / "bench.scope"
    (parent / "cgroup.subtree_control").mkdir(parents=True)  # a write to it fails, as EBUSY would
    with pytest.raises(mm.CgroupError, match="does not delegate the memory controller"):
        mm.MemoryCgroup.create((2, parent), "minmem-1")
    assert not (parent / "minmem-1").exists()


def test_the_wrapper_puts_the_command_itself_into_the_cgroup(tmp_path):
    cg = mm.MemoryCgroup(1, tmp_path)
    out = subprocess.run(mm.in_cgroup(cg, [sys.executable, "-c", "import os; print(os.getpid())"]),
                         capture_output=True, text=True, check=True)
    assert cg.pids() == [int(out.stdout)]  # exec kept the pid the shell wrote


def test_removing_an_empty_cgroup(tmp_path):
    cg = mm.MemoryCgroup(1, tmp_path / "minmem-1")
    cg.path.mkdir()
    cg.remove()
    assert not cg.path.exists()


# ---------------------------------------------------------------- the checkpoint and the page cache


def test_random_checkpoint_has_every_byte_and_finite_small_weights(tmp_path):
    np = pytest.importorskip("numpy")
    tensors = {"embed": [300, 64], "norm": [64], "proj": [64, 96]}
    path = tmp_path / "model.safetensors"
    data = mm.write_random_bf16(path, tensors)
    assert data == 2 * (300 * 64 + 64 + 64 * 96)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    assert len(raw) == 8 + n + data and path.stat().st_blocks * 512 >= len(raw)  # not sparse
    body = np.frombuffer(raw[8 + n:], dtype="<u2")
    values = (body.astype(np.uint32) << 16).view(np.float32)

    def tensor(name):
        a, b = header[name]["data_offsets"]
        return values[a // 2:b // 2]

    assert np.all(tensor("norm") == 1.0)
    for name in ("embed", "proj"):
        mag = np.abs(tensor(name))
        assert np.all(np.isfinite(mag)) and mag.min() >= 2.0 ** -9 and mag.max() < 2.0 ** -5
        assert 0.4 < np.mean(tensor(name) > 0) < 0.6


def test_resident_bytes_of_a_file_just_written(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * (3 * mm.PAGE + 1))
    assert mm.resident_bytes(f) == 4 * mm.PAGE  # fresh writes sit in the page cache, whole pages
    got = mm.evict([f, tmp_path / "missing"])
    assert got["files"] == 1 and got["bytes"] == 3 * mm.PAGE + 1


# ---------------------------------------------------------------- the report


def rec(subject, limit, outcome, admitted=True, **kw):
    return dict({"kind": "probe", "geometry": "g", "max_model_len": 4096, "run_id": "r", "subject": subject,
                 "limit_bytes": limit, "outcome": outcome, "plan_at_limit": {"admitted": admitted}}, **kw)


def test_summary_reads_the_least_limit_its_bracket_and_admitted_failures():
    base = {"kind": "baseline", "outcome": "runs", "decode_tok_s": 4.4, "wall_s": 90,
            "tree_pss_peak": {"pss": 4300 * MIB}, "cgroup": {"max_usage_bytes": 6000 * MIB}}
    rows = [
        {"kind": "plan", "geometry": "g", "max_model_len": 4096, "run_id": "r", "host": {"commit": "abc"},
         "admission_bytes": 7107 * MIB, "terms": {}, "peak": {}},
        rec("edge", None, **base), rec("plain", None, **base),
        rec("edge", 4352 * MIB, "runs"), rec("edge", 3840 * MIB, "runs"), rec("edge", 2816 * MIB, "oom_killed"),
        rec("edge", 3328 * MIB, "oom_killed"), rec("edge", 3584 * MIB, "slow", superseded=True),
        rec("edge", 3584 * MIB, "slow"), rec("edge", 3712 * MIB, "runs", admitted=False),
        rec("plain", 5120 * MIB, "runs"), rec("plain", 4608 * MIB, "oom_killed"),
        rec("plain", 4864 * MIB, "failed"), rec("plain", 4992 * MIB, "oom_killed"),
    ]
    (g,) = mm.summarize(rows)
    edge, plain = g["subjects"]["edge"], g["subjects"]["plain"]
    assert (edge["least"], edge["fails_at"], edge["fails_how"]) == (3712 * MIB, 3584 * MIB, "slow")
    assert (plain["least"], plain["fails_at"], plain["fails_how"]) == (5120 * MIB, 4992 * MIB, "oom_killed")
    assert g["admitted_but_failed"] == [2816 * MIB, 3328 * MIB, 3584 * MIB]
    assert g["refused_but_ran"] == [3712 * MIB]
    assert g["commit"] == "abc" and g["plan"]["admission_bytes"] == 7107 * MIB
    assert edge["baseline_decode"] == 4.4 and edge["tree_pss_peak"] == 4300 * MIB


def test_resume_reads_the_same_edge_code_only(tmp_path):
    results = tmp_path / "r.jsonl"
    base = {"kind": "baseline", "outcome": "runs", "decode_tok_s": 16.0, "wall_s": 60,
            "tree_pss_peak": {"pss": 1945 * MIB}}
    rows = [
        {"kind": "plan", "geometry": "g", "max_model_len": 4096, "run_id": "a", "host": {"edge_tree": "t1"}},
        {"kind": "plan", "geometry": "g", "max_model_len": 4096, "run_id": "b", "host": {"edge_tree": "t2"}},
        rec("edge", None, run_id="a", **base), rec("edge", 2048 * MIB, "runs", run_id="a"),
        rec("edge", 1792 * MIB, "slow", run_id="a", superseded=True), rec("edge", 1792 * MIB, "runs", run_id="a"),
        rec("edge", 1536 * MIB, "oom_killed", run_id="a"), rec("edge", 1664 * MIB, "error", run_id="a"),
        rec("edge", 1024 * MIB, "oom_killed", run_id="b"),
        rec("plain", 2176 * MIB, "runs", run_id="a"),  # no baseline for plain: its probes start over
    ]
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    baselines, seed = mm.earlier(results, "g", 4096, "t1")
    assert list(baselines) == ["edge"]
    assert sorted(seed["edge"]) == [(1536 * MIB, False), (1792 * MIB, True), (2048 * MIB, True)]
    assert mm.earlier(results, "g", 8192, "t1") == ({}, {})
    assert mm.earlier(results, "g", 4096, "t1+dirty") == ({}, {})


def _rows(admission_at_probe: int) -> list[dict]:
    """One geometry's plan, plain's and edge's probes (edge runs at 1,024 MiB, not at 896), as the bench writes them."""
    plan = {"kind": "plan", "geometry": "g", "max_model_len": 2048, "run_id": "r1", "model": "/m",
            "host": {"edge_tree": "tree1"}, "admission_bytes": 3000 * MIB}
    probes = [{"kind": "probe", "geometry": "g", "max_model_len": 2048, "run_id": "r1", "subject": "edge",
               "limit_bytes": limit, "outcome": outcome,
               "plan_at_limit": {"admitted": True, "admission_bytes": admission_at_probe}}
              for limit, outcome in ((1024 * MIB, "runs"), (896 * MIB, "oom"))]
    return [plan, *probes]


def test_the_admission_at_the_least_limit_is_the_newest_replan_of_the_same_code_tree_else_the_probe():
    rows = _rows(1100 * MIB)
    [group] = mm.summarize(rows)
    assert group["subjects"]["edge"]["least"] == 1024 * MIB
    assert group["admission_at_least"] == 1100 * MIB and group["replanned_by"] is None
    replans = [{"kind": "replan", "geometry": "g", "max_model_len": 2048, "tree": tree, "planned_by": by,
                "limit_bytes": 1024 * MIB, "plan_at_limit": {"admission_bytes": adm}}
               for tree, by, adm in (("tree1", "fit1", 1080 * MIB), ("tree1", "fit2", 1050 * MIB),
                                     ("other", "fit3", 1 * MIB))]
    [group] = mm.summarize(rows + replans)
    assert group["admission_at_least"] == 1050 * MIB and group["replanned_by"] == "fit2"


def test_replan_plans_each_group_once_at_edge_s_least_limit_and_appends_its_row(tmp_path, monkeypatch):
    results = tmp_path / "r.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in _rows(1100 * MIB)))
    calls = []

    def plan_at(edge, model, max_model_len, edge_args, parent, name, limit):
        calls.append((edge, str(model), max_model_len, limit))
        return {"admitted": True, "admission_bytes": 1060 * MIB}

    monkeypatch.setattr(mm, "plan_at", plan_at)
    monkeypatch.setattr(mm, "own_memory_cgroup", lambda: (1, tmp_path))
    monkeypatch.setattr(mm, "host_facts", lambda: {"edge_tree": "fit9"})
    assert mm.replan(results, "edge") == 0
    assert calls == [("edge", "/m", 2048, 1024 * MIB)]
    added = [json.loads(ln) for ln in results.read_text().splitlines()][-1]
    assert added["kind"] == "replan" and added["planned_by"] == "fit9" and added["tree"] == "tree1"
    [group] = mm.summarize([json.loads(ln) for ln in results.read_text().splitlines()])
    assert group["admission_at_least"] == 1060 * MIB
