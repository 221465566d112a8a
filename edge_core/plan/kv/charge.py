"""A session's KV charge in bytes, three ways side by side.

* ``flat`` -- every attention layer holds every token (the naive figure);
* ``by_layer_type`` -- a sliding layer holds its window, a chunked layer its
  chunk (the reference figure for hybrids; ``kv.bytes_by_layer_type`` in docs/json.md);
* ``vllm`` -- what the engine's own allocator reserves (an
  :class:`~edge_core.engine.EngineRules`; vLLM's, :mod:`edge_core.engines.vllm`, by default).

Recurrent (Mamba, linear-attention, short-conv) state is per sequence, not per
token, and is added to all three totals.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...artifact.families import ssm_dtype_asked
from ...engine import ChargeSettings
from ...engines.vllm import VLLM_RULES
from ...engines.vllm_allocator import CPU_ATTN_KERNEL_BLOCK_TOKENS, DEFAULT_MAMBA_SSM_CACHE_DTYPE
from ...errors import UsageError
from ...kv import RULES, KVEstimate
from .layout import kv_layout, rank_layout

if TYPE_CHECKING:
    from ...engine import EngineRules, KVLayout

#: Bytes per element for the dtypes a KV cache or model is stored in.
#: ``auto`` as a KV dtype means the model dtype (vLLM's meaning too).
DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "half": 2, "fp16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1,
}


def dtype_bytes(name: str, what: str) -> int:
    """Bytes per element of a dtype name (``torch.`` prefix allowed); :class:`UsageError` otherwise."""
    key = str(name).lower()
    if key.startswith("torch."):
        key = key[len("torch."):]
    if key not in DTYPE_BYTES:
        raise UsageError(f"{what} {name!r} is not one of {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


def positive(value: Any, name: str, *, optional: bool = False) -> None:
    """:class:`UsageError` unless ``value`` is a positive int (or None when ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")


def charge_bytes(layout: KVLayout, rule: str, max_model_len: int, s: ChargeSettings,
                 rules: EngineRules = VLLM_RULES) -> int:
    """Bytes for one rule; the KV pool plus recurrent state for every sequence (``vllm``: the engine's answer)."""
    if rule != "vllm":
        per_seq = 0
        for layer in layout.layers:
            if layer.attention:
                tokens = max_model_len
                if rule == "by_layer_type" and layer.window_tokens:
                    tokens = min(layer.window_tokens, max_model_len)
                per_seq += tokens * layer.elements_per_token * s.kv_bytes
            per_seq += layer.state_bytes(s.cache_bytes, s.ssm_bytes)
        return per_seq * s.max_num_seqs
    return rules.charge_bytes(layout, max_model_len, s)


def resolve_charge_settings(layout: KVLayout, kv_dtype: str, model_dtype: str, *, max_num_seqs: int,
                            max_num_batched_tokens: int | None, block_size: int | None, concurrent_batches: int,
                            mamba_cache_dtype: str, mamba_ssm_cache_dtype: str, enable_prefix_caching: bool | None,
                            kernel_block_tokens: int, config: Mapping[str, Any],
                            rules: EngineRules = VLLM_RULES) -> tuple[str, ChargeSettings]:
    """The KV dtype name and the resolved constants every charge of one session needs (block and mode: ``rules``')."""
    positive(max_num_seqs, "max_num_seqs")
    positive(max_num_batched_tokens, "max_num_batched_tokens", optional=True)
    positive(block_size, "block_size", optional=True)
    positive(concurrent_batches, "concurrent_batches")
    positive(kernel_block_tokens, "kernel_block_tokens")
    model_bytes = dtype_bytes(model_dtype, "model dtype")
    if str(kv_dtype).lower() == "auto":
        resolved, kv_bytes = str(model_dtype).lower(), model_bytes
    else:
        resolved, kv_bytes = str(kv_dtype).lower(), dtype_bytes(kv_dtype, "KV cache dtype")
    # mamba_cache_dtype auto: the model dtype (MambaStateDtypeCalculator,
    # get_kv_cache_torch_dtype). mamba_ssm_cache_dtype auto: what the model's
    # config asks for (NemotronH's mamba_ssm_cache_dtype, default float32;
    # Qwen3.5's mamba_ssm_dtype -- models/config.py), else the conv dtype.
    cache_bytes = model_bytes if str(mamba_cache_dtype).lower() == "auto" else dtype_bytes(
        mamba_cache_dtype, "mamba_cache_dtype")
    ssm_name = str(mamba_ssm_cache_dtype).lower()
    if ssm_name == "auto":
        asked = ssm_dtype_asked(config)
        ssm_bytes = dtype_bytes(asked, "mamba_ssm_cache_dtype") if asked else cache_bytes
    else:
        ssm_bytes = dtype_bytes(mamba_ssm_cache_dtype, "mamba_ssm_cache_dtype")
    block = rules.block_size(layout, block_size, kv_bytes=kv_bytes, cache_bytes=cache_bytes,
                             ssm_bytes=ssm_bytes, kernel_block_tokens=kernel_block_tokens)
    return resolved, ChargeSettings(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    block_size=block, concurrent_batches=concurrent_batches, kv_bytes=kv_bytes,
                                    cache_bytes=cache_bytes, ssm_bytes=ssm_bytes,
                                    mamba_cache_mode=rules.cache_mode(layout, enable_prefix_caching))


def estimate_kv(config: Mapping[str, Any], *, max_model_len: int, max_num_seqs: int = 1,
                max_num_batched_tokens: int | None = None, kv_dtype: str = "auto",
                model_dtype: str = "bfloat16", block_size: int | None = None,
                concurrent_batches: int = 1, mamba_cache_dtype: str = "auto",
                mamba_ssm_cache_dtype: str = DEFAULT_MAMBA_SSM_CACHE_DTYPE,
                enable_prefix_caching: bool | None = None,
                kernel_block_tokens: int = CPU_ATTN_KERNEL_BLOCK_TOKENS, tp_size: int = 1,
                layer_range: tuple[int, int] | None = None, rules: EngineRules = VLLM_RULES) -> KVEstimate:
    """Charge a session's KV cache three ways (see the module docstring).

    ``kv_dtype`` ``auto`` stores KV in ``model_dtype``; fp8 variants take one
    byte. Recurrent state follows vLLM's two settings: ``mamba_cache_dtype``
    (conv state; auto = the model dtype) and ``mamba_ssm_cache_dtype`` (the
    SSM state; default :data:`DEFAULT_MAMBA_SSM_CACHE_DTYPE`, what vLLM CPU
    resolves; ``auto`` = the model config's request, else the conv dtype).
    ``max_num_batched_tokens`` None is charged as ``max_model_len`` in flight
    — vLLM's bound without chunked prefill, and the conservative one; pass the
    engine's value to get its real sliding charge. ``concurrent_batches`` is
    vLLM's ``max_concurrent_batches``: 1 on the CPU build (platforms/cpu.py
    forces async scheduling off), 2 under async scheduling (the CUDA default),
    the pipeline size under pipeline parallelism. ``block_size`` is the
    platform's block (CPU 128); for a hybrid the estimate's ``block_size``
    is the larger one vLLM will pick (:func:`hybrid_block_size`), and passing
    it back gives the same answer. None charges exact tokens: no block
    rounding, no null block. ``enable_prefix_caching`` None is vLLM's default
    (on, except for attention-free models); with it a recurrent layer holds
    ``align``-mode state blocks. ``tp_size`` and ``layer_range`` charge one
    rank of a parallel layout (:func:`rank_layout`); vLLM's
    ``kv_cache_memory_bytes`` is per rank. ``rules`` are the engine's
    (:class:`~edge_core.engine.EngineRules`): its block, state mode and the
    ``vllm`` figure; the defaults above are vLLM CPU's.
    """
    positive(max_model_len, "max_model_len")
    layout = rank_layout(kv_layout(config, tp_size), tp_size, layer_range)
    resolved, s = resolve_charge_settings(layout, kv_dtype, model_dtype, max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                                          concurrent_batches=concurrent_batches, mamba_cache_dtype=mamba_cache_dtype,
                                          mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                                          enable_prefix_caching=enable_prefix_caching,
                                          kernel_block_tokens=kernel_block_tokens, config=config, rules=rules)
    figures = {rule: charge_bytes(layout, rule, max_model_len, s, rules) for rule in RULES}
    sequence_bytes, block_bytes = pool_unit_bytes(layout, max_model_len, s, rules)
    recurrent = sum(l.state_bytes(s.cache_bytes, s.ssm_bytes) for l in layout.layers) * max_num_seqs
    per_token = sum(l.elements_per_token for l in layout.layers if l.attention) * s.kv_bytes
    blocks = max((rules.state_blocks(l.state_formula, s.mamba_cache_mode) for l in layout.layers
                  if l.state_elements), default=0)
    notes = _rule_notes(s, rules, max_num_batched_tokens, block_size, recurrent=bool(recurrent),
                        hybrid=bool(s.block_size and per_token), state_blocks=blocks)
    return KVEstimate(
        max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, block_size=s.block_size,
        kv_dtype=resolved, kv_dtype_bytes=s.kv_bytes, state_dtype_bytes=s.cache_bytes,
        layer_counts=layout.counts(), windows_tokens=layout.windows_tokens(),
        bytes_per_token_flat=per_token, bytes_flat=figures["flat"],
        bytes_by_layer_type=figures["by_layer_type"], bytes_vllm=figures["vllm"],
        recurrent_state_bytes=recurrent, evidence=layout.evidence, rules=notes,
        base_block_size=block_size, ssm_state_dtype_bytes=s.ssm_bytes, mamba_cache_mode=s.mamba_cache_mode,
        state_blocks_per_request=blocks, tp_size=tp_size, layer_range=layer_range,
        concurrent_batches=concurrent_batches, sequence_bytes=sequence_bytes, block_bytes=block_bytes)


def pool_unit_bytes(layout: KVLayout, max_model_len: int, s: ChargeSettings,
                    rules: EngineRules = VLLM_RULES) -> tuple[int, int]:
    """(one full-length sequence, the pool's fixed part) in bytes, read off the engine's own ``vllm`` charge.

    The engine's charge is affine in the number of sequences: every sequence
    at ``max_model_len`` holds the same blocks, and the pool holds one block
    back (vLLM's null block, ``BlockPool``: one block across every layer, the
    pool's unit). So charging one and two sequences gives both.
    """
    one = rules.charge_bytes(layout, max_model_len, replace(s, max_num_seqs=1))
    two = rules.charge_bytes(layout, max_model_len, replace(s, max_num_seqs=2))
    return two - one, 2 * one - two


def _rule_notes(s: ChargeSettings, engine: EngineRules, max_num_batched_tokens: int | None, block_size: int | None, *,
                recurrent: bool, hybrid: bool, state_blocks: int) -> dict[str, str]:
    """One line per figure of :class:`KVEstimate` saying how it was computed."""
    if max_num_batched_tokens is None:
        in_flight = "max_model_len (max_num_batched_tokens not given)"
    else:
        in_flight = f"{s.concurrent_batches} x max_num_batched_tokens {max_num_batched_tokens}"
    rounding = (f"whole blocks of {s.block_size} tokens per layer per sequence, "
                f"+1 block per sliding layer, group padding, plus one null block"
                if s.block_size else "exact tokens (no block_size given), group padding")
    rules = {
        "flat": "every attention layer holds max_model_len tokens per sequence",
        "by_layer_type": "full/MLA layers hold max_model_len tokens; sliding and chunked "
                         "layers hold min(window, max_model_len)",
        "vllm": engine.charge_note(s, in_flight, rounding),
    }
    if recurrent:
        rules["recurrent"] = (
            f"recurrent state per sequence, conv part in {s.cache_bytes} B/elem (mamba_cache_dtype), "
            f"SSM part in {s.ssm_bytes} B/elem (mamba_ssm_cache_dtype), added to every total "
            f"(estimate from the state shapes); vLLM rule: mamba_cache_mode {s.mamba_cache_mode}, "
            f"{state_blocks} state page(s) per request per recurrent layer"
            + (f", each padded to one attention page of the hybrid block {s.block_size} tokens "
               f"(platform block {block_size})" if hybrid else ""))
    return rules
