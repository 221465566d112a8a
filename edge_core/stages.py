"""Can this exported graph run as one stage here, on which device, with how many bytes — and did it?

iGPUs and NPUs execute exported graphs one stage at a time, never a whole
decode session (SPEC section 4). This module plans such a stage and checks it
after its first run:

* **plan** (:func:`plan_graph_stage`, reached from ``make_plan`` when the
  artifact is an ``.onnx`` graph): the candidates are the devices that execute
  graphs; each goes through the gates *reachable* (a device that exists but no
  interpreter here drives it is ``device_unreachable_from_this_process``, naming
  the route and interpreter that would), *format* (the graph's scheme against
  the formats of the route that resolved), the backend's own gates, and
  *capacity* from the one host ledger;
* **host ledger** (:class:`HostLedger`): iGPU and NPU stages draw on the host
  pool the CPU row carries, so a stage's bytes are added to what is already
  admitted there (a CPU session, another stage) and the same RAM is never
  budgeted twice;
* **run** (:func:`run_graph_stage`): start the stage through the owning
  backend's ``start_stage`` / ``stream`` / ``cancel`` / ``stop_stage``, run it
  once on sample inputs, then read the *measured* placement (ONNX Runtime's
  per-node profile: listing a provider proves nothing) and the numeric gate
  (outputs against a CPU reference within a per-format tolerance). Either
  failing is a refusal in the record, ``execution_provider_declined_graph`` or
  ``numeric_gate_failed``, the latter constraining this artifact only.

Nothing here imports onnxruntime at module level; ``onnx`` is imported only to
read a graph's inputs and metadata while planning.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from .budget import MIB, Reservation
from .plan import (
    STAGE_ONLY_KINDS,
    DeviceVerdict,
    Plan,
    Refusal,
    SessionSpec,
    _format_refusal,
    candidate_order,
    headroom_reservations,
)

#: Share of nodes and of kernel time the target provider must have executed for
#: a stage to count as placed on its device (overridable per stage). One half:
#: a stage most of whose work ran elsewhere is not "on the NPU", while an EP
#: leaving a few boundary casts to the CPU still is.
DEFAULT_PLACEMENT_THRESHOLD = 0.5

#: Numeric gate tolerance per graph format: the largest absolute output error
#: allowed, as a fraction of the reference output's largest magnitude. Measured
#: on the demo stages (scripts/export_stage.py, onnxruntime 1.32 CPU, 3 seeds):
#: fp16 vs fp32 0.02-0.06 %, A16W8 vs fp32 0.02 % (MLP + residual) and
#: 1.1-1.4 % (LM head). Each bound leaves several times that (estimate, E);
#: fp32 against itself allows kernel reordering of float sums only.
NUMERIC_TOLERANCE = {
    "onnx:fp32": 1e-4,
    "onnx:fp16": 1e-2,
    "onnx:bf16": 3e-2,
    "onnx:a16w8": 5e-2,
    "onnx:a8w8": 8e-2,
    "onnx:qdq": 8e-2,
}
#: A format not in the table (estimate, E): loose enough for any 8-bit scheme.
DEFAULT_NUMERIC_TOLERANCE = 8e-2

#: What ``import onnxruntime`` plus one CPU-provider session cost in the
#: process, before weights: 31 MiB PSS measured (onnxruntime 1.32, this
#: project's CI machine; 20 MiB import, 11 MiB session and thread pools),
#: rounded up (E). A device's EP library (DirectML, VitisAI) comes on top
#: through its backend's ``reserve_memory``.
ORT_RUNTIME_BASELINE_BYTES = 48 * MIB
#: Floor of the activation arena: the first run of the demo stages grew PSS by
#: 5-7 MiB (arena chunk + profiling buffers), rounded up (E).
ORT_ACTIVATION_FLOOR_BYTES = 8 * MIB
#: Intermediate tensors held at once, as a multiple of the graph's input and
#: output bytes at the sample size (estimate, E: an MLP holds gate, up and
#: their product, 3 x intermediate ~ 9 x hidden).
ACTIVATION_IO_MULTIPLE = 12

#: Symbolic dimensions for sizing and sample inputs when the graph names none.
DEFAULT_SAMPLE_DIMS = {"batch": 1, "batch_size": 1, "sequence": 8, "sequence_length": 8, "seq": 8}
DEFAULT_SAMPLE_DIM = 8

#: Graph metadata written by scripts/export_stage.py.
META_REFERENCE = "edge.reference_graph"
META_SAMPLE_DIMS = "edge.sample_dims"
META_STAGE = "edge.stage"

EXPORT_SCRIPT = "scripts/export_stage.py"
#: The plan's JSON schema tag for the ``stage`` section.
STAGE_SCHEMA = "edge.graph_stage/1"

_ELEMENT_BYTES = {1: 4, 10: 2, 16: 2, 11: 8, 7: 8, 6: 4, 3: 1, 2: 1, 5: 2, 4: 2, 9: 1, 21: 1, 22: 1}


# ====================================================================== ledger

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


def held_bytes(plan: Any) -> int:
    """What an admitted plan holds on its pool: admission bytes less the per-host external reserve."""
    reserve = sum(t.bytes for t in plan.reservations if t.headroom and t.purpose == "external_reserve")
    return max(plan.peak.admission_bytes - reserve, 0)


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

    def admit_plan(self, plan: Any, entry_id: str | None = None) -> LedgerEntry:
        """Record an admitted plan on the host pool (a CPU session, a graph stage)."""
        if not plan.admitted or plan.peak is None:
            raise ValueError(f"only an admitted plan holds memory; {plan.model_path} was refused")
        device = plan.selected_device
        if device.memory_pool != "host_ram":
            raise ValueError(f"{device.device_id} has its own {device.memory_pool}; it does not draw on the host pool")
        manifest = plan.manifest
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


def host_capacity(devices: Iterable[Any], host: Any) -> tuple[int | None, str]:
    """Usable bytes of the host pool and how they were read.

    From the host facts (MemAvailable, clamped by the cgroup limit) when there
    are any; else from the CPU row of the device list, which carries the host
    pool; None when neither is known.
    """
    if host is not None:
        how = "host RAM available"
        if host.cgroup_limit_bytes is not None and host.usable_bytes < host.mem_available_bytes:
            how += ", clamped by the cgroup limit"
        return host.usable_bytes, how
    for device in devices:
        if device.kind == "cpu" and device.memory_pool == "host_ram" and device.memory_bytes:
            if device.memory_available_bytes is not None:
                return device.memory_available_bytes, f"host RAM available as the {device.device_id} row recorded it"
            return device.memory_bytes, f"host RAM total as the {device.device_id} row recorded it"
    return None, "unknown"


# ====================================================================== plan

@dataclass(frozen=True)
class GraphStagePlan(Plan):
    """A :class:`~edge_core.plan.Plan` for one exported-graph stage.

    ``stage`` says how the stage will run and be judged: the route that
    resolved, the target execution provider, the placement threshold, the
    numeric tolerance and reference, the sample dims, and the host ledger the
    capacity was checked against.
    """

    stage: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "stage": dict(self.stage)}


def executes_graphs(device: Any, formats: Iterable[str]) -> bool:
    """A device takes graph stages when its kind only runs stages or its formats are graph formats."""
    return device.kind in STAGE_ONLY_KINDS or any(f.startswith(("onnx:", "pt:")) for f in formats)


@dataclass(frozen=True)
class GraphFacts:
    """What planning reads from the graph beyond its manifest: I/O and edge metadata."""

    inputs: tuple[tuple[str, int, tuple[Any, ...]], ...]
    outputs: tuple[tuple[str, int, tuple[Any, ...]], ...]
    metadata: dict[str, str]

    def sample_dims(self) -> dict[str, int]:
        """Size of each symbolic dimension of the graph's I/O: the graph's own, then the defaults."""
        dims = dict(DEFAULT_SAMPLE_DIMS)
        try:
            given = json.loads(self.metadata.get(META_SAMPLE_DIMS) or "{}")
        except ValueError:
            given = {}
        if isinstance(given, dict):
            dims.update({str(k): int(v) for k, v in given.items() if isinstance(v, int) and v > 0})
        named = {str(d) for _, _, shape in self.inputs + self.outputs for d in shape if not isinstance(d, int)}
        return {name: dims.get(name, DEFAULT_SAMPLE_DIM) for name in sorted(named)}

    def io_bytes(self) -> int:
        dims = self.sample_dims()
        total = 0
        for _, elem, shape in self.inputs + self.outputs:
            count = 1
            for d in shape:
                count *= d if isinstance(d, int) and d > 0 else dims.get(str(d), DEFAULT_SAMPLE_DIM)
            total += count * _ELEMENT_BYTES.get(elem, 4)
        return total


def read_graph_facts(path: str) -> GraphFacts:
    """I/O specs and ``metadata_props`` of the graph at ``path`` (external data left on disk)."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}

    def specs(values: Iterable[Any]) -> tuple[tuple[str, int, tuple[Any, ...]], ...]:
        out = []
        for v in values:
            if v.name in initializers:  # old exporters list initializers as inputs
                continue
            tensor = v.type.tensor_type
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
            out.append((v.name, int(tensor.elem_type), shape))
        return tuple(out)

    return GraphFacts(specs(model.graph.input), specs(model.graph.output),
                      {p.key: p.value for p in model.metadata_props})


def resolve_reference(manifest: Any, facts: GraphFacts) -> tuple[str, str]:
    """The graph the numeric gate compares against on the CPU provider, and why that one.

    The graph's own ``edge.reference_graph`` (a file beside it, e.g. the fp32
    export an A16W8 graph was quantized from) when it names one that exists in
    the same directory; otherwise the same graph.
    """
    name = facts.metadata.get(META_REFERENCE)
    root = os.path.dirname(manifest.path)
    if name and os.path.basename(name) == name and name.lower().endswith(".onnx"):
        candidate = os.path.join(root, name)
        if os.path.isfile(candidate) and os.path.realpath(candidate) != os.path.realpath(manifest.path):
            return candidate, f"{name}, named by the graph's {META_REFERENCE} metadata"
    if name:
        return manifest.path, f"the same graph ({META_REFERENCE}={name!r} is not a graph beside it)"
    return manifest.path, "the same graph (it names no reference graph)"


def stage_reservations(manifest: Any, facts: GraphFacts, reference_path: str) -> list[Reservation]:
    """The stage's own memory terms on the host pool, in bytes."""
    graph_file = next((size for name, size in manifest.files if name == os.path.basename(manifest.path)),
                      manifest.weight_bytes)
    io_bytes = facts.io_bytes()
    reference_bytes = os.path.getsize(reference_path) if reference_path != manifest.path else graph_file
    dims = ", ".join(f"{k}={v}" for k, v in sorted(facts.sample_dims().items()) if k in ("batch", "sequence"))
    return [
        Reservation(purpose="weights", bytes=manifest.weight_bytes, pool="host_ram", lifetime="session_weights",
                    evidence="D", note=f"{manifest.tensor_count} initializers, {manifest.weight_format}, summed "
                    "from the graph"),
        Reservation(purpose="graph_load", bytes=graph_file, pool="host_ram", lifetime="load", evidence="E",
                    note="ONNX Runtime holds the serialized graph while it builds the initializers"),
        Reservation(purpose="ort_runtime", bytes=ORT_RUNTIME_BASELINE_BYTES, pool="host_ram", lifetime="session",
                    evidence="E", held_during_load=True,
                    note="import onnxruntime + one session (31 MiB PSS measured on the CPU provider, rounded up)"),
        Reservation(purpose="activations", bytes=max(ORT_ACTIVATION_FLOOR_BYTES, ACTIVATION_IO_MULTIPLE * io_bytes),
                    pool="host_ram", lifetime="request", evidence="E",
                    note=f"{ACTIVATION_IO_MULTIPLE} x the graph's I/O at the sample size ({dims}; "
                    f"{io_bytes:,} B), at least the arena's first growth"),
        Reservation(purpose="numeric_reference", bytes=2 * reference_bytes, pool="host_ram", lifetime="request",
                    evidence="E", note="the CPU reference session of the numeric gate (first run only): its "
                    "graph and weights"),
    ]


def _unreachable(device: Any) -> Refusal:
    from .routes import INTERPRETER_NAMES, statuses_of

    statuses = statuses_of(device)
    # The best-ranked route that could work from here or from an interpreter next door.
    best = next((s for s in statuses if s.get("where") in ("another_interpreter", "here")), None)
    if best is not None and best.get("where") == "another_interpreter":
        there = INTERPRETER_NAMES.get(str(best.get("interpreter")), best.get("interpreter"))
        remedy = f"run edge from {there}, where the {best.get('backend')} route lives ({best.get('install')})"
    elif best is not None:
        remedy = f"make the {best.get('backend')} route work in this interpreter: {best.get('reason')}"
    else:
        remedy = f"{device.reason}" if device.reason else "install the backend that drives it in this interpreter"
    return Refusal(
        code="device_unreachable_from_this_process", device_id=device.device_id,
        message=f"{device.device_id} ({device.name}) is there, but no interpreter here drives it: {device.reason}",
        remedy=remedy,
        details={"routes": [dict(s) for s in statuses]},
    )


def _stage_capacity_refusal(device: Any, peak: Any, capacity: int, how: str, ledger: HostLedger) -> Refusal:
    admitted = ledger.entries()
    held = sum(e.bytes for e in admitted)
    free = max(capacity - held, 0)
    if admitted and peak.admission_bytes <= capacity:
        names = ", ".join(f"{e.entry_id} ({e.bytes / MIB:,.0f} MiB)" for e in admitted)
        remedy = (f"the stage alone fits: release what is admitted on the host pool ({names}) or run the stage "
                  "after it; or use a smaller stage (export fewer layers)")
    else:
        remedy = "use a smaller stage (export fewer layers, or a quantized graph), or a machine with more RAM"
    return Refusal(
        code="budget_exceeds_device", device_id=device.device_id,
        message=(f"the stage needs {peak.admission_bytes / MIB:,.0f} MiB (predicted peak "
                 f"{peak.predicted_bytes / MIB:,.0f} MiB + headroom {peak.headroom_bytes / MIB:,.0f} MiB) of the "
                 f"host pool {device.device_id} draws on; {held / MIB:,.0f} MiB of its {capacity / MIB:,.0f} MiB "
                 f"({how}) are admitted to others, leaving {free / MIB:,.0f} MiB"),
        remedy=remedy,
        details={"needed_bytes": peak.admission_bytes, "capacity_bytes": capacity, "admitted_bytes": held,
                 "free_bytes": free, "admitted": [e.to_dict() for e in admitted]},
    )


def plan_graph_stage(manifest: Any, *, devices: list[Any], host: Any, registry: Any = None,
                     devices_source: str = "probed", session: SessionSpec | None = None,
                     ledger: HostLedger | None = None, placement_threshold: float | None = None,
                     numeric_tolerance: float | None = None) -> Plan:
    """Plan one exported-graph stage: the first graph-executing device that passes every gate.

    ``ledger`` (default :data:`HOST_LEDGER`) holds what is already admitted on
    the host pool. ``placement_threshold`` and ``numeric_tolerance`` override
    the defaults for this stage; both travel in ``plan.stage`` to the run.
    """
    from .budget import peak as combine

    session = session or SessionSpec()
    ledger = HOST_LEDGER if ledger is None else ledger
    threshold = DEFAULT_PLACEMENT_THRESHOLD if placement_threshold is None else float(placement_threshold)
    if not 0.0 < threshold <= 1.0:
        from .errors import UsageError

        raise UsageError(f"the placement threshold is a share of nodes and time in (0, 1], not {threshold}")

    def refused(refusals: list[Refusal], **extra: Any) -> Plan:
        return GraphStagePlan(admitted=False, model_path=manifest.path, session=session, manifest=manifest,
                              refusals=tuple(refusals), devices_source=devices_source, **extra)

    plugins = registry.plugins() if registry is not None else []
    if not devices and not plugins and devices_source == "probed":
        from .registry import install_hint

        return refused([Refusal(code="no_backend_installed", message=install_hint(),
                                remedy="pip install edge-dml (AMD/Intel iGPU, Windows or WSL) or edge-vitisai "
                                "(AMD XDNA NPU) in this venv")])
    try:
        facts = read_graph_facts(manifest.path)
    except Exception as exc:  # noqa: BLE001 - graph.py parsed it already; anything here is a bad graph
        return refused([Refusal(code="artifact_invalid", message=f"{manifest.path}: cannot read the graph's "
                                f"inputs and metadata: {type(exc).__name__}: {exc}", remedy="re-export the graph")])
    reference_path, reference_why = resolve_reference(manifest, facts)
    tolerance = NUMERIC_TOLERANCE.get(manifest.weight_format, DEFAULT_NUMERIC_TOLERANCE) \
        if numeric_tolerance is None else float(numeric_tolerance)
    capacity, how = host_capacity(devices, host)

    notes: list[str] = []
    verdicts: list[DeviceVerdict] = []
    fallbacks: list[dict[str, Any]] = []
    all_refusals: list[Refusal] = []
    admitted: dict[str, Any] | None = None
    for device in candidate_order(devices):
        owned = registry is not None and registry.owner(device) is not None
        formats = (registry.call_owner(device, "weight_formats") if owned else None) or list(device.weight_formats)
        if not executes_graphs(device, formats):
            verdicts.append(DeviceVerdict(device.device_id, False, note=(
                f"runs checkpoints, not exported graphs (formats: {', '.join(formats) or 'none'})")))
            continue
        if device.masked:
            verdicts.append(DeviceVerdict(device.device_id, False, note=device.reason or "masked by policy"))
            continue
        if not device.runnable:
            refusal = _unreachable(device)
            verdicts.append(DeviceVerdict(device.device_id, False, (refusal,)))
            all_refusals.append(refusal)
            continue
        if not owned:
            notes.append(f"{device.device_id}: its backend ({device.plugin or device.backend}) is not installed "
                         "here; planned from the device list alone, and it cannot be run from here")
        if manifest.weight_format not in formats:
            remedy = registry.call_owner(device, "format_remedy", weight_format=manifest.weight_format) \
                if owned else None
            refusal = _format_refusal(device, manifest, formats, remedy)
            verdicts.append(DeviceVerdict(device.device_id, False, (refusal,)))
            all_refusals.append(refusal)
            continue
        terms = stage_reservations(manifest, facts, reference_path)
        if owned:
            terms += registry.call_owner(device, "reserve_memory", manifest=manifest, session=session,
                                         host=host) or []
            gated = registry.call_owner(device, "gate_plan", manifest=manifest, session=session, host=host,
                                        reservations=terms) or []
            if gated:
                verdicts.append(DeviceVerdict(device.device_id, False, tuple(gated)))
                all_refusals.extend(gated)
                continue
        terms += headroom_reservations(device, combine(terms, device.memory_pool).predicted_bytes)
        total = combine(terms, device.memory_pool)
        if capacity is None:
            notes.append(f"{device.device_id}: host capacity unknown (a device list without host facts or a CPU "
                         "row); capacity not checked")
        elif device.memory_pool == "host_ram" and total.admission_bytes + ledger.admitted_bytes > capacity:
            refusal = _stage_capacity_refusal(device, total, capacity, how, ledger)
            verdicts.append(DeviceVerdict(device.device_id, False, (refusal,)))
            all_refusals.append(refusal)
            continue
        if admitted is None:
            admitted = {"device": device, "terms": terms, "peak": total, "formats": formats}
            verdicts.append(DeviceVerdict(device.device_id, True))
        else:
            fallbacks.append({"kind": "device", "device_id": device.device_id, "backend": device.backend,
                              "approved": True, "note": "passes every gate; used only if asked for"})
            verdicts.append(DeviceVerdict(device.device_id, False,
                                          note="a fallback: an earlier candidate was selected"))

    if admitted is None:
        refusals = list(all_refusals)
        if not refusals:
            why = "; ".join(f"{v.device_id}: {v.note}" for v in verdicts if v.note) or "no device was found"
            refusals.append(Refusal(
                code="no_runnable_device",
                message=f"no device this interpreter sees executes exported graphs ({why})",
                remedy=("install edge-dml (AMD/Intel iGPU through DirectML) or edge-vitisai (AMD XDNA NPU) in this "
                        "venv; or plan the checkpoint itself for the CPU or a discrete GPU"),
            ))
        return refused(refusals, verdicts=tuple(verdicts), fallbacks=tuple(fallbacks), notes=tuple(notes))

    from .routes import resolved_of

    device = admitted["device"]
    route = resolved_of(device)
    stage = {
        "schema": STAGE_SCHEMA,
        "kind": "graph_stage",
        "runtime": "onnxruntime",
        "stage": facts.metadata.get(META_STAGE),
        "route": dict(route) if route else None,
        "target_provider": (route or {}).get("provider") or device.extras.get("execution_provider"),
        "placement_threshold": threshold,
        "placement": "unproven until the first run's profile is read (edge run --model)",
        "numeric_tolerance": tolerance,
        "numeric_tolerance_metric": "max |output - reference| / max |reference|",
        "reference_graph": reference_path,
        "reference_why": reference_why,
        "sample_dims": facts.sample_dims(),
        "inputs": [{"name": n, "elem_type": e, "dims": list(s)} for n, e, s in facts.inputs],
        "outputs": [{"name": n, "elem_type": e, "dims": list(s)} for n, e, s in facts.outputs],
        "host_pool": {"capacity_bytes": capacity, "how": how, **ledger.to_dict()},
    }
    return GraphStagePlan(
        admitted=True, model_path=manifest.path, session=session, manifest=manifest, selected_device=device,
        reservations=tuple(admitted["terms"]), peak=admitted["peak"], capacity_bytes=capacity,
        fallbacks=tuple(fallbacks), verdicts=tuple(verdicts), devices_source=devices_source, notes=tuple(notes),
        stage=stage,
    )


# ====================================================================== numeric gate

@dataclass(frozen=True)
class OutputError:
    """Measured error of one output against its reference."""

    name: str
    max_abs_error: float
    mean_abs_error: float
    reference_peak_abs: float
    #: max_abs_error / reference_peak_abs: the gated figure.
    max_rel_error: float
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "max_abs_error": self.max_abs_error, "mean_abs_error": self.mean_abs_error,
                "reference_peak_abs": self.reference_peak_abs, "max_rel_error": self.max_rel_error,
                "shape": list(self.shape)}


@dataclass(frozen=True)
class NumericGate:
    """The stage's outputs against a CPU reference (evidence B: both were run)."""

    weight_format: str
    tolerance: float
    reference: dict[str, Any]
    outputs: tuple[OutputError, ...]
    problem: str | None = None

    @property
    def max_rel_error(self) -> float:
        return max((o.max_rel_error for o in self.outputs), default=float("inf"))

    @property
    def max_abs_error(self) -> float:
        return max((o.max_abs_error for o in self.outputs), default=float("inf"))

    @property
    def passed(self) -> bool:
        return self.problem is None and bool(self.outputs) and self.max_rel_error <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "weight_format": self.weight_format, "tolerance": self.tolerance,
                "metric": "max |output - reference| / max |reference|", "max_abs_error": self.max_abs_error,
                "max_rel_error": self.max_rel_error, "reference": dict(self.reference),
                "outputs": [o.to_dict() for o in self.outputs], "problem": self.problem, "evidence": "B"}


def compare_outputs(outputs: Mapping[str, Any], reference: Mapping[str, Any], *, weight_format: str,
                    tolerance: float, reference_info: Mapping[str, Any] | None = None) -> NumericGate:
    """Measure every output against the reference output of the same name (compared in float64)."""
    import numpy as np

    errors = []
    problems = []
    for name, ref in reference.items():
        if name not in outputs:
            problems.append(f"the stage produced no {name!r}")
            continue
        got = np.asarray(outputs[name], dtype=np.float64)
        want = np.asarray(ref, dtype=np.float64)
        if got.shape != want.shape:
            problems.append(f"{name!r} has shape {list(got.shape)}, the reference {list(want.shape)}")
            continue
        diff = np.abs(got - want)
        if not np.all(np.isfinite(got)):
            problems.append(f"{name!r} holds NaN or infinity")
        peak_abs = float(np.max(np.abs(want))) if want.size else 0.0
        max_abs = float(np.max(diff)) if diff.size else 0.0
        errors.append(OutputError(name, max_abs, float(np.mean(diff)) if diff.size else 0.0, peak_abs,
                                  max_abs / peak_abs if peak_abs > 0 else (0.0 if max_abs == 0 else float("inf")),
                                  tuple(int(d) for d in got.shape)))
    return NumericGate(weight_format, float(tolerance), dict(reference_info or {}), tuple(errors),
                       "; ".join(problems) or None)


# ====================================================================== run

def _refusal_dict(code: str, device_id: str | None, message: str, remedy: str, **details: Any) -> dict[str, Any]:
    return Refusal(code=code, device_id=device_id, message=message, remedy=remedy, details=details).to_dict()


def _pss() -> int | None:
    from .measure import read_pss_bytes

    return read_pss_bytes(os.getpid())


def run_graph_stage(plan: Any, registry: Any, *, inputs: Mapping[str, Any] | None = None, seed: int = 0,
                    ledger: HostLedger | None = None, executor_providers: Iterable[str] | None = None,
                    entry_id: str | None = None, idle_timeout_s: float = 600.0) -> dict[str, Any]:
    """Run an admitted graph-stage plan once and return the placement and numeric-gate record.

    Goes through the owning backend's hooks (``start_stage``, ``stream``,
    ``cancel``, ``stop_stage``) and the core's :class:`~edge_core.stream.StreamRun`.
    ``inputs`` default to deterministic samples (``seed``) shaped by the graph.
    ``executor_providers`` replaces the providers the session runs with while
    the placement target stays the route's provider (a stand-in: the record
    says so). The stage is admitted in ``ledger`` (default :data:`HOST_LEDGER`)
    while it runs and released after. ``record["passed"]`` is True only when
    the stage was placed on its target provider *and* passed the numeric gate;
    otherwise ``record["refusals"]`` says which gate said no.
    """
    from . import ort_stage
    from .errors import EdgeError, StageError, UsageError
    from .stream import StageRequest, StreamRun

    ledger = HOST_LEDGER if ledger is None else ledger
    record: dict[str, Any] = {
        "schema": "edge.graph_stage_run/1", "model_path": plan.model_path, "admitted": plan.admitted,
        "ran": False, "placed": False, "passed": False, "refusals": [r.to_dict() for r in plan.refusals],
    }
    if not plan.admitted:
        return record
    device = plan.selected_device
    stage_info = dict(getattr(plan, "stage", None) or {})
    target = stage_info.get("target_provider")
    manifest = plan.manifest
    record.update({"device_id": device.device_id, "backend": device.backend, "artifact_id": manifest.artifact_id,
                   "weight_format": manifest.weight_format, "target_provider": target,
                   "route": stage_info.get("route")})
    if registry is None or registry.owner(device) is None or "start_stage" not in registry.owner(device).hooks:
        record["refusals"] = [_refusal_dict(
            "device_unreachable_from_this_process", device.device_id,
            f"no backend installed in this interpreter runs stages on {device.device_id} (planned from a device "
            "list or a backend without start_stage)",
            f"run edge where {device.plugin or device.backend} is installed and drives {device.device_id}")]
        return record
    if not target:
        record["refusals"] = [_refusal_dict(
            "execution_provider_declined_graph", device.device_id,
            f"{device.device_id} names no target execution provider, so placement cannot be measured",
            f"the {device.plugin} backend must record its route (Device.extras['routes']) with a provider")]
        return record
    if executor_providers is not None:
        stand_in = list(executor_providers)
        plan = dataclasses.replace(plan, stage={**stage_info, "executor_providers": stand_in})
        record["executor_providers"] = stand_in
        record["stand_in"] = (f"the session runs with {', '.join(stand_in)} instead of the route's providers; "
                              f"placement is still judged against {target}")

    held = held_bytes(plan)
    capacity = stage_info.get("host_pool", {}).get("capacity_bytes")
    entry_id = entry_id or f"stage:{device.device_id}:{manifest.artifact_id}"
    reserve = sum(t.bytes for t in plan.reservations if t.headroom and t.purpose == "external_reserve")
    try:
        ledger.admit(entry_id, held, what=f"{device.backend} stage of {os.path.basename(plan.model_path)}",
                     device_id=device.device_id,
                     capacity_bytes=None if capacity is None else max(capacity - reserve, 0))
    except ValueError as exc:
        record["refusals"] = [_refusal_dict(
            "budget_exceeds_device", device.device_id, f"the host pool changed since the plan: {exc}",
            "release what was admitted since (see the ledger), then plan and run again", ledger=ledger.to_dict())]
        return record
    record["ledger_entry"] = {"entry_id": entry_id, "bytes": held}

    pss_before = _pss()
    timings: dict[str, float] = {}
    handle = None
    try:
        started = time.perf_counter()
        try:
            handle = registry.call_owner(device, "start_stage", plan=plan)
        except EdgeError as exc:
            record["refusals"] = [_refusal_dict(
                "artifact_invalid", device.device_id, f"the stage did not start: {exc}",
                f"check the graph with `edge plan --model {plan.model_path}`; re-export it "
                f"({EXPORT_SCRIPT}) if ONNX Runtime cannot load it")]
            return record
        timings["start_s"] = time.perf_counter() - started
        pss_started = _pss()
        if handle is None:
            raise StageError(f"plugin {device.plugin!r} returned no stage from start_stage for {device.device_id}")
        specs = getattr(handle, "inputs", None)
        if inputs is None:
            if specs is None:
                raise UsageError(f"the {device.plugin} stage does not describe its inputs; pass inputs=")
            inputs = ort_stage.sample_inputs(specs, seed=seed, dims=stage_info.get("sample_dims"))
        elif specs is not None:
            try:
                ort_stage.check_feeds(specs, inputs, plan.model_path)
            except StageError as exc:
                raise UsageError(str(exc)) from None
        request = StageRequest(inputs=dict(inputs))
        started = time.perf_counter()
        events = registry.call_owner(device, "stream", stage=handle, request=request)
        run = StreamRun(events, lambda: registry.call_owner(device, "cancel", stage=handle,
                                                             request_id=request.request_id),
                        request_id=request.request_id, epoch=request.epoch,
                        label=f"{device.plugin} on {device.device_id}")
        got = run.collect(idle_timeout_s=idle_timeout_s)
        timings["first_run_s"] = time.perf_counter() - started
        final = got[-1]
        record["ran"] = True
        record["finish_reason"] = final.finish_reason
        record["events"] = len(got)
        outputs = dict(final.tensors or {})
        record["outputs"] = final.to_dict()["tensors"]
        pss_ran = _pss()
        record["stage"] = handle.to_dict() if hasattr(handle, "to_dict") else {}
        record["stage"].pop("placement", None)  # measured placement is the record's own section

        placement = getattr(handle, "placement", None)
        refusals = []
        if placement is None:
            why = getattr(handle, "profile_error", None) or "the backend reported no per-node profile"
            record["placement"] = {"placed": False, "target_provider": target, "problem": why}
            refusals.append(_refusal_dict(
                "execution_provider_declined_graph", device.device_id,
                f"no measured placement for {target} on {device.device_id} ({why}); a listed provider is not evidence",
                "run the stage with a backend that profiles its first run (edge's ONNX Runtime stage runtime)"))
        else:
            record["placement"] = placement.to_dict()
            record["placed"] = placement.placed
            if not placement.placed:
                shares = placement.kernels_by_provider
                refusals.append(_refusal_dict(
                    "execution_provider_declined_graph", device.device_id,
                    f"{target} executed {placement.node_share:.0%} of the nodes and {placement.time_share:.0%} of "
                    f"the time of {os.path.basename(plan.model_path)} (threshold {placement.threshold:.0%}); "
                    f"kernels by provider: {', '.join(f'{p} {n}' for p, n in shares.items()) or 'none'}",
                    _declined_remedy(device, manifest, target, stage_info),
                    node_share=round(placement.node_share, 4), time_share=round(placement.time_share, 4),
                    threshold=placement.threshold, kernels_by_provider=shares,
                    time_us_by_provider=placement.time_us_by_provider,
                    missing_providers=list(getattr(handle, "missing_providers", ()) or ()),
                    session_providers=list(getattr(handle, "session_providers", ()) or ())))

        reference_path = stage_info.get("reference_graph") or plan.model_path
        started = time.perf_counter()
        reference, ran_ref = ort_stage.reference_outputs(reference_path, inputs)
        timings["reference_s"] = time.perf_counter() - started
        pss_ref = _pss()
        ran_ref["why"] = stage_info.get("reference_why")
        gate = compare_outputs(outputs, reference, weight_format=manifest.weight_format,
                               tolerance=float(stage_info.get("numeric_tolerance") or DEFAULT_NUMERIC_TOLERANCE),
                               reference_info=ran_ref)
        record["numeric_gate"] = gate.to_dict()
        if not gate.passed:
            refusals.append(_refusal_dict(
                "numeric_gate_failed", device.device_id,
                (f"{os.path.basename(plan.model_path)} ({manifest.weight_format}) on {device.device_id} is "
                 f"{gate.max_rel_error:.3g} of the reference's peak away from {os.path.basename(reference_path)} "
                 f"on the CPU (tolerance {gate.tolerance:.3g})" + (f"; {gate.problem}" if gate.problem else "")),
                (f"this artifact ({manifest.artifact_id}) is constrained, not the device or {manifest.weight_format} "
                 f"in general: re-export or re-quantize it ({EXPORT_SCRIPT}; more calibration data, per-channel "
                 "weights), or check that its reference graph is the graph it came from"),
                artifact_id=manifest.artifact_id, scope="artifact", max_abs_error=gate.max_abs_error,
                max_rel_error=gate.max_rel_error, tolerance=gate.tolerance))
        record["refusals"] = refusals
        record["passed"] = record["placed"] and gate.passed
        samples = [v for v in (pss_before, pss_started, pss_ran, pss_ref) if v is not None]
        record["memory"] = {
            "counter": "process PSS (the stage runs in this process)",
            "pss_before_bytes": pss_before, "pss_after_start_bytes": pss_started,
            "pss_after_run_bytes": pss_ran, "pss_after_reference_bytes": pss_ref,
            "attributable_peak_bytes": (max(samples) - pss_before) if samples and pss_before is not None else None,
            "predicted_peak_bytes": plan.peak.predicted_bytes if plan.peak is not None else None,
            "note": "read at four points, not sampled: a lower bound of the peak",
        }
        record["timings_s"] = {k: round(v, 4) for k, v in timings.items()}
        return record
    finally:
        if handle is not None:
            try:
                record["stopped"] = bool(registry.call_owner(device, "stop_stage", stage=handle))
            except EdgeError as exc:
                record["stopped"] = False
                record["stop_error"] = str(exc)
        ledger.release(entry_id)


def _declined_remedy(device: Any, manifest: Any, target: str, stage_info: Mapping[str, Any]) -> str:
    route = stage_info.get("route") or {}
    formats = route.get("formats") or list(device.weight_formats)
    return (f"{target} left this graph to other providers: for {device.device_id} export the stage in a format "
            f"it executes ({', '.join(formats) or 'see edge devices'}) with operators it supports "
            f"({EXPORT_SCRIPT}); check that the runtime offers {target} (edge devices --verify); a lower "
            "per-stage threshold is a choice, not a fix")


def describe_stage_record(record: Mapping[str, Any]) -> str:
    """The record of :func:`run_graph_stage` as the lines ``edge run --model GRAPH.onnx`` prints."""
    verdict = "PASSED" if record.get("passed") else "REFUSED"
    where = f" on {record['device_id']} ({record.get('backend')})" if record.get("device_id") else ""
    lines = [f"{verdict}{where}: {record.get('model_path')}"]
    if record.get("stand_in"):
        lines.append(f"  stand-in  {record['stand_in']}")
    placement = record.get("placement")
    if placement and "node_share" in placement:
        kernels = ", ".join(f"{p} {n}" for p, n in placement["kernels_by_provider"].items()) or "none"
        lines.append(f"  placement {placement['target_provider']}: {placement['node_share']:.0%} of "
                     f"{placement['kernels']} nodes, {placement['time_share']:.0%} of the time (threshold "
                     f"{placement['threshold']:.0%}) -> {'placed' if placement['placed'] else 'not placed'}; "
                     f"kernels by provider: {kernels} [B: measured]")
    elif placement:
        lines.append(f"  placement {placement.get('target_provider')}: not measured ({placement.get('problem')})")
    gate = record.get("numeric_gate")
    if gate:
        reference = os.path.basename(str(gate["reference"].get("graph", "")))
        lines.append(f"  numeric   max abs error {gate['max_abs_error']:.3g}, {gate['max_rel_error']:.3g} of the "
                     f"reference's peak vs {reference} on {gate['reference'].get('provider')} (tolerance "
                     f"{gate['tolerance']:g}) -> {'passed' if gate['passed'] else 'failed'} [B: measured]")
    for refusal in record.get("refusals") or ():
        lines.append(f"  refused   [{refusal['code']}] {refusal.get('device_id') or '-'}: {refusal['message']}")
        lines.append(f"            remedy: {refusal['remedy']}")
    memory = record.get("memory") or {}
    if memory.get("attributable_peak_bytes") is not None and memory.get("predicted_peak_bytes"):
        lines.append(f"  memory    {memory['attributable_peak_bytes'] / MIB:,.0f} MiB attributable PSS (a lower "
                     f"bound) against {memory['predicted_peak_bytes'] / MIB:,.0f} MiB predicted")
    timings = record.get("timings_s") or {}
    if timings:
        lines.append("  timings   " + ", ".join(f"{k} {v:.3f} s" for k, v in timings.items()))
    return "\n".join(lines)
