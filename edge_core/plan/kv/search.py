"""The inverse of a charge: the longest context whose KV charge fits a byte budget."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ...artifact.fields import CONTEXT_FIELDS, opt_int
from ...engines.vllm import VLLM_RULES
from ...engines.vllm_allocator import CPU_ATTN_KERNEL_BLOCK_TOKENS, DEFAULT_MAMBA_SSM_CACHE_DTYPE
from ...errors import UsageError
from ...kv import check_rule
from .charge import charge_bytes, positive, resolve_charge_settings
from .layout import kv_layout, rank_layout

if TYPE_CHECKING:
    from ...engine import EngineRules

#: Ceiling for :func:`max_model_len_for` when the config names no context
#: length: a model with no full-attention layer charges a constant beyond its
#: window, so the search needs an upper end. 16 Mi tokens is past any
#: published context length.
DEFAULT_CEILING_TOKENS = 1 << 24


def max_model_len_for(config: Mapping[str, Any], budget_bytes: int, *, max_num_seqs: int = 1,
                      max_num_batched_tokens: int | None = None, kv_dtype: str = "auto",
                      model_dtype: str = "bfloat16", block_size: int | None = None,
                      rule: str = "vllm", concurrent_batches: int = 1,
                      ceiling_tokens: int | None = None, mamba_cache_dtype: str = "auto",
                      mamba_ssm_cache_dtype: str = DEFAULT_MAMBA_SSM_CACHE_DTYPE,
                      enable_prefix_caching: bool | None = None,
                      kernel_block_tokens: int = CPU_ATTN_KERNEL_BLOCK_TOKENS, tp_size: int = 1,
                      layer_range: tuple[int, int] | None = None, rules: EngineRules = VLLM_RULES) -> int:
    """The largest ``max_model_len`` whose KV charge under ``rule`` fits ``budget_bytes``.

    0 when not even one token fits. The answer is capped at ``ceiling_tokens``
    (default: the config's ``max_position_embeddings``, else
    :data:`DEFAULT_CEILING_TOKENS`), since a model with no full-attention
    layer charges a constant past its window. Every rule is non-decreasing in
    ``max_model_len``, so a binary search is exact. ``rules`` are the engine's,
    as for :func:`~.charge.estimate_kv`.
    """
    check_rule(rule)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
        raise UsageError(f"budget_bytes must be an integer, got {budget_bytes!r}")
    layout = rank_layout(kv_layout(config, tp_size), tp_size, layer_range)
    _, s = resolve_charge_settings(layout, kv_dtype, model_dtype, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                                   concurrent_batches=concurrent_batches, mamba_cache_dtype=mamba_cache_dtype,
                                   mamba_ssm_cache_dtype=mamba_ssm_cache_dtype, enable_prefix_caching=enable_prefix_caching,
                                   kernel_block_tokens=kernel_block_tokens, config=config, rules=rules)
    if ceiling_tokens is None:
        ceiling_tokens = opt_int(config, CONTEXT_FIELDS) or DEFAULT_CEILING_TOKENS
    positive(ceiling_tokens, "ceiling_tokens")

    def fits(tokens: int) -> bool:
        return charge_bytes(layout, rule, tokens, s, rules) <= budget_bytes

    return largest_fitting(fits, ceiling_tokens)


def largest_fitting(fits: Callable[[int], bool], ceiling: int) -> int:
    """The largest ``n`` in ``[1, ceiling]`` with ``fits(n)``, or 0 when not even 1 fits.

    ``fits`` must be monotone (true up to some ``n``, false after): every
    charging rule grows with the context, so a binary search is exact. The one
    bisection both the KV inversion and the planner's context remedy use.
    """
    if ceiling < 1 or not fits(1):
        return 0
    lo, hi = 1, ceiling  # invariant: fits(lo); answer in [lo, hi]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
