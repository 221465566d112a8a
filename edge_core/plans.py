"""The plan and its parts: what the planner answers, admitted or refused, as values.

A refusal is a value, not an exception (:class:`Refusal`, with a code, a
message and a remedy); a :class:`Plan` carries the selected device, every
reservation, the KV summary and the engine arguments when admitted, and at
least one refusal when not. :class:`GraphStagePlan` is the same answer for one
exported-graph stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .budget import Peak, Reservation
    from .devices import Device
    from .kv import KVEstimate
    from .manifest import Manifest, ModelSource

#: Refusal codes. Each names the gate that said no.
REFUSAL_CODES = (
    "no_backend_installed",
    "no_runnable_device",
    "weight_format_unsupported",
    "kernel_unsupported",
    "budget_exceeds_device",
    "config_unreadable",
    "artifact_invalid",
    "no_exported_graph",
    "execution_provider_declined_graph",
    "numeric_gate_failed",
    "device_unreachable_from_this_process",
    "serve_unsupported",
    "architecture_unsupported",
    "runtime_dependency_missing",
    # A GGUF file (llama.cpp's format), which vLLM does not load: `edge import` converts it (artifact/gguf.py):
    "gguf_needs_import",
    # A model named by Hub id (edge_core/artifact/hub.py):
    "model_not_found",
    "model_gated",
    "revision_not_found",
    "model_not_cached",
    "hub_unreachable",
    "disk_space_insufficient",
    # Another live edge session on this host holds the bytes (edge_core/services/host_ledger.py):
    "device_committed",
    # A tensor/pipeline-parallel layout vLLM would reject (edge_core/plan/parallel.py):
    "parallel_layout_invalid",
    # A node of a --nnodes session with no address its ranks can reach the head on (edge_core/runtime/node_address.py),
    # or that cannot reach the head's ranks on it (edge_core/runtime/nodes.py):
    "node_unreachable",
)

#: Device kinds that take single exported stages, never a whole decode session.
STAGE_ONLY_KINDS = ("gpu_integrated", "npu")


@dataclass(frozen=True)
class Refusal:
    """One reason a device (or the whole plan) says no, and what would change that."""

    code: str
    message: str
    remedy: str
    device_id: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.code not in REFUSAL_CODES:
            raise ValueError(f"unknown refusal code {self.code!r}; known: {', '.join(REFUSAL_CODES)}")
        if not self.message or not self.remedy:
            raise ValueError(f"refusal {self.code!r} needs both a message and a remedy")

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "device_id": self.device_id,
            "message": self.message,
            "remedy": self.remedy,
            "details": dict(self.details),
        }


@dataclass(frozen=True)
class SessionSpec:
    """The limits of one autoregressive session, as the user asked for them.

    ``max_model_len`` None means the checkpoint's own context length;
    ``max_model_len_auto`` (``--max-model-len auto``) asks for the longest
    context one sequence can hold in the KV pool, fitted before anything loads
    (a planned session then carries the fitted length and keeps the flag).
    ``max_num_seqs`` bounds how many sequences run at once; they share one
    paged KV pool of ``kv_cache_memory_bytes`` (vLLM's, per rank; None: the
    planner sizes it, :mod:`edge_core.plan.pool`).
    ``kv_dtype`` is ``auto`` (the model dtype) or an fp8 variant.
    ``enforce_eager`` None means the device's backend decides
    (:mod:`edge_core.plan.execution`); True or False is the user's
    ``--enforce-eager`` / ``--compile``. A planned session always has it set.
    ``served`` is True for a session behind vLLM's OpenAI-compatible server
    (``edge serve``), whose engine core always runs in a process of its own;
    ``max_connections`` is then how many requests to the model its server
    holds open at once (``--max-connections``: running, queued or streaming;
    one more is answered 503), and the plan reserves their state. None for a
    session that is not served.
    ``in_process`` is the planned engine's process layout (the plan's
    ``execution``): None until planned.
    """

    max_model_len: int | None = None
    max_num_seqs: int = 1
    max_num_batched_tokens: int | None = None
    kv_dtype: str = "auto"
    enforce_eager: bool | None = None
    max_model_len_auto: bool = False
    kv_cache_memory_bytes: int | None = None
    served: bool = False
    max_connections: int | None = None
    in_process: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "max_model_len_auto": self.max_model_len_auto,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "kv_dtype": self.kv_dtype,
            "enforce_eager": self.enforce_eager,
            "served": self.served,
            "max_connections": self.max_connections,
            "in_process": self.in_process,
        }


#: Where a session's execution mode came from: the user's flag, or the backend's default.
EXECUTION_SOURCES = ("--enforce-eager", "--compile", "backend", "default")


@dataclass(frozen=True)
class ExecutionMode:
    """How the runtime executes the session: eagerly, or compiled (vLLM: torch.compile, CUDA graphs on a GPU).

    ``source`` is one of :data:`EXECUTION_SOURCES` (``backend``: the device's
    backend chose it through its ``execution_mode`` hook; ``default``: the
    backend has no such hook, and edge runs eagerly). ``reason`` says why, for
    people. ``cudagraph_capture_sizes`` are the batch sizes vLLM captures CUDA
    graphs for (empty when eager or on a runtime without graphs).

    The engine's process layout, the engine's rules' answer
    (:meth:`edge_core.engine.EngineRules.engine_processes`): ``in_process``
    True runs vLLM's engine core and its one worker inside edge's own process
    (vLLM's uniprocess executor), False in processes of their own;
    ``processes_reason`` says why; ``env`` is what that layout sets before the
    engine is imported (``VLLM_ENABLE_V1_MULTIPROCESSING``, an in-process
    engine's OpenMP threads), the same for edge's engine and for plain vLLM
    compared with it.
    """

    enforce_eager: bool
    source: str
    reason: str
    cudagraph_capture_sizes: tuple[int, ...] = ()
    in_process: bool = False
    processes_reason: str = ""
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.source not in EXECUTION_SOURCES:
            raise ValueError(f"unknown execution source {self.source!r}; known: {', '.join(EXECUTION_SOURCES)}")

    @property
    def mode(self) -> str:
        return "eager" if self.enforce_eager else "compiled"

    @property
    def processes(self) -> str:
        """``one`` (the engine inside edge's process) or ``separate`` (engine core and workers apart)."""
        return "one" if self.in_process else "separate"

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "enforce_eager": self.enforce_eager,
            "source": self.source,
            "reason": self.reason,
            "cudagraph_capture_sizes": list(self.cudagraph_capture_sizes),
            "processes": self.processes,
            "in_process": self.in_process,
            "processes_reason": self.processes_reason,
            "env": dict(self.env),
        }


#: The gates a candidate walks, in order; a refused device's verdict names the
#: one that said no. ``masked`` and ``runnable``: the device list itself says
#: no; ``placement``: the device takes the other kind of work (a stage-only
#: kind for a whole session, a checkpoint device for a graph stage);
#: ``format``: the weight format; ``backend``: the owning backend's
#: ``gate_plan`` (kernels, its runtime's own capacity check); ``capacity``:
#: admission bytes against the pool.
GATES = ("masked", "runnable", "placement", "format", "backend", "capacity")


@dataclass(frozen=True)
class DeviceVerdict:
    """One candidate device and what the gates said about it.

    ``gate`` is the gate that refused the device (one of :data:`GATES`), None
    when it passed every gate (selected, or a fallback). A device that reached
    the budget arithmetic keeps it, refused or not, so a refusal can be read
    term by term: ``reservations``, ``peak``, ``kv`` and ``capacity_bytes``
    (what admission compared with; None where the pool's capacity is unknown).
    A device refused before the arithmetic has none of them.
    """

    device_id: str
    selected: bool
    refusals: tuple[Refusal, ...] = ()
    note: str | None = None
    gate: str | None = None
    reservations: tuple[Reservation, ...] = ()
    peak: Peak | None = None
    kv: KVEstimate | None = None
    capacity_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.gate is not None and self.gate not in GATES:
            raise ValueError(f"unknown gate {self.gate!r} for {self.device_id}; known: {', '.join(GATES)}")

    @property
    def reached_budget(self) -> bool:
        """True when the budget arithmetic ran for this device (its reservations and peak are real)."""
        return self.peak is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "selected": self.selected,
            "gate": self.gate,
            "why_not": self.note or "; ".join(r.message for r in self.refusals) or None,
            "refusals": [r.to_dict() for r in self.refusals],
            "reservations": [r.to_dict() for r in self.reservations],
            "peak": self.peak.to_dict() if self.peak is not None else None,
            "kv": _kv_summary(self.kv),
            "capacity_bytes": self.capacity_bytes,
        }


@dataclass(frozen=True)
class Plan:
    """The answer, either way. ``admitted`` is False exactly when ``refusals`` is not empty.

    ``capacity_bytes`` is what admission checked the selected device's pool
    against: the VRAM total for a private pool, the usable host RAM
    (available, clamped by a cgroup limit) for the shared one.

    ``reservations``, ``peak``, ``capacity_bytes`` and ``engine_kwargs`` are
    the selected device's session, so a refused plan (which selects nothing)
    leaves them empty; each candidate's own budget is in its verdict. ``kv``
    describes the request (model and session) more than a device, so a
    refused plan carries the KV estimate of the first candidate that reached
    the budget arithmetic (None when none did).
    """

    admitted: bool
    model_path: str
    session: SessionSpec
    manifest: Manifest | None = None
    selected_device: Device | None = None
    reservations: tuple[Reservation, ...] = ()
    peak: Peak | None = None
    capacity_bytes: int | None = None
    kv: KVEstimate | None = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    refusals: tuple[Refusal, ...] = ()
    fallbacks: tuple[dict[str, Any], ...] = ()
    verdicts: tuple[DeviceVerdict, ...] = ()
    devices_source: str = "probed"
    notes: tuple[str, ...] = ()
    #: Where the model came from (a local path, the Hugging Face cache, the Hub's headers).
    source: ModelSource | None = None
    #: A plan across several ranks (:mod:`.parallel`): the layout, each rank's device and bytes, the
    #: environment the engine needs; None for one device. ``reservations`` and ``peak`` are then rank 0's device's.
    parallel: dict[str, Any] | None = None
    #: Eager or compiled, and why (:mod:`.execution`): the selected device's; None on a refused plan.
    execution: ExecutionMode | None = None

    @property
    def backend(self) -> str | None:
        return self.selected_device.backend if self.selected_device is not None else None

    @property
    def predicted_peak_bytes(self) -> int | None:
        return self.peak.predicted_bytes if self.peak is not None else None

    def selected(self) -> tuple[Device, Manifest]:
        """``(device, manifest)`` of an admitted plan; ValueError for a refused one, which selects nothing."""
        if not self.admitted or self.selected_device is None or self.manifest is None:
            raise ValueError(f"the plan for {self.model_path} was refused: it selected no device to run on")
        return self.selected_device, self.manifest

    def to_dict(self) -> dict[str, Any]:
        return {
            "admitted": self.admitted,
            "model_path": self.model_path,
            "source": self.source.to_dict() if self.source is not None else None,
            "devices_source": self.devices_source,
            "selected_device": self.selected_device.device_id if self.selected_device is not None else None,
            "backend": self.backend,
            "session": self.session.to_dict(),
            "reservations": [r.to_dict() for r in self.reservations],
            "admission_bytes": self.peak.admission_bytes if self.peak is not None else None,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "peak": self.peak.to_dict() if self.peak is not None else None,
            "capacity_bytes": self.capacity_bytes,
            "kv": _kv_summary(self.kv),
            "engine_kwargs": dict(self.engine_kwargs),
            "refusals": [r.to_dict() for r in self.refusals],
            "fallbacks": list(self.fallbacks),
            "devices": [v.to_dict() for v in self.verdicts],
            "manifest": self.manifest.to_dict() if self.manifest is not None else None,
            "notes": list(self.notes),
            "parallel": dict(self.parallel) if self.parallel is not None else None,
            "execution": self.execution.to_dict() if self.execution is not None else None,
        }


@dataclass(frozen=True)
class GraphStagePlan(Plan):
    """A :class:`Plan` for one exported-graph stage.

    ``stage`` says how the stage will run and be judged: the route that
    resolved, the target execution provider, the placement threshold, the
    numeric tolerance and reference, the sample dims, and the host ledger the
    capacity was checked against.
    """

    stage: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "stage": dict(self.stage)}


def _kv_summary(kv: KVEstimate | None) -> dict[str, Any] | None:
    if kv is None:
        return None
    summary = kv.to_dict()
    summary["reserved_rule"] = "vllm"
    return summary
