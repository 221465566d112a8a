"""edge-dml's routes and graph stages without DirectML: fake roots, a fake registry, fake provider lists.

Which DirectML route resolves decides the formats; the two routes resolve
through edge-core's shared mechanism, and a route living in another
interpreter (the Windows Python, seen from WSL) says so. A stage planned for a
Windows iGPU runs for real on ONNX Runtime's CPU provider standing in as the
executor while the placement target stays ``DmlExecutionProvider``.
"""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path

import pytest
from test_dml_probe import AMD, RYZEN_AI_WINDOWS, fake_winreg, make_root

import edge_dml
from edge_core.errors import PluginError
from edge_core.host import HostFacts
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import make_plan
from edge_core.runtime.graph_run import run_graph_stage
from edge_core.services.registry import Registry
from edge_dml import _probe

REPO = Path(__file__).resolve().parents[3]
EXPORT_SCRIPT = REPO / "scripts" / "export_stage.py"
DEMO = REPO / "edge_core" / "demo" / "tiny-llama"
GIB = 1 << 30
CPU_EP = "CPUExecutionProvider"


@pytest.fixture(autouse=True)
def private_ledger(tmp_path, monkeypatch):
    """Plan and run against a host-wide ledger of the test's own, not this machine's live edge sessions."""
    monkeypatch.setenv("EDGE_LEDGER_DIR", str(tmp_path / "ledger"))


@pytest.fixture
def installed(monkeypatch):
    import edge_core.builds

    versions: dict[str, str] = {}
    monkeypatch.setattr(edge_core.builds, "installed_version", versions.get)
    return versions


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    if not EXPORT_SCRIPT.is_file():
        pytest.skip(f"{EXPORT_SCRIPT} is not here (tests run outside the source tree)")
    spec = importlib.util.spec_from_file_location("export_stage", EXPORT_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.export_stage(DEMO, tmp_path_factory.mktemp("stage"), formats=("fp16",))


@pytest.fixture
def registry():
    reg = Registry(entry_points=[], environ={})
    reg.register(edge_dml, "dml")
    try:
        yield reg
    finally:
        reg.unregister("dml")


def host() -> HostFacts:
    return HostFacts(system="windows", mem_total_bytes=32 * GIB, mem_available_bytes=28 * GIB,
                     cgroup_limit_bytes=None, cgroup_usage_bytes=None, logical_cores=8, physical_cores=8,
                     cpu_model="AMD Ryzen AI 9 HX 370", machine="AMD64")


def probed(**kwargs):
    (device,), _ = _probe.probe(**kwargs)
    return device.replace(plugin="dml")


def plan(path, device, registry):
    return make_plan(str(path), session=SessionSpec(), devices=[device], host=host(), registry=registry)


def test_wsl_lists_the_windows_route_as_another_interpreter(tmp_path, installed):
    installed["torch-directml"] = "0.2.5"
    device = probed(root=make_root(tmp_path, wsl=True, dxg=True), system="Linux")
    ort_route, torch_route = device.extras["routes"]
    assert (ort_route["backend"], ort_route["where"], ort_route["available"]) == ("ort:dml", "another_interpreter",
                                                                                   False)
    assert "native Windows Python" in ort_route["reason"] and ort_route["provider"] == "DmlExecutionProvider"
    assert (torch_route["backend"], torch_route["where"], torch_route["available"]) == ("torch:dml", "here", True)
    assert torch_route["rank"] == 1 and "1.23 vs 1.54" in torch_route["preference_note"]


def test_wsl_without_any_route_names_both_ways_to_get_one(tmp_path, installed):
    device = probed(root=make_root(tmp_path, wsl=True, dxg=True), system="Linux")
    assert not device.runnable
    assert "native Windows Python" in device.reason and "edge-dml[wsl]" in device.reason


def test_onnx_graph_on_the_wsl_torch_route_is_refused_naming_the_windows_route(graphs, registry, tmp_path,
                                                                               installed):
    installed["torch-directml"] = "0.2.5"
    device = probed(root=make_root(tmp_path, wsl=True, dxg=True), system="Linux")
    result = plan(graphs["fp16"], device, registry)
    [refusal] = result.refusals
    assert refusal.code == "weight_format_unsupported"
    assert "torch exports" in refusal.remedy and "Windows Python" in refusal.remedy


def test_native_linux_igpu_is_unreachable_from_this_process(graphs, registry, tmp_path, installed):
    device = probed(root=make_root(tmp_path, cards=[AMD]), system="Linux")
    [refusal] = plan(graphs["fp16"], device, registry).refusals
    assert refusal.code == "device_unreachable_from_this_process"
    assert "Windows or WSL" in refusal.message


def test_windows_igpu_admits_an_fp16_stage_and_is_declined_when_the_cpu_runs_it(graphs, registry, installed):
    installed["onnxruntime-directml"] = "1.24.4"
    device = probed(system="Windows", winreg=fake_winreg(RYZEN_AI_WINDOWS))
    assert [r["where"] for r in device.extras["routes"]] == ["here", "elsewhere"]
    result = plan(graphs["fp16"], device, registry)
    assert result.admitted, result.refusals
    assert result.stage["target_provider"] == "DmlExecutionProvider"
    record = run_graph_stage(result, registry, executor_providers=[CPU_EP])
    assert record["ran"] and not record["placed"]
    [refusal] = record["refusals"]
    assert refusal["code"] == "execution_provider_declined_graph"
    assert refusal["details"]["node_share"] == 0.0 and CPU_EP in refusal["details"]["kernels_by_provider"]
    assert record["numeric_gate"]["passed"]  # fp16 outputs match the fp32 reference: only placement tells


def test_torch_route_does_not_start_onnx_stages(graphs, registry, tmp_path, installed):
    installed["torch-directml"] = "0.2.5"
    device = probed(root=make_root(tmp_path, wsl=True, dxg=True), system="Linux")
    with pytest.raises(PluginError, match="torch exports"):
        registry.call_owner(device, "start_stage", plan=types.SimpleNamespace(manifest=None))


def fake_ort(providers):
    ort = types.ModuleType("onnxruntime")
    ort.__version__ = "1.24.4"
    ort.get_available_providers = lambda: list(providers)
    return ort


def test_verify_reads_the_windows_provider_list(installed):
    installed["onnxruntime-directml"] = "1.24.4"
    device = probed(system="Windows", winreg=fake_winreg(RYZEN_AI_WINDOWS))
    verified = _probe.verify(device, ort=fake_ort(["DmlExecutionProvider", CPU_EP]))
    assert verified.runnable and verified.evidence["runnable"] == "B"
    assert verified.extras["providers"] == ["DmlExecutionProvider", CPU_EP]
    overwritten = _probe.verify(device, ort=fake_ort(["AzureExecutionProvider", CPU_EP]))
    assert not overwritten.runnable and "offers no DmlExecutionProvider" in overwritten.reason
    assert "AzureExecutionProvider" in overwritten.reason


def test_verify_counts_torch_directml_devices_under_wsl(tmp_path, installed):
    installed["torch-directml"] = "0.2.5"
    device = probed(root=make_root(tmp_path, wsl=True, dxg=True), system="Linux")
    one = _probe.verify(device, torch_directml=types.SimpleNamespace(device_count=lambda: 1))
    assert one.runnable and one.extras["dml_device_count"] == 1 and one.evidence["runnable"] == "B"
    none = _probe.verify(device, torch_directml=types.SimpleNamespace(device_count=lambda: 0))
    assert not none.runnable and "no DirectML device" in none.reason


def test_hooks_answer_only_for_their_own_devices_and_stages(tmp_path, installed):
    from edge_core.devices import Device

    foreign = Device(device_id="gpu_integrated:other", kind="gpu_integrated", vendor="x", name="x",
                     backend="foreign:runtime", runnable=True, memory_pool="host_ram", memory_bytes=0)
    for hook in (edge_dml.weight_formats, edge_dml.verify_device):
        assert hook(device=foreign) is None
    assert edge_dml.format_remedy(device=foreign, weight_format="onnx:a16w8") is None
    assert edge_dml.start_stage(device=foreign, plan=None) is None
    stage = types.SimpleNamespace(backend="ort:vitisai", target_provider="VitisAIExecutionProvider")
    assert edge_dml.stream(stage=stage, request=None) is None
    assert edge_dml.cancel(stage=stage, request_id="r") is None
    assert edge_dml.stop_stage(stage=stage) is None
