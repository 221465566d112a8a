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
