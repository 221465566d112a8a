"""Ask Linux for AMX permission in every vLLM process: a vLLM general plugin, registered by edge-cpu.

vLLM CPU's attention kernel runs AMX tile instructions, but nothing in the
engine asks the kernel for permission to use the AMX tile state
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)``); without it a worker can die
with SIGILL (docs/vllm-cpu-facts.md, "AMX tile permission"). vLLM starts its
engine core and workers with spawn, so the request must happen in each of
them: vLLM loads its ``vllm.general_plugins`` entry points in every process it
starts (engine core, worker) before any model code runs, which is where
:func:`request_amx` runs. PyTorch exposes the request as
``torch.cpu._init_amx()``; on a CPU without AMX it returns False and does
nothing.

Unlike edge-cpu's other vLLM plugins it is not gated on an engine edge
started (:mod:`._engine`): it is a fix, not a lever. It changes nothing an
engine computes or holds; without it plain vLLM 0.32 itself dies on this
project's AMX host (the demo with a one-token prompt: SIGILL, exit 132, in
process; the worker dead under the multiprocess executor; measured
2026-12-07, docs/vllm-cpu-facts.md "AMX tile permission"). So it also covers
plain vLLM in this venv — the path ``edge parity`` compares against; ``VLLM_PLUGINS``
without ``edge_cpu_amx`` leaves vLLM as it ships.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def request_amx() -> None:
    """Request AMX tile permission for this process (idempotent; a no-op without AMX or torch)."""
    try:
        import torch

        granted = bool(torch.cpu._init_amx())
    except Exception as exc:  # noqa: BLE001 — a missing torch or a changed private API must not stop vLLM
        log.debug("edge-cpu: AMX permission not requested: %s", exc)
        return
    log.debug("edge-cpu: AMX permission %s", "granted" if granted else "not available on this CPU")
