"""edge-vitisai against fake roots, fake distribution metadata and a fake onnxruntime module.

The fake ``/sys`` tree links ``accelN/device/driver`` to a driver directory the
way the kernel does, so the probe resolves a real symlink.
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pluggy
import pytest

import edge_core.hookspecs
import edge_vitisai
from edge_core.devices import Device
from edge_vitisai import _probe

RYZEN_AI = "AMD Ryzen AI 9 HX 370 w/ Radeon 890M"
OTHER_CPU = "Intel(R) Core(TM) i7-8650U CPU @ 1.90GHz"


def make_root(tmp_path: Path, driver=None, dev_node=True, wsl=False, cpu=OTHER_CPU) -> Path:
    root = tmp_path / "root"
    (root / "proc/sys/kernel").mkdir(parents=True)
    release = "6.6.87.2-microsoft-standard-WSL2" if wsl else "6.14.0-generic"
    (root / "proc/sys/kernel/osrelease").write_text(release + "\n")
    (root / "proc/cpuinfo").write_text(f"processor\t: 0\nmodel name\t: {cpu}\n")
    if wsl:
        (root / "dev").mkdir()
        (root / "dev/dxg").write_text("")
    if driver:
        drivers = root / "sys/bus/pci/drivers" / driver
        drivers.mkdir(parents=True)
        device = root / "sys/devices/pci0000:00/0000:00:08.2/0000:c5:00.1"
        device.mkdir(parents=True)
        (device / "driver").symlink_to(os.path.relpath(drivers, device))
        (device / "device").write_text("0x17f0\n")
        accel = root / "sys/class/accel/accel0"
        accel.mkdir(parents=True)
        (accel / "device").symlink_to(os.path.relpath(device, accel))
        if dev_node:
            (root / "dev/accel").mkdir(parents=True)
            (root / "dev/accel/accel0").write_text("")
    return root


def metadata(versions=None, files=None):
    """version_of / files_of lookups over a fixed set of installed distributions."""
    versions = versions or {}
    files = files or {}
    return {"version_of": versions.get, "files_of": lambda name: files.get(name, [])}


VITISAI = metadata({"onnxruntime-vitisai": "1.22.0"})
NOTHING = metadata()


def test_linux_amdxdna_with_the_runtime_is_runnable(tmp_path):
    (device,), note = _probe.probe(root=make_root(tmp_path, driver="amdxdna"), system="Linux", **VITISAI)
    assert note is None
    assert device.device_id == "npu:amd" and device.kind == "npu" and device.vendor == "amd"
    assert device.memory_pool == "host_ram" and device.memory_bytes == 0
    assert device.weight_formats == ("onnx:a16w8",) and device.backend == "ort:vitisai"
    assert device.runnable and device.reason is None
    assert device.extras["accel"] == "accel0" and device.extras["pci_device"] == "0x17f0"
    assert device.evidence["found"] == "D"


def test_linux_amdxdna_without_the_runtime_says_what_to_install(tmp_path):
    (device,), _ = _probe.probe(root=make_root(tmp_path, driver="amdxdna"), system="Linux", **NOTHING)
    assert not device.runnable
    assert "Ryzen AI Software" in device.reason and "VitisAI" in device.reason


def test_plain_onnxruntime_counts_only_with_the_vitisai_provider_library(tmp_path):
    root = make_root(tmp_path, driver="amdxdna")
    ryzen_build = metadata(
        {"onnxruntime": "1.20.1"},
        {"onnxruntime": ["onnxruntime/capi/libonnxruntime_providers_vitisai.so",
                         "onnxruntime/capi/onnxruntime_pybind11_state.so"]},
    )
    (device,), _ = _probe.probe(root=root, system="Linux", **ryzen_build)
    assert device.runnable and device.extras["runtime"] == "onnxruntime 1.20.1"
    stock = metadata({"onnxruntime": "1.31.1"}, {"onnxruntime": ["onnxruntime/capi/onnxruntime_pybind11_state.so"]})
    (device,), _ = _probe.probe(root=root, system="Linux", **stock)
    assert not device.runnable


def test_accel_device_of_another_driver_is_not_an_xdna_npu(tmp_path):
    devices, note = _probe.probe(root=make_root(tmp_path, driver="intel_vpu"), system="Linux", **VITISAI)
    assert devices == [] and "amdxdna" in note


def test_missing_device_node_is_not_runnable(tmp_path):
    root = make_root(tmp_path, driver="amdxdna", dev_node=False)
    (device,), _ = _probe.probe(root=root, system="Linux", **VITISAI)
    assert not device.runnable and "/dev/accel/accel0 is missing" in device.reason


def test_unopenable_device_node_names_the_group(tmp_path, monkeypatch):
    # Tests run as root in CI, where access() always succeeds: replace the OS call instead.
    monkeypatch.setattr(_probe.os, "access", lambda path, mode: False)
    (device,), _ = _probe.probe(root=make_root(tmp_path, driver="amdxdna"), system="Linux", **VITISAI)
    assert not device.runnable and "render" in device.reason


def test_wsl_with_a_ryzen_ai_cpu_lists_the_npu_as_unreachable(tmp_path):
    root = make_root(tmp_path, wsl=True, cpu=RYZEN_AI)
    (device,), _ = _probe.probe(root=root, system="Linux", **VITISAI)  # cpu model read from /proc/cpuinfo
    assert not device.runnable
    assert device.reason.startswith("device_unreachable_from_this_process:")
    assert "Windows Python" in device.reason
    assert device.evidence["found"] == "E"
    host = types.SimpleNamespace(cpu_model=RYZEN_AI)
    (device,), _ = _probe.probe(host, root=make_root(tmp_path / "b", wsl=True), system="Linux", **NOTHING)
    assert device.device_id == "npu:amd"


def test_wsl_without_evidence_of_an_npu_lists_nothing(tmp_path):
    devices, note = _probe.probe(root=make_root(tmp_path, wsl=True), system="Linux", **VITISAI)
    assert devices == [] and note


def test_plain_linux_without_amdxdna_lists_nothing_and_hints_at_the_driver(tmp_path):
    devices, note = _probe.probe(root=make_root(tmp_path), system="Linux", **VITISAI)
    assert devices == [] and "amdxdna" in note and "6.14" not in note
    devices, note = _probe.probe(root=make_root(tmp_path / "b", cpu=RYZEN_AI), system="Linux", **VITISAI)
    assert devices == [] and "load the amdxdna driver" in note


def test_windows_runnable_follows_the_runtime(tmp_path):
    host = types.SimpleNamespace(cpu_model=RYZEN_AI)
    (device,), _ = _probe.probe(host, root=tmp_path, system="Windows", **VITISAI)
    assert device.runnable and device.extras["runtime"] == "onnxruntime-vitisai 1.22.0"
    (device,), _ = _probe.probe(host, root=tmp_path, system="Windows", **NOTHING)
    assert not device.runnable and "Ryzen AI Software" in device.reason
    devices, note = _probe.probe(types.SimpleNamespace(cpu_model=OTHER_CPU), root=tmp_path,
                                 system="Windows", **NOTHING)
    assert devices == [] and note


def test_probe_never_imports_onnxruntime(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # any import would raise ImportError
    host = types.SimpleNamespace(cpu_model=RYZEN_AI)
    (device,), _ = _probe.probe(host, root=make_root(tmp_path, driver="amdxdna"), system="Linux", **VITISAI)
    assert device.runnable


def fake_ort(providers):
    ort = types.ModuleType("onnxruntime")
    ort.__version__ = "1.22.0"
    ort.get_available_providers = lambda: list(providers)
    return ort


@pytest.fixture
def npu(tmp_path):
    (device,), _ = _probe.probe(root=make_root(tmp_path, driver="amdxdna"), system="Linux", **VITISAI)
    return device


def test_verify_confirms_the_provider_through_the_hook(npu, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", fake_ort(["VitisAIExecutionProvider", "CPUExecutionProvider"]))
    verified = edge_vitisai.verify_device(device=npu)
    assert verified.runnable and verified.evidence["runnable"] == "B"
    assert "VitisAIExecutionProvider" in verified.extras["providers"]


def test_verify_refuses_a_runtime_without_the_provider(npu, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", fake_ort(["CPUExecutionProvider"]))
    verified = edge_vitisai.verify_device(device=npu)
    assert not verified.runnable and "CPUExecutionProvider" in verified.reason


def test_verify_when_onnxruntime_cannot_be_imported(npu, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    verified = edge_vitisai.verify_device(device=npu)
    assert not verified.runnable and "cannot be imported" in verified.reason


def test_hooks_answer_only_for_the_npu(npu):
    other = Device(device_id="cpu", kind="cpu", vendor="amd", name="cpu", backend="vllm:cpu",
                   runnable=True, memory_pool="host_ram", memory_bytes=1)
    assert edge_vitisai.weight_formats(device=npu) == ["onnx:a16w8"]
    assert edge_vitisai.weight_formats(device=other) is None
    assert edge_vitisai.verify_device(device=other) is None


def test_hook_probes_this_machine_without_raising():
    pm = pluggy.PluginManager(edge_core.hookspecs.PROJECT)
    pm.add_hookspecs(edge_core.hookspecs)
    pm.register(edge_vitisai, name="undo-vitisai")
    try:
        pm.check_pending()
        (devices,) = pm.hook.probe_devices(host=None)
    finally:
        pm.unregister(name="undo-vitisai")
    assert all(isinstance(d, Device) for d in devices)
    assert devices or edge_vitisai.last_probe_note
    assert edge_vitisai.EDGE_API_VERSION == edge_core.hookspecs.API_VERSION


def test_entry_point_is_registered_when_installed():
    from importlib import metadata as md

    try:
        md.distribution("edge-vitisai")
    except md.PackageNotFoundError:
        pytest.skip("edge-vitisai is not installed in this interpreter (running from the tree)")
    points = {ep.name: ep.value for ep in md.entry_points(group="edge.backends")}
    assert points.get("vitisai") == "edge_vitisai"
