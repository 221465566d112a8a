"""The core's memory terms of a session: weights, KV cache, activations, and the headroom kept free.

A backend adds its own terms through ``reserve_memory`` (runtime baseline,
CUDA context, graph pool); these are the ones every session has. Estimates
are named module constants with their evidence class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..budget import Reservation
from ..kv import POOL_SOURCES

if TYPE_CHECKING:
    from ..devices import Device
    from ..host import HostFacts
    from ..kv import KVEstimate
    from ..layout import DeviceShare
    from ..manifest import Manifest
    from ..plans import SessionSpec

#: Host RAM kept free for everything that is not this session (the OS, a
#: desktop, other processes growing). Host capacity is already *available*
#: memory, so this only covers growth while the session runs; where a memory
#: cgroup limit binds instead, the host RAM it leaves beyond the session's
#: room is that room already, and only the rest is reserved
#: (:func:`host_reserve_bytes`). Evidence E.
HOST_EXTERNAL_RESERVE_BYTES = 512 << 20
#: What the external reserve's term says of itself.
RESERVE_NOTE = "kept free for the OS and other processes; not forecast as usage"
#: VRAM kept free beside the session: capacity is the card's total, and a
#: display server or another process may hold a few hundred MiB. Evidence E.
VRAM_EXTERNAL_RESERVE_BYTES = 512 << 20
#: Safety margin as a fraction of the held peak (what admission counts): the
#: sampled peak is a lower bound and the runtime terms are estimates. Evidence E.
SAFETY_MARGIN_FRACTION = 0.05
#: Bytes per activation element: vLLM CPU computes norms and logits in fp32.
ACTIVATION_ELEMENT_BYTES = 4


def activation_bytes(config: dict[str, Any], session: SessionSpec, tp_size: int = 1) -> int:
    """Working set of one forward pass (E): hidden states, MLP intermediates and fp32 logits.

    Under tensor parallelism a rank holds its slice of the MLP intermediates
    and of the logits; the hidden states are whole on every rank.
    """
    hidden = int(config.get("hidden_size") or 0)
    intermediate = int(config.get("intermediate_size") or 4 * hidden) // tp_size
    vocab = -(-int(config.get("vocab_size") or 0) // tp_size)
    tokens = session.max_num_batched_tokens or 0
    per_token = 4 * hidden + 3 * intermediate
    logits = session.max_num_seqs * vocab * 2  # logits and their softmax for the sampled positions
    return (tokens * per_token + logits) * ACTIVATION_ELEMENT_BYTES


def core_reservations(device: Device, manifest: Manifest, session: SessionSpec, kv: KVEstimate,
                      share: DeviceShare | None = None) -> list[Reservation]:
    """Weights (D, from the headers), the KV pool (D, vLLM's allocator rule) and activations (E).

    With ``share`` (ranks of a parallel layout on this device) the weights are
    the ranks' slices, and the KV pool and activations are per rank, once for
    each rank the device runs.
    """
    pool = device.memory_pool
    ranks = share.ranks_here if share is not None else 1
    tp = share.layout.tp if share is not None else 1
    of = f" x {ranks} ranks" if ranks > 1 else ""
    weights_note = (f"{manifest.tensor_count} tensors, {manifest.weight_format}, summed from the safetensors headers"
                    if share is None else
                    f"rank{'s' if ranks > 1 else ''} {', '.join(map(str, share.ranks))} of {share.layout.label()}: "
                    "split tensors / TP, replicated ones whole, vocabulary by padded rows, this stage's layers "
                    "(from the safetensors headers)")
    return [
        Reservation(purpose="weights", bytes=manifest.weight_bytes, pool=pool, lifetime="session_weights",
                    evidence="D", note=weights_note),
        Reservation(purpose="kv_cache", bytes=kv.pool_bytes * ranks, pool=pool, lifetime="session", evidence="D",
                    note=kv_note(kv) + f"; pre-allocated at engine start{of}"
                    + (f" (per rank: kv_cache_memory_bytes {kv.pool_bytes})" if share is not None else "")),
        Reservation(purpose="activations", bytes=activation_bytes(manifest.config, session, tp) * ranks, pool=pool,
                    lifetime="request", evidence="E",
                    note=f"{session.max_num_batched_tokens} batched tokens of hidden + MLP state and fp32 "
                    f"logits per forward pass{of}"),
    ]


def kv_note(kv: KVEstimate) -> str:
    """The KV term's note: the pool, why that size, and what it guarantees."""
    what = f"{kv.kv_dtype} ({kv.kv_dtype_bytes} B/elem), vLLM allocator rule, block {kv.block_size}"
    pool = kv.pool
    if pool is None:
        return f"{kv.max_model_len} tokens x {kv.max_num_seqs} seq, {what}"
    blocks = f"{pool.num_blocks:,} blocks of {pool.block_bytes:,} B, " if pool.block_bytes else ""
    return f"one shared pool, {blocks}{POOL_SOURCES[pool.source]}: it {pool.guarantee()}; {what}"


def host_reserve_bytes(host: HostFacts | None) -> tuple[int, str]:
    """The host-RAM reserve for what is not this session, and why that much.

    Other processes' growth can take a session's room only through host RAM.
    Under a memory cgroup whose limit binds (its room is less than the host's
    available RAM), the host RAM beyond that room is already free for them:
    only what of :data:`HOST_EXTERNAL_RESERVE_BYTES` it does not cover is kept.
    """
    if host is None:
        return HOST_EXTERNAL_RESERVE_BYTES, RESERVE_NOTE
    beyond = max(host.mem_available_bytes - host.usable_bytes, 0)
    if not beyond:
        return HOST_EXTERNAL_RESERVE_BYTES, RESERVE_NOTE
    reserve = max(HOST_EXTERNAL_RESERVE_BYTES - beyond, 0)
    return reserve, (f"{HOST_EXTERNAL_RESERVE_BYTES >> 20} MiB kept free for the OS and other processes, less the "
                     f"{beyond / 2**20:,.0f} MiB of available host RAM beyond the cgroup limit's room, which they "
                     "grow into first; not forecast as usage")


def headroom_reservations(device: Device, held_bytes: int, host: HostFacts | None = None) -> list[Reservation]:
    """The external reserve and the safety margin on the held peak: kept free at admission, never forecast as usage."""
    pool = device.memory_pool
    if pool == "host_ram":
        reserve, note = host_reserve_bytes(host)
    else:
        reserve, note = VRAM_EXTERNAL_RESERVE_BYTES, RESERVE_NOTE
    return [
        Reservation(purpose="external_reserve", bytes=reserve, pool=pool, lifetime="session", evidence="E",
                    headroom=True, note=note),
        Reservation(purpose="safety_margin", bytes=int(held_bytes * SAFETY_MARGIN_FRACTION), pool=pool,
                    lifetime="session", evidence="E", headroom=True,
                    note=f"{SAFETY_MARGIN_FRACTION:.0%} of the held peak; sampled peaks are lower bounds"),
    ]


def external_reserve_bytes(terms: tuple[Reservation, ...] | list[Reservation]) -> int:
    """The external-reserve part of a budget's headroom (a property of the host, counted once)."""
    return sum(t.bytes for t in terms if t.headroom and t.purpose == "external_reserve")
