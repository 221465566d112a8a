"""What plan does a parallel search end in? The admitted layout's plan, or the one-device plan's refusals plus the layouts'."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...engines.vllm_launch import MASTER_PORT
from ...layout import EXECUTOR_MP
from ...plans import Refusal
from ..decode import engine_kwargs_for
from ..execution import with_mode
from .groups import host_of, mixed_group_refusal
from .layout import ParallelRequest
from .weights import tensor_roles

if TYPE_CHECKING:
    from ...devices import Device
    from ...engine import EngineRules
    from ...host import HostFacts
    from ...kv import KVEstimate
    from ...layout import Layout
    from ...manifest import Manifest
    from ...plans import DeviceVerdict, Plan, SessionSpec
    from .attempt import Attempt


def admitted_plan(manifest: Manifest, single: Plan, attempt: Attempt, request: ParallelRequest,
                  facts: Mapping[str, HostFacts | None], command_model: str | None, rules: EngineRules) -> Plan:
    """``single`` turned into the plan of ``attempt``: rank 0's device in the table, every rank in ``parallel``.

    ``rules`` are the engine's (rank 0's backend's): they write the launch environment and node commands.
    """
    layout = attempt.layout
    device, _, outcome = attempt.outcomes[0]
    assert outcome.kv is not None and outcome.peak is not None
    session = with_mode(outcome.session or single.session, outcome.execution)
    kv = rank_pool(outcome.kv, [o.kv for _, _, o in attempt.outcomes if o.kv is not None], rules)
    kwargs = _engine_kwargs(manifest, session, attempt, request, kv)
    env, unpinned = rules.launch_env(device, layout, session, facts.get(host_of(device)),
                                     [d for d, _, _ in attempt.outcomes])
    if request.nnodes > 1 and request.address is not None:
        env = {**env, **rules.node_address_env(request.address)}
    parallel = _parallel_section(manifest, single, attempt, request, facts, command_model, kwargs, env, rules)
    return replace(single, admitted=True, refusals=(), selected_device=device, reservations=outcome.reservations,
                   peak=outcome.peak, capacity_bytes=outcome.capacity_bytes or 0, kv=kv, engine_kwargs=kwargs,
                   verdicts=_verdicts(single, attempt),
                   notes=_notes(manifest, single, attempt, request, unpinned, rules),
                   parallel=parallel, session=session, execution=outcome.execution)


def rank_pool(first: KVEstimate, every: list[KVEstimate], rules: EngineRules) -> KVEstimate:
    """The one ``kv_cache_memory_bytes`` every rank is handed (vLLM's is per rank), as rank 0's estimate.

    Every rank gets the same figure and vLLM gives each the smallest rank's
    block count: the largest of the ranks' pools where each asked for its own
    (the most layers' blocks), the smallest where a pool was cut to fit its
    device (the tightest device's).
    """
    pools = [kv.pool for kv in every if kv.pool is not None]
    charge = max(kv.bytes_vllm for kv in every)
    if not pools or first.pool is None:
        return replace(first, bytes_vllm=charge)
    cut = any(p.source in ("fit", "one_sequence") for p in pools)
    size = (min if cut else max)(p.bytes for p in pools)
    source = next((p.source for p in pools if p.bytes == size), first.pool.source)
    return replace(first, bytes_vllm=charge).with_pool(size, source, rules)


def _engine_kwargs(manifest: Manifest, session: SessionSpec, attempt: Attempt, request: ParallelRequest,
                   kv: KVEstimate) -> dict[str, Any]:
    """Rank 0's engine arguments with the layout's sizes, the tightest rank's memory fraction and the node flags."""
    layout = attempt.layout
    device, _, outcome = attempt.outcomes[0]
    assert outcome.peak is not None
    kwargs = engine_kwargs_for(manifest, session, device, kv, outcome.peak, outcome.capacity_bytes or 0)
    fractions = [o.peak.admission_bytes / (d.memory_bytes or o.capacity_bytes or 1)
                 for d, _, o in attempt.outcomes if o.peak is not None]
    kwargs["gpu_memory_utilization"] = round(min(max(max(fractions), 0.01), 0.99) + 0.005, 2)
    kwargs["tensor_parallel_size"] = layout.tp
    kwargs["pipeline_parallel_size"] = layout.pp
    kwargs["distributed_executor_backend"] = layout.executor
    if request.nnodes > 1:
        kwargs.update(nnodes=request.nnodes, node_rank=request.node_rank, master_addr=request.master_addr,
                      master_port=request.master_port or MASTER_PORT)
    elif layout.hosts > 1 and layout.executor == EXECUTOR_MP:
        kwargs.update(nnodes=layout.hosts, node_rank=0, master_addr=attempt.hosts[0], master_port=MASTER_PORT)
    return kwargs


def _parallel_section(manifest: Manifest, single: Plan, attempt: Attempt, request: ParallelRequest,
                      facts: Mapping[str, HostFacts | None], command_model: str | None, kwargs: dict[str, Any],
                      env: dict[str, str], rules: EngineRules) -> dict[str, Any]:
    """The plan's ``parallel``: the layout, its environment, every rank and device, and each node's command."""
    layout = attempt.layout
    device = attempt.outcomes[0][0]
    joined = request.nnodes > 1
    parallel = {
        "tensor_parallel_size": layout.tp, "pipeline_parallel_size": layout.pp, "world_size": layout.world_size,
        "executor": layout.executor, "hosts": attempt.hosts, "label": layout.label(),
        "requested": request.to_dict(), "env": env,
        "ranks": [r.to_dict() for r in attempt.ranks],
        "devices": [{"device_id": d.device_id, "host": host_of(d), "share": s.to_dict(),
                     "peak": o.peak.to_dict() if o.peak is not None else None,
                     "capacity_bytes": o.capacity_bytes, "reservations": [t.to_dict() for t in o.reservations]}
                    for d, s, o in attempt.outcomes],
        "nnodes": layout.hosts,
        "commands": node_edge_commands(request, layout, command_model or manifest.path) if joined
        else rules.node_commands(attempt.hosts, command_model or manifest.path, layout, device_files(single),
                                 kwargs, rules.node_env(device, layout, attempt.hosts, facts, env))
        if layout.hosts > 1 else [],
    }
    if joined:
        node: dict[str, Any] = {"nnodes": request.nnodes, "node_rank": request.node_rank,
                                "master_addr": request.master_addr, "master_port": request.master_port or MASTER_PORT,
                                "ranks": [r.rank for r in attempt.ranks], "headless": request.node_rank > 0}
        if request.address is not None:
            node["address"] = request.address.to_dict()
        parallel["node"] = node
    return parallel


def _verdicts(single: Plan, attempt: Attempt) -> tuple[DeviceVerdict, ...]:
    """``single``'s verdicts with the layout's devices selected, each naming its ranks."""
    layout = attempt.layout
    chosen = {d.device_id: (s, o) for d, s, o in attempt.outcomes}
    verdicts: list[DeviceVerdict] = []
    for verdict in single.verdicts:
        if verdict.device_id in chosen:
            s, o = chosen[verdict.device_id]
            ranks = ", ".join(map(str, s.ranks))
            verdicts.append(o.verdict(verdict.device_id, selected=True,
                                      note=f"rank{'s' if len(s.ranks) > 1 else ''} {ranks} of {layout.label()}"))
        else:
            verdicts.append(verdict)
    listed = {v.device_id for v in verdicts}
    for d, s, o in attempt.outcomes:  # devices of other hosts' documents are not in the single walk's order
        if d.device_id not in listed:
            verdicts.append(o.verdict(d.device_id, selected=True, note=f"ranks {list(s.ranks)} of {layout.label()}"))
    return tuple(verdicts)


def _notes(manifest: Manifest, single: Plan, attempt: Attempt, request: ParallelRequest,
           unpinned: str | None, rules: EngineRules) -> tuple[str, ...]:
    """``single``'s notes plus why a layout was chosen, and what the plan could not pin."""
    layout = attempt.layout
    device = attempt.outcomes[0][0]
    if not tensor_roles(manifest).from_tensors:
        notes_without_tensors: tuple[str, ...] = ("the checkpoint lists no tensors (a graph, or an unread table): each "
                                                  "rank's weights are the whole model's / TP, an estimate",)
    else:
        notes_without_tensors = ()
    count = len(attempt.outcomes)
    why = ("pinned" if request.pinned else "no single device takes the session")
    return single.notes + notes_without_tensors + (
        f"{why}: {layout.label()} on {count} device{'s' if count > 1 else ''} ({layout.flags()}); the table is "
        "rank 0's device, `parallel` in --json has each",) + ((unpinned,) if unpinned else ()) + (
        rules.launch_notes(device, layout) if request.nnodes <= 1 else ())


def device_files(plan: Plan) -> list[str]:
    """The device-list files a plan read (``--devices``), for a Ray head's ``edge serve``."""
    source = plan.devices_source
    return source.removeprefix("file:").split(",") if source.startswith("file:") else []


def node_edge_commands(request: ParallelRequest, layout: Layout, model: str, command: str = "serve") -> list[dict[str, Any]]:
    """The ``edge`` command each node of a ``--nnodes`` session runs (node 0 serves; the others run headless)."""
    port = request.master_port or MASTER_PORT
    rows = []
    for rank in range(request.nnodes):
        rows.append({"node_rank": rank,
                     "ranks": list(range(rank * layout.ranks_per_host, (rank + 1) * layout.ranks_per_host)),
                     "command": f"edge {command} --model {model} {layout.flags()} --nnodes {request.nnodes} "
                                f"--node-rank {rank} --master-addr {request.master_addr} --master-port {port}"})
    return rows


def refused_plan(single: Plan, tried: list[Attempt], request: ParallelRequest, candidates: list[Device]) -> Plan:
    """``single``'s refusals plus each layout's reasons, one per distinct reason (like devices repeat them).

    A pinned layout no group could even form is refused for the devices: unlike
    ones named (``candidates`` are the groupable devices), else that there are
    too few.
    """
    extra: list[Refusal] = []
    for attempt in tried:
        if not (request.pinned or attempt.reached_budget):
            continue  # a layout the model cannot split is not news when nothing was pinned
        seen: set[tuple[str, str]] = set()
        for refusal in attempt.refusals:
            key = (refusal.code, refusal.message.replace(refusal.device_id or "\0", "DEVICE"))
            if key in seen:
                continue
            seen.add(key)
            extra.append(replace(refusal, message=f"{attempt.layout.label()}: {refusal.message}",
                                 details={**refusal.details,
                                          "layout": {"tp": attempt.layout.tp, "pp": attempt.layout.pp}}))
    mixed = mixed_group_refusal(candidates) if len({d.kind for d in candidates}) == 1 else None
    if request.pinned and not tried and mixed is not None:
        extra.append(mixed)
    elif request.pinned and not tried:
        extra.append(Refusal(
            code="parallel_layout_invalid",
            message=f"no group of like devices can run {request.tp or 1} x {request.pp or 1} ranks here",
            remedy="check `edge devices` for the runnable devices of one backend and model, or plan against "
                   "captured device lists with --devices",
            details={"dimension": "devices", **request.to_dict()}))
    largest = max((a for a in tried if a.reached_budget), key=lambda a: a.layout.world_size, default=None)
    notes = single.notes
    if tried:
        notes += ("parallel layouts tried: " + ", ".join(a.layout.label() for a in tried),)
    if largest is not None and not request.pinned:
        extra.append(_largest_refusal(single, largest))
    refusals = tuple(extra) if request.pinned else single.refusals + tuple(extra)
    return replace(single, admitted=False, refusals=refusals or single.refusals, notes=notes)


#: A 4-bit build's weights against bf16's (GPTQ/AWQ int4 with group scales: ~0.27-0.3 of the bytes).
FOUR_BIT_FRACTION = 0.3


def _largest_refusal(single: Plan, attempt: Attempt) -> Refusal:
    """What the widest layout tried still lacks, and the build that would fit it."""
    gib = 2**30
    device, share, outcome = max(attempt.outcomes, key=lambda o: o[2].peak.admission_bytes if o[2].peak else 0)
    needed = outcome.peak.admission_bytes if outcome.peak else 0
    capacity = outcome.capacity_bytes or device.memory_bytes
    remedy = "use more devices, a shorter context (--max-model-len), or a quantized build of this model"
    manifest = single.manifest
    if manifest is not None and not manifest.quantized:
        quantized = share.rank_weight_bytes * FOUR_BIT_FRACTION
        remedy = (f"use a 4-bit build of this model (GPTQ or AWQ int4: about {quantized / gib:.1f} GiB of weights "
                  f"per rank at {attempt.layout.label()}, against {share.rank_weight_bytes / gib:.1f} GiB in "
                  f"{manifest.dtype or 'its dtype'}), more devices, or a shorter context (--max-model-len)")
    return Refusal(
        code="budget_exceeds_device", device_id=device.device_id,
        message=(f"even split over every like device ({attempt.layout.label()}), a rank needs "
                 f"{needed / gib:.1f} GiB and {device.device_id} has {capacity / gib:.1f} GiB"),
        remedy=remedy,
        details={"layout": {"tp": attempt.layout.tp, "pp": attempt.layout.pp}, "needed_bytes": needed,
                 "capacity_bytes": capacity, "rank_weight_bytes": share.rank_weight_bytes})
