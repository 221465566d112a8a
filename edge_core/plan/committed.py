"""What is already admitted on this host, so the same bytes are never budgeted twice.

One mechanism: :mod:`edge_core.services.host_ledger`, one record per live edge session
on this host, whatever process, venv or interpreter holds it. A checkpoint
session registers when the CLI admits it; a graph stage run in a process
(:func:`edge_core.runtime.run_graph_stage`) registers its own record for the
length of the run (unless ``edge run`` admitted it as the process's session),
so the next stage planned in the same process sees it exactly as another
process does. The capacity gate subtracts what the live records hold and the
pool does not show yet (:func:`check_committed`, refused ``device_committed``
naming the holders); a plan too big for the pool alone still names them
(:func:`with_holders`).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..plans import Refusal
from ..services.host_ledger import HOST_POOL

if TYPE_CHECKING:
    from ..devices import Device
    from ..plans import Plan
    from ..services.host_ledger import LedgerView, SessionRecord

#: The ``command`` of a graph stage's own ledger record (``edge ps`` lists it beside the sessions).
STAGE_COMMAND = "graph stage"


def pool_key(device: Device) -> str:
    """The ledger's key for ``device``'s pool: the shared host RAM, or the device's own memory."""
    return HOST_POOL if device.memory_pool == HOST_POOL else device.device_id


def ledger_bytes(plan: Plan) -> dict[str, int]:
    """What an admitted plan holds per ledger pool: its admission bytes, split by the pool each term draws on."""
    device = plan.selected_device
    if device is None or plan.peak is None:
        return {}
    own = pool_key(device)
    held = {own: plan.peak.admission_bytes}
    if own != HOST_POOL:
        host_terms = sum(r.bytes for r in plan.reservations if r.pool == HOST_POOL and not r.reclaimable)
        if host_terms:
            held[HOST_POOL] = host_terms
    return held


def with_holders(refusals: list[Refusal], pool: str, ledger: LedgerView | None) -> tuple[Refusal, ...]:
    """Budget refusals that also name the live edge sessions holding memory on ``pool`` (the others unchanged).

    A loaded session's memory is already gone from the pool's capacity, so the
    plan is refused for want of memory rather than ``device_committed``; the
    user still needs to know who holds it.
    """
    holders = [r for r in (ledger.records if ledger is not None else ()) if r.reserved_bytes.get(pool)]
    if not holders:
        return tuple(refusals)
    named = "; ".join(f"{r.describe()} holds {r.reserved_bytes[pool] / 2**30:.1f} GiB" for r in holders)
    out = []
    for refusal in refusals:
        if refusal.code != "budget_exceeds_device":
            out.append(refusal)
            continue
        out.append(replace(refusal, message=f"{refusal.message} (other edge sessions on this host: {named})",
                           remedy=f"{refusal.remedy}; or stop the other session (`edge stop {holders[0].pid}`)",
                           details={**refusal.details, "holders": [
                               {"pid": r.pid, "session_id": r.session_id, "command": r.command, "model": r.model,
                                "reserved_bytes": r.reserved_bytes[pool]} for r in holders]}))
    return tuple(out)


def committed_refusal(device: Device, needed: int, capacity: int, committed: int,
                      holders: tuple[SessionRecord, ...]) -> Refusal:
    """``device_committed``: it would fit, but not beside what live sessions on this host were admitted to hold."""
    gib = 2**30
    pool = pool_key(device)
    named = "; ".join(f"{r.unseen_bytes(pool) / gib:.1f} GiB to {r.describe()}" for r in holders)
    # Stopping the process that asks would be no remedy: its own stages end when their runs return.
    others = [r for r in holders if not (r.pid == os.getpid() and r.command == STAGE_COMMAND)]
    if others:
        remedy = (f"stop it (`edge stop {others[0].pid}`) or wait for it to finish (`--wait SECONDS` queues this "
                  "admission)")
    elif holders:
        remedy = "run it after the graph stages this process is running (each releases its bytes when its run ends)"
    else:
        remedy = "wait for the other sessions to finish (`edge ps` lists them)"
    return Refusal(
        code="device_committed", device_id=device.device_id,
        message=(f"{device.device_id}: this session needs {needed / gib:.1f} GiB of {capacity / gib:.1f} GiB, but "
                 f"{committed / gib:.1f} GiB is committed to other edge sessions and not yet in use: {named}"),
        remedy=remedy,
        details={"needed_bytes": needed, "capacity_bytes": capacity, "committed_bytes": committed,
                 "holders": holder_dicts(holders, pool)},
    )


def holder_dicts(holders: tuple[SessionRecord, ...], pool: str) -> list[dict[str, Any]]:
    """The live records holding ``pool`` as plans show them (``details.holders``, ``stage.host_pool.holders``)."""
    return [{"pid": r.pid, "session_id": r.session_id, "command": r.command, "model": r.model,
             "unseen_bytes": r.unseen_bytes(pool)} for r in holders]


def check_committed(device: Device, needed: int, capacity: int, ledger: LedgerView | None) -> Refusal | None:
    """``device_committed`` when ``needed`` bytes fit ``capacity`` only without what live records hold unseen."""
    pool = pool_key(device)
    committed = ledger.committed_bytes(pool) if ledger is not None else 0
    if ledger is None or not committed or needed <= capacity - committed:
        return None
    return committed_refusal(device, needed, capacity, committed, ledger.holders(pool))
