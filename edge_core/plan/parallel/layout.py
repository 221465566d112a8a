"""What a parallel layout is: its sizes, each device's share, each rank's budget, and what the user pinned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...engines.vllm_launch import MASTER_PORT
from ...layout import NodeAddress


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
    #: Not pinned but read where the node runs (admission): the interface and address its ranks use to reach
    #: the head; None when the plan is not for this host (a saved device list) or for one node.
    address: NodeAddress | None = None

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
