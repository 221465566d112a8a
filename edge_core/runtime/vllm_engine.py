"""A started vLLM engine: how its requests stream, how one is cancelled, and how it stops with nothing left behind.

:class:`VllmStage` is the handle :func:`edge_core.runtime.vllm_stage.start`
returns; it runs vLLM's async engine on a private asyncio loop in its own
thread. Deltas wait in a per-request queue and are merged into one event when
several are waiting (:class:`MergingReader`).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import StageError
from ..stream import DeltaEvent, StageRequest, StateHandle
from .deaths import account, child_exits, failure
from .logs import EngineLog
from .processes import reap

if TYPE_CHECKING:
    from ..devices import Device
    from ..plans import Plan

#: How long :func:`cancel` waits for the abort message to be handed to the
#: engine core (a ZMQ send on the stage's loop, milliseconds). It never waits
#: on the request's producer.
ABORT_WAIT_S = 2.0
#: Seconds given to vLLM's own shutdown before the stage's processes are
#: terminated, then killed (a clean stop of the demo stage takes a few
#: seconds: docs/vllm-cpu-facts.md "Engine start and determinism").
SHUTDOWN_TIMEOUT_S = 20.0

#: vLLM finish reasons -> edge's (``repetition`` is a stop the engine decided).
_FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error", "repetition": "stop"}


@dataclass(frozen=True)
class StopReport:
    """What :meth:`VllmStage.stop` found: the stage's processes and whether each is gone."""

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
            hand_over("error", self._explain(exc, request.request_id))
        finally:
            if generator is not None:
                try:
                    await generator.aclose()
                except Exception:  # noqa: BLE001 — the request is over either way
                    pass
            self._forget(state)

    async def _render(self, request: StageRequest) -> Any:
        """Tokenize the prompt the way ``vllm.LLM.generate`` does (the renderer's completion defaults), or a
        conversation the way ``vllm.LLM.chat`` and the OpenAI server's chat endpoint do (the model's chat
        template, the assistant's turn opened, no special tokens added beside the template's own)."""
        from vllm.renderers.inputs.preprocess import parse_model_prompt

        renderer = self.engine.renderer
        if request.messages is not None:
            from vllm.renderers import ChatParams

            params = ChatParams(chat_template_kwargs={"add_generation_prompt": True, "continue_final_message": False})
            tok_params = renderer.default_chat_tok_params.with_kwargs(add_special_tokens=False)
            _, (engine_input,) = await renderer.render_chat_async([[dict(t) for t in request.messages]], params,
                                                                  tok_params)
            return engine_input
        if request.prompt_token_ids is not None:
            prompt: dict[str, Any] = {"prompt_token_ids": list(request.prompt_token_ids)}
        else:
            prompt = {"prompt": request.prompt}
        parsed = parse_model_prompt(self.engine.model_config, prompt)
        (engine_input,) = await renderer.render_cmpl_async([parsed], renderer.default_cmpl_tok_params)
        return engine_input

    def _explain(self, exc: Exception, request_id: str) -> Exception:
        """An engine that died under a request: which process, of what, and what to do (:mod:`.deaths`)."""
        if type(exc).__name__ != "EngineDeadError":
            return exc
        time.sleep(0.2)  # the engine core's exit status lands a moment after the front notices
        engine_log = EngineLog.from_environ()
        deaths = account(child_exits(self.stage_pids), engine_log)
        return failure(f"the vLLM engine on {self.device_id} died during request {request_id} ({type(exc).__name__})",
                       None, deaths, engine_failure_detail(engine_log), engine_log.path)

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
        joined = stop_loop(self.loop, self.thread)
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


def run_loop(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
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


def stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> bool:
    if not loop.is_closed():
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:
            pass
    thread.join(SHUTDOWN_TIMEOUT_S)
    return not thread.is_alive()


def engine_failure_detail(engine_log: EngineLog) -> str:
    """What a failure message adds about the engine: the log lines that name the cause, and where the log is."""
    if engine_log.path is None:
        return ". vLLM's output above has the root cause; the plan's engine arguments are in `edge plan --json`"
    causes = engine_log.causes()
    shown = "".join(f"\n    {line}" for line in causes)
    return (f". From the engine log ({engine_log.path}):{shown}" if causes
            else f". The engine log is {engine_log.path}; the plan's engine arguments are in `edge plan --json`")
