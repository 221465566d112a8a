"""Did the graph stage really run on its device, with the right numbers? Run it once and measure.

:func:`run_graph_stage` starts an admitted graph-stage plan the way every stage
starts, through :class:`~edge_core.runtime.session.StageSession` (no reaper or
sampler: the stage runs in this process), runs it once on sample inputs, then
reads the *profiled* placement (ONNX Runtime's per-node profile: listing a
provider proves nothing) and the numeric gate (outputs against a CPU
reference within a per-format tolerance, :func:`compare_outputs`). Either
failing is a refusal in the record, ``execution_provider_declined_graph`` or
``numeric_gate_failed``, the latter constraining this artifact only. While it
runs the stage holds its bytes in the host-wide ledger
(:mod:`edge_core.services.host_ledger`), where ``edge ps``, the next stage
planned in this process and every other edge process see them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import PluginError, StageError, UsageError
from ..plan.committed import STAGE_COMMAND, check_committed, ledger_bytes
from ..plan.graph_stage import DEFAULT_NUMERIC_TOLERANCE, EXPORT_SCRIPT
from ..plans import Refusal
from ..services import host_ledger
from ..stream import StageRequest
from . import ort_stage
from .measure import read_pss_bytes
from .session import StageSession
from .stream_run import StreamRun

if TYPE_CHECKING:
    from ..devices import Device
    from ..manifest import Manifest
    from ..plans import GraphStagePlan
    from ..services.host_ledger import Registration
    from ..services.registry import Registry


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


def _refusal_dict(code: str, device_id: str | None, message: str, remedy: str, **details: Any) -> dict[str, Any]:
    return Refusal(code=code, device_id=device_id, message=message, remedy=remedy, details=details).to_dict()


def _pss() -> int | None:
    return read_pss_bytes(os.getpid())


def admit_stage(plan: GraphStagePlan, ledger_dir: Path | None = None) -> Registration | Refusal:
    """Hold an admitted stage plan's bytes in the host-wide ledger for its run: a record of its own, or a refusal.

    Under the ledger's lock, the plan's capacity is checked again against what
    the live records hold now (a session or another stage may have been
    admitted since the plan) and, if it still fits, a ``graph stage`` record
    of this process is registered. The caller updates it with what the stage
    has measurably taken and removes it when the stage ends.
    """
    device, manifest = plan.selected()
    assert plan.peak is not None  # an admitted plan has its budget
    capacity = (plan.stage or {}).get("host_pool", {}).get("capacity_bytes")
    with host_ledger.admission(ledger_dir) as taken:
        if capacity is not None and device.memory_pool == host_ledger.HOST_POOL:  # the pool planning checked
            refusal = check_committed(device, plan.peak.admission_bytes, capacity, taken.view)
            if refusal is not None:
                return refusal
        return taken.register(command=STAGE_COMMAND, model=plan.model_path, artifact_id=manifest.artifact_id,
                              device_ids=(device.device_id,), reserved_bytes=ledger_bytes(plan),
                              predicted_peak_bytes=plan.peak.predicted_bytes, headroom_bytes=plan.peak.headroom_bytes,
                              held_peak_bytes=plan.peak.held_bytes, session=False)


def session_holding(plan: GraphStagePlan) -> Registration | None:
    """This process's session registration when it was admitted for this very plan (``edge run --model GRAPH``)."""
    device, manifest = plan.selected()
    own = host_ledger.current()
    if own is not None and own.record.artifact_id == manifest.artifact_id \
            and own.record.device_ids == (device.device_id,):
        return own
    return None


def run_graph_stage(plan: GraphStagePlan, registry: Registry, *, inputs: Mapping[str, Any] | None = None, seed: int = 0,
                    ledger_dir: Path | None = None, executor_providers: Iterable[str] | None = None,
                    idle_timeout_s: float = 600.0) -> dict[str, Any]:
    """Run an admitted graph-stage plan once and return the placement and numeric-gate record.

    Starts and stops the stage through :class:`~edge_core.runtime.session.StageSession`
    and runs it through the backend's ``stream`` / ``cancel`` and the core's
    :class:`~edge_core.runtime.stream_run.StreamRun`.
    ``inputs`` default to deterministic samples (``seed``) shaped by the graph.
    ``executor_providers`` replaces the providers the session runs with while
    the placement target stays the route's provider (a stand-in: the record
    says so). While it runs the stage is a record in the host-wide ledger at
    ``ledger_dir`` (default :func:`~edge_core.services.host_ledger.ledger_dir`),
    admitted by :func:`admit_stage` and removed after — or, when this process's
    session was admitted for this plan (``edge run`` registers before it starts
    the stage), that session's record. ``record["passed"]`` is True only when
    the stage was placed on its target provider *and* passed the numeric gate;
    otherwise ``record["refusals"]`` says which gate said no.
    """
    record: dict[str, Any] = {
        "schema": "edge.graph_stage_run/1", "model_path": plan.model_path, "admitted": plan.admitted,
        "ran": False, "placed": False, "passed": False, "refusals": [r.to_dict() for r in plan.refusals],
    }
    if not plan.admitted:
        return record
    device, manifest = plan.selected()
    stage_info = dict(getattr(plan, "stage", None) or {})
    target = stage_info.get("target_provider")
    record.update({"device_id": device.device_id, "backend": device.backend, "artifact_id": manifest.artifact_id,
                   "weight_format": manifest.weight_format, "target_provider": target,
                   "route": stage_info.get("route")})
    refusal = _cannot_run(device, registry, target)
    if refusal is not None:
        record["refusals"] = [refusal]
        return record
    if executor_providers is not None:
        plan = _with_stand_in(plan, list(executor_providers), record)
    session = session_holding(plan)
    holder = session or admit_stage(plan, ledger_dir)
    if isinstance(holder, Refusal):
        record["refusals"] = [holder.to_dict()]
        return record
    held = holder.record
    record["ledger_record"] = {"session_id": held.session_id, "command": held.command,
                               "reserved_bytes": dict(held.reserved_bytes), "directory": str(holder.directory)}
    footprint = _Footprint(holder, own=session is None)
    stage = StageSession(plan, registry, watches=False, ledger=holder, releases_ledger=session is None,
                         keeps_stop_error=True)
    with contextlib.ExitStack() as running:
        try:
            running.enter_context(stage)
        except PluginError as exc:  # a graph ONNX Runtime cannot load: a refusal, not a crash
            record["refusals"] = [_refusal_dict(
                "artifact_invalid", device.device_id, f"the stage did not start: {exc}", _reexport(plan))]
            return record
        _judge(plan, stage, record, footprint, inputs=inputs, seed=seed, idle_timeout_s=idle_timeout_s)
    record["stopped"] = bool(stage.stop_answer)
    if stage.stop_error is not None:
        record["stop_error"] = str(stage.stop_error)
    return record


def _judge(plan: GraphStagePlan, stage: StageSession, record: dict[str, Any], footprint: _Footprint, *,
           inputs: Mapping[str, Any] | None, seed: int, idle_timeout_s: float) -> None:
    """The started stage run once, then its placement and numeric gates, into ``record``."""
    stage_info = dict(plan.stage or {})
    timings = {"start_s": stage.start_s}
    footprint.read()
    handle = stage.stage
    feeds = _feeds(handle, inputs, seed, stage_info, plan)
    outputs = _run_once(stage.registry, stage.device, handle, feeds, idle_timeout_s, record, timings)
    footprint.read()
    record["stage"] = handle.to_dict() if hasattr(handle, "to_dict") else {}
    record["stage"].pop("placement", None)  # profiled placement is the record's own section
    refusals = _placement_refusals(handle, plan, stage_info.get("target_provider"), stage_info, record)
    refusals += _numeric_refusals(plan, stage_info, feeds, outputs, record, timings, footprint)
    record["refusals"] = refusals
    record["passed"] = record["placed"] and record["numeric_gate"]["passed"]
    record["memory"] = footprint.to_dict(plan)
    record["timings_s"] = {k: round(v, 4) for k, v in timings.items()}


def _reexport(plan: GraphStagePlan) -> str:
    return (f"check the graph with `edge plan --model {plan.model_path}`; re-export it ({EXPORT_SCRIPT}) if ONNX "
            "Runtime cannot load it")


def _cannot_run(device: Device, registry: Registry, target: str | None) -> dict[str, Any] | None:
    """Why this interpreter cannot run or judge the stage (no backend with ``start_stage``, no target); else None."""
    owner = registry.owner(device) if registry is not None else None
    if owner is None or "start_stage" not in owner.hooks:
        return _refusal_dict(
            "device_unreachable_from_this_process", device.device_id,
            f"no backend installed in this interpreter runs stages on {device.device_id} (planned from a device "
            "list or a backend without start_stage)",
            f"run edge where {device.plugin or device.backend} is installed and drives {device.device_id}")
    if not target:
        return _refusal_dict(
            "execution_provider_declined_graph", device.device_id,
            f"{device.device_id} names no target execution provider, so placement cannot be measured",
            f"the {device.plugin} backend must record its route (Device.extras['routes']) with a provider")
    return None


def _with_stand_in(plan: GraphStagePlan, providers: list[str], record: dict[str, Any]) -> GraphStagePlan:
    """``plan`` run with ``providers`` instead of its route's, said in ``record``; placement keeps its target."""
    stage_info = dict(plan.stage or {})
    record["executor_providers"] = providers
    record["stand_in"] = (f"the session runs with {', '.join(providers)} instead of the route's providers; "
                          f"placement is still judged against {stage_info.get('target_provider')}")
    return dataclasses.replace(plan, stage={**stage_info, "executor_providers": providers})


class _Footprint:
    """The stage's process PSS, read at four points; its own ledger record kept at what it has taken.

    A session's record (``own`` False) is its session's watcher's to update.
    """

    def __init__(self, holder: Registration, own: bool):
        self.holder = holder
        self.own = own
        self.before = _pss()
        self.reads: list[int | None] = []

    def read(self) -> int | None:
        pss = _pss()
        self.reads.append(pss)
        if self.own and pss is not None and self.before is not None:
            grown = max(pss - self.before, 0)
            self.holder.update(measured_current_bytes=grown,
                               measured_peak_bytes=max(grown, self.holder.record.measured_peak_bytes))
        return pss

    def to_dict(self, plan: GraphStagePlan) -> dict[str, Any]:
        started, ran, ref = self.reads
        samples = [v for v in (self.before, started, ran, ref) if v is not None]
        return {
            "counter": "process PSS (the stage runs in this process)",
            "pss_before_bytes": self.before, "pss_after_start_bytes": started,
            "pss_after_run_bytes": ran, "pss_after_reference_bytes": ref,
            "attributable_peak_bytes": (max(samples) - self.before) if samples and self.before is not None else None,
            "predicted_peak_bytes": plan.peak.predicted_bytes if plan.peak is not None else None,
            "note": "read at four points, not sampled: a lower bound of the peak",
        }


def _feeds(handle: Any, inputs: Mapping[str, Any] | None, seed: int, stage_info: Mapping[str, Any],
           plan: GraphStagePlan) -> Mapping[str, Any]:
    """The caller's inputs checked against the stage's specs, or deterministic samples shaped by them."""
    specs = getattr(handle, "inputs", None)
    if inputs is None:
        if specs is None:
            raise UsageError(f"the {plan.selected()[0].plugin} stage does not describe its inputs; pass inputs=")
        return ort_stage.sample_inputs(specs, seed=seed, dims=stage_info.get("sample_dims"))
    if specs is not None:
        try:
            ort_stage.check_feeds(specs, inputs, plan.model_path)
        except StageError as exc:
            raise UsageError(str(exc)) from None
    return inputs


def _run_once(registry: Registry, device: Device, handle: Any, inputs: Mapping[str, Any], idle_timeout_s: float,
              record: dict[str, Any], timings: dict[str, float]) -> dict[str, Any]:
    """One request through the backend's ``stream`` and the core's :class:`StreamRun`; its outputs by name."""
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
    record["outputs"] = final.to_dict()["tensors"]
    return dict(final.tensors or {})


def _placement_refusals(handle: Any, plan: GraphStagePlan, target: Any, stage_info: Mapping[str, Any],
                        record: dict[str, Any]) -> list[dict[str, Any]]:
    """The profiled placement into ``record``; ``execution_provider_declined_graph`` when it is missing or short."""
    device, manifest = plan.selected()
    placement = getattr(handle, "placement", None)
    if placement is None:
        why = getattr(handle, "profile_error", None) or "the backend reported no per-node profile"
        record["placement"] = {"placed": False, "target_provider": target, "problem": why}
        return [_refusal_dict(
            "execution_provider_declined_graph", device.device_id,
            f"no measured placement for {target} on {device.device_id} ({why}); a listed provider is not evidence",
            "run the stage with a backend that profiles its first run (edge's ONNX Runtime stage runtime)")]
    record["placement"] = placement.to_dict()
    record["placed"] = placement.placed
    if placement.placed:
        return []
    shares = placement.kernels_by_provider
    return [_refusal_dict(
        "execution_provider_declined_graph", device.device_id,
        f"{target} executed {placement.node_share:.0%} of the nodes and {placement.time_share:.0%} of "
        f"the time of {os.path.basename(plan.model_path)} (threshold {placement.threshold:.0%}); "
        f"kernels by provider: {', '.join(f'{p} {n}' for p, n in shares.items()) or 'none'}",
        _declined_remedy(device, manifest, target, stage_info),
        node_share=round(placement.node_share, 4), time_share=round(placement.time_share, 4),
        threshold=placement.threshold, kernels_by_provider=shares,
        time_us_by_provider=placement.time_us_by_provider,
        missing_providers=list(getattr(handle, "missing_providers", ()) or ()),
        session_providers=list(getattr(handle, "session_providers", ()) or ()))]


def _numeric_refusals(plan: GraphStagePlan, stage_info: Mapping[str, Any], inputs: Mapping[str, Any],
                      outputs: Mapping[str, Any], record: dict[str, Any], timings: dict[str, float],
                      footprint: _Footprint) -> list[dict[str, Any]]:
    """The numeric gate (the CPU reference run, then the comparison) into ``record``; ``numeric_gate_failed`` if so."""
    device, manifest = plan.selected()
    reference_path = stage_info.get("reference_graph") or plan.model_path
    started = time.perf_counter()
    reference, ran_ref = ort_stage.reference_outputs(reference_path, inputs)
    timings["reference_s"] = time.perf_counter() - started
    footprint.read()
    ran_ref["why"] = stage_info.get("reference_why")
    gate = compare_outputs(outputs, reference, weight_format=manifest.weight_format,
                           tolerance=float(stage_info.get("numeric_tolerance") or DEFAULT_NUMERIC_TOLERANCE),
                           reference_info=ran_ref)
    record["numeric_gate"] = gate.to_dict()
    if gate.passed:
        return []
    return [_refusal_dict(
        "numeric_gate_failed", device.device_id,
        (f"{os.path.basename(plan.model_path)} ({manifest.weight_format}) on {device.device_id} is "
         f"{gate.max_rel_error:.3g} of the reference's peak away from {os.path.basename(reference_path)} "
         f"on the CPU (tolerance {gate.tolerance:.3g})" + (f"; {gate.problem}" if gate.problem else "")),
        (f"this artifact ({manifest.artifact_id}) is constrained, not the device or {manifest.weight_format} "
         f"in general: re-export or re-quantize it ({EXPORT_SCRIPT}; more calibration data, per-channel "
         "weights), or check that its reference graph is the graph it came from"),
        artifact_id=manifest.artifact_id, scope="artifact", max_abs_error=gate.max_abs_error,
        max_rel_error=gate.max_rel_error, tolerance=gate.tolerance)]


def _declined_remedy(device: Device, manifest: Manifest, target: str, stage_info: Mapping[str, Any]) -> str:
    route = stage_info.get("route") or {}
    formats = route.get("formats") or list(device.weight_formats)
    return (f"{target} left this graph to other providers: for {device.device_id} export the stage in a format "
            f"it executes ({', '.join(formats) or 'see edge devices'}) with operators it supports "
            f"({EXPORT_SCRIPT}); check that the runtime offers {target} (edge devices --verify); a lower "
            "per-stage threshold is a choice, not a fix")

