"""Can this checkpoint run here, on which device, with how many bytes — and if not, why.

The planner walks the candidate devices in a fixed order (private pool before
shared, then larger) through the gates: runnable, whole-session placement,
weight format, the backend's own gates (kernels, the runtime's own capacity
check), and capacity. The first device that passes every gate is selected; the
others are reported with why they were not used. A plan is returned either
way: a refusal is a value with codes, messages and remedies, never an
exception, and no remedy is ever applied silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
)


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

    ``max_model_len`` None means the checkpoint's own context length.
    ``kv_dtype`` is ``auto`` (the model dtype) or an fp8 variant.
    """

    max_model_len: int | None = None
    max_num_seqs: int = 1
    max_num_batched_tokens: int | None = None
    kv_dtype: str = "auto"
    enforce_eager: bool = True

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_dtype": self.kv_dtype,
            "enforce_eager": self.enforce_eager,
        }


# ---------------------------------------------------------------- estimates

#: Host RAM kept free for everything that is not this session (the OS, a
#: desktop, other processes growing). Host capacity is already *available*
#: memory, so this only covers growth while the session runs. Evidence E.
HOST_EXTERNAL_RESERVE_BYTES = 512 << 20
#: VRAM kept free beside the session: capacity is the card's total, and a
#: display server or another process may hold a few hundred MiB. Evidence E.
VRAM_EXTERNAL_RESERVE_BYTES = 512 << 20
#: Safety margin as a fraction of the predicted peak: the sampled peak is a
#: lower bound and the runtime terms are estimates. Evidence E.
SAFETY_MARGIN_FRACTION = 0.05
#: Bytes per activation element: vLLM CPU computes norms and logits in fp32.
ACTIVATION_ELEMENT_BYTES = 4
#: Engine default when the user sets no token budget per forward pass.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

#: Which in-tree backend executes each format, for remedies that point to
#: another virtual environment. (Only the installed backends are asked; this
#: is what edge knows about the ones that are not installed here.)
FORMATS_ELSEWHERE = {
    "dense": ("edge-cpu", "edge-cuda"),
    "compressed-tensors:int8": ("edge-cpu (x86-64)", "edge-cuda (SM 7.5-9.0)"),
    "compressed-tensors:fp8": ("edge-cuda (SM >= 8.9)",),
    "compressed-tensors:w4a16": ("edge-cuda (SM >= 7.5)",),
    "gptq": ("edge-cpu (x86-64)", "edge-cuda"),
    "awq": ("edge-cpu (x86-64)", "edge-cuda"),
    "fp8": ("edge-cuda (SM >= 8.9)",),
    "modelopt_fp4": ("edge-cuda (SM >= 10.0)",),
    "bitsandbytes": ("edge-cuda",),
    "onnx:fp32": ("edge-dml (Windows)",),
    "onnx:fp16": ("edge-dml (Windows)",),
    "onnx:a16w8": ("edge-vitisai (XDNA NPU)",),
    "pt:fp32": ("edge-dml (WSL)",),
    "pt:fp16": ("edge-dml (WSL)",),
}

#: Device kinds that take single exported stages, never a whole decode session.
STAGE_ONLY_KINDS = ("gpu_integrated", "npu")


@dataclass(frozen=True)
class DeviceVerdict:
    """One candidate device and what the gates said about it."""

    device_id: str
    selected: bool
    refusals: tuple[Refusal, ...] = ()
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "selected": self.selected,
            "why_not": self.note or "; ".join(r.message for r in self.refusals) or None,
            "refusals": [r.to_dict() for r in self.refusals],
        }


@dataclass(frozen=True)
class Plan:
    """The answer, either way. ``admitted`` is False exactly when ``refusals`` is not empty."""

    admitted: bool
    model_path: str
    session: SessionSpec
    manifest: Any = None
    selected_device: Any = None
    reservations: tuple[Any, ...] = ()
    peak: Any = None
    capacity_bytes: int | None = None
    kv: Any = None
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    refusals: tuple[Refusal, ...] = ()
    fallbacks: tuple[dict[str, Any], ...] = ()
    verdicts: tuple[DeviceVerdict, ...] = ()
    devices_source: str = "probed"
    notes: tuple[str, ...] = ()

    @property
    def backend(self) -> str | None:
        return self.selected_device.backend if self.selected_device is not None else None

    @property
    def predicted_peak_bytes(self) -> int | None:
        return self.peak.predicted_bytes if self.peak is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "admitted": self.admitted,
            "model_path": self.model_path,
            "devices_source": self.devices_source,
            "selected_device": self.selected_device.device_id if self.selected_device is not None else None,
            "backend": self.backend,
            "session": self.session.to_dict(),
            "reservations": [r.to_dict() for r in self.reservations],
            "peak_bytes": self.peak.admission_bytes if self.peak is not None else None,
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
        }


def _kv_summary(kv: Any) -> dict[str, Any] | None:
    if kv is None:
        return None
    summary = kv.to_dict()
    summary["reserved_rule"] = "vllm"
    return summary


# ---------------------------------------------------------------- planning

def candidate_order(devices: list[Any]) -> list[Any]:
    """Private pool before shared pool, then larger. Not a performance ranking."""
    return sorted(devices, key=lambda d: (d.memory_pool != "vram", -d.memory_bytes, d.device_id))


def resolve_session(manifest: Any, session: SessionSpec) -> SessionSpec:
    """Fill the limits the user left open from the checkpoint; reject impossible ones."""
    from .errors import UsageError

    config = manifest.config
    native = config.get("max_position_embeddings") or config.get("n_positions") or config.get("seq_length")
    max_model_len = session.max_model_len or native
    if not isinstance(max_model_len, int) or max_model_len <= 0:
        raise UsageError(
            f"{manifest.path}: config.json gives no max_position_embeddings; pass --max-model-len"
        )
    if isinstance(native, int) and max_model_len > native:
        raise UsageError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings ({native}); "
            "vLLM would refuse it too"
        )
    if session.max_num_seqs < 1:
        raise UsageError("--max-num-seqs must be at least 1")
    batched = session.max_num_batched_tokens or min(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    if batched < 1:
        raise UsageError("--max-num-batched-tokens must be at least 1")
    return SessionSpec(
        max_model_len=max_model_len,
        max_num_seqs=session.max_num_seqs,
        max_num_batched_tokens=batched,
        kv_dtype=session.kv_dtype,
        enforce_eager=session.enforce_eager,
    )


def _activation_bytes(config: dict[str, Any], session: SessionSpec) -> int:
    """Working set of one forward pass (E): hidden states, MLP intermediates and fp32 logits."""
    hidden = int(config.get("hidden_size") or 0)
    intermediate = int(config.get("intermediate_size") or 4 * hidden)
    vocab = int(config.get("vocab_size") or 0)
    tokens = session.max_num_batched_tokens or 0
    per_token = 4 * hidden + 3 * intermediate
    logits = session.max_num_seqs * vocab * 2  # logits and their softmax for the sampled positions
    return (tokens * per_token + logits) * ACTIVATION_ELEMENT_BYTES


def core_reservations(device: Any, manifest: Any, session: SessionSpec, kv: Any) -> list[Any]:
    from .budget import Reservation

    pool = device.memory_pool
    return [
        Reservation(purpose="weights", bytes=manifest.weight_bytes, pool=pool, lifetime="session_weights",
                    evidence="D", note=f"{manifest.tensor_count} tensors, {manifest.weight_format}, "
                    "summed from the safetensors headers"),
        Reservation(purpose="kv_cache", bytes=kv.bytes_vllm, pool=pool, lifetime="session", evidence="D",
                    note=f"{kv.max_model_len} tokens x {kv.max_num_seqs} seq, {kv.kv_dtype} "
                    f"({kv.kv_dtype_bytes} B/elem), vLLM allocator rule, block {kv.block_size}; "
                    "pre-allocated at engine start"),
        Reservation(purpose="activations", bytes=_activation_bytes(manifest.config, session), pool=pool,
                    lifetime="request", evidence="E",
                    note=f"{session.max_num_batched_tokens} batched tokens of hidden + MLP state and fp32 "
                    "logits per forward pass"),
    ]


def headroom_reservations(device: Any, predicted_bytes: int) -> list[Any]:
    from .budget import Reservation

    pool = device.memory_pool
    reserve = HOST_EXTERNAL_RESERVE_BYTES if pool == "host_ram" else VRAM_EXTERNAL_RESERVE_BYTES
    return [
        Reservation(purpose="external_reserve", bytes=reserve, pool=pool, lifetime="session", evidence="E",
                    headroom=True, note="kept free for the OS and other processes; not forecast as usage"),
        Reservation(purpose="safety_margin", bytes=int(predicted_bytes * SAFETY_MARGIN_FRACTION), pool=pool,
                    lifetime="session", evidence="E", headroom=True,
                    note=f"{SAFETY_MARGIN_FRACTION:.0%} of the predicted peak; sampled peaks are lower bounds"),
    ]


def capacity_of(device: Any, host: Any) -> tuple[int, str]:
    """Total for a private VRAM pool; *available* host RAM (cgroup-clamped) for the shared pool."""
    if device.memory_pool == "vram":
        return device.memory_bytes, f"{device.device_id} VRAM total"
    if host is None:
        return device.memory_available_bytes or device.memory_bytes, "host RAM as recorded in the device list"
    how = "host RAM available"
    if host.cgroup_limit_bytes is not None and host.usable_bytes < host.mem_available_bytes:
        how += ", clamped by the cgroup limit"
    return host.usable_bytes, how


def engine_kwargs_for(manifest: Any, session: SessionSpec, device: Any, kv: Any, peak: Any,
                      capacity_bytes: int) -> dict[str, Any]:
    """vLLM engine arguments derived from the plan; never vLLM's defaults for memory.

    ``gpu_memory_utilization`` is computed on both pools: vLLM's CPU backend
    reads it as a fraction of the NUMA node's RAM, and its 0.92 default asked
    for 28.4 GiB of a 30.9 GiB machine for a 6.55 GiB plan.
    """
    total = device.memory_bytes or capacity_bytes
    fraction = min(max(peak.admission_bytes / total, 0.01), 0.99) if total else 0.9
    kwargs: dict[str, Any] = {
        "model": manifest.path,
        "max_model_len": session.max_model_len,
        "max_num_seqs": session.max_num_seqs,
        "max_num_batched_tokens": session.max_num_batched_tokens,
        "enforce_eager": session.enforce_eager,
        "kv_cache_memory_bytes": kv.bytes_vllm,
        "gpu_memory_utilization": round(fraction + 0.005, 2),
        "seed": 0,
    }
    if manifest.dtype in ("bfloat16", "float16", "float32"):
        kwargs["dtype"] = manifest.dtype
    if session.kv_dtype != "auto":
        kwargs["kv_cache_dtype"] = session.kv_dtype
    return kwargs


def _format_refusal(device: Any, manifest: Any, formats: list[str], backend_remedy: str | None) -> Refusal:
    fmt = manifest.weight_format
    elsewhere = FORMATS_ELSEWHERE.get(fmt, ())
    builds = ", ".join(f for f in formats if not f.startswith(("onnx", "pt:"))) or ", ".join(formats) or "none"
    remedy = backend_remedy or f"{device.device_id} executes {builds}: use a build of this model in one of those formats"
    if elsewhere:
        remedy += f"; {fmt} runs on {' or '.join(elsewhere)} (pip install edge-core <backend> in its own venv)"
    return Refusal(
        code="weight_format_unsupported", device_id=device.device_id,
        message=f"{device.device_id} ({device.name}) cannot execute {fmt} weights",
        remedy=remedy, details={"weight_format": fmt, "device_formats": list(formats)},
    )


def _admission_with_kv(terms: list[Any], pool: str, kv_bytes: int) -> int:
    """Admission bytes of ``terms`` if the KV pool were ``kv_bytes`` (margin recomputed on the new peak)."""
    from dataclasses import replace

    from .budget import peak as combine

    usage = [replace(t, bytes=kv_bytes) if t.purpose == "kv_cache" else t for t in terms if not t.headroom]
    predicted = combine(usage, pool).predicted_bytes
    headroom = sum(t.bytes for t in terms if t.headroom and t.purpose != "safety_margin")
    return predicted + headroom + int(predicted * SAFETY_MARGIN_FRACTION)


def largest_fitting_len(manifest: Any, session: SessionSpec, kv: Any, terms: list[Any], pool: str,
                        capacity: int) -> int:
    """The largest ``max_model_len`` whose whole admission budget fits ``capacity`` (0 if none).

    Found by bisection over the same arithmetic the plan uses (KV by vLLM's
    rule, peak, headroom), so replanning with the answer is admitted.
    """
    from .kv import estimate_kv

    def fits(tokens: int) -> bool:
        kv_bytes = estimate_kv(manifest.config, max_model_len=tokens, max_num_seqs=session.max_num_seqs,
                               max_num_batched_tokens=min(session.max_num_batched_tokens or tokens, tokens),
                               kv_dtype=session.kv_dtype, model_dtype=manifest.dtype or "bfloat16",
                               block_size=kv.block_size).bytes_vllm
        return _admission_with_kv(terms, pool, kv_bytes) <= capacity

    lo, hi = 0, int(session.max_model_len or 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _capacity_refusal(device: Any, manifest: Any, session: SessionSpec, kv: Any, terms: list[Any],
                      peak: Any, capacity: int, how: str) -> Refusal:
    fits = largest_fitting_len(manifest, session, kv, terms, device.memory_pool, capacity)
    weights = manifest.weight_bytes
    if fits:
        remedy = (f"--max-model-len {fits} fits ({capacity / 2**30:.1f} GiB {how}); or use a smaller or "
                  "quantized build, or a device with more memory")
    else:
        remedy = (f"nothing fits even with the shortest context: weights alone are {weights / 2**30:.1f} GiB "
                  f"against {capacity / 2**30:.1f} GiB {how}; use a smaller or quantized build, or a device "
                  "with more memory")
    return Refusal(
        code="budget_exceeds_device", device_id=device.device_id,
        message=(f"needs {peak.admission_bytes / 2**30:.2f} GiB (predicted peak "
                 f"{peak.predicted_bytes / 2**30:.2f} GiB + headroom {peak.headroom_bytes / 2**30:.2f} GiB) but "
                 f"{device.device_id} has {capacity / 2**30:.2f} GiB ({how})"),
        remedy=remedy,
        details={"needed_bytes": peak.admission_bytes, "capacity_bytes": capacity, "max_model_len_that_fits": fits},
    )


def make_plan(model_path: str, *, session: SessionSpec, devices: list[Any], host: Any, registry: Any = None,
              devices_source: str = "probed", digest_weights: bool = False) -> Plan:
    """Walk the gates for every candidate device and return the plan, admitted or refused."""
    from .artifact import read_manifest
    from .errors import ArtifactError

    def refused(refusals: list[Refusal], **extra: Any) -> Plan:
        return Plan(admitted=False, model_path=str(model_path), session=session, refusals=tuple(refusals),
                    devices_source=devices_source, **extra)

    try:
        manifest = read_manifest(model_path, digest_weights=digest_weights)
    except ArtifactError as exc:
        return refused([Refusal(code=exc.code, message=str(exc), remedy=exc.remedy)])
    if manifest.kind == "onnx":
        from .stages import plan_graph_stage

        return plan_graph_stage(manifest, devices=devices, host=host, registry=registry,
                                devices_source=devices_source, session=session)
    plugins = registry.plugins() if registry is not None else []
    if not devices and not plugins and devices_source == "probed":
        from .registry import install_hint

        return refused([Refusal(code="no_backend_installed", message=install_hint(),
                                remedy="pip install edge-cpu (or edge-cuda for NVIDIA GPUs) in this venv")],
                       manifest=manifest)
    try:
        session = resolve_session(manifest, session)
    except ArtifactError as exc:
        return refused([Refusal(code=exc.code, message=str(exc), remedy=exc.remedy)], manifest=manifest)

    notes: list[str] = []
    verdicts: list[DeviceVerdict] = []
    admitted: dict[str, Any] | None = None
    fallbacks: list[dict[str, Any]] = []
    all_refusals: list[Refusal] = []
    for device in candidate_order(devices):
        if device.masked:
            verdicts.append(DeviceVerdict(device.device_id, False, note=device.reason or "masked by policy"))
            continue
        if not device.runnable:
            verdicts.append(DeviceVerdict(device.device_id, False, note=f"not runnable here: {device.reason}"))
            continue
        if device.kind in STAGE_ONLY_KINDS:
            refusal = Refusal(
                code="no_exported_graph", device_id=device.device_id,
                message=(f"{device.device_id} executes exported graphs one stage at a time, never a whole "
                         "autoregressive session"),
                remedy=("export a stage of this model to ONNX (scripts/export_stage.py) and plan it with "
                        "`edge plan --model STAGE.onnx`"),
            )
            verdicts.append(DeviceVerdict(device.device_id, False, (refusal,)))
            all_refusals.append(refusal)
            continue
        try:
            outcome = _plan_on_device(device, manifest, session, host, registry, notes)
        except ArtifactError as exc:  # the config lacks what the KV arithmetic needs: no device can help
            return refused([Refusal(code=exc.code, message=str(exc), remedy=exc.remedy)], manifest=manifest)
        refusals = outcome["refusals"]
        all_refusals.extend(refusals)
        if refusals:
            verdicts.append(DeviceVerdict(device.device_id, False, tuple(refusals)))
            for refusal in refusals:
                fits = refusal.details.get("max_model_len_that_fits") if refusal.details else None
                if refusal.code == "budget_exceeds_device" and fits:
                    fallbacks.append({"kind": "shorter_context", "device_id": device.device_id,
                                      "max_model_len": fits, "approved": False,
                                      "note": "never applied silently: rerun with --max-model-len"})
            continue
        if admitted is None:
            admitted = {"device": device, **outcome}
            verdicts.append(DeviceVerdict(device.device_id, True))
        else:
            fallbacks.append({"kind": "device", "device_id": device.device_id, "backend": device.backend,
                              "approved": True, "note": "passes every gate; used only if asked for"})
            verdicts.append(DeviceVerdict(device.device_id, False, note="a fallback: an earlier candidate was selected"))

    if admitted is None:
        refusals = list(all_refusals)
        if not any(d.runnable for d in devices if not d.masked) or not refusals:
            why = "; ".join(f"{v.device_id}: {v.note}" for v in verdicts if v.note) or "no device was found"
            refusals.insert(0, Refusal(
                code="no_runnable_device", message=f"no device this interpreter drives can take the session ({why})",
                remedy=("install the backend for this machine's hardware in this venv (edge devices lists what "
                        "is missing), or unmask a kind you masked"),
            ))
        return refused(refusals, manifest=manifest, verdicts=tuple(verdicts), fallbacks=tuple(fallbacks),
                       notes=tuple(notes))
    device = admitted["device"]
    return Plan(
        admitted=True, model_path=str(model_path), session=session, manifest=manifest, selected_device=device,
        reservations=tuple(admitted["reservations"]), peak=admitted["peak"], capacity_bytes=admitted["capacity"],
        kv=admitted["kv"], engine_kwargs=engine_kwargs_for(manifest, session, device, admitted["kv"],
                                                           admitted["peak"], admitted["capacity"]),
        fallbacks=tuple(fallbacks), verdicts=tuple(verdicts), devices_source=devices_source, notes=tuple(notes),
    )


def _plan_on_device(device: Any, manifest: Any, session: SessionSpec, host: Any, registry: Any,
                    notes: list[str]) -> dict[str, Any]:
    from .budget import peak as combine
    from .kv import estimate_kv

    owned = registry is not None and registry.owner(device) is not None
    if not owned:
        notes.append(f"{device.device_id}: its backend ({device.plugin or device.backend}) is not installed here; "
                     "planned from the device list alone, without the backend's own gates and memory terms")
    formats = (registry.call_owner(device, "weight_formats") if owned else None) or list(device.weight_formats)
    if manifest.weight_format not in formats:
        remedy = registry.call_owner(device, "format_remedy", weight_format=manifest.weight_format) if owned else None
        return {"refusals": [_format_refusal(device, manifest, formats, remedy)]}
    block = device.extras.get("kv_block_size") if isinstance(device.extras, dict) else None
    kv = estimate_kv(manifest.config, max_model_len=session.max_model_len, max_num_seqs=session.max_num_seqs,
                     max_num_batched_tokens=session.max_num_batched_tokens, kv_dtype=session.kv_dtype,
                     model_dtype=manifest.dtype or "bfloat16", block_size=block)
    terms = core_reservations(device, manifest, session, kv)
    if owned:
        terms += registry.call_owner(device, "reserve_memory", manifest=manifest, session=session, host=host) or []
        refusals = registry.call_owner(device, "gate_plan", manifest=manifest, session=session, host=host,
                                       reservations=terms) or []
        if refusals:
            return {"refusals": list(refusals)}
    predicted = combine(terms, device.memory_pool).predicted_bytes
    terms += headroom_reservations(device, predicted)
    total = combine(terms, device.memory_pool)
    capacity, how = capacity_of(device, host)
    if total.admission_bytes > capacity:
        return {"refusals": [_capacity_refusal(device, manifest, session, kv, terms, total, capacity, how)]}
    return {"refusals": [], "reservations": terms, "peak": total, "capacity": capacity, "kv": kv}
