"""The VRAM only a vLLM CUDA session knows about: its CUDA context, its CUDA graphs when compiled, its collectives."""

from __future__ import annotations

from typing import Any

from edge_core import Reservation

from . import _graphs

#: VRAM a CUDA context plus cuBLAS/cuDNN workspaces take in a vLLM worker before
#: any weight: typically 400-600 MiB on Hopper and Blackwell drivers (NVML used
#: bytes after context creation, as reported by vLLM users). Estimate, class E.
CUDA_CONTEXT_BYTES = 600 << 20

#: VRAM NCCL and vLLM's custom all-reduce hold per rank once a session spans several GPUs: NCCL's
#: communicator buffers (NCCL_BUFFSIZE 4 MiB per channel and peer) plus vLLM's custom all-reduce and
#: its registered graph buffers; users report 0.3-0.6 GiB per rank in nvidia-smi. Estimate, class E.
COLLECTIVE_BUFFER_BYTES = 512 << 20


def reservations(session: Any, share: Any = None, manifest: Any = None, sm: int | None = None) -> list[Reservation]:
    terms = [
        Reservation(purpose="cuda_context", bytes=CUDA_CONTEXT_BYTES, pool="vram", lifetime="session",
                    evidence="E", held_during_load=True,
                    note="CUDA context + cuBLAS workspace of the worker process"),
    ]
    if getattr(session, "enforce_eager", True) is False:  # None: not decided yet, nothing captured
        terms += graph_terms(session, manifest, share, sm)
    if share is not None and share.layout.world_size > 1:
        terms.append(Reservation(purpose="collective_buffers", bytes=COLLECTIVE_BUFFER_BYTES, pool="vram",
                                 lifetime="session", evidence="E", held_during_load=True,
                                 note=f"NCCL communicators and vLLM's custom all-reduce of {share.layout.label()}"))
    return terms


def graph_terms(session: Any, manifest: Any, share: Any, sm: int | None) -> list[Reservation]:
    """The CUDA graph pool of a compiled session (per rank on this device), as its two parts."""
    batched = int(session.max_num_batched_tokens or session.max_model_len or 1)
    graphs = _graphs.graph_set(int(session.max_num_seqs), batched, sm)
    layers = share.layers[1] - share.layers[0] if share is not None and share.layers else None
    count, hidden, width = _graphs.model_shape(manifest, layers)
    pool = _graphs.graph_pool_bytes(graphs, layers=count, hidden_size=hidden, dtype_bytes=width)
    ranks = share.ranks_here if share is not None else 1
    sizes = graphs.piecewise
    span = f"{len(sizes)} PIECEWISE sizes {sizes[0]}..{sizes[-1]}" if sizes else "no PIECEWISE size"
    per_rank = f" x {ranks} ranks" if ranks > 1 else ""
    tokens = sum(graphs.piecewise) + sum(graphs.full)
    return [
        Reservation(purpose="cuda_graph_pool", bytes=ranks * pool.pool_bytes, pool="vram",
                    lifetime="session", evidence="E",
                    note=(f"CUDA graph pool: {_graphs.CAPTURE_WORKSPACE_BYTES >> 20} MiB capture workspace + outputs "
                          f"of {span} and {len(graphs.full)} FULL decode sizes ({tokens} tokens x hidden {hidden} x "
                          f"{width} B){per_rank} (docs/vllm-cuda-facts.md)")),
        Reservation(purpose="cuda_graph_nodes", bytes=ranks * pool.node_bytes, pool="vram",
                    lifetime="session", evidence="E",
                    note=(f"the CUDA graphs themselves: {len(sizes)} PIECEWISE sizes x {count + 1} pieces + "
                          f"{len(graphs.full)} FULL x {count} layers, {_graphs.GRAPH_BYTES_PER_LAYER >> 10} KiB "
                          f"per layer and graph{per_rank} (docs/vllm-cuda-facts.md)")),
    ]
