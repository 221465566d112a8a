"""edge-dml against fake roots, a fake ``winreg`` and fake distribution metadata.

The probe's own code reads the fake ``/sys``, ``/dev`` and ``/proc`` files and
walks the fake registry exactly as it would the real ones.
"""

from __future__ import annotations

import types
from pathlib import Path

import pluggy
import pytest

import edge_core.builds
import edge_core.hookspecs
import edge_dml
from edge_core.devices import Device
from edge_dml import _probe, _routes

AMD, INTEL, NVIDIA = "0x1002", "0x8086", "0x10de"


def make_root(tmp_path: Path, cards=(), wsl=False, dxg=False) -> Path:
    root = tmp_path / "root"
    (root / "proc/sys/kernel").mkdir(parents=True)
    release = "6.6.87.2-microsoft-standard-WSL2" if wsl else "6.14.0-generic"
    (root / "proc/sys/kernel/osrelease").write_text(release + "\n")
    drm = root / "sys/class/drm"
    drm.mkdir(parents=True)
    for index, vendor in enumerate(cards):
        device = drm / f"card{index}" / "device"
        device.mkdir(parents=True)
        (device / "vendor").write_text(vendor + "\n")
        # Connector entries sit beside the cards and are not adapters.
        (drm / f"card{index}-eDP-1").mkdir()
    if dxg:
        (root / "dev").mkdir()
        (root / "dev/dxg").write_text("")
    return root


@pytest.fixture
def installed(monkeypatch):
    """Distributions edge_core.builds reports as installed (name -> version)."""
    versions: dict[str, str] = {}
    monkeypatch.setattr(edge_core.builds, "installed_version", versions.get)
    return versions


class FakeKey:
    def __init__(self, tree, path):
        self.tree, self.path = tree, path

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fake_winreg(adapters: dict[str, dict[str, str]]):
    """A module shaped like winreg, holding the display class with these subkeys."""
    reg = types.ModuleType("winreg")
    reg.HKEY_LOCAL_MACHINE = "HKLM"
    tree = {_probe.DISPLAY_CLASS_KEY: adapters}

    def open_key(parent, sub):
        if parent == "HKLM":
            if sub not in tree:
                raise FileNotFoundError(sub)
            return FakeKey(tree, (sub,))
        if sub not in tree[parent.path[0]]:
            raise FileNotFoundError(sub)
        if sub == "Properties":
            raise PermissionError("Access is denied")
        return FakeKey(tree, parent.path + (sub,))

    def enum_key(key, index):
        names = sorted(tree[key.path[0]])
        if index >= len(names):
            raise OSError("No more data is available")
        return names[index]

    def query_value(key, name):
        values = tree[key.path[0]][key.path[1]]
        if name not in values:
            raise FileNotFoundError(name)
        return values[name], 1

    reg.OpenKey, reg.EnumKey, reg.QueryValueEx = open_key, enum_key, query_value
    return reg


RYZEN_AI_WINDOWS = {
    "0000": {"MatchingDeviceId": r"PCI\VEN_1002&DEV_150E&REV_C1", "DriverDesc": "AMD Radeon(TM) 890M Graphics"},
    "0001": {"MatchingDeviceId": r"pci\ven_10de&dev_2c58", "DriverDesc": "NVIDIA GeForce RTX 5090 Laptop GPU"},
    "Properties": {},
}


def test_native_linux_lists_the_igpu_but_directml_cannot_reach_it(tmp_path, installed):
    root = make_root(tmp_path, cards=[AMD])
    (device,), note = _probe.probe(root=root, system="Linux")
    assert note is None
    assert device.device_id == "gpu_integrated:amd" and device.vendor == "amd"
    assert device.kind == "gpu_integrated" and device.memory_pool == "host_ram"
    assert device.memory_bytes == 0
    assert not device.runnable and "DirectML needs Windows or WSL" in device.reason
    assert device.weight_formats == () and device.backend is None


def test_nvidia_card_is_left_to_edge_cuda(tmp_path, installed):
    devices, note = _probe.probe(root=make_root(tmp_path, cards=[NVIDIA]), system="Linux")
    assert devices == [] and "edge-cuda" in note
    devices, _ = _probe.probe(root=make_root(tmp_path / "b", cards=[NVIDIA, INTEL]), system="Linux")
    assert [d.device_id for d in devices] == ["gpu_integrated:intel"]


def test_no_gpu_at_all_is_an_empty_list_with_a_note(tmp_path, installed):
    devices, note = _probe.probe(root=make_root(tmp_path), system="Linux")
    assert devices == [] and note


def test_wsl_with_torch_directml_resolves_the_torch_route(tmp_path, installed):
    installed["torch-directml"] = "0.2.5.dev240914"
    root = make_root(tmp_path, wsl=True, dxg=True)
    (device,), _ = _probe.probe(root=root, system="Linux")
    assert device.device_id == "gpu_integrated:dxg" and device.vendor == "unknown"
    assert device.runnable and device.backend == "torch:dml"
    assert device.weight_formats == ("pt:fp16", "pt:fp32")
    # The ranking's evidence travels with the device: this route ran slower than the CPU.
    assert "1.23 vs 1.54" in device.extras["route_note"]


def test_wsl_without_torch_directml_has_no_formats_and_says_what_to_install(tmp_path, installed):
    installed["onnxruntime-directml"] = "1.24.4"  # the Windows route does not apply under WSL
    (device,), _ = _probe.probe(root=make_root(tmp_path, wsl=True, dxg=True), system="Linux")
    assert not device.runnable and device.backend is None
    assert device.weight_formats == ()
    assert "edge-dml[wsl]" in device.reason
    assert device.extras["route"] == "torch:dml"


def test_wsl_uses_the_sysfs_vendor_when_it_is_there(tmp_path, installed):
    installed["torch-directml"] = "0.2.5"
    (device,), _ = _probe.probe(root=make_root(tmp_path, cards=[INTEL], wsl=True, dxg=True), system="Linux")
    assert device.device_id == "gpu_integrated:intel"


def test_wsl_without_dxg_has_no_gpu(tmp_path, installed):
    devices, note = _probe.probe(root=make_root(tmp_path, wsl=True), system="Linux")
    assert devices == [] and "/dev/dxg" in note


def test_windows_lists_the_amd_igpu_from_the_registry(installed):
    installed["onnxruntime-directml"] = "1.24.4"
    (device,), _ = _probe.probe(system="Windows", winreg=fake_winreg(RYZEN_AI_WINDOWS))
    assert device.device_id == "gpu_integrated:amd"
    assert device.name == "AMD Radeon(TM) 890M Graphics"
    assert device.runnable and device.backend == "ort:dml"
    assert device.weight_formats == ("onnx:fp16", "onnx:fp32")


def test_windows_without_the_runtime_is_not_runnable(installed):
    (device,), _ = _probe.probe(system="Windows", winreg=fake_winreg(RYZEN_AI_WINDOWS))
    assert not device.runnable and device.weight_formats == ()
    assert "onnxruntime-directml is not installed" in device.reason


def test_windows_with_plain_onnxruntime_beside_directml_is_a_clash(installed):
    installed.update({"onnxruntime-directml": "1.24.4", "onnxruntime": "1.31.1"})
    (device,), _ = _probe.probe(system="Windows", winreg=fake_winreg(RYZEN_AI_WINDOWS))
    assert not device.runnable
    assert "pip uninstall onnxruntime" in device.reason


def test_windows_registry_without_adapters(installed):
    devices, note = _probe.probe(system="Windows", winreg=fake_winreg({}))
    assert devices == [] and note


def test_macos_has_no_directml(tmp_path, installed):
    devices, note = _probe.probe(root=make_root(tmp_path, cards=[AMD]), system="Darwin")
    assert devices == [] and "Windows or WSL" in note


def test_routes_are_ranked_with_onnxruntime_first():
    assert [route.backend for route in _routes.ROUTES] == ["ort:dml", "torch:dml"]
    assert _routes.WSL_DML_FP32_TFLOPS < _routes.SAME_HOST_CPU_FP32_TFLOPS


def test_weight_formats_follow_the_resolved_route(tmp_path, installed):
    installed["torch-directml"] = "0.2.5"
    (resolved,), _ = _probe.probe(root=make_root(tmp_path, wsl=True, dxg=True), system="Linux")
    assert edge_dml.weight_formats(device=resolved) == ["pt:fp16", "pt:fp32"]
    (unresolved,), _ = _probe.probe(root=make_root(tmp_path / "b", cards=[AMD]), system="Linux")
    assert edge_dml.weight_formats(device=unresolved) == []
    cpu = Device(device_id="cpu", kind="cpu", vendor="amd", name="cpu", backend="vllm:cpu",
                 runnable=True, memory_pool="host_ram", memory_bytes=1)
    assert edge_dml.weight_formats(device=cpu) is None


def test_hook_probes_this_machine_without_raising(installed):
    pm = pluggy.PluginManager(edge_core.hookspecs.PROJECT)
    pm.add_hookspecs(edge_core.hookspecs)
    pm.register(edge_dml, name="undo-dml")
    try:
        pm.check_pending()
        (devices,) = pm.hook.probe_devices(host=None)
    finally:
        pm.unregister(name="undo-dml")
    assert all(isinstance(d, Device) for d in devices)
    assert devices or edge_dml.last_probe_note  # nothing found must say why
    assert edge_dml.EDGE_API_VERSION == edge_core.hookspecs.API_VERSION


def test_entry_point_is_registered_when_installed():
    from importlib import metadata as md

    try:
        md.distribution("edge-dml")
    except md.PackageNotFoundError:
        pytest.skip("edge-dml is not installed in this interpreter (running from the tree)")
    points = {ep.name: ep.value for ep in md.entry_points(group="edge.backends")}
    assert points.get("dml") == "edge_dml"
