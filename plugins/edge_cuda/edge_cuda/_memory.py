"""The VRAM only a vLLM CUDA session knows about: its CUDA context and, when not eager, the graph pool."""

from __future__ import annotations

from typing import Any

from edge_core import Reservation

#: VRAM a CUDA context plus cuBLAS/cuDNN workspaces take in a vLLM worker before
#: any weight: typically 400-600 MiB on Hopper and Blackwell drivers (NVML used
#: bytes after context creation, as reported by vLLM users). Estimate, class E.
CUDA_CONTEXT_BYTES = 600 << 20

#: VRAM vLLM's CUDA graph capture holds when not eager (``enforce_eager=False``):
#: vLLM logs "Graph capturing finished ... took 0.2-1.0 GiB" for 7-70B models at
#: default capture sizes. Estimate, class E; charged only when graphs are captured.
GRAPH_POOL_BYTES = 1 << 30


#: VRAM NCCL and vLLM's custom all-reduce hold per rank once a session spans several GPUs: NCCL's
#: communicator buffers (NCCL_BUFFSIZE 4 MiB per channel and peer) plus vLLM's custom all-reduce and
#: its registered graph buffers; users report 0.3-0.6 GiB per rank in nvidia-smi. Estimate, class E.
COLLECTIVE_BUFFER_BYTES = 512 << 20


def reservations(session: Any, share: Any = None) -> list[Reservation]:
    terms = [
        Reservation(purpose="cuda_context", bytes=CUDA_CONTEXT_BYTES, pool="vram", lifetime="session",
                    evidence="E", held_during_load=True,
                    note="CUDA context + cuBLAS workspace of the worker process"),
    ]
    if not getattr(session, "enforce_eager", True):
        terms.append(Reservation(purpose="graph_pool", bytes=GRAPH_POOL_BYTES, pool="vram", lifetime="session",
                                 evidence="E", note="CUDA graph capture pool (enforce_eager=False)"))
    if share is not None and share.layout.world_size > 1:
        terms.append(Reservation(purpose="collective_buffers", bytes=COLLECTIVE_BUFFER_BYTES, pool="vram",
                                 lifetime="session", evidence="E", held_during_load=True,
                                 note=f"NCCL communicators and vLLM's custom all-reduce of {share.layout.label()}"))
    return terms
