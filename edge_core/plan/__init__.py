"""Can it run here, on which device, with how many bytes — and if not, why?

The plan layer: pure and import-cheap (it never imports a runtime, the CLI,
torch or vLLM) and does no I/O: :func:`plan_artifact` is handed a read artifact
(its :class:`~edge_core.manifest.Manifest`), device facts and a ledger view,
and returns a :class:`~edge_core.plans.Plan` either way — admitted with every reservation and the engine
arguments, or refused with a :class:`~edge_core.plans.Refusal` per reason, each with a remedy
that is never applied silently.

The answer's types are the contract's (:mod:`edge_core.plans`). Modules: :mod:`.planner` (the entry),
:mod:`.decode` (a whole decode session), :mod:`.graph_stage` (one
exported-graph stage), :mod:`.kv` (KV-cache arithmetic), :mod:`.terms` (the
core's memory terms), :mod:`.capacity` (what admission checks against),
:mod:`.pool` (the KV pool's size and ``--max-model-len auto``), :mod:`.remedies`,
:mod:`.committed` (what live sessions on this host already hold),
:mod:`.execution` (eager or compiled: the user's flag, else the backend's default).

Backends take the types they are handed from the contract, so nothing on the
way to ``edge devices`` imports this package; ``edge plan`` needs all of it
but :mod:`.graph_stage`, imported from its module when a graph is planned.
"""

from .capacity import capacity_of
from .decode import DEFAULT_MAX_NUM_BATCHED_TOKENS, engine_kwargs_for, resolve_session
from .gates import candidate_order
from .kv import estimate_kv, kv_layout, max_model_len_for
from .planner import only_backend, only_devices, plan_artifact, unreadable_artifact
from .remedies import FORMATS_ELSEWHERE
from .terms import HOST_EXTERNAL_RESERVE_BYTES, SAFETY_MARGIN_FRACTION, VRAM_EXTERNAL_RESERVE_BYTES

__all__ = [
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "FORMATS_ELSEWHERE",
    "HOST_EXTERNAL_RESERVE_BYTES",
    "SAFETY_MARGIN_FRACTION",
    "VRAM_EXTERNAL_RESERVE_BYTES",
    "candidate_order",
    "capacity_of",
    "engine_kwargs_for",
    "estimate_kv",
    "kv_layout",
    "max_model_len_for",
    "only_backend",
    "only_devices",
    "plan_artifact",
    "resolve_session",
    "unreadable_artifact",
]

