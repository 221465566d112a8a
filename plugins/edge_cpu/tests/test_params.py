"""edge-cpu's plain parameters: vLLM's weight classes re-wrapped as torch.nn.Parameter once loaded (edge_cpu/_params.py)."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
import types

import pytest

from edge_cpu import _engine, _imports, _packing, _params


def test_vllm_loads_it_as_a_general_plugin():
    points = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert points.get("edge_cpu_params") == "edge_cpu._params:install"


def test_a_vllm_parameter_becomes_a_plain_one_over_the_same_storage(monkeypatch):
    torch = pytest.importorskip("torch")
    parameter = pytest.importorskip("vllm.model_executor.parameter")
    # vLLM's classes read the tensor-parallel group as they are made: one rank here
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parameter, "get_tensor_model_parallel_world_size", lambda: 1)
    layer = torch.nn.Linear(64, 32, bias=False)
    packed = parameter.PackedvLLMParameter(data=torch.arange(64, dtype=torch.int32).reshape(32, 2), input_dim=1,
                                           output_dim=0, packed_dim=1, packed_factor=8, weight_loader=lambda *a: None)
    layer.register_parameter("weight_packed", packed)
    kept = layer.weight
    assert _params.plain_parameters(layer, parameter.BasevLLMParameter) == 1
    plain = layer.weight_packed
    assert type(plain) is torch.nn.Parameter and not plain.requires_grad
    assert plain.data_ptr() == packed.data_ptr() and torch.equal(plain, packed)  # no copy, same values
    assert layer.weight is kept  # a plain parameter already is left alone
    # what the re-wrap is for: an operator handed the plain one runs no Python __torch_function__ first
    seen: list[object] = []

    class Watching(parameter.BasevLLMParameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    watched = Watching(data=torch.ones(4), weight_loader=lambda *a: None)
    torch.add(watched, 1)
    assert seen
    holder = torch.nn.Module()
    holder.register_parameter("w", watched)
    _params.plain_parameters(holder, parameter.BasevLLMParameter)
    seen.clear()
    torch.add(holder.w, 1)
    assert not seen


def test_the_loader_re_wraps_after_vllm_has_post_processed_the_weights(monkeypatch):
    order: list[str] = []
    loader = types.ModuleType("fake_base_loader")
    loader.process_weights_after_loading = lambda model, config, device: order.append("vllm")
    monkeypatch.setattr(_params, "plain_parameters", lambda model, base: order.append("plain") or 0)
    assert _params.wrap_loader(loader) and _params.wrap_loader(loader)  # wrapping twice wraps once
    loader.process_weights_after_loading(types.SimpleNamespace(), "config", "cpu")
    assert order == ["vllm", "plain"]


@pytest.fixture
def no_finders(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, _imports.AfterImport)])
    monkeypatch.delitem(sys.modules, _packing.LOADER_MODULE, raising=False)


def test_its_switch_keeps_vllms_classes_in_an_engine_edge_started(no_finders, monkeypatch):
    # the gate itself (no engine mark: nothing) is test_engine_gate.py's, as for every gated plugin
    monkeypatch.setenv(_engine.ENGINE_ENV, "1")
    monkeypatch.setenv(_params.PLAIN_PARAMETERS_ENV, "0")
    _params.install()
    assert not [f for f in sys.meta_path if isinstance(f, _imports.AfterImport)]
