"""Which kind each layer of a text model is, and what it caches per token and per sequence.

Input is a model's *text* config as a plain dict (``config.json``, with a
multimodal wrapper's ``text_config`` already resolved by the caller); nothing
is imported from transformers. The layer types come from the family rules in
:mod:`edge_core.artifact.families`; :func:`kv_layout` turns them into kinds
(full, MLA, sliding window, chunked local, recurrent state, none) with the
elements each caches, and :func:`rank_layout` cuts that to one parallel rank.
The value types (:class:`~edge_core.engine.KVLayout`) are the contract's: an
engine's rules receive them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ...artifact.families import (
    CHUNKED_NAMES,
    FULL_NAMES,
    HYBRID_NAMES,
    NONE_NAMES,
    RECURRENT_NAMES,
    SLIDING_NAMES,
    layer_pattern,
    state_formula,
    traits_of,
)
from ...artifact.fields import (
    ATTENTION_HEAD_FIELDS,
    HEAD_DIM_FIELDS,
    HIDDEN_FIELDS,
    KV_HEAD_FIELDS,
    opt_int,
    req_int,
    unreadable,
    window_tokens,
)
from ...engine import LAYER_KINDS, KVLayout, LayerKV

__all__ = ["LAYER_KINDS", "KVLayout", "LayerKV", "attention_shape", "kv_layout", "rank_layout", "recurrent_state"]

def attention_shape(config: Mapping[str, Any]) -> tuple[int, int, int, bool]:
    """(elements per token per layer, kv heads, head dim, mla)."""
    if config.get("kv_lora_rank") is not None:
        rank = req_int(config, ("kv_lora_rank",))
        rope = req_int(config, ("qk_rope_head_dim",), what="needed with kv_lora_rank (MLA)")
        # MLA caches one latent vector per token: vLLM's MLAAttentionSpec has
        # num_kv_heads=1, head_size=kv_lora_rank+qk_rope_head_dim, head_size_v=0.
        return rank + rope, 1, rank + rope, True
    heads = req_int(config, ATTENTION_HEAD_FIELDS, what="attention heads")
    kv_heads = opt_int(config, KV_HEAD_FIELDS)
    if kv_heads is None or traits_of(config).kv_head_per_query_head:
        kv_heads = 1 if config.get("multi_query") is True else heads
    head_dim = opt_int(config, (*HEAD_DIM_FIELDS, "attention_head_dim"))
    if head_dim is None:
        hidden = req_int(config, HIDDEN_FIELDS, what="needed when head_dim is absent")
        if hidden < heads:
            raise unreadable(f"hidden_size {hidden} is smaller than num_attention_heads {heads}")
        head_dim = hidden // heads
    return 2 * kv_heads * head_dim, kv_heads, head_dim, False



def recurrent_state(config: Mapping[str, Any], name: str, tp: int = 1) -> tuple[int, int, str]:
    """(state elements per sequence, of which SSM-dtype elements, formula) of one recurrent layer on one rank.

    Shapes follow vLLM's MambaStateShapeCalculator (mamba_utils.py) at tensor
    parallel size ``tp`` and no speculative tokens, with each family's fields
    as its ``get_mamba_state_shape_from_config`` reads them: the conv width
    and the heads are split across ranks, and Mamba-2's groups are first
    replicated up to ``tp`` when they do not divide (``extra_groups_for_head_shards``).
    The layout gates have checked that the heads divide.
    """
    formula = state_formula(config, name)
    if formula == "gated_deltanet":
        # Conv over q, k, v plus a v x k delta-rule state per value head.
        nk = req_int(config, ("linear_num_key_heads",))
        nv = req_int(config, ("linear_num_value_heads",))
        dk = req_int(config, ("linear_key_head_dim",))
        dv = req_int(config, ("linear_value_head_dim",))
        kernel = req_int(config, ("linear_conv_kernel_dim",))
        ssm = nv // tp * dv * dk
        return (kernel - 1) * ((2 * nk * dk + nv * dv) // tp) + ssm, ssm, formula
    if formula == "linear_attention":
        # Lightning attention (MiniMax): a head_dim x head_dim state per head,
        # in mamba_cache_dtype (linear_attention_state_dtype).
        heads = req_int(config, ATTENTION_HEAD_FIELDS)
        head_dim = opt_int(config, HEAD_DIM_FIELDS) or req_int(config, HIDDEN_FIELDS) // heads
        return heads // tp * head_dim * head_dim, 0, formula
    if formula == "short_conv":
        # LFM2 short convolution: the last conv_L_cache - 1 inputs (lfm2.py reads conv_dim).
        kernel = req_int(config, ("conv_L_cache",))
        dim = opt_int(config, ("conv_dim",)) or req_int(config, HIDDEN_FIELDS)
        return (kernel - 1) * (dim // tp), 0, formula
    d_state = req_int(config, ("mamba_d_state", "ssm_state_size", "state_size"), what="Mamba state size")
    kernel = req_int(config, ("mamba_d_conv", "conv_kernel"), what="Mamba conv kernel")
    traits = traits_of(config)
    plain = traits.plain_mamba_names
    ssm_heads = opt_int(config, ("mamba_n_heads", "mamba_num_heads", "n_mamba_heads")
                        + (("num_heads",) if plain else ()))
    expand = opt_int(config, ("mamba_expand", "expand"))
    inner = opt_int(config, ("mamba_d_ssm",))
    if ssm_heads is not None:
        head_dim_names = ("mamba_d_head", "mamba_head_dim", "mamba_headdim") + (("head_dim",) if plain else ())
        if inner is None:
            if traits.mamba_inner_from_heads or not expand:
                inner = ssm_heads * req_int(config, head_dim_names, what="Mamba-2 head dim")
            else:
                inner = expand * req_int(config, HIDDEN_FIELDS)
        if config.get("mamba_d_head") == "auto":
            # GraniteMoeHybridConfig / FalconH1Config: "auto" is intermediate // heads.
            head_dim = inner // ssm_heads
        else:
            head_dim = req_int(config, head_dim_names, what="Mamba-2 head dim")
        groups = opt_int(config, ("mamba_n_groups", "n_groups", "mamba_ngroups")) or 1
        if groups % tp:
            groups = tp  # replicated so every rank's heads have their group (vLLM: + tp - groups)
        ssm = ssm_heads // tp * head_dim * d_state
        return (kernel - 1) * ((inner + 2 * groups * d_state) // tp) + ssm, ssm, "mamba2"
    if inner is None:
        inner = (expand * req_int(config, HIDDEN_FIELDS) if expand
                 else req_int(config, ("intermediate_size",), what="Mamba inner width"))
    return (kernel - 1) * (inner // tp) + inner // tp * d_state, inner // tp * d_state, "mamba1"



class _Builder:
    """One config's layers as :func:`kv_layout` classifies them, with the notes and evidence they earn."""

    def __init__(self, config: Mapping[str, Any], tp_size: int, evidence: str) -> None:
        self.config, self.tp_size, self.evidence = config, tp_size, evidence
        self.notes: list[str] = []
        self.shape: tuple[int, int, int, bool] | None = None
        self.states: dict[str, tuple[int, int, str]] = {}

    def state(self, name: str) -> tuple[int, int, str]:
        if name not in self.states:
            self.states[name] = recurrent_state(self.config, name, self.tp_size)
            self.notes.append(f"{name!r} state per sequence from the {self.states[name][2]} shape (estimate)")
        return self.states[name]

    def layer(self, i: int, name: str) -> LayerKV:
        hybrid = name in HYBRID_NAMES
        if hybrid or name in FULL_NAMES or name in SLIDING_NAMES or name in CHUNKED_NAMES or (
                name.endswith("attention") and name not in RECURRENT_NAMES):
            return self.attention_layer(i, name, hybrid)
        if name in RECURRENT_NAMES:
            total, ssm, formula = self.state(name)
            self.evidence = "E"
            return LayerKV(i, "recurrent", state_elements=total, ssm_state_elements=ssm, state_formula=formula)
        if name in NONE_NAMES:
            return LayerKV(i, "none")
        raise unreadable(f"layer {i} has layer type {name!r}, which edge does not know "
                         f"how to size (known: attention kinds, hybrid, "
                         f"{', '.join(sorted(RECURRENT_NAMES | NONE_NAMES))})")

    def attention_layer(self, i: int, name: str, hybrid: bool) -> LayerKV:
        if self.shape is None:
            self.shape = attention_shape(self.config)
        elements, _, _, mla = self.shape
        if name in SLIDING_NAMES:
            window = window_tokens(self.config)
            if window is None:
                raise unreadable(f"layer {i} is {name!r} but config has no 'sliding_window'")
            return LayerKV(i, "sliding", elements, window + traits_of(self.config).extra_window_tokens)
        if name in CHUNKED_NAMES:
            chunk = window_tokens(self.config, "attention_chunk_size")
            if chunk is None:
                raise unreadable(f"layer {i} is {name!r} but config has no 'attention_chunk_size'")
            return LayerKV(i, "chunked", elements, chunk)
        if name not in FULL_NAMES and not hybrid:
            note = f"layer type {name!r} is not one edge knows; charged as full attention"
            if note not in self.notes:
                self.notes.append(note)
            self.evidence = "E"
        total = ssm = 0
        formula = ""
        if hybrid:
            # Falcon-H1 / Zamba2 run attention and a Mamba-2 mixer side by
            # side in one layer: it keeps both a KV cache and a state.
            total, ssm, formula = self.state("mamba")
            self.evidence = "E"
        return LayerKV(i, "mla" if mla else "full", elements, state_elements=total,
                       ssm_state_elements=ssm, state_formula=formula)


def kv_layout(config: Mapping[str, Any], tp_size: int = 1) -> KVLayout:
    """Classify every layer of a text config; recurrent state is one rank's of ``tp_size``
    (:func:`rank_layout` then splits the KV heads and cuts the layers).

    Raises :class:`~edge_core.errors.ArtifactError` ``config_unreadable``
    naming the field when the config lacks or garbles one the answer needs.
    """
    if not isinstance(config, Mapping):
        raise unreadable(f"text config must be a JSON object, got {type(config).__name__}")
    pattern = layer_pattern(config)
    builder = _Builder(config, tp_size, pattern.evidence)
    layers = [builder.layer(i, name) for i, name in enumerate(pattern.names)]
    kv_heads = head_dim = 0
    mla = False
    if builder.shape is not None:
        _, kv_heads, head_dim, mla = builder.shape
    return KVLayout(tuple(layers), kv_heads, head_dim, mla, pattern.source, builder.evidence, tuple(builder.notes))


def rank_layout(layout: KVLayout, tp_size: int = 1, layer_range: tuple[int, int] | None = None) -> KVLayout:
    """The part of ``layout`` one tensor/pipeline-parallel rank caches.

    vLLM splits KV heads across ``tp_size`` ranks (``num_kv_heads // tp``) and
    replicates them when there are fewer heads than ranks (one head per
    rank); MLA's latent is one shared vector per token, which tensor
    parallelism does not split. Recurrent state is already one rank's when
    ``layout`` is ``kv_layout(config, tp_size)``. A pipeline stage caches only its layers, ``layer_range`` =
    ``[start, end)`` as vLLM's ``get_pp_indices`` gives them.
    """
    layers = layout.layers
    if layer_range is not None:
        start, end = layer_range
        layers = tuple(l for l in layers if start <= l.index < end)
    kv_heads = layout.num_kv_heads
    if tp_size > 1 and not layout.mla and kv_heads:
        per_rank = max(1, kv_heads // tp_size)
        layers = tuple(replace(l, elements_per_token=l.elements_per_token * per_rank // kv_heads)
                       if l.attention else l for l in layers)
        kv_heads = per_rank
    if layers is layout.layers and kv_heads == layout.num_kv_heads:
        return layout
    return replace(layout, layers=layers, num_kv_heads=kv_heads)

