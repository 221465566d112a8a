"""What a parallel layout is: its sizes, each device's share, each rank's budget, and what the user pinned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: vLLM's executor backends: its multiprocessing executor (one host, or several nodes joined by
#: ``nnodes``/``node_rank``/``master_addr``), and Ray, chosen explicitly (``--distributed-executor-backend``).
EXECUTOR_MP = "mp"
EXECUTOR_RAY = "ray"
EXECUTORS = (EXECUTOR_MP, EXECUTOR_RAY)
#: The port the head's multi-node executor listens on when the user names none (vLLM's
#: ``--master-port`` default, ``ParallelConfig.master_port``).
MASTER_PORT = 29501


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
class RankBudget:
    """One rank of an admitted or refused parallel layout, for the plan's ``parallel.ranks``."""

    rank: int
    tp_rank: int
    pp_rank: int
    device_id: str
    host: str
    layers: tuple[int, int]
    weight_bytes: int
    kv_cache_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "device_id": self.device_id,
                "host": self.host, "layers": list(self.layers), "weight_bytes": self.weight_bytes,
                "kv_cache_bytes": self.kv_cache_bytes}


@dataclass(frozen=True)
class ParallelRequest:
    """What the user pinned: ``--tensor-parallel-size``, ``--pipeline-parallel-size``, ``--device-ids``,
    ``--distributed-executor-backend`` (None: ``mp``)."""

    tp: int | None = None
    pp: int | None = None
    device_ids: tuple[str, ...] = ()
    executor: str | None = None
    #: ``--nnodes``/``--node-rank``/``--master-addr``/``--master-port``: this host is node ``node_rank`` of
    #: ``nnodes`` joined on vLLM's multi-node executor, and plans only its own ranks.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def pinned(self) -> bool:
        """True when the user asked for more than one rank (or node)."""
        return (self.tp or 1) * (self.pp or 1) > 1 or self.nnodes > 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
                               "device_ids": list(self.device_ids), "executor": self.executor}
        if self.nnodes > 1:
            out.update(nnodes=self.nnodes, node_rank=self.node_rank, master_addr=self.master_addr,
                       master_port=self.master_port or MASTER_PORT)
        return out
