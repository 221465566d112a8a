"""KV-cache arithmetic: layouts and charges against published architectures.

Expected numbers are computed here from the model cards' config values and
the textbook formulas (K and V per kv head per layer; the MLA latent; Mamba's
conv + SSM state), never copied from edge_core.plan.kv's output. The vLLM rule is also
checked against the installed vLLM's own spec classes where vLLM is importable.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from published_configs import PUBLISHED

from edge_core.engines.vllm_allocator import DEFAULT_MAMBA_SSM_CACHE_DTYPE
from edge_core.errors import ArtifactError, UsageError
from edge_core.plan.kv import estimate_kv, kv_layout, max_model_len_for

MIB = 1 << 20
GIB = 1 << 30
BF16 = 2
FP32 = 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# Published configs (the fields that matter), from the checkpoints' config.json.
LLAMA_31_8B = {"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
               "num_attention_heads": 32, "num_key_value_heads": 8,
               "max_position_embeddings": 131072}
LLAMA_31_70B = {"model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192,
                "num_attention_heads": 64, "num_key_value_heads": 8,
                "max_position_embeddings": 131072}
MISTRAL_7B_V01 = {"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096,
                  "max_position_embeddings": 32768}
GEMMA2_9B = {"model_type": "gemma2", "num_hidden_layers": 42, "hidden_size": 3584,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
             "sliding_window": 4096, "max_position_embeddings": 8192}
GEMMA3_4B_TEXT = {"model_type": "gemma3_text", "num_hidden_layers": 34, "hidden_size": 2560,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                  "sliding_window": 1024, "sliding_window_pattern": 6,
                  "max_position_embeddings": 131072}
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048,
                    "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                    "max_position_embeddings": 163840}
JAMBA_V01 = {"model_type": "jamba", "num_hidden_layers": 32, "hidden_size": 4096,
             "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_period": 8,
             "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
             "max_position_embeddings": 262144}
QWEN3_NEXT_80B = {"model_type": "qwen3_next", "num_hidden_layers": 48, "hidden_size": 2048,
                  "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
                  "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 12,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                  "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                  "linear_conv_kernel_dim": 4}

# gpt-oss-20b's shape with one extra full layer (as an eagle drafter adds).
GPT_OSS_LIKE = {"model_type": "gpt_oss", "num_hidden_layers": 25, "hidden_size": 2880,
                "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 12 + ["full_attention"]}

# SPEC section 6 reference: 36 layers, 9 full + 27 sliding@512, 10 kv heads x 128.
REFERENCE = {"num_hidden_layers": 36, "hidden_size": 2560, "num_attention_heads": 20,
             "num_key_value_heads": 10, "head_dim": 128, "sliding_window": 512,
             "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
REFERENCE["layer_types"] = REFERENCE["layer_types"] * 9


# ---------------------------------------------------------------- SPEC reference

def test_spec_reference_flat_is_720_mib():
    est = estimate_kv(REFERENCE, max_model_len=4096, max_num_seqs=1)
    assert est.bytes_flat == 720 * MIB
    assert est.layer_counts["full"] == 9 and est.layer_counts["sliding"] == 27


def test_spec_reference_by_layer_type_is_248_mib():
    est = estimate_kv(REFERENCE, max_model_len=4096)
    token_layers = 9 * 4096 + 27 * 512
    expected = token_layers * 2 * (10 * 128) * BF16
    assert est.bytes_by_layer_type == expected
    assert round(est.bytes_by_layer_type / MIB) == 248
    assert est.bytes_by_layer_type < est.bytes_flat


def test_reference_vllm_rule_by_hand():
    # vLLM 0.32 SlidingWindowSpec: cdiv(min(w - 1 + in_flight, len), bs) + 1 blocks;
    # full layers cdiv(len, bs); 9:27 splits into four groups of 9 (no padding);
    # one null block of 9 layers x one page is held back.
    est = estimate_kv(REFERENCE, max_model_len=4096, max_num_batched_tokens=2048, block_size=16)
    page = 16 * 2 * 10 * 128 * BF16
    full = 9 * cdiv(4096, 16) * page
    sliding = 27 * (cdiv(min(512 - 1 + 2048, 4096), 16) + 1) * page
    assert est.bytes_vllm == full + sliding + 9 * page


# ----------------------------------------------------------- dense architectures

def test_llama_31_8b_bytes_per_token():
    est = estimate_kv(LLAMA_31_8B, max_model_len=8192)
    assert est.bytes_per_token_flat == 32 * 2 * 8 * 128 * BF16 == 131072
    assert est.bytes_flat == est.bytes_by_layer_type == GIB  # 131072 x 8192


def test_llama_31_70b_bytes_per_token():
    est = estimate_kv(LLAMA_31_70B, max_model_len=1024)
    assert est.bytes_per_token_flat == 80 * 2 * 8 * 128 * BF16 == 327680


def test_head_dim_defaults_to_hidden_over_heads_and_kv_heads_to_heads():
    config = {"num_hidden_layers": 2, "hidden_size": 768, "num_attention_heads": 12}
    layout = kv_layout(config)
    assert (layout.num_kv_heads, layout.head_dim) == (12, 64)
    assert estimate_kv(config, max_model_len=1).bytes_per_token_flat == 2 * 2 * 12 * 64 * BF16


def test_gpt2_style_aliases():
    config = {"n_layer": 12, "n_embd": 768, "n_head": 12}
    assert estimate_kv(config, max_model_len=1).bytes_per_token_flat == 12 * 2 * 768 * BF16


def test_fp8_kv_halves_bf16():
    bf16 = estimate_kv(REFERENCE, max_model_len=4096, max_num_seqs=3)
    fp8 = estimate_kv(REFERENCE, max_model_len=4096, max_num_seqs=3, kv_dtype="fp8_e4m3")
    assert fp8.kv_dtype_bytes == 1
    assert fp8.bytes_flat * 2 == bf16.bytes_flat
    assert fp8.bytes_by_layer_type * 2 == bf16.bytes_by_layer_type


def test_auto_kv_dtype_follows_model_dtype():
    est = estimate_kv(LLAMA_31_8B, max_model_len=16, model_dtype="float32")
    assert est.kv_dtype == "float32" and est.kv_dtype_bytes == 4
    assert est.bytes_per_token_flat == 32 * 2 * 8 * 128 * 4


def test_sequences_multiply_the_charge():
    one = estimate_kv(REFERENCE, max_model_len=4096)
    four = estimate_kv(REFERENCE, max_model_len=4096, max_num_seqs=4)
    assert four.bytes_flat == 4 * one.bytes_flat
    assert four.bytes_by_layer_type == 4 * one.bytes_by_layer_type
    assert four.tokens == 4 * 4096


def test_block_rounding_and_null_block():
    # 1000 tokens in blocks of 16 occupy 63 blocks = 1008 token slots per layer;
    # the null block is one 16-token block across all 32 layers.
    est = estimate_kv(LLAMA_31_8B, max_model_len=1000, block_size=16)
    assert est.bytes_vllm == (63 * 16 + 16) * 131072
    exact = estimate_kv(LLAMA_31_8B, max_model_len=1000)
    assert exact.bytes_vllm == 1000 * 131072 == exact.bytes_flat


# ------------------------------------------------------------------ sliding rules

def test_mistral_every_layer_slides():
    layout = kv_layout(MISTRAL_7B_V01)
    assert layout.counts()["sliding"] == 32 and layout.windows_tokens() == (4096,)
    est = estimate_kv(MISTRAL_7B_V01, max_model_len=32768)
    per_token_layer = 2 * 8 * 128 * BF16
    assert est.bytes_flat == 32 * 32768 * per_token_layer  # 4 GiB
    assert est.bytes_by_layer_type == 32 * 4096 * per_token_layer == 512 * MIB


def test_mistral_vllm_rule_uses_in_flight_tokens():
    est = estimate_kv(MISTRAL_7B_V01, max_model_len=32768, max_num_batched_tokens=2048,
                      block_size=16)
    page = 16 * 2 * 8 * 128 * BF16
    blocks = cdiv(4096 - 1 + 2048, 16) + 1
    assert est.bytes_vllm == 32 * blocks * page + 32 * page


def test_window_larger_than_context_charges_context():
    est = estimate_kv(MISTRAL_7B_V01, max_model_len=1000)
    assert est.bytes_by_layer_type == est.bytes_flat


def test_use_sliding_window_false_disables_window():
    config = dict(MISTRAL_7B_V01, use_sliding_window=False)
    assert kv_layout(config).counts()["full"] == 32


def test_gemma2_alternates_starting_with_sliding():
    layout = kv_layout(GEMMA2_9B)
    kinds = [layer.kind for layer in layout.layers]
    assert kinds[:4] == ["sliding", "full", "sliding", "full"]
    assert layout.counts()["sliding"] == layout.counts()["full"] == 21
    est = estimate_kv(GEMMA2_9B, max_model_len=8192)
    assert est.bytes_by_layer_type == (21 * 8192 + 21 * 4096) * 2 * 8 * 256 * BF16


def test_gemma3_every_sixth_layer_full():
    layout = kv_layout(GEMMA3_4B_TEXT)
    full = [layer.index for layer in layout.layers if layer.kind == "full"]
    assert full == [5, 11, 17, 23, 29]
    assert layout.counts()["sliding"] == 29
    assert layout.evidence == "E"  # inferred from a pattern, not stated per layer


def test_gemma3_vllm_rule_pads_the_uneven_group():
    # 5 full + 29 sliding: vLLM groups by 5, so sliding is charged as 30 layers.
    est = estimate_kv(GEMMA3_4B_TEXT, max_model_len=8192, max_num_batched_tokens=1024,
                      block_size=16)
    page = 16 * 2 * 4 * 256 * BF16
    full = 5 * cdiv(8192, 16) * page
    sliding = 30 * (cdiv(1024 - 1 + 1024, 16) + 1) * page
    assert est.bytes_vllm == full + sliding + 5 * page


def test_vllm_rule_groups_near_equal_types_by_the_larger_count():
    # vLLM's heuristic: 12 sliding + 13 full (max < 1.5 x min) groups by 13,
    # so sliding is padded to 13 layers rather than full to 24.
    config = dict(GPT_OSS_LIKE)
    est = estimate_kv(config, max_model_len=4096, max_num_batched_tokens=512, block_size=16)
    page = 16 * 2 * 8 * 64 * BF16
    full = 13 * cdiv(4096, 16) * page
    sliding = 13 * (cdiv(128 - 1 + 512, 16) + 1) * page
    assert est.bytes_vllm == full + sliding + 13 * page


def test_qwen2_window_only_above_max_window_layers():
    config = {"model_type": "qwen2", "num_hidden_layers": 32, "hidden_size": 4096,
              "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096,
              "use_sliding_window": True, "max_window_layers": 28}
    kinds = [layer.kind for layer in kv_layout(config).layers]
    assert kinds == ["full"] * 28 + ["sliding"] * 4
    off = dict(config, use_sliding_window=False, sliding_window=131072)
    assert kv_layout(off).counts()["full"] == 32


def test_sliding_window_zero_means_none():
    assert kv_layout(dict(MISTRAL_7B_V01, sliding_window=0)).counts()["full"] == 32


def test_missing_max_num_batched_tokens_charges_sliding_as_full_under_vllm_rule():
    est = estimate_kv(REFERENCE, max_model_len=4096)
    assert est.bytes_vllm == est.bytes_flat


def test_concurrent_batches_double_in_flight():
    one = estimate_kv(MISTRAL_7B_V01, max_model_len=32768, max_num_batched_tokens=2048)
    two = estimate_kv(MISTRAL_7B_V01, max_model_len=32768, max_num_batched_tokens=2048,
                      concurrent_batches=2)
    per_token_layer = 2 * 8 * 128 * BF16
    assert one.bytes_vllm == 32 * (4095 + 2048) * per_token_layer
    assert two.bytes_vllm == 32 * (4095 + 4096) * per_token_layer


def test_llama4_chunked_layers():
    config = {"model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120,
              "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
              "attention_chunk_size": 8192}
    layout = kv_layout(config)
    assert layout.counts()["chunked"] == 36 and layout.counts()["full"] == 12
    est = estimate_kv(config, max_model_len=32768, max_num_batched_tokens=2048)
    per_token_layer = 2 * 8 * 128 * BF16
    assert est.bytes_by_layer_type == (12 * 32768 + 36 * 8192) * per_token_layer
    # vLLM disables its hybrid manager for chunked attention: every layer full.
    assert est.bytes_vllm == est.bytes_flat == 48 * 32768 * per_token_layer


# ------------------------------------------------------------------- MLA, hybrid

def test_deepseek_v2_lite_mla():
    layout = kv_layout(DEEPSEEK_V2_LITE)
    assert layout.mla and layout.counts()["mla"] == 27
    assert (layout.num_kv_heads, layout.head_dim) == (1, 512 + 64)
    est = estimate_kv(DEEPSEEK_V2_LITE, max_model_len=4096)
    assert est.bytes_per_token_flat == 27 * 576 * BF16 == 31104
    assert est.bytes_flat == 4096 * 31104


def test_jamba_mamba1_state():
    layout = kv_layout(JAMBA_V01)
    attention = [layer.index for layer in layout.layers if layer.kind == "full"]
    assert attention == [4, 12, 20, 28]
    d_inner = 2 * 4096
    # conv state in the model dtype, SSM state in fp32 (vLLM CPU 0.32's default)
    state_per_layer = d_inner * (4 - 1) * BF16 + d_inner * 16 * FP32
    est = estimate_kv(JAMBA_V01, max_model_len=8192, max_num_seqs=2)
    assert est.recurrent_state_bytes == 2 * 28 * state_per_layer
    attention_bytes = 2 * 8192 * 4 * 2 * 8 * 128 * BF16
    assert est.bytes_flat == attention_bytes + est.recurrent_state_bytes
    assert est.bytes_per_token_flat == 4 * 2 * 8 * 128 * BF16
    assert est.evidence == "E"


def test_qwen3_next_gated_deltanet_state():
    layout = kv_layout(QWEN3_NEXT_80B)
    assert layout.counts()["recurrent"] == 36 and layout.counts()["full"] == 12
    conv = (4 - 1) * (2 * 16 * 128 + 32 * 128)
    recurrent = 32 * 128 * 128
    est = estimate_kv(QWEN3_NEXT_80B, max_model_len=4096)
    assert est.recurrent_state_bytes == 36 * (conv * BF16 + recurrent * FP32)
    bf16_state = estimate_kv(QWEN3_NEXT_80B, max_model_len=4096, mamba_ssm_cache_dtype="bfloat16")
    assert bf16_state.recurrent_state_bytes == 36 * (conv + recurrent) * BF16
    assert est.bytes_flat == 4096 * 12 * 2 * 2 * 256 * BF16 + est.recurrent_state_bytes


def test_mamba2_hybrid_state_from_layer_types():
    # Mamba-2 state: conv (d_conv - 1) x (d_inner + 2 * groups * d_state),
    # SSM n_heads x head_dim x d_state.
    config = {"model_type": "granitemoehybrid", "num_hidden_layers": 4, "hidden_size": 1536,
              "num_attention_heads": 12, "num_key_value_heads": 4,
              "layer_types": ["mamba", "mamba", "mamba", "attention"],
              "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128,
              "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_groups": 1}
    d_inner = 2 * 1536
    conv, ssm = (4 - 1) * (d_inner + 2 * 1 * 128), 48 * 64 * 128
    est = estimate_kv(config, max_model_len=100)
    assert est.recurrent_state_bytes == 3 * (conv * BF16 + ssm * FP32)
    assert (est.state_dtype_bytes, est.ssm_state_dtype_bytes) == (BF16, FP32)
    # "auto" follows the model dtype, as vLLM does where no platform resets it.
    auto = estimate_kv(config, max_model_len=100, mamba_ssm_cache_dtype="auto")
    assert auto.recurrent_state_bytes == 3 * (conv + ssm) * BF16
    assert est.bytes_per_token_flat == 1 * 2 * 4 * 128 * BF16


def test_nemotron_h_pattern():
    config = {"model_type": "nemotron_h", "num_hidden_layers": 6, "hidden_size": 1024,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
              "hybrid_override_pattern": "M-M*-E", "mamba_num_heads": 16,
              "mamba_head_dim": 64, "ssm_state_size": 128, "conv_kernel": 4, "n_groups": 2}
    counts = kv_layout(config).counts()
    assert (counts["recurrent"], counts["full"], counts["none"]) == (2, 1, 3)


def test_falcon_h1_layers_hold_both_kv_and_state():
    config = {"model_type": "falcon_h1", "num_hidden_layers": 4, "hidden_size": 1024,
              "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 128,
              "mamba_d_ssm": 1536, "mamba_n_heads": 24, "mamba_d_head": 64,
              "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_n_groups": 1}
    conv, ssm = (4 - 1) * (1536 + 2 * 128), 24 * 64 * 128
    est = estimate_kv(config, max_model_len=100, max_num_batched_tokens=64, block_size=16)
    assert est.layer_counts["full"] == 4
    assert est.recurrent_state_bytes == 4 * (conv * BF16 + ssm * FP32)
    assert est.bytes_flat == 100 * 4 * 2 * 2 * 128 * BF16 + est.recurrent_state_bytes
    assert est.bytes_vllm >= est.bytes_flat


def test_pure_mamba_has_no_per_token_charge():
    config = {"model_type": "mamba", "num_hidden_layers": 24, "hidden_size": 768,
              "intermediate_size": 1536, "state_size": 16, "conv_kernel": 4}
    small = estimate_kv(config, max_model_len=10)
    large = estimate_kv(config, max_model_len=10_000)
    assert small.bytes_per_token_flat == 0
    assert small.bytes_flat == large.bytes_flat == 24 * (1536 * 3 * BF16 + 1536 * 16 * FP32)
    # Attention-free: vLLM turns prefix caching off (ModelConfig.is_prefix_caching_supported),
    # so each layer holds one state page, and the pool holds back one null block of them.
    vllm = estimate_kv(config, max_model_len=10_000, block_size=128)
    assert vllm.mamba_cache_mode == "none" and vllm.state_blocks_per_request == 1
    assert vllm.bytes_vllm == 24 * (1536 * 3 * BF16 + 1536 * 16 * FP32) * (1 + 1)


# -------------------------------------------------------------- max_model_len_for

@pytest.mark.parametrize("rule", ["flat", "by_layer_type", "vllm"])
@pytest.mark.parametrize("config, budget", [
    *((c, b) for c in (REFERENCE, LLAMA_31_8B, MISTRAL_7B_V01, GEMMA3_4B_TEXT, DEEPSEEK_V2_LITE, JAMBA_V01)
      for b in (300 * MIB, GIB + 12345)),
    # Hybrids hold a constant state per sequence first: larger budgets.
    *((PUBLISHED[name], b) for name in ("ibm-granite/granite-4.0-h-tiny", "tiiuae/Falcon-H1-7B-Instruct")
      for b in (3 * GIB, 8 * GIB + 12345))])
@pytest.mark.parametrize("block", [16, 128])
def test_max_model_len_for_is_the_largest_that_fits(rule, config, budget, block):
    kwargs = dict(max_num_seqs=2, max_num_batched_tokens=512, block_size=block)
    n = max_model_len_for(config, budget, rule=rule, ceiling_tokens=1 << 20, **kwargs)
    assert n >= 1
    assert estimate_kv(config, max_model_len=n, **kwargs).bytes_for(rule) <= budget
    if n < 1 << 20:
        assert estimate_kv(config, max_model_len=n + 1, **kwargs).bytes_for(rule) > budget


def test_max_model_len_for_closed_form_llama():
    # Flat: 1 GiB / 131072 bytes per token = 8192 tokens exactly.
    assert max_model_len_for(LLAMA_31_8B, GIB, rule="flat") == 8192
    assert max_model_len_for(LLAMA_31_8B, GIB - 1, rule="flat") == 8191
    # vLLM with 16-token blocks: one block goes to the null block, and the
    # answer needs no rounding since 8176 is a multiple of 16.
    assert max_model_len_for(LLAMA_31_8B, GIB, rule="vllm", block_size=16) == 8192 - 16


def test_max_model_len_for_nothing_fits():
    assert max_model_len_for(LLAMA_31_8B, 131071, rule="flat") == 0


def test_max_model_len_for_caps_at_the_model_context():
    # Mistral's charge stops growing past the window: the cap is its context.
    huge = 100 * GIB
    assert max_model_len_for(MISTRAL_7B_V01, huge, rule="by_layer_type") == 32768


# --------------------------------------------------------------------- bad input

@pytest.mark.parametrize("config, field", [
    ({"hidden_size": 4096, "num_attention_heads": 32}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "hidden_size": 4096, "num_attention_heads": 0},
     "num_attention_heads"),
    ({"num_hidden_layers": 2, "hidden_size": 4096, "num_attention_heads": 32,
      "num_key_value_heads": "8"}, "num_key_value_heads"),
    ({"num_hidden_layers": 2.5, "hidden_size": 4096, "num_attention_heads": 32},
     "num_hidden_layers"),
    ({"num_hidden_layers": True, "hidden_size": 4096, "num_attention_heads": 32},
     "num_hidden_layers"),
    ({"num_hidden_layers": 2, "num_attention_heads": 32}, "hidden_size"),
    (dict(REFERENCE, layer_types=["full_attention"] * 35), "layer_types"),
    (dict(REFERENCE, layer_types=["full_attention"] * 35 + ["teleport"]), "teleport"),
    ({k: v for k, v in REFERENCE.items() if k != "sliding_window"}, "sliding_window"),
    (dict(DEEPSEEK_V2_LITE, qk_rope_head_dim=None), "qk_rope_head_dim"),
    ({"model_type": "jamba", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
      "attn_layer_period": 2, "attn_layer_offset": 1, "mamba_d_conv": 4}, "mamba_d_state"),
])
def test_bad_configs_name_the_field(config, field):
    with pytest.raises(ArtifactError) as err:
        estimate_kv(config, max_model_len=16)
    assert err.value.code == "config_unreadable"
    assert field in err.value.message
    assert err.value.remedy


def test_config_not_a_mapping():
    with pytest.raises(ArtifactError) as err:
        kv_layout(["not", "a", "dict"])
    assert err.value.code == "config_unreadable"


@pytest.mark.parametrize("kwargs", [
    {"max_model_len": 0}, {"max_model_len": 16, "max_num_seqs": 0},
    {"max_model_len": 16, "kv_dtype": "int3"}, {"max_model_len": 16, "block_size": -16},
])
def test_bad_session_limits_are_usage_errors(kwargs):
    with pytest.raises(UsageError):
        estimate_kv(LLAMA_31_8B, **kwargs)


def test_to_dict_is_plain_json():
    import json

    est = estimate_kv(REFERENCE, max_model_len=4096, max_num_batched_tokens=256, block_size=16)
    data = json.loads(json.dumps(est.to_dict()))
    assert data["bytes_flat"] == 720 * MIB
    assert set(data["rules"]) >= {"flat", "by_layer_type", "vllm"}
    layout = json.loads(json.dumps(kv_layout(REFERENCE).to_dict()))
    assert layout["layer_counts"]["sliding"] == 27 and layout["source"] == "layer_types"


# ------------------------------------------------------------------- properties

CONFIGS = [REFERENCE, LLAMA_31_8B, MISTRAL_7B_V01, GEMMA2_9B, GEMMA3_4B_TEXT,
           DEEPSEEK_V2_LITE, JAMBA_V01, QWEN3_NEXT_80B, *(PUBLISHED[name] for name in (
               "ibm-granite/granite-4.0-h-tiny", "tiiuae/Falcon-H1-7B-Instruct",
               "nvidia/NVIDIA-Nemotron-Nano-9B-v2", "Qwen/Qwen3-Next-80B-A3B-Instruct"))]


@settings(max_examples=200, deadline=None)
@given(config=st.sampled_from(CONFIGS),
       length=st.integers(1, 300_000), extra=st.integers(0, 5000),
       seqs=st.integers(1, 64), more_seqs=st.integers(0, 8),
       batched=st.one_of(st.none(), st.integers(1, 16384)),
       block=st.one_of(st.none(), st.sampled_from([1, 16, 32, 128])),
       kv_dtype=st.sampled_from(["auto", "fp8"]))
def test_charges_are_monotone(config, length, extra, seqs, more_seqs, batched, block, kv_dtype):
    kwargs = dict(max_num_batched_tokens=batched, block_size=block, kv_dtype=kv_dtype)
    base = estimate_kv(config, max_model_len=length, max_num_seqs=seqs, **kwargs)
    longer = estimate_kv(config, max_model_len=length + extra, max_num_seqs=seqs, **kwargs)
    wider = estimate_kv(config, max_model_len=length, max_num_seqs=seqs + more_seqs, **kwargs)
    for rule in ("flat", "by_layer_type", "vllm"):
        assert base.bytes_for(rule) <= longer.bytes_for(rule)
        assert base.bytes_for(rule) <= wider.bytes_for(rule)
    assert base.bytes_by_layer_type <= base.bytes_flat


# ------------------------------------------------- against vLLM's own allocator

def _vllm_reserved_bytes(kinds, *, kv_heads, head_dim, window, max_model_len, batched,
                         block_size, seqs, mla=False):
    """What vLLM 0.32's capacity check needs: per-request group usage x seqs + null block."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm")
    from types import SimpleNamespace as NS

    from vllm.v1.core import kv_cache_utils as u
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    specs = {}
    for i, kind in enumerate(kinds):
        if mla:
            specs[f"l{i}"] = MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                              head_size=head_dim, dtype=torch.bfloat16)
        elif kind == "sliding":
            specs[f"l{i}"] = SlidingWindowSpec(block_size=block_size, num_kv_heads=kv_heads,
                                               head_size=head_dim, dtype=torch.bfloat16,
                                               sliding_window=window)
        else:
            specs[f"l{i}"] = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads,
                                               head_size=head_dim, dtype=torch.bfloat16)
    config = NS(model_config=NS(max_model_len=max_model_len),
                parallel_config=NS(decode_context_parallel_size=1),
                max_in_flight_tokens=batched,
                cache_config=NS(get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC),
                attention_config=NS(hisparse_config=None))
    if len(set(specs.values())) == 1:
        groups = u._get_kv_cache_groups_uniform_spec(specs)
    else:
        groups = u._get_kv_cache_groups_uniform_page_size(specs)
    usage = u._max_memory_usage_bytes_from_groups(config, groups)
    return usage * seqs + u._pool_bytes_per_block(config, groups)


@pytest.mark.vllm
@pytest.mark.parametrize("length, batched, block, seqs", [
    (4096, 2048, 16, 1), (1000, 256, 128, 3), (300, 8192, 16, 2), (131072, 4096, 128, 1)])
def test_vllm_rule_matches_installed_vllm(length, batched, block, seqs):
    cases = [
        (REFERENCE, (["sliding"] * 3 + ["full"]) * 9, 10, 128, 512, False),
        (LLAMA_31_8B, ["full"] * 32, 8, 128, None, False),
        (MISTRAL_7B_V01, ["sliding"] * 32, 8, 128, 4096, False),
        (GEMMA3_4B_TEXT, (["sliding"] * 5 + ["full"]) * 5 + ["sliding"] * 4, 4, 256, 1024, False),
        (GEMMA2_9B, ["sliding", "full"] * 21, 8, 256, 4096, False),
        (DEEPSEEK_V2_LITE, ["full"] * 27, 1, 576, None, True),
        (GPT_OSS_LIKE, ["sliding", "full"] * 12 + ["full"], 8, 64, 128, False),
    ]
    for config, kinds, kv_heads, head_dim, window, mla in cases:
        expected = _vllm_reserved_bytes(kinds, kv_heads=kv_heads, head_dim=head_dim,
                                        window=window, max_model_len=length, batched=batched,
                                        block_size=block, seqs=seqs, mla=mla)
        est = estimate_kv(config, max_model_len=length, max_num_seqs=seqs,
                          max_num_batched_tokens=batched, block_size=block)
        assert est.bytes_vllm == expected, config


# ------------------------------------------- hybrids against vLLM's own allocator
#
# vLLM's figure is built the way its engine builds it (vllm 0.32): the HF
# config object from transformers' own class, the model's
# verify_and_update_config hooks (HybridAttentionMambaModelConfig ->
# MambaModelConfig sets mamba_cache_mode "align" under prefix caching;
# NemotronH sets its SSM dtype), the CPU platform's SSM-dtype reset,
# CpuPlatform._align_hybrid_block_size (the enlarged attention block and the
# padded state page), the state shapes and dtypes from the model class, each
# state layer's MambaSpec from the real mixer's get_kv_cache_spec, then
# get_kv_cache_groups and the admission figure get_kv_cache_configs checks:
# _max_memory_usage_bytes_from_groups + the null block (_pool_bytes_per_block).
# The layer pattern is read from what vLLM's model file reads, not from edge.

HYBRIDS = ["ibm-granite/granite-4.0-h-tiny", "tiiuae/Falcon-H1-7B-Instruct",
           "nvidia/NVIDIA-Nemotron-Nano-9B-v2", "Qwen/Qwen3-Next-80B-A3B-Instruct"]
#: state-spaces/mamba-130m-hf's config.json: attention-free, checked the same way.
MAMBA_130M = {"architectures": ["MambaForCausalLM"], "model_type": "mamba", "hidden_size": 768,
              "num_hidden_layers": 24, "intermediate_size": 1536, "state_size": 16, "conv_kernel": 4,
              "expand": 2, "vocab_size": 50280}


def _vllm_state_minimum(monkeypatch, config, *, max_model_len, cpu_ssm_reset=True, prefix_caching=True, tp=1):
    """(bytes vLLM 0.32 needs for one max-len request on one rank of ``tp``, its attention block size,
    its state dtypes)."""
    torch = pytest.importorskip("torch", reason="vLLM's allocator needs torch")
    pytest.importorskip("vllm", reason="vLLM is not installed here")
    transformers = pytest.importorskip("transformers", reason="vLLM reads the HF config object")
    from types import SimpleNamespace as NS

    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.model_executor.layers.mamba.mamba_mixer import MambaMixer
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, HybridAttentionMambaModelConfig
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.core import kv_cache_utils as u
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    model_type, arch = config["model_type"], config["architectures"][0]
    hf = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    kv_heads = getattr(hf, "num_key_value_heads", None)
    head_dim = getattr(hf, "head_dim", None) or (hf.hidden_size // hf.num_attention_heads if kv_heads else 0)
    if kv_heads:
        kv_heads = max(1, kv_heads // tp)  # ModelConfig.get_num_kv_heads: split, or one per rank
    if model_type == "nemotron_h":  # nemotron_h.py: one layer per hybrid_override_pattern character
        kinds = [{"M": ("state",), "*": ("attention",)}.get(c, ()) for c in hf.hybrid_override_pattern]
    elif model_type == "falcon_h1":  # falcon_h1.py: attention and a Mamba-2 mixer in every layer
        kinds = [("attention", "state")] * hf.num_hidden_layers
    elif model_type == "mamba":
        kinds = [("state",)] * hf.num_hidden_layers
    else:  # granitemoehybrid.py / qwen3_next.py read layer_types
        kinds = [("attention",) if t == "full_attention" else ("state",) for t in hf.layer_types]
    hybrid = any("attention" in k for k in kinds)
    cache = NS(block_size=128, user_specified_block_size=False, cache_dtype="auto", mamba_cache_dtype="auto",
               mamba_ssm_cache_dtype="auto", mamba_cache_mode="none", mamba_block_size=None,
               mamba_page_size_padded=None, enable_prefix_caching=prefix_caching and hybrid,
               use_replayssm=False, kv_cache_dtype_skip_layers=None,
               get_resolved_kv_cache_layout=lambda: KVCacheLayout.LBHNC)  # CPU_ATTN's only layout
    model = NS(hf_config=hf, hf_text_config=hf, dtype=torch.bfloat16, architecture=arch, use_mla=False,
               get_num_kv_heads=lambda parallel: kv_heads, get_head_size=lambda: head_dim,
               max_model_len=max_model_len, is_hybrid=hybrid, model_impl="vllm", convert_type="none",
               runner_type="generate")
    vllm_config = NS(model_config=model, cache_config=cache,
                     parallel_config=NS(tensor_parallel_size=tp, decode_context_parallel_size=1),
                     scheduler_config=NS(enable_chunked_prefill=True, disable_hybrid_kv_cache_manager=False),
                     num_speculative_tokens=0, speculative_config=None, attention_config=NS(hisparse_config=None),
                     max_in_flight_tokens=max_model_len)
    if arch in MODELS_CONFIG_MAP:
        MODELS_CONFIG_MAP[arch].verify_and_update_config(vllm_config)
    if hybrid:
        HybridAttentionMambaModelConfig.verify_and_update_config(vllm_config)
    if cpu_ssm_reset and cache.mamba_ssm_cache_dtype != "float32":
        # platforms/cpu.py check_and_update_config, on an AVX512-BF16 host: any SSM
        # dtype but float32 is reset to float32 unless a GDN model asked for fp16/bf16.
        cache.mamba_ssm_cache_dtype = "float32"
    if hybrid:
        # The CPU attention backend is every attention layer's (get_attn_backend_cls).
        monkeypatch.setattr(CpuPlatform, "_find_non_ssm_backends",
                            classmethod(lambda cls, vllm_config: [CPUAttentionBackend]))
        CpuPlatform._align_hybrid_block_size(vllm_config, CPUAttentionBackend)
    else:
        cache.mamba_block_size = max_model_len  # MambaModelConfig without prefix caching
    model_cls, _ = ModelRegistry.resolve_model_cls(arch, model_config=model)
    shapes = model_cls.get_mamba_state_shape_from_config(vllm_config)
    dtypes = model_cls.get_mamba_state_dtype_from_config(vllm_config)
    mixer = {"qwen3_next": QwenGatedDeltaNetAttention, "mamba": MambaMixer}.get(model_type, MambaMixer2)

    class Mixer(mixer):
        """The model's mixer class, with its state shape, so its own get_kv_cache_spec builds the spec."""

        def __init__(self):
            torch.nn.Module.__init__(self)

        def get_state_shape(self):
            return shapes

        def get_state_dtype(self):
            return dtypes

    specs = {}
    for i, layer_kinds in enumerate(kinds):
        for kind in layer_kinds:
            specs[f"layers.{i}.{kind}"] = (
                FullAttentionSpec(block_size=cache.block_size, num_kv_heads=kv_heads, head_size=head_dim,
                                  dtype=torch.bfloat16) if kind == "attention" else Mixer().get_kv_cache_spec(vllm_config))
    groups = u.get_kv_cache_groups(vllm_config, dict(specs))
    needed = u._max_memory_usage_bytes_from_groups(vllm_config, groups) + u._pool_bytes_per_block(vllm_config, groups)

    def accepts(kv_cache_memory_bytes):
        try:
            u._check_enough_kv_cache_memory(
                kv_cache_memory_bytes - u._pool_bytes_per_block(vllm_config, groups),
                lambda: u._max_memory_usage_bytes_from_groups(vllm_config, groups), max_model_len,
                lambda available: 0)
        except ValueError:
            return False
        return True

    return needed, cache.block_size, dtypes, accepts


@pytest.mark.vllm
@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("length", [4096, 32768, 131072])
@pytest.mark.parametrize("platform", ["cpu", "auto"])
def test_hybrid_vllm_rule_matches_vllm_allocator(monkeypatch, name, length, platform):
    config = PUBLISHED[name]
    needed, block, dtypes, accepts = _vllm_state_minimum(monkeypatch, config, max_model_len=length,
                                                         cpu_ssm_reset=platform == "cpu")
    ssm = DEFAULT_MAMBA_SSM_CACHE_DTYPE if platform == "cpu" else "auto"
    est = estimate_kv(config, max_model_len=length, max_num_batched_tokens=2048, block_size=128,
                      mamba_ssm_cache_dtype=ssm)
    assert needed <= est.bytes_vllm <= needed * 1.01, (name, est.bytes_vllm / needed)
    assert accepts(est.bytes_vllm)
    # The block vLLM picks for the hybrid is the one the estimate reports.
    assert est.block_size == block and est.base_block_size == 128
    assert est.ssm_state_dtype_bytes == dtypes[1].itemsize and est.state_dtype_bytes == dtypes[0].itemsize
    # Passing the reported block back (as the planner's remedies do) gives the same figure.
    again = estimate_kv(config, max_model_len=length, max_num_batched_tokens=2048, block_size=est.block_size,
                        mamba_ssm_cache_dtype=ssm)
    assert again.bytes_vllm == est.bytes_vllm and again.block_size == est.block_size


@pytest.mark.vllm
@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("tp", [2, 4])
def test_one_rank_of_a_hybrid_matches_vllm_allocator_at_that_tensor_parallel_size(monkeypatch, name, tp):
    """vLLM splits the conv width, the SSM heads and the KV heads by TP (Mamba-2 groups replicated up to TP)."""
    config = PUBLISHED[name]
    needed, block, _, accepts = _vllm_state_minimum(monkeypatch, config, max_model_len=32768, tp=tp)
    est = estimate_kv(config, max_model_len=32768, max_num_batched_tokens=2048, block_size=128, tp_size=tp)
    assert needed <= est.bytes_vllm <= needed * 1.01, (name, tp, est.bytes_vllm / needed)
    assert accepts(est.bytes_vllm) and est.block_size == block
    whole = estimate_kv(config, max_model_len=32768, max_num_batched_tokens=2048, block_size=128)
    assert est.recurrent_state_bytes < whole.recurrent_state_bytes  # no longer charged whole on every rank


@pytest.mark.vllm
@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_vllm_rule_without_prefix_caching_holds_one_state_block(monkeypatch, name):
    config = PUBLISHED[name]
    needed, block, _, _ = _vllm_state_minimum(monkeypatch, config, max_model_len=8192, prefix_caching=False)
    est = estimate_kv(config, max_model_len=8192, block_size=128, enable_prefix_caching=False)
    assert est.mamba_cache_mode == "none" and est.state_blocks_per_request == 1
    assert needed <= est.bytes_vllm <= needed * 1.01 and est.block_size == block


@pytest.mark.vllm
def test_attention_free_vllm_rule_matches_vllm_allocator(monkeypatch):
    needed, _, _, accepts = _vllm_state_minimum(monkeypatch, MAMBA_130M, max_model_len=2048)
    est = estimate_kv(MAMBA_130M, max_model_len=2048, block_size=128)
    assert est.bytes_vllm == needed and accepts(est.bytes_vllm)


def test_granite_4_h_tiny_hybrid_block_and_state_by_hand():
    # CPU: conv state (3 x (3072 + 2 x 128)) bf16 + SSM state 48 x 64 x 128 fp32;
    # one attention token per layer is 2 x 4 KV heads x 128 x bf16 = 2048 B;
    # the block grows to 128 x cdiv(state, 128 x 2048) = 896 tokens (issue 10 saw 896).
    config = PUBLISHED["ibm-granite/granite-4.0-h-tiny"]
    state = 3 * (3072 + 256) * BF16 + 48 * 64 * 128 * FP32
    block = 128 * cdiv(state, 128 * 2048)
    est = estimate_kv(config, max_model_len=4096, block_size=128)
    assert block == 896 and est.block_size == block
    page = block * 2048
    # 4 attention + 36 Mamba-2 layers group by 4: one attention group, nine state groups.
    # A request: cdiv(4096, 896) pages per attention layer, 3 state pages per Mamba-2
    # layer (align mode: 2 + 1 prefill checkpoint), plus a 4-layer null block.
    assert est.mamba_cache_mode == "align" and est.state_blocks_per_request == 3
    assert est.bytes_vllm == (4 * cdiv(4096, block) + 36 * 3) * page + 4 * page
    # The charge edge made before (128-token pages, one bf16 state): 70%+ short.
    old = 4 * 4096 * 2048 + 4 * 2048 * 128 + 36 * cdiv(3 * 3328 * BF16 + 48 * 64 * 128 * BF16,
                                                          128 * 2048) * 128 * 2048
    assert old < 0.3 * est.bytes_vllm


def test_hybrid_state_dtypes_are_parameters():
    config = PUBLISHED["ibm-granite/granite-4.0-h-tiny"]
    fp32 = estimate_kv(config, max_model_len=4096, block_size=128)
    bf16 = estimate_kv(config, max_model_len=4096, block_size=128, mamba_ssm_cache_dtype="bfloat16")
    assert (fp32.ssm_state_dtype_bytes, bf16.ssm_state_dtype_bytes) == (FP32, BF16)
    assert bf16.block_size == 128 * cdiv(3 * 3328 * BF16 + 48 * 64 * 128 * BF16, 128 * 2048) == 512
    conv32 = estimate_kv(config, max_model_len=4096, block_size=128, mamba_cache_dtype="float32")
    assert conv32.recurrent_state_bytes - fp32.recurrent_state_bytes == 36 * 3 * 3328 * (FP32 - BF16)


def test_nemotron_h_ssm_width_is_heads_times_head_dim():
    # nemotron_h.py: intermediate = mamba_num_heads x mamba_head_dim (128 x 80),
    # not expand x hidden_size (2 x 4480), which the published config also names.
    config = PUBLISHED["nvidia/NVIDIA-Nemotron-Nano-9B-v2"]
    layout = kv_layout(config)
    conv = (4 - 1) * (128 * 80 + 2 * 8 * 128)
    ssm = 128 * 80 * 128
    assert layout.counts()["recurrent"] == 27 and layout.counts()["full"] == 4
    assert {l.state_elements for l in layout.layers if l.kind == "recurrent"} == {conv + ssm}
    # Its vLLM config hook asks for an fp32 SSM state on every platform.
    auto = estimate_kv(config, max_model_len=1024, mamba_ssm_cache_dtype="auto")
    assert auto.ssm_state_dtype_bytes == FP32


# ------------------------------------------------------- per-layer vocabularies
#
# Each spelling is checked against the layer types transformers' own
# configuration class derives from it (the attribute vLLM's model file reads).

def _hf_layer_types(model_type, config):
    transformers = pytest.importorskip("transformers", reason="the oracle is transformers' configuration class")
    hf = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    return list(hf.layer_types)


def _edge_kinds(config):
    out = []
    for layer in kv_layout(config).layers:
        if layer.attention and layer.state_elements:
            out.append("hybrid")
        elif layer.kind == "recurrent":
            out.append("linear_attention" if layer.state_formula != "short_conv" else "conv")
        elif layer.kind == "none":
            out.append("none")
        else:
            out.append({"full": "full_attention", "sliding": "sliding_attention",
                        "chunked": "chunked_attention"}[layer.kind])
    return out


def test_qwen3_next_full_attention_interval_alone():
    published = PUBLISHED["Qwen/Qwen3-Next-80B-A3B-Instruct"]
    assert "layer_types" not in published
    layout = kv_layout(published)
    assert layout.counts()["full"] == 12 and layout.counts()["recurrent"] == 36
    assert [l.index for l in layout.layers if l.kind == "full"] == list(range(3, 48, 4))
    assert _edge_kinds(published) == _hf_layer_types("qwen3_next", published)
    explicit = dict(published, layer_types=_hf_layer_types("qwen3_next", published))
    del explicit["full_attention_interval"]
    kwargs = dict(max_model_len=32768, max_num_batched_tokens=2048, block_size=128)
    a, b = estimate_kv(published, **kwargs), estimate_kv(explicit, **kwargs)
    assert (a.bytes_flat, a.bytes_by_layer_type, a.bytes_vllm) == (b.bytes_flat, b.bytes_by_layer_type, b.bytes_vllm)
    conv, delta = (4 - 1) * (2 * 16 * 128 + 32 * 128), 32 * 128 * 128
    assert a.recurrent_state_bytes == 36 * (conv * BF16 + delta * FP32)
    assert a.bytes_flat == 32768 * 12 * 2 * 2 * 256 * BF16 + a.recurrent_state_bytes


def test_qwen3_next_interval_defaults_to_four():
    config = {k: v for k, v in PUBLISHED["Qwen/Qwen3-Next-80B-A3B-Instruct"].items()
              if k != "full_attention_interval"}
    assert _edge_kinds(config) == _hf_layer_types("qwen3_next", config)
    three = dict(config, full_attention_interval=3)
    assert _edge_kinds(three) == _hf_layer_types("qwen3_next", three)
    assert kv_layout(three).counts()["full"] == 16


def test_layers_block_type_spelling():
    # transformers 5 writes Mamba layers as "linear_attention" (its legacy remap);
    # in a Mamba family that is a Mamba-2 mixer, not a gated-DeltaNet or lightning layer.
    granite = dict(PUBLISHED["ibm-granite/granite-4.0-h-tiny"])
    legacy = granite.pop("layer_types")
    remapped = ["linear_attention" if t == "mamba" else "full_attention" for t in legacy]
    spelled = dict(granite, layers_block_type=remapped)
    assert _edge_kinds(spelled) == _hf_layer_types("granitemoehybrid", spelled)
    assert kv_layout(spelled).layers == kv_layout(PUBLISHED["ibm-granite/granite-4.0-h-tiny"]).layers
    assert {l.state_formula for l in kv_layout(spelled).layers if l.state_elements} == {"mamba2"}


def test_nemotron_h_layers_block_type_wins_over_the_pattern():
    # NemotronHConfig uses hybrid_override_pattern only when layers_block_type is
    # absent, and vLLM reads the pattern derived from layers_block_type.
    published = PUBLISHED["nvidia/NVIDIA-Nemotron-Nano-9B-v2"]
    listed = ["linear_attention", "full_attention"] * 4
    both = dict(published, layers_block_type=listed)
    hf = _hf_layer_types("nemotron_h", both)
    assert hf == listed
    kinds = _edge_kinds(both)
    assert kinds == hf and len(kinds) == 8  # num_hidden_layers 56 is ignored, as NemotronHConfig does


def test_hybrid_override_pattern_against_transformers():
    published = PUBLISHED["nvidia/NVIDIA-Nemotron-Nano-9B-v2"]
    hf = [{"mlp": "none", "moe": "none"}.get(t, t) for t in _hf_layer_types("nemotron_h", published)]
    assert _edge_kinds(published) == hf


@pytest.mark.parametrize("model_type, pattern", [("gemma3_text", 6), ("cohere2", 4)])
def test_sliding_window_pattern_default(model_type, pattern):
    config = {"model_type": model_type, "num_hidden_layers": 12, "hidden_size": 1024,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "sliding_window": 512}
    assert _edge_kinds(config) == _hf_layer_types(model_type, config)
    assert kv_layout(config).counts()["full"] == 12 // pattern


def test_sliding_window_pattern_named():
    config = {"model_type": "gemma3_text", "num_hidden_layers": 12, "hidden_size": 1024,
              "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128, "sliding_window": 512,
              "sliding_window_pattern": 3}
    assert _edge_kinds(config) == _hf_layer_types("gemma3_text", config)
    assert kv_layout(config).counts()["full"] == 4


def test_cohere2_window_is_one_wider_in_vllm():
    # commandr.py passes sliding_window + 1 for Cohere2's sliding layers.
    config = {"model_type": "cohere2", "num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 8,
              "num_key_value_heads": 8, "sliding_window": 4096}
    assert kv_layout(config).windows_tokens() == (4097,)


def test_exaone4_string_pattern():
    config = {"model_type": "exaone4", "num_hidden_layers": 10, "hidden_size": 1024, "num_attention_heads": 8,
              "num_key_value_heads": 8, "sliding_window": 4096, "sliding_window_pattern": "LLLG"}
    kinds = _edge_kinds(config)
    # L = local, G = global, repeated from layer 0; the final layer is always global.
    assert [i for i, k in enumerate(kinds) if k == "full_attention"] == [3, 7, 9]


def test_lfm2_full_attn_idxs():
    config = {"model_type": "lfm2", "num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 16,
              "num_key_value_heads": 8, "conv_L_cache": 3, "conv_dim": 1024, "full_attn_idxs": [2, 5]}
    assert _edge_kinds(config) == _hf_layer_types("lfm2", config)
    layout = kv_layout(config)
    assert {l.state_elements for l in layout.layers if l.kind == "recurrent"} == {(3 - 1) * 1024}


def test_bamba_attn_layer_indices():
    config = {"model_type": "bamba", "num_hidden_layers": 8, "hidden_size": 1024, "num_attention_heads": 8,
              "num_key_value_heads": 8, "attn_layer_indices": [3, 7], "mamba_n_heads": 32, "mamba_d_head": 64,
              "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_n_groups": 1}
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.for_model("bamba", **{k: v for k, v in config.items() if k != "model_type"})
    assert _edge_kinds(config) == list(hf.layers_block_type)


def test_jamba_period_defaults():
    config = {k: v for k, v in JAMBA_V01.items() if k not in ("attn_layer_period", "attn_layer_offset")}
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoConfig.for_model("jamba", **{k: v for k, v in config.items() if k != "model_type"})
    assert [k == "full_attention" for k in _edge_kinds(config)] == [t == "attention" for t in hf.layers_block_type]


def test_olmo_hybrid_default():
    config = {"model_type": "olmo_hybrid", "num_hidden_layers": 10, "hidden_size": 1024,
              "num_attention_heads": 8, "num_key_value_heads": 8, "linear_num_key_heads": 8,
              "linear_num_value_heads": 8, "linear_key_head_dim": 96, "linear_value_head_dim": 192,
              "linear_conv_kernel_dim": 4}
    assert _edge_kinds(config) == _hf_layer_types("olmo_hybrid", config)


def test_granitemoehybrid_without_layer_types_is_all_mamba():
    config = {k: v for k, v in PUBLISHED["ibm-granite/granite-4.0-h-tiny"].items() if k != "layer_types"}
    assert _edge_kinds(config) == _hf_layer_types("granitemoehybrid", config)


def test_gpt_oss_without_layer_types_alternates():
    config = {"model_type": "gpt_oss", "num_hidden_layers": 6, "hidden_size": 2880, "num_attention_heads": 64,
              "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128}
    assert _edge_kinds(config) == _hf_layer_types("gpt_oss", config)


def test_llama4_reads_no_rope_layers_over_layer_types():
    # llama4.py decides chunked vs global from no_rope_layers, not layer_types.
    config = {"model_type": "llama4_text", "num_hidden_layers": 4, "hidden_size": 1024,
              "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128, "attention_chunk_size": 256,
              "no_rope_layers": [1, 0, 1, 0], "layer_types": ["full_attention"] * 4}
    assert _edge_kinds(config) == ["chunked_attention", "full_attention"] * 2


def test_zamba2_hybrid_layers():
    config = {"model_type": "zamba2", "num_hidden_layers": 6, "hidden_size": 1024, "num_attention_heads": 16,
              "attention_head_dim": 128, "layers_block_type": ["mamba", "mamba", "hybrid"] * 2,
              "mamba_d_state": 64, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_ngroups": 1,
              "n_mamba_heads": 32, "mamba_headdim": 64}
    layout = kv_layout(config)
    assert _edge_kinds(config) == ["linear_attention", "linear_attention", "hybrid"] * 2
    # zamba2.py: Attention(num_heads, attention_head_dim) -- one KV head per head.
    assert (layout.num_kv_heads, layout.head_dim) == (16, 128)
    conv, ssm = (4 - 1) * (2 * 1024 + 2 * 64), 32 * 64 * 64
    assert {l.state_elements for l in layout.layers} == {conv + ssm}
