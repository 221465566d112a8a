"""edge-transformers beyond the conformance suite: probe reasons, the architecture gate, stage edge cases.

Installed metadata is faked at its boundary (``_probe.installed_version``); the
stage tests load the bundled demo checkpoint with the real transformers.
"""

from __future__ import annotations

import dataclasses

import pytest

import edge_transformers
from edge_core.artifact import DEMO_MODEL, read_manifest
from edge_core.errors import StageError
from edge_core.host import HostFacts
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import make_plan
from edge_core.services.registry import Registry
from edge_core.stream import StageRequest
from edge_transformers import _plan, _probe, _stage

GIB = 1 << 30
HOST = HostFacts(system="darwin", mem_total_bytes=16 * GIB, mem_available_bytes=9 * GIB, cgroup_limit_bytes=None,
                 cgroup_usage_bytes=None, logical_cores=8, physical_cores=8, cpu_model="Apple M2", machine="arm64")


def test_runnable_when_transformers_and_torch_are_installed(monkeypatch):
    monkeypatch.setattr(_probe, "installed_version", {"transformers": "5.19.0", "torch": "2.13.0"}.get)
    [device] = edge_transformers.probe_devices(host=HOST)
    assert device.device_id == "cpu:hf" and device.runnable and device.backend == "transformers:cpu"
    assert device.memory_pool == "host_ram" and device.memory_bytes == 16 * GIB
    assert device.memory_available_bytes == 9 * GIB and device.vendor == "apple"
    assert device.extras["runtime"] == "transformers 5.19.0, torch 2.13.0"


def test_missing_torch_is_the_reason_not_a_crash(monkeypatch):
    monkeypatch.setattr(_probe, "installed_version", {"transformers": "5.19.0"}.get)
    [device] = edge_transformers.probe_devices(host=HOST)
    assert not device.runnable and device.backend is None
    assert device.reason.startswith("torch is not installed") and "pip install edge-transformers" in device.reason


def test_an_architecture_transformers_lacks_is_refused_before_load():
    manifest = read_manifest(str(DEMO_MODEL))
    alien = dataclasses.replace(manifest, model_type="acme_alien",
                                config={**manifest.config, "model_type": "acme_alien", "auto_map": {"x": "y"}})
    [device] = edge_transformers.probe_devices(host=HOST)
    device = device.replace(plugin="transformers")
    assert _plan.gate(device, manifest) == []
    [refusal] = edge_transformers.gate_plan(device=device, manifest=alien)
    assert refusal.code == "kernel_unsupported" and "acme_alien" in refusal.message
    assert "auto_map" in refusal.message and "upgrade transformers" in refusal.remedy


# -- a real stage on the demo checkpoint ----------------------------------------


@pytest.fixture(scope="module")
def stage():
    pytest.importorskip("transformers")
    registry = Registry(entry_points=[], environ={})
    registry.register(edge_transformers, "transformers")
    try:
        from edge_core.host import read_host

        host = read_host()
        devices = [d for d in registry.probe(host) if d.runnable]
        if not devices:
            pytest.skip("transformers and torch are not both installed here")
        plan = make_plan(str(DEMO_MODEL), session=SessionSpec(max_model_len=64), devices=devices, host=host,
                         registry=registry)
        assert plan.admitted, plan.refusals
        handle = _stage.start(devices[0], plan)
        yield handle
        _stage.stop(handle)
    finally:
        registry.unregister("transformers")


def request(**changes):
    base = dict(prompt="Hello there", max_tokens=6, temperature=0.0, ignore_eos=True)
    base.update(changes)
    return StageRequest(**base)


@pytest.mark.slow
def test_cancel_before_the_first_token_yields_only_an_abort(stage):
    req = request()
    events = _stage.stream(stage, req)
    assert _stage.cancel(stage, req.request_id) is True
    assert _stage.cancel(stage, req.request_id) is False
    [only] = list(events)
    assert only.finish_reason == "abort" and only.token_ids == () and only.seq == 0


@pytest.mark.slow
def test_eos_stops_generation_unless_ignored(stage):
    greedy = [t for e in _stage.stream(stage, request()) for t in e.token_ids]
    eos = greedy[2]
    stage.eos_token_ids = frozenset({eos})
    try:
        stopped = list(_stage.stream(stage, request(ignore_eos=False)))
        # Random weights repeat tokens: generation stops at the first occurrence.
        assert [t for e in stopped for t in e.token_ids] == greedy[:greedy.index(eos) + 1]
        assert stopped[-1].finish_reason == "stop"
        ignored = list(_stage.stream(stage, request(ignore_eos=True)))
        assert [t for e in ignored for t in e.token_ids] == greedy
    finally:
        stage.eos_token_ids = _stage._eos_ids(stage.model)


@pytest.mark.slow
def test_seeded_sampling_repeats_and_token_ids_prompt_works(stage):
    ids = list(stage.tokenizer("Hello there").input_ids)
    runs = [[t for e in _stage.stream(stage, request(prompt=None, prompt_token_ids=ids, temperature=1.0, seed=7))
             for t in e.token_ids] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 6


@pytest.mark.slow
def test_a_conversation_is_rendered_by_the_models_template(stage):
    turns = ({"role": "user", "content": "Hello there"},)
    # tiny-llama's template writes each turn as <|role|>, newline, content, newline, then opens the assistant's.
    assert "<|assistant|>" in stage.tokenizer.chat_template
    rendered = stage.tokenizer("<|user|>\nHello there\n<|assistant|>\n", add_special_tokens=False).input_ids
    as_chat = [t for e in _stage.stream(stage, request(prompt=None, messages=turns)) for t in e.token_ids]
    as_ids = [t for e in _stage.stream(stage, request(prompt=None, prompt_token_ids=rendered)) for t in e.token_ids]
    assert as_chat == as_ids and len(as_chat) == 6
    template, stage.tokenizer.chat_template = stage.tokenizer.chat_template, None
    try:
        with pytest.raises(StageError, match="no chat template"):
            _stage.stream(stage, request(prompt=None, messages=turns))
    finally:
        stage.tokenizer.chat_template = template


@pytest.mark.slow
def test_a_request_longer_than_the_plan_is_a_named_error(stage):
    with pytest.raises(StageError, match="max_model_len 64"):
        _stage.stream(stage, request(max_tokens=63))


@pytest.mark.slow
def test_stop_aborts_a_request_in_flight_and_refuses_new_ones():
    pytest.importorskip("transformers")
    from edge_core.host import read_host

    [device] = [d.replace(plugin="transformers") for d in edge_transformers.probe_devices(host=read_host())]
    if not device.runnable:
        pytest.skip(device.reason)
    registry = Registry(entry_points=[], environ={})
    registry.register(edge_transformers, "transformers")
    try:
        plan = make_plan(str(DEMO_MODEL), session=SessionSpec(max_model_len=64), devices=[device], host=read_host(),
                         registry=registry)
    finally:
        registry.unregister("transformers")
    handle = _stage.start(device, plan)
    events = _stage.stream(handle, request(max_tokens=20))
    first = next(events)
    assert first.seq == 0 and first.finish_reason is None
    assert _stage.stop(handle) is True
    rest = list(events)
    assert [e.finish_reason for e in rest] == ["abort"] and handle.model is None
    with pytest.raises(StageError, match="stopped"):
        _stage.stream(handle, request())
