"""Eager or compiled: the user's flag wins, else the owning backend's ``execution_mode``, else eager."""

from __future__ import annotations

import pytest

from edge_core.artifact import DEMO_MODEL, read_manifest
from edge_core.cli import build_parser
from edge_core.devices import Device
from edge_core.errors import UsageError
from edge_core.plan.execution import DEFAULT_REASON, execution_mode, with_mode
from edge_core.plans import ExecutionMode, SessionSpec

GPU = Device.from_dict({"device_id": "acme:0", "kind": "gpu_discrete", "vendor": "acme", "name": "Acme",
                        "backend": "acme", "plugin": "acme", "runnable": True, "memory_pool": "vram",
                        "memory_bytes": 1 << 34})


class Owner:
    """The registry's owner dispatch, at the boundary: records each call and answers what the backend would."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def call_owner(self, device, hook, **kwargs):
        self.calls.append((device.device_id, hook, sorted(kwargs)))
        return self.answer


@pytest.fixture(scope="module")
def manifest():
    return read_manifest(str(DEMO_MODEL))


def test_the_backends_answer_decides_when_no_flag_is_given(manifest):
    owner = Owner(ExecutionMode(enforce_eager=False, source="default", reason="Acme compiles",
                                cudagraph_capture_sizes=(1, 2)))
    mode = execution_mode(GPU, manifest, SessionSpec(), owner, owned=True)
    assert (mode.enforce_eager, mode.source, mode.reason, mode.cudagraph_capture_sizes) == \
        (False, "backend", "Acme compiles", (1, 2))
    assert owner.calls == [("acme:0", "execution_mode", ["manifest", "session"])]


@pytest.mark.parametrize("flag, eager", [("--enforce-eager", True), ("--compile", False)])
def test_a_flag_overrides_the_backend_without_asking_it(manifest, flag, eager):
    owner = Owner(ExecutionMode(enforce_eager=not eager, source="backend", reason="the other way"))
    mode = execution_mode(GPU, manifest, SessionSpec(enforce_eager=eager), owner, owned=True)
    assert (mode.enforce_eager, mode.source) == (eager, flag) and flag in mode.reason
    assert owner.calls == []


def test_no_answer_or_a_backend_not_installed_here_is_eager(manifest):
    for owner, owned in ((Owner(None), True), (Owner("not a mode"), True), (Owner(ExecutionMode(
            enforce_eager=False, source="backend", reason="x")), False), (None, False)):
        mode = execution_mode(GPU, manifest, SessionSpec(), owner, owned=owned)
        assert (mode.enforce_eager, mode.source, mode.reason) == (True, "default", DEFAULT_REASON)


def test_with_mode_sets_enforce_eager_and_nothing_else():
    session = SessionSpec(max_num_seqs=4)
    assert with_mode(session, None) is session
    assert with_mode(session, ExecutionMode(enforce_eager=False, source="backend", reason="r")) == \
        SessionSpec(max_num_seqs=4, enforce_eager=False)


def test_an_unknown_source_is_refused():
    with pytest.raises(ValueError, match="unknown execution source"):
        ExecutionMode(enforce_eager=True, source="guess", reason="r")


@pytest.mark.parametrize("command", ["plan", "run", "serve", "accept", "parity"])
def test_every_command_that_plans_takes_both_flags_and_defaults_to_the_backend(command):
    parser = build_parser()
    extra = ["--json", "out.json"] if command == "accept" else []
    assert parser.parse_args([command, *extra]).enforce_eager is None
    assert parser.parse_args([command, *extra, "--enforce-eager"]).enforce_eager is True
    assert parser.parse_args([command, *extra, "--compile"]).enforce_eager is False
    with pytest.raises((SystemExit, UsageError), match="not allowed with"):
        parser.parse_args([command, *extra, "--compile", "--enforce-eager"])
