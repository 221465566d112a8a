"""The stage hooks of every backend that runs on vLLM (edge-cpu, edge-cuda), written once.

A backend re-exports these functions from its module
(``from edge_core.vllm_hooks import cancel, start_stage, stop_stage, stream``)
and pluggy registers them as its own hookimpls. Dispatch already goes to the
owning backend only, so the functions need no ownership check. The runtime
(:mod:`edge_core.vllm_stage`, which imports vLLM) loads only when a stage starts.
"""

from __future__ import annotations

from typing import Any

from .hookspecs import hookimpl

__all__ = ["cancel", "start_stage", "stop_stage", "stream"]


@hookimpl
def start_stage(device: Any, plan: Any) -> Any:
    from . import vllm_stage

    return vllm_stage.start(device, plan)


@hookimpl
def stream(stage: Any, request: Any) -> Any:
    from . import vllm_stage

    return vllm_stage.stream(stage, request)


@hookimpl
def cancel(stage: Any, request_id: str) -> bool:
    from . import vllm_stage

    return vllm_stage.cancel(stage, request_id)


@hookimpl
def stop_stage(stage: Any) -> bool:
    from . import vllm_stage

    return vllm_stage.stop(stage)
