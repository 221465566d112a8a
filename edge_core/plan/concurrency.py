"""How many full-context sequences fit at once: the concurrency a server's plan can promise.

``--max-num-seqs`` sizes the KV pool (every sequence may reach
``max_model_len``), so a plan admitted with N sequences has room for N
full-context sequences; :func:`full_context_sequences` also answers how many
would fit on the device's capacity, by the plan's own arithmetic (KV by vLLM's
rule, peak, headroom), so the user can raise ``--max-num-seqs`` knowingly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .gates import Owner
from .kv import estimate_kv, largest_fitting
from .remedies import admission_with_kv

if TYPE_CHECKING:
    from ..plans import Plan
    from ..services.registry import Registry

#: Upper end of the search: past any server's useful concurrency on one device.
MAX_SEQUENCES_SEARCHED = 4096


def full_context_sequences(plan: Plan, registry: Registry | None = None) -> int:
    """The most sequences of ``max_model_len`` tokens the selected device's capacity admits (0 if refused).

    The KV pool is charged by the engine rules of the device's backend in ``registry`` (vLLM's without one).
    """
    if not plan.admitted or plan.kv is None or plan.capacity_bytes is None or plan.manifest is None:
        return 0
    device, manifest = plan.selected()
    session, kv, capacity = plan.session, plan.kv, plan.capacity_bytes
    terms, rules = list(plan.reservations), Owner.of(device, registry).rules()

    def fits(seqs: int) -> bool:
        kv_bytes = estimate_kv(manifest.config, max_model_len=int(session.max_model_len or 0), max_num_seqs=seqs,
                               max_num_batched_tokens=session.max_num_batched_tokens, kv_dtype=session.kv_dtype,
                               model_dtype=manifest.dtype or "bfloat16", block_size=kv.block_size,
                               rules=rules).bytes_vllm
        return admission_with_kv(terms, device.memory_pool, kv_bytes) <= capacity

    return largest_fitting(fits, MAX_SEQUENCES_SEARCHED)
