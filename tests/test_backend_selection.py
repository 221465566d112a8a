"""``--backend NAME`` (edge_core.plan.only_backend): the user chooses which backend plans and runs.

The planner takes the first device that passes every gate in a fixed order;
``--backend`` narrows the candidates to one plugin's devices (or one backend
string) before planning. Device lists come from a saved ``edge devices --json``
document, so these tests do not depend on what is installed here.
"""

from __future__ import annotations

import json

import pytest
from fakes import plugin_module

from edge_core import Device
from edge_core.artifact import DEMO_MODEL
from edge_core.cli import main
from edge_core.errors import UsageError
from edge_core.plan import only_backend
from edge_core.services.registry import Registry

GIB = 1 << 30


def cpu(device_id: str, plugin: str, backend: str) -> Device:
    return Device(device_id=device_id, kind="cpu", vendor="amd", name="AMD Ryzen", backend=backend, runnable=True,
                  memory_pool="host_ram", memory_bytes=32 * GIB, memory_available_bytes=28 * GIB,
                  weight_formats=("dense",), evidence={"found": "D"}, plugin=plugin)


DEVICES = [cpu("cpu", "cpu", "vllm:cpu"), cpu("cpu:hf", "transformers", "transformers:cpu")]


def test_no_backend_keeps_every_device():
    assert only_backend(DEVICES, None, None) == DEVICES


@pytest.mark.parametrize("name", ["transformers", "transformers:cpu"])
def test_a_plugin_name_or_a_backend_string_selects_its_devices(name):
    assert [d.device_id for d in only_backend(DEVICES, name, None)] == ["cpu:hf"]


def test_an_installed_plugin_without_devices_selects_nothing_and_the_plan_says_why():
    registry = Registry(entry_points=[], environ={})
    registry.register(plugin_module("quiet", probe_devices=lambda host: []), "quiet")
    try:
        assert only_backend(DEVICES, "quiet", registry) == []
    finally:
        registry.unregister("quiet")


def test_a_name_nothing_carries_is_a_usage_error_listing_what_is_known():
    with pytest.raises(UsageError) as caught:
        only_backend(DEVICES, "nvidia", None)
    message = str(caught.value)
    assert "'nvidia'" in message and "cpu, transformers, transformers:cpu, vllm:cpu" in message


@pytest.fixture
def device_list(tmp_path, host_tree):
    from edge_core.host import read_host

    path = tmp_path / "devices.json"
    host = read_host(host_tree(mem_total=32 * GIB, mem_available=28 * GIB))
    path.write_text(json.dumps({"host": host.to_dict(), "devices": [d.to_dict() for d in DEVICES]}))
    return str(path)


def test_edge_plan_backend_selects_the_device(device_list, capsys, monkeypatch):
    # No installed backend: both devices are planned from the list alone.
    monkeypatch.setenv("EDGE_PLUGINS", "none-installed")
    code = main(["plan", "--model", str(DEMO_MODEL), "--devices", device_list, "--backend", "transformers",
                 "--max-model-len", "256", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["selected_device"] == "cpu:hf"
    assert [row["device_id"] for row in doc["devices"]] == ["cpu:hf"]


def test_edge_plan_without_backend_takes_the_first_candidate(device_list, capsys, monkeypatch):
    monkeypatch.setenv("EDGE_PLUGINS", "none-installed")
    code = main(["plan", "--model", str(DEMO_MODEL), "--devices", device_list, "--max-model-len", "256", "--json"])
    assert code == 0 and json.loads(capsys.readouterr().out)["selected_device"] == "cpu"


def test_edge_plan_unknown_backend_exits_64(device_list, capsys, monkeypatch):
    monkeypatch.setenv("EDGE_PLUGINS", "none-installed")
    assert main(["plan", "--devices", device_list, "--backend", "nvidia"]) == 64
    assert "no installed plugin or device backend is named 'nvidia'" in capsys.readouterr().err
