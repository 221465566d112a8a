"""Exported-graph stages: planning, the host-wide ledger, measured placement and the numeric gate.

The stage path runs for real here on ONNX Runtime's CPU execution provider:
the graphs are exported from the demo checkpoint by ``scripts/export_stage.py``
and a throwaway test backend whose *target* provider is the CPU provider lets
placement genuinely succeed. Tests that need ``onnx`` or ``onnxruntime`` skip
themselves when the package is missing (the core test session has neither).
The NPU side (VitisAI target, CPU provider standing in as the executor) lives in
edge-vitisai's tests. Every test plans and runs against a host-wide ledger of
its own (``EDGE_LEDGER_DIR``), never this machine's live sessions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edge_core import hookimpl
from edge_core.cli.run import describe_stage_record
from edge_core.devices import Device
from edge_core.errors import UsageError
from edge_core.host import HostFacts
from edge_core.plan.committed import ledger_bytes
from edge_core.plan.graph_stage import NUMERIC_TOLERANCE, plan_graph_stage
from edge_core.plans import SessionSpec
from edge_core.routes import ROUTES_EXTRA, Route, resolve
from edge_core.runtime.admission import make_plan
from edge_core.runtime.graph_run import admit_stage, compare_outputs, run_graph_stage
from edge_core.services import host_ledger as hl
from edge_core.services.registry import Registry

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "edge_core" / "demo" / "tiny-llama"
GIB = 1 << 30
CPU_EP = "CPUExecutionProvider"
TEST_BACKEND = "ort:cpu-test"
GRAPH_FORMATS = ("onnx:fp32", "onnx:fp16", "onnx:a16w8")


def load_export_script():
    spec = importlib.util.spec_from_file_location("export_stage", REPO / "scripts" / "export_stage.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_host(available: int = 28 * GIB, total: int = 32 * GIB) -> HostFacts:
    return HostFacts(system="linux", mem_total_bytes=total, mem_available_bytes=available, cgroup_limit_bytes=None,
                     cgroup_usage_bytes=None, logical_cores=4, physical_cores=4, cpu_model="test cpu",
                     machine="x86_64")


def vllm_cpu_row(total: int = 32 * GIB) -> Device:
    return Device(device_id="cpu", kind="cpu", vendor="amd", name="test cpu", backend="vllm:cpu", runnable=True,
                  memory_pool="host_ram", memory_bytes=total, weight_formats=("dense",), evidence={"found": "D"})


def cpu_provider_device(total: int = 32 * GIB) -> Device:
    """The test backend's device: ONNX Runtime's CPU provider *is* its target, so placement can succeed here."""
    route = Route(backend=TEST_BACKEND, interpreter="linux", distribution="onnxruntime", formats=GRAPH_FORMATS,
                  install="pip install onnxruntime", provider=CPU_EP)
    statuses = resolve([route], "linux", check=lambda r: ("test", None)).to_list()
    return Device(device_id="cpu:ort-test", kind="cpu", vendor="test", name="ONNX Runtime CPU provider (test)",
                  backend=TEST_BACKEND, runnable=True, memory_pool="host_ram", memory_bytes=total,
                  weight_formats=GRAPH_FORMATS, evidence={"found": "D"}, extras={ROUTES_EXTRA: statuses},
                  plugin="ort-test")


class CpuProviderBackend:
    """A throwaway backend running graph stages through edge-core's shared ONNX Runtime stage runtime."""

    EDGE_API_VERSION = 1

    @staticmethod
    @hookimpl
    def probe_devices(host):
        return [cpu_provider_device()]

    @staticmethod
    @hookimpl
    def weight_formats(device):
        return list(GRAPH_FORMATS) if device.backend == TEST_BACKEND else None

    @staticmethod
    @hookimpl
    def start_stage(device, plan):
        from edge_core.runtime import ort_stage

        return ort_stage.start(device, plan, providers=(CPU_EP,), target_provider=CPU_EP)

    @staticmethod
    @hookimpl
    def stream(stage, request):
        from edge_core.runtime import ort_stage

        return ort_stage.stream(stage, request)

    @staticmethod
    @hookimpl
    def cancel(stage, request_id):
        from edge_core.runtime import ort_stage

        return ort_stage.cancel(stage, request_id)

    @staticmethod
    @hookimpl
    def stop_stage(stage):
        from edge_core.runtime import ort_stage

        return ort_stage.stop(stage)


@pytest.fixture(autouse=True)
def ledger(tmp_path, monkeypatch) -> Path:
    """The host-wide ledger every test here plans and runs against: a directory of its own, empty to begin with."""
    path = tmp_path / "ledger"
    monkeypatch.setenv("EDGE_LEDGER_DIR", str(path))
    return path


#: Another edge process on this host: admitted and registered as the CLI does, then alive until killed.
OTHER_SESSION = """
import sys, time
from edge_core.services.host_ledger import admission
reserved = int(sys.argv[1])
with admission() as taken:
    taken.register(command="edge serve", model="Qwen/Qwen2.5-7B", artifact_id=None, device_ids=("cpu",),
                   reserved_bytes={"host_ram": reserved}, predicted_peak_bytes=reserved, headroom_bytes=0)
print("registered", flush=True)
time.sleep(300)
"""


@pytest.fixture
def other_session():
    """A function starting another edge process that holds ``reserved`` bytes of host RAM; each is killed after."""
    procs = []

    def start(reserved: int) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", OTHER_SESSION, str(reserved)], stdout=subprocess.PIPE,
                                text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "registered", "the other session did not register"
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            proc.stdout.close()


def hold(reserved: int, *, measured: int = 0, command: str = "edge serve") -> hl.Registration:
    """A record of this process holding ``reserved`` bytes of host RAM (``measured`` of them loaded already)."""
    with hl.admission() as taken:
        held = taken.register(command=command, model="Qwen/Qwen2.5-7B", artifact_id=None, device_ids=("cpu",),
                              reserved_bytes={"host_ram": reserved}, predicted_peak_bytes=reserved,
                              headroom_bytes=0, session=False)
    if measured:
        held.update(measured_current_bytes=measured, measured_peak_bytes=measured)
    return held


@pytest.fixture
def registry():
    reg = Registry(entry_points=[], environ={})
    reg.register(CpuProviderBackend, "ort-test")
    try:
        yield reg
    finally:
        reg.unregister("ort-test")


@pytest.fixture(scope="module")
def fp32_graph(tmp_path_factory):
    pytest.importorskip("onnx")
    paths = load_export_script().export_stage(DEMO, tmp_path_factory.mktemp("fp32"), formats=())
    return paths["fp32"]


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    return load_export_script().export_stage(DEMO, tmp_path_factory.mktemp("stage"))


def plan(path, devices, registry=None, host=None, **stage_options):
    """Plan ``path`` as ``edge plan`` does (make_plan beside the host ledger); stage options go direct."""
    host, ledger = host or make_host(), hl.read_ledger()
    if not stage_options:
        return make_plan(str(path), session=SessionSpec(), devices=devices, host=host, registry=registry,
                         ledger=ledger)
    from edge_core.artifact import read_manifest
    from edge_core.artifact.graph_facts import read_graph_facts

    manifest = read_manifest(str(path))
    return plan_graph_stage(manifest, read_graph_facts(manifest), devices=devices, host=host, registry=registry,
                            ledger=ledger, **stage_options)


# ---------------------------------------------------------------- the export script

def test_export_writes_three_formats_that_the_manifest_reader_recognises(graphs):
    from edge_core.artifact import read_manifest

    formats = {fmt: read_manifest(str(path)).weight_format for fmt, path in graphs.items()}
    assert formats == {"fp32": "onnx:fp32", "fp16": "onnx:fp16", "a16w8": "onnx:a16w8"}
    a16w8 = read_manifest(str(graphs["a16w8"]))
    assert a16w8.onnx["activation_bits"] == [16] and a16w8.onnx["weight_bits"] == [8]
    # Quantized weights are about a quarter of the fp32 ones (int8 + scales).
    assert read_manifest(str(graphs["fp32"])).weight_bytes > 3.5 * a16w8.weight_bytes


def test_export_is_byte_identical_across_runs(graphs, tmp_path):
    again = load_export_script().export_stage(DEMO, tmp_path)
    for fmt, path in graphs.items():
        assert again[fmt].read_bytes() == path.read_bytes(), f"{fmt} graph changed between two exports"


def test_export_lm_head_stage(tmp_path):
    pytest.importorskip("onnx")
    from edge_core.artifact import read_manifest

    paths = load_export_script().export_stage(DEMO, tmp_path, stage="lm_head", formats=("fp16",))
    manifest = read_manifest(str(paths["fp16"]))
    assert manifest.weight_format == "onnx:fp16"
    assert manifest.weight_bytes > 512 * 128 * 2  # the vocab x hidden head in fp16


# ---------------------------------------------------------------- planning

def test_checkpoint_on_an_npu_is_refused_with_the_export_script_named():
    npu = Device(device_id="npu:amd", kind="npu", vendor="amd", name="AMD XDNA NPU", backend="ort:vitisai",
                 runnable=True, memory_pool="host_ram", memory_bytes=0, weight_formats=("onnx:a16w8",))
    result = make_plan(str(DEMO), session=SessionSpec(max_model_len=256), devices=[npu], host=make_host())
    [refusal] = [r for r in result.refusals if r.code == "no_exported_graph"]
    assert "scripts/export_stage.py" in refusal.remedy
    assert (REPO / "scripts" / "export_stage.py").is_file()


def test_graph_is_planned_only_on_devices_that_execute_graphs(fp32_graph):
    result = plan(fp32_graph, [vllm_cpu_row()])
    assert not result.admitted
    [refusal] = result.refusals
    assert refusal.code == "no_runnable_device"
    assert "edge-dml" in refusal.remedy and "edge-vitisai" in refusal.remedy
    assert "runs checkpoints, not exported graphs" in result.to_dict()["devices"][0]["why_not"]


def test_test_backend_admits_a_graph_with_route_target_and_host_pool_terms(fp32_graph, registry):
    result = plan(fp32_graph, [vllm_cpu_row(), cpu_provider_device()], registry)
    assert result.admitted, result.refusals
    assert result.selected_device.device_id == "cpu:ort-test"
    doc = result.to_dict()
    stage = doc["stage"]
    assert stage["target_provider"] == CPU_EP and stage["route"]["backend"] == TEST_BACKEND
    assert stage["placement_threshold"] == 0.5
    assert stage["numeric_tolerance"] == NUMERIC_TOLERANCE["onnx:fp32"]
    assert stage["sample_dims"] == {"batch": 1, "sequence": 8}
    purposes = {t["purpose"]: t for t in doc["reservations"]}
    assert purposes["weights"]["bytes"] == result.manifest.weight_bytes and purposes["weights"]["evidence"] == "D"
    assert {"ort_runtime", "activations", "external_reserve", "safety_margin"} <= set(purposes)
    assert all(t["pool"] == "host_ram" for t in doc["reservations"])
    json.dumps(doc)  # the whole plan is JSON


def test_format_gate_refuses_a_format_the_route_does_not_execute(fp32_graph, registry):
    igpu = Device(device_id="gpu_integrated:amd", kind="gpu_integrated", vendor="amd", name="Radeon 890M",
                  backend="torch:dml", runnable=True, memory_pool="host_ram", memory_bytes=0,
                  weight_formats=("pt:fp16", "pt:fp32"))
    result = plan(fp32_graph, [igpu], registry)
    [refusal] = result.refusals
    assert refusal.code == "weight_format_unsupported" and refusal.device_id == "gpu_integrated:amd"
    assert refusal.details["device_formats"] == ["pt:fp16", "pt:fp32"]


def test_unreachable_device_names_the_route_and_the_interpreter_that_would_drive_it(fp32_graph):
    route = Route(backend="ort:vitisai", interpreter="windows", distribution="onnxruntime-vitisai",
                  formats=("onnx:a16w8",), install="Ryzen AI Software", provider="VitisAIExecutionProvider")
    statuses = resolve([route], "wsl", check=lambda r: ("1", None)).to_list()
    npu = Device(device_id="npu:amd", kind="npu", vendor="amd", name="AMD XDNA NPU", backend="ort:vitisai",
                 runnable=False, reason="driven by the Windows driver; WSL has no amdxdna device",
                 memory_pool="host_ram", memory_bytes=0, weight_formats=("onnx:a16w8",),
                 extras={ROUTES_EXTRA: statuses})
    result = plan(fp32_graph, [npu])
    [refusal] = result.refusals
    assert refusal.code == "device_unreachable_from_this_process"
    assert "native Windows Python" in refusal.remedy and "Ryzen AI Software" in refusal.remedy
    assert refusal.details["routes"][0]["where"] == "another_interpreter"


def test_masked_graph_device_is_listed_not_planned(fp32_graph, registry):
    device = cpu_provider_device().replace(masked=True, runnable=False, reason="masked by policy (kind cpu)")
    result = plan(fp32_graph, [device], registry)
    assert not result.admitted
    assert result.verdicts[0].note.startswith("masked")


def test_placement_threshold_must_be_a_share(fp32_graph, registry):
    with pytest.raises(UsageError, match="placement threshold"):
        plan(fp32_graph, [cpu_provider_device()], registry, placement_threshold=1.5)


def test_planning_a_graph_imports_no_onnxruntime(fp32_graph):
    pytest.importorskip("onnx")
    script = (
        "import sys\n"
        "from edge_core.runtime.admission import make_plan\n"
        "from edge_core.plans import SessionSpec\n"
        "from edge_core.devices import Device\n"
        "d = Device(device_id='npu:amd', kind='npu', vendor='amd', name='n', backend='ort:vitisai', runnable=True,\n"
        "           memory_pool='host_ram', memory_bytes=0, weight_formats=('onnx:a16w8',))\n"
        f"p = make_plan({str(fp32_graph)!r}, session=SessionSpec(), devices=[d], host=None)\n"
        "print(p.refusals[0].code, [m for m in ('onnxruntime', 'torch', 'vllm') if m in sys.modules])\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split(maxsplit=1) == ["weight_format_unsupported", "[]\n"]


# ---------------------------------------------------------------- the host-wide ledger

def test_a_stage_that_fits_only_without_another_sessions_reservation_is_refused_naming_it(
        fp32_graph, registry, other_session):
    host = make_host(available=2 * GIB)
    alone = plan(fp32_graph, [cpu_provider_device()], registry, host=host)
    assert alone.admitted, alone.refusals
    assert alone.stage["host_pool"]["committed_bytes"] == 0 and alone.stage["host_pool"]["holders"] == []
    # Another process (any venv) was admitted to all but half of what the stage needs, and has loaded little yet.
    other = other_session(host.usable_bytes - alone.peak.admission_bytes // 2)
    refused = plan(fp32_graph, [cpu_provider_device()], registry, host=host)
    assert not refused.admitted
    [refusal] = refused.refusals
    assert refusal.code == "device_committed" and refusal.device_id == "cpu:ort-test"
    assert f"pid {other.pid}" in refusal.message and "Qwen/Qwen2.5-7B" in refusal.message
    assert f"edge stop {other.pid}" in refusal.remedy
    assert [h["pid"] for h in refusal.details["holders"]] == [other.pid]
    assert refused.verdicts[-1].gate == "capacity"
    # Once it has ended its record is stale: removed by the next read, and the stage fits again.
    other.kill()
    other.wait()
    again = plan(fp32_graph, [cpu_provider_device()], registry, host=host)
    assert again.admitted, again.refusals
    assert hl.read_ledger().records == ()


def test_a_stage_too_big_for_the_pool_still_names_who_holds_it(fp32_graph, registry):
    alone = plan(fp32_graph, [cpu_provider_device()], registry)
    held = hold(GIB, measured=GIB)  # loaded: the host already shows it as used, so nothing is "committed"
    try:
        refused = plan(fp32_graph, [cpu_provider_device()], registry,
                       host=make_host(available=alone.peak.admission_bytes - 1))
        [refusal] = refused.refusals
        assert refusal.code == "budget_exceeds_device"
        assert f"pid {os.getpid()}" in refusal.message and f"edge stop {os.getpid()}" in refusal.remedy
        assert refusal.details["holders"][0]["reserved_bytes"] == GIB
    finally:
        held.remove()


def test_a_stage_held_in_this_process_counts_against_the_next_stage_planned_here(fp32_graph, registry):
    alone = plan(fp32_graph, [cpu_provider_device()], registry)
    host = make_host(available=alone.peak.admission_bytes * 3 // 2)  # one stage fits, not two
    first = plan(fp32_graph, [cpu_provider_device()], registry, host=host)
    held = admit_stage(first)
    assert isinstance(held, hl.Registration), held
    try:
        second = plan(fp32_graph, [cpu_provider_device()], registry, host=host)
        [refusal] = second.refusals
        assert refusal.code == "device_committed"
        assert refusal.details["holders"][0]["session_id"] == held.record.session_id
        assert "graph stages this process is running" in refusal.remedy  # never "stop yourself"
    finally:
        held.remove()
    assert plan(fp32_graph, [cpu_provider_device()], registry, host=host).admitted


def test_a_running_stage_is_a_host_ledger_record_until_it_ends(graphs, registry, monkeypatch, ledger):
    stage_plan = plan(graphs["fp32"], [cpu_provider_device()], registry)
    seen = {}
    call_owner = registry.call_owner

    def spy(device, hook, **kwargs):
        if hook == "stream":  # the stage has started and is about to run
            seen["during"] = hl.read_ledger().records
        return call_owner(device, hook, **kwargs)

    monkeypatch.setattr(registry, "call_owner", spy)
    record = run_graph_stage(stage_plan, registry)
    assert record["ran"]
    [held] = seen["during"]
    assert (held.command, held.pid, held.state, held.device_ids) == ("graph stage", os.getpid(), "running",
                                                                     ("cpu:ort-test",))
    assert held.reserved_bytes == ledger_bytes(stage_plan) == record["ledger_record"]["reserved_bytes"]
    assert held.session_id == record["ledger_record"]["session_id"]
    assert hl.read_ledger().records == () and list(ledger.glob("*.json")) == []


def test_a_stage_edge_run_admitted_is_held_by_that_sessions_record_not_a_second_one(graphs, registry, monkeypatch):
    stage_plan = plan(graphs["fp32"], [cpu_provider_device()], registry)
    # What `edge run --model GRAPH.onnx` does before it starts the stage: admit the plan as this process's session.
    with hl.admission() as taken:
        session = taken.register(command="edge run", model=stage_plan.model_path,
                                 artifact_id=stage_plan.manifest.artifact_id, device_ids=("cpu:ort-test",),
                                 reserved_bytes=ledger_bytes(stage_plan),
                                 predicted_peak_bytes=stage_plan.peak.predicted_bytes,
                                 headroom_bytes=stage_plan.peak.headroom_bytes)
    seen = {}
    call_owner = registry.call_owner

    def spy(device, hook, **kwargs):
        if hook == "stream":
            seen["during"] = hl.read_ledger().records
        return call_owner(device, hook, **kwargs)

    monkeypatch.setattr(registry, "call_owner", spy)
    try:
        record = run_graph_stage(stage_plan, registry)
        assert record["ran"] and record["ledger_record"]["session_id"] == session.record.session_id
        [held] = seen["during"]
        assert held.session_id == session.record.session_id and held.state == "running"
        assert [r.session_id for r in hl.read_ledger().records] == [session.record.session_id]  # the session's
    finally:
        session.remove()
    assert hl.current() is None


def test_run_refuses_when_another_session_was_admitted_after_planning(graphs, registry):
    host = make_host(available=2 * GIB)
    stage_plan = plan(graphs["fp32"], [cpu_provider_device()], registry, host=host)
    assert stage_plan.admitted
    late = hold(2 * GIB - stage_plan.peak.admission_bytes + 1, command="edge run")
    try:
        record = run_graph_stage(stage_plan, registry)
        assert not record["ran"] and record["refusals"][0]["code"] == "device_committed"
        assert [r.session_id for r in hl.read_ledger().records] == [late.record.session_id]  # no stage record left
    finally:
        late.remove()


# ---------------------------------------------------------------- placement and the numeric gate

def test_cpu_provider_backend_passes_placement_and_the_numeric_gate(graphs, registry):
    stage_plan = plan(graphs["a16w8"], [cpu_provider_device()], registry)
    assert stage_plan.admitted
    record = run_graph_stage(stage_plan, registry)
    assert record["ran"] and record["finish_reason"] == "stop"
    assert record["placed"] and record["passed"] and record["refusals"] == []
    placement = record["placement"]
    assert placement["node_share"] == 1.0 and placement["time_share"] == 1.0
    assert placement["kernels_by_provider"] == {CPU_EP: placement["kernels"]} and placement["kernels"] > 0
    assert {n["provider"] for n in placement["nodes"]} == {CPU_EP}
    gate = record["numeric_gate"]
    assert gate["passed"] and gate["reference"]["graph"].endswith("mlp0.fp32.onnx")
    # A16W8 against fp32 really differs, and by less than the A16W8 tolerance.
    assert 0 < gate["max_rel_error"] < NUMERIC_TOLERANCE["onnx:a16w8"]
    assert gate["max_abs_error"] > 0
    assert record["stage"]["session_providers"] == [CPU_EP]
    assert record["stopped"] is True
    assert record["memory"]["predicted_peak_bytes"] > 0
    json.dumps(record)
    text = describe_stage_record(record)
    assert text.startswith("PASSED on cpu:ort-test") and "100% of" in text and "-> placed" in text


def test_fp16_stage_is_checked_against_the_fp32_reference(graphs, registry):
    record = run_graph_stage(plan(graphs["fp16"], [cpu_provider_device()], registry), registry)
    assert record["passed"], record["refusals"]
    assert record["outputs"]["mlp_out"]["dtype"] == "float16"
    assert 0 < record["numeric_gate"]["max_rel_error"] < NUMERIC_TOLERANCE["onnx:fp16"]


def test_numeric_gate_fails_a_graph_calibrated_on_the_wrong_range(registry, tmp_path):
    pytest.importorskip("onnxruntime")
    # Calibrated on hidden states 100x narrower than the stage sees: 16-bit activations clip.
    paths = load_export_script().export_stage(DEMO, tmp_path, formats=("a16w8",), calibration_scale=0.01)
    stage_plan = plan(paths["a16w8"], [cpu_provider_device()], registry)
    assert stage_plan.admitted  # nothing in the graph's format says it is badly calibrated
    record = run_graph_stage(stage_plan, registry)
    assert record["placed"] and not record["passed"]
    [refusal] = record["refusals"]
    assert refusal["code"] == "numeric_gate_failed"
    assert refusal["details"]["scope"] == "artifact"
    assert refusal["details"]["artifact_id"] == stage_plan.manifest.artifact_id
    assert refusal["details"]["max_rel_error"] > NUMERIC_TOLERANCE["onnx:a16w8"]
    assert "not the device" in refusal["remedy"]


def test_a_stricter_per_stage_tolerance_fails_the_same_outputs(graphs, registry):
    stage_plan = plan(graphs["a16w8"], [cpu_provider_device()], registry, numeric_tolerance=1e-9)
    record = run_graph_stage(stage_plan, registry)
    assert [r["code"] for r in record["refusals"]] == ["numeric_gate_failed"]
    assert record["numeric_gate"]["tolerance"] == 1e-9


def test_compare_outputs_measures_the_error_against_the_reference_peak():
    np = pytest.importorskip("numpy")
    reference = {"y": np.array([[1.0, -4.0], [2.0, 0.5]])}
    gate = compare_outputs({"y": reference["y"] + np.array([[0.0, 0.1], [0.0, 0.0]])}, reference,
                           weight_format="onnx:fp16", tolerance=0.03)
    assert gate.max_abs_error == pytest.approx(0.1) and gate.max_rel_error == pytest.approx(0.025)
    assert gate.passed
    assert not compare_outputs({"y": reference["y"] * 1.1}, reference, weight_format="x", tolerance=0.03).passed
    missing = compare_outputs({}, reference, weight_format="x", tolerance=1.0)
    assert not missing.passed and "no 'y'" in missing.problem
    nan = compare_outputs({"y": np.full((2, 2), np.nan)}, reference, weight_format="x", tolerance=1.0)
    assert not nan.passed and "NaN" in nan.problem


def test_profile_kernels_are_counted_by_node_and_by_time():
    from edge_core.runtime.ort_stage import placement_from_profile

    def kernel(name, provider, dur):
        return {"cat": "Node", "name": f"{name}_kernel_time", "dur": dur,
                "args": {"provider": provider, "op_name": "MatMul"}}

    profile = [
        {"cat": "Session", "name": "model_run", "dur": 999},
        {"cat": "Node", "name": "a_fence_before", "dur": 1, "args": {"provider": "X"}},
        kernel("a", "VitisAIExecutionProvider", 90), kernel("b", CPU_EP, 5), kernel("c", CPU_EP, 5),
    ]
    placement = placement_from_profile(profile, "VitisAIExecutionProvider", 0.5)
    assert placement.kernels_by_provider == {CPU_EP: 2, "VitisAIExecutionProvider": 1}
    assert placement.node_share == pytest.approx(1 / 3) and placement.time_share == pytest.approx(0.9)
    assert not placement.placed  # most of the time, but not most of the nodes
    assert placement_from_profile(profile, "VitisAIExecutionProvider", 0.3).placed
    assert not placement_from_profile([], CPU_EP).placed


def test_bad_inputs_are_a_usage_error_naming_what_the_graph_takes(graphs, registry):
    np = pytest.importorskip("numpy")
    stage_plan = plan(graphs["fp32"], [cpu_provider_device()], registry)
    with pytest.raises(UsageError, match=r"missing hidden_states.*hidden_states: float32\['batch', 'sequence', 128\]"):
        run_graph_stage(stage_plan, registry, inputs={"x": np.zeros((1, 8, 128), np.float32)})
    with pytest.raises(UsageError, match="has shape"):
        run_graph_stage(stage_plan, registry, inputs={"hidden_states": np.zeros((1, 8, 64), np.float32)})
    assert hl.read_ledger().records == ()  # the stage's record went with the error


def test_a_graph_onnx_runtime_cannot_load_is_a_refusal_not_a_traceback(graphs, registry, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], name="mystery", domain="edge.test")],
                              "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("edge.test", 1)])
    model.ir_version = 10
    path = tmp_path / "mystery.onnx"
    onnx.save(model, str(path))
    record = run_graph_stage(plan(path, [cpu_provider_device()], registry), registry)
    assert not record["ran"]
    assert record["refusals"][0]["code"] == "artifact_invalid" and "NoSuchOp" in record["refusals"][0]["message"]


# ---------------------------------------------------------------- the stage hooks

def test_stage_hooks_stream_one_tensor_event_and_cancel_cleanly(graphs, registry):
    from edge_core.runtime.stream_run import StreamRun
    from edge_core.stream import StageRequest, StateHandle

    stage_plan = plan(graphs["fp32"], [cpu_provider_device()], registry)
    device = stage_plan.selected_device
    stage = registry.call_owner(device, "start_stage", plan=stage_plan)
    try:
        assert stage.executed_on == device.device_id
        assert isinstance(stage.state, StateHandle) and stage.state.artifact_id == stage_plan.manifest.artifact_id
        # Cancelled before it runs: the request ends with one "abort" event and nothing runs.
        from edge_core.runtime.ort_stage import sample_inputs

        inputs = sample_inputs(stage.inputs, seed=3)
        request = StageRequest(inputs=inputs, epoch=2)
        events = registry.call_owner(device, "stream", stage=stage, request=request)
        assert registry.call_owner(device, "cancel", stage=stage, request_id=request.request_id) is True
        assert registry.call_owner(device, "cancel", stage=stage, request_id=request.request_id) is False
        [event] = list(events)
        assert (event.finish_reason, event.epoch, event.seq, event.tensors) == ("abort", 2, 0, None)
        assert stage.runs == 0 and stage.placement is None
        assert registry.call_owner(device, "cancel", stage=stage, request_id="req-never") is False
        # A request through the core's bounded stream: one final event carrying the output tensor.
        request = StageRequest(inputs=inputs)
        run = StreamRun(registry.call_owner(device, "stream", stage=stage, request=request),
                        lambda: registry.call_owner(device, "cancel", stage=stage, request_id=request.request_id),
                        request_id=request.request_id)
        [event] = run.collect(idle_timeout_s=60)
        assert event.finish_reason == "stop" and set(event.tensors) == {"mlp_out"}
        assert event.tensors["mlp_out"].shape == (1, 8, 128)
        assert stage.placement is not None and stage.placement.placed and stage.in_flight_count == 0
        assert registry.call_owner(device, "cancel", stage=stage, request_id=request.request_id) is False
    finally:
        profile_dir = stage._profile_dir
        assert registry.call_owner(device, "stop_stage", stage=stage) is True
    assert profile_dir is None or not Path(profile_dir).exists()
    with pytest.raises(Exception, match="stopped"):
        registry.call_owner(device, "stream", stage=stage, request=StageRequest(inputs=inputs))


# ---------------------------------------------------------------- the CLI

def test_edge_plan_graph_has_the_same_output_json_and_exit_codes(graphs, tmp_path):
    device_list = tmp_path / "devices.json"
    host = make_host()
    npu = Device(device_id="npu:amd", kind="npu", vendor="amd", name="AMD XDNA NPU", backend="ort:vitisai",
                 runnable=True, memory_pool="host_ram", memory_bytes=0, weight_formats=("onnx:a16w8",),
                 plugin="vitisai", evidence={"found": "D"})
    device_list.write_text(json.dumps({"host": host.to_dict(),
                                       "devices": [vllm_cpu_row().to_dict(), npu.to_dict()]}))

    def edge(*args):
        return subprocess.run([sys.executable, "-m", "edge_core", "plan", "--devices", str(device_list), *args],
                              capture_output=True, text=True, timeout=120)

    admitted = edge("--model", str(graphs["a16w8"]), "--json")
    assert admitted.returncode == 0, admitted.stderr
    doc = json.loads(admitted.stdout)
    assert doc["admitted"] and doc["selected_device"] == "npu:amd" and doc["stage"]["kind"] == "graph_stage"
    refused = edge("--model", str(graphs["fp32"]))
    assert refused.returncode == 2, refused.stderr
    assert "[weight_format_unsupported] npu:amd" in refused.stdout and "Traceback" not in refused.stderr
    text = edge("--model", str(graphs["a16w8"]))
    assert text.returncode == 0 and "ADMITTED on npu:amd" in text.stdout and "stage " in text.stdout
    ambiguous = edge("--model", str(graphs["a16w8"].parent))  # a directory holding three graphs
    assert ambiguous.returncode == 2 and "pass the one .onnx file" in ambiguous.stdout
