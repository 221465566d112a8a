"""Published ``config.json`` files of hybrid and default-relying models, transcribed for the KV and artifact tests.

Plain dicts keyed by Hugging Face repository id. Each entry says where its
fields come from. Only these fields decide the KV arithmetic and vLLM's
allocator: layer count and pattern, attention heads / KV heads / head_dim,
the Mamba / gated-DeltaNet state geometry, dtype. Tokenizer, RoPE and
routing fields are kept where they were sure, or dropped. A field noted as
"recalled" was not checked against a second copy.
"""

from __future__ import annotations

from typing import Any

GRANITE_4_H_TINY_LAYER_TYPES = (["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"]
                                + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4)

PUBLISHED: dict[str, dict[str, Any]] = {
    # ibm-granite/granite-4.0-h-tiny config.json (transformers 4.56 era). The
    # geometry (hidden 1536, 40 layers, 12 heads / 4 KV heads, 48 Mamba-2 heads
    # of 64, d_state 128, 1 group, d_conv 4, expand 2, the 40-entry layer_types
    # with attention at 5, 15, 25, 35) was checked against two independent
    # public copies (a simulator's GRANITE_H_TINY_HF fixture and an mlx port's
    # test); the MoE and multiplier fields are recalled from the model card's file.
    "ibm-granite/granite-4.0-h-tiny": {
        "architectures": ["GraniteMoeHybridForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "attention_multiplier": 0.0078125, "bos_token_id": 100257, "embedding_multiplier": 12,
        "eos_token_id": 100257, "hidden_act": "silu", "hidden_size": 1536, "init_method": "mup",
        "initializer_range": 0.1, "intermediate_size": 512, "layer_types": GRANITE_4_H_TINY_LAYER_TYPES,
        "logits_scaling": 6, "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_d_conv": 4,
        "mamba_d_head": 64, "mamba_d_state": 128, "mamba_expand": 2, "mamba_n_groups": 1, "mamba_n_heads": 48,
        "mamba_proj_bias": False, "max_position_embeddings": 131072, "model_type": "granitemoehybrid",
        "normalization_function": "rmsnorm", "num_attention_heads": 12, "num_experts_per_tok": 6,
        "num_hidden_layers": 40, "num_key_value_heads": 4, "num_local_experts": 64, "output_router_logits": False,
        "pad_token_id": 100256, "position_embedding_type": "nope", "residual_multiplier": 0.22,
        "rms_norm_eps": 1e-05, "rope_theta": 10000, "router_aux_loss_coef": 0.0,
        "shared_intermediate_size": 1024, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 100352,
    },
    # tiiuae/Falcon-H1-7B-Instruct config.json: every field below appears
    # identically in two independent public transcriptions (a Swift sizing
    # test quoting mlx-community's copy, and a simulator's FALCON_H1_7B_HF
    # fixture); attention and a Mamba-2 mixer run side by side in all 44 layers.
    "tiiuae/Falcon-H1-7B-Instruct": {
        "architectures": ["FalconH1ForCausalLM"], "attn_layer_indices": None, "head_dim": 128,
        "hidden_size": 3072, "intermediate_size": 12288, "mamba_chunk_size": 128, "mamba_d_conv": 4,
        "mamba_d_head": 128, "mamba_d_ssm": 3072, "mamba_d_state": 256, "mamba_expand": 2, "mamba_n_groups": 1,
        "mamba_n_heads": 24, "max_position_embeddings": 262144, "model_type": "falcon_h1",
        "num_attention_heads": 12, "num_hidden_layers": 44, "num_key_value_heads": 2,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 130048,
    },
    # nvidia/NVIDIA-Nemotron-Nano-9B-v2 config.json: hidden 4480, 56 layers in
    # hybrid_override_pattern (27 Mamba-2, 4 attention, 25 MLP), 40 heads / 8
    # KV heads of 128, 128 Mamba heads of 80 (SSM width 10240, as a TensorRT
    # port's ssm_inner_size states), n_groups 8, ssm_state_size 128,
    # conv_kernel 4, from two public copies (a TensorRT-LLM family's thinker
    # config, which cites this repo and revision, and a memory simulator's
    # fixture). expand 2 is recalled from the published file (it is also
    # NemotronHConfig's default); vLLM ignores it (nemotron_h.py uses heads x head_dim).
    "nvidia/NVIDIA-Nemotron-Nano-9B-v2": {
        "architectures": ["NemotronHForCausalLM"], "bos_token_id": 1, "chunk_size": 128, "conv_kernel": 4,
        "eos_token_id": 2, "expand": 2, "head_dim": 128, "hidden_size": 4480,
        "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-",
        "intermediate_size": 15680, "mamba_head_dim": 80, "mamba_hidden_act": "silu", "mamba_num_heads": 128,
        "max_position_embeddings": 131072, "model_type": "nemotron_h", "n_groups": 8,
        "num_attention_heads": 40, "num_hidden_layers": 56, "num_key_value_heads": 8, "pad_token_id": 12,
        "rms_norm_eps": 1e-05, "ssm_state_size": 128, "torch_dtype": "bfloat16", "use_conv_bias": True,
        "vocab_size": 131072,
    },
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: the layer pattern is given
    # only as full_attention_interval 4 (no layer_types), as issue 10 quotes;
    # attention 16 heads / 2 KV heads of 256; gated DeltaNet 16 key heads and
    # 32 value heads of 128, conv kernel 4 (these equal Qwen3NextConfig's
    # defaults in transformers 5.19, a second source). MoE fields recalled.
    "Qwen/Qwen3-Next-80B-A3B-Instruct": {
        "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "full_attention_interval": 4,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
        "intermediate_size": 5120, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
        "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16, "num_experts": 512,
        "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
        "output_router_logits": False, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    },
    # google/gemma-3-4b-it config.json: the wrapper, whose text_config names
    # six fields (hidden_size, intermediate_size, model_type, num_hidden_layers,
    # rope_scaling, sliding_window) and leaves heads, KV heads, head_dim and
    # the sliding pattern to Gemma3TextConfig's defaults (issue 10). Checked
    # against a public C# test quoting "the original gemma-3-4b-it's config.json"
    # (which adds one field of its own) and the 27B sibling's layout.
    "google/gemma-3-4b-it": {
        "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
        "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
        "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
        "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
        "vision_config": {
            "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
            "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
            "patch_size": 14, "vision_use_head": False,
        },
    },
}
