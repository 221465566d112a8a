"""Tests for edge_core.runtime.measure: PSS from smaps_rollup, the process-tree sampler, and compare().

Hermetic tests read a fake ``/proc`` tree; one test walks a real
parent -> child -> grandchild tree where only the grandchild holds the memory.
Nothing is timed: the tests synchronise on pipes and on the sampler's sample
count; timeouts are hang guards only.
"""

from __future__ import annotations

import json
import mmap
import os
import select
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from edge_core.runtime.measure import (
    PEAK_NOTE,
    PSS_REREAD_RSS_BYTES,
    MemoryReport,
    ProcessTreeSampler,
    compare,
    read_available_bytes,
    read_pss_bytes,
)

MIB = 1 << 20
HANG_GUARD_S = 60.0

SMAPS_ROLLUP = """\
555d3752c000-7ffefa072000 ---p 00000000 00:00 0                          [rollup]
Rss:                1700 kB
Pss:                 300 kB
Pss_Dirty:           112 kB
Pss_Anon:            112 kB
Pss_File:            188 kB
Shared_Clean:       1536 kB
Private_Dirty:       112 kB
Swap:                  0 kB
SwapPss:               0 kB
"""


def fake_proc(root, *, pss_kb: int | None = 300, available_kb: int = 1_000_000):
    """A fake /proc with this process's smaps_rollup (if pss_kb) and a meminfo."""
    root.mkdir(exist_ok=True)
    (root / "meminfo").write_text(f"MemTotal:  4000000 kB\nMemFree:  10 kB\nMemAvailable:  {available_kb} kB\n")
    if pss_kb is not None:
        (root / str(os.getpid())).mkdir(exist_ok=True)
        (root / str(os.getpid()) / "smaps_rollup").write_text(SMAPS_ROLLUP.replace("300 kB", f"{pss_kb} kB"))
    return root


def children_now() -> int:
    return len(psutil.Process().children(recursive=True))


def test_read_pss_from_smaps_rollup(tmp_path):
    fake_proc(tmp_path)
    assert read_pss_bytes(os.getpid(), tmp_path) == 300 * 1024  # Pss, not Pss_Anon or Rss
    assert read_pss_bytes(999_999_999, tmp_path) is None
    assert read_available_bytes(tmp_path) == 1_000_000 * 1024


def test_real_smaps_rollup_is_read_for_this_process():
    if not os.path.exists(f"/proc/{os.getpid()}/smaps_rollup"):
        pytest.skip("this kernel has no /proc/<pid>/smaps_rollup (Linux >= 4.14 needed)")
    pss = read_pss_bytes(os.getpid())
    assert pss is not None and 0 < pss <= psutil.Process().memory_info().rss


def test_sampler_reads_pss_through_the_injected_root(tmp_path):
    if children_now():
        pytest.skip("this test process has children; their PSS would fall back to RSS")
    sampler = ProcessTreeSampler(os.getpid(), proc_root=fake_proc(tmp_path, pss_kb=300))
    sample = sampler.baseline()
    assert sample.process_count == 1 and sample.pss_fallback_processes == 0
    assert sample.tree_pss_bytes == 300 * 1024
    assert sample.tree_rss_bytes == pytest.approx(psutil.Process().memory_info().rss, rel=0.5)
    assert sampler.report().counter("tree_pss").source == "smaps_rollup Pss"


def test_pss_is_read_again_when_the_rss_moved_or_the_last_read_is_old_and_moves_with_the_rss_between(tmp_path):
    if children_now():
        pytest.skip("this test process has children; their PSS would fall back to RSS")
    root = fake_proc(tmp_path, pss_kb=300)
    sampler = ProcessTreeSampler(os.getpid(), proc_root=root, pss_max_age_s=3600)
    first = sampler.sample_once()
    fake_proc(tmp_path, pss_kb=900)  # smaps_rollup changes; the RSS barely moves
    second = sampler.sample_once()
    moved = second.tree_rss_bytes - first.tree_rss_bytes
    assert abs(moved) < PSS_REREAD_RSS_BYTES, "this process's RSS moved between two reads; rerun"
    assert second.tree_pss_bytes == 300 * 1024 + moved  # not re-read: the last PSS, moved by the RSS
    held = mmap.mmap(-1, 4 * PSS_REREAD_RSS_BYTES)  # fresh pages: a heap allocation may reuse resident ones
    for offset in range(0, len(held), 4096):
        held[offset] = 1  # touched: resident
    third = sampler.sample_once()
    assert third.tree_rss_bytes - first.tree_rss_bytes >= PSS_REREAD_RSS_BYTES
    assert third.tree_pss_bytes == 900 * 1024  # the RSS moved: read again
    held.close()
    aged = ProcessTreeSampler(os.getpid(), proc_root=root, pss_max_age_s=0.05)
    assert aged.sample_once().tree_pss_bytes == 900 * 1024
    fake_proc(tmp_path, pss_kb=500)
    time.sleep(0.1)
    assert aged.sample_once().tree_pss_bytes == 500 * 1024  # the last read is old: read again


def test_pss_falls_back_to_rss_and_says_so(tmp_path):
    sampler = ProcessTreeSampler(os.getpid(), proc_root=fake_proc(tmp_path, pss_kb=None))
    sample = sampler.baseline()
    assert sample.pss_fallback_processes == sample.process_count >= 1
    assert sample.tree_pss_bytes == sample.tree_rss_bytes
    report = sampler.report()
    assert report.counter("tree_pss").source.endswith("+rss_fallback")
    assert report.pss_fallback_processes_max >= 1


def test_counters_are_separate_and_host_available_peaks_at_its_minimum(tmp_path):
    root = fake_proc(tmp_path, available_kb=1000)
    readings = iter([5 * MIB, 9 * MIB, 7 * MIB])
    sampler = ProcessTreeSampler(os.getpid(), device_counter=lambda: next(readings), proc_root=root)
    sampler.baseline()
    fake_proc(root, available_kb=400)
    sampler.sample_once()
    fake_proc(root, available_kb=700)
    sampler.sample_once()
    report = sampler.report()
    host = report.counter("host_available")
    assert (host.direction, host.baseline_bytes, host.peak_bytes) == ("available", 1000 * 1024, 400 * 1024)
    assert host.attributable_peak_bytes == 600 * 1024
    device = report.counter("device")
    assert (device.baseline_bytes, device.peak_bytes, device.attributable_peak_bytes) == (5 * MIB, 9 * MIB, 4 * MIB)
    assert device.source == "backend"
    assert report.sample_count == 3
    data = report.to_dict()
    json.dumps(data)
    assert set(data["counters"]) == {"tree_rss", "tree_pss", "host_available", "device"}
    assert data["note"] == PEAK_NOTE and "lower bound" in PEAK_NOTE


def test_failing_device_counter_is_counted_not_fatal(tmp_path):
    def broken():
        raise RuntimeError("NVML: driver not loaded")

    sampler = ProcessTreeSampler(os.getpid(), device_counter=broken, proc_root=fake_proc(tmp_path))
    sample = sampler.baseline()
    assert sample.device_bytes is None and sample.tree_rss_bytes > 0
    report = sampler.report()
    assert report.sampling_errors == 1
    assert report.counter("device").peak_bytes is None


def test_report_needs_a_sample_and_omits_an_absent_device_counter(tmp_path):
    sampler = ProcessTreeSampler(os.getpid(), proc_root=fake_proc(tmp_path))
    with pytest.raises(RuntimeError, match="no memory sample"):
        sampler.report()
    sampler.baseline()
    with pytest.raises(KeyError, match="no counter 'device'"):
        sampler.report().counter("device")
    with pytest.raises(ValueError, match="period_s"):
        ProcessTreeSampler(os.getpid(), period_s=0)


def test_background_thread_samples_until_stopped(tmp_path):
    sampler = ProcessTreeSampler(os.getpid(), period_s=0.01, proc_root=fake_proc(tmp_path))
    with sampler:
        assert sampler.wait_for_samples(5, HANG_GUARD_S)
    stopped_at = sampler.sample_count
    assert stopped_at >= 6  # five (baseline included) while running, then the closing sample
    assert sampler.sample_count == stopped_at  # nothing samples after stop
    report = sampler.report()
    assert report.sample_count == stopped_at and report.period_s == 0.01
    assert report.counter("tree_rss").samples == stopped_at


def _report(counter_values: dict[str, int | None]) -> MemoryReport:
    from edge_core.runtime.measure import CounterReport

    counters = tuple(
        CounterReport(name, "used", "test", 0, value, value, 1) for name, value in counter_values.items()
    )
    return MemoryReport(1, 0.25, 1, 0.0, 1, 0, counters)


def test_compare_flags_a_prediction_below_the_measurement():
    report = _report({"tree_pss": 1000, "tree_rss": None})
    ok = compare(1200, report)
    assert (ok["verdict"], ok["ratio"], ok["is_bug"]) == ("bounds", 1.2, False)
    bad = compare(800, report)
    assert (bad["verdict"], bad["is_bug"]) == ("under_predicted", True)
    assert "is a bug" in bad["message"] and bad["measured_attributable_bytes"] == 1000
    assert compare(800, report, counter="tree_rss")["verdict"] == "no_measurement"
    with pytest.raises(KeyError, match="no counter 'device'"):
        compare(800, report, counter="device")
    assert "lower bound" in ok["note"]


# The tree: parent (depth 2) -> child (depth 1) -> grandchild (depth 0), and only
# the grandchild allocates. It touches every page so the memory is resident,
# signals on the ready pipe, and holds the memory until the release pipe closes.
CHAIN = textwrap.dedent("""\
    import os, subprocess, sys
    depth, ready_fd, release_fd, mib = map(int, sys.argv[1:5])
    if depth > 0:
        argv = [sys.executable, __file__, str(depth - 1), str(ready_fd), str(release_fd), str(mib)]
        sys.exit(subprocess.Popen(argv, pass_fds=(ready_fd, release_fd)).wait())
    block = bytearray(mib << 20)
    block[::4096] = b"\\x01" * len(range(0, len(block), 4096))
    os.write(ready_fd, b"ready")
    os.read(release_fd, 1)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="walks a real /proc process tree")
def test_sampler_counts_the_grandchild_that_holds_the_memory(tmp_path):
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    ready_r, ready_w = os.pipe()
    release_r, release_w = os.pipe()
    sampler = ProcessTreeSampler(os.getpid(), period_s=0.05)
    sampler.baseline()
    sampler.start()
    proc = subprocess.Popen(
        [sys.executable, str(script), "2", str(ready_w), str(release_r), "200"], pass_fds=(ready_w, release_r)
    )
    os.close(ready_w)
    os.close(release_r)
    try:
        readable, _, _ = select.select([ready_r], [], [], HANG_GUARD_S)
        assert readable, "the grandchild never signalled that it allocated"
        assert os.read(ready_r, 5) == b"ready"
        # Two more samples: the second one started after the allocation was resident.
        assert sampler.wait_for_samples(sampler.sample_count + 2, HANG_GUARD_S)
        alive = sampler.last_sample  # taken while the whole tree held its memory
        parent = psutil.Process(proc.pid)
        parent_rss = parent.memory_info().rss
        descendants = parent.children(recursive=True)
    finally:
        os.close(release_w)  # the grandchild's read returns: the tree exits
        proc.wait(HANG_GUARD_S)
        os.close(ready_r)
        sampler.stop()
    report = sampler.report()
    assert len(descendants) == 2
    # Reading only the process we spawned would see a bare interpreter, not 200 MiB.
    assert parent_rss < 100 * MIB
    assert report.process_count_max >= 4  # this process + parent + child + grandchild
    assert report.counter("tree_pss").attributable_peak_bytes >= 190 * MIB
    assert report.counter("tree_rss").attributable_peak_bytes >= 190 * MIB
    # While the tree was steady every process's PSS was read (no RSS stand-ins),
    # and the grandchild's 200 MiB is in it.
    assert alive.process_count >= 4 and alive.pss_fallback_processes == 0
    assert alive.tree_pss_bytes - sampler.report().counter("tree_pss").baseline_bytes >= 190 * MIB
    # The tree has exited: the last sample is back near the baseline.
    assert sampler.last_sample.tree_pss_bytes < report.counter("tree_pss").peak_bytes - 150 * MIB
