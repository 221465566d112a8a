"""What happens when an admitted plan runs: one stage, its requests, and its memory, sampled.

:class:`StageSession` is the one code path every command that starts a stage
goes through (``edge run``, ``edge accept``, the edge half of ``edge parity``,
``edge serve``, whose server starts the engine itself: ``starts_stage=False``
skips step 4, and a graph stage run in this process,
:func:`~edge_core.runtime.graph_run.run_graph_stage`: ``watches=False`` skips
steps 2 and 3). Each step pushes its undo onto one
:class:`contextlib.ExitStack`, so every exit (an error, Ctrl-C, a start that
fails) unwinds the same steps in reverse:

1. the owning backend's ``prepare_stage`` (vLLM CPU grows its NUMA node),
   before the memory baseline (step 3);
2. the session's reaper (:class:`~edge_core.runtime.reaper.SessionReaper`):
   every process the engine starts carries the session's marker, and if edge
   dies without stopping (``kill -9``, the OOM killer) the reaper ends them
   within seconds;
3. the memory baseline over the whole process tree, then the 0.25 s sampler
   (:class:`~edge_core.runtime.measure.ProcessTreeSampler`), with the backend's
   device counter when it has one (``memory_counter``), and the death watch
   (:class:`~edge_core.runtime.deaths.DeathWatch`: the memory cgroup's OOM
   count and the kernel log's position now, each engine process's exit
   status as it ends), so an engine that dies is named;
4. ``start_stage`` with SIGTERM and SIGHUP routed through the Ctrl-C path, so
   every way of stopping edge that edge can see cancels, stops and reports;
   then the host ledger's record says ``running``;
5. requests through :class:`Consumer` (the core's bounded, fenced
   :class:`~edge_core.runtime.stream_run.StreamRun`), timed;
6. ``stop_stage`` with Ctrl-C held off, the sampler and the reaper ended, a
   ledger record the session held for itself removed; then the budget against
   every counter it covers (:func:`memory_record`).

:func:`run_session` is ``edge run``'s use of it: one request, streamed,
cancelled cleanly on Ctrl-C. Nothing here prints: progress goes to an
:class:`Observer`, results come back as records. No module here imports vLLM
at top level.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import EdgeError, StageError
from ..services.host_ledger import set_state
from .deaths import DeathWatch
from .env import versions
from .logs import EngineLog
from .measure import DEFAULT_PERIOD_S, ProcessTreeSampler, compare
from .reaper import SessionReaper
from .stream_run import StreamRun

if TYPE_CHECKING:
    from ..devices import Device
    from ..plans import Plan
    from ..services.host_ledger import Registration
    from ..services.registry import Registry
    from ..stream import CancelReport, DeltaEvent, StageRequest
    from .measure import MemoryReport

#: Which budget bounds which counter. The predicted peak is a forecast of the
#: tree's PSS, file pages included (the held peak, what admission counts, leaves
#: those out: the kernel reclaims them under a limit). Tree RSS (shared pages counted once per process) and host
#: available memory (moved by every process on the host) are reported, not
#: checked; see docs/vllm-cpu-facts.md, "Counters the budget does not bound".
#: NVML's used bytes are the whole card's; on a GPU the session is what fills it.
COVERED_COUNTERS = {
    "host_ram": {"tree_pss": "predicted"},
    "vram": {"device": "predicted"},
}


class Observer(Protocol):
    """What a long run tells whoever started it (the CLI prints it; :class:`SilentObserver` drops it).

    ``message`` is a one-line status, ``step`` wraps a long step (an engine
    start) so its caller can show it is alive, ``progress`` counts work done.
    """

    def message(self, text: str) -> None: ...

    def step(self, what: str) -> contextlib.AbstractContextManager[None]: ...

    def progress(self, done: int, total: int, note: str) -> None: ...


class SilentObserver:
    """The default :class:`Observer`: says nothing."""

    def message(self, text: str) -> None:
        pass

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        yield

    def progress(self, done: int, total: int, note: str) -> None:
        pass


def round_or_none(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


@dataclass(frozen=True)
class RequestResult:
    """One request as the consumer saw it. Times in seconds from submission."""

    request_id: str
    prompt: str | None
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    events: int
    time_to_first_token_s: float | None
    decode_tokens_per_s: float | None
    duration_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "tokens": len(self.token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "events": self.events,
            "time_to_first_token_s": round_or_none(self.time_to_first_token_s),
            "decode_tokens_per_s": round_or_none(self.decode_tokens_per_s, 2),
            "duration_s": round_or_none(self.duration_s),
        }


class Consumer:
    """Drives one request through :class:`StreamRun`, timing it; ``run`` is there to cancel from outside."""

    def __init__(self, registry: Registry, device: Device, stage: Any, request: StageRequest):
        self.request = request
        self.submitted = time.perf_counter()
        events = registry.call_owner(device, "stream", stage=stage, request=request)
        if events is None:
            raise StageError(f"the backend that owns {device.device_id} does not implement stream")
        self.run = StreamRun(
            events,
            lambda: registry.call_owner(device, "cancel", stage=stage, request_id=request.request_id),
            request_id=request.request_id, epoch=request.epoch, label=f"{device.backend} on {device.device_id}",
        )
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.events = 0
        self.first_at: float | None = None
        self.first_tokens = 0
        self.last_at: float | None = None
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[DeltaEvent]:
        for event in self.run:
            now = time.perf_counter()
            if event.token_ids:
                if self.first_at is None:
                    self.first_at, self.first_tokens = now, len(event.token_ids)
                self.last_at = now
            self.token_ids.extend(event.token_ids)
            self.text.append(event.text)
            self.events += 1
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
            yield event

    def drain(self, on_event: Callable[[DeltaEvent], None] | None = None) -> RequestResult:
        for event in self:
            if on_event is not None:
                on_event(event)
        return self.result()

    def result(self) -> RequestResult:
        ttft = None if self.first_at is None else self.first_at - self.submitted
        rate = None
        later = len(self.token_ids) - self.first_tokens
        if self.first_at is not None and self.last_at is not None and self.last_at > self.first_at and later > 0:
            rate = later / (self.last_at - self.first_at)
        return RequestResult(
            request_id=self.request.request_id, prompt=self.request.prompt, token_ids=tuple(self.token_ids),
            text="".join(self.text), finish_reason=self.finish_reason, events=self.events,
            time_to_first_token_s=ttft, decode_tokens_per_s=rate,
            duration_s=(self.last_at or time.perf_counter()) - self.submitted,
        )


class TerminationAsInterrupt:
    """SIGTERM and SIGHUP take the Ctrl-C path (cancel, stop, report) while a stage runs.

    The stage's processes live in their own process group (:mod:`.processes`),
    so a signal that ended edge without cleanup would leave them to the
    session's reaper; routed through KeyboardInterrupt they are stopped like
    after Ctrl-C, in order and reported. SIGKILL cannot be caught: that is
    what the reaper (:mod:`.reaper`) is for.
    """

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> TerminationAsInterrupt:
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._raise)
        return self

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


def prepare_stage(registry: Registry, plan: Plan, observer: Observer) -> Any:
    """The owning backend's ``prepare_stage`` (None when it has nothing to prepare)."""
    assert plan.selected_device is not None
    return registry.call_owner(plan.selected_device, "prepare_stage", plan=plan, progress=observer.message)


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The part of an admitted plan a run record repeats beside its measurements."""
    return {
        "admitted": plan.admitted,
        "source": plan.source.to_dict() if plan.source is not None else None,
        "selected_device": plan.selected_device.device_id if plan.selected_device is not None else None,
        "backend": plan.backend,
        "session": plan.session.to_dict(),
        "predicted_peak_bytes": plan.peak.predicted_bytes if plan.peak is not None else None,
        "held_peak_bytes": plan.peak.held_bytes if plan.peak is not None else None,
        "headroom_bytes": plan.peak.headroom_bytes if plan.peak is not None else None,
        "admission_bytes": plan.peak.admission_bytes if plan.peak is not None else None,
        "capacity_bytes": plan.capacity_bytes,
        "reservations": [r.to_dict() for r in plan.reservations],
        "engine_kwargs": dict(plan.engine_kwargs),
        "refusals": [r.to_dict() for r in plan.refusals],
        "parallel": dict(plan.parallel) if plan.parallel is not None else None,
    }


def stage_info(stage: Any) -> dict[str, Any]:
    """The stage handle's own record (``to_dict()``), or at least the device it executed on."""
    to_dict = getattr(stage, "to_dict", None)
    return to_dict() if callable(to_dict) else {"executed_on": getattr(stage, "executed_on", None)}


def memory_record(plan: Plan, report: MemoryReport) -> dict[str, Any]:
    """Budget against measurement, one entry per counter, never summed."""
    assert plan.peak is not None and plan.selected_device is not None
    peak = plan.peak
    budgets = {"predicted": peak.predicted_bytes}
    covered = COVERED_COUNTERS.get(plan.selected_device.memory_pool, {})
    counters = {}
    for counter in report.counters:
        which = covered.get(counter.name)
        entry = counter.to_dict()
        entry["budget"] = which
        entry["budget_bytes"] = budgets[which] if which else None
        if which:
            verdict = compare(budgets[which], report, counter.name)
            entry.update(ratio=round_or_none(verdict["ratio"], 4), verdict=verdict["verdict"],
                         is_bug=verdict["is_bug"])
        else:
            entry.update(ratio=None, verdict="not_covered", is_bug=False)
        counters[counter.name] = entry
    headline = counters.get("tree_pss") if plan.selected_device.memory_pool == "host_ram" else counters.get("device")
    return {
        "predicted_peak_bytes": peak.predicted_bytes,
        "held_peak_bytes": peak.held_bytes,
        "headroom_bytes": peak.headroom_bytes,
        "admission_bytes": peak.admission_bytes,
        "measured_counter": headline["name"] if headline else None,
        "measured_attributable_bytes": headline["attributable_peak_bytes"] if headline else None,
        "ratio": headline["ratio"] if headline else None,
        "verdict": headline["verdict"] if headline else "no_measurement",
        "counters": counters,
        "covered": dict(covered.items()),
        "sampler": report.to_dict(),
        "note": report.note,
    }


class StageSession:
    """One admitted plan's stage, started and its memory sampled; use as a context manager.

    Entering runs the start sequence, each step pushing its undo onto one
    :class:`contextlib.ExitStack`: the engine log named, the device prepared
    (``prepare_stage``), the session's reaper started, the memory baseline taken
    before any runtime is imported and the sampler started, SIGTERM/SIGHUP
    routed through Ctrl-C, the stage started and its host-ledger record marked
    ``running``. Leaving (or a start that fails or is interrupted) unwinds the
    stack in reverse: the stage stopped with Ctrl-C held off (an interrupted stop
    would leave engine processes behind), the signals restored, the sampler and
    the reaper stopped, a record the session holds for itself removed, a clean
    session's log deleted. A SIGKILL of this process is the reaper's to clean up.
    ``memory()`` is the budget against what the sampler read, after leaving;
    ``engine_processes()`` the session's live engine processes, while it runs.

    Options for callers whose stage differs: ``starts_stage=False`` does
    everything but start and stop the stage (``edge serve``'s server starts its
    own engine); ``watches=False`` skips the reaper and the sampler (a graph
    stage runs in this process and reads its own PSS); ``ledger`` is the
    registration to mark instead of this process's session, removed on leaving
    when ``releases_ledger``; ``keeps_stop_error`` records a failed stop in
    ``stop_error`` instead of raising it.
    """

    def __init__(self, plan: Plan, registry: Registry, observer: Observer | None = None, *,
                 node_prep: Any = None, prepared: bool = False, engine_log: EngineLog | None = None,
                 keep_log: bool = False, starts_stage: bool = True, watches: bool = True,
                 ledger: Registration | None = None, releases_ledger: bool = False, keeps_stop_error: bool = False):
        if not plan.admitted or plan.selected_device is None:
            raise StageError("a stage starts only from an admitted plan; run `edge plan` to see why it was refused")
        self.plan = plan
        self.registry = registry
        self.device: Device = plan.selected_device
        self.observer: Observer = observer or SilentObserver()
        self.node_prep = node_prep
        self._prepared = prepared
        self._starts_stage = starts_stage
        self._watches = watches
        self.ledger = ledger
        self._releases_ledger = releases_ledger
        self._keeps_stop_error = keeps_stop_error
        self.stage: Any = None
        self.stage_pids: tuple[int, ...] = ()
        self.start_s = 0.0
        self.stop_s = 0.0
        self.stop_answer: Any = None
        #: The backend's error from ``stop_stage``, kept when ``keeps_stop_error`` (else it is raised).
        self.stop_error: EdgeError | None = None
        #: The backend's device memory counter (``memory_counter``), None when it has none.
        self.counter: Any = None
        self.sampler: ProcessTreeSampler | None = None
        self._report: MemoryReport | None = None
        #: Marks the session's processes and ends them if this process dies without stopping the stage.
        self.reaper = SessionReaper()
        #: Where the engine's own output goes (None: wherever it goes by default, the terminal).
        self.engine_log = engine_log
        self._keep_log = keep_log or (engine_log is not None and engine_log.path is None)
        self._undo: contextlib.ExitStack | None = None

    def __enter__(self) -> StageSession:
        with contextlib.ExitStack() as undo:  # a start that fails or is interrupted is unwound as a session is
            undo.push(self._settle_log)
            (self.engine_log or EngineLog(None)).export()  # never a previous session's log
            if self.engine_log is not None and self.engine_log.path is not None:
                self.observer.message(f"engine log: {self.engine_log.path}")
            if self.ledger is not None and self._releases_ledger:
                undo.callback(self.ledger.remove)
            if not self._prepared:
                self.node_prep = prepare_stage(self.registry, self.plan, self.observer)
            if self._watches:
                self._watch(undo)
            if self._starts_stage:
                undo.enter_context(TerminationAsInterrupt())
                undo.callback(self._stop)
                self._start()
            self._undo = undo.pop_all()
        return self

    def _watch(self, undo: contextlib.ExitStack) -> None:
        """Start the reaper, then take the memory baseline and start the sampler."""
        undo.enter_context(self.reaper)  # before the baseline: its own few MiB are not the engine's
        if not self.reaper.watching:
            self.observer.message("WARNING: the session's reaper did not start: if edge is killed without a "
                                  "chance to stop (kill -9, the OOM killer), its engine processes will outlive it")
        counter = self.counter = self.registry.call_owner(self.device, "memory_counter")
        self.sampler = ProcessTreeSampler(
            os.getpid(), DEFAULT_PERIOD_S,
            device_counter=counter.read if counter is not None else None,
            device_source=counter.source if counter is not None else "none")
        self.sampler.baseline()  # before the runtime is imported: everything above it is the session's
        self.sampler.start()
        undo.callback(self._stop_sampler)
        undo.enter_context(DeathWatch(self.plan, self.sampler, reaper=self.reaper))

    def _start(self) -> None:
        """``start_stage``, timed; then the host ledger's record (``edge ps``) says the stage is up."""
        with self.observer.step(f"starting {self.device.backend} on {self.device.device_id} "
                                "(plan's engine arguments, nothing else)"):
            started = time.perf_counter()
            self.stage = self.registry.call_owner(self.device, "start_stage", plan=self.plan)
            self.start_s = time.perf_counter() - started
        if self.stage is None:
            owner = self.registry.owner(self.device)
            if owner is not None and "start_stage" in owner.hooks:
                raise StageError(f"plugin {self.device.plugin!r} returned no stage from start_stage for "
                                 f"{self.device.device_id}")
            raise StageError(f"the backend that owns {self.device.device_id} ({self.device.plugin}) does not "
                             "implement start_stage; it can plan but not run")
        self.stage_pids = tuple(getattr(self.stage, "stage_pids", ()))
        if self.ledger is not None:
            self.ledger.update(state="running")
        else:
            set_state("running")  # this process's session record

    def request(self, request: StageRequest) -> Consumer:
        """Submit ``request``; iterate (or ``drain()``) the returned consumer for its events."""
        return Consumer(self.registry, self.device, self.stage, request)

    def __exit__(self, *exc: Any) -> None:
        undo, self._undo = self._undo, None
        if undo is not None:
            undo.__exit__(*exc)

    def _stop(self) -> None:
        """``stop_stage`` with Ctrl-C held off: an interrupted stop would leave engine processes behind."""
        if self.stage is None or self.stop_answer is not None:
            return
        started = time.perf_counter()
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            self.stop_answer = self.registry.call_owner(self.device, "stop_stage", stage=self.stage)
        except EdgeError as exc:
            if not self._keeps_stop_error:
                raise
            self.stop_error = exc
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        self.stop_s = time.perf_counter() - started

    def _stop_sampler(self) -> None:
        if self.sampler is not None and self._report is None:
            self.sampler.stop()
            self._report = self.sampler.report()

    def _settle_log(self, exc_type: Any, *exc: Any) -> None:
        """Delete the engine log of a session that stopped cleanly: it says nothing anyone needs."""
        failed = exc_type is not None and exc_type is not KeyboardInterrupt
        if self.engine_log is not None and not failed and not self._keep_log and self.stop_answer:
            self.engine_log.remove()

    def memory(self) -> dict[str, Any]:
        """The budget against every counter, from the samples taken while the session lived."""
        if self._report is None:
            raise StageError("the session's memory is read after it has stopped" if self._watches else
                             "this session did not sample memory (watches=False)")
        return memory_record(self.plan, self._report)

    @property
    def session_id(self) -> str:
        """The marker's value (``EDGE_SESSION_ID``) in every engine process this session starts."""
        return self.reaper.session_id

    def engine_processes(self) -> list[tuple[int, float]]:
        """(pid, start time as psutil's ``create_time``) of the engine processes this session started that still
        run; any process can ask the same with :func:`~edge_core.runtime.reaper.marked_processes`."""
        return self.reaper.processes()

    def info(self) -> dict[str, Any]:
        return stage_info(self.stage) if self.stage is not None else {}

    def versions(self) -> dict[str, str]:
        return dict(self.info().get("versions") or versions())


@dataclass(frozen=True)
class RunOutcome:
    """``edge run``'s answer: how the request ended, what it produced, and the memory against the budget."""

    outcome: str
    request: StageRequest
    result: RequestResult | None
    cancel_report: CancelReport | None
    memory: dict[str, Any]
    start_s: float
    stop_s: float
    stage: dict[str, Any]
    node_prep: Any
    stopped: Any

    def to_dict(self, plan: Plan, plan_s: float) -> dict[str, Any]:
        result = self.result
        assert plan.manifest is not None and plan.selected_device is not None
        return {
            "outcome": self.outcome,
            "model": plan.model_path,
            "artifact_id": plan.manifest.artifact_id,
            "device": plan.selected_device.device_id,
            "executed_on": self.stage.get("executed_on"),
            "request": self.request.to_dict(),
            "tokens": len(result.token_ids) if result else 0,
            "token_ids": list(result.token_ids) if result else [],
            "text": result.text if result else "",
            "finish_reason": result.finish_reason if result else None,
            "timings": {
                "plan_s": round(plan_s, 4),
                "engine_start_s": round(self.start_s, 3),
                "vllm_import_s": self.stage.get("import_s"),
                "vllm_engine_s": self.stage.get("engine_start_s"),
                "time_to_first_token_s": round_or_none(result.time_to_first_token_s) if result else None,
                "decode_tokens_per_s": round_or_none(result.decode_tokens_per_s, 2) if result else None,
                "stop_s": round(self.stop_s, 3),
            },
            "memory": self.memory,
            "plan": plan_summary(plan),
            "node_prep": self.node_prep.to_dict() if self.node_prep is not None else None,
            "stage": self.stage,
            "versions": self.stage.get("versions") or versions(),
            "cancel": self.cancel_report.to_dict() if self.cancel_report is not None else None,
            "stopped": self.stopped,
        }


def run_session(plan: Plan, registry: Registry, request: StageRequest, *, observer: Observer | None = None,
                on_event: Callable[[DeltaEvent], None] | None = None, engine_log: EngineLog | None = None,
                keep_log: bool = False) -> RunOutcome:
    """Start ``plan``'s stage, run ``request`` to its end (events to ``on_event``), stop, measure.

    A Ctrl-C (or SIGTERM/SIGHUP) while the request runs cancels it in order —
    retire the epoch, abort in the engine, close the stream — and the outcome
    is ``cancelled`` with the fence's report; during the engine start it is
    ``cancelled`` with no request.
    """
    consumer: Consumer | None = None
    cancel_report = None
    outcome = "completed"
    session = StageSession(plan, registry, observer, engine_log=engine_log, keep_log=keep_log)
    try:
        with session:
            try:
                consumer = session.request(request)
                consumer.drain(on_event)
            except KeyboardInterrupt:  # cancel while the stage is still up: the stop comes after
                outcome = "cancelled"
                if consumer is not None:
                    cancel_report = consumer.run.cancel()
    except KeyboardInterrupt:  # during the engine start: no request ran
        if session.sampler is None:  # interrupted before the sampler was made
            raise
        outcome = "cancelled"
    return RunOutcome(
        outcome=outcome, request=request, result=consumer.result() if consumer is not None else None,
        cancel_report=cancel_report, memory=session.memory(), start_s=session.start_s, stop_s=session.stop_s,
        stage=session.info(), node_prep=session.node_prep, stopped=session.stop_answer,
    )
