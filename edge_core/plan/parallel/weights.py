"""How many weight bytes does each rank hold? Every tensor's role under tensor and pipeline parallelism.

A rank holds its slice of every tensor (split ones / k, replicated ones whole,
the vocabulary-parallel embedding and LM head by padded rows); a pipeline
stage holds its layers, the first the embedding, the last the head.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...layout import Layout
from .gates import config_int, model_config, num_layers, padded_vocab, pp_partition

if TYPE_CHECKING:
    from ...manifest import Manifest

#: A decoder layer's index in a tensor name (``model.layers.12.``, ``transformer.h.3.``, ``backbone.layers.0.``).
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
#: Tensors of a vision tower or projector (multimodal wrappers): held by the first stage, split by TP.
_VISION = ("visual.", "vision_tower", "vision_model", "multi_modal_projector", "mm_projector", "vision_embed")
_EMBED = ("embed_tokens.", "wte.", "word_embeddings.", "tok_embeddings.", "embeddings.word")
#: Modules vLLM builds as ``ReplicatedLinear`` or keeps whole on every rank: norms, a MoE router,
#: MLA's low-rank down-projections (its latent is shared by every head).
_REPLICATED = ("norm", "ln_", ".gate.weight", ".router.", "e_score_correction_bias", "q_a_proj", "kv_a_proj_with_mqa",
               "rotary_emb")
_KV_PROJ = (".k_proj.", ".v_proj.")
_FUSED_QKV = (".qkv_proj.", ".query_key_value.", ".Wqkv.", ".c_attn.")


@dataclass(frozen=True)
class TensorRoles:
    """The checkpoint's bytes by role and layer: the one pass over the tensors every layout reuses."""

    #: (role, layer index or -1) -> bytes
    table: dict[tuple[str, int], int]
    from_tensors: bool


_ROLE_CACHE: dict[str, TensorRoles] = {}


def tensor_role(name: str) -> tuple[str, int]:
    """``(role, layer)`` of one tensor: how tensor parallelism splits it, and its decoder layer (-1: none)."""
    if any(v in name for v in _VISION):
        return "vision", -1
    match = _LAYER_INDEX.search(name)
    layer = int(match.group(1)) if match else -1
    if layer < 0:
        if any(e in name for e in _EMBED):
            return "embed", -1
        if name.startswith(("lm_head.", "output.")) or ".lm_head." in name:
            return "lm_head", -1
        return "global", -1  # the final norm and friends: whole, on the last stage
    if any(r in name for r in _REPLICATED):
        return "replicated", layer
    if any(k in name for k in _KV_PROJ):
        return "kv", layer
    if any(q in name for q in _FUSED_QKV):
        return "qkv", layer
    return "split", layer


def tensor_roles(manifest: Manifest) -> TensorRoles:
    cached = _ROLE_CACHE.get(manifest.artifact_id)
    if cached is not None:
        return cached
    tensors = manifest.tensors
    table: dict[tuple[str, int], int] = {}
    if tensors is not None and len(tensors):
        for shard in tensors.shards():
            for name, nbytes in zip(shard.names, shard.nbytes):
                key = tensor_role(name)
                table[key] = table.get(key, 0) + nbytes
        roles = TensorRoles(table, True)
    else:
        roles = TensorRoles({("split", -1): manifest.weight_bytes}, False)
    _ROLE_CACHE[manifest.artifact_id] = roles
    return roles


def _fraction(role: str, config: Mapping[str, Any], tp: int) -> tuple[int, int]:
    """One rank's share of a role's bytes under TP ``tp``, as ``numerator / denominator``."""
    if tp <= 1 or role in ("replicated", "global"):
        return 1, 1
    heads = config_int(config, "num_attention_heads", "n_head") or 1
    kv = config_int(config, "num_key_value_heads") or heads
    if role == "kv":
        return 1, min(tp, kv)
    if role == "qkv":
        return heads // tp + 2 * max(1, kv // tp), heads + 2 * kv
    if role in ("embed", "lm_head"):
        vocab = config_int(config, "vocab_size")
        if vocab:
            return min(padded_vocab(vocab) // tp, vocab), vocab
    return 1, tp


def rank_weight_bytes(manifest: Manifest, layout: Layout) -> list[int]:
    """Weight bytes one rank of each pipeline stage holds (a list of ``layout.pp`` figures).

    Every TP rank of a stage holds the same bytes. Layers past
    ``num_hidden_layers`` (a multi-token-prediction head vLLM skips) are
    charged to the last stage; with tied embeddings the last stage holds the
    embedding table too (vLLM builds it there as the LM head).
    """
    config = model_config(manifest)
    roles = tensor_roles(manifest)
    layers = num_layers(config) or 1
    stages = pp_partition(layers, layout.pp) if layout.pp > 1 else [(0, layers)]
    last = len(stages) - 1
    tied = bool(config.get("tie_word_embeddings", False))

    def stage_of(layer: int) -> int:
        for i, (start, end) in enumerate(stages):
            if start <= layer < end:
                return i
        return last

    out = [0] * len(stages)
    for (role, layer), nbytes in roles.table.items():
        num, den = _fraction(role, config, layout.tp)
        share = -(-nbytes * num // den)
        if role in ("embed", "vision"):
            targets = {0, last} if role == "embed" and tied and last else {0}
        elif role in ("lm_head", "global"):
            targets = {last}
        else:
            targets = {stage_of(layer)} if layer >= 0 else {last}
        for stage in targets:
            out[stage] += share
    return out
