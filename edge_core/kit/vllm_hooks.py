"""The stage hooks of every backend that runs on vLLM (edge-cpu, edge-cuda), written once.

A backend re-exports these functions from its module
(``from edge_core.kit.vllm_hooks import cancel, engine_rules, reference_token_ids, start_server, ...``)
and pluggy registers them as its own hookimpls. Dispatch already goes to the
owning backend only, so the functions need no ownership check. ``engine_rules``
hands the planner vLLM's rules (:mod:`edge_core.engines.vllm`). The runtime
(:mod:`edge_core.runtime.vllm_stage`, which imports vLLM) loads only when a
hook runs.

It also holds the one gate both vLLM backends apply the same way,
:func:`pipeline_refusals`: vLLM's model classes, and which of them implement
``SupportsPP``, are the same source on every platform
(:mod:`edge_core.kit.vllm_source` reads them).

Part of the backend kit: like :mod:`edge_core.testing`, this module sits on
top of the layers (it calls into the runtime) and nothing in the core imports it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..hookspecs import hookimpl

if TYPE_CHECKING:
    from pathlib import Path

    from ..devices import Device
    from ..engine import EngineRules
    from ..layout import DeviceShare
    from ..plans import Plan, Refusal
    from ..runtime.vllm_server import VllmServer
    from ..runtime.vllm_stage import VllmStage
    from ..server import ServerOptions
    from ..stream import DeltaEvent, StageRequest

__all__ = ["architectures", "cancel", "engine_rules", "pipeline_refusals", "reference_token_ids", "start_server", "start_stage",
           "stop_stage", "stream"]

log = logging.getLogger(__name__)


@hookimpl
def engine_rules(device: Device) -> EngineRules:
    # Imported when planning asks, not with the backend: `edge devices` imports every backend.
    from ..engines.vllm import VLLM_RULES

    return VLLM_RULES


@hookimpl
def start_stage(device: Device, plan: Plan) -> VllmStage:
    from ..runtime import vllm_stage

    return vllm_stage.start(device, plan)


@hookimpl
def stream(stage: VllmStage, request: StageRequest) -> Iterator[DeltaEvent]:
    from ..runtime import vllm_stage

    return vllm_stage.stream(stage, request)


@hookimpl
def cancel(stage: VllmStage, request_id: str) -> bool:
    from ..runtime import vllm_stage

    return vllm_stage.cancel(stage, request_id)


@hookimpl
def stop_stage(stage: VllmStage) -> bool:
    from ..runtime import vllm_stage

    return vllm_stage.stop(stage)


@hookimpl
def reference_token_ids(device: Device, plan: Plan, prompts: list[str], max_tokens: int
                        ) -> tuple[list[list[int]], dict[str, Any]]:
    from ..runtime import vllm_stage

    return vllm_stage.plain_token_ids(device, plan, prompts, max_tokens)


@hookimpl
def start_server(device: Device, plan: Plan, options: ServerOptions) -> VllmServer:
    from ..runtime import vllm_server

    return vllm_server.start(device, plan, options)


def architectures(manifest: Any) -> list[str]:
    """The architectures vLLM would look up for this checkpoint, in its order (read by attribute)."""
    first = getattr(manifest, "architecture", None)
    archs = [first] if isinstance(first, str) else []
    config = getattr(manifest, "config", None) or {}
    if getattr(manifest, "text_config_key", None) is None and isinstance(config.get("architectures"), list):
        archs += [a for a in config["architectures"] if isinstance(a, str) and a not in archs]
    return archs


def pipeline_refusals(device: Device, manifest: Any, share: DeviceShare | None, *, root: Path | str | None,
                      models: dict[str, list[str]] | None, label: str) -> list[Refusal]:
    """A pipeline-parallel layout of a model whose vLLM class lacks ``SupportsPP`` (may be empty).

    ``root`` and ``models`` are the vLLM package the plan is checked against
    and its registry (:func:`edge_core.kit.vllm_source.registered_models`);
    ``label`` names that build in the message. Asked only when
    ``share.layout.pp > 1``: the class's module is read then. A class that
    could not be read, or an architecture only vLLM's Transformers fallback
    would serve, is not grounds to refuse; the reason goes to the debug log.
    """
    if share is None or share.layout.pp <= 1:
        return []
    from ..plans import Refusal
    from .vllm_source import PP_INTERFACE, PP_UNSUPPORTED_ERROR, pp_support

    arch = next((a for a in architectures(manifest) if models and a in models), None)
    if arch is None:
        log.debug("pipeline parallelism not checked: %s's registry names none of %s", label, architectures(manifest))
        return []
    found = pp_support(root, models, arch)
    if found.supported is not False:
        if found.supported is None:
            log.debug("pipeline parallelism of %s not checked: %s", arch, found.where)
        return []
    layout = share.layout
    return [Refusal(
        code="parallel_layout_invalid", device_id=device.device_id,
        message=(f"pipeline parallel size {layout.pp}: {label}'s model class for {arch} "
                 f"({found.class_name}, module {found.module}) does not implement {PP_INTERFACE} "
                 f"({found.where}); vLLM would fail at engine start ({PP_UNSUPPORTED_ERROR!r})"),
        remedy=(f"use tensor parallelism only: --tensor-parallel-size {layout.world_size} --pipeline-parallel-size 1 "
                "(the plan lists the sizes the model's heads and vocabulary divide by if that one does not), or a "
                f"model whose vLLM class implements {PP_INTERFACE}"),
        details={"dimension": "pipeline_support", "pipeline_parallel_size": layout.pp,
                 "architecture": arch, "model_class": found.class_name, "module": found.module,
                 "vllm": label, "vllm_source": found.where},
    )]
