"""What is already admitted, so the same bytes are never budgeted twice.

Across processes: :mod:`edge_core.host_ledger` holds one record per live edge
session on this host; the capacity gate subtracts what those records hold and
the pool does not show yet, and :func:`committed_refusal` names the holders
when that is why a plan does not fit.

Within one process: the CPU session and every iGPU/NPU stage draw on the
host pool the CPU row carries (SPEC section 3). Each admission adds its bytes
to :class:`HostLedger` and each release takes them out; planning a graph
stage consults the total.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..host_ledger import HOST_POOL
from .terms import external_reserve_bytes
from .types import Refusal

if TYPE_CHECKING:
    from ..devices import Device
    from ..host_ledger import LedgerView, SessionRecord
    from .types import Plan


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
    named = "; ".join(f"{r.unseen_bytes(pool_key(device)) / gib:.1f} GiB to {r.describe()}" for r in holders)
    first = holders[0].pid if holders else None
    return Refusal(
        code="device_committed", device_id=device.device_id,
        message=(f"{device.device_id}: this session needs {needed / gib:.1f} GiB of {capacity / gib:.1f} GiB, but "
                 f"{committed / gib:.1f} GiB is committed to other edge sessions and not yet in use: {named}"),
        remedy=(f"stop it (`edge stop {first}`) or wait for it to finish (`--wait SECONDS` queues this admission)"
                if first is not None else "wait for the other sessions to finish (`edge ps` lists them)"),
        details={"needed_bytes": needed, "capacity_bytes": capacity, "committed_bytes": committed,
                 "holders": [{"pid": r.pid, "session_id": r.session_id, "command": r.command, "model": r.model,
                              "unseen_bytes": r.unseen_bytes(pool_key(device))} for r in holders]},
    )


@dataclass(frozen=True)
class LedgerEntry:
    """Bytes one admitted session or stage holds on the host pool.

    ``bytes`` is the entry's predicted peak plus its safety margin; the
    external reserve (RAM kept free for the OS) is a property of the host,
    counted once by whoever checks capacity, never once per entry.
    """

    entry_id: str
    bytes: int
    what: str
    device_id: str | None = None
    evidence: str = "E"

    def to_dict(self) -> dict[str, Any]:
        return {"entry_id": self.entry_id, "bytes": self.bytes, "what": self.what,
                "device_id": self.device_id, "evidence": self.evidence}


def held_bytes(plan: Plan) -> int:
    """What an admitted plan holds on its pool: admission bytes less the per-host external reserve."""
    if plan.peak is None:
        return 0
    return max(plan.peak.admission_bytes - external_reserve_bytes(plan.reservations), 0)


class HostLedger:
    """What has been admitted on this host's RAM pool, by id; thread-safe.

    The CPU session and every iGPU/NPU stage draw on the same pool (SPEC
    section 3), so each admission adds its bytes here and each release takes
    them out; planning a stage consults the total. Capacity is the host's
    usable RAM as the probe read it *before* anything the ledger holds was
    loaded, so a loaded session is counted once — by the ledger — and not again
    through a smaller ``MemAvailable``.
    """

    def __init__(self) -> None:
        self._entries: dict[str, LedgerEntry] = {}
        self._lock = threading.Lock()

    def entries(self) -> tuple[LedgerEntry, ...]:
        with self._lock:
            return tuple(self._entries.values())

    @property
    def admitted_bytes(self) -> int:
        with self._lock:
            return sum(e.bytes for e in self._entries.values())

    def admit(self, entry_id: str, nbytes: int, *, what: str, device_id: str | None = None,
              evidence: str = "E", capacity_bytes: int | None = None) -> LedgerEntry:
        """Record ``nbytes`` under ``entry_id``; with ``capacity_bytes``, only if everything still fits.

        Raises ValueError for a duplicate id, a negative size, or (with a
        capacity) when the entry would not fit beside what is admitted — checked
        and recorded under one lock, so two admissions cannot both take the
        last free bytes.
        """
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"ledger entry {entry_id!r}: bytes must be a non-negative int, got {nbytes!r}")
        entry = LedgerEntry(entry_id, nbytes, what, device_id, evidence)
        with self._lock:
            if entry_id in self._entries:
                raise ValueError(f"ledger entry {entry_id!r} is already admitted; release it first")
            admitted = sum(e.bytes for e in self._entries.values())
            if capacity_bytes is not None and admitted + nbytes > capacity_bytes:
                raise ValueError(f"ledger entry {entry_id!r} needs {nbytes} bytes but only "
                                 f"{max(capacity_bytes - admitted, 0)} of {capacity_bytes} are free")
            self._entries[entry_id] = entry
        return entry

    def admit_plan(self, plan: Plan, entry_id: str | None = None) -> LedgerEntry:
        """Record an admitted plan on the host pool (a CPU session, a graph stage)."""
        if not plan.admitted or plan.peak is None:
            raise ValueError(f"only an admitted plan holds memory; {plan.model_path} was refused")
        device, manifest = plan.selected_device, plan.manifest
        assert device is not None and manifest is not None  # an admitted plan has both
        if device.memory_pool != "host_ram":
            raise ValueError(f"{device.device_id} has its own {device.memory_pool}; it does not draw on the host pool")
        what = f"{device.backend or device.device_id} {'stage' if getattr(plan, 'stage', None) else 'session'} " \
               f"of {manifest.architecture or manifest.model_type or os.path.basename(plan.model_path)}"
        return self.admit(entry_id or f"{device.device_id}:{manifest.artifact_id}", held_bytes(plan), what=what,
                          device_id=device.device_id)

    def release(self, entry_id: str) -> bool:
        """Take ``entry_id`` out; True if it was admitted."""
        with self._lock:
            return self._entries.pop(entry_id, None) is not None

    def to_dict(self) -> dict[str, Any]:
        entries = self.entries()
        return {"admitted_bytes": sum(e.bytes for e in entries), "entries": [e.to_dict() for e in entries]}


#: The ledger of this process's host pool: used when a caller passes none.
HOST_LEDGER = HostLedger()
