"""What a parallel layout is: how many ranks split each layer and the layers, and the share one device runs.

:class:`Layout` and :class:`DeviceShare` are computed by :mod:`edge_core.plan.parallel`;
a backend is handed a ``DeviceShare`` (``share``) by ``reserve_memory`` and ``gate_plan``.
:class:`NodeAddress` is where one node of a multi-node layout reaches the others, read where it runs
(:mod:`edge_core.runtime.node_address`) and handed to the engine's rules for its ranks' environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: vLLM's executor backends: its multiprocessing executor (one host, or several nodes joined by
#: ``nnodes``/``node_rank``/``master_addr``), and Ray, chosen explicitly (``--distributed-executor-backend``).
EXECUTOR_MP = "mp"
EXECUTOR_RAY = "ray"
EXECUTORS = (EXECUTOR_MP, EXECUTOR_RAY)


@dataclass(frozen=True)
class Layout:
    """How many ranks split each layer (``tp``) and how many stages split the layers (``pp``)."""

    tp: int = 1
    pp: int = 1
    hosts: int = 1
    #: vLLM's executor: ``mp`` (multi-node across hosts) unless Ray was chosen.
    executor: str = EXECUTOR_MP

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def ranks_per_host(self) -> int:
        """vLLM's ``local_world_size``: node ``i`` runs ranks ``i * this`` to ``(i + 1) * this - 1``."""
        return self.world_size // self.hosts

    def label(self) -> str:
        parts = [f"TP {self.tp}"] + ([f"PP {self.pp}"] if self.pp > 1 else [])
        return (" x ".join(parts) + (f" over {self.hosts} hosts" if self.hosts > 1 else "")
                + (" on Ray" if self.executor == EXECUTOR_RAY else ""))

    def flags(self) -> str:
        """The edge command-line flags that pin this layout."""
        out = f"--tensor-parallel-size {self.tp}"
        if self.pp > 1:
            out += f" --pipeline-parallel-size {self.pp}"
        if self.executor != EXECUTOR_MP:
            out += f" --distributed-executor-backend {self.executor}"
        return out


@dataclass(frozen=True)
class DeviceShare:
    """The part of a parallel layout one device runs: its ranks, their layers and their weight bytes.

    A GPU runs one rank; vLLM CPU's ranks share the host's one CPU device, each
    bound to its own cores. ``weight_bytes`` is the sum over ``ranks``;
    ``rank_weight_bytes`` the largest single rank's. ``layers`` is the stage's
    ``[start, end)`` (None when the device holds ranks of several stages).
    Handed to the owning backend's ``reserve_memory`` and ``gate_plan`` as
    ``share``.
    """

    layout: Layout
    ranks: tuple[int, ...]
    weight_bytes: int
    rank_weight_bytes: int
    layers: tuple[int, int] | None
    pp_rank: int | None

    @property
    def ranks_here(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.layout.tp, "pp": self.layout.pp, "ranks": list(self.ranks),
                "pp_rank": self.pp_rank, "layers": list(self.layers) if self.layers else None,
                "weight_bytes": self.weight_bytes, "rank_weight_bytes": self.rank_weight_bytes}


@dataclass(frozen=True)
class NodeAddress:
    """The interface and address one node's ranks use to reach the head: what they bind and advertise.

    Read on the node itself from its route to ``master_ip`` (the head: the
    interface that holds ``master_ip``). ``problem`` says, in words, why there
    is none (the name does not resolve, no route, the head does not hold the
    address, the interface is down); the plan is then refused ``node_unreachable``.
    """

    #: ``--master-addr`` as given, and the IP it resolved to here (None when it did not).
    master_addr: str
    master_ip: str | None
    #: The interface (``eth0``, ``lo``) and this node's address on it; None with a ``problem``.
    interface: str | None = None
    address: str | None = None
    #: True when ``master_ip`` is an address of this host (the head, or a node on the head's host).
    local: bool = False
    problem: str | None = None

    @property
    def loopback(self) -> bool:
        """True when the ranks talk over loopback: every node must then be on this one host."""
        return self.address is not None and (self.address.startswith("127.") or self.address == "::1")

    def describe(self) -> str:
        """``eth0 10.0.0.2`` (the interface and the address), or the problem."""
        return self.problem or f"{self.interface} {self.address}"

    def to_dict(self) -> dict[str, Any]:
        return {"master_addr": self.master_addr, "master_ip": self.master_ip, "interface": self.interface,
                "address": self.address, "local": self.local, "loopback": self.loopback, "problem": self.problem}
