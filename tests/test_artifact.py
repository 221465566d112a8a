"""Tests for edge_core.artifact (and edge_core.artifact.graph): manifests read without loading a weight."""

from __future__ import annotations

import builtins
import json
import os
import pickle
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from factories import (
    KNOWN_CONFIGS,
    QUANT_CONFIGS,
    llama_like_tensors,
    quantize_tensors,
    quantized_config,
    tiny_config,
    write_checkpoint,
    write_safetensors_header_only,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edge_core import artifact
from edge_core.artifact import read_manifest, weight_format_for
from edge_core.errors import ArtifactError
from edge_core.manifest import Manifest

BYTES_PER = {"bfloat16": 2, "float16": 2, "float32": 4}


def decoder_params(c: dict) -> int:
    """Parameter count of a Llama-family decoder from its config, by the architecture's formula."""
    hidden, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    kv = c["num_key_value_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    q, kv_width = heads * head_dim, kv * head_dim
    attention = hidden * q * 2 + hidden * kv_width * 2
    if c["model_type"] == "qwen2":
        attention += q + 2 * kv_width  # q/k/v biases
    mlp = 3 * hidden * c["intermediate_size"]
    norms = (4 if c["model_type"] == "gemma2" else 2) * hidden
    tied = c.get("tie_word_embeddings", c["model_type"] == "gemma2")
    embeddings = c["vocab_size"] * hidden * (1 if tied else 2)
    return layers * (attention + mlp + norms) + hidden + embeddings


#: Parameter counts the model publishers state (model cards / safetensors metadata).
PUBLISHED_PARAMS = {
    "meta-llama/Llama-3.1-8B": 8_030_261_248,
    "meta-llama/Llama-3.1-70B": 70_553_706_496,
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,
    "Qwen/Qwen2.5-0.5B": 494_032_768,
    "google/gemma-2-2b": 2_614_341_888,
}


def refused(path, code: str, **kwargs) -> ArtifactError:
    with pytest.raises(ArtifactError) as info:
        read_manifest(path, **kwargs)
    assert info.value.code == code, info.value.message
    assert info.value.message and info.value.remedy
    return info.value


def raw_safetensors(path: Path, header, data_bytes: int = 0, length: int | None = None) -> None:
    if header is None:  # shorter than the 8-byte length prefix
        path.write_bytes(b"\x10\x00\x00")
        return
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write((len(raw) if length is None else length).to_bytes(8, "little"))
        f.write(raw)
        f.write(b"\0" * data_bytes)


def tiny_checkpoint(root: Path, **overrides) -> Path:
    config = tiny_config(**overrides)
    return write_checkpoint(root, config, llama_like_tensors(config))


# ---------------------------------------------------------------- real geometries


@pytest.mark.parametrize("name", [n for n in PUBLISHED_PARAMS if n != "meta-llama/Llama-3.1-70B"])
def test_weight_bytes_match_published_parameter_count(tmp_path, name):
    config = KNOWN_CONFIGS[name]
    assert decoder_params(config) == PUBLISHED_PARAMS[name]
    m = read_manifest(write_checkpoint(tmp_path, config, llama_like_tensors(config)))
    assert m.weight_bytes == PUBLISHED_PARAMS[name] * BYTES_PER[config["torch_dtype"]]
    assert m.dtype == config["torch_dtype"]
    assert m.weight_format == "dense" and m.kind == "checkpoint"
    assert m.architecture == config["architectures"][0] and m.model_type == config["model_type"]
    assert m.config == config and m.quantization is None
    assert m.total_file_bytes > m.weight_bytes


def test_seventy_billion_in_thirty_shards(tmp_path):
    config = KNOWN_CONFIGS["meta-llama/Llama-3.1-70B"]
    write_checkpoint(tmp_path, config, llama_like_tensors(config), shards=30)
    m = read_manifest(tmp_path)
    assert m.weight_bytes == 70_553_706_496 * 2
    assert m.dtype_bytes == {"BF16": 70_553_706_496 * 2}
    assert m.tensor_count == 80 * 9 + 3
    names = [name for name, _ in m.files]
    assert names[:2] == ["config.json", "model.safetensors.index.json"]
    assert names[2:] == [f"model-{i:05d}-of-00030.safetensors" for i in range(1, 31)]
    assert m.total_file_bytes == sum(os.stat(tmp_path / n).st_size for n in names)


def test_dtype_falls_back_to_the_dominant_float_tensor_dtype(tmp_path):
    config = tiny_config()
    del config["torch_dtype"]
    tensors = llama_like_tensors(config, dtype="F16")
    tensors["extra.int_buffer"] = ("I64", [4])
    assert read_manifest(write_checkpoint(tmp_path, config, tensors)).dtype == "float16"


def test_transformers_v5_dtype_key(tmp_path):
    config = tiny_config(dtype="float32")
    del config["torch_dtype"]
    assert read_manifest(write_checkpoint(tmp_path, config, llama_like_tensors(config, "F32"))).dtype == "float32"


def test_reads_what_the_safetensors_library_writes(tmp_path):
    np = pytest.importorskip("numpy")
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    arrays = {"a": np.zeros((3, 5), np.float16), "b": np.arange(7, dtype=np.int64),
              "c": np.ones((2, 2, 2), np.float32), "empty": np.zeros((0, 4), np.float32),
              "flag": np.array([True, False])}
    safetensors_numpy.save_file(arrays, str(tmp_path / "model.safetensors"), metadata={"format": "np"})
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    m = read_manifest(tmp_path)
    assert m.tensor_count == len(arrays)
    assert m.weight_bytes == sum(a.nbytes for a in arrays.values())
    assert m.dtype_bytes == {"BOOL": 2, "F16": 30, "F32": 32, "I64": 56}


def test_factory_files_are_valid_for_the_safetensors_library(tmp_path):
    safe_open = pytest.importorskip("safetensors").safe_open
    tensors = {"w": ("BF16", [4, 8]), "s": ("F32", [4, 1]), "q": ("I8", [16])}
    write_safetensors_header_only(tmp_path / "x.safetensors", tensors, metadata={"format": "pt"})
    with safe_open(str(tmp_path / "x.safetensors"), "np") as f:
        assert set(f.keys()) == {"w", "s", "q"}
        assert f.get_slice("q").get_shape() == [16]
        assert f.get_slice("w").get_shape() == [4, 8]


# ---------------------------------------------------------------- formats


EXPECTED_FORMAT = {
    "w8a8-int8": "compressed-tensors:int8",
    "ct-fp8": "compressed-tensors:fp8",
    "w4a16": "compressed-tensors:w4a16",
    "gptq": "gptq",
    "awq": "awq",
    "fp8": "fp8",
    "modelopt-fp8": "fp8",
    "modelopt-nvfp4": "modelopt_fp4",
    "bitsandbytes": "bitsandbytes",
}


@pytest.mark.parametrize("scheme", sorted(EXPECTED_FORMAT))
def test_quantized_checkpoint_maps_to_its_format_name(tmp_path, scheme):
    config = quantized_config(tiny_config(), scheme)
    write_checkpoint(tmp_path, config, quantize_tensors(llama_like_tensors(config), scheme))
    m = read_manifest(tmp_path)
    assert m.weight_format == EXPECTED_FORMAT[scheme]
    assert m.quantization == QUANT_CONFIGS[scheme]
    assert m.quantized
    assert m.dtype == "bfloat16"  # the declared model dtype, not the int payload's


def test_int8_weight_bytes_follow_the_quantized_layout(tmp_path):
    config = quantized_config(tiny_config(), "w8a8-int8")
    write_checkpoint(tmp_path, config, quantize_tensors(llama_like_tensors(config), "w8a8-int8"))
    h, i, layers, vocab = 256, 512, 2, 1024
    linear_rows = h + 128 + 128 + h + i + i + h  # q, k, v, o, gate, up, down output rows
    linear_params = h * h + 2 * 128 * h + h * h + 3 * h * i
    expected_int8 = layers * linear_params
    expected_bf16 = 2 * (layers * linear_rows + 2 * vocab * h + (2 * layers + 1) * h)
    assert read_manifest(tmp_path).dtype_bytes == {"BF16": expected_bf16, "I8": expected_int8}


def test_modelopt_hf_quant_config_file(tmp_path):
    config = tiny_config()
    tensors = quantize_tensors(llama_like_tensors(config), "modelopt-nvfp4")
    write_checkpoint(tmp_path, config, tensors)
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt", "version": "0.19.0"},
         "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16}}))
    m = read_manifest(tmp_path)
    assert m.weight_format == "modelopt_fp4"
    assert "hf_quant_config.json" in dict(m.files)


@pytest.mark.parametrize("quant, expected", [
    (None, "dense"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "compressed-tensors:int8"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "compressed-tensors:fp8"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "compressed-tensors:w4a16"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"},
                              "input_activations": {"num_bits": 8, "type": "int"}}}}, "compressed-tensors:int8"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 8, "type": "int"}}}}, "compressed-tensors:w8a16"),
    ({"quant_method": "compressed-tensors",
      "config_groups": {"a": {"weights": {"num_bits": 8, "type": "float"}},
                        "b": {"weights": {"num_bits": 4, "type": "int"}}}}, "compressed-tensors:mixed"),
    ({"quant_method": "compressed-tensors", "format": "dense", "sparsity_config": {"format": "dense"}}, "dense"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "nvfp4"}}, "modelopt_fp4"),
    ({"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}, "fp8"),
    ({"quant_method": "GPTQ", "bits": 4}, "gptq"),
])
def test_weight_format_for(quant, expected):
    assert weight_format_for(quant) == expected


# A well-formed method edge has no rule for (hqq, MXFP8) is a named format,
# unknown:<method>, and mxfp4 a known one: tests/test_formats.py covers both,
# from the name to the gate's weight_format_unsupported refusal. A malformed
# config is still artifact_invalid, naming what is wrong.
@pytest.mark.parametrize("quant, needle", [
    ({"bits": 4}, "no quant_method"),
    ({"quant_method": "compressed-tensors", "config_groups": ["not", "a", "dict"]}, "config_groups"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized"}, "naive-quantized"),
])
def test_malformed_quantization_is_refused_by_name(quant, needle):
    with pytest.raises(ArtifactError) as info:
        weight_format_for(quant)
    assert info.value.code == "artifact_invalid"
    assert needle in info.value.message


# ---------------------------------------------------------------- layouts


def test_multimodal_wrapper_resolves_text_config(tmp_path):
    text = {k: v for k, v in KNOWN_CONFIGS["mistralai/Mistral-7B-v0.1"].items() if k != "torch_dtype"}
    text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"] = 256, 512, 2
    text["vocab_size"] = 1000
    config = {"architectures": ["Mistral3ForConditionalGeneration"], "model_type": "mistral3",
              "torch_dtype": "float16", "text_config": text,
              "vision_config": {"model_type": "pixtral", "hidden_size": 1024},
              "quantization_config": QUANT_CONFIGS["w8a8-int8"]}
    tensors = {("language_model." + k): v for k, v in
               quantize_tensors(llama_like_tensors({**text, "torch_dtype": "float16"}), "w8a8-int8").items()}
    tensors["vision_tower.patch_conv.weight"] = ("F16", [1024, 3, 16, 16])
    m = read_manifest(write_checkpoint(tmp_path, config, tensors))
    assert m.text_config_key == "text_config"
    assert m.config["hidden_size"] == 256 and m.config["sliding_window"] == 4096
    assert m.config["quantization_config"] == QUANT_CONFIGS["w8a8-int8"]
    assert m.text_config is m.config
    assert m.dtype == "float16"
    assert m.weight_format == "compressed-tensors:int8"
    assert m.architecture == "Mistral3ForConditionalGeneration" and m.model_type == "mistral3"


def test_hugging_face_cache_symlink_layout(tmp_path):
    built = write_checkpoint(tmp_path / "build", tiny_config(), llama_like_tensors(tiny_config()), shards=3)
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for i, src in enumerate(sorted(built.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        blob.write_bytes(src.read_bytes())
        (snapshot / src.name).symlink_to(Path("..", "..", "blobs", blob.name))
    m = read_manifest(snapshot)
    assert m.path == str(snapshot)
    assert m.weight_bytes == read_manifest(built).weight_bytes
    assert m.artifact_id == read_manifest(built).artifact_id


def test_unindexed_multi_file_checkpoint_reads_every_file(tmp_path):
    config = tiny_config()
    tensors = llama_like_tensors(config)
    names = list(tensors)
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_safetensors_header_only(tmp_path / "a.safetensors", {n: tensors[n] for n in names[:5]})
    write_safetensors_header_only(tmp_path / "b.safetensors", {n: tensors[n] for n in names[5:]})
    assert read_manifest(tmp_path).tensor_count == len(tensors)


def test_artifact_id_covers_config_and_headers_not_weights(tmp_path):
    config = tiny_config()
    a = write_checkpoint(tmp_path / "a", config, llama_like_tensors(config), shards=2)
    b = write_checkpoint(tmp_path / "b", config, llama_like_tensors(config), shards=2)
    ma, mb = read_manifest(a, digest_weights=True), read_manifest(b, digest_weights=True)
    assert ma.artifact_id == mb.artifact_id and len(ma.artifact_id) == 16
    assert ma.content_digest == mb.content_digest and len(ma.content_digest) == 64
    assert read_manifest(a).content_digest is None

    shard = b / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one weight byte: same headers, different content
    shard.write_bytes(bytes(data))
    changed = read_manifest(b, digest_weights=True)
    assert changed.artifact_id == ma.artifact_id and changed.content_digest != ma.content_digest

    (b / "config.json").write_text(json.dumps({**config, "rope_theta": 1.0}))
    assert read_manifest(b).artifact_id != ma.artifact_id


def test_to_dict_is_json_and_complete(tmp_path):
    m = read_manifest(tiny_checkpoint(tmp_path))
    d = json.loads(json.dumps(m.to_dict()))
    assert d["weight_bytes"] == m.weight_bytes and d["evidence"] == "D"
    assert d["files"][0] == {"name": "config.json", "size_bytes": os.stat(tmp_path / "config.json").st_size}
    d["config"]["hidden_size"] = -1
    assert m.config["hidden_size"] == 256  # to_dict hands out copies


# ---------------------------------------------------------------- hostile input: config


@pytest.mark.parametrize("content", [None, b"", b"  \n", b"{not json", b"[1, 2]", b"42", b"\xff\xfe\x00{",
                                     b"[" * 100_000 + b"]" * 100_000])
def test_bad_config_is_config_unreadable(tmp_path, content):
    write_safetensors_header_only(tmp_path / "model.safetensors", {"w": ("F32", [2])})
    if content is not None:
        (tmp_path / "config.json").write_bytes(content)
    refused(tmp_path, "config_unreadable")


# ---------------------------------------------------------------- hostile input: safetensors headers

W = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize("header, data_bytes, length, needle", [
    (None, 0, None, "too short"),
    ({"w": W}, 16, 10**9, "claims"),
    ({"w": W}, 16, 2**63, "limit"),
    (b"\x00\x01\x02 not json", 0, None, "not JSON"),
    (b"\xff\xfe", 0, None, "not JSON"),
    (b"[1, 2, 3]", 0, None, "not a JSON object"),
    (b"[" * 50_000, 0, None, "not JSON"),
    ({"w": {**W, "dtype": "Q4_K"}}, 16, None, "unknown dtype"),
    ({"w": {**W, "shape": [2, -2]}}, 16, None, "shape"),
    ({"w": {**W, "shape": "2x2"}}, 16, None, "shape"),
    ({"w": {**W, "shape": [True, 4]}}, 16, None, "shape"),
    ({"w": {**W, "shape": [2.0, 2]}}, 16, None, "shape"),
    ({"w": {**W, "data_offsets": [0]}}, 16, None, "data_offsets"),
    ({"w": {**W, "data_offsets": [0, "16"]}}, 16, None, "data_offsets"),
    ({"w": {**W, "data_offsets": [16, 0]}}, 16, None, "data_offsets"),
    ({"w": {**W, "data_offsets": [-4, 12]}}, 16, None, "data_offsets"),
    ({"w": W}, 8, None, "truncated"),
    ({"w": {**W, "shape": [2, 3]}}, 16, None, "shape needs"),
    ({"w": {**W, "shape": [10**30, 10**30]}}, 16, None, "shape needs"),
    ({"w": W, "v": {**W, "data_offsets": [8, 24]}}, 24, None, "overlapping"),
    ({"w": {**W, "data_offsets": [4, 20]}}, 20, None, "belong to no tensor"),
    ({"w": W}, 20, None, "trailing"),
    ({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, 2, None, "sub-byte"),
    ({"w": "F32"}, 16, None, "not an object"),
    ({"__metadata__": {"n": 1}, "w": W}, 16, None, "__metadata__"),
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
     b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', 4, None, "twice"),
    # A field given twice in one entry, and a duplicate hidden behind an escaped key: the fast
    # parse's key counts differ, so the strict parse names it.
    (b'{"w": {"dtype": "F32", "dtype": "F16", "shape": [1], "data_offsets": [0, 4]}}', 4, None, "twice"),
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
     b'"\\u0077": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', 4, None, "twice"),
])
def test_lying_header_is_refused(tmp_path, header, data_bytes, length, needle):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    raw_safetensors(tmp_path / "model.safetensors", header, data_bytes, length)
    err = refused(tmp_path, "artifact_invalid")
    assert needle in err.message and "model.safetensors" in err.message


def test_sub_byte_and_empty_tensors_are_accepted(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    raw_safetensors(tmp_path / "model.safetensors", {
        "__metadata__": {"format": "pt"},
        "packed": {"dtype": "F4", "shape": [4, 3], "data_offsets": [0, 6]},
        "empty": {"dtype": "BF16", "shape": [0, 128], "data_offsets": [6, 6]},
        "scalar": {"dtype": "F32", "shape": [], "data_offsets": [6, 10]}}, 10)
    m = read_manifest(tmp_path)
    assert (m.weight_bytes, m.tensor_count, m.dtype_bytes) == (10, 3, {"BF16": 0, "F32": 4, "F4": 6})


# ---------------------------------------------------------------- hostile input: index and layout


def sharded(tmp_path) -> tuple[Path, dict]:
    root = write_checkpoint(tmp_path, tiny_config(), llama_like_tensors(tiny_config()), shards=2)
    return root, json.loads((root / "model.safetensors.index.json").read_text())


@pytest.mark.parametrize("bad_name", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors",
                                      "..\\x.safetensors", "", "a\0b.safetensors", "sub//x.safetensors"])
def test_index_naming_files_outside_the_directory_is_refused(tmp_path, bad_name):
    root, index = sharded(tmp_path / "m")
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "m" / "model-00001-of-00002.safetensors").read_bytes())
    index["weight_map"]["model.norm.weight"] = bad_name
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "outside the model directory" in refused(root, "artifact_invalid").message


@pytest.mark.parametrize("mutate, needle", [
    (lambda ix: ix["weight_map"].__setitem__("model.norm.weight", "model-00009-of-00009.safetensors"), "missing"),
    (lambda ix: ix["weight_map"].__setitem__("model.norm.weight", "model-00001-of-00002.safetensors"),
     "does not hold"),
    (lambda ix: ix.__setitem__("weight_map", ["model-00001-of-00002.safetensors"]), "weight_map"),
    (lambda ix: ix.__setitem__("weight_map", {}), "weight_map"),
    (lambda ix: ix["weight_map"].__setitem__("model.norm.weight", 3), "weight_map"),
])
def test_lying_index_is_refused(tmp_path, mutate, needle):
    root, index = sharded(tmp_path)
    mutate(index)
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    assert needle in refused(root, "artifact_invalid").message


def test_index_that_is_not_json_is_refused(tmp_path):
    root, _ = sharded(tmp_path)
    (root / "model.safetensors.index.json").write_text("{")
    refused(root, "artifact_invalid")


def test_tensor_in_two_files_is_refused(tmp_path):
    tiny_checkpoint(tmp_path)
    write_safetensors_header_only(tmp_path / "stray.safetensors", {"model.norm.weight": ("BF16", [256])})
    assert "both" in refused(tmp_path, "artifact_invalid").message


def test_missing_path_plain_file_and_empty_directory(tmp_path):
    assert "does not exist" in refused(tmp_path / "nope", "artifact_invalid").message
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert "not a model directory" in refused(tmp_path / "model.safetensors", "artifact_invalid").message
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "config_unreadable")
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert "no *.safetensors" in refused(tmp_path / "empty", "artifact_invalid").message


class Opened:
    """Records every path opened through os.open and builtins.open while active."""

    def __init__(self, monkeypatch):
        self.paths: list[str] = []
        real_os_open, real_open = os.open, builtins.open

        def spy_os_open(path, *a, **k):
            self.paths.append(os.path.realpath(path))
            return real_os_open(path, *a, **k)

        def spy_open(file, *a, **k):
            if isinstance(file, (str, os.PathLike)):
                self.paths.append(os.path.realpath(file))
            return real_open(file, *a, **k)

        monkeypatch.setattr(os, "open", spy_os_open)
        monkeypatch.setattr(builtins, "open", spy_open)


def guarded(fn, *args):
    """Run fn in a thread so a blocking open fails the test instead of hanging the suite."""
    result: dict = {}

    def target():
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(120)  # a guard against a hang, not a speed check: the call takes milliseconds
    if thread.is_alive():
        pytest.fail("read_manifest blocked: it opened a FIFO or device")
    return result


@pytest.mark.parametrize("target", ["fifo", "/dev/zero"])
@pytest.mark.parametrize("victim", ["model.safetensors", "config.json", "model.safetensors.index.json"])
def test_non_regular_files_are_refused_without_opening(tmp_path, monkeypatch, target, victim):
    if not hasattr(os, "mkfifo") or not os.path.exists("/dev/zero"):
        pytest.skip("needs a POSIX system with FIFOs and /dev/zero")
    if victim == "model.safetensors.index.json":
        root, _ = sharded(tmp_path)
    else:
        root = tiny_checkpoint(tmp_path)
    path = root / victim
    path.unlink()
    if target == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    opened = Opened(monkeypatch)
    result = guarded(read_manifest, root)
    err = result.get("error")
    assert isinstance(err, ArtifactError), result
    assert err.code == ("config_unreadable" if victim == "config.json" else "artifact_invalid")
    assert ("a FIFO" if target == "fifo" else "a device") in err.message
    assert os.path.realpath(path) not in opened.paths


def test_fifo_swapped_in_after_the_stat_is_caught_by_fstat(tmp_path, monkeypatch):
    if not hasattr(os, "mkfifo"):
        pytest.skip("needs FIFOs")
    root = tiny_checkpoint(tmp_path)
    regular = os.stat(root / "config.json")
    shard = root / "model.safetensors"
    shard.unlink()
    os.mkfifo(shard)
    real_stat = os.stat
    # The race: stat saw a regular file, then the path became a FIFO.
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: regular if str(p) == str(shard) else real_stat(p, *a, **k))
    err = guarded(read_manifest, root).get("error")
    assert isinstance(err, ArtifactError) and "a FIFO" in err.message


@pytest.mark.parametrize("names", [["pytorch_model.bin"], ["model.pt"], ["consolidated.00.pth"], ["model.ckpt"],
                                   ["pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json"]])
def test_pickle_only_weights_are_refused_unopened(tmp_path, monkeypatch, names):
    sentinel = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (sentinel,))

    root = tmp_path / "model"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(tiny_config()))
    for name in names:
        (root / name).write_bytes(pickle.dumps(Payload()))
    opened = Opened(monkeypatch)
    err = refused(root, "artifact_invalid")
    assert "pickle" in err.message and names[0] in err.message
    assert "safetensors.torch.save_file" in err.remedy
    assert not sentinel.exists()
    assert not any(p.endswith(tuple(names)) for p in opened.paths)


# ---------------------------------------------------------------- properties


def _only_artifact_errors(root: str) -> Manifest | None:
    try:
        return read_manifest(root)
    except ArtifactError as exc:
        assert exc.code in ("config_unreadable", "artifact_invalid") and exc.message and exc.remedy
        assert artifact.INTERNAL_MARK not in exc.message, exc.message
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_as_a_shard(data):
    with tempfile.TemporaryDirectory() as root:
        Path(root, "config.json").write_text(json.dumps(tiny_config()))
        Path(root, "model.safetensors").write_bytes(data)
        _only_artifact_errors(root)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
tensor_entries = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "I8", "F4", "U8", "bogus"]) | json_values,
    "shape": st.lists(st.integers(-2, 6), max_size=3) | json_values,
    "data_offsets": st.lists(st.integers(-2, 64), min_size=2, max_size=2) | json_values,
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(header=st.dictionaries(st.text(max_size=6), tensor_entries | json_values, max_size=4),
       data_bytes=st.integers(0, 64))
def test_structured_headers_either_tile_exactly_or_are_refused(header, data_bytes):
    with tempfile.TemporaryDirectory() as root:
        Path(root, "config.json").write_text(json.dumps(tiny_config()))
        raw_safetensors(Path(root, "model.safetensors"), header, data_bytes)
        m = _only_artifact_errors(root)
        if m is not None:
            assert m.weight_bytes == data_bytes  # success means every data byte belongs to one tensor


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=st.text(max_size=200) | json_values.map(json.dumps)
       | st.dictionaries(st.sampled_from(["quantization_config", "text_config", "torch_dtype", "architectures",
                                          "model_type", "dtype", "compression_config"]),
                         json_values, max_size=4).map(json.dumps))
def test_arbitrary_config_text(config):
    with tempfile.TemporaryDirectory() as root:
        Path(root, "config.json").write_text(config, encoding="utf-8", errors="surrogatepass")
        write_safetensors_header_only(Path(root, "model.safetensors"), {"w": ("BF16", [4, 4])})
        _only_artifact_errors(root)


quant_groups = st.dictionaries(st.text(max_size=4), st.fixed_dictionaries({}, optional={
    "weights": st.fixed_dictionaries({}, optional={"num_bits": st.sampled_from([4, 8, 16]) | json_values,
                                                   "type": st.sampled_from(["int", "float"]) | json_values})
    | json_values,
    "input_activations": st.none() | st.fixed_dictionaries({"num_bits": st.sampled_from([8, 16]),
                                                            "type": st.sampled_from(["int", "float"])})
    | json_values}) | json_values, max_size=3)


@settings(max_examples=300, deadline=None)
@given(quant=st.fixed_dictionaries({}, optional={
    "quant_method": st.sampled_from(["compressed-tensors", "modelopt", "gptq", "mxfp4"]) | json_values,
    "format": st.sampled_from(["int-quantized", "pack-quantized", "naive-quantized", "dense"]) | json_values,
    "config_groups": quant_groups | json_values,
    "quant_algo": st.sampled_from(["NVFP4", "FP8", "MXFP8"]) | json_values,
    "quantization": st.fixed_dictionaries({"quant_algo": json_values}) | json_values}))
def test_any_quantization_config_names_a_format_or_is_refused(quant):
    try:
        assert isinstance(weight_format_for(quant), str)
    except ArtifactError as exc:
        assert exc.code == "artifact_invalid" and exc.remedy


# ---------------------------------------------------------------- ONNX graphs


def _onnx():
    return pytest.importorskip("onnx")


def matmul_graph(elem_type: int, name: str = "fp"):
    onnx = _onnx()
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    np_type = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}[elem_type]
    weight = numpy_helper.from_array(np.ones((64, 32), np_type), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], name,
                              [helper.make_tensor_value_info("x", elem_type, [1, 64])],
                              [helper.make_tensor_value_info("y", elem_type, [1, 32])], [weight])
    return onnx, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def qdq_graph(act_type: int):
    """x -(Q/DQ act_type)-> MatMul with an int8 weight behind a DequantizeLinear."""
    onnx = _onnx()
    from onnx import TensorProto, helper

    inits = [
        helper.make_tensor("x_scale", TensorProto.FLOAT, [], [0.01]),
        helper.make_tensor("x_zp", act_type, [], [0]),
        helper.make_tensor("w_q", TensorProto.INT8, [64, 32], [1] * 64 * 32),
        helper.make_tensor("w_scale", TensorProto.FLOAT, [], [0.02]),
        helper.make_tensor("w_zp", TensorProto.INT8, [], [0]),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x_dq"]),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w"]),
        helper.make_node("MatMul", ["x_dq", "w"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "qdq", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], inits)
    return onnx, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("kind, expected, weight_bytes", [
    ("fp32", "onnx:fp32", 64 * 32 * 4), ("fp16", "onnx:fp16", 64 * 32 * 2),
    ("a16w8", "onnx:a16w8", 4 + 2 + 64 * 32 + 4 + 1), ("a8w8", "onnx:a8w8", 4 + 1 + 64 * 32 + 4 + 1),
])
def test_onnx_graph_formats(tmp_path, kind, expected, weight_bytes):
    if kind in ("fp32", "fp16"):
        onnx, model = matmul_graph(1 if kind == "fp32" else 10)
    else:
        onnx, model = qdq_graph(onnx_type("UINT16" if kind == "a16w8" else "UINT8"))
    onnx.save(model, str(tmp_path / "model.onnx"))
    m = read_manifest(tmp_path / "model.onnx")
    assert (m.kind, m.weight_format, m.weight_bytes) == ("onnx", expected, weight_bytes)
    assert m.onnx["opset"] == (17 if kind in ("fp32", "fp16") else 21)
    assert m.onnx["qdq"] == kind.startswith("a")
    assert m.files == (("model.onnx", os.stat(tmp_path / "model.onnx").st_size),)


def test_qdq_zero_point_from_a_constant_node(tmp_path):
    onnx, model = qdq_graph(onnx_type("UINT16"))
    from onnx import helper

    graph = model.graph
    zp = next(t for t in graph.initializer if t.name == "x_zp")
    value = onnx.TensorProto()
    value.CopyFrom(zp)
    value.name = ""  # torch exports leave the Constant's tensor unnamed; nodes use its output
    graph.node.insert(0, helper.make_node("Constant", [], ["x_zp"], value=value))
    graph.initializer.remove(zp)
    onnx.save(model, str(tmp_path / "model.onnx"))
    m = read_manifest(tmp_path / "model.onnx")
    assert m.weight_format == "onnx:a16w8" and m.onnx["activation_bits"] == [16]


def onnx_type(name: str) -> int:
    return getattr(_onnx().TensorProto, name)


def test_onnx_directory_with_external_data_and_config(tmp_path):
    onnx, model = matmul_graph(onnx_type("FLOAT"))
    onnx.save(model, str(tmp_path / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="model.onnx_data", size_threshold=0)
    (tmp_path / "config.json").write_text(json.dumps(tiny_config(architectures=["Qwen2ForCausalLM"])))
    m = read_manifest(tmp_path, digest_weights=True)
    assert m.weight_bytes == 64 * 32 * 4
    assert dict(m.files)["model.onnx_data"] == 64 * 32 * 4
    assert m.onnx["external_data_files"] == ["model.onnx_data"]
    assert m.architecture == "Qwen2ForCausalLM" and m.content_digest is not None

    with open(tmp_path / "model.onnx_data", "r+b") as f:
        f.truncate(100)
    assert "truncated" in refused(tmp_path, "artifact_invalid").message


def test_onnx_external_data_outside_the_directory_is_refused(tmp_path):
    onnx, model = matmul_graph(onnx_type("FLOAT"))
    (tmp_path / "g").mkdir()
    onnx.save(model, str(tmp_path / "g" / "model.onnx"), save_as_external_data=True, location="w.bin",
              size_threshold=0)
    (tmp_path / "w.bin").write_bytes((tmp_path / "g" / "w.bin").read_bytes())
    model = onnx.load(str(tmp_path / "g" / "model.onnx"), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../w.bin"
    onnx.save(model, str(tmp_path / "g" / "model.onnx"))
    assert "outside" in refused(tmp_path / "g" / "model.onnx", "artifact_invalid").message


def test_onnx_refusals(tmp_path, monkeypatch):
    _onnx()
    (tmp_path / "junk.onnx").write_bytes(b"\x08\x07\x12\xff\xff\xff\xff\x0f garbage")
    refused(tmp_path / "junk.onnx", "artifact_invalid")
    (tmp_path / "two").mkdir()
    for name in ("a.onnx", "b.onnx"):
        (tmp_path / "two" / name).write_bytes(b"")
    assert "2 ONNX graphs" in refused(tmp_path / "two", "artifact_invalid").message
    monkeypatch.setitem(sys.modules, "onnx", None)  # as if the extra were not installed
    onnx_module_missing = refused(tmp_path / "junk.onnx", "artifact_invalid")
    assert onnx_module_missing.remedy == "pip install 'edge-core[onnx]'"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=256))
def test_arbitrary_bytes_as_an_onnx_graph(data):
    _onnx()
    with tempfile.TemporaryDirectory() as root:
        Path(root, "model.onnx").write_bytes(data)
        _only_artifact_errors(str(Path(root, "model.onnx")))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=6))
@example(edits=[(114, 50)])  # found by this test: a DequantizeLinear node left with no output
def test_corrupted_onnx_graph_is_refused_or_read(edits):
    onnx, model = qdq_graph(onnx_type("UINT16"))
    data = bytearray(model.SerializeToString())
    for position, value in edits:
        data[position % len(data)] = value
    with tempfile.TemporaryDirectory() as root:
        Path(root, "model.onnx").write_bytes(bytes(data))
        _only_artifact_errors(str(Path(root, "model.onnx")))


# ---------------------------------------------------------------- published configs


def test_known_configs_are_plain_json():
    assert json.loads(json.dumps(KNOWN_CONFIGS)) == KNOWN_CONFIGS
    ds = KNOWN_CONFIGS["deepseek-ai/DeepSeek-V2-Lite"]
    assert (ds["kv_lora_rank"], ds["qk_rope_head_dim"], ds["q_lora_rank"]) == (512, 64, None)


def test_a16w8_is_named_by_the_matmul_weights_not_a_16_bit_norm_scale(tmp_path):
    """ONNX Runtime's A16W8 quantizer keeps a norm's scale at 16 bits; the weights are still 8-bit."""
    onnx, model = qdq_graph(onnx_type("UINT16"))
    from onnx import TensorProto, helper

    graph = model.graph
    graph.initializer.extend([
        helper.make_tensor("g_q", TensorProto.UINT16, [32], [3] * 32),
        helper.make_tensor("g_scale", TensorProto.FLOAT, [], [0.001]),
        helper.make_tensor("g_zp", TensorProto.UINT16, [], [0]),
    ])
    graph.node.extend([
        helper.make_node("DequantizeLinear", ["g_q", "g_scale", "g_zp"], ["g"]),
        helper.make_node("Mul", ["y", "g"], ["y_scaled"]),
    ])
    graph.output[0].name = "y_scaled"
    onnx.save(model, str(tmp_path / "model.onnx"))
    m = read_manifest(tmp_path / "model.onnx")
    assert m.weight_format == "onnx:a16w8"
    assert m.onnx["weight_bits"] == [8]


def test_mla_moe_checkpoint_weight_bytes_match_the_published_architecture(tmp_path):
    """DeepSeek-V2-Lite: MLA attention + 64-expert MoE, 15.7B parameters on its model card."""
    from factories import deepseek_v2_tensors

    c = KNOWN_CONFIGS["deepseek-ai/DeepSeek-V2-Lite"]
    write_checkpoint(tmp_path, c, deepseek_v2_tensors(c), shards=4)
    h, v, n = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    attention = (n * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]) * h          # q_proj
                 + (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * h                # compressed KV + rope key
                 + c["kv_lora_rank"]                                               # its norm
                 + n * (c["qk_nope_head_dim"] + c["v_head_dim"]) * c["kv_lora_rank"]  # KV up-projection
                 + h * n * c["v_head_dim"] + 2 * h)                                # o_proj, two norms
    dense = 3 * h * c["intermediate_size"]
    moe = (c["n_routed_experts"] * h + c["n_routed_experts"] * 3 * h * c["moe_intermediate_size"]
           + 3 * h * c["moe_intermediate_size"] * c["n_shared_experts"])
    layers = c["num_hidden_layers"]
    params = 2 * v * h + layers * attention + dense + (layers - 1) * moe + h
    assert params == 15_706_484_224 and round(params / 1e9, 1) == 15.7
    m = read_manifest(tmp_path)
    assert m.weight_bytes == params * 2 and m.model_type == "deepseek_v2" and m.weight_format == "dense"
