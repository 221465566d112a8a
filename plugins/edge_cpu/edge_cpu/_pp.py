"""Give a later pipeline stage its receive buffers in eager mode: a vLLM general plugin, registered by edge-cpu.

vLLM CPU's model runner keeps the buffers a pipeline stage after the
first receives its hidden states into (``intermediate_tensors``) unset until a
dummy forward pass allocates them; only the warm-up runs one, and
``CPUModelRunner.warming_up_model`` returns at once when nothing is compiled
(``CompilationMode.NONE``: eager). Eager pipeline parallelism then dies in the
first request, ``assert self.intermediate_tensors is not None`` in
``sync_and_gather_intermediate_tensors`` (docs/vllm-cpu-facts.md#pipeline-parallel).

:func:`allocate_stage_buffers` (the ``vllm.general_plugins`` entry point, like
:mod:`._heap`) wraps ``CPUModelRunner.load_model`` when vLLM's CPU model
runner module is imported (:mod:`._imports`): after the model is built, a
stage that is not the first allocates the same buffers the dummy pass would
(``make_empty_intermediate_tensors`` for ``max_num_tokens`` in the model's
dtype). vLLM itself is not edited; a runner that already has them, or a
changed vLLM without the method, is left as it is; an engine edge did not
start is left alone (:mod:`._engine`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ._engine import in_edge_engine
from ._imports import patch_on_import, wrap_once

log = logging.getLogger(__name__)

#: vLLM CPU's (V1) model runner module, and the class whose ``load_model`` is wrapped there.
RUNNER_MODULE = "vllm.v1.worker.cpu_model_runner"
RUNNER_CLASS = "CPUModelRunner"
#: Set on the wrapper, so a second install wraps nothing and a probe can tell it is there.
MARK = "_edge_allocates_stage_buffers"


def first_stage() -> bool:
    """Whether this worker runs the first pipeline stage (vLLM's PP group, set up before the model loads)."""
    from vllm.distributed import get_pp_group

    return bool(get_pp_group().is_first_rank)


def allocate(runner: Any, is_first_stage: Callable[[], bool] | None = None) -> bool:
    """Allocate ``runner.intermediate_tensors`` as vLLM's dummy pass does; False when there was nothing to do."""
    if getattr(runner, "intermediate_tensors", None) is not None or (is_first_stage or first_stage)():
        return False
    runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
        batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)
    return True


def wrap_runner(module: Any, is_first_stage: Callable[[], bool] | None = None) -> bool:
    """Make ``module.CPUModelRunner.load_model`` allocate a later stage's buffers; False: nothing to wrap."""
    def wrap(load: Callable[..., Any]) -> Callable[..., Any]:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = load(self, *args, **kwargs)
            try:
                if allocate(self, is_first_stage):
                    log.debug("edge-cpu: pipeline stage buffers allocated for %s tokens", self.max_num_tokens)
            except Exception as exc:  # noqa: BLE001 - a changed vLLM must never stop the engine from starting
                log.debug("edge-cpu: pipeline stage buffers not allocated: %s", exc)
            return out

        return load_model

    return wrap_once(getattr(module, RUNNER_CLASS, None), "load_model", MARK, wrap)


def allocate_stage_buffers() -> None:
    """Arrange for vLLM CPU's model runner to allocate a later stage's buffers (the general plugin); nothing in an
    engine edge did not start (:mod:`._engine`)."""
    if not in_edge_engine():
        return
    try:
        patch_on_import(RUNNER_MODULE, wrap_runner)
    except Exception as exc:  # noqa: BLE001 - a changed vLLM must never stop the engine from starting
        log.debug("edge-cpu: pipeline stage buffers not arranged: %s", exc)
