"""A session's KV cache: its charge under each rule, and the pool the engine is handed.

:class:`KVEstimate` is computed by :mod:`edge_core.plan.kv` and carried in every
:class:`~edge_core.plans.Plan` (``plan.kv``) a backend is handed; its
:class:`KVPool` is the shared, paged pool vLLM allocates once and schedules
every sequence from (:mod:`edge_core.plan.pool` sizes it). The JSON names
their fields (docs/json.md, ``kv`` and ``kv.pool``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .errors import UsageError


class PoolCarver(Protocol):
    """What carves a KV pool: an engine's rules (:meth:`edge_core.engine.EngineRules.carve_pool`)."""

    def carve_pool(self, pool_bytes: int, *, sequence_bytes: int, block_bytes: int, max_num_seqs: int
                   ) -> tuple[int, int, int, float]: ...

#: Charging rules, in the order :class:`KVEstimate` reports them.
RULES = ("flat", "by_layer_type", "vllm")

#: Where a pool's size came from, and how a plan says it.
POOL_SOURCES = {
    "kv_cache_memory": "--kv-cache-memory",
    "max_num_seqs": "sized for max_num_seqs sequences at full context",
    "fit": "the largest that fits beside everything else (max_num_seqs sequences at full context do not)",
    "one_sequence": "the least vLLM starts with: one full-length sequence",
}


@dataclass(frozen=True)
class KVPool:
    """The KV pool one rank's engine allocates (vLLM's ``kv_cache_memory_bytes``), and what it guarantees.

    The engine's rules carve it (:meth:`~edge_core.engine.EngineRules.carve_pool`;
    vLLM's: :func:`edge_core.engines.vllm_allocator.carve_pool`): vLLM cuts
    ``bytes`` into ``num_blocks`` blocks of ``block_bytes`` (one block of
    ``block_size`` tokens across every layer, ``get_kv_cache_config_from_groups``),
    holds one back as the null block, and gives every running sequence the
    blocks it reaches; when the pool runs short it preempts a sequence and
    resumes it later. A sequence at ``max_model_len`` holds
    ``blocks_per_sequence`` blocks (``sequence_bytes``), so the pool holds
    ``full_length_sequences`` of them at once; ``max_num_seqs`` only bounds
    how many run at once, and the rest wait. ``tokens`` and
    ``max_concurrency`` are the figures vLLM logs at start ("KV cache size: N
    tokens", "Maximum concurrency for L tokens per request: Cx", which counts
    the null block). ``block_bytes`` 0 means exact tokens (no block size
    known): the pool is counted in whole sequences.
    """

    bytes: int
    source: str
    max_model_len: int
    max_num_seqs: int
    block_size: int | None
    block_bytes: int
    num_blocks: int
    blocks_per_sequence: int
    sequence_bytes: int
    full_length_sequences: int
    tokens: int
    max_concurrency: float

    def __post_init__(self) -> None:
        if self.source not in POOL_SOURCES:
            raise ValueError(f"unknown KV pool source {self.source!r}; known: {', '.join(POOL_SOURCES)}")

    @property
    def min_bytes(self) -> int:
        """The least pool the engine starts with: one full-length sequence and the null block."""
        return self.sequence_bytes + self.block_bytes

    def guarantee(self) -> str:
        """What the pool promises, in words."""
        seqs = self.full_length_sequences
        held = (f"holds {seqs:,} sequence{'s' if seqs != 1 else ''} of {self.max_model_len:,} tokens at once"
                if self.sequence_bytes else "holds no per-token cache (no attention or state layers)")
        waiting = ("; max_num_seqs bounds how many run at once, and the rest wait (vLLM preempts a sequence and "
                   "resumes it when the pool runs short)") if seqs < self.max_num_seqs else ""
        return f"{held} ({self.tokens:,} tokens; max_num_seqs {self.max_num_seqs}){waiting}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes": self.bytes,
            "source": self.source,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "block_size": self.block_size,
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
            "blocks_per_sequence": self.blocks_per_sequence,
            "sequence_bytes": self.sequence_bytes,
            "min_bytes": self.min_bytes,
            "full_length_sequences": self.full_length_sequences,
            "tokens": self.tokens,
            "max_concurrency": self.max_concurrency,
            "guarantee": self.guarantee(),
        }


@dataclass(frozen=True)
class KVEstimate:
    """A session's KV charge under each rule, in bytes, with how each was computed.

    Every ``bytes_*`` total covers ``max_num_seqs`` sequences of
    ``max_model_len`` tokens and includes ``recurrent_state_bytes`` (one
    state per sequence; the ``vllm`` rule charges vLLM's state blocks): the
    charge of every sequence at full context at once. The engine is handed
    ``pool`` instead, one shared pool (:class:`KVPool`).
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
    #: One sequence at ``max_model_len`` under the ``vllm`` rule (its blocks, state included), per rank.
    sequence_bytes: int = 0
    #: vLLM's bytes per pool block: one block across every layer (its null block); 0 for exact tokens.
    block_bytes: int = 0
    #: The pool the engine is handed (:mod:`edge_core.plan.pool`); None until the planner sized it.
    pool: KVPool | None = None

    @property
    def tokens(self) -> int:
        """Token slots of ``max_num_seqs`` sequences at full context: max_model_len x max_num_seqs."""
        return self.max_model_len * self.max_num_seqs

    @property
    def pool_bytes(self) -> int:
        """Bytes the engine's KV pool takes per rank: the planned pool's, else the ``vllm`` charge."""
        return self.pool.bytes if self.pool is not None else self.bytes_vllm

    def with_pool(self, pool_bytes: int, source: str, rules: PoolCarver) -> KVEstimate:
        """This estimate with a pool of ``pool_bytes``, carved as the engine's ``rules`` carve it."""
        blocks, per_sequence, full, concurrency = rules.carve_pool(
            pool_bytes, sequence_bytes=self.sequence_bytes, block_bytes=self.block_bytes,
            max_num_seqs=self.max_num_seqs)
        return replace(self, pool=KVPool(
            bytes=pool_bytes, source=source, max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            block_size=self.block_size, block_bytes=self.block_bytes, num_blocks=blocks,
            blocks_per_sequence=per_sequence, sequence_bytes=self.sequence_bytes, full_length_sequences=full,
            tokens=int(concurrency * self.max_model_len), max_concurrency=round(concurrency, 2)))

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
            "sequence_bytes": self.sequence_bytes,
            "block_bytes": self.block_bytes,
            "pool": self.pool.to_dict() if self.pool is not None else None,
        }


def check_rule(rule: str) -> str:
    """``rule`` when it is one of :data:`RULES`; :class:`UsageError` otherwise."""
    if rule not in RULES:
        raise UsageError(f"KV rule {rule!r} is not one of {', '.join(RULES)}")
    return rule
