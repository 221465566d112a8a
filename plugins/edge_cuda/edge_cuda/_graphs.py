"""vLLM CUDA's default execution mode, and what its CUDA graphs hold in VRAM.

vLLM CUDA compiles the model with torch.compile and captures CUDA graphs
unless told ``enforce_eager`` (its ``CompilationConfig`` default,
``cudagraph_mode=FULL_AND_PIECEWISE``). :func:`capture_sizes` is vLLM's
default capture list for a session (``config/vllm.py``,
``VllmConfig._set_cudagraph_sizes``, without speculative decoding);
:func:`graph_pool_bytes` is the VRAM those graphs keep, as terms of what
drives it, calibrated against published vLLM logs (docs/vllm-cuda-facts.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: vLLM's default ceiling on a captured batch, in tokens: 512, or 1024 on data-center Blackwell
#: (``current_platform.is_device_capability_family(100)``: SM 10.x).
DEFAULT_MAX_CAPTURE = 512
BLACKWELL_DC_MAX_CAPTURE = 1024

#: What stays in the graph pool per token of every captured size, in hidden-size vectors of the model dtype
#: (each size's own static buffers at the compiled pieces' boundaries). Fit: 5 (docs/vllm-cuda-facts.md,
#: "Calibration against published logs"). Estimate, class E.
VECTORS_PER_CAPTURED_TOKEN = 5
#: What one instantiated CUDA graph keeps per layer it covers, whatever the batch (its kernel nodes and their
#: parameters in device memory): a PIECEWISE size is ``layers + 1`` graphs of one layer each, a FULL size one
#: graph over every layer. Fit: 144 KiB (same section). Estimate, class E.
GRAPH_BYTES_PER_LAYER = 144 << 10
#: What a capture holds whatever it captures: the capture stream's own cuBLAS/cuBLASLt workspaces and the
#: pool's first segments. Fit: 80 MiB (same section). Estimate, class E.
CAPTURE_WORKSPACE_BYTES = 80 << 20


@dataclass(frozen=True)
class GraphSet:
    """The CUDA graphs vLLM captures for one session: PIECEWISE sizes (every capture size) and FULL decode sizes."""

    piecewise: tuple[int, ...]
    full: tuple[int, ...]


def max_capture_size(max_num_seqs: int, max_num_batched_tokens: int, sm: int | None) -> int:
    """vLLM's ``max_cudagraph_capture_size`` default: ``min(2 * max_num_seqs, 512 or 1024, max_num_batched_tokens)``."""
    ceiling = BLACKWELL_DC_MAX_CAPTURE if sm is not None and sm // 10 == 10 else DEFAULT_MAX_CAPTURE
    return min(max_num_seqs * 2, ceiling, max_num_batched_tokens)


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int, sm: int | None = None) -> tuple[int, ...]:
    """vLLM's default ``cudagraph_capture_sizes`` (``performance_mode="balanced"``, one token per decode).

    1, 2, 4, then every 8 below 256, then every 16 up to the ceiling; plus
    ``max_num_batched_tokens`` and ``max_num_seqs`` when they fit under it.
    """
    top = max_capture_size(max_num_seqs, max_num_batched_tokens, sm)
    sizes = [i for i in (1, 2, 4) if i <= top]
    if top >= 8:
        sizes += range(8, min(top + 1, 256), 8)
    if top >= 256:
        sizes += range(256, top + 1, 16)
    if max_num_batched_tokens <= top:
        sizes.append(max_num_batched_tokens)
    if max_num_seqs <= top:
        sizes.append(max_num_seqs)
    return tuple(sorted({s for s in sizes if s <= max_num_batched_tokens}))


def graph_set(max_num_seqs: int, max_num_batched_tokens: int, sm: int | None = None) -> GraphSet:
    """PIECEWISE graphs at every capture size; FULL (decode) graphs at the sizes a decode batch can take."""
    sizes = capture_sizes(max_num_seqs, max_num_batched_tokens, sm)
    return GraphSet(piecewise=sizes, full=tuple(s for s in sizes if s <= max_num_seqs))


@dataclass(frozen=True)
class GraphPool:
    """What a session's CUDA graphs keep, in bytes: the pool (workspace and per-size outputs) and the graphs' own."""

    pool_bytes: int
    node_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.pool_bytes + self.node_bytes


def graph_pool_bytes(graphs: GraphSet, *, layers: int, hidden_size: int, dtype_bytes: int,
                     workspace_bytes: int = CAPTURE_WORKSPACE_BYTES, bytes_per_layer: int = GRAPH_BYTES_PER_LAYER,
                     vectors_per_token: int = VECTORS_PER_CAPTURED_TOKEN) -> GraphPool:
    """What ``graphs`` keep on one rank once captured (every rank of a TP/PP layout captures the same set).

    pool: ``workspace_bytes`` plus, for every captured size of either kind,
    size x hidden x dtype x ``vectors_per_token`` (the hidden state is whole
    on every TP rank). graphs: every PIECEWISE size is ``layers + 1`` graphs,
    every FULL size one graph over all layers, ``bytes_per_layer`` per layer
    each covers. Nothing when no size is captured. The defaults are the
    module constants; bench/cuda_graph_calibration.py passes others to fit them.
    """
    if not graphs.piecewise and not graphs.full:
        return GraphPool(pool_bytes=0, node_bytes=0)
    tokens = sum(graphs.piecewise) + sum(graphs.full)
    pool = workspace_bytes + tokens * hidden_size * dtype_bytes * vectors_per_token
    nodes = (len(graphs.piecewise) * (layers + 1) + len(graphs.full) * layers) * bytes_per_layer
    return GraphPool(pool_bytes=pool, node_bytes=nodes)


def model_shape(manifest: Any, layers: int | None = None) -> tuple[int, int, int]:
    """(layers, hidden_size, dtype bytes) of the text model, read by attribute from ``manifest.config``."""
    config = getattr(manifest, "config", None) or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = int(text.get("hidden_size") or text.get("d_model") or text.get("n_embd") or 0)
    count = layers if layers is not None else int(text.get("num_hidden_layers") or text.get("n_layer") or 0)
    dtype = str(getattr(manifest, "dtype", None) or text.get("torch_dtype") or "bfloat16")
    return count, hidden, 4 if dtype in ("float32", "fp32") else 2
