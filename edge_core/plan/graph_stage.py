"""Can this exported graph run as one stage here, on which device, with how many bytes?

iGPUs and NPUs execute exported graphs one stage at a time, never a whole
decode session. :func:`plan_graph_stage` (reached from
:func:`~edge_core.plan.planner.plan_artifact` when the artifact is an ``.onnx`` graph) walks the devices that
execute graphs through the gates *reachable* (a device that exists but no
interpreter here drives it is ``device_unreachable_from_this_process``, naming
the route and interpreter that would), *format* (the graph's scheme against
the formats of the route that resolved), the backend's own gates, and
*capacity*: the host pool, less what the live edge sessions and stages on this
host hold and it does not show yet (the host-wide ledger, :mod:`.committed`).
Whether the stage then really ran on its device, and with the right numbers,
is checked after its first run (:mod:`edge_core.runtime.graph_run`); the
thresholds it is judged by are decided here and travel in ``plan.stage``.

The graph's inputs, outputs and metadata are read by the caller (:mod:`edge_core.artifact.graph_facts`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..artifact.graph_facts import META_STAGE, GraphFacts
from ..budget import MIB, Reservation
from ..errors import ArtifactError, UsageError
from ..plans import STAGE_ONLY_KINDS, DeviceVerdict, GraphStagePlan, Plan, Refusal, SessionSpec
from ..routes import INTERPRETER_NAMES, resolved_of, statuses_of
from ..services.host_ledger import HOST_POOL, LedgerView
from .committed import holder_dicts
from .gates import Judgement, Owner, backend_budget, budget_gates, format_gate, walk
from .remedies import no_backend_refusal

if TYPE_CHECKING:
    from ..budget import Peak
    from ..devices import Device
    from ..host import HostFacts
    from ..manifest import Manifest
    from ..services.registry import Registry

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
#: process, before weights, rounded up (E; docs/vllm-cpu-facts.md, "ONNX
#: Runtime on the CPU provider"). A device's EP library (DirectML, VitisAI) comes on top
#: through its backend's ``reserve_memory``.
ORT_RUNTIME_BASELINE_BYTES = 48 * MIB
#: Floor of the activation arena: the first run of the demo stages grew PSS by
#: 5-7 MiB (arena chunk + profiling buffers), rounded up (E).
ORT_ACTIVATION_FLOOR_BYTES = 8 * MIB
#: Intermediate tensors held at once, as a multiple of the graph's input and
#: output bytes at the sample size (estimate, E: an MLP holds gate, up and
#: their product, 3 x intermediate ~ 9 x hidden).
ACTIVATION_IO_MULTIPLE = 12

EXPORT_SCRIPT = "scripts/export_stage.py"
#: The plan's JSON schema tag for the ``stage`` section.
STAGE_SCHEMA = "edge.graph_stage/1"

def executes_graphs(device: Device, formats: Iterable[str]) -> bool:
    """A device takes graph stages when its kind only runs stages or its formats are graph formats."""
    return device.kind in STAGE_ONLY_KINDS or any(f.startswith(("onnx:", "pt:")) for f in formats)


def stage_reservations(manifest: Manifest, facts: GraphFacts, reference_path: str) -> list[Reservation]:
    """The stage's own memory terms on the host pool, in bytes."""
    graph_file = next((size for name, size in manifest.files if name == os.path.basename(manifest.path)),
                      manifest.weight_bytes)
    io_bytes = facts.io_bytes()
    reference_bytes = facts.reference_bytes if reference_path != manifest.path else graph_file
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


def unreachable_refusal(device: Device) -> Refusal:
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


def stage_capacity_refusal(device: Device, peak: Peak, capacity: int, how: str) -> Refusal:
    """``budget_exceeds_device``: the stage does not fit the host pool even with nothing else admitted."""
    return Refusal(
        code="budget_exceeds_device", device_id=device.device_id,
        message=(f"the stage needs {peak.admission_bytes / MIB:,.0f} MiB (predicted peak "
                 f"{peak.predicted_bytes / MIB:,.0f} MiB + headroom {peak.headroom_bytes / MIB:,.0f} MiB) of the "
                 f"host pool {device.device_id} draws on, which has {capacity / MIB:,.0f} MiB ({how})"),
        remedy="use a smaller stage (export fewer layers, or a quantized graph), or a machine with more RAM",
        details={"needed_bytes": peak.admission_bytes, "capacity_bytes": capacity},
    )


def host_pool_doc(capacity: int | None, how: str, ledger: LedgerView) -> dict[str, Any]:
    """``plan.stage["host_pool"]``: the capacity the stage was admitted against, and who else held the pool."""
    return {"capacity_bytes": capacity, "how": how, "committed_bytes": ledger.committed_bytes(HOST_POOL),
            "holders": holder_dicts(ledger.holders(HOST_POOL), HOST_POOL), "ledger_dir": ledger.directory}


def plan_graph_stage(manifest: Manifest, graph: GraphFacts | ArtifactError, *, devices: list[Device],
                     host: HostFacts | None, registry: Registry | None = None,
                     devices_source: str = "probed", session: SessionSpec | None = None,
                     ledger: LedgerView | None = None, placement_threshold: float | None = None,
                     numeric_tolerance: float | None = None) -> Plan:
    """Plan one exported-graph stage: the first graph-executing device that passes every gate.

    ``graph`` is what the caller read from the graph beyond its manifest
    (:func:`edge_core.artifact.graph_facts.read_graph_facts`), or why it could not.

    ``ledger`` is what the live edge sessions and stages on this host hold
    (the caller reads it: :func:`~edge_core.services.host_ledger.read_ledger`);
    None plans as if nothing else held memory.
    ``placement_threshold`` and ``numeric_tolerance`` override the defaults
    for this stage; both travel in ``plan.stage`` to the run.
    """
    session = session or SessionSpec()
    threshold = DEFAULT_PLACEMENT_THRESHOLD if placement_threshold is None else float(placement_threshold)
    if not 0.0 < threshold <= 1.0:
        raise UsageError(f"the placement threshold is a share of nodes and time in (0, 1], not {threshold}")

    def refused(refusals: list[Refusal], **extra: Any) -> Plan:
        return GraphStagePlan(admitted=False, model_path=manifest.path, session=session, manifest=manifest,
                              refusals=tuple(refusals), devices_source=devices_source, **extra)

    plugins = registry.plugins() if registry is not None else []
    if not devices and not plugins and devices_source == "probed":
        return refused([no_backend_refusal(registry, "pip install edge-dml (AMD/Intel iGPU, Windows or WSL) or "
                                           "edge-vitisai (AMD XDNA NPU) in this venv")])
    if isinstance(graph, ArtifactError):
        return refused([Refusal(code=graph.code, message=str(graph), remedy=graph.remedy)])
    facts, reference_path, reference_why = graph, graph.reference_path, graph.reference_why
    tolerance = NUMERIC_TOLERANCE.get(manifest.weight_format, DEFAULT_NUMERIC_TOLERANCE) \
        if numeric_tolerance is None else float(numeric_tolerance)
    ledger = ledger if ledger is not None else LedgerView()
    record = walk(devices, lambda device: _judge(device, manifest, facts, reference_path, session, host, registry,
                                                 devices, ledger),
                  notes=tuple(f"session ledger: {warning}" for warning in ledger.warnings))
    verdicts, fallbacks, notes = tuple(record.verdicts), tuple(record.fallbacks), tuple(record.notes)
    if record.selected is None:
        why = "; ".join(f"{v.device_id}: {v.note}" for v in verdicts if v.note) or "no device was found"
        refusals = list(record.refusals) or [Refusal(
            code="no_runnable_device", message=f"no device this interpreter sees executes exported graphs ({why})",
            remedy=("install edge-dml (AMD/Intel iGPU through DirectML) or edge-vitisai (AMD XDNA NPU) in this "
                    "venv; or plan the checkpoint itself for the CPU or a discrete GPU"),
        )]
        return refused(refusals, verdicts=verdicts, fallbacks=fallbacks, notes=notes)
    device, budget = record.selected
    stage = {
        "schema": STAGE_SCHEMA, "kind": "graph_stage", "runtime": "onnxruntime",
        "stage": facts.metadata.get(META_STAGE),
        **_route_doc(device),
        "placement_threshold": threshold,
        "placement": "unproven until the first run's profile is read (edge run --model)",
        "numeric_tolerance": tolerance,
        "numeric_tolerance_metric": "max |output - reference| / max |reference|",
        "reference_graph": reference_path, "reference_why": reference_why,
        "sample_dims": facts.sample_dims(),
        "inputs": [{"name": n, "elem_type": e, "dims": list(s)} for n, e, s in facts.inputs],
        "outputs": [{"name": n, "elem_type": e, "dims": list(s)} for n, e, s in facts.outputs],
        "host_pool": host_pool_doc(budget.capacity_bytes, budget.how, ledger),
    }
    return GraphStagePlan(
        admitted=True, model_path=manifest.path, session=session, manifest=manifest, selected_device=device,
        reservations=budget.reservations, peak=budget.peak, capacity_bytes=budget.capacity_bytes,
        fallbacks=fallbacks, verdicts=verdicts, devices_source=devices_source, notes=notes, stage=stage,
    )


def _route_doc(device: Device) -> dict[str, Any]:
    """``plan.stage``'s route that resolved for ``device`` and the execution provider it targets."""
    route = resolved_of(device)
    return {"route": dict(route) if route else None,
            "target_provider": (route or {}).get("provider") or device.extras.get("execution_provider")}


def _judge(device: Device, manifest: Manifest, facts: GraphFacts, reference_path: str, session: SessionSpec,
           host: HostFacts | None, registry: Registry | None, devices: list[Device],
           ledger: LedgerView) -> Judgement:
    """One candidate through the stage planner's gates: placement, masked, runnable, format, backend, capacity."""
    owner = Owner.of(device, registry)
    formats = owner.formats()
    if not executes_graphs(device, formats):
        return Judgement(DeviceVerdict(device.device_id, False, gate="placement", note=(
            f"runs checkpoints, not exported graphs (formats: {', '.join(formats) or 'none'})")))
    if device.masked:
        return Judgement(DeviceVerdict(device.device_id, False, note=device.reason or "masked by policy",
                                       gate="masked"))
    if not device.runnable:
        return Judgement(DeviceVerdict(device.device_id, False, (unreachable_refusal(device),), gate="runnable"))
    notes = owner.missing_note("and it cannot be run from here")
    refusal = format_gate(owner, manifest, formats)
    if refusal is not None:
        return Judgement(DeviceVerdict(device.device_id, False, (refusal,), gate="format"), notes)
    budget = backend_budget(owner, stage_reservations(manifest, facts, reference_path), manifest=manifest,
                            session=session, host=host, devices=devices)
    row = DeviceVerdict(device.device_id, False, reservations=budget.reservations, peak=budget.peak,
                        capacity_bytes=budget.capacity_bytes)
    capacity = budget.capacity_bytes
    # The capacity gate is the host pool's (see the module docstring); other pools are not checked here.
    too_big = (lambda: stage_capacity_refusal(device, budget.peak, capacity or 0, budget.how)) \
        if device.memory_pool == HOST_POOL else None
    gate, refusals = budget_gates(device, budget, ledger, too_big)
    if gate is None and capacity is None:
        notes += (f"{device.device_id}: host capacity unknown (a device list without host facts or a CPU row); "
                  "capacity not checked",)
    return Judgement(replace(row, refusals=refusals, gate=gate), notes, payload=budget)
