"""Will the NUMA node vLLM CPU binds to hold the KV pool when vLLM checks it — and if a VM has not grown the node yet, can it be made to?

vLLM CPU checks an explicit ``kv_cache_memory_bytes`` against the bound
node's reclaimable memory *at the moment the worker sizes the pool*, after
the weights are loaded. On VMs whose memory comes online on demand the node
reads far less than the machine has, and touching anonymous memory grows it
for good (docs/vllm-cpu-facts.md, "The NUMA node on a VM").

edge-cpu's planner counts memory not yet attributed to any node as available
to the bound node; :func:`prepare_node` makes the runtime honour that before
the engine loads anything: if the node reads short of the target and the host
has unattributed memory, it touches and releases anonymous memory until the
node has grown, re-reads, and raises :class:`~edge_core.errors.StageError` if
the node is still short of what vLLM will certainly check. What it did is a
:class:`NodePrep` for the run record.

Verified with a real run (2026-11-30): ``edge run --max-num-seqs 8500
--max-num-batched-tokens 8704`` on the demo asks for a 16.6 GiB KV pool while
node 0 read 15.92 GiB reclaimable (16.09 GiB total); edge grew the node to
20.34 GiB (19.13 GiB reclaimable) before loading, and vLLM accepted the pool.

edge-cpu's ``prepare_stage`` hook calls it (through
:func:`edge_core.runtime.vllm_stage.prepare_node_for`, with the node vLLM will
bind to) before the memory sampler's baseline, so the touched (and released)
pages are never counted as the session's memory.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StageError
from ..host import parse_meminfo, read_numa_nodes

#: Bytes touched per step: the stop test (re-reading the node's meminfo) runs
#: every ~0.4 s (docs/vllm-cpu-facts.md, "The NUMA node on a VM"), and a
#: 10 GiB deficit is ~40 reads.
CHUNK_BYTES = 128 << 20
#: Host MemAvailable never pushed below this while touching: pre-faulting must
#: not make the host swap or wake the OOM killer (estimate, E).
HOST_FLOOR_BYTES = 1 << 30
#: The target stands this far above the predicted peak: the node check comes
#: after other processes on the host had ~15 s to allocate (estimate, E).
TARGET_SLACK_BYTES = 256 << 20
#: Touch-release rounds at most; a node that did not grow in a round ends the
#: loop early, and a later round allows for the shortfall the previous release
#: showed.
MAX_ROUNDS = 3
#: How far below "reclaimable + touched" the node reads right after a release,
#: so the first round aims this much above the target (estimate, E). Measured
#: on this project's VM: 1.4 GiB after touching 11 GiB (MemFree then crept up
#: ~0.6 GiB over 30 s); in a 16.6 GiB KV-pool run, three rounds aiming at the
#: bare target each fell ~1.5 GiB short (34 GiB touched in 61 s in all).
RELEASE_SHORTFALL_BYTES = 2 << 30

NOT_NEEDED = "not_needed"
PREFAULTED = "prefaulted"
NO_NUMA = "no_numa"


@dataclass(frozen=True)
class NodeReading:
    """One read of a node's meminfo and the host's, in bytes."""

    node_id: int
    total_bytes: int
    reclaimable_bytes: int
    host_total_bytes: int
    host_available_bytes: int
    #: Host MemTotal minus the sum of every node's MemTotal: memory that can
    #: still come online on the node that touches it.
    unattributed_bytes: int

    def to_dict(self) -> dict[str, int]:
        return {
            "node_id": self.node_id,
            "total_bytes": self.total_bytes,
            "reclaimable_bytes": self.reclaimable_bytes,
            "host_total_bytes": self.host_total_bytes,
            "host_available_bytes": self.host_available_bytes,
            "unattributed_bytes": self.unattributed_bytes,
        }


@dataclass(frozen=True)
class NodePrep:
    """What :func:`prepare_node` found and did.

    ``required_bytes`` is what vLLM will certainly find taken or asked for on
    the node when it checks (KV pool + weights); below it the start fails.
    ``target_bytes`` is what pre-faulting aims for (the predicted peak plus
    slack), so the check passes with everything else the session holds.
    """

    action: str
    node_id: int | None
    kv_bytes: int
    required_bytes: int
    target_bytes: int
    before: NodeReading | None
    after: NodeReading | None
    touched_bytes: int = 0
    rounds: int = 0
    seconds: float = 0.0
    note: str = ""
    #: Per round: bytes touched, what the node was expected to read after the
    #: release, and what it read (bytes), with its total.
    round_log: tuple[dict[str, int], ...] = ()
    #: A tensor-parallel plan's other nodes (its ranks bound elsewhere), each prepared the same way.
    other_nodes: tuple[NodePrep, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "node_id": self.node_id,
            "kv_bytes": self.kv_bytes,
            "required_bytes": self.required_bytes,
            "target_bytes": self.target_bytes,
            "before": self.before.to_dict() if self.before else None,
            "after": self.after.to_dict() if self.after else None,
            "touched_bytes": self.touched_bytes,
            "rounds": self.rounds,
            "round_log": [dict(entry) for entry in self.round_log],
            "seconds": round(self.seconds, 3),
            "note": self.note,
            "other_nodes": [other.to_dict() for other in self.other_nodes],
        }


def read_node(node_id: int, root: str | os.PathLike[str] = "/") -> NodeReading | None:
    """Read ``node_id`` and the host's meminfo under ``root``; None if the node is not there."""
    base = Path(root)
    nodes = read_numa_nodes(base)
    node = next((n for n in nodes if n.node_id == node_id), None)
    if node is None:
        return None
    try:
        host = parse_meminfo((base / "proc/meminfo").read_text(encoding="ascii", errors="replace"))
    except OSError:
        host = {}
    host_total = host.get("MemTotal", 0)
    return NodeReading(
        node_id=node_id,
        total_bytes=node.total_bytes,
        reclaimable_bytes=node.reclaimable_bytes,
        host_total_bytes=host_total,
        host_available_bytes=host.get("MemAvailable", host.get("MemFree", 0)),
        unattributed_bytes=max(host_total - sum(n.total_bytes for n in nodes), 0),
    )


class _AnonymousToucher:
    """Touches anonymous memory a chunk at a time and releases it all at once."""

    def __init__(self) -> None:
        self._maps: list[mmap.mmap] = []

    def touch(self, nbytes: int) -> None:
        page = mmap.PAGESIZE
        region = mmap.mmap(-1, nbytes)
        self._maps.append(region)
        # One write per page faults it in; the value does not matter.
        region[::page] = b"\x01" * ((nbytes + page - 1) // page)

    def release(self) -> None:
        for region in self._maps:
            region.close()
        self._maps.clear()


def prepare_node(
    *,
    node_id: int | None,
    kv_bytes: int,
    required_bytes: int,
    target_bytes: int,
    root: str | os.PathLike[str] = "/",
    chunk_bytes: int = CHUNK_BYTES,
    host_floor_bytes: int = HOST_FLOOR_BYTES,
    max_rounds: int = MAX_ROUNDS,
    release_shortfall_bytes: int = RELEASE_SHORTFALL_BYTES,
    toucher: Any = None,
    progress: Callable[[int, int], None] | None = None,
) -> NodePrep:
    """Make sure the bound node reads at least ``required_bytes`` before vLLM starts; aim for ``target_bytes``.

    Raises :class:`StageError` when the node stays below ``required_bytes``:
    vLLM would load the weights and then refuse the KV pool. ``progress`` is
    called with (bytes touched so far, bytes the node is short) while touching.
    """
    started = time.monotonic()
    if node_id is None or read_node(node_id, root) is None:
        return NodePrep(NO_NUMA, None, kv_bytes, required_bytes, target_bytes, None, None,
                        note="no NUMA node information: vLLM checks the host's available memory instead")
    before = read_node(node_id, root)
    assert before is not None  # checked above
    if before.reclaimable_bytes >= target_bytes:
        return NodePrep(NOT_NEEDED, node_id, kv_bytes, required_bytes, target_bytes, before, before,
                        seconds=time.monotonic() - started,
                        note=f"node {node_id} already reads {before.reclaimable_bytes / 2**30:.2f} GiB reclaimable")
    toucher = toucher or _AnonymousToucher()
    current = before
    touched_total = rounds = 0
    overshoot = release_shortfall_bytes
    log: list[dict[str, int]] = []
    while current.reclaimable_bytes < target_bytes and current.unattributed_bytes > 0 and rounds < max_rounds:
        rounds += 1
        grown_from = current.total_bytes
        touched, expected = _touch_round(
            node_id, root, current, toucher, aim_bytes=target_bytes + overshoot, chunk_bytes=chunk_bytes,
            host_floor_bytes=host_floor_bytes, progress=progress, touched_before=touched_total,
            short_bytes=max(target_bytes - before.reclaimable_bytes, 0))
        touched_total += touched
        current = read_node(node_id, root) or current
        log.append({"touched_bytes": touched, "expected_bytes": expected,
                    "reclaimable_bytes": current.reclaimable_bytes, "total_bytes": current.total_bytes})
        # The next round expects the release to fall short as much as this one did.
        overshoot = max(overshoot, expected - current.reclaimable_bytes)
        if touched == 0 or current.total_bytes <= grown_from:
            break  # the node did not grow: more rounds would not help
    if current.reclaimable_bytes < required_bytes:
        raise _short_node(node_id, current, required_bytes, kv_bytes, touched_total)
    return NodePrep(PREFAULTED if touched_total else NOT_NEEDED, node_id, kv_bytes, required_bytes, target_bytes,
                    before, current, touched_total, rounds, time.monotonic() - started, round_log=tuple(log),
                    note=(f"node {node_id} grew from {before.total_bytes / 2**30:.2f} to "
                          f"{current.total_bytes / 2**30:.2f} GiB" if touched_total else
                          f"node {node_id} reads {current.reclaimable_bytes / 2**30:.2f} GiB: enough for the "
                          "KV check, short of the full target, and cannot grow"))


def _touch_round(node_id: int, root: str | os.PathLike[str], current: NodeReading, toucher: Any, *, aim_bytes: int,
                 chunk_bytes: int, host_floor_bytes: int, progress: Callable[[int, int], None] | None,
                 touched_before: int, short_bytes: int) -> tuple[int, int]:
    """Touch chunks until the node is expected to read ``aim_bytes`` or the host nears its floor; then release.

    Returns (bytes touched, reclaimable bytes expected after the release);
    ``progress`` gets the bytes touched over all rounds and ``short_bytes``.
    """
    touched = 0
    expected = current.reclaimable_bytes
    try:
        while True:
            reading = read_node(node_id, root) or current
            # While held, touched pages left the node's free figure; after
            # release they come back on a node that has grown to hold them
            # (not all at once: a later round aims higher by the shortfall).
            expected = reading.reclaimable_bytes + touched
            if expected >= aim_bytes:
                break
            if reading.host_available_bytes - chunk_bytes < host_floor_bytes:
                break
            toucher.touch(chunk_bytes)
            touched += chunk_bytes
            if progress is not None:
                progress(touched_before + touched, short_bytes)
    finally:
        toucher.release()
    return touched, expected


def _short_node(node_id: int, current: NodeReading, required_bytes: int, kv_bytes: int,
                touched_total: int) -> StageError:
    """The node stays below what vLLM's KV check needs: nothing was loaded, and what to do."""
    gib = 2**30
    return StageError(
        f"vLLM CPU checks the KV pool against NUMA node {node_id}, which can give "
        f"{current.reclaimable_bytes / gib:.2f} GiB (MemFree + file pages + SReclaimable, of "
        f"{current.total_bytes / gib:.2f} GiB on the node) but the session needs "
        f"{required_bytes / gib:.2f} GiB there (KV pool {kv_bytes / gib:.2f} GiB + weights) before the pool is "
        f"sized; pre-faulting {touched_total / gib:.2f} GiB of memory "
        f"({'did not grow the node' if touched_total else 'was not possible: no memory left to bring online'}). "
        "Nothing was loaded. Free memory on the host, shorten the context (--max-model-len), or use "
        "--kv-dtype fp8, then plan again"
    )
