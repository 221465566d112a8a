"""Loaded weights as plain parameters: vLLM's weight classes cost a Python call on every operator that reads one.

vLLM loads each weight of a quantized layer into a subclass of its own
(``BasevLLMParameter`` and its children, model_executor/parameter.py), which
carries the weight loader and the layout the loader needs, and defines
``__torch_function__``. A tensor with a ``__torch_function__`` of its own
sends every operator it is handed through Python first: vLLM CPU's W4A8
kernel reads three such weights, four layers in each of SmolLM2's 30 blocks,
so 120 Python detours a token. Once the weights are post-processed nothing
loads them again, so each is re-wrapped as a plain ``torch.nn.Parameter`` over
the same storage (no copy: what the engine holds is unchanged, and so are its
numbers). Measured on SmolLM2's W4A16 import, eager, in one process: 47.7
against 51.0 tok/s, token ids identical (docs/benchmarks.md, "An int8 head
for 4-bit checkpoints").

A vLLM general plugin (the ``edge_cpu_params`` entry point), on in every
engine edge starts (:mod:`._engine`) unless ``EDGE_CPU_PLAIN_PARAMETERS`` is
``0``; it wraps the loader's ``process_weights_after_loading`` so the model
is re-wrapped after vLLM post-processed it, before it is compiled or run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ._engine import in_edge_engine
from ._imports import patch_on_import, wrap_once
from ._packing import LOADER_MODULE, PROCESS, enabled

log = logging.getLogger(__name__)

#: The switch: ``0`` keeps vLLM's weight classes.
PLAIN_PARAMETERS_ENV = "EDGE_CPU_PLAIN_PARAMETERS"
_MARK = "_edge_cpu_plain_parameters"
#: What this process did.
COUNTS = {"parameters_plain": 0}


def plain_parameters(model: Any, base: type) -> int:
    """Re-wrap every parameter of ``model`` that is an instance of ``base`` as a plain ``torch.nn.Parameter``
    over the same storage; returns how many."""
    import torch

    replaced = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, base):
                module._parameters[name] = torch.nn.Parameter(param.data, requires_grad=False)
                replaced += 1
    COUNTS["parameters_plain"] += replaced
    return replaced


def wrap_loader(module: Any) -> bool:
    """Make the loader's ``process_weights_after_loading`` re-wrap vLLM's weight classes once it has run."""
    def wrap(process: Callable[..., Any]) -> Callable[..., Any]:
        def process_weights_after_loading(model: Any, *args: Any, **kwargs: Any) -> Any:
            result = process(model, *args, **kwargs)
            try:
                from vllm.model_executor.parameter import BasevLLMParameter

                log.debug("edge-cpu: %d parameters re-wrapped", plain_parameters(model, BasevLLMParameter))
            except Exception as exc:  # noqa: BLE001 - vLLM's own classes still compute the same
                log.debug("edge-cpu: parameters left as vLLM made them: %s", exc)
            return result

        return process_weights_after_loading

    return wrap_once(module, PROCESS, _MARK, wrap)


def install() -> None:
    """The ``vllm.general_plugins`` entry point: wrap the loader in an engine edge started, unless switched off."""
    if not in_edge_engine() or not enabled(PLAIN_PARAMETERS_ENV):
        return
    try:
        patch_on_import(LOADER_MODULE, wrap_loader)
    except Exception as exc:  # noqa: BLE001 - a changed vLLM must never stop the engine from starting
        log.debug("edge-cpu: plain parameters not installed: %s", exc)
