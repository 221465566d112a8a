"""Checkpoints for tests: real published configs, and header-only safetensors files that cost no disk.

``write_safetensors_header_only`` writes a valid safetensors header and then
*extends* the file with ``truncate`` so the data section is a hole: a 70B
checkpoint occupies kilobytes, yet every size and offset is what the real files
have. This module keeps its own dtype table and writes headers with ``json``
only, so tests of :mod:`edge_core.artifact` do not grade the reader against
itself.
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

#: safetensors dtype code -> bits per element.
DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "F4": 4,
}
TORCH_TO_SAFETENSORS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}

Tensors = dict[str, tuple[str, list[int]]]

# Published config.json values (Hugging Face model repositories), trimmed of
# tokenizer-only keys. Plain dicts: the KV tests read these too.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-3.1-8B": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    "meta-llama/Llama-3.1-70B": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 8192,
        "initializer_range": 0.02, "intermediate_size": 28672, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 64, "num_hidden_layers": 80,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
    },
    "mistralai/Mistral-7B-v0.1": {
        "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
        "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
        "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000,
    },
    "Qwen/Qwen2.5-0.5B": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
        "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 24,
        "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False,
        "use_sliding_window": False, "vocab_size": 151936,
    },
    # google/gemma-2-2b as published, plus the ``layer_types`` that transformers
    # >= 4.53 derives for Gemma 2 (even layers sliding): written out so the KV
    # arithmetic does not need to know Gemma's convention.
    "google/gemma-2-2b": {
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
        "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
        "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2",
        "num_attention_heads": 8, "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "torch_dtype": "float32", "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000,
        "layer_types": ["sliding_attention", "full_attention"] * 13,
    },
    # HuggingFaceTB/SmolLM2-135M-Instruct, edge's demo model (docs/vllm-cpu-facts.md names its vLLM figures).
    "HuggingFaceTB/SmolLM2-135M-Instruct": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu", "hidden_size": 576,
        "initializer_range": 0.041666666666666664, "intermediate_size": 1536, "is_llama_config": True,
        "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
        "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_interleaved": False, "rope_scaling": None, "rope_theta": 100000, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.42.3", "use_cache": True, "vocab_size": 49152,
    },
    "deepseek-ai/DeepSeek-V2-Lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
        "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
        "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
        "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
        "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096, "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
        "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
    },
}

# quantization_config blocks as the producing tools write them (llm-compressor,
# AutoGPTQ, AutoAWQ, ModelOpt, bitsandbytes, Qwen/DeepSeek fp8 releases).
_CT_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False, "strategy": "channel",
            "group_size": None, "observer": "minmax", "actorder": None, "block_structure": None}
QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "w8a8-int8": {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "global_compression_ratio": 1.45, "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None, "weights": dict(_CT_INT8),
            "input_activations": {**_CT_INT8, "dynamic": True, "strategy": "token", "observer": None}}},
    },
    "ct-fp8": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {**_CT_INT8, "type": "float"},
            "input_activations": {**_CT_INT8, "type": "float", "dynamic": True, "strategy": "token",
                                  "observer": None}}},
    },
    "w4a16": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "input_activations": None, "output_activations": None,
            "weights": {**_CT_INT8, "num_bits": 4, "strategy": "group", "group_size": 128}}},
    },
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "model_name_or_path": None,
             "model_file_base_name": "model"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": [128, 128]},
    "modelopt-fp8": {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                     "exclude_modules": ["lm_head"]},
    "modelopt-nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                       "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                     "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": False,
                     "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
                     "llm_int8_threshold": 6.0, "llm_int8_skip_modules": None},
    # The schemes one format name hides (issue 10): GPTQ at 8 bits, asymmetric, or with
    # act-order groups; fp8 with one scale per tensor (AutoFP8's static layout).
    "gptq-8bit": {"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False, "sym": True,
                  "damp_percent": 0.01, "true_sequential": True, "static_groups": False},
    "gptq-asym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": False,
                  "damp_percent": 0.01, "true_sequential": True, "static_groups": False},
    "gptq-desc-act": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True,
                      "damp_percent": 0.01, "true_sequential": True, "static_groups": False},
    "fp8-per-tensor": {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]},
    # openai/gpt-oss-20b: MXFP4 experts, everything else bf16.
    "mxfp4": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    # A method edge has no rule for (transformers' HQQ integration).
    "hqq": {"quant_method": "hqq", "skip_modules": ["lm_head"],
            "quant_config": {"weight_quant_params": {"nbits": 4, "group_size": 64, "axis": 1}}},
}


def vllm_block_bytes(config: dict[str, Any], block_size: int, dtype_bytes: int = 2) -> int:
    """vLLM 0.32's bytes per KV pool block of a full-attention model, from its own formulas: every layer's
    ``FullAttentionSpec.page_size_bytes`` (K and V of ``block_size`` tokens) in one group
    (``_get_kv_cache_bytes_per_block``, v1/core/kv_cache_utils.py)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes * block_size


def tensor_bytes(dtype: str, shape: list[int]) -> int:
    return math.prod(shape) * DTYPE_BITS[dtype] // 8


def write_safetensors_header_only(path: str | os.PathLike, tensors: Tensors,
                                  metadata: dict[str, str] | None = None) -> int:
    """Write a valid safetensors file whose data section is a sparse hole; returns the data bytes."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = tensor_bytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the safetensors writer pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def write_checkpoint(directory: str | os.PathLike, config: dict[str, Any], tensors: Tensors,
                     shards: int = 1) -> Path:
    """config.json plus model.safetensors, or ``shards`` files and model.safetensors.index.json."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config, indent=2))
    if shards == 1:
        write_safetensors_header_only(root / "model.safetensors", tensors)
        return root
    # Split in order, by bytes, the way save_pretrained fills shards up to a size.
    total = sum(tensor_bytes(*spec) for spec in tensors.values())
    groups: list[Tensors] = [{} for _ in range(shards)]
    running = 0
    for name, spec in tensors.items():
        groups[min(shards - 1, running * shards // max(total, 1))][name] = spec
        running += tensor_bytes(*spec)
    weight_map = {}
    for i, group in enumerate(groups, start=1):
        file_name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        write_safetensors_header_only(root / file_name, group)
        weight_map.update({name: file_name for name in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return root


def llama_like_tensors(config: dict[str, Any], dtype: str | None = None) -> Tensors:
    """The tensor names, dtypes and shapes a Llama/Mistral/Qwen2/Gemma2-style decoder stores.

    Qwen2 adds q/k/v biases; Gemma 2 adds pre/post feed-forward norms and ties
    the LM head to the embedding by default.
    """
    c = config
    dtype = dtype or TORCH_TO_SAFETENSORS[c.get("torch_dtype", "bfloat16")]
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    head_dim = c.get("head_dim") or hidden // heads
    inter, vocab = c["intermediate_size"], c["vocab_size"]
    gemma = c.get("model_type", "").startswith("gemma")
    qkv_bias = c.get("model_type") == "qwen2" or c.get("attention_bias", False)
    tensors: Tensors = {"model.embed_tokens.weight": (dtype, [vocab, hidden])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = (dtype, [heads * head_dim, hidden])
        tensors[p + "self_attn.k_proj.weight"] = (dtype, [kv_heads * head_dim, hidden])
        tensors[p + "self_attn.v_proj.weight"] = (dtype, [kv_heads * head_dim, hidden])
        if qkv_bias:
            tensors[p + "self_attn.q_proj.bias"] = (dtype, [heads * head_dim])
            tensors[p + "self_attn.k_proj.bias"] = (dtype, [kv_heads * head_dim])
            tensors[p + "self_attn.v_proj.bias"] = (dtype, [kv_heads * head_dim])
        tensors[p + "self_attn.o_proj.weight"] = (dtype, [hidden, heads * head_dim])
        tensors[p + "mlp.gate_proj.weight"] = (dtype, [inter, hidden])
        tensors[p + "mlp.up_proj.weight"] = (dtype, [inter, hidden])
        tensors[p + "mlp.down_proj.weight"] = (dtype, [hidden, inter])
        tensors[p + "input_layernorm.weight"] = (dtype, [hidden])
        tensors[p + "post_attention_layernorm.weight"] = (dtype, [hidden])
        if gemma:
            tensors[p + "pre_feedforward_layernorm.weight"] = (dtype, [hidden])
            tensors[p + "post_feedforward_layernorm.weight"] = (dtype, [hidden])
    tensors["model.norm.weight"] = (dtype, [hidden])
    if not c.get("tie_word_embeddings", gemma):
        tensors["lm_head.weight"] = (dtype, [vocab, hidden])
    return tensors


def deepseek_v2_tensors(config: dict[str, Any], dtype: str | None = None) -> Tensors:
    """The tensors of a DeepSeek-V2-style decoder: MLA attention, dense first layers, then MoE.

    MLA stores a low-rank KV projection (``kv_a_proj_with_mqa``: kv_lora_rank +
    qk_rope_head_dim rows) and its up-projection (``kv_b_proj``); ``q_lora_rank``
    None means a plain q_proj.
    """
    c = config
    dtype = dtype or TORCH_TO_SAFETENSORS[c.get("torch_dtype", "bfloat16")]
    hidden, heads, vocab = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    nope, rope, v_dim, rank = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
    tensors: Tensors = {"model.embed_tokens.weight": (dtype, [vocab, hidden])}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if c.get("q_lora_rank"):
            tensors[p + "self_attn.q_a_proj.weight"] = (dtype, [c["q_lora_rank"], hidden])
            tensors[p + "self_attn.q_a_layernorm.weight"] = (dtype, [c["q_lora_rank"]])
            tensors[p + "self_attn.q_b_proj.weight"] = (dtype, [heads * (nope + rope), c["q_lora_rank"]])
        else:
            tensors[p + "self_attn.q_proj.weight"] = (dtype, [heads * (nope + rope), hidden])
        tensors[p + "self_attn.kv_a_proj_with_mqa.weight"] = (dtype, [rank + rope, hidden])
        tensors[p + "self_attn.kv_a_layernorm.weight"] = (dtype, [rank])
        tensors[p + "self_attn.kv_b_proj.weight"] = (dtype, [heads * (nope + v_dim), rank])
        tensors[p + "self_attn.o_proj.weight"] = (dtype, [hidden, heads * v_dim])
        tensors[p + "input_layernorm.weight"] = (dtype, [hidden])
        tensors[p + "post_attention_layernorm.weight"] = (dtype, [hidden])
        if i < c.get("first_k_dense_replace", 0):
            inter = c["intermediate_size"]
            for name, shape in (("gate_proj", [inter, hidden]), ("up_proj", [inter, hidden]),
                                ("down_proj", [hidden, inter])):
                tensors[p + f"mlp.{name}.weight"] = (dtype, shape)
            continue
        moe = c["moe_intermediate_size"]
        tensors[p + "mlp.gate.weight"] = (dtype, [c["n_routed_experts"], hidden])
        for e in range(c["n_routed_experts"]):
            for name, shape in (("gate_proj", [moe, hidden]), ("up_proj", [moe, hidden]),
                                ("down_proj", [hidden, moe])):
                tensors[p + f"mlp.experts.{e}.{name}.weight"] = (dtype, shape)
        shared = moe * c["n_shared_experts"]
        for name, shape in (("gate_proj", [shared, hidden]), ("up_proj", [shared, hidden]),
                            ("down_proj", [hidden, shared])):
            tensors[p + f"mlp.shared_experts.{name}.weight"] = (dtype, shape)
    tensors["model.norm.weight"] = (dtype, [hidden])
    if not c.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = (dtype, [vocab, hidden])
    return tensors


_LINEAR = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
           "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def quantize_tensors(tensors: Tensors, scheme: str, group_size: int = 128) -> Tensors:
    """Replace each decoder linear weight with what ``scheme`` stores instead (keys of QUANT_CONFIGS).

    The LM head and embeddings stay dense, as the producing tools leave them.
    """
    out: Tensors = {}
    for name, (dtype, shape) in tensors.items():
        if not (name.startswith("model.layers.") and name.endswith(_LINEAR)):
            out[name] = (dtype, shape)
            continue
        base = name[: -len("weight")]
        n_out, n_in = shape
        if scheme == "w8a8-int8":
            out[name] = ("I8", shape)
            out[base + "weight_scale"] = (dtype, [n_out, 1])
        elif scheme == "ct-fp8":
            out[name] = ("F8_E4M3", shape)
            out[base + "weight_scale"] = (dtype, [n_out, 1])
        elif scheme == "w4a16":
            out[base + "weight_packed"] = ("I32", [n_out, n_in // 8])
            out[base + "weight_scale"] = (dtype, [n_out, n_in // group_size])
            out[base + "weight_shape"] = ("I64", [2])
        elif scheme.startswith("gptq"):
            per_int32 = 32 // QUANT_CONFIGS[scheme]["bits"]
            out[base + "qweight"] = ("I32", [n_in // per_int32, n_out])
            out[base + "qzeros"] = ("I32", [n_in // group_size, n_out // per_int32])
            out[base + "scales"] = ("F16", [n_in // group_size, n_out])
            out[base + "g_idx"] = ("I32", [n_in])
        elif scheme == "awq":
            out[base + "qweight"] = ("I32", [n_in, n_out // 8])
            out[base + "qzeros"] = ("I32", [n_in // group_size, n_out // 8])
            out[base + "scales"] = ("F16", [n_in // group_size, n_out])
        elif scheme == "fp8":
            out[name] = ("F8_E4M3", shape)
            out[base + "weight_scale_inv"] = ("F32", [-(-n_out // 128), -(-n_in // 128)])
        elif scheme in ("mxfp4", "hqq"):
            # gpt-oss quantizes MoE experts only (a Llama-like stack has none); HQQ's layout
            # does not matter here, only its quant_method does.
            out[name] = (dtype, shape)
        elif scheme in ("modelopt-fp8", "fp8-per-tensor"):
            out[name] = ("F8_E4M3", shape)
            out[base + "weight_scale"] = ("F32", [])
            out[base + "input_scale"] = ("F32", [])
        elif scheme == "modelopt-nvfp4":
            out[name] = ("U8", [n_out, n_in // 2])
            out[base + "weight_scale"] = ("F8_E4M3", [n_out, n_in // 16])
            out[base + "weight_scale_2"] = ("F32", [])
            out[base + "input_scale"] = ("F32", [])
        elif scheme == "bitsandbytes":
            out[name] = ("U8", [n_out * n_in // 2, 1])
            out[name + ".absmax"] = ("F32", [n_out * n_in // 64])
            out[name + ".quant_map"] = ("F32", [16])
        else:
            raise ValueError(f"unknown scheme {scheme!r}; known: {', '.join(QUANT_CONFIGS)}")
    return out


def quantized_config(config: dict[str, Any], scheme: str) -> dict[str, Any]:
    """``config`` with the ``quantization_config`` that ``scheme``'s producer writes."""
    out = copy.deepcopy(config)
    out["quantization_config"] = copy.deepcopy(QUANT_CONFIGS[scheme])
    return out


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A two-layer Llama config small enough to write real weights for."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }
    config.update(overrides)
    return config
