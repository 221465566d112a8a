"""edge-vitisai's graph stages on a machine with no NPU: the format gate, routes, and profiled placement.

The NPU is made "present" by the probe reading a fake ``/sys`` tree (amdxdna
bound, the VitisAI runtime in installed metadata). The stage then runs for real
through edge-core's ONNX Runtime stage runtime with the CPU execution provider
standing in as the executor, while the placement target stays
``VitisAIExecutionProvider`` — so the profile shows every node on the CPU and
the stage must be refused, never reported as running on the NPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_vitisai_probe import NOTHING, RYZEN_AI, VITISAI, make_root

import edge_vitisai
from edge_core.cli.run import describe_stage_record
from edge_core.host import HostFacts
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import make_plan
from edge_core.runtime.graph_run import run_graph_stage
from edge_core.services.registry import Registry
from edge_vitisai import _probe

REPO = Path(__file__).resolve().parents[3]
EXPORT_SCRIPT = REPO / "scripts" / "export_stage.py"
DEMO = REPO / "edge_core" / "demo" / "tiny-llama"
GIB = 1 << 30
CPU_EP = "CPUExecutionProvider"


def host() -> HostFacts:
    return HostFacts(system="linux", mem_total_bytes=32 * GIB, mem_available_bytes=28 * GIB, cgroup_limit_bytes=None,
                     cgroup_usage_bytes=None, logical_cores=8, physical_cores=8, cpu_model=RYZEN_AI, machine="x86_64")


@pytest.fixture(autouse=True)
def private_ledger(tmp_path, monkeypatch):
    """Plan and run against a host-wide ledger of the test's own, not this machine's live edge sessions."""
    monkeypatch.setenv("EDGE_LEDGER_DIR", str(tmp_path / "ledger"))


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    if not EXPORT_SCRIPT.is_file():
        pytest.skip(f"{EXPORT_SCRIPT} is not here (tests run outside the source tree)")
    spec = importlib.util.spec_from_file_location("export_stage", EXPORT_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.export_stage(DEMO, tmp_path_factory.mktemp("stage"))


@pytest.fixture
def registry():
    reg = Registry(entry_points=[], environ={})
    reg.register(edge_vitisai, "vitisai")
    try:
        yield reg
    finally:
        reg.unregister("vitisai")


def probed(tmp_path, **kwargs):
    (device,), _ = _probe.probe(**kwargs)
    return device.replace(plugin="vitisai")  # the registry stamps the owner on probed devices


def plan(path, device, registry):
    return make_plan(str(path), session=SessionSpec(), devices=[device], host=host(), registry=registry)


def test_fp32_stage_for_the_npu_is_refused_by_the_format_gate(graphs, registry, tmp_path):
    npu = probed(tmp_path, root=make_root(tmp_path, driver="amdxdna"), system="Linux", **VITISAI)
    result = plan(graphs["fp32"], npu, registry)
    assert not result.admitted
    [refusal] = result.refusals
    assert refusal.code == "weight_format_unsupported" and refusal.device_id == "npu:amd"
    assert "scripts/export_stage.py" in refusal.remedy and "a16w8" in refusal.remedy
    assert plan(graphs["fp16"], npu, registry).refusals[0].code == "weight_format_unsupported"


def test_a16w8_stage_passes_the_format_gate_and_is_declined_once_profiling_shows_the_cpu(graphs, registry, tmp_path):
    npu = probed(tmp_path, root=make_root(tmp_path, driver="amdxdna"), system="Linux", **VITISAI)
    result = plan(graphs["a16w8"], npu, registry)
    assert result.admitted, result.refusals
    assert result.stage["target_provider"] == "VitisAIExecutionProvider"
    assert result.stage["route"]["backend"] == "ort:vitisai" and result.stage["route"]["interpreter"] == "linux"
    record = run_graph_stage(result, registry, executor_providers=[CPU_EP])
    assert record["ran"] and not record["placed"] and not record["passed"]
    assert record["executor_providers"] == [CPU_EP] and "VitisAIExecutionProvider" in record["stand_in"]
    [refusal] = record["refusals"]
    assert refusal["code"] == "execution_provider_declined_graph" and refusal["device_id"] == "npu:amd"
    details = refusal["details"]
    assert details["node_share"] == 0.0 and details["time_share"] == 0.0
    assert set(details["kernels_by_provider"]) == {CPU_EP} and details["kernels_by_provider"][CPU_EP] > 0
    placement = record["placement"]
    assert placement["kernels"] == details["kernels_by_provider"][CPU_EP]
    assert {node["provider"] for node in placement["nodes"]} == {CPU_EP}
    # The outputs themselves are fine: only the profiled placement can tell (docs/igpu-npu-facts.md).
    assert record["numeric_gate"]["passed"]
    assert record["stopped"] is True
    text = describe_stage_record(record)
    assert text.startswith("REFUSED on npu:amd") and "[execution_provider_declined_graph]" in text
    assert f"0% of {placement['kernels']} nodes" in text and "not placed" in text


def test_the_real_route_on_a_runtime_without_vitisai_is_declined_too(graphs, registry, tmp_path):
    import onnxruntime

    if "VitisAIExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this ONNX Runtime offers VitisAI: the declined path needs a build without it")
    npu = probed(tmp_path, root=make_root(tmp_path, driver="amdxdna"), system="Linux", **VITISAI)
    record = run_graph_stage(plan(graphs["a16w8"], npu, registry), registry)
    [refusal] = record["refusals"]
    assert refusal["code"] == "execution_provider_declined_graph"
    assert refusal["details"]["missing_providers"] == ["VitisAIExecutionProvider"]
    assert refusal["details"]["node_share"] == 0.0


def test_npu_from_wsl_is_unreachable_and_the_refusal_names_the_windows_interpreter(graphs, registry, tmp_path):
    npu = probed(tmp_path, root=make_root(tmp_path, wsl=True, cpu=RYZEN_AI), system="Linux", **VITISAI)
    [windows, linux] = npu.extras["routes"]
    assert (windows["interpreter"], windows["where"], windows["available"]) == ("windows", "another_interpreter",
                                                                                False)
    assert linux["where"] == "elsewhere"
    result = plan(graphs["a16w8"], npu, registry)
    [refusal] = result.refusals
    assert refusal.code == "device_unreachable_from_this_process"
    assert "native Windows Python" in refusal.remedy and "Ryzen AI Software" in refusal.remedy


def test_routes_resolve_per_interpreter_kind(tmp_path):
    linux = probed(tmp_path, root=make_root(tmp_path, driver="amdxdna"), system="Linux", **VITISAI)
    statuses = {r["interpreter"]: r for r in linux.extras["routes"]}
    assert statuses["linux"]["available"] and statuses["linux"]["version"] == "1.22.0"
    assert statuses["linux"]["provider"] == "VitisAIExecutionProvider"
    missing = probed(tmp_path, root=make_root(tmp_path / "b", driver="amdxdna"), system="Linux", **NOTHING)
    here = {r["interpreter"]: r for r in missing.extras["routes"]}["linux"]
    assert not here["available"] and "Ryzen AI Software" in here["reason"]
    import types

    windows = probed(tmp_path, host=types.SimpleNamespace(cpu_model=RYZEN_AI), root=tmp_path, system="Windows",
                     **VITISAI)
    assert [r["where"] for r in windows.extras["routes"]] == ["here", "elsewhere"]
    assert windows.extras["routes"][0]["available"]


def test_stage_hooks_answer_only_for_their_own_stages(graphs, registry, tmp_path):
    class Foreign:
        backend = "ort:dml"
        target_provider = "DmlExecutionProvider"

    assert edge_vitisai.stream(stage=Foreign(), request=None) is None
    assert edge_vitisai.cancel(stage=Foreign(), request_id="r") is None
    assert edge_vitisai.stop_stage(stage=Foreign()) is None
    other = probed(tmp_path, root=make_root(tmp_path, driver="amdxdna"), system="Linux", **VITISAI).replace(
        device_id="npu:other")
    assert edge_vitisai.start_stage(device=other, plan=None) is None
    assert edge_vitisai.format_remedy(device=other, weight_format="onnx:fp32") is None
