"""The gate pipeline both planners walk a device through, and the one way they call its backend.

A planner judges each candidate (:func:`candidate_order`) with its own early
gates (masked, runnable, placement), then the shared ones: the weight format
(:func:`format_gate`), the backend's own gates on the whole budget
(:func:`backend_budget`) and capacity (:func:`budget_gates`). :func:`walk`
keeps the record: the first device that passes every gate is selected, later
ones are pre-approved fallbacks, the others keep why they were refused. Only
:class:`Owner` calls a backend's hooks, and only when that backend is
installed here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..budget import combine
from ..engines.vllm import VLLM_RULES
from .capacity import capacity_of
from .committed import check_committed, pool_key, with_holders
from .remedies import format_refusal
from .terms import headroom_reservations

if TYPE_CHECKING:
    from collections.abc import Iterable

    from ..budget import Peak, Reservation
    from ..devices import Device
    from ..engine import EngineRules
    from ..host import HostFacts
    from ..layout import DeviceShare
    from ..manifest import Manifest
    from ..plans import DeviceVerdict, Refusal, SessionSpec
    from ..services.host_ledger import LedgerView
    from ..services.registry import Registry

#: The verdict note of a device that passed every gate after another was selected.
FALLBACK_NOTE = "a fallback: an earlier candidate was selected"


def candidate_order(devices: list[Device]) -> list[Device]:
    """Private pool before shared pool, then larger. Not a performance ranking."""
    return sorted(devices, key=lambda d: (d.memory_pool != "vram", -d.memory_bytes, d.device_id))


@dataclass(frozen=True)
class Owner:
    """The backend that owns ``device`` when it is installed here; ``registry`` is None when none is."""

    device: Device
    registry: Registry | None

    @classmethod
    def of(cls, device: Device, registry: Registry | None) -> Owner:
        owned = registry is not None and registry.owner(device) is not None
        return cls(device, registry if owned else None)

    @property
    def installed(self) -> bool:
        return self.registry is not None

    def call(self, hook: str, **kwargs: Any) -> Any:
        """The owning backend's answer to ``hook``; None when no installed backend owns the device."""
        return None if self.registry is None else self.registry.call_owner(self.device, hook, **kwargs)

    def formats(self) -> list[str]:
        """The weight formats the device runs: its backend's answer, else what the device list says."""
        return self.call("weight_formats") or list(self.device.weight_formats)

    def rules(self) -> EngineRules:
        """The engine's rules for the checkpoint planner: its backend's ``engine_rules``, else vLLM's.

        vLLM's answer for a device no installed backend owns (a saved device
        list), as every backend that plans checkpoints runs them on vLLM.
        """
        return self.call("engine_rules") or VLLM_RULES

    def missing_note(self, consequence: str) -> tuple[str, ...]:
        """A plan note when no installed backend owns the device: planned from the list alone, ``consequence``."""
        if self.installed:
            return ()
        device = self.device
        return (f"{device.device_id}: its backend ({device.plugin or device.backend}) is not installed here; "
                f"planned from the device list alone, {consequence}",)


def format_gate(owner: Owner, manifest: Manifest, formats: list[str]) -> Refusal | None:
    """``format_not_supported`` when the artifact's weight format is not among ``formats``; else None."""
    if manifest.weight_format in formats:
        return None
    remedy = owner.call("format_remedy", weight_format=manifest.weight_format)
    return format_refusal(owner.device, manifest, formats, remedy)


@dataclass(frozen=True)
class Budget:
    """One device's whole budget and what its backend's gates said of it."""

    reservations: tuple[Reservation, ...]
    peak: Peak
    capacity_bytes: int | None
    how: str
    gated: tuple[Refusal, ...] = ()


def backend_budget(owner: Owner, terms: list[Reservation], *, manifest: Manifest, session: SessionSpec,
                   host: HostFacts | None, devices: Iterable[Device], share: DeviceShare | None = None) -> Budget:
    """The planner's ``terms`` plus the backend's, judged by its ``gate_plan``, plus the core's headroom.

    The budget is pure arithmetic, computed before any verdict counts, so a
    refused device keeps the terms it was refused on. ``gate_plan`` judges the
    usage terms; headroom is the core's admission policy, added after it.
    """
    device = owner.device
    terms = list(terms)
    gated: list[Refusal] = []
    if owner.installed:
        terms += owner.call("reserve_memory", manifest=manifest, session=session, host=host, share=share) or []
        gated = owner.call("gate_plan", manifest=manifest, session=session, host=host, reservations=terms,
                           share=share) or []
    terms = terms + headroom_reservations(device, combine(terms, device.memory_pool).held_bytes, host)
    capacity, how = capacity_of(device, host, devices)
    return Budget(tuple(terms), combine(terms, device.memory_pool), capacity, how, tuple(gated))


def budget_gates(device: Device, budget: Budget, ledger: LedgerView | None,
                 too_big: Callable[[], Refusal] | None) -> tuple[str | None, tuple[Refusal, ...]]:
    """The backend's gates, then capacity: ``(gate, refusals)``, or ``(None, ())`` when the device passes.

    Capacity refuses a budget too big for the pool alone (``too_big()``, naming
    the live sessions that hold the pool) or one that fits only without what
    those sessions hold and the pool does not show yet. It is not checked
    when the capacity is unknown or ``too_big`` is None.
    """
    pool = pool_key(device)
    if budget.gated:
        return "backend", with_holders(list(budget.gated), pool, ledger)
    capacity = budget.capacity_bytes
    if capacity is None or too_big is None:
        return None, ()
    if budget.peak.admission_bytes > capacity:
        return "capacity", with_holders([too_big()], pool, ledger)
    committed = check_committed(device, budget.peak.admission_bytes, capacity, ledger)
    return ("capacity", (committed,)) if committed is not None else (None, ())


@dataclass(frozen=True)
class Judgement:
    """What a planner's gates said of one device: its verdict row (``gate`` None when it passed)."""

    verdict: DeviceVerdict
    notes: tuple[str, ...] = ()
    fallbacks: tuple[dict[str, Any], ...] = ()
    #: What the planner builds its plan from when this device is selected.
    payload: Any = None


@dataclass
class Walk:
    """The record of one walk over the candidates, in candidate order."""

    verdicts: list[DeviceVerdict] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    fallbacks: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    selected: tuple[Device, Any] | None = None


def walk(devices: list[Device], judge: Callable[[Device], Judgement], notes: Iterable[str] = ()) -> Walk:
    """Judge every candidate; select the first that passes, approve the later ones as fallbacks."""
    record = Walk(notes=list(notes))
    for device in candidate_order(devices):
        judged = judge(device)
        record.notes.extend(judged.notes)
        record.fallbacks.extend(judged.fallbacks)
        if judged.verdict.gate is not None:
            record.verdicts.append(judged.verdict)
            record.refusals.extend(judged.verdict.refusals)
        elif record.selected is None:
            record.selected = (device, judged.payload)
            record.verdicts.append(replace(judged.verdict, selected=True))
        else:
            record.fallbacks.append({"kind": "device", "device_id": device.device_id, "backend": device.backend,
                                     "approved": True, "note": "passes every gate; used only if asked for"})
            record.verdicts.append(replace(judged.verdict, note=FALLBACK_NOTE))
    return record
