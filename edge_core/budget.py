"""How many bytes a session needs: reservations, predicted peak and headroom.

A budget is a list of :class:`Reservation` terms. Two numbers come out of it:

* the **predicted peak** — what the session will actually use, checked against
  the sampled peak after every run. It is a max, not a sum: the load path
  (weights + load transient, which is gone before the KV pool is sized) and the
  steady state (weights + KV + activations + runtime) never coexist in full.
* the **headroom** — external reserve and safety margin, kept free at
  admission and never forecast as usage.

Admission compares predicted peak + headroom with the pool's capacity.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .devices import EVIDENCE, POOLS
from .errors import UsageError

#: Lifetimes, from longest to shortest.
LIFETIMES = ("session_weights", "session", "load", "request")

MIB = 1 << 20


@dataclass(frozen=True)
class Reservation:
    """One term of a memory budget.

    ``lifetime`` says when the bytes are held: ``load`` only while weights are
    being read (gone before the KV pool is sized), ``session_weights`` and
    ``session`` for the whole session, ``request`` while a request runs.
    ``headroom`` terms are kept free, not predicted as usage.
    """

    purpose: str
    bytes: int
    pool: str
    lifetime: str
    evidence: str
    note: str = ""
    reclaimable: bool = False
    headroom: bool = False
    #: True for ``session`` terms that already exist while weights load (the
    #: runtime's processes, a CUDA context); False for the KV pool and
    #: activations, which are sized after loading.
    held_during_load: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.bytes, int) or self.bytes < 0:
            problems.append(f"bytes must be a non-negative int, got {self.bytes!r}")
        if self.pool not in POOLS:
            problems.append(f"pool {self.pool!r} is not one of {', '.join(POOLS)}")
        if self.lifetime not in LIFETIMES:
            problems.append(f"lifetime {self.lifetime!r} is not one of {', '.join(LIFETIMES)}")
        if self.evidence not in EVIDENCE:
            problems.append(f"evidence {self.evidence!r} is not one of D/B/E")
        if problems:
            raise ValueError(f"invalid reservation {self.purpose!r}: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return {
            "purpose": self.purpose,
            "bytes": self.bytes,
            "pool": self.pool,
            "lifetime": self.lifetime,
            "evidence": self.evidence,
            "reclaimable": self.reclaimable,
            "headroom": self.headroom,
            "held_during_load": self.held_during_load,
            "note": self.note,
        }


@dataclass(frozen=True)
class Peak:
    """The budget's answer for one pool, in bytes."""

    load_path_bytes: int
    steady_state_bytes: int
    headroom_bytes: int

    @property
    def predicted_bytes(self) -> int:
        """The forecast of what the session will use: max of the two paths."""
        return max(self.load_path_bytes, self.steady_state_bytes)

    @property
    def admission_bytes(self) -> int:
        """What admission checks against capacity: prediction plus headroom."""
        return self.predicted_bytes + self.headroom_bytes

    def to_dict(self) -> dict[str, int]:
        return {
            "load_path_bytes": self.load_path_bytes,
            "steady_state_bytes": self.steady_state_bytes,
            "predicted_peak_bytes": self.predicted_bytes,
            "headroom_bytes": self.headroom_bytes,
            "admission_bytes": self.admission_bytes,
        }


def combine(reservations: Iterable[Reservation], pool: str) -> Peak:
    """Combine the terms of one pool.

    Load path = ``load`` terms + weights + terms ``held_during_load`` (the
    runtime is up before weights are read). Steady state = every
    ``session_weights``, ``session`` and ``request`` term. Headroom terms are
    summed apart.
    """
    load = steady = headroom = 0
    for term in reservations:
        if term.pool != pool:
            continue
        if term.headroom:
            headroom += term.bytes
            continue
        if term.lifetime == "load":
            load += term.bytes
        else:
            steady += term.bytes
            if term.lifetime == "session_weights" or term.held_during_load:
                load += term.bytes
    return Peak(load_path_bytes=load, steady_state_bytes=steady, headroom_bytes=headroom)


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
