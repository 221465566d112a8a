"""How large a session's KV pool is, and how long a context it holds: vLLM's shared, paged pool, sized before loading.

vLLM allocates one KV pool per rank at start and schedules every sequence
from it: it needs room for one sequence at ``max_model_len`` (else it refuses
to start, ``check_enough_kv_cache_memory``), and when running sequences
outgrow the pool it preempts one and resumes it later. So the pool is not
``max_num_seqs`` x ``max_model_len``; it is, in order:

* the user's ``--kv-cache-memory`` (vLLM's ``kv_cache_memory_bytes``), as given;
* else the pool that holds ``max_num_seqs`` sequences at full context, where it fits;
* else the largest that fits beside everything else (whole blocks), never
  below one full-length sequence: where not even that fits, the plan is
  refused (:mod:`.remedies` names the context that would fit).

``--max-model-len auto`` is vLLM's auto-fit (``_auto_fit_max_model_len``:
the longest context one sequence can hold in the pool, the null block held
back) done before anything loads: on the user's pool, else on the largest
pool that fits when the model's own context does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..budget import combine
from .kv import largest_fitting, max_model_len_for
from .terms import SAFETY_MARGIN_FRACTION

if TYPE_CHECKING:
    from ..budget import Reservation
    from ..engine import EngineRules
    from ..kv import KVEstimate
    from ..manifest import Manifest
    from ..plans import SessionSpec


def admission_with_kv(terms: list[Reservation], pool: str, kv_bytes: int) -> int:
    """Admission bytes of ``terms`` if the KV term were ``kv_bytes`` (margin recomputed on the new held peak)."""
    usage = [replace(t, bytes=kv_bytes) if t.purpose == "kv_cache" else t for t in terms if not t.headroom]
    held = combine(usage, pool).held_bytes
    headroom = sum(t.bytes for t in terms if t.headroom and t.purpose != "safety_margin")
    return held + headroom + int(held * SAFETY_MARGIN_FRACTION)


def pool_unit(kv: KVEstimate) -> int:
    """The step a pool grows by: one block (vLLM's), or one whole sequence where no block size is known."""
    return kv.block_bytes or kv.sequence_bytes


def largest_pool(kv: KVEstimate, terms: list[Reservation], memory_pool: str, capacity: int, *, ranks: int = 1,
                 least_bytes: int | None = None, most_bytes: int | None = None, unit: int | None = None) -> int:
    """The largest pool per rank, in whole ``unit`` s (:func:`pool_unit`), whose admission fits ``capacity``; 0 if none.

    Searched from ``least_bytes`` (default: one full-length sequence and the
    null block, the least vLLM starts with) up to ``most_bytes`` (default:
    ``max_num_seqs`` sequences, the pool the session asks for). ``ranks`` is
    how many ranks' pools the device holds: the KV term is that many pools.
    """
    unit = pool_unit(kv) if unit is None else unit
    if unit <= 0:
        return 0
    least = -(-(kv.sequence_bytes + kv.block_bytes if least_bytes is None else least_bytes) // unit)
    most = (kv.bytes_vllm if most_bytes is None else most_bytes) // unit
    if most < least:
        return 0

    def fits(step: int) -> bool:
        return admission_with_kv(terms, memory_pool, (least + step - 1) * unit * ranks) <= capacity

    steps = largest_fitting(fits, most - least + 1)
    return (least + steps - 1) * unit if steps else 0


def fitted_context(manifest: Manifest, session: SessionSpec, kv: KVEstimate, pool_bytes: int,
                   rules: EngineRules) -> int:
    """The longest ``max_model_len`` (at most the session's) one sequence can hold in ``pool_bytes``; 0 if none.

    vLLM's auto-fit (``_estimate_max_model_len_from_groups``): the largest
    length whose one request's blocks fit the pool less its null block, by
    binary search over the same allocator rule the plan charges with.
    """
    return max_model_len_for(manifest.config, pool_bytes, max_num_seqs=1,
                             max_num_batched_tokens=session.max_num_batched_tokens, kv_dtype=session.kv_dtype,
                             model_dtype=manifest.dtype or "bfloat16", block_size=kv.base_block_size,
                             concurrent_batches=kv.concurrent_batches, ceiling_tokens=int(session.max_model_len or 0),
                             tp_size=kv.tp_size, layer_range=kv.layer_range, rules=rules)


def with_context(session: SessionSpec, max_model_len: int) -> SessionSpec:
    """``session`` at ``max_model_len``, its tokens per forward pass no more than that."""
    batched = min(session.max_num_batched_tokens or max_model_len, max_model_len)
    return replace(session, max_model_len=max_model_len, max_num_batched_tokens=batched)


def choose_pool(kv: KVEstimate, session: SessionSpec, passes: Callable[[KVEstimate], bool],
                largest: Callable[[KVEstimate], int], rules: EngineRules) -> tuple[KVEstimate, bool]:
    """``kv`` with the pool this session gets, and whether the pool had to be smaller than it asks for.

    ``passes(kv)`` says whether a plan with ``kv``'s pool passes every gate;
    ``largest(kv)`` is the largest pool whose admission fits (0: not even one
    full-length sequence). The user's pool is taken as given (its gates judge
    it); otherwise the ``max_num_seqs`` pool where it passes, else the
    largest that fits and passes (a backend's gate on the pool, vLLM CPU's
    NUMA node, may cut it further), else the least one when not even that
    fits (the gates refuse it). A plan refused even at the least pool keeps
    the pool it asked for: no smaller pool would mend it.
    """
    if session.kv_cache_memory_bytes is not None:
        return kv.with_pool(session.kv_cache_memory_bytes, "kv_cache_memory", rules), False
    asked = kv.with_pool(kv.bytes_vllm, "max_num_seqs", rules)
    if passes(asked):
        return asked, False
    least = kv.with_pool(kv.sequence_bytes + kv.block_bytes, "one_sequence", rules)
    fit = largest(kv)
    if not fit:
        return least, True
    fitted = kv.with_pool(fit, "fit", rules)
    if passes(fitted):
        return fitted, True
    if not passes(least):
        return asked, False  # refused even at the least pool: no smaller pool mends what refused it
    unit = pool_unit(kv)
    lo = least.pool.bytes if least.pool is not None else 0
    steps = largest_fitting(lambda step: passes(kv.with_pool(lo + (step - 1) * unit, "fit", rules)),
                            (fit - lo) // unit + 1)
    return kv.with_pool(lo + (steps - 1) * unit, "fit", rules), True
