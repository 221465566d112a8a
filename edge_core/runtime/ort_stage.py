"""Running one exported-graph stage through ONNX Runtime, and measuring which provider ran it.

The stage runtime both graph backends share (edge-dml's DirectML EP and
edge-vitisai's VitisAI EP use it with their own provider), imported only when a
stage starts: ``import onnxruntime`` costs hundreds of milliseconds and must
never sit on the ``edge devices`` / ``edge plan`` path.

A graph stage is request/response: a request's ``inputs`` (name -> array) go
in, one :class:`~edge_core.stream.DeltaEvent` comes out carrying the output
arrays in ``tensors`` and ``finish_reason="stop"``. Cancel sets ONNX Runtime's
``RunOptions.terminate`` on the run in flight.

Placement is profiled, never read from the session: an ONNX Runtime session
*lists* every provider it was given whether or not that provider claimed a
single node (an XDNA session lists VitisAI while every node of an fp32 graph
runs on the CPU, with CPU-identical outputs). So the first run of every stage
is profiled (``SessionOptions.enable_profiling``) and the profile's kernel
events — each names the provider that executed it in ``args.provider`` — are
counted by node and by time.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..artifact.graph_facts import DEFAULT_SAMPLE_DIM, DEFAULT_SAMPLE_DIMS
from ..errors import StageError
from ..plan.graph_stage import DEFAULT_PLACEMENT_THRESHOLD
from ..stream import DeltaEvent, StageRequest, StateHandle

if TYPE_CHECKING:
    from ..devices import Device
    from ..plans import Plan

#: ONNX Runtime's CPU execution provider: present in every build, the reference
#: executor of the numeric gate and the fallback every graph EP leaves work to.
CPU_PROVIDER = "CPUExecutionProvider"

#: The profile's event category and name suffix of one executed kernel (ONNX
#: Runtime 1.x). ``_fence_before``/``_fence_after`` events share the category
#: and are not executions.
_NODE_CATEGORY = "Node"
_KERNEL_SUFFIX = "_kernel_time"

_NUMPY_OF_ORT = {
    "tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
    "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8",
    "tensor(int16)": "int16", "tensor(uint16)": "uint16", "tensor(bool)": "bool",
}


def import_ort() -> Any:
    """``onnxruntime``, or a :class:`StageError` saying how to get it."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise StageError(
            f"running a graph stage needs ONNX Runtime, which cannot be imported here ({exc}): install the "
            "build for the device (onnxruntime-directml for edge-dml on Windows, Ryzen AI Software's "
            "onnxruntime-vitisai for edge-vitisai, plain onnxruntime for the CPU provider)"
        ) from None
    return onnxruntime


# ------------------------------------------------------------------ placement

@dataclass(frozen=True)
class KernelEvent:
    """One kernel the profiled run executed: node name, operator, provider, microseconds."""

    node: str
    op_type: str
    provider: str
    duration_us: int

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "op_type": self.op_type, "provider": self.provider,
                "duration_us": self.duration_us}


@dataclass(frozen=True)
class Placement:
    """Which provider executed the stage's first run, read from ONNX Runtime's profile (evidence B).

    ``node_share`` is the fraction of executed kernels the target provider ran,
    ``time_share`` the fraction of kernel time. An EP that compiles a partition
    runs it as one kernel, so a partition counts once: the node share is then
    conservative, and the per-stage threshold is the knob for a graph whose
    partition is large but whose CPU remainder has many small nodes.
    """

    target_provider: str
    threshold: float
    kernels: tuple[KernelEvent, ...]
    profile_file: str | None = None

    @property
    def kernels_by_provider(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.kernels:
            out[k.provider] = out.get(k.provider, 0) + 1
        return dict(sorted(out.items()))

    @property
    def time_us_by_provider(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.kernels:
            out[k.provider] = out.get(k.provider, 0) + k.duration_us
        return dict(sorted(out.items()))

    @property
    def node_share(self) -> float:
        if not self.kernels:
            return 0.0
        return self.kernels_by_provider.get(self.target_provider, 0) / len(self.kernels)

    @property
    def time_share(self) -> float:
        total = sum(k.duration_us for k in self.kernels)
        if not total:
            # Kernels too quick for the microsecond clock: time says nothing the node count does not.
            return self.node_share
        return self.time_us_by_provider.get(self.target_provider, 0) / total

    @property
    def placed(self) -> bool:
        return bool(self.kernels) and self.node_share >= self.threshold and self.time_share >= self.threshold

    def to_dict(self) -> dict[str, Any]:
        return {
            "target_provider": self.target_provider,
            "threshold": self.threshold,
            "placed": self.placed,
            "node_share": round(self.node_share, 4),
            "time_share": round(self.time_share, 4),
            "kernels": len(self.kernels),
            "kernels_by_provider": self.kernels_by_provider,
            "time_us_by_provider": self.time_us_by_provider,
            "nodes": [k.to_dict() for k in self.kernels],
            "evidence": "B",
            "source": "ONNX Runtime profile of the first run (SessionOptions.enable_profiling)",
        }


def kernel_events(profile: Iterable[Mapping[str, Any]]) -> list[KernelEvent]:
    """The executed kernels in an ONNX Runtime profile (the parsed JSON list)."""
    out = []
    for event in profile:
        if not isinstance(event, Mapping) or event.get("cat") != _NODE_CATEGORY:
            continue
        name = str(event.get("name", ""))
        if not name.endswith(_KERNEL_SUFFIX):
            continue
        raw_args = event.get("args")
        args: Mapping[str, Any] = raw_args if isinstance(raw_args, Mapping) else {}
        provider = str(args.get("provider") or "unknown")
        try:
            duration = max(int(event.get("dur") or 0), 0)
        except (TypeError, ValueError):
            duration = 0
        out.append(KernelEvent(name[: -len(_KERNEL_SUFFIX)], str(args.get("op_name") or "?"), provider, duration))
    return out


def placement_from_profile(profile: Iterable[Mapping[str, Any]], target_provider: str,
                           threshold: float = DEFAULT_PLACEMENT_THRESHOLD,
                           profile_file: str | None = None) -> Placement:
    """Measure placement from a parsed profile against ``target_provider``."""
    return Placement(target_provider, float(threshold), tuple(kernel_events(profile)), profile_file)


# ------------------------------------------------------------------ inputs

@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: name, numpy dtype name, dims (int or symbolic name)."""

    name: str
    dtype: str
    dims: tuple[Any, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "dims": list(self.dims)}


def _specs(args: Iterable[Any]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(a.name, _NUMPY_OF_ORT.get(a.type, a.type), tuple(a.shape)) for a in args)


def sample_inputs(specs: Iterable[TensorSpec], *, seed: int = 0, dims: Mapping[str, int] | None = None,
                  int_high: int = 2) -> dict[str, Any]:
    """Deterministic sample inputs for ``specs``: standard normal floats, small non-negative ints.

    Symbolic dims take ``dims`` (the graph's ``edge.sample_dims``), then
    :data:`DEFAULT_SAMPLE_DIMS`, then :data:`DEFAULT_SAMPLE_DIM`.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    known = {**DEFAULT_SAMPLE_DIMS, **dict(dims or {})}
    out = {}
    for spec in specs:
        shape = [d if isinstance(d, int) and d > 0 else known.get(str(d), DEFAULT_SAMPLE_DIM) for d in spec.dims]
        if spec.dtype.startswith("float"):
            out[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif spec.dtype == "bool":
            out[spec.name] = rng.integers(0, 2, size=shape).astype(bool)
        else:
            out[spec.name] = rng.integers(0, max(int_high, 1), size=shape).astype(spec.dtype)
    return out


def check_feeds(specs: Iterable[TensorSpec], inputs: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``inputs`` as numpy arrays in the graph's own dtypes; a :class:`StageError` naming any mismatch.

    Float inputs are cast between float widths (a fp16 graph checked against a
    fp32 reference takes the same values); names, ranks and fixed dims must match.
    """
    import numpy as np

    specs = list(specs)
    wanted = {s.name for s in specs}
    given = set(inputs)
    problems = []
    if given != wanted:
        if wanted - given:
            problems.append(f"missing {', '.join(sorted(wanted - given))}")
        if given - wanted:
            problems.append(f"unknown {', '.join(sorted(given - wanted))}")
    feeds = {}
    for spec in specs:
        if spec.name not in inputs:
            continue
        try:
            array = np.asarray(inputs[spec.name])
        except Exception as exc:  # noqa: BLE001 - any unconvertible object is a bad input
            problems.append(f"{spec.name} is not an array ({type(exc).__name__})")
            continue
        if array.ndim != len(spec.dims) or any(
                isinstance(d, int) and d > 0 and d != n for d, n in zip(spec.dims, array.shape)):
            problems.append(f"{spec.name} has shape {list(array.shape)}, the graph wants {list(spec.dims)}")
            continue
        if array.dtype.name != spec.dtype:
            if array.dtype.kind == "f" and spec.dtype.startswith("float"):
                array = array.astype(spec.dtype)
            else:
                problems.append(f"{spec.name} is {array.dtype.name}, the graph wants {spec.dtype}")
                continue
        feeds[spec.name] = array
    if problems:
        expected = ", ".join(f"{s.name}: {s.dtype}{list(s.dims)}" for s in specs)
        raise StageError(f"{where}: inputs do not match the graph ({'; '.join(problems)}); it takes {expected}")
    return feeds


# ------------------------------------------------------------------ the stage

@dataclass
class _InFlight:
    run_options: Any
    cancelled: bool = False


@dataclass
class OrtStage:
    """A started graph stage: one ONNX Runtime session on one device, and what its first run proved.

    ``session_providers`` is what the session *lists* — recorded, never taken
    as evidence; ``placement`` is what the profile shows (None before the
    first run).
    """

    device_id: str
    backend: str
    artifact_id: str
    model_path: str
    target_provider: str
    threshold: float
    requested_providers: tuple[str, ...]
    missing_providers: tuple[str, ...]
    session_providers: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    ort_version: str
    start_s: float
    state: StateHandle
    _session: Any = field(repr=False)
    _profile_dir: str | None = field(repr=False, default=None)
    placement: Placement | None = None
    profile_error: str | None = None
    runs: int = 0
    _inflight: dict[str, _InFlight] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _first_run: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _profiling: bool = True
    stopped: bool = False

    @property
    def executed_on(self) -> str:
        return self.device_id

    @property
    def in_flight_count(self) -> int:
        with self._lock:
            return len(self._inflight)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "backend": self.backend,
            "model_path": self.model_path,
            "artifact_id": self.artifact_id,
            "runtime": f"onnxruntime {self.ort_version}",
            "target_provider": self.target_provider,
            "requested_providers": list(self.requested_providers),
            "missing_providers": list(self.missing_providers),
            "session_providers": list(self.session_providers),
            "session_providers_note": "what the session lists; not evidence of placement",
            "inputs": [s.to_dict() for s in self.inputs],
            "outputs": [s.to_dict() for s in self.outputs],
            "start_s": round(self.start_s, 4),
            "runs": self.runs,
            "placement": self.placement.to_dict() if self.placement else None,
            "profile_error": self.profile_error,
        }

    # -- requests ------------------------------------------------------------

    def stream(self, request: StageRequest) -> Iterator[DeltaEvent]:
        """Register ``request`` as in flight now and return the iterator that runs it."""
        if self.stopped:
            raise StageError(f"graph stage on {self.device_id} is stopped; start a new one")
        if request.inputs is None:
            raise StageError(f"graph stage on {self.device_id} takes tensors: give StageRequest(inputs=...), "
                             "not a prompt")
        feeds = check_feeds(self.inputs, request.inputs, f"graph stage {self.model_path}")
        ort = import_ort()
        flight = _InFlight(ort.RunOptions())
        with self._lock:
            if request.request_id in self._inflight:
                raise StageError(f"request {request.request_id} is already in flight on {self.device_id}")
            self._inflight[request.request_id] = flight
        return self._events(request, flight, feeds)

    def _events(self, request: StageRequest, flight: _InFlight, feeds: dict[str, Any]) -> Iterator[DeltaEvent]:
        def event(finish: str, tensors: Mapping[str, Any] | None = None) -> DeltaEvent:
            return DeltaEvent(request.request_id, request.epoch, 0, finish_reason=finish, tensors=tensors)

        try:
            if flight.cancelled:
                yield event("abort")
                return
            try:
                values = self._run(feeds, flight.run_options)
            except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own exception types
                if flight.cancelled:
                    yield event("abort")
                    return
                raise StageError(f"ONNX Runtime failed running {self.model_path} on {self.device_id}: "
                                 f"{type(exc).__name__}: {exc}") from exc
            yield event("stop", dict(zip((o.name for o in self.outputs), values)))
        finally:
            with self._lock:
                self._inflight.pop(request.request_id, None)

    def _run(self, feeds: dict[str, Any], run_options: Any) -> list[Any]:
        if not self._profiling:
            values: list[Any] = self._session.run(None, feeds, run_options)
            self.runs += 1
            return values
        with self._first_run:
            if not self._profiling:  # another request was first
                return self._run(feeds, run_options)
            values = self._session.run(None, feeds, run_options)
            self.runs += 1
            self._end_profiling()
            return values

    def _end_profiling(self) -> None:
        """Close the profile after the first run and measure placement from it."""
        self._profiling = False
        try:
            path = self._session.end_profiling()
            with open(path, encoding="utf-8") as handle:
                profile = json.load(handle)
            self.placement = placement_from_profile(profile, self.target_provider, self.threshold,
                                                    os.path.basename(path))
        except (OSError, ValueError) as exc:
            # No profile is no evidence: placement stays None and the stage is not placed.
            self.profile_error = f"{type(exc).__name__}: {exc}"
        finally:
            self._remove_profile_dir()

    def cancel(self, request_id: str) -> bool:
        """Terminate ``request_id`` if it is in flight; True if it was."""
        with self._lock:
            flight = self._inflight.get(request_id)
            if flight is None or flight.cancelled:
                return False
            flight.cancelled = True
        flight.run_options.terminate = True
        return True

    def stop(self) -> bool:
        """Terminate what is in flight, close the profile, drop the session; True once all is gone."""
        with self._lock:
            flights = list(self._inflight.values())
            self.stopped = True
        for flight in flights:
            flight.cancelled = True
            flight.run_options.terminate = True
        if self._profiling:
            self._profiling = False
            try:
                self._session.end_profiling()
            except Exception:  # noqa: BLE001 - the profile of a stage that never ran is discarded anyway
                pass
        self._remove_profile_dir()
        self._session = None
        return True

    def _remove_profile_dir(self) -> None:
        if self._profile_dir:
            shutil.rmtree(self._profile_dir, ignore_errors=True)
            self._profile_dir = None


def session_options(ort: Any, profile_prefix: str | None,
                    configure: Callable[[Any, Any, list[str]], None] | None = None, providers: Iterable[str] = ()) -> Any:
    """ONNX Runtime session options: errors-only logging, profiling for the placement check.

    ``configure(ort, options, providers)`` is the backend's say over its
    provider's needs (DirectML cannot run with memory patterns, for one); it
    runs last.
    """
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: provider fallbacks are recorded, not printed
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    if configure is not None:
        configure(ort, options, list(providers))
    return options


def start(device: Device, plan: Plan, *, providers: Iterable[str], target_provider: str,
          provider_options: Mapping[str, Mapping[str, str]] | None = None,
          configure: Callable[[Any, Any, list[str]], None] | None = None) -> OrtStage:
    """Open ``plan``'s graph on ``device`` with ``providers`` (best first); profile its first run.

    ``plan.stage["executor_providers"]``, when set, replaces ``providers`` as
    the providers the session runs with while the placement target stays
    ``target_provider`` — the stand-in that lets the whole path run here on the
    CPU provider and still be judged against the device's own provider.
    Requested providers this ONNX Runtime build does not offer are dropped and
    recorded as missing: the stage may still start, and placement will show
    where it really ran.
    """
    ort = import_ort()
    stage_info = dict(getattr(plan, "stage", None) or {})
    requested = tuple(stage_info.get("executor_providers") or providers)
    threshold = float(stage_info.get("placement_threshold") or DEFAULT_PLACEMENT_THRESHOLD)
    available = set(ort.get_available_providers())
    use = [p for p in requested if p in available] or [CPU_PROVIDER]
    missing = tuple(p for p in requested if p not in available)
    manifest = plan.selected()[1]
    model_path = manifest.path
    profile_dir = tempfile.mkdtemp(prefix="edge-ort-profile-")
    options = session_options(ort, os.path.join(profile_dir, "stage"), configure, use)
    per_provider = [dict((provider_options or {}).get(p, {})) for p in use]
    started = time.perf_counter()
    try:
        session = ort.InferenceSession(model_path, options, providers=use, provider_options=per_provider)
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own exception types
        shutil.rmtree(profile_dir, ignore_errors=True)
        raise StageError(f"ONNX Runtime could not open {model_path} with {', '.join(use)} for "
                         f"{device.device_id}: {type(exc).__name__}: {exc}") from exc
    return OrtStage(
        device_id=device.device_id,
        backend=device.backend or "ort",
        artifact_id=manifest.artifact_id,
        model_path=model_path,
        target_provider=target_provider,
        threshold=threshold,
        requested_providers=requested,
        missing_providers=missing,
        session_providers=tuple(session.get_providers()),
        inputs=_specs(session.get_inputs()),
        outputs=_specs(session.get_outputs()),
        ort_version=str(getattr(ort, "__version__", "?")),
        start_s=time.perf_counter() - started,
        state=StateHandle(backend=device.backend or "ort", device_id=device.device_id,
                          artifact_id=manifest.artifact_id, ref=f"ort-session-{uuid.uuid4().hex[:12]}"),
        _session=session,
        _profile_dir=profile_dir,
    )


# ------------------------------------------------------------------ hook bodies

def stream(stage: OrtStage, request: StageRequest) -> Iterator[DeltaEvent]:
    return stage.stream(request)


def cancel(stage: OrtStage, request_id: str) -> bool:
    return stage.cancel(request_id)


def stop(stage: OrtStage) -> bool:
    return stage.stop()


# ------------------------------------------------------------------ reference

def reference_outputs(model_path: str, inputs: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``model_path`` once on the CPU provider alone: (outputs by name, what ran).

    The numeric gate's reference. Inputs are cast to the graph's float width,
    so an fp16 stage and its fp32 reference see the same values.
    """
    ort = import_ort()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    started = time.perf_counter()
    try:
        session = ort.InferenceSession(model_path, options, providers=[CPU_PROVIDER])
        specs = _specs(session.get_inputs())
        feeds = check_feeds(specs, inputs, f"reference graph {model_path}")
        values = session.run(None, feeds)
    except StageError:
        raise
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime raises its own exception types
        raise StageError(f"the CPU reference run of {model_path} failed: {type(exc).__name__}: {exc}") from exc
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, values)), {"graph": model_path, "provider": CPU_PROVIDER,
                                      "seconds": round(time.perf_counter() - started, 4)}
