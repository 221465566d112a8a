"""The reference set: published checkpoints edge's verdict and KV pool are checked against (issue 10).

Each :class:`Entry` is one Hugging Face repository: its ``config.json`` as
published (transcribed; ``source`` says from where and what was recalled), the
classes of problem it stands for, a tensor inventory in the checkpoint's own
naming (written as header-only safetensors: real sizes, no disk), and the cut
that makes a copy small enough to start on this machine: fewer layers (one
period of the layer pattern, the pattern lists shortened with them) and, for
the largest MoE models, fewer experts. The KV cache does not depend on the
expert count; it does depend on the layer pattern, which the cut keeps.

``scripts/reference_vllm_cpu.py`` starts vLLM CPU itself on every cut copy
(``load_format="dummy"``, 16 greedy tokens) and stores what it did in
``tests/data/vllm_cpu_reference.json``; ``tests/test_reference_set.py``
compares edge's plans of the same copies with that file. Both build the copies
with :func:`write_cut` and plan them with :data:`SESSION` settings, so the two
sides see the same files and the same limits.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from factories import (
    KNOWN_CONFIGS,
    QUANT_CONFIGS,
    TORCH_TO_SAFETENSORS,
    Tensors,
    deepseek_v2_tensors,
    llama_like_tensors,
    quantize_tensors,
    write_checkpoint,
)
from published_configs import PUBLISHED

#: The limits both sides use for a cut copy: vLLM is started with exactly these and
#: edge plans with them (``max_model_len`` is capped at the model's own context).
SESSION = {"max_model_len": 8192, "max_num_seqs": 1, "max_num_batched_tokens": 2048}

#: Tokens each reference run generates (greedy, EOS ignored).
REFERENCE_TOKENS = 16

#: Classes of problem issue 10 names; every entry carries at least one, every class has an entry.
CLASSES = (
    "plain_gqa", "tied_embeddings", "sliding_window", "mla", "moe", "hybrid_mamba2", "hybrid_mamba1",
    "hybrid_gated_deltanet", "multimodal_wrapper", "library_defaults", "quantized",
)


@dataclass(frozen=True)
class Entry:
    """One published checkpoint of the reference set."""

    repo: str
    classes: tuple[str, ...]
    config: dict[str, Any]
    family: str
    source: str
    cut: dict[str, Any] = field(default_factory=dict)
    #: A quantization scheme of ``factories.QUANT_CONFIGS`` the weights are stored in, if any.
    scheme: str | None = None

    @property
    def name(self) -> str:
        return self.repo.replace("/", "--")


def _text(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: ``text_config`` of a wrapper, else the config itself."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _with_quant(config: dict[str, Any], scheme: str, **overrides: Any) -> dict[str, Any]:
    out = copy.deepcopy(config)
    out.update(overrides)
    out["quantization_config"] = copy.deepcopy(QUANT_CONFIGS[scheme])
    return out


def _drop(config: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k not in keys}


# --- published configs not used elsewhere in the tests ------------------------------------

LLAMA_32_1B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
LLAMA_3_8B_INSTRUCT = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128009, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
QWEN25_05B_INSTRUCT_FP16 = {**KNOWN_CONFIGS["Qwen/Qwen2.5-0.5B"], "eos_token_id": 151645, "torch_dtype": "float16"}
MISTRAL_7B_INSTRUCT_V02 = {
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 32000,
}

GEMMA_3_1B_IT = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}
PHI_4_MINI_INSTRUCT = {
    "architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 199999, "embd_pdrop": 0.0, "eos_token_id": 199999, "full_attn_mod": 1, "hidden_act": "silu",
    "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 8192, "interpolate_factor": 1,
    "lm_head_bias": False, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "phi3",
    "num_attention_heads": 24, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "original_max_position_embeddings": 4096, "pad_token_id": 199999, "partial_rotary_factor": 0.75,
    "resid_pdrop": 0.0, "rms_norm_eps": 1e-05,
    # 48 factors each (head_dim 128 x 0.75 / 2); the published values are not transcribed:
    # they scale RoPE frequencies and enter no memory figure.
    "rope_scaling": {"long_factor": [1.0] * 48, "short_factor": [1.0] * 48, "type": "longrope"},
    "rope_theta": 10000.0, "sliding_window": 262144, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "vocab_size": 200064,
}
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "quantization_config": copy.deepcopy(QUANT_CONFIGS["mxfp4"]), "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
    "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
DEEPSEEK_V3 = {
    # auto_map (the repo's remote code) left out: vLLM registers DeepseekV3ForCausalLM itself.
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
JAMBA_MINI_15 = {
    "architectures": ["JambaForCausalLM"], "attention_dropout": 0.0, "attn_layer_offset": 4, "attn_layer_period": 8,
    "bos_token_id": 1, "eos_token_id": [2, 518], "expert_layer_offset": 1, "expert_layer_period": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "mamba_conv_bias": True, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_dt_rank": 256, "mamba_expand": 2,
    "mamba_proj_bias": False, "max_position_embeddings": 262144, "model_type": "jamba", "num_attention_heads": 32,
    "num_experts": 16, "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8,
    "num_logits_to_keep": 1, "output_router_logits": False, "pad_token_id": 0, "rms_norm_eps": 1e-06,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_mamba_kernels": True, "vocab_size": 65536,
}
QWEN25_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "vocab_size": 151936,
}
MISTRAL_SMALL_31 = {
    "architectures": ["Mistral3ForConditionalGeneration"], "image_token_index": 10, "model_type": "mistral3",
    "multimodal_projector_bias": False, "projector_hidden_act": "gelu", "spatial_merge_size": 2,
    "text_config": {
        "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
        "initializer_range": 0.02, "intermediate_size": 32768, "max_position_embeddings": 131072,
        "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 40, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000000.0, "sliding_window": None, "use_cache": True,
        "vocab_size": 131072,
    },
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
    "vision_config": {"attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024,
                      "image_size": 1540, "initializer_range": 0.02, "intermediate_size": 4096,
                      "model_type": "pixtral", "num_attention_heads": 16, "num_channels": 3,
                      "num_hidden_layers": 24, "patch_size": 14, "rope_theta": 10000.0},
    "vision_feature_layer": -1,
}
#: gemma-3-4b-it's language model alone: the published wrapper's ``text_config`` (six fields)
#: as a text checkpoint, so vLLM runs it without the vision stack and edge's defaults are checked
#: against vLLM's (both come from transformers' Gemma3TextConfig).
GEMMA_3_4B_TEXT_TOWER = {
    **PUBLISHED["google/gemma-3-4b-it"]["text_config"], "architectures": ["Gemma3ForCausalLM"],
    "torch_dtype": "bfloat16",
}


# --- tensor inventories ---------------------------------------------------------------------


def _attention(p: str, hidden: int, heads: int, kv_heads: int, head_dim: int, dtype: str, *,
               bias: bool = False, gated_q: bool = False, qk_norm: bool = False) -> Tensors:
    q_rows = heads * head_dim * (2 if gated_q else 1)
    t: Tensors = {
        p + "q_proj.weight": (dtype, [q_rows, hidden]), p + "k_proj.weight": (dtype, [kv_heads * head_dim, hidden]),
        p + "v_proj.weight": (dtype, [kv_heads * head_dim, hidden]), p + "o_proj.weight": (dtype, [hidden, heads * head_dim]),
    }
    if bias:
        t.update({p + "q_proj.bias": (dtype, [heads * head_dim]), p + "k_proj.bias": (dtype, [kv_heads * head_dim]),
                  p + "v_proj.bias": (dtype, [kv_heads * head_dim]), p + "o_proj.bias": (dtype, [hidden])})
    if qk_norm:
        t.update({p + "q_norm.weight": (dtype, [head_dim]), p + "k_norm.weight": (dtype, [head_dim])})
    return t


def _mlp(p: str, hidden: int, inter: int, dtype: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
         ) -> Tensors:
    gate, up, down = names
    return {p + f"{gate}.weight": (dtype, [inter, hidden]), p + f"{up}.weight": (dtype, [inter, hidden]),
            p + f"{down}.weight": (dtype, [hidden, inter])}


def _head(c: dict[str, Any], dtype: str, prefix: str = "model.") -> Tensors:
    t: Tensors = {prefix + "norm.weight": (dtype, [c["hidden_size"]])}
    if not c.get("tie_word_embeddings", False):
        t["lm_head.weight"] = (dtype, [c["vocab_size"], c["hidden_size"]])
    return t


def _dims(c: dict[str, Any]) -> tuple[int, int, int, int]:
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    return hidden, heads, c.get("num_key_value_heads", heads), c.get("head_dim") or hidden // heads


def _qwen3_tensors(c: dict[str, Any], dtype: str) -> Tensors:
    hidden, heads, kv, hd = _dims(c)
    t: Tensors = {"model.embed_tokens.weight": (dtype, [c["vocab_size"], hidden])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update(_attention(p + "self_attn.", hidden, heads, kv, hd, dtype, qk_norm=True))
        t.update(_mlp(p + "mlp.", hidden, c["intermediate_size"], dtype))
        t.update({p + "input_layernorm.weight": (dtype, [hidden]), p + "post_attention_layernorm.weight": (dtype, [hidden])})
    return {**t, **_head(c, dtype)}


def _phi3_tensors(c: dict[str, Any], dtype: str) -> Tensors:
    hidden, heads, kv, hd = _dims(c)
    inter = c["intermediate_size"]
    t: Tensors = {"model.embed_tokens.weight": (dtype, [c["vocab_size"], hidden])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({p + "self_attn.qkv_proj.weight": (dtype, [(heads + 2 * kv) * hd, hidden]),
                  p + "self_attn.o_proj.weight": (dtype, [hidden, heads * hd]),
                  p + "mlp.gate_up_proj.weight": (dtype, [2 * inter, hidden]),
                  p + "mlp.down_proj.weight": (dtype, [hidden, inter]),
                  p + "input_layernorm.weight": (dtype, [hidden]),
                  p + "post_attention_layernorm.weight": (dtype, [hidden])})
    return {**t, **_head(c, dtype)}


def _moe_tensors(c: dict[str, Any], dtype: str) -> Tensors:
    """Mixtral (``block_sparse_moe.experts.E.w1/w2/w3``) and Qwen3-MoE (``mlp.experts.E.gate_proj``...)."""
    hidden, heads, kv, hd = _dims(c)
    mixtral = c["model_type"] == "mixtral"
    experts = c["num_local_experts"] if mixtral else c["num_experts"]
    inter = c["intermediate_size"] if mixtral else c["moe_intermediate_size"]
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    moe = "block_sparse_moe." if mixtral else "mlp."
    t: Tensors = {"model.embed_tokens.weight": (dtype, [c["vocab_size"], hidden])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update(_attention(p + "self_attn.", hidden, heads, kv, hd, dtype, qk_norm=not mixtral))
        t[p + moe + "gate.weight"] = (dtype, [experts, hidden])
        for e in range(experts):
            t.update(_mlp(p + moe + f"experts.{e}.", hidden, inter, dtype, names))
        t.update({p + "input_layernorm.weight": (dtype, [hidden]), p + "post_attention_layernorm.weight": (dtype, [hidden])})
    return {**t, **_head(c, dtype)}


def _gpt_oss_tensors(c: dict[str, Any], dtype: str) -> Tensors:
    """gpt-oss as released: bf16 attention (with biases and sinks), MXFP4 experts as U8 blocks and scales."""
    hidden, heads, kv, hd = _dims(c)
    experts, inter = c["num_local_experts"], c["intermediate_size"]
    t: Tensors = {"model.embed_tokens.weight": (dtype, [c["vocab_size"], hidden])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update(_attention(p + "self_attn.", hidden, heads, kv, hd, dtype, bias=True))
        t[p + "self_attn.sinks"] = (dtype, [heads])
        t.update({p + "mlp.router.weight": (dtype, [experts, hidden]), p + "mlp.router.bias": (dtype, [experts])})
        for name, rows, cols in (("gate_up_proj", 2 * inter, hidden), ("down_proj", hidden, inter)):
            t[p + f"mlp.experts.{name}_blocks"] = ("U8", [experts, rows, cols // 32, 16])
            t[p + f"mlp.experts.{name}_scales"] = ("U8", [experts, rows, cols // 32])
            t[p + f"mlp.experts.{name}_bias"] = (dtype, [experts, rows])
        t.update({p + "input_layernorm.weight": (dtype, [hidden]), p + "post_attention_layernorm.weight": (dtype, [hidden])})
    return {**t, **_head(c, dtype)}


def _mamba2_mixer(p: str, hidden: int, heads: int, head_dim: int, groups: int, state: int, conv: int,
                  dtype: str) -> Tensors:
    d_ssm = heads * head_dim
    conv_dim = d_ssm + 2 * groups * state
    return {
        p + "in_proj.weight": (dtype, [2 * d_ssm + 2 * groups * state + heads, hidden]),
        p + "conv1d.weight": (dtype, [conv_dim, 1, conv]), p + "conv1d.bias": (dtype, [conv_dim]),
        p + "A_log": (dtype, [heads]), p + "D": (dtype, [heads]), p + "dt_bias": (dtype, [heads]),
        p + "norm.weight": (dtype, [d_ssm]), p + "out_proj.weight": (dtype, [hidden, d_ssm]),
    }


def _granite_hybrid_tensors(c: dict[str, Any], dtype: str) -> Tensors:
    hidden, heads, kv, hd = _dims(c)
    experts, inter, shared = c["num_local_experts"], c["intermediate_size"], c["shared_intermediate_size"]
    t: Tensors = {"model.embed_tokens.weight": (dtype, [c["vocab_size"], hidden])}
    for i, kind in enumerate(c["layer_types"]):
        p = f"model.layers.{i}."
        if kind == "mamba":
            t.update(_mamba2_mixer(p + "mamba.", hidden, c["mamba_n_heads"], c["mamba_d_head"], c["mamba_n_groups"],
                                   c["mamba_d_state"], c["mamba_d_conv"], dtype))
        else:
            t.update(_attention(p + "self_attn.", hidden, heads, kv, hd, dtype))
        t.update({p + "block_sparse_moe.input_linear.weight": (dtype, [experts, 2 * inter, hidden]),
                  p + "block_sparse_moe.output_linear.weight": (dtype, [experts, hidden, inter]),
                  p + "block_sparse_moe.router.layer.weight": (dtype, [experts, hidden]),
                  p + "shared_mlp.input_linear.weight": (dtype, [2 * shared, hidden]),
                  p + "shared_mlp.output_linear.weight": (dtype, [hidden, shared]),
                  p + "input_layernorm.weight": (dtype, [hidden]),
                  p + "post_attention_layernorm.weight": (dtype, [hidden])})
    return {**t, **_head(c, dtype)}


def _falcon_h1_tensors(c: dict[str, Any], dtype: str) -> Tensors:
    hidden, heads, kv, hd = _dims(c)
    t: Tensors = {"model.embed_tokens.weight": (dtype, [c["vocab_size"], hidden])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update(_mamba2_mixer(p + "mamba.", hidden, c["mamba_n_heads"], c["mamba_d_head"], c["mamba_n_groups"],
                               c["mamba_d_state"], c["mamba_d_conv"], dtype))
        t.update(_attention(p + "self_attn.", hidden, heads, kv, hd, dtype))
        t.update(_mlp(p + "feed_forward.", hidden, c["intermediate_size"], dtype))
        t.update({p + "input_layernorm.weight": (dtype, [hidden]), p + "pre_ff_layernorm.weight": (dtype, [hidden])})
    t["model.final_layernorm.weight"] = (dtype, [hidden])
    if not c.get("tie_word_embeddings", False):
        t["lm_head.weight"] = (dtype, [c["vocab_size"], hidden])
    return t


def _nemotron_h_tensors(c: dict[str, Any], dtype: str) -> Tensors:
    hidden, heads, kv, hd = _dims(c)
    t: Tensors = {"backbone.embeddings.weight": (dtype, [c["vocab_size"], hidden])}
    for i, kind in enumerate(c["hybrid_override_pattern"]):
        p = f"backbone.layers.{i}."
        t[p + "norm.weight"] = (dtype, [hidden])
        if kind == "M":
            t.update(_mamba2_mixer(p + "mixer.", hidden, c["mamba_num_heads"], c["mamba_head_dim"], c["n_groups"],
                                   c["ssm_state_size"], c["conv_kernel"], dtype))
        elif kind == "*":
            t.update(_attention(p + "mixer.", hidden, heads, kv, hd, dtype))
        else:
            t.update({p + "mixer.up_proj.weight": (dtype, [c["intermediate_size"], hidden]),
                      p + "mixer.down_proj.weight": (dtype, [hidden, c["intermediate_size"]])})
    t.update({"backbone.norm_f.weight": (dtype, [hidden]), "lm_head.weight": (dtype, [c["vocab_size"], hidden])})
    return t


def _qwen3_next_tensors(c: dict[str, Any], dtype: str) -> Tensors:
    hidden, heads, kv, hd = _dims(c)
    interval = c.get("full_attention_interval", 4)
    nk, nv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    key_dim, value_dim = nk * dk, nv * dv
    experts, moe, shared = c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    t: Tensors = {"model.embed_tokens.weight": (dtype, [c["vocab_size"], hidden])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if (i + 1) % interval == 0:
            t.update(_attention(p + "self_attn.", hidden, heads, kv, hd, dtype, gated_q=True, qk_norm=True))
        else:
            q = p + "linear_attn."
            t.update({q + "in_proj_qkvz.weight": (dtype, [2 * key_dim + 2 * value_dim, hidden]),
                      q + "in_proj_ba.weight": (dtype, [2 * nv, hidden]),
                      q + "conv1d.weight": (dtype, [2 * key_dim + value_dim, 1, c["linear_conv_kernel_dim"]]),
                      q + "dt_bias": (dtype, [nv]), q + "A_log": (dtype, [nv]), q + "norm.weight": (dtype, [dv]),
                      q + "out_proj.weight": (dtype, [hidden, value_dim])})
        t[p + "mlp.gate.weight"] = (dtype, [experts, hidden])
        for e in range(experts):
            t.update(_mlp(p + f"mlp.experts.{e}.", hidden, moe, dtype))
        t.update(_mlp(p + "mlp.shared_expert.", hidden, shared, dtype))
        t[p + "mlp.shared_expert_gate.weight"] = (dtype, [1, hidden])
        t.update({p + "input_layernorm.weight": (dtype, [hidden]), p + "post_attention_layernorm.weight": (dtype, [hidden])})
    return {**t, **_head(c, dtype)}


def _jamba_tensors(c: dict[str, Any], dtype: str) -> Tensors:
    hidden, heads, kv, hd = _dims(c)
    inner, rank, state = c["mamba_expand"] * hidden, c["mamba_dt_rank"], c["mamba_d_state"]
    t: Tensors = {"model.embed_tokens.weight": (dtype, [c["vocab_size"], hidden])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if i % c["attn_layer_period"] == c["attn_layer_offset"]:
            t.update(_attention(p + "self_attn.", hidden, heads, kv, hd, dtype))
        else:
            m = p + "mamba."
            t.update({m + "in_proj.weight": (dtype, [2 * inner, hidden]),
                      m + "conv1d.weight": (dtype, [inner, 1, c["mamba_d_conv"]]), m + "conv1d.bias": (dtype, [inner]),
                      m + "x_proj.weight": (dtype, [rank + 2 * state, inner]),
                      m + "dt_proj.weight": (dtype, [inner, rank]), m + "dt_proj.bias": (dtype, [inner]),
                      m + "A_log": (dtype, [inner, state]), m + "D": (dtype, [inner]),
                      m + "out_proj.weight": (dtype, [hidden, inner]), m + "dt_layernorm.weight": (dtype, [rank]),
                      m + "b_layernorm.weight": (dtype, [state]), m + "c_layernorm.weight": (dtype, [state])})
        if i % c["expert_layer_period"] == c["expert_layer_offset"]:
            t[p + "feed_forward.router.weight"] = (dtype, [c["num_experts"], hidden])
            for e in range(c["num_experts"]):
                t.update(_mlp(p + f"feed_forward.experts.{e}.", hidden, c["intermediate_size"], dtype))
        else:
            t.update(_mlp(p + "feed_forward.", hidden, c["intermediate_size"], dtype))
        t.update({p + "input_layernorm.weight": (dtype, [hidden]), p + "pre_ff_layernorm.weight": (dtype, [hidden])})
    t["model.final_layernorm.weight"] = (dtype, [hidden])
    if not c.get("tie_word_embeddings", False):
        t["lm_head.weight"] = (dtype, [c["vocab_size"], hidden])
    return t


def _vision_tower(p: str, layers: int, hidden: int, inter: int, dtype: str) -> Tensors:
    """A ViT encoder's per-layer weights (attention q/k/v/o, two-matrix MLP), as the wrappers store them."""
    t: Tensors = {}
    for i in range(layers):
        q = f"{p}{i}."
        t.update(_attention(q + "attn.", hidden, 1, 1, hidden, dtype, bias=True))
        t.update({q + "mlp.fc1.weight": (dtype, [inter, hidden]), q + "mlp.fc2.weight": (dtype, [hidden, inter]),
                  q + "norm1.weight": (dtype, [hidden]), q + "norm2.weight": (dtype, [hidden])})
    return t


def _wrapper_tensors(c: dict[str, Any], dtype: str) -> Tensors:
    """Multimodal wrappers: the language model under its published prefix, plus the vision tower.

    The language model's tensors are exact; the vision tower's are its layers' shapes under
    one generic naming (edge plans a tower by its bytes, and vLLM fails on these models here
    before any weight is read).
    """
    text, vision = _text(c), c["vision_config"]
    if c["model_type"] == "qwen2_5_vl":
        lm = llama_like_tensors({**text, "model_type": "qwen2"}, dtype)
        tower = _vision_tower("visual.blocks.", vision["depth"], vision["hidden_size"], vision["intermediate_size"],
                              dtype)
        return {**lm, **tower, "visual.merger.mlp.0.weight": (dtype, [4 * vision["hidden_size"]] * 2),
                "visual.merger.mlp.2.weight": (dtype, [vision["out_hidden_size"], 4 * vision["hidden_size"]])}
    lm = llama_like_tensors({"tie_word_embeddings": c["model_type"] == "gemma3", **text}, dtype)
    tower = _vision_tower("vision_tower.encoder.layers.", vision["num_hidden_layers"], vision["hidden_size"],
                          vision["intermediate_size"], dtype)
    out = {("language_model." + k): v for k, v in lm.items()}
    out.update(tower)
    out["multi_modal_projector.linear.weight"] = (dtype, [text["hidden_size"], vision["hidden_size"]])
    return out


def _fp8_block_all(tensors: Tensors) -> Tensors:
    """DeepSeek-V3's release: every decoder matrix but the router stored as fp8 with 128x128 block scales."""
    out: Tensors = {}
    for name, (dtype, shape) in tensors.items():
        if (name.startswith("model.layers.") and name.endswith(".weight") and len(shape) == 2
                and not name.endswith(("norm.weight", "mlp.gate.weight"))):
            out[name] = ("F8_E4M3", shape)
            out[name[: -len("weight")] + "weight_scale_inv"] = ("F32", [-(-shape[0] // 128), -(-shape[1] // 128)])
        else:
            out[name] = (dtype, shape)
    return out


_FAMILIES = {
    "llama": llama_like_tensors, "qwen3": _qwen3_tensors, "phi3": _phi3_tensors, "moe": _moe_tensors,
    "gpt_oss": _gpt_oss_tensors, "deepseek": deepseek_v2_tensors, "granite_hybrid": _granite_hybrid_tensors,
    "falcon_h1": _falcon_h1_tensors, "nemotron_h": _nemotron_h_tensors, "qwen3_next": _qwen3_next_tensors,
    "jamba": _jamba_tensors, "wrapper": _wrapper_tensors,
}


#: The shapes Gemma 3's published shards have where its config leaves them to
#: Gemma3TextConfig's defaults (8 heads, 4 KV heads of 256, 262208 tokens). Used for the
#: tensor inventory only: what edge plans from is its own reading of the config.
_GEMMA3_TEXT_SHAPES = {"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "vocab_size": 262208}


def tensors_for(entry: Entry, config: dict[str, Any]) -> Tensors:
    """The tensor inventory of ``config`` (the published one or a cut) in ``entry``'s checkpoint format."""
    if _text(config).get("model_type") == "gemma3_text":
        config = copy.deepcopy(config)
        text = _text(config)
        text.update({k: v for k, v in _GEMMA3_TEXT_SHAPES.items() if k not in text})
    dtype = TORCH_TO_SAFETENSORS[config.get("torch_dtype") or _text(config).get("torch_dtype") or "bfloat16"]
    if entry.family == "wrapper":
        tensors = _wrapper_tensors(config, dtype)
    else:
        tensors = _FAMILIES[entry.family](config, dtype)
    if entry.family == "deepseek" and "quantization_config" in config:
        return _fp8_block_all(tensors)
    if entry.scheme is not None:
        return quantize_tensors(tensors, entry.scheme)
    return tensors


_PATTERNS = ("layer_types", "layers_block_type")


def cut_config(entry: Entry) -> dict[str, Any]:
    """The published config with ``entry.cut`` applied to its language model, layer patterns shortened to match."""
    config = copy.deepcopy(entry.config)
    text = _text(config)
    text.update(copy.deepcopy(entry.cut))
    layers = text["num_hidden_layers"]
    for key in _PATTERNS:
        if isinstance(text.get(key), list) and key not in entry.cut:
            text[key] = text[key][:layers]
    if isinstance(text.get("hybrid_override_pattern"), str) and "hybrid_override_pattern" not in entry.cut:
        text["hybrid_override_pattern"] = text["hybrid_override_pattern"][:layers]
    return config


#: The demo checkpoint's tokenizer files: vLLM needs a tokenizer to start; the reference
#: runs feed token ids and do not detokenize, so its small vocabulary does not matter.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def write_published(entry: Entry, directory: Path) -> Path:
    """The checkpoint as published: config.json and header-only shards of the full inventory."""
    tensors = tensors_for(entry, entry.config)
    return write_checkpoint(directory, entry.config, tensors, shards=4 if len(tensors) > 64 else 1)


def write_cut(entry: Entry, directory: Path, tokenizer_from: Path | None = None) -> Path:
    """The cut copy both sides run and plan; the demo tokenizer is copied in when ``tokenizer_from`` is given."""
    config = cut_config(entry)
    root = write_checkpoint(directory, config, tensors_for(entry, config))
    if tokenizer_from is not None:
        for name in _TOKENIZER_FILES:
            shutil.copyfile(tokenizer_from / name, root / name)
    return root


def session_for(entry: Entry) -> dict[str, int]:
    """:data:`SESSION` with ``max_model_len`` capped at the model's own context."""
    context = _text(entry.config).get("max_position_embeddings") or SESSION["max_model_len"]
    return {**SESSION, "max_model_len": min(SESSION["max_model_len"], int(context))}


_K = KNOWN_CONFIGS
_P = PUBLISHED
_SRC_KNOWN = "config.json as on its Hub page (tests/factories.py KNOWN_CONFIGS)"
_SRC_PUB = "config.json as on its Hub page (tests/published_configs.py says which fields were checked twice)"
_SRC_MEM = "config.json as on its Hub page, transcribed from memory of the published file"
_SRC_QUANT = ("the base model's config.json with the quantization_config its producer writes "
              "(tests/factories.py QUANT_CONFIGS), transcribed from memory of the published file")

ENTRIES: tuple[Entry, ...] = (
    Entry("meta-llama/Llama-3.1-8B", ("plain_gqa",), _K["meta-llama/Llama-3.1-8B"], "llama", _SRC_KNOWN,
          {"num_hidden_layers": 2}),
    Entry("Qwen/Qwen2.5-0.5B", ("tied_embeddings", "plain_gqa"), _K["Qwen/Qwen2.5-0.5B"], "llama", _SRC_KNOWN,
          {"num_hidden_layers": 2}),
    Entry("Qwen/Qwen3-0.6B", ("tied_embeddings", "plain_gqa"), QWEN3_06B, "qwen3", _SRC_MEM,
          {"num_hidden_layers": 2}),
    Entry("mistralai/Mistral-7B-v0.1", ("sliding_window",), _K["mistralai/Mistral-7B-v0.1"], "llama", _SRC_KNOWN,
          {"num_hidden_layers": 2}),
    # Published without layer_types (transformers derives Gemma 2's alternation).
    Entry("google/gemma-2-2b", ("sliding_window", "library_defaults"), _drop(_K["google/gemma-2-2b"], "layer_types"),
          "llama", _SRC_KNOWN + "; the layer_types added there for other tests are dropped", {"num_hidden_layers": 2}),
    Entry("google/gemma-3-1b-it", ("sliding_window", "tied_embeddings"), GEMMA_3_1B_IT, "llama", _SRC_MEM,
          {"num_hidden_layers": 6}),
    Entry("microsoft/Phi-4-mini-instruct", ("sliding_window", "tied_embeddings"), PHI_4_MINI_INSTRUCT, "phi3",
          _SRC_MEM + "; the 48 longrope factors are written as 1.0", {"num_hidden_layers": 2}),
    Entry("openai/gpt-oss-20b", ("sliding_window", "moe", "quantized"), GPT_OSS_20B, "gpt_oss", _SRC_MEM,
          {"num_hidden_layers": 2}),
    Entry("deepseek-ai/DeepSeek-V2-Lite", ("mla", "moe"), _K["deepseek-ai/DeepSeek-V2-Lite"], "deepseek", _SRC_KNOWN,
          {"num_hidden_layers": 2}),
    Entry("deepseek-ai/DeepSeek-V3", ("mla", "moe", "quantized"), DEEPSEEK_V3, "deepseek", _SRC_MEM,
          {"num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 16}),
    Entry("mistralai/Mixtral-8x7B-v0.1", ("moe",), MIXTRAL_8X7B, "moe", _SRC_MEM, {"num_hidden_layers": 1}),
    Entry("Qwen/Qwen3-30B-A3B", ("moe",), QWEN3_30B_A3B, "moe", _SRC_MEM, {"num_hidden_layers": 2}),
    Entry("ibm-granite/granite-4.0-h-tiny", ("hybrid_mamba2", "moe"), _P["ibm-granite/granite-4.0-h-tiny"],
          "granite_hybrid", _SRC_PUB, {"num_hidden_layers": 10}),
    Entry("tiiuae/Falcon-H1-7B-Instruct", ("hybrid_mamba2",), _P["tiiuae/Falcon-H1-7B-Instruct"], "falcon_h1",
          _SRC_PUB, {"num_hidden_layers": 2}),
    Entry("nvidia/NVIDIA-Nemotron-Nano-9B-v2", ("hybrid_mamba2",), _P["nvidia/NVIDIA-Nemotron-Nano-9B-v2"],
          "nemotron_h", _SRC_PUB, {"num_hidden_layers": 15}),
    Entry("Qwen/Qwen3-Next-80B-A3B-Instruct", ("hybrid_gated_deltanet", "moe"),
          _P["Qwen/Qwen3-Next-80B-A3B-Instruct"], "qwen3_next", _SRC_PUB,
          {"num_hidden_layers": 4, "num_experts": 16}),
    Entry("ai21labs/AI21-Jamba-Mini-1.5", ("hybrid_mamba1", "moe"), JAMBA_MINI_15, "jamba", _SRC_MEM,
          {"num_hidden_layers": 8, "num_experts": 2}),
    Entry("Qwen/Qwen2.5-VL-3B-Instruct", ("multimodal_wrapper",), QWEN25_VL_3B, "wrapper", _SRC_MEM,
          {"num_hidden_layers": 2}),
    Entry("mistralai/Mistral-Small-3.1-24B-Instruct-2503", ("multimodal_wrapper",), MISTRAL_SMALL_31, "wrapper",
          _SRC_MEM, {"num_hidden_layers": 2}),
    Entry("google/gemma-3-4b-it", ("multimodal_wrapper", "library_defaults", "sliding_window"),
          _P["google/gemma-3-4b-it"], "wrapper", _SRC_PUB, {"num_hidden_layers": 6}),
    Entry("google/gemma-3-4b-it:text_config", ("library_defaults", "sliding_window"), GEMMA_3_4B_TEXT_TOWER, "llama",
          "the text_config of google/gemma-3-4b-it's published config.json, as a text-only Gemma3ForCausalLM",
          {"num_hidden_layers": 6}),
    # Quantized releases; each is planned and run like the rest.
    Entry("Qwen/Qwen2.5-0.5B-Instruct-GPTQ-Int4", ("quantized",), _with_quant(QWEN25_05B_INSTRUCT_FP16, "gptq"),
          "llama", _SRC_QUANT, {"num_hidden_layers": 2}, scheme="gptq"),
    Entry("Qwen/Qwen2.5-0.5B-Instruct-GPTQ-Int8", ("quantized",), _with_quant(QWEN25_05B_INSTRUCT_FP16, "gptq-8bit"),
          "llama", _SRC_QUANT, {"num_hidden_layers": 2}, scheme="gptq-8bit"),
    Entry("Qwen/Qwen2.5-0.5B-Instruct-AWQ", ("quantized",), _with_quant(QWEN25_05B_INSTRUCT_FP16, "awq"),
          "llama", _SRC_QUANT, {"num_hidden_layers": 2}, scheme="awq"),
    Entry("TheBloke/Mistral-7B-Instruct-v0.2-GPTQ", ("quantized",),
          _with_quant(MISTRAL_7B_INSTRUCT_V02, "gptq-desc-act", torch_dtype="float16"),
          "llama", _SRC_QUANT, {"num_hidden_layers": 2}, scheme="gptq-desc-act"),
    Entry("RedHatAI/Llama-3.2-1B-Instruct-quantized.w8a8", ("quantized", "tied_embeddings"),
          _with_quant(LLAMA_32_1B_INSTRUCT, "w8a8-int8"), "llama", _SRC_QUANT, {"num_hidden_layers": 2},
          scheme="w8a8-int8"),
    Entry("RedHatAI/Llama-3.2-1B-Instruct-quantized.w4a16", ("quantized",),
          _with_quant(LLAMA_32_1B_INSTRUCT, "w4a16"), "llama", _SRC_QUANT, {"num_hidden_layers": 2}, scheme="w4a16"),
    Entry("RedHatAI/Llama-3.2-1B-Instruct-FP8-dynamic", ("quantized",), _with_quant(LLAMA_32_1B_INSTRUCT, "ct-fp8"),
          "llama", _SRC_QUANT, {"num_hidden_layers": 2}, scheme="ct-fp8"),
    Entry("Qwen/Qwen3-0.6B-FP8", ("quantized",), _with_quant(QWEN3_06B, "fp8"), "qwen3", _SRC_QUANT,
          {"num_hidden_layers": 2}, scheme="fp8"),
    Entry("neuralmagic/Meta-Llama-3-8B-Instruct-FP8", ("quantized",), _with_quant(LLAMA_3_8B_INSTRUCT, "fp8-per-tensor"),
          "llama", _SRC_QUANT, {"num_hidden_layers": 2}, scheme="fp8-per-tensor"),
    Entry("unsloth/Llama-3.2-1B-Instruct-bnb-4bit", ("quantized",), _with_quant(LLAMA_32_1B_INSTRUCT, "bitsandbytes"),
          "llama", _SRC_QUANT, {"num_hidden_layers": 2}, scheme="bitsandbytes"),
    Entry("nvidia/Llama-3.1-8B-Instruct-FP4", ("quantized",), _with_quant(_K["meta-llama/Llama-3.1-8B"], "modelopt-nvfp4"),
          "llama", _SRC_QUANT, {"num_hidden_layers": 2}, scheme="modelopt-nvfp4"),
)

BY_NAME = {e.name: e for e in ENTRIES}
