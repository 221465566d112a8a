"""Give the worker's free heap back to Linux once vLLM CPU has loaded the model: a vLLM general plugin.

After loading, vLLM CPU re-lays every unquantized linear layer out for oneDNN
(``dispatch_cpu_unquantized_gemm``), allocating each packed copy before it
frees the original. Weights under glibc's mmap threshold (which rises as large
blocks are freed, up to 32 MiB) sit side by side in the main heap; their freed
originals become holes in the middle of it, glibc gives memory back only from
the top, and in one layer after another a packed copy finds no hole and grows
the heap. Without tcmalloc (the PyPI build ships none) a small model's worker
keeps a share of its linear weights in such holes, not the same from run to
run, and ``malloc_trim(0)`` right after loading returns nearly all of it
(docs/vllm-cpu-facts.md, "The worker's heap after packing"). Tensors of 32 MiB
or more are always mmapped and returned when freed, so the holes are a small
model's problem, and a budget cannot predict them.

:func:`trim_after_load` runs in every process vLLM starts (the
``vllm.general_plugins`` entry point, like :mod:`._amx`). It imports nothing
of vLLM: a finder on ``sys.meta_path`` waits for vLLM's CPU worker module to
be imported (only worker processes import it; :mod:`._imports`) and then wraps
``CPUWorker.load_model``, so the heap is trimmed after the weights are loaded
and packed, before the worker sizes and allocates its KV cache. Only in an
engine edge started (:mod:`._engine`): plain vLLM in this venv is left alone. On a libc without ``malloc_trim`` it does
nothing.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

from ._engine import in_edge_engine
from ._imports import AfterImport, wrap_once

log = logging.getLogger(__name__)

#: The module that defines vLLM CPU's worker, and the class whose ``load_model`` is wrapped there.
WORKER_MODULE = "vllm.v1.worker.cpu_worker"
WORKER_CLASS = "CPUWorker"
#: Set on the wrapper, so a second install wraps nothing and a probe can tell it is there.
MARK = "_edge_trims_heap"


def trim() -> bool | None:
    """``malloc_trim(0)``: whether glibc gave memory back; None on a libc without it."""
    import ctypes  # in the engine worker only: `edge devices` imports this module too

    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return None


def wrap_worker(module: Any, trimmer: Callable[[], bool | None] = trim) -> bool:
    """Make ``module.CPUWorker.load_model`` trim the heap when it returns; False when there is nothing to wrap."""
    def wrap(load: Callable[..., Any]) -> Callable[..., Any]:
        def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return load(self, *args, **kwargs)
            finally:
                log.debug("edge-cpu: heap trimmed after loading the model: %s", trimmer())

        return load_model

    return wrap_once(getattr(module, WORKER_CLASS, None), "load_model", MARK, wrap)


class WrapOnImport(AfterImport):
    """Finds nothing itself: when ``module`` is imported, wraps its worker's ``load_model`` (:func:`wrap_worker`)."""

    def __init__(self, module: str = WORKER_MODULE, trimmer: Callable[[], bool | None] = trim) -> None:
        super().__init__(module, functools.partial(wrap_worker, trimmer=trimmer))
        self.trimmer = trimmer


def trim_after_load() -> None:
    """Arrange for vLLM CPU's worker to trim its heap after loading (the ``vllm.general_plugins`` entry point);
    nothing in an engine edge did not start (:mod:`._engine`)."""
    if not in_edge_engine():
        return
    try:
        if WORKER_MODULE in sys.modules:
            wrap_worker(sys.modules[WORKER_MODULE])
        elif not any(isinstance(finder, WrapOnImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, WrapOnImport())
    except Exception as exc:  # noqa: BLE001 - a changed vLLM must never stop the engine from starting
        log.debug("edge-cpu: heap trim not installed: %s", exc)
