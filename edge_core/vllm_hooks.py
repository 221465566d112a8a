"""The stage hooks of every backend that runs on vLLM (edge-cpu, edge-cuda), written once.

A backend re-exports these functions from its module
(``from edge_core.vllm_hooks import cancel, reference_token_ids, start_server, start_stage, stop_stage, stream``)
and pluggy registers them as its own hookimpls. Dispatch already goes to the
owning backend only, so the functions need no ownership check. The runtime
(:mod:`edge_core.runtime.vllm_stage`, which imports vLLM) loads only when a
hook runs.

Part of the backend kit: like :mod:`edge_core.testing`, this module sits on
top of the layers (it calls into the runtime) and nothing in the core imports it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from .hookspecs import hookimpl

if TYPE_CHECKING:
    from .devices import Device
    from .plan import Plan
    from .runtime.vllm_server import VllmServer
    from .runtime.vllm_stage import VllmStage
    from .serving import ServerOptions
    from .stream import DeltaEvent, StageRequest

__all__ = ["cancel", "reference_token_ids", "start_server", "start_stage", "stop_stage", "stream"]


@hookimpl
def start_stage(device: Device, plan: Plan) -> VllmStage:
    from .runtime import vllm_stage

    return vllm_stage.start(device, plan)


@hookimpl
def stream(stage: VllmStage, request: StageRequest) -> Iterator[DeltaEvent]:
    from .runtime import vllm_stage

    return vllm_stage.stream(stage, request)


@hookimpl
def cancel(stage: VllmStage, request_id: str) -> bool:
    from .runtime import vllm_stage

    return vllm_stage.cancel(stage, request_id)


@hookimpl
def stop_stage(stage: VllmStage) -> bool:
    from .runtime import vllm_stage

    return vllm_stage.stop(stage)


@hookimpl
def reference_token_ids(device: Device, plan: Plan, prompts: list[str], max_tokens: int
                        ) -> tuple[list[list[int]], dict[str, Any]]:
    from .runtime import vllm_stage

    return vllm_stage.plain_token_ids(device, plan, prompts, max_tokens)


@hookimpl
def start_server(device: Device, plan: Plan, options: ServerOptions) -> VllmServer:
    from .runtime import vllm_server

    return vllm_server.start(device, plan, options)
