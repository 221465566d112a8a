"""Can it run across several devices — tensor- and pipeline-parallel on vLLM — and with how many bytes per rank?

Everything vLLM checks late is decided first, as ``parallel_layout_invalid``
refusals (:mod:`.gates`); each rank gets its own budget: its slice of every
tensor (:mod:`.weights`) and its own KV pool (vLLM's ``kv_cache_memory_bytes``
is per rank). :mod:`.groups` forms groups of like devices and orders the
layouts to try, :mod:`.attempt` budgets one layout on one group,
:mod:`.search` picks the smallest that fits, and :mod:`.outcome` turns it into a
plan, with the environment and commands that start it from the engine's rules
(:class:`~edge_core.engine.EngineRules`, asked of the rank-0 device's backend).

Expected per-rank figures in the tests come from the architecture formulas,
never from this package.
"""

from ...engines.vllm_launch import MASTER_PORT
from ...layout import EXECUTOR_MP, EXECUTOR_RAY, EXECUTORS, DeviceShare, Layout
from .gates import (
    MAX_LISTED_TP,
    VOCAB_PADDING_SIZE,
    layout_refusals,
    num_layers,
    padded_vocab,
    pp_partition,
    pp_problems,
    tp_problems,
    valid_tp_sizes,
)
from .groups import candidate_layouts, group_key, groupable, host_of, mixed_group_refusal, rank_capacity
from .layout import ParallelRequest, RankBudget
from .outcome import FOUR_BIT_FRACTION, node_edge_commands
from .search import plan_parallel
from .weights import rank_weight_bytes, tensor_role

__all__ = [
    "EXECUTORS", "EXECUTOR_MP", "EXECUTOR_RAY", "FOUR_BIT_FRACTION",
    "MASTER_PORT", "MAX_LISTED_TP", "VOCAB_PADDING_SIZE", "DeviceShare", "Layout",
    "ParallelRequest", "RankBudget", "candidate_layouts", "group_key", "groupable", "host_of",
    "layout_refusals", "mixed_group_refusal", "node_edge_commands", "num_layers", "padded_vocab",
    "plan_parallel", "pp_partition", "pp_problems", "rank_capacity", "rank_weight_bytes", "tensor_role",
    "tp_problems", "valid_tp_sizes",
]
