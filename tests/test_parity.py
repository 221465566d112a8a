"""``edge parity`` (edge_core/runtime/parity.py): the runtime alone against edge's stage, token ids compared.

The backend here is a fake at the runtime boundary: its "engine" derives
token ids from the prompt's characters, so the expected ids are computed in
the test from the same rule, and its reference run can be told to diverge at
a chosen position. What is under test is parity's own logic — the reference
hook is asked for exactly the acceptance prompts, the edge half goes through
the real stage session (stream, sampler, stop), and the first divergent
position is recorded per prompt.
"""

from __future__ import annotations

import contextlib
import os
import types

import pytest

from edge_core import Device, hookimpl
from edge_core.artifact import DEMO_MODEL
from edge_core.errors import UsageError
from edge_core.plans import SessionSpec
from edge_core.runtime.accept import PROMPTS
from edge_core.runtime.admission import make_plan
from edge_core.runtime.parity import first_divergence, run_parity
from edge_core.services.registry import Registry
from edge_core.stream import DeltaEvent, StateHandle

GIB = 1 << 30


def engine_ids(prompt: str, max_tokens: int) -> list[int]:
    """The fake engine's greedy output: the prompt's character codes, cycled."""
    codes = [ord(c) for c in prompt]
    return [codes[i % len(codes)] for i in range(max_tokens)]


def fake_backend(*, diverge_at: int | None = None, with_reference: bool = True) -> types.ModuleType:
    module = types.ModuleType("edge_fake_parity")
    module.EDGE_API_VERSION = 1
    module.asked = []
    module.pins = []

    @hookimpl
    def probe_devices(host):
        return [Device(device_id="gpu_discrete:fake", kind="gpu_discrete", vendor="fake", name="Fake GPU",
                       backend="fake:gpu", runnable=True, memory_pool="vram", memory_bytes=8 * GIB,
                       weight_formats=("dense",), evidence={"found": "D", "runnable": "D"})]

    @hookimpl
    def start_stage(device, plan):
        return types.SimpleNamespace(executed_on=device.device_id,
                                     state=StateHandle("fake:gpu", device.device_id, plan.manifest.artifact_id, "r"))

    @hookimpl
    def stream(stage, request):
        ids = engine_ids(request.prompt, request.max_tokens)
        return iter([DeltaEvent(request.request_id, request.epoch, seq, (token,), "x",
                                "length" if seq == len(ids) - 1 else None) for seq, token in enumerate(ids)])

    @hookimpl
    def cancel(stage, request_id):
        return False

    @hookimpl
    def stop_stage(stage):
        return True

    def reference_token_ids(device, plan, prompts, max_tokens):
        module.asked.append((list(prompts), max_tokens))
        module.pins.append(os.environ.get("EDGE_TEST_STAGE_PIN"))
        out = [engine_ids(p, max_tokens) for p in prompts]
        if diverge_at is not None:
            out[1][diverge_at] += 1
        return out, {"engine_start_s": 0.0, "leftover_pids": []}

    for hook in (probe_devices, start_stage, stream, cancel, stop_stage):
        setattr(module, hook.__name__, hook)
    if with_reference:
        module.reference_token_ids = hookimpl(reference_token_ids)
    return module


@pytest.fixture
def planned():
    registries = []

    def make(**kwargs):
        registry = Registry(allow=["fake"])
        registry.register(fake_backend(**kwargs), "fake")
        registries.append(registry)
        from edge_core.host import read_host

        host = read_host()
        plan = make_plan(str(DEMO_MODEL), session=SessionSpec(max_model_len=256), devices=registry.probe(host),
                         host=host, registry=registry)
        assert plan.admitted, plan.refusals
        return plan, registry

    yield make
    for registry in registries:
        registry.unregister("fake")


def test_first_divergence_positions():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_hook_reference_token_ids_identical_runs_are_identical(planned):
    plan, registry = planned()
    record = run_parity(plan, registry, max_tokens=8)
    assert record["outcome"] == "identical"
    assert [row["first_divergent_position"] for row in record["prompts"]] == [None] * len(PROMPTS)
    assert record["prompts"][0]["edge_token_ids"] == engine_ids(PROMPTS[0], 8)
    asked = registry.owner(plan.selected_device).plugin.asked
    assert asked == [(list(PROMPTS), 8)]


def test_a_divergence_is_recorded_at_its_position_for_its_prompt(planned):
    plan, registry = planned(diverge_at=5)
    record = run_parity(plan, registry, max_tokens=8)
    assert record["outcome"] == "diverged"
    positions = [row["first_divergent_position"] for row in record["prompts"]]
    assert positions[1] == 5 and positions.count(None) == len(PROMPTS) - 1


def test_a_backend_without_a_reference_run_is_a_usage_error_before_anything_starts(planned):
    plan, registry = planned(with_reference=False)
    with pytest.raises(UsageError, match="reference_token_ids"):
        run_parity(plan, registry, max_tokens=8)


def test_across_nodes_the_stage_runs_joined_first_then_the_reference_alone_in_the_environment_before_it(planned):
    plan, registry = planned()
    fake = registry.owner(plan.selected_device).plugin
    seen = []

    @contextlib.contextmanager
    def nodes():
        seen.append(("joined", len(fake.asked)))
        os.environ["EDGE_TEST_STAGE_PIN"] = "0"  # what the stage's start sets (thread binding, device pin)
        yield
        seen.append(("left", len(fake.asked)))

    record = run_parity(plan, registry, max_tokens=8, nodes=nodes())
    assert seen == [("joined", 0), ("left", 0)]  # the reference had not run while the nodes were joined
    assert fake.asked == [(list(PROMPTS), 8)] and fake.pins == [None]
    assert "EDGE_TEST_STAGE_PIN" not in os.environ
    assert record["outcome"] == "identical"
