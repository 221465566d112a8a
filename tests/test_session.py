"""StageSession: the one start sequence, unwound in reverse on every exit path.

Hermetic: a throwaway backend whose ``start_stage`` / ``stop_stage`` record
what happened, a plan admitted by construction, a host ledger in a directory
of its own. ``watches=False`` keeps the reaper and the sampler out (they are
the engine tests' to exercise, tests/test_run.py); what is checked here is the
order the steps are undone in, and that every exit (a clean one, an error in
the body, Ctrl-C, SIGTERM, a start that fails) undoes all of them.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from fakes import plugin_module

from edge_core.devices import Device
from edge_core.errors import PluginError, StageError
from edge_core.plans import Plan, SessionSpec
from edge_core.runtime.session import StageSession
from edge_core.services import host_ledger as hl
from edge_core.services.registry import Registry

PLUGIN = "session-test"
DEVICE = Device(device_id="cpu:session-test", kind="cpu", vendor="test", name="session test device",
                backend="test:session", runnable=True, memory_pool="host_ram", memory_bytes=1 << 30,
                weight_formats=("dense",), evidence={"found": "D"}, plugin=PLUGIN)
PLAN = Plan(admitted=True, model_path="test-model", session=SessionSpec(), selected_device=DEVICE)
main_thread_only = pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                      reason="signal handlers are set from the main thread only")


class Backend:
    """What the session asked of the backend, in order; ``fail`` names a hook that raises."""

    def __init__(self, ledger: hl.Registration | None = None, fail: str | None = None):
        self.calls: list[str] = []
        self.ledger, self.fail = ledger, fail

    def hooks(self) -> dict:
        def start_stage(device, plan):
            self.calls.append("start_stage")
            if self.fail == "start_stage":
                raise RuntimeError("the graph did not load")
            return object()

        def stop_stage(stage):
            # The ledger record is still there while the stage stops, and Ctrl-C is held off.
            self.calls.append(f"stop_stage(record={self._record_live()}, "
                              f"sigint={signal.getsignal(signal.SIGINT) is signal.SIG_IGN})")
            if self.fail == "stop_stage":
                raise RuntimeError("the stage would not stop")
            return True

        return {"start_stage": start_stage, "stop_stage": stop_stage}

    def _record_live(self) -> bool:
        return self.ledger is not None and any(
            r.session_id == self.ledger.record.session_id for r in hl.read_ledger().records)


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGE_LEDGER_DIR", str(tmp_path / "ledger"))
    return tmp_path / "ledger"


@pytest.fixture
def stage_record():
    """A ledger record of this process's own (``session=False``), as a graph stage registers one."""
    with hl.admission() as taken:
        held = taken.register(command="graph stage", model="test-model", artifact_id=None,
                              device_ids=(DEVICE.device_id,), reserved_bytes={"host_ram": 1 << 20},
                              predicted_peak_bytes=1 << 20, headroom_bytes=0, session=False)
    yield held
    held.remove()


def registry_with(backend: Backend):
    registry = Registry(entry_points=[], environ={})
    registry.register(plugin_module(PLUGIN, **backend.hooks()), PLUGIN)
    return registry


def session(registry, held, **options) -> StageSession:
    return StageSession(PLAN, registry, watches=False, ledger=held, releases_ledger=True, **options)


def live_ids() -> list[str]:
    return [r.session_id for r in hl.read_ledger().records]


@main_thread_only
def test_a_clean_session_marks_its_record_running_then_unwinds_in_reverse(stage_record):
    backend = Backend(stage_record)
    registry = registry_with(backend)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with session(registry, stage_record) as started:
            assert [r.state for r in hl.read_ledger().records] == ["running"]
            assert signal.getsignal(signal.SIGTERM) is not before  # routed through Ctrl-C while the stage runs
        # The stage stopped first (its record still live, Ctrl-C held off), then the signals, then the record.
        assert backend.calls == ["start_stage", "stop_stage(record=True, sigint=True)"]
        assert started.stop_answer is True and started.stop_error is None
        assert signal.getsignal(signal.SIGTERM) is before
        assert live_ids() == []
    finally:
        registry.unregister(PLUGIN)


@main_thread_only
@pytest.mark.parametrize("stop_by", ["error", "ctrl-c", "sigterm"])
def test_every_exit_from_the_body_stops_the_stage_and_removes_its_record(stage_record, stop_by):
    backend = Backend(stage_record)
    registry = registry_with(backend)
    raised = {"error": ValueError, "ctrl-c": KeyboardInterrupt, "sigterm": KeyboardInterrupt}[stop_by]
    try:
        with pytest.raises(raised):
            with session(registry, stage_record):
                if stop_by == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)  # arrives as KeyboardInterrupt inside the block
                    time.sleep(5)
                    pytest.fail("SIGTERM did not arrive as KeyboardInterrupt")
                raise raised("stop")
        assert backend.calls == ["start_stage", "stop_stage(record=True, sigint=True)"]
        assert live_ids() == []
    finally:
        registry.unregister(PLUGIN)


@main_thread_only
def test_a_start_that_fails_unwinds_what_was_done_before_it(stage_record):
    backend = Backend(stage_record, fail="start_stage")
    registry = registry_with(backend)
    before = signal.getsignal(signal.SIGTERM)
    stage = session(registry, stage_record)
    try:
        with pytest.raises(PluginError, match="the graph did not load"):
            stage.__enter__()
        assert backend.calls == ["start_stage"]  # nothing started, so nothing to stop
        assert signal.getsignal(signal.SIGTERM) is before and live_ids() == []
        stage.__exit__(None, None, None)  # leaving after a failed start has nothing left to undo
    finally:
        registry.unregister(PLUGIN)


def test_a_failed_stop_is_kept_when_asked_and_raised_otherwise(stage_record):
    backend = Backend(stage_record, fail="stop_stage")
    registry = registry_with(backend)
    try:
        with session(registry, stage_record, keeps_stop_error=True) as kept:
            pass
        assert kept.stop_answer is None and "would not stop" in str(kept.stop_error)
        assert live_ids() == []  # the record goes even when the stop failed

        with hl.admission() as taken:
            again = taken.register(command="graph stage", model="test-model", artifact_id=None,
                                   device_ids=(DEVICE.device_id,), reserved_bytes={"host_ram": 1},
                                   predicted_peak_bytes=1, headroom_bytes=0, session=False)
        with pytest.raises(PluginError, match="would not stop"):
            with session(registry, again):
                pass
        assert live_ids() == []
    finally:
        registry.unregister(PLUGIN)


def test_a_backend_whose_start_stage_returns_nothing_is_named():
    registry = Registry(entry_points=[], environ={})
    registry.register(plugin_module(PLUGIN, start_stage=lambda device, plan: None), PLUGIN)
    try:
        with pytest.raises(StageError, match=f"plugin '{PLUGIN}' returned no stage from start_stage"):
            with StageSession(PLAN, registry, watches=False):
                pass
    finally:
        registry.unregister(PLUGIN)


def test_a_session_that_did_not_watch_says_so_when_asked_for_memory(stage_record):
    backend = Backend(stage_record)
    registry = registry_with(backend)
    try:
        with session(registry, stage_record) as done:
            pass
        with pytest.raises(StageError, match="did not sample memory"):
            done.memory()
    finally:
        registry.unregister(PLUGIN)
