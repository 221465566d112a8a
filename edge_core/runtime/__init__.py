"""Run it: an admitted plan becomes a running stage, its memory sampled, cancelled and stopped cleanly.

The runtime layer. vLLM and ONNX Runtime are imported inside functions only,
when a stage starts; each submodule is imported on first use, so ``edge plan``
plans through :mod:`.admission` without psutil or the rest. Every engine start
goes through :class:`StageSession` (:mod:`.session`): ``edge run`` is
:func:`run_session`, ``edge serve`` :func:`.serve.serve_plan`, ``edge accept``
:func:`run_acceptance`, ``edge parity`` :func:`run_parity`; a graph stage,
which runs in this process, :func:`run_graph_stage`.

Modules: :mod:`.admission` (which plan a command runs, admitted on this
host), :mod:`.session`, :mod:`.accept`, :mod:`.parity`, :mod:`.graph_run`
(what a command runs); :mod:`.vllm_stage`, :mod:`.ort_stage` (the two stage
runtimes backends share); :mod:`.env` (the engine's environment),
:mod:`.numa` (NUMA node preparation), :mod:`.stream_run` and
:mod:`.stream_queue` (one request driven through a bounded stream),
:mod:`.processes` (process groups and reaping), :mod:`.reaper` (each
session's marker, and the reaper that ends its engine processes when edge is
killed), :mod:`.measure` (the process-tree memory sampler).
"""

from typing import TYPE_CHECKING

from .._exports import lazy_exports

if TYPE_CHECKING:
    from .accept import ACCEPT_TOKENS, PROMPTS, Criterion, run_acceptance
    from .env import apply_runtime_env, versions
    from .graph_run import NumericGate, compare_outputs, run_graph_stage
    from .measure import DEFAULT_PERIOD_S, MemoryReport, ProcessTreeSampler
    from .parity import first_divergence, run_parity
    from .reaper import SessionReaper, marked_processes
    from .session import (
        COVERED_COUNTERS,
        Consumer,
        Observer,
        RequestResult,
        RunOutcome,
        SilentObserver,
        StageSession,
        memory_record,
        run_session,
    )

__all__ = [
    "ACCEPT_TOKENS",
    "COVERED_COUNTERS",
    "DEFAULT_PERIOD_S",
    "PROMPTS",
    "Consumer",
    "Criterion",
    "MemoryReport",
    "NumericGate",
    "Observer",
    "ProcessTreeSampler",
    "RequestResult",
    "RunOutcome",
    "SessionReaper",
    "SilentObserver",
    "StageSession",
    "apply_runtime_env",
    "compare_outputs",
    "first_divergence",
    "marked_processes",
    "memory_record",
    "run_acceptance",
    "run_graph_stage",
    "run_parity",
    "run_session",
    "versions",
]

__getattr__ = lazy_exports(__name__, {
    "ACCEPT_TOKENS": ".accept", "PROMPTS": ".accept", "Criterion": ".accept", "run_acceptance": ".accept",
    "apply_runtime_env": ".env", "versions": ".env",
    "NumericGate": ".graph_run", "compare_outputs": ".graph_run", "run_graph_stage": ".graph_run",
    "DEFAULT_PERIOD_S": ".measure", "MemoryReport": ".measure", "ProcessTreeSampler": ".measure",
    "first_divergence": ".parity", "run_parity": ".parity",
    "SessionReaper": ".reaper", "marked_processes": ".reaper",
    "COVERED_COUNTERS": ".session", "Consumer": ".session", "Observer": ".session", "RequestResult": ".session",
    "RunOutcome": ".session", "SilentObserver": ".session", "StageSession": ".session",
    "memory_record": ".session", "run_session": ".session",
}, globals())
