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
