"""Does every rank of one layout fit its device? One layout budgeted on one group of like devices."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...layout import DeviceShare, Layout
from ...plans import Refusal
from ..committed import pool_key
from ..decode import DeviceOutcome, plan_on_device
from ..pool import with_context
from .gates import layout_refusals, model_config, num_layers, pp_partition
from .groups import group_key, host_of, rank_capacity
from .layout import RankBudget
from .weights import rank_weight_bytes

if TYPE_CHECKING:
    from ...devices import Device
    from ...host import HostFacts
    from ...manifest import Manifest
    from ...plans import SessionSpec
    from ...services.host_ledger import LedgerView
    from ...services.registry import Registry


@dataclass
class Attempt:
    """One layout tried on one group: its refusals, or every device's share, outcome and ranks."""

    layout: Layout
    refusals: list[Refusal]
    outcomes: list[tuple[Device, DeviceShare, DeviceOutcome]] = field(default_factory=list)
    ranks: list[RankBudget] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)

    @property
    def reached_budget(self) -> bool:
        return bool(self.outcomes)


def try_layout(layout: Layout, group: dict[str, list[Device]], manifest: Manifest, session: SessionSpec,
                host_facts: Mapping[str, HostFacts | None], registry: Registry | None, devices: list[Device],
                ledger: LedgerView | None, node: int | None = None) -> Attempt:
    """Budget every rank of ``layout`` on ``group``; with ``node``, only that node's ranks, on the group's one host."""
    capacity = rank_capacity(group, host_facts)
    if node is not None and capacity is not None:
        capacity *= layout.hosts  # every node is taken to be like this one; each checks its own
    attempt = Attempt(layout, layout_refusals(manifest, layout, max_ranks=capacity))
    if attempt.refusals:
        return attempt
    config = model_config(manifest)
    layers = num_layers(config) or 1
    stages = pp_partition(layers, layout.pp) if layout.pp > 1 else [(0, layers)]
    per_stage = rank_weight_bytes(manifest, layout)
    hosts = list(group)[: layout.hosts]
    attempt.hosts = hosts
    first = group[hosts[0]][0]
    # Which device runs each rank (rank = pp_rank * tp + tp_rank, as vLLM numbers them).
    placed: dict[str, list[int]] = {}
    where: dict[int, Device] = {}
    for rank in range(layout.world_size):
        on, local = divmod(rank, layout.ranks_per_host)  # vLLM's multi-node numbering
        if node is not None and on != node:
            continue  # another node's rank: that node plans it against its own devices
        # vLLM CPU's ranks share their host's CPU, each bound to its own cores; a GPU runs one rank.
        device = group[hosts[0 if node is not None else on]][0 if first.kind == "cpu" else local]
        placed.setdefault(device.device_id, []).append(rank)
        where[rank] = device
    by_id = {d.device_id: d for hosted in group.values() for d in hosted}
    # Like devices running like shares get the same budget: plan one, reuse it (an 8-GPU stage costs one).
    # The first refusal ends the layout: every rank must fit, and its like devices would say the same.
    admitted: dict[tuple[Any, ...], DeviceOutcome] = {}
    for device_id, ranks in placed.items():
        device = by_id[device_id]
        stage_ids = sorted({r // layout.tp for r in ranks})
        weights = [per_stage[r // layout.tp] for r in ranks]
        share = DeviceShare(layout=layout, ranks=tuple(ranks), weight_bytes=sum(weights),
                            rank_weight_bytes=max(weights), pp_rank=stage_ids[0] if len(stage_ids) == 1 else None,
                            layers=stages[stage_ids[0]] if len(stage_ids) == 1 else None)
        committed = ledger.committed_bytes(pool_key(device)) if ledger is not None else 0
        alike = (group_key(device), host_of(device), share.weight_bytes, share.layers, len(ranks), committed)
        outcome = admitted.get(alike) or plan_on_device(
            device, manifest, session, host_facts.get(host_of(device)), registry, devices, ledger, share=share)
        attempt.outcomes.append((device, share, outcome))
        if outcome.refusals:
            attempt.refusals.extend(outcome.refusals)
            break
        admitted[alike] = outcome
        for rank in ranks:
            pp_rank, tp_rank = divmod(rank, layout.tp)
            attempt.ranks.append(RankBudget(
                rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, device_id=device_id, host=host_of(device),
                layers=stages[pp_rank], weight_bytes=per_stage[pp_rank],
                kv_cache_bytes=outcome.kv.pool_bytes if outcome.kv is not None else 0))
    fitted = {o.session.max_model_len for _, _, o in attempt.outcomes if o.session is not None}
    if session.max_model_len_auto and not attempt.refusals and len(fitted) > 1:
        # --max-model-len auto fitted each device on its own: every rank runs the shortest of them.
        return try_layout(layout, group, manifest, with_context(session, min(int(n or 0) for n in fitted)),
                          host_facts, registry, devices, ledger, node)
    if layout.hosts > 1 and node is None:  # joined nodes compare their builds when they meet (runtime.nodes)
        attempt.refusals.extend(host_refusals(group, hosts))
    attempt.ranks.sort(key=lambda r: r.rank)
    return attempt


def host_refusals(group: dict[str, list[Device]], hosts: list[str]) -> list[Refusal]:
    """Every host of a multi-host layout runs the same runtime build and version (read from the device documents)."""
    builds = {h: (group[h][0].extras or {}).get("runtime") for h in hosts}
    if None in builds.values() or len(set(builds.values())) > 1:
        rows = ", ".join(f"{h}: {b or 'not recorded'}" for h, b in builds.items())
        return [Refusal(code="parallel_layout_invalid", device_id=group[hosts[0]][0].device_id,
                        message=f"the hosts of one multi-node layout must run the same vLLM build and version; the "
                                f"device documents say {rows}",
                        remedy="install the same edge backend and vLLM version on every host, then capture each "
                               "host's list again with `edge devices --json`",
                        details={"dimension": "runtime", "runtimes": builds})]
    return []
