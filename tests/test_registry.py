"""Fault injection against the registry: one broken plugin never takes the others down."""

from __future__ import annotations

import threading

import pytest
from fakes import FakeEntryPoint, plugin_module

from edge_core import Device
from edge_core.host import read_host
from edge_core.services.registry import Registry


def device(device_id="gpu_discrete:toy", **changes):
    base = dict(device_id=device_id, kind="gpu_discrete", vendor="toy", name="Toy", backend="toy",
                runnable=True, memory_pool="vram", memory_bytes=8 << 30, weight_formats=("dense",),
                evidence={"found": "D"})
    base.update(changes)
    return Device(**base)


def healthy(name="toy", device_id="gpu_discrete:toy"):
    return plugin_module(name, probe_devices=lambda host: [device(device_id)])


def ep(name, module_or_exc):
    def loader():
        if isinstance(module_or_exc, BaseException):
            raise module_or_exc
        return module_or_exc
    return FakeEntryPoint(name, loader)


@pytest.fixture
def host(host_tree):
    return read_host(host_tree())


def probe(entry_points, host, **kwargs):
    registry = Registry(entry_points, environ={}, **kwargs)
    devices = registry.probe(host)
    return registry, devices


def test_healthy_plugin_is_loaded_and_devices_are_tagged_with_it(host):
    registry, devices = probe([ep("toy", healthy())], host)
    assert [d.device_id for d in devices] == ["gpu_discrete:toy"]
    assert devices[0].plugin == "toy"
    record = registry.records["toy"]
    assert record.status == "loaded"
    assert "probe_devices" in record.hooks
    assert record.device_ids == ("gpu_discrete:toy",)


def test_the_record_names_the_plugin_s_distribution_and_version(host):
    # Read from the distribution's METADATA fields, as importlib.metadata gives them.
    registry, _ = probe([FakeEntryPoint("toy", healthy, dist="edge-toy")], host)
    record = registry.records["toy"]
    assert (record.distribution, record.version) == ("edge-toy", "0.0.1")


def test_import_error_is_a_status_and_others_still_work(host):
    registry, devices = probe([ep("broken", ImportError("No module named 'pynvml'")), ep("toy", healthy())], host)
    assert registry.records["broken"].status == "import_error"
    assert "pynvml" in registry.records["broken"].reason
    assert [d.device_id for d in devices] == ["gpu_discrete:toy"]


def test_even_systemexit_at_import_is_contained(host):
    registry, devices = probe([ep("exits", SystemExit(3)), ep("toy", healthy())], host)
    assert registry.records["exits"].status == "import_error"
    assert devices


def test_probe_that_raises_is_a_probe_error(host):
    def boom(host):
        raise RuntimeError("driver exploded")

    registry, devices = probe([ep("bad", plugin_module("bad", probe_devices=boom)), ep("toy", healthy())], host)
    assert registry.records["bad"].status == "probe_error"
    assert "driver exploded" in registry.records["bad"].reason
    assert [d.plugin for d in devices] == ["toy"]


@pytest.mark.parametrize("answer,needle", [
    ("a string", "returned str"),
    ({"device_id": "x"}, "returned dict"),
    ([{"device_id": "x"}], "holding dict"),
])
def test_wrong_return_type_is_invalid(host, answer, needle):
    module = plugin_module("wrong", probe_devices=lambda host: answer)
    registry, devices = probe([ep("wrong", module), ep("toy", healthy())], host)
    assert registry.records["wrong"].status == "invalid"
    assert needle in registry.records["wrong"].reason
    assert [d.plugin for d in devices] == ["toy"]


def test_api_version_mismatch_names_both_versions(host):
    module = plugin_module("old", api_version=0, probe_devices=lambda host: [device("npu:old")])
    registry, devices = probe([ep("old", module), ep("toy", healthy())], host)
    record = registry.records["old"]
    assert record.status == "api_mismatch"
    assert "API 0" in record.reason and "API 1" in record.reason
    assert "npu:old" not in [d.device_id for d in devices]


def test_missing_api_version_is_a_mismatch(host):
    module = plugin_module("anon", api_version=None, probe_devices=lambda host: [])
    registry, _ = probe([ep("anon", module)], host)
    assert registry.records["anon"].status == "api_mismatch"
    assert "declares no EDGE_API_VERSION" in registry.records["anon"].reason


def test_unknown_hook_name_fails_validation(host):
    module = plugin_module("typo", probe_device=lambda host: [])
    registry, _ = probe([ep("typo", module)], host)
    assert registry.records["typo"].status == "invalid"
    assert "probe_device" in registry.records["typo"].reason


def test_hanging_probe_times_out_and_others_answer(host):
    release = threading.Event()

    def hang(host):
        release.wait(30)
        return []

    try:
        registry, devices = probe(
            [ep("slow", plugin_module("slow", probe_devices=hang)), ep("toy", healthy())], host,
            probe_timeout_s=0.2,
        )
        assert registry.records["slow"].status == "probe_timeout"
        assert "0.2 s" in registry.records["slow"].reason
        assert [d.plugin for d in devices] == ["toy"]
    finally:
        release.set()


def test_duplicate_device_id_is_reported_not_merged(host):
    registry, devices = probe([ep("a", healthy("a")), ep("b", healthy("b"))], host)
    assert [d.plugin for d in devices] == ["a"]
    assert any("claimed by plugins 'a' and 'b'" in w for w in registry.warnings)


def test_block_list_applies_before_import(host):
    entry = ep("toy", healthy())
    registry, devices = probe([entry], host, block=["toy"])
    assert entry.loads == 0
    assert registry.records["toy"].status == "blocked"
    assert devices == []


def test_allow_list_naming_an_absent_plugin_warns(host):
    entry = ep("toy", healthy())
    other = ep("other", healthy("other", "npu:other"))
    registry, devices = probe([entry, other], host, allow=["toy", "ghost"])
    assert other.loads == 0 and registry.records["other"].status == "not_allowed"
    assert any("'ghost'" in w and "not installed" in w for w in registry.warnings)
    assert [d.plugin for d in devices] == ["toy"]


def test_allow_list_comes_from_the_environment(host):
    registry = Registry([ep("toy", healthy())], environ={"EDGE_PLUGINS": "nothing"})
    registry.probe(host)
    assert registry.records["toy"].status == "not_allowed"


def test_priority_orders_plugins_and_user_override_wins(host):
    a, b = healthy("a", "npu:a"), healthy("b", "npu:b")
    a.EDGE_PRIORITY, b.EDGE_PRIORITY = 10, 20
    registry, devices = probe([ep("b", b), ep("a", a)], host)
    assert [r.name for r in registry.plugins()] == ["a", "b"]
    registry, devices = probe([ep("b", b), ep("a", a)], host, priorities={"b": 1})
    assert [r.name for r in registry.plugins()] == ["b", "a"]


def test_no_devices_status_carries_the_plugins_note(host):
    module = plugin_module("empty", probe_devices=lambda host: [])
    module.last_probe_note = "NVML: driver not loaded"
    registry, _ = probe([ep("empty", module)], host)
    assert registry.records["empty"].status == "no_devices"
    assert registry.records["empty"].reason == "NVML: driver not loaded"


def test_owner_dispatch_reaches_only_the_owning_plugin(host):
    seen = []

    def formats_a(device):
        seen.append(("a", device.device_id))
        return ["dense"]

    def formats_b(device):
        seen.append(("b", device.device_id))
        return ["fp8"]

    a = plugin_module("a", probe_devices=lambda host: [device("npu:a")], weight_formats=formats_a)
    b = plugin_module("b", probe_devices=lambda host: [device("npu:b")], weight_formats=formats_b)
    registry, devices = probe([ep("a", a), ep("b", b)], host)
    by_id = {d.device_id: d for d in devices}
    assert registry.call_owner(by_id["npu:b"], "weight_formats") == ["fp8"]
    assert seen == [("b", "npu:b")]


def test_owner_hook_failure_names_plugin_and_device(host):
    from edge_core.errors import PluginError

    def explode(device):
        raise KeyError("boom")

    module = plugin_module("x", probe_devices=lambda host: [device("npu:x")], weight_formats=explode)
    registry, devices = probe([ep("x", module)], host)
    with pytest.raises(PluginError, match="plugin 'x' failed in weight_formats for device 'npu:x'"):
        registry.call_owner(devices[0], "weight_formats")



def test_an_engine_death_passes_through_the_owner_call_as_it_is(host):
    # The backend did not fail: the engine it started died, and the error already names the process and why.
    from edge_core.errors import EngineDied

    died = EngineDied("vLLM could not start on npu:x: pid 7 (VLLM::Worker) was killed by SIGILL", {})

    def dies(device):
        raise died

    module = plugin_module("x", probe_devices=lambda host: [device("npu:x")], weight_formats=dies)
    registry, devices = probe([ep("x", module)], host)
    with pytest.raises(EngineDied) as caught:
        registry.call_owner(devices[0], "weight_formats")
    assert caught.value is died

def test_tracing_prints_hook_calls(host, capsys):
    probe([ep("toy", healthy())], host, trace=True)
    err = capsys.readouterr().err
    assert "edge trace: probe_devices(host=" in err
    assert "gpu_discrete:toy" in err
