"""How many full-context sequences a device's KV pool could hold at once: what a server's plan can promise.

The plan's pool (:mod:`.pool`) states how many sequences at ``max_model_len``
it holds at once (``kv.pool.full_length_sequences``); ``--max-num-seqs`` only
bounds how many run at once, and the rest wait. :func:`full_context_sequences`
answers how many the device's capacity could hold with the largest pool that
fits beside everything else, by the plan's own arithmetic (vLLM's blocks,
peak, headroom), so the user can raise ``--max-num-seqs`` or
``--kv-cache-memory`` knowingly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .gates import Owner
from .pool import largest_pool

if TYPE_CHECKING:
    from ..plans import Plan
    from ..services.registry import Registry

#: Upper end of the search: past any server's useful concurrency on one device.
MAX_SEQUENCES_SEARCHED = 4096


def full_context_sequences(plan: Plan, registry: Registry | None = None) -> int:
    """The most sequences of ``max_model_len`` tokens one pool on the selected device's capacity holds (0 if refused).

    The pool is carved by the engine rules of the device's backend in ``registry`` (vLLM's without one).
    """
    if not plan.admitted or plan.kv is None or plan.capacity_bytes is None or plan.manifest is None:
        return 0
    device, _ = plan.selected()
    kv = plan.kv
    most = kv.sequence_bytes * MAX_SEQUENCES_SEARCHED + kv.block_bytes
    pool = largest_pool(kv, list(plan.reservations), device.memory_pool, plan.capacity_bytes, most_bytes=most)
    fitted = kv.with_pool(pool, "fit", Owner.of(device, registry).rules()).pool if pool else None
    return min(fitted.full_length_sequences, MAX_SEQUENCES_SEARCHED) if fitted is not None else 0
