"""KV-cache arithmetic: layouts and charges against published architectures.

Expected numbers are computed here from the model cards' config values and
the textbook formulas (K and V per kv head per layer; the MLA latent; Mamba's
conv + SSM state), never copied from kv.py's output. The vLLM rule is also
checked against the installed vLLM's own spec classes where vLLM is importable.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_core.errors import ArtifactError, UsageError
from edge_core.plan.kv import estimate_kv, kv_layout, max_model_len_for

MIB = 1 << 20
GIB = 1 << 30
BF16 = 2


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
    state_per_layer = (d_inner * (4 - 1) + d_inner * 16) * BF16  # conv + SSM state
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
    assert est.recurrent_state_bytes == 36 * (conv + recurrent) * BF16
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
    state = (4 - 1) * (d_inner + 2 * 1 * 128) + 48 * 64 * 128
    est = estimate_kv(config, max_model_len=100)
    assert est.recurrent_state_bytes == 3 * state * BF16
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
    state = (4 - 1) * (1536 + 2 * 128) + 24 * 64 * 128
    est = estimate_kv(config, max_model_len=100, max_num_batched_tokens=64, block_size=16)
    assert est.layer_counts["full"] == 4
    assert est.recurrent_state_bytes == 4 * state * BF16
    assert est.bytes_flat == 100 * 4 * 2 * 2 * 128 * BF16 + est.recurrent_state_bytes
    assert est.bytes_vllm >= est.bytes_flat


def test_pure_mamba_has_no_per_token_charge():
    config = {"model_type": "mamba", "num_hidden_layers": 24, "hidden_size": 768,
              "intermediate_size": 1536, "state_size": 16, "conv_kernel": 4}
    small = estimate_kv(config, max_model_len=10)
    large = estimate_kv(config, max_model_len=10_000)
    assert small.bytes_per_token_flat == 0
    assert small.bytes_flat == large.bytes_flat == 24 * (1536 * 3 + 1536 * 16) * BF16


# -------------------------------------------------------------- max_model_len_for

@pytest.mark.parametrize("rule", ["flat", "by_layer_type", "vllm"])
@pytest.mark.parametrize("config", [REFERENCE, LLAMA_31_8B, MISTRAL_7B_V01, GEMMA3_4B_TEXT,
                                    DEEPSEEK_V2_LITE, JAMBA_V01])
@pytest.mark.parametrize("budget", [300 * MIB, GIB + 12345])
def test_max_model_len_for_is_the_largest_that_fits(rule, config, budget):
    kwargs = dict(max_num_seqs=2, max_num_batched_tokens=512, block_size=16)
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
           DEEPSEEK_V2_LITE, JAMBA_V01, QWEN3_NEXT_80B]


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
