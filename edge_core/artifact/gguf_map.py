"""Which checkpoint a GGUF file becomes: its config.json, each tensor's name and shape, and what cannot be converted.

llama.cpp's converter (``convert_hf_to_gguf.py``) renames a Hugging Face
checkpoint's tensors (``model.layers.0.self_attn.q_proj.weight`` becomes
``blk.0.attn_q.weight``), stores shapes fastest dimension first, keeps the
config as ``<arch>.*`` metadata keys, and for the Llama family permutes the
rows of the query and key projections (its rotary kernels pair dimensions
differently from transformers'). This module inverts that for the families
edge imports: Llama (and Mistral, which llama.cpp files as ``llama``), Qwen2
and Qwen3. It is pure: the header (:mod:`.gguf`) in, a :class:`Conversion`
out; the runtime's importer (:mod:`edge_core.runtime.gguf_import`) moves the
bytes. Anything it cannot place is refused by name, never dropped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import ArtifactError
from .gguf import DEQUANTIZABLE, ArrayInfo, GGUFHeader, GGUFTensor

#: safetensors' names of the output dtypes.
SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
#: Output dtypes `edge import` writes, and their bytes per element.
DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}
#: ``--bits 4``: the decoder layers' linear weights as 4-bit integers with a scale and a zero point per group of
#: this many inputs along each row (GGUF's own 32-element blocks), in compressed-tensors' pack-quantized layout,
#: the W4A16 format vLLM CPU runs (its CPUWNA16 kernel: uint4 with zero points, groups and sizes multiples of 32).
W4_GROUP = 32
#: The linear layers ``--bits 4`` quantizes; embeddings, norms, biases and the LM head stay in the dtype.
W4_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Family:
    """One GGUF architecture edge imports: the checkpoint class vLLM loads, and how llama.cpp stored it."""

    model_type: str
    architecture: str
    #: llama.cpp permuted q/k rows for its rotary kernels (the Llama family only).
    permuted_qk: bool
    #: Per-head RMS norms on q and k (Qwen3).
    qk_norm: bool = False
    #: The config class has ``attention_bias``, set from whether the file holds q/k/v biases (Qwen2 always has
    #: them and no such field).
    bias_field: bool = True
    #: Config fields the class needs that GGUF metadata does not carry.
    extra: tuple[tuple[str, Any], ...] = ()


FAMILIES = {
    "llama": Family("llama", "LlamaForCausalLM", permuted_qk=True, extra=(("mlp_bias", False),)),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", permuted_qk=False, bias_field=False,
                    extra=(("use_sliding_window", False),)),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", permuted_qk=False, qk_norm=True,
                    extra=(("use_sliding_window", False),)),
}

#: GGUF tensor names -> Hugging Face ones (``{i}`` is the layer).
_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
#: Llama 3's rotary frequency factors: a tensor in the file, a ``rope_scaling`` entry in the config.
ROPE_FREQS = "rope_freqs.weight"


@dataclass(frozen=True)
class TensorMove:
    """One GGUF tensor's place in the checkpoint: its name, shape (row-major), and the q/k heads to un-permute."""

    source: GGUFTensor
    name: str
    shape: tuple[int, ...]
    #: Heads whose rows llama.cpp interleaved for its rotary kernels (q: attention heads, k: KV heads); 0: none.
    unpermute_heads: int = 0
    #: Written as 4-bit integers (``--bits 4``), not as floats.
    quantized: bool = False

    def outputs(self, dtype: str) -> list[tuple[str, str, tuple[int, ...], int]]:
        """The safetensors entries this tensor becomes: (name, safetensors dtype, shape, bytes).

        A 4-bit weight is compressed-tensors' four: ``weight_packed`` (int32, eight 4-bit values per word
        along the input), ``weight_scale`` (one per group, in ``dtype``), ``weight_zero_point`` (int32, eight
        per word along the output) and ``weight_shape``.
        """
        if not self.quantized:
            return [(self.name, SAFETENSORS_DTYPES[dtype], self.shape, math.prod(self.shape) * DTYPES[dtype])]
        rows, cols = self.shape
        stem = self.name[: -len(".weight")]
        groups = cols // W4_GROUP
        return [(f"{stem}.weight_packed", "I32", (rows, cols // 8), rows * cols // 2),
                (f"{stem}.weight_scale", SAFETENSORS_DTYPES[dtype], (rows, groups), rows * groups * DTYPES[dtype]),
                (f"{stem}.weight_zero_point", "I32", (rows // 8, groups), rows // 8 * groups * 4),
                (f"{stem}.weight_shape", "I64", (2,), 16)]


@dataclass(frozen=True)
class Conversion:
    """What `edge import` writes for one GGUF file: the config, every tensor's move, and the bytes they take."""

    header: GGUFHeader
    family: Family
    dtype: str
    config: dict[str, Any]
    generation_config: dict[str, Any]
    moves: tuple[TensorMove, ...]
    #: Llama 3's frequency-factor tensor, read by the importer to fill ``rope_scaling``; None when absent.
    rope_freqs: GGUFTensor | None
    #: 16: every weight in ``dtype``; 4: the linear layers as W4A16 (:data:`W4_GROUP`).
    bits: int = 16

    @property
    def weight_bytes(self) -> int:
        return sum(out[3] for move in self.moves for out in move.outputs(self.dtype))

    def source_types(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for move in self.moves:
            counts[move.source.type_name] = counts.get(move.source.type_name, 0) + 1
        return counts


def unsupported(header: GGUFHeader, what: str, remedy: str) -> ArtifactError:
    return ArtifactError("architecture_unsupported", f"{header.path}: {what}", remedy, header.path)


def plan_conversion(header: GGUFHeader, dtype: str = "bfloat16", bits: int = 16) -> Conversion:
    """The checkpoint ``header`` becomes, or :class:`ArtifactError` naming the architecture or tensor it cannot take.

    ``bits=4`` writes the decoder's linear layers as W4A16 (:data:`W4_GROUP`); a layer whose sizes are not
    whole groups of 32 (the kernel's rule) stays in ``dtype``, and the config's ``ignore`` list names it.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if bits not in (16, 4):
        raise ValueError(f"bits must be 16 or 4, got {bits!r}")
    family = FAMILIES.get(header.architecture)
    if family is None:
        raise unsupported(header, f"a GGUF of architecture {header.architecture!r}, which edge import does not "
                          f"convert (it converts {', '.join(sorted(FAMILIES))}; Mistral files are 'llama')",
                          "use the model's original safetensors checkpoint from its publisher (edge plans it as "
                          "is), or a GGUF of a supported architecture")
    odd = sorted({t.type_name for t in header.tensors if t.type_name not in DEQUANTIZABLE})
    if odd:
        raise ArtifactError(
            "weight_format_unsupported",
            f"{header.path}: tensors of type {', '.join(odd)}, which edge import cannot dequantize",
            f"use a GGUF quantized with one of {', '.join(sorted(DEQUANTIZABLE))}, or the original checkpoint",
            header.path)
    config = _config(header, family, dtype)
    moves = tuple(_moves(header, family, config))
    if bits == 4:
        moves = tuple(replace(m, quantized=_w4_fits(m)) for m in moves)
        config["quantization_config"] = w4a16_config([m.name for m in moves if _w4_target(m) and not m.quantized])
    rope_freqs = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    return Conversion(header=header, family=family, dtype=dtype, config=config,
                      generation_config=_generation_config(header), moves=moves, rope_freqs=rope_freqs, bits=bits)


def _w4_target(move: TensorMove) -> bool:
    return move.name.endswith(".weight") and move.name.split(".")[-2] in W4_TARGETS


def _w4_fits(move: TensorMove) -> bool:
    rows, cols = move.shape if len(move.shape) == 2 else (0, 0)
    return _w4_target(move) and rows % 32 == 0 and cols % W4_GROUP == 0


def w4a16_config(unquantized: list[str]) -> dict[str, Any]:
    """compressed-tensors' ``quantization_config`` for the 4-bit layers: asymmetric int4, groups of
    :data:`W4_GROUP` inputs, weights only (activations stay in the model dtype); the LM head and any linear layer
    whose sizes do not fit the groups are left out by name."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                        "group_size": W4_GROUP, "dynamic": False, "actorder": None, "observer": "minmax"},
            "input_activations": None, "output_activations": None,
        }},
        "ignore": ["lm_head", *(name[: -len(".weight")] for name in unquantized)],
        "kv_cache_scheme": None,
    }


def _int(header: GGUFHeader, key: str, default: int | None = None) -> int:
    value = header.metadata.get(key, default)
    if isinstance(value, list) and value and all(v == value[0] for v in value):
        value = value[0]  # a per-layer list that is the same everywhere
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise unsupported(header, f"metadata {key} is {value!r}, not one positive whole number",
                          "use a GGUF written by a current llama.cpp converter, or the original checkpoint")
    return value


def _config(header: GGUFHeader, family: Family, dtype: str) -> dict[str, Any]:
    arch = header.architecture
    meta = header.metadata
    hidden = _int(header, f"{arch}.embedding_length")
    heads = _int(header, f"{arch}.attention.head_count")
    kv_heads = _int(header, f"{arch}.attention.head_count_kv", heads)
    head_dim = (meta.get(f"{arch}.attention.key_length")
                or (meta.get(f"{arch}.rope.dimension_count") if family.permuted_qk else None) or hidden // heads)
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{arch}.vocab_size") or (tokens.length if isinstance(tokens, ArrayInfo) else None)
    names = {t.name for t in header.tensors}
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "hidden_size": hidden,
        "intermediate_size": _int(header, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _int(header, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim),
        "max_position_embeddings": _int(header, f"{arch}.context_length"),
        "rms_norm_eps": float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": int(vocab) if vocab else None,
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": dtype,
    }
    if config["vocab_size"] is None:
        raise unsupported(header, "neither a vocab_size key nor a token table", "use a GGUF with its tokenizer")
    if family.bias_field:
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    config.update(family.extra)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0))
        config["rope_scaling"] = {"rope_type": scaling, "factor": factor}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if scaling == "yarn" and isinstance(original, int):
            config["rope_scaling"]["original_max_position_embeddings"] = original
    elif scaling not in (None, "none"):
        raise unsupported(header, f"rope scaling {scaling!r}, which edge import does not map",
                          "use the original checkpoint")
    for key, field in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if isinstance(meta.get(field), int):
            config[key] = meta[field]
    return config


def _generation_config(header: GGUFHeader) -> dict[str, Any]:
    """bos/eos/pad as the GGUF names them; the end-of-turn tokens also stop generation (Llama 3's eot, eom)."""
    meta = header.metadata
    out: dict[str, Any] = {}
    if isinstance(meta.get("tokenizer.ggml.bos_token_id"), int):
        out["bos_token_id"] = meta["tokenizer.ggml.bos_token_id"]
    stops = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                               "tokenizer.ggml.eom_token_id") if isinstance(meta.get(k), int)]
    stops = list(dict.fromkeys(stops))
    if stops:
        out["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    if isinstance(meta.get("tokenizer.ggml.padding_token_id"), int):
        out["pad_token_id"] = meta["tokenizer.ggml.padding_token_id"]
    return out


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None when it is not a weight of the families here."""
    stem, dot, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL and kind in ("weight", "bias"):
        return f"{_GLOBAL[stem]}.{kind}"
    match = _BLOCK.match(gguf_name)
    if match and match.group(2) in _LAYER:
        return f"model.layers.{match.group(1)}.{_LAYER[match.group(2)]}.{match.group(3)}"
    return None


def _moves(header: GGUFHeader, family: Family, config: dict[str, Any]) -> list[TensorMove]:
    moves = []
    layers = config["num_hidden_layers"]
    for tensor in header.tensors:
        if tensor.name == ROPE_FREQS:
            continue
        name = hf_name(tensor.name)
        match = _BLOCK.match(tensor.name)
        if name is None or (match and int(match.group(1)) >= layers):
            raise unsupported(header, f"tensor {tensor.name!r} has no place in {family.architecture}",
                              "use the model's original checkpoint; edge import converts the dense decoder "
                              "layouts of llama, qwen2 and qwen3 only")
        if (".q_norm." in name or ".k_norm." in name) and not family.qk_norm:
            raise unsupported(header, f"tensor {tensor.name!r} (per-head q/k norms) in a {header.architecture} file",
                              "use the model's original checkpoint")
        heads = 0
        if family.permuted_qk and ".q_proj." in name:
            heads = config["num_attention_heads"]
        elif family.permuted_qk and ".k_proj." in name:
            heads = config["num_key_value_heads"]
        moves.append(TensorMove(tensor, name, tuple(reversed(tensor.shape)), heads))
    return moves


def llama3_rope_scaling(factors: Sequence[float], rope_theta: float, head_dim: int
                        ) -> dict[str, Any] | None:
    """Llama 3's ``rope_scaling`` recovered from the frequency factors llama.cpp stored, or None when none fits.

    llama.cpp's converter turns Meta's (factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings) into one factor per
    rotary frequency: 1 for short wavelengths, ``factor`` for long ones, a
    smooth blend between. The published Llama 3.1/3.2/3.3 settings are tried
    and the one that reproduces every stored factor (to 1e-3) is returned.
    """
    wanted = list(factors)
    half = head_dim // 2
    if len(wanted) != half:
        return None
    for factor in (8.0, 16.0, 32.0, 4.0, 2.0):
        for low, high, original in ((1.0, 4.0, 8192),):
            candidate = _llama3_factors(rope_theta, head_dim, factor, low, high, original)
            if all(abs(a - b) <= 1e-3 * max(1.0, abs(b)) for a, b in zip(candidate, wanted, strict=True)):
                return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                        "original_max_position_embeddings": original}
    return None


def _llama3_factors(theta: float, head_dim: int, factor: float, low: float, high: float, original: int
                    ) -> list[float]:
    out = []
    low_wavelen, high_wavelen = original / low, original / high
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out
