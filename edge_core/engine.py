"""What the planner asks the engine a backend runs on: how many KV bytes it reserves, and how a layout starts.

The checkpoint planner hands an engine's rules a :class:`KVLayout` (every
layer's cache shape, read from the model's config) and one session's
:class:`ChargeSettings`; the rules answer in bytes and tokens. For an admitted
parallel layout they write the environment and per-host commands that start it.
A backend names its engine's rules through the optional ``engine_rules`` hook;
the vLLM rules (:mod:`edge_core.engines.vllm`) answer for a device whose
backend gives none. The graph-stage planner asks no engine rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .devices import Device
    from .host import HostFacts
    from .layout import Layout, NodeAddress
    from .plans import SessionSpec

#: Layer kinds. ``mla`` is full attention over a compressed latent (one
#: "head" of kv_lora_rank + qk_rope_head_dim elements, not doubled for K/V).
LAYER_KINDS = ("full", "mla", "sliding", "chunked", "recurrent", "none")


@dataclass(frozen=True)
class LayerKV:
    """What one decoder layer keeps per sequence.

    ``elements_per_token`` counts cached elements per token (K and V together;
    the latent for MLA), 0 for recurrent and ``none`` layers.
    ``window_tokens`` is the sliding window or attention chunk, else None.
    ``state_elements`` is the recurrent state per sequence, else 0; of it,
    ``ssm_state_elements`` is the part vLLM stores in ``mamba_ssm_cache_dtype``
    (the SSM / delta-rule state), the rest (conv state, a lightning or
    short-conv state) in ``mamba_cache_dtype``. ``state_formula`` names the
    shape rule (``mamba1``, ``mamba2``, ``gated_deltanet``, ...).
    """

    index: int
    kind: str
    elements_per_token: int = 0
    window_tokens: int | None = None
    state_elements: int = 0
    ssm_state_elements: int = 0
    state_formula: str = ""

    @property
    def attention(self) -> bool:
        return self.kind in ("full", "mla", "sliding", "chunked")

    def state_bytes(self, cache_dtype_bytes: int, ssm_dtype_bytes: int) -> int:
        """This layer's state per sequence: the SSM part in its dtype, the rest in the cache dtype."""
        return ((self.state_elements - self.ssm_state_elements) * cache_dtype_bytes
                + self.ssm_state_elements * ssm_dtype_bytes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind,
            "elements_per_token": self.elements_per_token,
            "window_tokens": self.window_tokens,
            "state_elements": self.state_elements,
            "ssm_state_elements": self.ssm_state_elements,
            "state_formula": self.state_formula,
        }


@dataclass(frozen=True)
class KVLayout:
    """Every layer's KV shape, read from a text config.

    ``num_kv_heads`` x ``head_dim`` is one of K or V per token per layer
    (MLA: 1 x (kv_lora_rank + qk_rope_head_dim)). ``source`` says which config
    fields decided the layer kinds; ``evidence`` is ``D`` (detected: the config
    states them, ``layer_types`` or plain full attention) or ``E`` (estimated:
    edge inferred them from a family rule, or estimated recurrent state).
    """

    layers: tuple[LayerKV, ...]
    num_kv_heads: int
    head_dim: int
    mla: bool
    source: str
    evidence: str
    notes: tuple[str, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def counts(self) -> dict[str, int]:
        """Layers per kind, every kind present (zeros included)."""
        out = {kind: 0 for kind in LAYER_KINDS}
        for layer in self.layers:
            out[layer.kind] += 1
        return out

    def windows_tokens(self) -> tuple[int, ...]:
        """Distinct sliding windows / chunks, ascending."""
        return tuple(sorted({l.window_tokens for l in self.layers if l.window_tokens}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "mla": self.mla,
            "layer_counts": self.counts(),
            "windows_tokens": list(self.windows_tokens()),
            "layer_kinds": [l.kind for l in self.layers],
            "elements_per_token_per_layer": max(
                (l.elements_per_token for l in self.layers), default=0),
            "state_elements_per_layer": max((l.state_elements for l in self.layers), default=0),
            "state_layers": sum(1 for l in self.layers if l.state_elements),
            "source": self.source,
            "evidence": self.evidence,
            "notes": list(self.notes),
        }



@dataclass(frozen=True)
class ChargeSettings:
    """One session's constants every KV charge needs: sizes, the engine's resolved block, bytes per element.

    ``block_size`` is the attention block the engine uses for this layout in
    tokens (None: charge exact tokens); ``kv_bytes``, ``cache_bytes`` and
    ``ssm_bytes`` are bytes per element of the KV cache, the conv state and the
    SSM state; ``mamba_cache_mode`` is the engine's state-caching mode (None
    without recurrent layers).
    """

    max_num_seqs: int
    max_num_batched_tokens: int | None
    block_size: int | None
    concurrent_batches: int
    kv_bytes: int
    cache_bytes: int
    ssm_bytes: int
    mamba_cache_mode: str | None


@dataclass(frozen=True)
class ProcessLayout:
    """How many processes an engine runs a session in: inside edge's own (``in_process``) or apart, why, and the
    environment that layout sets before the engine is imported (the same for edge's engine and a plain reference)."""

    in_process: bool
    reason: str
    env: Mapping[str, str]


class EngineRules(Protocol):
    """An engine's answers to the planner, each pure arithmetic over the values it is handed."""

    #: The engine's name, as the charging rule of :data:`edge_core.budget.RULES` it fills.
    name: str

    def block_size(self, layout: KVLayout, block_size: int | None, *, kv_bytes: int, cache_bytes: int,
                   ssm_bytes: int, kernel_block_tokens: int) -> int | None:
        """The attention block in tokens the engine uses for ``layout`` when the platform's is ``block_size``."""

    def cache_mode(self, layout: KVLayout, enable_prefix_caching: bool | None) -> str | None:
        """How the engine caches recurrent state for ``layout`` (None without recurrent layers)."""

    def state_blocks(self, formula: str, mode: str | None) -> int:
        """State pages one request holds per recurrent layer of shape rule ``formula``."""

    def charge_bytes(self, layout: KVLayout, max_model_len: int, settings: ChargeSettings) -> int:
        """Bytes the engine's allocator reserves for ``settings.max_num_seqs`` requests of ``max_model_len`` tokens."""

    def charge_note(self, settings: ChargeSettings, in_flight: str, rounding: str) -> str:
        """One line saying how :meth:`charge_bytes` counts, for the estimate's ``rules``."""

    def carve_pool(self, pool_bytes: int, *, sequence_bytes: int, block_bytes: int, max_num_seqs: int
                   ) -> tuple[int, int, int, float]:
        """How the engine carves a KV pool of ``pool_bytes``: (blocks, blocks per sequence at ``max_model_len``,
        full-length sequences it holds at once, the concurrency the engine reports). ``sequence_bytes`` and
        ``block_bytes`` are one full-length sequence and the pool's fixed part, read off :meth:`charge_bytes`."""

    def engine_processes(self, device: Device, session: SessionSpec, world_size: int,
                         host: HostFacts | None) -> ProcessLayout:
        """Whether ``session`` on ``device`` runs inside edge's own process (``world_size`` ranks), why, and its env."""

    def launch_env(self, device: Device, layout: Layout, session: SessionSpec, host: HostFacts | None,
                   devices: list[Device]) -> tuple[dict[str, str], str | None]:
        """The environment rank 0's host sets before the engine starts, and a note when a card cannot be named."""

    def node_env(self, device: Device, layout: Layout, hosts: list[str], facts: Mapping[str, HostFacts | None],
                 head_env: Mapping[str, str]) -> dict[str, dict[str, str]]:
        """Each host's environment for a multi-host layout, from the head's."""

    def node_commands(self, hosts: list[str], model: str, layout: Layout, device_files: list[str],
                      engine_kwargs: Mapping[str, Any] | None = None,
                      env_by_host: Mapping[str, Mapping[str, str]] | None = None) -> list[dict[str, Any]]:
        """What to run on each host to bring a multi-host layout up on the engine's own multi-node paths."""

    def launch_notes(self, device: Device, layout: Layout) -> tuple[str, ...]:
        """What a person must know before running :meth:`node_commands` as printed (may be empty)."""

    def node_address_env(self, address: NodeAddress) -> dict[str, str]:
        """What one node's ranks need set to bind and advertise ``address`` (its interface and IP) to the others."""
