"""Can it run here, on which device, with how many bytes — and if not, why?

The plan layer: pure and import-cheap (it never imports a runtime, the CLI,
torch or vLLM). :func:`make_plan` reads the artifact and returns a
:class:`Plan` either way — admitted with every reservation and the engine
arguments, or refused with a :class:`Refusal` per reason, each with a remedy
that is never applied silently.

Modules: :mod:`.types` (the answer), :mod:`.planner` (the entry),
:mod:`.checkpoint` (a whole decode session), :mod:`.graph_stage` (one
exported-graph stage), :mod:`.kv` (KV-cache arithmetic), :mod:`.terms` (the
core's memory terms), :mod:`.capacity` (what admission checks against),
:mod:`.remedies`, :mod:`.ledger` (what live sessions on this host already hold),
:mod:`.execution` (eager or compiled: the user's flag, else the backend's default).

The types are imported with the package; everything else on first use
(:mod:`edge_core._exports` says why).
"""

from typing import TYPE_CHECKING

from .._exports import lazy_exports
from .types import (
    REFUSAL_CODES,
    STAGE_ONLY_KINDS,
    DeviceVerdict,
    ExecutionMode,
    GraphStagePlan,
    Plan,
    Refusal,
    SessionSpec,
)

if TYPE_CHECKING:
    from .capacity import capacity_of
    from .checkpoint import DEFAULT_MAX_NUM_BATCHED_TOKENS, engine_kwargs_for, resolve_session
    from .gates import candidate_order
    from .graph_stage import executes_graphs, plan_graph_stage
    from .kv import KVEstimate, estimate_kv, kv_layout, max_model_len_for
    from .planner import load_devices, make_plan, only_backend
    from .remedies import FORMATS_ELSEWHERE
    from .terms import HOST_EXTERNAL_RESERVE_BYTES, SAFETY_MARGIN_FRACTION, VRAM_EXTERNAL_RESERVE_BYTES

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "FORMATS_ELSEWHERE",
    "HOST_EXTERNAL_RESERVE_BYTES",
    "REFUSAL_CODES",
    "SAFETY_MARGIN_FRACTION",
    "STAGE_ONLY_KINDS",
    "VRAM_EXTERNAL_RESERVE_BYTES",
    "DeviceVerdict",
    "ExecutionMode",
    "GraphStagePlan",
    "KVEstimate",
    "Plan",
    "Refusal",
    "SessionSpec",
    "candidate_order",
    "capacity_of",
    "engine_kwargs_for",
    "estimate_kv",
    "executes_graphs",
    "kv_layout",
    "load_devices",
    "make_plan",
    "max_model_len_for",
    "only_backend",
    "plan_graph_stage",
    "resolve_session",
]

__getattr__ = lazy_exports(__name__, {
    "capacity_of": ".capacity",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS": ".checkpoint", "candidate_order": ".gates",
    "engine_kwargs_for": ".checkpoint", "resolve_session": ".checkpoint",
    "executes_graphs": ".graph_stage", "plan_graph_stage": ".graph_stage",
    "KVEstimate": ".kv", "estimate_kv": ".kv", "kv_layout": ".kv", "max_model_len_for": ".kv",
    "load_devices": ".planner", "make_plan": ".planner", "only_backend": ".planner",
    "FORMATS_ELSEWHERE": ".remedies",
    "HOST_EXTERNAL_RESERVE_BYTES": ".terms", "SAFETY_MARGIN_FRACTION": ".terms",
    "VRAM_EXTERNAL_RESERVE_BYTES": ".terms",
}, globals())
