"""How many bytes of KV cache a text model needs, and how long a context fits a budget.

:mod:`.layout` classifies every layer (with the family rules of
:mod:`edge_core.artifact.families`), :mod:`.charge` charges a session three
ways (the engine's own allocator rule asked of an :class:`~edge_core.engine.EngineRules`,
vLLM's by default), and :mod:`.search` inverts a rule: the longest context whose charge fits.
The values it returns and reads are the contract's (:mod:`edge_core.kv`, :mod:`edge_core.engine`).
"""

from .charge import DTYPE_BYTES, estimate_kv
from .layout import kv_layout, rank_layout
from .search import DEFAULT_CEILING_TOKENS, largest_fitting, max_model_len_for

__all__ = [
    "DEFAULT_CEILING_TOKENS",
    "DTYPE_BYTES",
    "estimate_kv",
    "kv_layout",
    "largest_fitting",
    "max_model_len_for",
    "rank_layout",
]
