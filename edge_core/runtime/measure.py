"""How much memory did a run actually use, in numbers that can be trusted?

The engine runs in worker processes (vLLM spawns them), so reading only the
parent process is wrong: :class:`ProcessTreeSampler` samples the whole process
tree — root and every descendant, as they appear and disappear — on a fixed
period, in separate accountings that are never summed:

* ``tree_rss`` — sum of resident set sizes. Counts shared pages once per
  process, and the page cache of an mmap'd checkpoint as if it were the run's.
* ``tree_pss`` — sum of proportional set sizes (``Pss`` in
  ``/proc/<pid>/smaps_rollup``): shared and file-backed pages split fairly
  among the processes mapping them. The counter the budget is checked against.
* ``host_available`` — ``MemAvailable``: what the whole host has left. Its
  "peak" is its minimum.
* ``device`` — a counter the backend contributes (NVML used bytes for CUDA:
  the whole card, every process).

A sampled peak is a lower bound: a spike between two samples is missed. The
"attributable peak" is the peak minus a baseline taken before loading.

``smaps_rollup`` is read again only when it can have moved: a process's RSS
(``statm``, microseconds) is read at every sample, its PSS (``smaps_rollup``,
milliseconds: ~20 ms a read for edge's own process with vLLM's engine in it
under gVisor, 8-10% of a core at 4 Hz, which the engine's decode lost) when
its RSS moved by :data:`PSS_REREAD_RSS_BYTES` since the last read, or that
read is :data:`PSS_MAX_AGE_S` old; in between, the PSS moves with the RSS
(private pages count in full in both). Loading re-reads at every sample (the
RSS climbs); a steady decode re-reads every :data:`PSS_MAX_AGE_S`.

The sampler also remembers every process it has seen (:class:`SeenProcess`:
its title, e.g. vLLM's ``VLLM::Worker``, and the last reading while it
lived), so a process that dies can still be named with what was measured last
(:mod:`.deaths`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from ..host import parse_meminfo

#: Sampling period: short enough to catch a load transient that
#: lasts seconds, long enough that walking a 4-process tree costs well under 1%
#: of a core.
DEFAULT_PERIOD_S = 0.25

#: A process's ``smaps_rollup`` is read again when its RSS moved by this much since the last read ...
PSS_REREAD_RSS_BYTES = 4 << 20
#: ... or the last read is this old (seconds); 0 reads it at every sample.
PSS_MAX_AGE_S = 2.0

COUNTERS = ("tree_rss", "tree_pss", "host_available", "device")

#: Counters whose "peak" is their lowest reading (free memory going down is use going up).
_AVAILABLE_COUNTERS = ("host_available",)

PEAK_NOTE = (
    "every peak is sampled on a fixed period and is a lower bound: a spike shorter "
    "than the period between two samples is missed"
)


def read_pss_bytes(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """Return ``Pss`` of ``pid`` from ``smaps_rollup`` in bytes, or None when it cannot be read.

    smaps_rollup (Linux >= 4.14) is one pre-summed record; reading full
    ``smaps`` (what psutil's ``memory_full_info`` does) walks every mapping and
    costs milliseconds per process on a torch worker. None — process gone, no
    permission, an older kernel — makes the caller fall back to RSS.
    """
    try:
        text = (Path(proc_root) / str(pid) / "smaps_rollup").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    return parse_meminfo(text).get("Pss")


def read_title(pid: int, proc_root: str | os.PathLike[str] = "/proc") -> str | None:
    """The process's title: the first word of ``/proc/<pid>/cmdline`` (vLLM's setproctitle writes
    ``VLLM::EngineCore`` there), None when it cannot be read."""
    try:
        raw = (Path(proc_root) / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    title = raw.split(b"\0", 1)[0].decode(errors="replace").strip()
    return title or None


def read_available_bytes(proc_root: str | os.PathLike[str] = "/proc") -> int | None:
    """Return ``MemAvailable`` in bytes; psutil's figure where ``meminfo`` cannot be read."""
    try:
        text = (Path(proc_root) / "meminfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return int(psutil.virtual_memory().available)
    return parse_meminfo(text).get("MemAvailable")


@dataclass(frozen=True)
class Sample:
    """One reading of every counter, in bytes; None where a counter could not be read."""

    monotonic_s: float
    process_count: int
    tree_rss_bytes: int
    tree_pss_bytes: int
    #: Processes whose PSS could not be read and whose RSS stands in for it.
    pss_fallback_processes: int
    host_available_bytes: int | None
    device_bytes: int | None
    #: (pid, PSS bytes) of each process counted in ``tree_pss_bytes`` (RSS where PSS could not be read).
    process_pss_bytes: tuple[tuple[int, int], ...] = ()

    def value(self, counter: str) -> int | None:
        """The reading of ``counter`` (one of :data:`COUNTERS`), in bytes."""
        value: int | None = getattr(self, f"{counter}_bytes")
        return value

    def to_dict(self) -> dict[str, Any]:
        return {
            "monotonic_s": self.monotonic_s,
            "process_count": self.process_count,
            "tree_rss_bytes": self.tree_rss_bytes,
            "tree_pss_bytes": self.tree_pss_bytes,
            "pss_fallback_processes": self.pss_fallback_processes,
            "host_available_bytes": self.host_available_bytes,
            "device_bytes": self.device_bytes,
        }


@dataclass(frozen=True)
class SeenProcess:
    """A process of the tree as the sampler last saw it alive: its title and the last reading with it in."""

    pid: int
    title: str | None
    first_seen_s: float
    last_seen_s: float
    #: Its own PSS (RSS where PSS could not be read) and RSS at ``last_seen_s``, in bytes.
    pss_bytes: int
    rss_bytes: int
    #: The whole tree's PSS and RSS in the same sample, in bytes.
    tree_pss_bytes: int
    tree_rss_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "title": self.title, "first_seen_s": self.first_seen_s,
                "last_seen_s": self.last_seen_s, "pss_bytes": self.pss_bytes, "rss_bytes": self.rss_bytes,
                "tree_pss_bytes": self.tree_pss_bytes, "tree_rss_bytes": self.tree_rss_bytes}


@dataclass(frozen=True)
class CounterReport:
    """Baseline, peak and attributable peak of one counter, in bytes.

    For a ``used`` counter the peak is the highest reading and the attributable
    peak is ``peak_bytes - baseline_bytes``; for an ``available`` counter
    (host_available) the peak is the *lowest* reading and the attributable peak
    is ``baseline_bytes - peak_bytes``. ``source`` says how it was read;
    a ``tree_pss`` source ending in ``+rss_fallback`` means at least one process
    was counted by RSS because its PSS could not be read.
    """

    name: str
    direction: str
    source: str
    baseline_bytes: int | None
    peak_bytes: int | None
    attributable_peak_bytes: int | None
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "direction": self.direction,
            "source": self.source,
            "baseline_bytes": self.baseline_bytes,
            "peak_bytes": self.peak_bytes,
            "attributable_peak_bytes": self.attributable_peak_bytes,
            "samples": self.samples,
        }


@dataclass(frozen=True)
class MemoryReport:
    """What a :class:`ProcessTreeSampler` saw: one :class:`CounterReport` per counter, never summed."""

    root_pid: int
    period_s: float
    sample_count: int
    duration_s: float
    process_count_max: int
    pss_fallback_processes_max: int
    counters: tuple[CounterReport, ...]
    sampling_errors: int = 0
    note: str = PEAK_NOTE

    def counter(self, name: str) -> CounterReport:
        for report in self.counters:
            if report.name == name:
                return report
        raise KeyError(
            f"no counter {name!r} in this memory report; it has {', '.join(c.name for c in self.counters)}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "root_pid": self.root_pid,
            "period_s": self.period_s,
            "sample_count": self.sample_count,
            "duration_s": self.duration_s,
            "process_count_max": self.process_count_max,
            "pss_fallback_processes_max": self.pss_fallback_processes_max,
            "sampling_errors": self.sampling_errors,
            "counters": {c.name: c.to_dict() for c in self.counters},
            "note": self.note,
        }


class _Extreme:
    """Running peak of one counter (max for used, min for available)."""

    def __init__(self, direction: str):
        self.direction = direction
        self.value: int | None = None
        self.samples = 0

    def add(self, value: int | None) -> None:
        if value is None:
            return
        self.samples += 1
        if self.value is None:
            self.value = value
        elif self.direction == "used":
            self.value = max(self.value, value)
        else:
            self.value = min(self.value, value)


def _holds_memory(proc: psutil.Process, rss: int) -> bool:
    """False for a process that is exiting or gone: its smaps_rollup is empty or missing
    for a reason other than permissions, and falling back to RSS would misreport it."""
    if rss == 0:
        return False
    try:
        return proc.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


class ProcessTreeSampler:
    """Sample a process tree's memory on a fixed period in a background thread.

    Usage::

        sampler = ProcessTreeSampler(os.getpid(), device_counter=nvml_used)
        sampler.baseline()          # before anything is loaded
        with sampler:               # starts and stops the thread
            ... load and run ...
        report = sampler.report()

    ``device_counter`` returns bytes (or None when it cannot tell). ``proc_root``
    replaces ``/proc`` for reading ``smaps_rollup``, ``cmdline`` and ``meminfo``
    (tests use a fake tree); the process tree itself is walked with psutil.
    ``on_new_process`` is called (from the sampling thread) with each pid the
    first time a sample finds it, ``on_sample`` with every sample.
    """

    def __init__(
        self,
        root_pid: int,
        period_s: float = DEFAULT_PERIOD_S,
        device_counter: Callable[[], int | None] | None = None,
        *,
        device_source: str = "backend",
        proc_root: str | os.PathLike[str] = "/proc",
        on_new_process: Callable[[int], None] | None = None,
        pss_max_age_s: float = PSS_MAX_AGE_S,
        on_sample: Callable[[Sample], None] | None = None,
    ):
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.root_pid = root_pid
        self.period_s = period_s
        self.device_counter = device_counter
        self.device_source = device_source
        self.proc_root = Path(proc_root)
        self.on_new_process = on_new_process
        self.on_sample = on_sample
        self.pss_max_age_s = pss_max_age_s
        #: pid -> (PSS, RSS, monotonic seconds) at its last smaps_rollup read.
        self._pss_read: dict[int, tuple[int, int, float]] = {}
        self._reading = threading.Lock()  # sample_once runs on the sampling thread and on its callers'
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._baseline: Sample | None = None
        self._last: Sample | None = None
        self._peaks = {name: _Extreme("available" if name in _AVAILABLE_COUNTERS else "used") for name in COUNTERS}
        self._count = 0
        self._process_max = 0
        self._fallback_max = 0
        self._errors = 0
        self._first_s: float | None = None
        self._last_s: float | None = None
        self._seen: dict[int, SeenProcess] = {}
        self._titles: dict[int, str | None] = {}

    # -- one sample ------------------------------------------------------------

    def _tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.root_pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []  # the root is gone: nothing left to count

    def sample_once(self) -> Sample:
        """Read every counter now and fold the reading into the peaks."""
        with self._reading:
            return self._sample()

    def _sample(self) -> Sample:
        rss_total = pss_total = fallback = count = 0
        per_process: list[tuple[int, int]] = []
        rss_of: dict[int, int] = {}
        now = time.monotonic()
        for proc in self._tree():
            try:
                rss = int(proc.memory_info().rss)
            except psutil.Error:
                continue  # exited between the walk and the read
            pss = self._pss(proc.pid, rss, now)
            if pss is None:
                if not _holds_memory(proc, rss):
                    continue  # exiting or exited between the reads: nothing to count
                fallback += 1
                pss = rss
            count += 1
            rss_total += rss
            pss_total += pss
            per_process.append((proc.pid, pss))
            rss_of[proc.pid] = rss
        device = None
        if self.device_counter is not None:
            try:
                device = self.device_counter()
            except Exception:  # noqa: BLE001 — a failing counter must not stop the others
                with self._cond:
                    self._errors += 1
        sample = Sample(
            monotonic_s=time.monotonic(),
            process_count=count,
            tree_rss_bytes=rss_total,
            tree_pss_bytes=pss_total,
            pss_fallback_processes=fallback,
            host_available_bytes=read_available_bytes(self.proc_root),
            device_bytes=None if device is None else int(device),
            process_pss_bytes=tuple(per_process),
        )
        self._record(sample)
        self._remember(sample, rss_of)
        for pid in set(self._pss_read) - set(rss_of):
            del self._pss_read[pid]  # gone: a reused pid starts afresh
        if self.on_sample is not None:
            try:
                self.on_sample(sample)
            except Exception:  # noqa: BLE001 — a listener's failure must not stop the sampling
                with self._cond:
                    self._errors += 1
        return sample

    def _pss(self, pid: int, rss: int, now: float) -> int | None:
        """``pid``'s PSS: read from ``smaps_rollup`` when it can have moved (see the module's doc), else the
        last read moved by the RSS since."""
        last = self._pss_read.get(pid)
        if last is not None:
            pss, rss_then, read_s = last
            if abs(rss - rss_then) < PSS_REREAD_RSS_BYTES and now - read_s < self.pss_max_age_s:
                return max(pss + rss - rss_then, 0)
        pss_now = read_pss_bytes(pid, self.proc_root)
        if pss_now is None:
            self._pss_read.pop(pid, None)
        else:
            self._pss_read[pid] = (pss_now, rss, now)
        return pss_now

    def _remember(self, sample: Sample, rss_of: dict[int, int]) -> None:
        """Update each process's :class:`SeenProcess`, its title re-read at every sample (vLLM titles its
        processes a moment after they start)."""
        new = []
        for pid, pss in sample.process_pss_bytes:
            title = self._titles.get(pid)
            # Read at every sample: a spawned process can show its parent's title (VLLM::EngineCore) before it
            # sets its own (VLLM::Worker), and a death names the last.
            title = self._titles[pid] = read_title(pid, self.proc_root) or title
            with self._cond:
                before = self._seen.get(pid)
                self._seen[pid] = SeenProcess(
                    pid=pid, title=title, first_seen_s=before.first_seen_s if before else sample.monotonic_s,
                    last_seen_s=sample.monotonic_s, pss_bytes=pss, rss_bytes=rss_of.get(pid, 0),
                    tree_pss_bytes=sample.tree_pss_bytes, tree_rss_bytes=sample.tree_rss_bytes)
            if before is None:
                new.append(pid)
        if self.on_new_process is not None:
            for pid in new:
                try:
                    self.on_new_process(pid)
                except Exception:  # noqa: BLE001 — a listener's failure must not stop the sampling
                    with self._cond:
                        self._errors += 1

    def _record(self, sample: Sample) -> None:
        with self._cond:
            for name, extreme in self._peaks.items():
                extreme.add(sample.value(name))
            self._count += 1
            self._process_max = max(self._process_max, sample.process_count)
            self._fallback_max = max(self._fallback_max, sample.pss_fallback_processes)
            if self._first_s is None:
                self._first_s = sample.monotonic_s
            self._last_s = sample.monotonic_s
            self._last = sample
            self._cond.notify_all()

    def baseline(self) -> Sample:
        """Take the pre-load sample every attributable peak is counted from."""
        sample = self.sample_once()
        with self._cond:
            self._baseline = sample
        return sample

    # -- background thread -----------------------------------------------------

    def start(self) -> ProcessTreeSampler:
        """Start sampling; takes the baseline first if none was taken."""
        if self._thread is not None:
            return self
        if self._baseline is None:
            self.baseline()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"edge-measure-{self.root_pid}", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        # Deadlines advance by the period, so a slow sample does not stretch the
        # schedule: the period is fixed, not "period after each sample".
        deadline = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample_once()
            except Exception:  # noqa: BLE001 — keep sampling; the report counts failures
                with self._cond:
                    self._errors += 1
            deadline += self.period_s
            now = time.monotonic()
            if deadline < now:
                deadline = now  # fell behind: skip the missed ticks instead of bursting
            self._stop.wait(deadline - now)

    def stop(self) -> None:
        """Stop the thread and take one last sample, so a short run is never empty."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample_once()

    def __enter__(self) -> ProcessTreeSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def sample_count(self) -> int:
        with self._cond:
            return self._count

    @property
    def last_sample(self) -> Sample | None:
        with self._cond:
            return self._last

    def seen(self) -> dict[int, SeenProcess]:
        """Every process a sample has found, by pid, as last seen alive (the root included)."""
        with self._cond:
            return dict(self._seen)

    def wait_for_samples(self, count: int, timeout: float | None = None) -> bool:
        """Block until at least ``count`` samples were taken; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._count >= count, timeout)

    # -- report ----------------------------------------------------------------

    def _source(self, name: str) -> str:
        if name == "tree_rss":
            return "psutil rss, root and descendants"
        if name == "tree_pss":
            return "smaps_rollup Pss" + ("+rss_fallback" if self._fallback_max else "")
        if name == "host_available":
            return "MemAvailable"
        return self.device_source

    def report(self) -> MemoryReport:
        """Summarise what was sampled so far (the baseline is the first sample if none was taken)."""
        with self._cond:
            if self._count == 0:
                raise RuntimeError("no memory sample taken yet: call baseline() or start() first")
            counters = []
            for name, extreme in self._peaks.items():
                if name == "device" and self.device_counter is None:
                    continue
                base = None if self._baseline is None else self._baseline.value(name)
                peak = extreme.value
                if base is None and extreme.samples:
                    base = peak  # no baseline reading: nothing is attributable
                attributable = None
                if base is not None and peak is not None:
                    attributable = peak - base if extreme.direction == "used" else base - peak
                counters.append(CounterReport(
                    name=name,
                    direction=extreme.direction,
                    source=self._source(name),
                    baseline_bytes=base,
                    peak_bytes=peak,
                    attributable_peak_bytes=attributable,
                    samples=extreme.samples,
                ))
            return MemoryReport(
                root_pid=self.root_pid,
                period_s=self.period_s,
                sample_count=self._count,
                duration_s=(self._last_s or 0.0) - (self._first_s or 0.0),
                process_count_max=self._process_max,
                pss_fallback_processes_max=self._fallback_max,
                counters=tuple(counters),
                sampling_errors=self._errors,
            )


def compare(budget_bytes: int, report: MemoryReport, counter: str = "tree_pss") -> dict[str, Any]:
    """Check a predicted peak against a sampled attributable peak.

    ``budget_bytes`` is the plan's predicted peak (usage, not headroom).
    Verdicts: ``bounds`` when the prediction is at or above the measurement,
    ``under_predicted`` — a bug in the budget — when below it, and
    ``no_measurement`` when the counter has no attributable reading. Because the
    measurement is a sampled lower bound, a ratio just above 1.0 does not prove
    the budget safe.
    """
    reading = report.counter(counter)
    measured = reading.attributable_peak_bytes
    out: dict[str, Any] = {
        "counter": counter,
        "predicted_bytes": int(budget_bytes),
        "measured_attributable_bytes": measured,
        "ratio": None,
        "verdict": "no_measurement",
        "is_bug": False,
        "note": report.note,
    }
    if measured is None or measured <= 0:
        return out
    out["ratio"] = budget_bytes / measured
    if budget_bytes >= measured:
        out["verdict"] = "bounds"
    else:
        out["verdict"] = "under_predicted"
        out["is_bug"] = True
        out["message"] = (
            f"the budget predicted {budget_bytes} bytes but {counter} measured "
            f"{measured} bytes attributable: a prediction below the measurement is a bug "
            "in the budget; report it with this record"
        )
    return out
