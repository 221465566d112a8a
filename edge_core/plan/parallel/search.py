"""Which layout runs the session? The search over groups of like devices, fewest devices first.

When no single device takes the session (or the user pins a layout), the
planner tries groups of like devices: the same backend, kind, model and
memory (vLLM's tensor parallelism assumes identical ranks), on one host
first, then across hosts on vLLM's multiprocessing executor in its
multi-node mode (Ray only when chosen, where the platform has it). The
smallest group that fits wins, tensor parallel before pipeline parallel. A
layout is admitted only when every rank fits its device.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from ...layout import EXECUTOR_MP, Layout
from ...plans import Refusal
from ..gates import Owner
from .attempt import Attempt, try_layout
from .groups import candidate_layouts, groupable, host_of, like_groups
from .layout import ParallelRequest
from .outcome import admitted_plan, refused_plan

if TYPE_CHECKING:
    from ...devices import Device
    from ...host import HostFacts
    from ...manifest import Manifest
    from ...plans import Plan
    from ...services.host_ledger import LedgerView
    from ...services.registry import Registry


def plan_parallel(manifest: Manifest, single: Plan, *, request: ParallelRequest, devices: list[Device],
                  host: HostFacts | None, hosts: Mapping[str, HostFacts | None] | None = None,
                  registry: Registry | None = None, ledger: LedgerView | None = None,
                  command_model: str | None = None) -> Plan:
    """Try layouts over groups of like devices when ``single`` (the one-device plan) found none, or one is pinned.

    Returns ``single`` unchanged when it was admitted and nothing is pinned,
    when no group can form, or when the session itself is invalid; otherwise
    the admitted layout with the fewest devices, or ``single``'s refusals with
    the parallel ones added (the smallest layout each group could not take).
    """
    if (single.admitted and not request.pinned) or single.manifest is None:
        return single
    if single.refusals and single.refusals[0].code in ("config_unreadable", "no_backend_installed") \
            and not single.verdicts:
        return single
    session = single.session
    facts: dict[str, HostFacts | None] = {"local": host, **(hosts or {})}
    groups = like_groups(devices)
    tried: list[Attempt] = []
    best: Attempt | None = None
    executor = request.executor or EXECUTOR_MP
    if request.nnodes > 1:
        return _plan_node(manifest, single, request, groups, facts, registry, devices, ledger, command_model)
    for group in groups:
        first = next(iter(group.values()))[0]
        if first.kind == "cpu" and request.device_ids and len(group) > 1:
            # CPUs named on several hosts: the pinned ranks spread evenly over them, a node per host.
            world = (request.tp or 1) * (request.pp or 1)
            layouts = [Layout(request.tp or 1, request.pp or 1, len(group), executor)] \
                if world % len(group) == 0 else []
        elif first.kind == "cpu":
            group = dict(list(group.items())[:1])  # unnamed, vLLM CPU ranks are planned on one host
            known = facts.get(host_of(first))
            nodes = min(len(known.allowed_nodes()), known.usable_cores) if known is not None else 0
            per_host = [request.tp * (request.pp or 1) if request.tp else (request.pp or max(nodes, 1))]
            layouts = candidate_layouts(per_host, request.tp, request.pp, executor)
        else:
            layouts = candidate_layouts([len(v) for v in group.values()], request.tp, request.pp, executor)
        for layout in layouts:
            if best is not None and layout.world_size >= best.layout.world_size:
                break
            attempt = try_layout(layout, group, manifest, session, facts, registry, devices, ledger)
            tried.append(attempt)
            if not attempt.refusals:
                best = attempt
                break
    if best is not None:
        return admitted_plan(manifest, single, best, request, facts, command_model,
                             Owner.of(best.outcomes[0][0], registry).rules())
    return refused_plan(single, tried, request, [d for d in devices if groupable(d)])


def _plan_node(manifest: Manifest, single: Plan, request: ParallelRequest, groups: list[dict[str, list[Device]]],
               facts: Mapping[str, HostFacts | None], registry: Registry | None, devices: list[Device],
               ledger: LedgerView | None, command_model: str | None) -> Plan:
    """Node ``request.node_rank`` of ``request.nnodes``: this host's own ranks of the layout, on its own devices.

    vLLM's multi-node numbering gives node ``i`` ranks ``i * k`` to ``(i + 1) * k - 1``, ``k`` the world
    size over the nodes; the other nodes plan theirs where they run, and the head checks when they meet
    that every node asked for the same layout, model and build (:mod:`edge_core.runtime.nodes`).
    """
    layout = Layout(request.tp or 1, request.pp or 1, request.nnodes, request.executor or EXECUTOR_MP)
    refusals: list[Refusal] = []
    if layout.executor != EXECUTOR_MP:
        refusals.append(Refusal(
            code="parallel_layout_invalid",
            message=f"--nnodes joins nodes on vLLM's multiprocessing executor, not {layout.executor}",
            remedy="leave out --distributed-executor-backend, or on a Ray cluster plan it from one host with a "
                   "device list per host (--devices A.json --devices B.json --distributed-executor-backend ray)",
            details={"dimension": "executor", "executor": layout.executor, "nnodes": request.nnodes}))
    elif layout.world_size % request.nnodes:
        refusals.append(Refusal(
            code="parallel_layout_invalid",
            message=f"{layout.world_size} rank{'s' if layout.world_size > 1 else ''} ({layout.label()}) cannot be "
                    f"shared evenly by {request.nnodes} nodes (vLLM runs the same number of ranks on every node)",
            remedy=f"make --tensor-parallel-size x --pipeline-parallel-size a multiple of {request.nnodes}, e.g. "
                   f"--tensor-parallel-size {request.nnodes}",
            details={"dimension": "nnodes", "nnodes": request.nnodes, "world_size": layout.world_size}))
    refusals += _address_refusals(request)
    tried: list[Attempt] = []
    if not refusals:
        for group in groups:
            group = dict(list(group.items())[:1])  # this host's devices: a node plans against its own
            attempt = try_layout(layout, group, manifest, single.session, facts, registry, devices, ledger,
                                  node=request.node_rank)
            tried.append(attempt)
            if not attempt.refusals:
                return admitted_plan(manifest, single, attempt, request, facts, command_model,
                                     Owner.of(attempt.outcomes[0][0], registry).rules())
    if refusals:
        return replace(single, admitted=False, refusals=tuple(refusals))
    return refused_plan(single, tried, request, [d for d in devices if groupable(d)])


def _address_refusals(request: ParallelRequest) -> list[Refusal]:
    """``node_unreachable`` when this node has no address its ranks could reach the head on."""
    address = request.address
    if address is None or address.problem is None:
        return []
    head = request.node_rank == 0
    return [Refusal(
        code="node_unreachable",
        message=f"node {request.node_rank}{' (the head)' if head else ''}: {address.problem}; vLLM's ranks "
                "would not meet",
        remedy=("give --master-addr as an address this host holds on the network the other nodes share (every "
                "node the same)" if head else
                "give --master-addr as node 0's address on a network this host shares with it (`ip route get "
                f"{address.master_ip or address.master_addr}` shows the way), and bring that interface up"),
        details=address.to_dict())]
