"""Can this model be split this way? The divisibility gates vLLM checks late, decided before anything starts.

Attention heads (config time in vLLM), KV heads, the padded vocabulary, MLP
and quantization-group divisibility (inside each worker, after processes
have spawned), layers per pipeline stage: each a ``parallel_layout_invalid``
refusal naming the dimension, the values and the sizes that would work.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...layout import Layout
from ...plans import Refusal

if TYPE_CHECKING:
    from ...manifest import Manifest

#: vLLM pads the vocabulary to a multiple of this before splitting it across
#: ranks (``DEFAULT_VOCAB_PADDING_SIZE``, model_executor/layers/vocab_parallel_embedding.py).
VOCAB_PADDING_SIZE = 64
#: Largest tensor-parallel size a refusal lists as an alternative.
MAX_LISTED_TP = 16


def model_config(manifest: Manifest) -> Mapping[str, Any]:
    """The model's ``config.json`` (empty when it has none)."""
    return manifest.config or {}


def config_int(config: Mapping[str, Any], *names: str) -> int | None:
    """The first of ``names`` that holds a positive integer, else None."""
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def num_layers(config: Mapping[str, Any]) -> int | None:
    return config_int(config, "num_hidden_layers", "n_layer", "num_layers")


def pp_partition(layers: int, pp: int) -> list[tuple[int, int]]:
    """Each stage's ``[start, end)`` layers, as vLLM's ``get_pp_indices`` splits them (without an override).

    Even shares; the remainder goes one layer each to the stages before the
    last, from the second-to-last backwards (the last holds the final norm and
    the LM head).
    """
    partitions = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        partitions[-i] += 1
    out, start = [], 0
    for size in partitions:
        out.append((start, start + size))
        start += size
    return out


def padded_vocab(vocab: int, padding: int = VOCAB_PADDING_SIZE) -> int:
    return -(-vocab // padding) * padding


def _quant_group_size(manifest: Manifest) -> int | None:
    scheme = manifest.quantization_scheme or {}
    size = scheme.get("group_size")
    if isinstance(size, int) and size > 0:
        return size
    quant = manifest.quantization or {}
    size = quant.get("group_size")
    return size if isinstance(size, int) and size > 0 else None


def _mla(config: Mapping[str, Any]) -> bool:
    return config.get("kv_lora_rank") is not None


def tp_problems(manifest: Manifest, tp: int) -> list[tuple[str, str, dict[str, Any]]]:
    """Why tensor parallel size ``tp`` cannot split this model: ``(dimension, message, values)`` each."""
    if tp <= 1:
        return []
    config = model_config(manifest)
    out: list[tuple[str, str, dict[str, Any]]] = []
    heads = config_int(config, "num_attention_heads", "n_head")
    if heads and heads % tp:
        out.append(("attention_heads", f"{heads} attention heads are not divisible by {tp}",
                    {"num_attention_heads": heads}))
    kv = config_int(config, "num_key_value_heads")
    if kv and not _mla(config) and kv % tp and tp % kv:
        out.append(("kv_heads", f"{kv} KV heads are not divisible by {tp}, nor is {tp} a multiple of {kv} "
                    "(vLLM splits KV heads, or replicates them when there are fewer than ranks)",
                    {"num_key_value_heads": kv}))
    vocab = config_int(config, "vocab_size")
    if vocab and padded_vocab(vocab) % tp:
        out.append(("vocab", f"the vocabulary ({vocab}, padded to {padded_vocab(vocab)}, a multiple of "
                    f"{VOCAB_PADDING_SIZE}) is not divisible by {tp}",
                    {"vocab_size": vocab, "padded_vocab_size": padded_vocab(vocab)}))
    for name in ("intermediate_size", "moe_intermediate_size"):
        size = config_int(config, name)
        if size and size % tp:
            out.append(("intermediate_size", f"{name} {size} is not divisible by {tp}", {name: size}))
    for name in ("mamba_n_heads", "mamba_num_heads", "linear_num_value_heads"):
        size = config_int(config, name)
        if size and size % tp:
            out.append(("recurrent_heads", f"{name} {size} is not divisible by {tp}", {name: size}))
    group = _quant_group_size(manifest)
    if group:
        hidden = config_int(config, "hidden_size") or 0
        head_dim = config_int(config, "head_dim") or (hidden // heads if heads else 0)
        inputs = {"down_proj": config_int(config, "moe_intermediate_size", "intermediate_size"),
                  "o_proj": (heads or 0) * head_dim or None}
        for module, size in inputs.items():
            if size and size % tp == 0 and (size // tp) % group:
                out.append(("quantization_group", f"{module}'s input ({size}) split {tp} ways is {size // tp} "
                            f"columns per rank, not a whole number of {group}-column quantization groups",
                            {"module": module, "input_size": size, "group_size": group}))
    return out


def pp_problems(manifest: Manifest, pp: int) -> list[tuple[str, str, dict[str, Any]]]:
    """Why ``pp`` pipeline stages cannot split this model (a stage needs at least one layer)."""
    if pp <= 1:
        return []
    layers = num_layers(model_config(manifest))
    if layers is not None and layers < pp:
        return [("layers", f"{layers} layers cannot fill {pp} pipeline stages", {"num_hidden_layers": layers})]
    return []


def valid_tp_sizes(manifest: Manifest, limit: int = MAX_LISTED_TP) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that pass every divisibility gate."""
    return [k for k in range(1, limit + 1) if not tp_problems(manifest, k)]


def layout_refusals(manifest: Manifest, layout: Layout, device_id: str | None = None,
                    max_ranks: int | None = None) -> list[Refusal]:
    """``parallel_layout_invalid`` for each dimension ``layout`` cannot split, with the sizes that would work.

    ``max_ranks`` is how many ranks the devices at hand can host
    (:func:`rank_capacity`): a size listed as an alternative fits it too.
    """
    refusals = []
    limit = MAX_LISTED_TP if max_ranks is None else max(min(MAX_LISTED_TP, max_ranks // max(layout.pp, 1)), 1)
    sizes = valid_tp_sizes(manifest, limit)
    where = f"up to {limit}" if max_ranks is None else f"up to {limit}, the ranks the devices here can host,"
    for dimension, message, values in tp_problems(manifest, layout.tp):
        refusals.append(Refusal(
            code="parallel_layout_invalid", device_id=device_id,
            message=f"tensor parallel size {layout.tp}: {message}",
            remedy=f"use --tensor-parallel-size {' or '.join(map(str, sizes))} (the sizes {where} that "
                   "every dimension divides by)" + (", or pipeline parallelism (--pipeline-parallel-size)"
                                                    if max_ranks is None or max_ranks > 1 else ""),
            details={"dimension": dimension, "tensor_parallel_size": layout.tp, **values,
                     "valid_tensor_parallel_sizes": sizes}))
    for dimension, message, values in pp_problems(manifest, layout.pp):
        most = values["num_hidden_layers"]
        if max_ranks is not None:
            most = max(min(most, max_ranks // max(layout.tp, 1)), 1)
        refusals.append(Refusal(
            code="parallel_layout_invalid", device_id=device_id,
            message=f"pipeline parallel size {layout.pp}: {message}",
            remedy=f"use at most --pipeline-parallel-size {most}",
            details={"dimension": dimension, "pipeline_parallel_size": layout.pp, **values}))
    return refusals
