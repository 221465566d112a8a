"""edge-cpu's vLLM plugins change vLLM only in an engine edge started (edge_cpu/_engine.py); AMX permission always."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
import types

import pytest

from edge_cpu import _amx, _engine, _heap, _imports, _packing, _params, _pp

#: Every edge-cpu vLLM plugin that changes what the engine holds or computes: each is gated.
GATED = {"edge_cpu_heap": _heap.trim_after_load, "edge_cpu_pp": _pp.allocate_stage_buffers,
         "edge_cpu_packing": _packing.install, "edge_cpu_params": _params.install}


@pytest.fixture
def clean_imports(monkeypatch):
    """A ``sys.meta_path`` without edge-cpu's finders, and vLLM's patched modules not imported, for this test."""
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, _imports.AfterImport)])
    for name in (_heap.WORKER_MODULE, _pp.RUNNER_MODULE, _packing.DISPATCH_MODULE, _packing.LOADER_MODULE):
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name in (*_packing.levers(), _params.PLAIN_PARAMETERS_ENV):
        monkeypatch.delenv(name, raising=False)  # every lever on, as a user's environment has them


def finders() -> list[str]:
    return sorted(f.module for f in sys.meta_path if isinstance(f, _imports.AfterImport))


@pytest.mark.parametrize("name", sorted(GATED))
def test_in_a_users_own_vllm_no_plugin_changes_anything(name, clean_imports, monkeypatch):
    monkeypatch.delenv(_engine.ENGINE_ENV, raising=False)
    GATED[name]()
    assert finders() == []


@pytest.mark.parametrize("name,modules", [
    ("edge_cpu_heap", [_heap.WORKER_MODULE]),
    ("edge_cpu_pp", [_pp.RUNNER_MODULE]),
    ("edge_cpu_packing", sorted([_packing.DISPATCH_MODULE, _packing.LOADER_MODULE])),
    ("edge_cpu_params", [_packing.LOADER_MODULE]),
])
def test_in_an_engine_edge_started_each_plugin_waits_for_its_vllm_module(name, modules, clean_imports, monkeypatch):
    monkeypatch.setenv(_engine.ENGINE_ENV, "1")
    GATED[name]()
    assert finders() == modules


@pytest.mark.parametrize("value,on", [(None, False), ("", False), ("0", False), ("true", False), ("1", True),
                                      (" 1 ", True)])
def test_only_the_mark_1_opens_the_gate(value, on):
    environ = {} if value is None else {_engine.ENGINE_ENV: value}
    assert _engine.in_edge_engine(environ) is on


def test_every_registered_plugin_is_gated_but_the_amx_permission():
    points = {ep.name for ep in metadata.entry_points(group="vllm.general_plugins") if ep.value.startswith("edge_cpu")}
    assert points == {*GATED, "edge_cpu_amx"}


def test_amx_permission_is_asked_in_every_vllm_process(monkeypatch):
    # Not a lever: without it vLLM CPU 0.32 dies with SIGILL on this AMX host (plugins/edge_cpu/README.md).
    asked: list[bool] = []
    fake_torch = types.SimpleNamespace(cpu=types.SimpleNamespace(_init_amx=lambda: asked.append(True) or True))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    monkeypatch.delenv(_engine.ENGINE_ENV, raising=False)
    _amx.request_amx()
    assert asked == [True]
