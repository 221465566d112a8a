from __future__ import annotations

import json

import pytest

from edge_core.devices import Device, apply_mask, load_device_list, parse_mask


def cpu(**changes):
    base = dict(device_id="cpu", kind="cpu", vendor="amd", name="EPYC", backend="vllm:cpu", runnable=True,
                memory_pool="host_ram", memory_bytes=32 << 30, weight_formats=("dense",),
                evidence={"found": "D"})
    base.update(changes)
    return Device(**base)


def test_shared_pool_devices_must_carry_zero_bytes():
    with pytest.raises(ValueError, match="draws from host RAM"):
        Device(device_id="npu:amd", kind="npu", vendor="amd", name="XDNA2", backend=None, runnable=False,
               memory_pool="host_ram", memory_bytes=16 << 30, reason="no runtime")


@pytest.mark.parametrize("bad", [
    {"device_id": "0"}, {"kind": "tpu"}, {"memory_pool": "disk"}, {"memory_bytes": -1},
    {"evidence": {"x": "Z"}}, {"runnable": False, "reason": None},
])
def test_invalid_records_are_refused_with_a_message(bad):
    with pytest.raises(ValueError, match="invalid device record"):
        cpu(**bad)


def test_mask_keeps_device_listed_with_real_memory():
    masked = apply_mask([cpu()], parse_mask("cpu"))
    assert masked[0].masked and not masked[0].runnable
    assert masked[0].memory_bytes == 32 << 30
    assert masked[0].status == "masked"
    assert apply_mask([cpu()], parse_mask("gpu_discrete"))[0].runnable


def test_unknown_mask_kind_is_named():
    with pytest.raises(ValueError, match="tpu"):
        parse_mask("gpu_discrete,tpu")


def test_device_list_round_trips(tmp_path):
    path = tmp_path / "devices.json"
    path.write_text(json.dumps({"devices": [cpu().to_dict()], "host": {"mem_total_bytes": 1}}))
    devices, host = load_device_list(str(path))
    assert devices == [cpu()]
    assert host == {"mem_total_bytes": 1}


@pytest.mark.parametrize("content,needle", [
    ("not json", "not JSON"), ("[]", "no 'devices' list"), ('{"devices": [1]}', "not an object"),
    ('{"devices": [{"device_id": "cpu"}]}', "devices[0]"),
])
def test_bad_device_lists_are_named(tmp_path, content, needle):
    path = tmp_path / "d.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_device_list(str(path))


# ---- a device list is user input: every field is checked on load ----

def write_list(tmp_path, devices, host=None):
    path = tmp_path / "devices.json"
    doc = {"devices": devices, **({"host": host} if host is not None else {})}
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("field,value", [
    ("evidence", "D"),
    ("compute_capability", [9, 0]),
    ("compute_capability", "9.0"),
    ("memory_bytes", -1),
    ("memory_bytes", "32GiB"),
    ("memory_bytes", True),
    ("memory_available_bytes", 1.5),
    ("kind", "tpu"),
    ("memory_pool", "disk"),
    ("weight_formats", "dense"),
    ("runnable", "yes"),
    ("masked", 1),
    ("extras", [1, 2]),
    ("device_id", ""),
    ("backend", 3),
])
def test_each_bad_device_field_is_named_with_its_value_and_what_is_expected(tmp_path, field, value):
    row = {**cpu().to_dict(), field: value}
    path = write_list(tmp_path, [cpu().to_dict(), row])
    with pytest.raises(ValueError) as info:
        load_device_list(path)
    message = str(info.value)
    assert path in message and f"devices[1].{field} is {value!r}: expected" in message
    assert "edge devices --json" in message  # what to do about it


def test_a_missing_required_device_field_is_named(tmp_path):
    row = cpu().to_dict()
    del row["memory_pool"]
    with pytest.raises(ValueError, match=r"devices\[0\]\.memory_pool is missing: expected one of vram, host_ram"):
        load_device_list(write_list(tmp_path, [row]))


def test_unknown_device_fields_are_ignored_for_lists_from_newer_versions(tmp_path):
    row = {**cpu().to_dict(), "numa_binding": {"node": 0}, "future": [1]}
    devices, _ = load_device_list(write_list(tmp_path, [row]))
    assert devices == [cpu()]


def test_from_dict_names_the_field_without_a_file():
    with pytest.raises(ValueError, match=r"^compute_capability is \[9, 0\]: expected a string like 'sm_90'"):
        Device.from_dict({**cpu().to_dict(), "compute_capability": [9, 0]})


def test_a_long_bad_value_is_quoted_shortened(tmp_path):
    row = {**cpu().to_dict(), "vendor": ["x" * 500]}
    with pytest.raises(ValueError) as info:
        load_device_list(write_list(tmp_path, [row]))
    assert "devices[0].vendor is ['xxx" in str(info.value) and "x" * 100 not in str(info.value)


@pytest.mark.parametrize("host,field", [
    ({"mem_total_bytes": "64GiB"}, "host.mem_total_bytes"),
    ({"mem_available_bytes": -5}, "host.mem_available_bytes"),
    ({"cgroup_limit_bytes": "max"}, "host.cgroup_limit_bytes"),
    ({"logical_cores": 2.5}, "host.logical_cores"),
    ({"isa_flags": "avx2"}, "host.isa_flags"),
    ({"is_wsl": "no"}, "host.is_wsl"),
    ({"system": 7}, "host.system"),
    ({"numa_nodes": {"node_id": 0}}, "host.numa_nodes"),
    ({"numa_nodes": [{"node_id": 0, "total_bytes": "lots", "reclaimable_bytes": 0}]},
     "host.numa_nodes[0].total_bytes"),
    ({"numa_nodes": [{"node_id": 0, "total_bytes": 1, "reclaimable_bytes": 0, "cpus": "0-3"}]},
     "host.numa_nodes[0].cpus"),
    ([1, 2], "host"),
])
def test_a_bad_host_section_is_named_not_a_crash(tmp_path, host, field):
    path = write_list(tmp_path, [cpu().to_dict()], host=host)
    with pytest.raises(ValueError) as info:
        load_device_list(path)
    assert path in str(info.value) and f"{field} is " in str(info.value)


def test_a_host_section_as_edge_devices_writes_it_loads(tmp_path, host_tree):
    from edge_core.host import HostFacts, read_host

    host = read_host(host_tree(nodes=[{"total": 16 << 30, "free": 8 << 30, "cpus": 2}]))
    _, doc = load_device_list(write_list(tmp_path, [cpu().to_dict()], host=host.to_dict()))
    assert HostFacts.from_dict(doc) == host


def test_the_checked_fields_are_the_fields_the_documents_carry():
    from edge_core.devices import DEVICE_FIELDS, HOST_SECTION_FIELDS, NUMA_NODE_FIELDS
    from edge_core.host import NumaNode, read_host

    assert set(DEVICE_FIELDS) == set(cpu().to_dict())
    # usable_bytes and usable_cores are derived (clamped by the cgroup), so from_dict does not read them
    assert set(HOST_SECTION_FIELDS) == set(read_host().to_dict()) - {"usable_bytes", "usable_cores"}
    assert set(NUMA_NODE_FIELDS) == set(NumaNode(0, 1, 1).to_dict())
