"""The stream/cancel/stop hooks of every backend that runs graph stages on ONNX Runtime, written once.

edge-dml and edge-vitisai differ only in which route and execution provider a
stage of theirs carries, so each builds its three hooks with
:func:`stage_hooks`. A hook answers None for a stage it does not own. The
runtime (:mod:`edge_core.runtime.ort_stage`) is imported only when a hook runs.
Part of the backend kit, on top of the layers like :mod:`edge_core.kit.vllm_hooks`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..hookspecs import hookimpl

__all__ = ["stage_hooks"]


def stage_hooks(backend: str, target_provider: str) -> tuple[Callable[..., Any], ...]:
    """Return ``(stream, cancel, stop_stage)`` hookimpls for stages of ``backend`` on ``target_provider``."""

    def ours(stage: Any) -> bool:
        return getattr(stage, "backend", None) == backend and getattr(stage, "target_provider", None) == target_provider

    @hookimpl
    def stream(stage: Any, request: Any) -> Any:
        if not ours(stage):
            return None
        from ..runtime import ort_stage

        return ort_stage.stream(stage, request)

    @hookimpl
    def cancel(stage: Any, request_id: str) -> bool | None:
        if not ours(stage):
            return None
        from ..runtime import ort_stage

        return ort_stage.cancel(stage, request_id)

    @hookimpl
    def stop_stage(stage: Any) -> bool | None:
        if not ours(stage):
            return None
        from ..runtime import ort_stage

        return ort_stage.stop(stage)

    return stream, cancel, stop_stage
