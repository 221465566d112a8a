"""How many bytes of KV cache a text model needs, and how long a context fits a budget.

:mod:`.layout` classifies every layer (with the family rules of
:mod:`edge_core.artifact.families`), :mod:`.charge` charges a session three
ways (the engine's own allocator rule asked of an :class:`~edge_core.engine.EngineRules`,
vLLM's by default), and :mod:`.search` inverts a rule: the longest context whose charge fits.
"""

from ...engines.vllm_allocator import CPU_ATTN_KERNEL_BLOCK_TOKENS, DEFAULT_MAMBA_SSM_CACHE_DTYPE, hybrid_block_size
from ...kv import RULES, KVEstimate
from .charge import DTYPE_BYTES, estimate_kv
from .layout import LAYER_KINDS, KVLayout, LayerKV, kv_layout, rank_layout
from .search import DEFAULT_CEILING_TOKENS, largest_fitting, max_model_len_for

__all__ = [
    "CPU_ATTN_KERNEL_BLOCK_TOKENS",
    "DEFAULT_CEILING_TOKENS",
    "DEFAULT_MAMBA_SSM_CACHE_DTYPE",
    "DTYPE_BYTES",
    "LAYER_KINDS",
    "RULES",
    "KVEstimate",
    "KVLayout",
    "LayerKV",
    "estimate_kv",
    "hybrid_block_size",
    "kv_layout",
    "largest_fitting",
    "max_model_len_for",
    "rank_layout",
]
