"""A session's KV cache charge, as the planner reports it: bytes under each charging rule, and how each was had.

:class:`KVEstimate` is computed by :mod:`edge_core.plan.kv` and carried in every
:class:`~edge_core.plans.Plan` (``plan.kv``) a backend is handed; the JSON
names its fields (docs/json.md, ``kv``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import UsageError

#: Charging rules, in the order :class:`KVEstimate` reports them.
RULES = ("flat", "by_layer_type", "vllm")

@dataclass(frozen=True)
class KVEstimate:
    """A session's KV charge under each rule, in bytes, with how each was computed.

    Every ``bytes_*`` total covers ``max_num_seqs`` sequences of
    ``max_model_len`` tokens and includes ``recurrent_state_bytes`` (one
    state per sequence; the ``vllm`` rule charges vLLM's state blocks).
    ``bytes_per_token_flat`` is one token of one sequence in every attention
    layer. ``block_size`` is the attention block vLLM will use -- for a hybrid,
    the platform's ``base_block_size`` enlarged until one attention page holds
    one state page. ``state_dtype_bytes`` is ``mamba_cache_dtype`` (conv
    state), ``ssm_state_dtype_bytes`` ``mamba_ssm_cache_dtype``.
    ``mamba_cache_mode`` is vLLM's (``align`` with prefix caching, else
    ``none``; None without recurrent layers) and ``state_blocks_per_request``
    the state pages one request holds per recurrent layer under it.
    ``rules`` holds one note per figure.
    """

    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int | None
    block_size: int | None
    kv_dtype: str
    kv_dtype_bytes: int
    state_dtype_bytes: int
    layer_counts: dict[str, int]
    windows_tokens: tuple[int, ...]
    bytes_per_token_flat: int
    bytes_flat: int
    bytes_by_layer_type: int
    bytes_vllm: int
    recurrent_state_bytes: int
    evidence: str
    rules: dict[str, str] = field(default_factory=dict)
    base_block_size: int | None = None
    ssm_state_dtype_bytes: int = 0
    mamba_cache_mode: str | None = None
    state_blocks_per_request: int = 0
    #: The rank this estimate is for (:func:`~.layout.rank_layout`): 1 and None for a whole model on one device.
    tp_size: int = 1
    layer_range: tuple[int, int] | None = None
    concurrent_batches: int = 1

    @property
    def tokens(self) -> int:
        """Token slots the session asks for: max_model_len x max_num_seqs."""
        return self.max_model_len * self.max_num_seqs

    def bytes_for(self, rule: str) -> int:
        return {"flat": self.bytes_flat, "by_layer_type": self.bytes_by_layer_type,
                "vllm": self.bytes_vllm}[check_rule(rule)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "base_block_size": self.base_block_size,
            "tokens": self.tokens,
            "kv_dtype": self.kv_dtype,
            "kv_dtype_bytes": self.kv_dtype_bytes,
            "state_dtype_bytes": self.state_dtype_bytes,
            "ssm_state_dtype_bytes": self.ssm_state_dtype_bytes,
            "mamba_cache_mode": self.mamba_cache_mode,
            "state_blocks_per_request": self.state_blocks_per_request,
            "layer_counts": dict(self.layer_counts),
            "windows_tokens": list(self.windows_tokens),
            "bytes_per_token_flat": self.bytes_per_token_flat,
            "bytes_flat": self.bytes_flat,
            "bytes_by_layer_type": self.bytes_by_layer_type,
            "bytes_vllm": self.bytes_vllm,
            "recurrent_state_bytes": self.recurrent_state_bytes,
            "evidence": self.evidence,
            "rules": dict(self.rules),
            "tp_size": self.tp_size,
            "layer_range": list(self.layer_range) if self.layer_range is not None else None,
            "concurrent_batches": self.concurrent_batches,
        }


def check_rule(rule: str) -> str:
    """``rule`` when it is one of :data:`RULES`; :class:`UsageError` otherwise."""
    if rule not in RULES:
        raise UsageError(f"KV rule {rule!r} is not one of {', '.join(RULES)}")
    return rule
