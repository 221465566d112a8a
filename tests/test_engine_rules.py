"""The seam between the planner and an engine: ``engine_rules`` (edge_core.engine, edge_core.engines.vllm).

The checkpoint planner charges the KV pool and writes a parallel layout's
launch environment from the rules the device's backend hands it; a device no
installed backend owns gets vLLM's. A throwaway backend with rules of its own
shows the planner takes the answer, not a copy of vLLM's.
"""

from __future__ import annotations

from typing import Any

import pytest
from fakes import plugin_module

from edge_core import Device
from edge_core.artifact import DEMO_MODEL
from edge_core.engine import ChargeSettings, EngineRules, KVLayout
from edge_core.engines.vllm import VLLM_RULES, VllmRules
from edge_core.host import read_host
from edge_core.kit import vllm_hooks
from edge_core.layout import Layout
from edge_core.plan.gates import Owner
from edge_core.plan.parallel import ParallelRequest
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import make_plan
from edge_core.services.registry import Registry

GIB = 1 << 30


class DoubledRules(VllmRules):
    """An engine whose allocator holds twice vLLM's pool and whose ranks need one more variable."""

    name = "acme"

    def charge_bytes(self, layout: KVLayout, max_model_len: int, settings: ChargeSettings) -> int:
        return 2 * super().charge_bytes(layout, max_model_len, settings)

    def launch_env(self, device: Device, layout: Layout, session: SessionSpec, host: Any,
                   devices: list[Device]) -> tuple[dict[str, str], str | None]:
        env, note = super().launch_env(device, layout, session, host, devices)
        return {**env, "ACME_RANKS": str(layout.world_size)}, note


def acme_cpu() -> Device:
    return Device(device_id="cpu", kind="cpu", vendor="amd", name="AMD Ryzen", backend="acme:cpu", runnable=True,
                  memory_pool="host_ram", memory_bytes=32 * GIB, memory_available_bytes=28 * GIB,
                  weight_formats=("dense",), evidence={"found": "D"}, plugin="acme", extras={"parallel": "vllm"})


@pytest.fixture
def acme():
    rules = DoubledRules()
    registry = Registry(entry_points=[], environ={})
    registry.register(plugin_module("acme", probe_devices=lambda host: [],
                                    engine_rules=lambda device: rules if device.plugin == "acme" else None), "acme")
    try:
        yield registry, rules
    finally:
        registry.unregister("acme")


def test_vllm_rules_are_engine_rules():
    rules: EngineRules = VLLM_RULES  # mypy checks the protocol here; the name is the charging rule it fills
    assert rules.name == "vllm"


def test_hook_engine_rules_is_what_the_planner_charges_the_kv_pool_by(acme, host_tree):
    registry, rules = acme
    host = read_host(host_tree(mem_total=32 * GIB, mem_available=28 * GIB))
    session = SessionSpec(max_model_len=256)
    device = acme_cpu()
    assert Owner.of(device, registry).rules() is rules
    owned = make_plan(str(DEMO_MODEL), session=session, devices=[device], host=host, registry=registry)
    alone = make_plan(str(DEMO_MODEL), session=session, devices=[device], host=host, registry=None)
    assert owned.admitted and alone.admitted and owned.kv is not None and alone.kv is not None
    assert owned.kv.bytes_vllm == 2 * alone.kv.bytes_vllm  # the backend's rule, not vLLM's
    assert owned.kv.bytes_flat == alone.kv.bytes_flat  # the engine-neutral figures are the core's own


def test_hook_engine_rules_writes_a_parallel_layouts_environment(acme, host_tree):
    registry, _ = acme
    host = read_host(host_tree(mem_total=32 * GIB, mem_available=28 * GIB, cores=4))
    plan = make_plan(str(DEMO_MODEL), session=SessionSpec(max_model_len=256), devices=[acme_cpu()], host=host,
                     registry=registry, parallel=ParallelRequest(tp=2))
    assert plan.admitted and plan.parallel is not None
    assert plan.parallel["env"]["ACME_RANKS"] == "2"


def test_a_device_no_backend_owns_is_planned_by_vllms_rules():
    assert Owner.of(acme_cpu(), None).rules() is VLLM_RULES


def test_the_vllm_backends_hand_over_vllms_rules():
    assert vllm_hooks.engine_rules(device=acme_cpu()) is VLLM_RULES
