"""How many bytes a session needs: reservations, what must be held, what will be seen, and headroom.

A budget is a list of :class:`Reservation` terms. Each term is **held**
(anonymous memory the session cannot run without) or **reclaimable** (clean
file-backed pages, such as a checkpoint's page cache while its weights are
read, which the kernel drops under pressure). Three numbers come out of it:

* the **held peak** — what the session must have to start and answer; the
  admission is built on it. It is a max, not a sum: the load path (weights +
  the held load transients, gone before the KV pool is sized) and the steady
  state (weights + KV + activations + runtime) never coexist in full.
* the **predicted peak** — what the live gauge (tree PSS) will show, file
  pages included: held terms plus the reclaimable ones, checked against the
  sampled peak after every run. A load reads (its file pages mapped) and then
  processes what it read (its held transients), so the observed load path
  counts the larger of the two phases, not both.
* the **headroom** — external reserve and safety margin, kept free at
  admission and never forecast as usage.

Admission compares held peak + headroom with the pool's capacity.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .devices import EVIDENCE, POOLS

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
    ``reclaimable`` marks clean file-backed pages (a checkpoint's page cache):
    the live gauge shows them, the kernel drops them under pressure, and
    admission does not count them (:func:`combine`).
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
    """The budget's answer for one pool, in bytes.

    ``load_path_bytes`` and ``steady_state_bytes`` are what the live gauge
    (tree PSS) will show, reclaimable file pages included; the ``held_*``
    figures leave those out: only what must be held is admitted against.
    """

    load_path_bytes: int
    steady_state_bytes: int
    headroom_bytes: int
    held_load_path_bytes: int
    held_steady_state_bytes: int

    @property
    def predicted_bytes(self) -> int:
        """The forecast the sampled tree PSS is checked against: max of the two observed paths."""
        return max(self.load_path_bytes, self.steady_state_bytes)

    @property
    def held_bytes(self) -> int:
        """What the session must hold at its peak (file pages left out): max of the two held paths."""
        return max(self.held_load_path_bytes, self.held_steady_state_bytes)

    @property
    def reclaimable_bytes(self) -> int:
        """What the predicted peak shows beyond the held one: file pages the kernel reclaims under pressure."""
        return self.predicted_bytes - self.held_bytes

    @property
    def admission_bytes(self) -> int:
        """What admission checks against capacity: the held peak plus headroom."""
        return self.held_bytes + self.headroom_bytes

    def to_dict(self) -> dict[str, int]:
        return {
            "load_path_bytes": self.load_path_bytes,
            "steady_state_bytes": self.steady_state_bytes,
            "predicted_peak_bytes": self.predicted_bytes,
            "held_load_path_bytes": self.held_load_path_bytes,
            "held_steady_state_bytes": self.held_steady_state_bytes,
            "held_peak_bytes": self.held_bytes,
            "reclaimable_bytes": self.reclaimable_bytes,
            "headroom_bytes": self.headroom_bytes,
            "admission_bytes": self.admission_bytes,
        }


def combine(reservations: Iterable[Reservation], pool: str) -> Peak:
    """Combine the terms of one pool.

    Held load path = weights + held ``load`` terms + terms ``held_during_load``
    (the runtime is up before weights are read). Held steady state = every
    held ``session_weights``, ``session`` and ``request`` term. The observed
    paths add the reclaimable terms: in the load path, reading (the file
    pages, reclaimable ``load`` terms) comes before processing (the held
    ``load`` transients), so it counts the larger of the two; in the steady
    state, all of them. Headroom terms are summed apart.
    """
    base = base_reclaimable = transient = mapped = steady = steady_reclaimable = headroom = 0
    for term in reservations:
        if term.pool != pool:
            continue
        if term.headroom:
            headroom += term.bytes
        elif term.lifetime == "load":
            if term.reclaimable:
                mapped += term.bytes
            else:
                transient += term.bytes
        else:
            during_load = term.lifetime == "session_weights" or term.held_during_load
            if term.reclaimable:
                steady_reclaimable += term.bytes
                base_reclaimable += term.bytes if during_load else 0
            else:
                steady += term.bytes
                base += term.bytes if during_load else 0
    return Peak(load_path_bytes=base + base_reclaimable + max(transient, mapped),
                steady_state_bytes=steady + steady_reclaimable, headroom_bytes=headroom,
                held_load_path_bytes=base + transient, held_steady_state_bytes=steady)
