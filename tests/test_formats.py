"""Format names and the schemes behind them (edge_core/artifact/formats.py), and the format remedies.

Expected names are SPEC section 4's; expected scheme values are what each
producing tool's ``quantization_config`` means (AutoGPTQ's ``bits``/``sym``/
``desc_act``, llm-compressor's ``strategy``, AutoFP8's ``activation_scheme``).
The bitsandbytes remedy is checked against the installed vLLM's own
quantization registry, read here with a regular expression of this file's own.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from factories import (
    QUANT_CONFIGS,
    llama_like_tensors,
    quantize_tensors,
    quantized_config,
    tiny_config,
    write_checkpoint,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_core import Device
from edge_core.artifact import read_manifest, weight_format_for
from edge_core.artifact.formats import SCHEME_KEYS, quantization_scheme_for
from edge_core.errors import ArtifactError
from edge_core.host import HostFacts
from edge_core.plan.remedies import FORMATS_ELSEWHERE
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import make_plan

GIB = 1 << 30

#: SPEC section 4's names (mxfp4 and unknown:<method> from issue 10): a name says how
#: the checkpoint was produced, whatever scheme it hides.
EXPECTED_FORMAT = {
    "w8a8-int8": "compressed-tensors:int8",
    "ct-fp8": "compressed-tensors:fp8",
    "w4a16": "compressed-tensors:w4a16",
    "gptq": "gptq",
    "gptq-8bit": "gptq",
    "gptq-asym": "gptq",
    "gptq-desc-act": "gptq",
    "awq": "awq",
    "fp8": "fp8",
    "fp8-per-tensor": "fp8",
    "modelopt-fp8": "fp8",
    "modelopt-nvfp4": "modelopt_fp4",
    "bitsandbytes": "bitsandbytes",
    "mxfp4": "mxfp4",
    "hqq": "unknown:hqq",
}

#: What each quantization_config says about its scheme, in SCHEME_KEYS' terms (keys left out: None).
EXPECTED_SCHEME = {
    "gptq": dict(method="gptq", weight_type="int", weight_bits=4, group_size=128, symmetric=True, desc_act=False,
                 weight_scale="group"),
    "gptq-8bit": dict(method="gptq", weight_type="int", weight_bits=8, group_size=128, symmetric=True,
                      desc_act=False, weight_scale="group"),
    "gptq-asym": dict(method="gptq", weight_type="int", weight_bits=4, group_size=128, symmetric=False,
                      desc_act=False, weight_scale="group"),
    "gptq-desc-act": dict(method="gptq", weight_type="int", weight_bits=4, group_size=128, symmetric=True,
                          desc_act=True, weight_scale="group"),
    # AutoAWQ's zero_point: asymmetric weights.
    "awq": dict(method="awq", weight_type="int", weight_bits=4, group_size=128, symmetric=False,
                weight_scale="group"),
    "w4a16": dict(method="compressed-tensors", weight_type="int", weight_bits=4, group_size=128, symmetric=True,
                  weight_scale="group"),
    "w8a8-int8": dict(method="compressed-tensors", weight_type="int", weight_bits=8, symmetric=True,
                      weight_scale="channel", activation_type="int", activation_bits=8, activation_dynamic=True,
                      activation_scale="token"),
    "ct-fp8": dict(method="compressed-tensors", weight_type="float", weight_bits=8, symmetric=True,
                   weight_scale="channel", activation_type="float", activation_bits=8, activation_dynamic=True,
                   activation_scale="token"),
    # DeepSeek/Qwen fp8 releases: 128x128 weight blocks, activations per token group of 128.
    "fp8": dict(method="fp8", weight_type="float", weight_bits=8, symmetric=True, weight_scale="block",
                weight_block_size=[128, 128], activation_type="float", activation_bits=8, activation_dynamic=True,
                activation_scale="group"),
    # AutoFP8: one weight scale per tensor and a static activation scale.
    "fp8-per-tensor": dict(method="fp8", weight_type="float", weight_bits=8, symmetric=True, weight_scale="tensor",
                           activation_type="float", activation_bits=8, activation_dynamic=False,
                           activation_scale="tensor"),
    "modelopt-nvfp4": dict(method="modelopt", weight_type="float", weight_bits=4, group_size=16, symmetric=True,
                           weight_scale="group", activation_type="float", activation_bits=4,
                           activation_dynamic=True, activation_scale="group"),
    "mxfp4": dict(method="mxfp4", weight_type="float", weight_bits=4, group_size=32, symmetric=True,
                  weight_scale="group"),
    "bitsandbytes": dict(method="bitsandbytes", weight_type="float", weight_bits=4),
    "hqq": dict(method="hqq"),
}


def _checkpoint(root: Path, scheme: str) -> Path:
    config = quantized_config(tiny_config(), scheme)
    return write_checkpoint(root, config, quantize_tensors(llama_like_tensors(config), scheme))


def test_every_factory_config_has_an_expected_format():
    assert set(QUANT_CONFIGS) == set(EXPECTED_FORMAT)


@pytest.mark.parametrize("scheme", sorted(EXPECTED_FORMAT))
def test_format_name_is_specs_whatever_the_scheme(tmp_path, scheme):
    assert read_manifest(_checkpoint(tmp_path, scheme)).weight_format == EXPECTED_FORMAT[scheme]


@pytest.mark.parametrize("scheme", sorted(EXPECTED_SCHEME))
def test_manifest_carries_the_scheme_a_gate_needs(tmp_path, scheme):
    manifest = read_manifest(_checkpoint(tmp_path, scheme))
    expected = {key: None for key in SCHEME_KEYS} | EXPECTED_SCHEME[scheme]
    assert {key: manifest.quantization_scheme[key] for key in SCHEME_KEYS} == expected
    assert manifest.to_dict()["quantization_scheme"] == manifest.quantization_scheme
    json.dumps(manifest.to_dict())  # the manifest's JSON stays JSON


def test_dense_checkpoint_has_no_scheme(tmp_path):
    config = tiny_config()
    manifest = read_manifest(write_checkpoint(tmp_path, config, llama_like_tensors(config)))
    assert manifest.weight_format == "dense" and manifest.quantization_scheme is None


def test_awq_spelled_the_autoawq_way_reads_the_same():
    # AutoAWQ's own quant_config.json spells w_bit / q_group_size.
    scheme = quantization_scheme_for({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": False})
    assert (scheme["weight_bits"], scheme["group_size"], scheme["symmetric"]) == (4, 64, True)


def test_mixed_compressed_tensors_groups_are_marked_mixed():
    quant = {"quant_method": "compressed-tensors", "config_groups": {
        "a": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
        "b": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}}}
    scheme = quantization_scheme_for(quant)
    assert weight_format_for(quant) == "compressed-tensors:mixed"
    assert scheme["mixed"] is True and scheme["weight_bits"] is None


@pytest.mark.parametrize("quant, expected", [
    ({"quant_method": "mxfp4"}, "mxfp4"),
    ({"quant_method": "hqq", "nbits": 4}, "unknown:hqq"),
    ({"quant_method": "TorchAO"}, "unknown:torchao"),
    ({"quant_method": "modelopt", "quant_algo": "MXFP8"}, "unknown:modelopt:mxfp8"),
])
def test_a_valid_checkpoint_in_an_unknown_format_is_named_not_invalid(quant, expected):
    assert weight_format_for(quant) == expected


@pytest.mark.parametrize("quant, needle", [
    ({"bits": 4}, "no quant_method"),
    ({"quant_method": "not a method!"}, "not a quantization method name"),
    ({"quant_method": "modelopt"}, "quant_algo"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized"}, "naive-quantized"),
])
def test_a_malformed_config_is_still_artifact_invalid(quant, needle):
    with pytest.raises(ArtifactError) as info:
        weight_format_for(quant)
    assert info.value.code == "artifact_invalid" and needle in info.value.message


def _cpu_only(formats: tuple[str, ...]) -> Device:
    return Device(device_id="cpu", kind="cpu", vendor="intel", name="Xeon", backend="vllm:cpu", runnable=True,
                  memory_pool="host_ram", memory_bytes=64 * GIB, weight_formats=formats, evidence={"found": "D"},
                  extras={"kv_block_size": 128})


HOST = HostFacts(system="linux", mem_total_bytes=64 * GIB, mem_available_bytes=60 * GIB, cgroup_limit_bytes=None,
                 cgroup_usage_bytes=None, logical_cores=8, physical_cores=4, cpu_model="Intel Xeon",
                 machine="x86_64", isa_flags=("avx2",), numa_nodes=())


def test_unknown_method_is_refused_as_a_format_naming_the_devices_formats(tmp_path):
    plan = make_plan(str(_checkpoint(tmp_path, "hqq")), session=SessionSpec(max_model_len=512),
                     devices=[_cpu_only(("dense", "gptq"))], host=HOST)
    [refusal] = plan.refusals
    assert refusal.code == "weight_format_unsupported"
    assert "unknown:hqq" in refusal.message
    assert "dense, gptq" in refusal.remedy and "'hqq'" in refusal.remedy
    assert "edge-cuda" not in refusal.remedy


def _vllm_quant_registry() -> set[str] | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    text = (Path(list(spec.submodule_search_locations)[0])
            / "model_executor/layers/quantization/__init__.py").read_text(encoding="utf-8")
    literal = re.search(r"QuantizationMethods\s*=\s*Literal\[(.*?)\]", text, re.S)
    mapping = re.search(r"method_to_config[^=]*=\s*\{(.*?)\}", text, re.S)
    return {m for block in (literal, mapping) if block for m in re.findall(r'"([^"]+)"', block.group(1))}


def test_bitsandbytes_remedy_names_no_build_that_does_not_register_it(tmp_path):
    registered = _vllm_quant_registry()
    if registered is None:
        pytest.skip("vLLM is not installed here: its quantization registry decides this")
    if "bitsandbytes" in registered:
        pytest.skip("this vLLM registers bitsandbytes; the remedy may name a build again")
    assert "bitsandbytes" not in FORMATS_ELSEWHERE
    plan = make_plan(str(_checkpoint(tmp_path, "bitsandbytes")), session=SessionSpec(max_model_len=512),
                     devices=[_cpu_only(("dense", "gptq"))], host=HOST)
    [refusal] = plan.refusals
    assert refusal.code == "weight_format_unsupported"
    assert "edge-cuda" not in refusal.remedy
    assert "registers no bitsandbytes" in refusal.remedy


def test_mxfp4_has_somewhere_to_run():
    assert "mxfp4" in FORMATS_ELSEWHERE


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=10)


@settings(max_examples=300, deadline=None)
@given(quant=st.fixed_dictionaries({}, optional={
    "quant_method": st.sampled_from(["gptq", "awq", "fp8", "mxfp4", "bitsandbytes", "modelopt", "compressed-tensors",
                                     "hqq"]) | json_values,
    "bits": json_values, "sym": json_values, "desc_act": json_values, "group_size": json_values,
    "weight_block_size": json_values, "activation_scheme": json_values, "quant_algo": json_values,
    "config_groups": json_values, "zero_point": json_values, "load_in_4bit": json_values}) | json_values)
def test_scheme_reader_never_raises(quant):
    scheme = quantization_scheme_for(quant)
    assert scheme is None or set(SCHEME_KEYS) <= set(scheme)
    json.dumps(scheme)
