"""The conformance suite (edge_core.testing) passes a well-behaved backend and catches each broken one.

Each case writes a small pure-Python backend into a pytester directory — a
fake at the runtime boundary: its "engine" counts tokens instead of running a
model — and runs ``BackendConformance`` against it in a child pytest. The
well-behaved backend must pass every check (the stage checks included, on
the bundled demo checkpoint); each injected bug must fail the check written
for it, and only by that check's reason.
"""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import pytest

pytest_plugins = ("pytester",)

#: A backend implementing every hook. ``BUG`` names the one contract it breaks.
FAKE_BACKEND = textwrap.dedent('''
    """A fake backend: one discrete GPU whose "engine" emits counted tokens."""
    import subprocess, sys, threading, uuid
    from dataclasses import dataclass, field

    from edge_core import Device, Reservation, hookimpl
    from edge_core.stream import DeltaEvent, StateHandle

    BUG = {bug!r}
    EDGE_API_VERSION = 1
    EDGE_PRIORITY = 50
    last_probe_note = None
    DEVICE_ID = "gpu_discrete:fake"
    if BUG == "heavy_import":
        import types
        sys.modules.setdefault("torch", types.ModuleType("torch"))


    def _device(host):
        return Device(device_id=DEVICE_ID, kind="gpu_discrete", vendor="fake", name="Fake GPU",
                      backend="fake:gpu", runnable=True, memory_pool="vram", memory_bytes=8 << 30,
                      weight_formats=("dense",), evidence={{"found": "D", "runnable": "D"}})


    def _owns(device):
        return BUG == "answers_foreign" or device.device_id == DEVICE_ID


    @hookimpl
    def probe_devices(host):
        if BUG == "probe_raises" and host.machine != "x86_64":
            raise RuntimeError("no driver on " + host.machine)
        devices = [_device(host)]
        if BUG == "duplicate_id":
            devices.append(_device(host))
        if BUG == "unstable_id":
            devices = [devices[0].replace(device_id="gpu_discrete:" + uuid.uuid4().hex[:6])]
        return devices


    @hookimpl
    def weight_formats(device):
        return ["dense"] if _owns(device) else None


    @hookimpl
    def format_remedy(device, weight_format):
        return "use a dense build of this model" if _owns(device) else None


    @hookimpl
    def gate_plan(device, manifest):
        return [] if _owns(device) else None


    @hookimpl
    def reserve_memory(device, manifest, session, host):
        if not _owns(device):
            return None
        purpose = "weights" if BUG == "double_counts_weights" else "runtime_baseline"
        return [Reservation(purpose=purpose, bytes=256 << 20, pool="vram", lifetime="session", evidence="E",
                            held_during_load=True, note="fake runtime context")]


    @dataclass
    class Stage:
        state: StateHandle
        executed_on: str
        child: object = None
        inflight: dict = field(default_factory=dict)
        lock: threading.Lock = field(default_factory=threading.Lock)


    @hookimpl
    def start_stage(device, plan):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        with open("child.pid", "w") as handle:
            handle.write(str(child.pid))
        executed_on = "gpu_discrete:elsewhere" if BUG == "wrong_device" else device.device_id
        state = StateHandle(backend=device.backend, device_id=executed_on,
                            artifact_id=plan.manifest.artifact_id, ref="fake-1")
        return Stage(state=state, executed_on=executed_on, child=child)


    @hookimpl
    def stream(stage, request):
        flag = threading.Event()
        with stage.lock:
            stage.inflight[request.request_id] = flag
        return _generate(stage, request, flag)


    def _generate(stage, request, flag):
        epoch = 0 if BUG == "ignores_epoch" else request.epoch
        sent = []
        try:
            for seq in range(request.max_tokens):
                if flag.is_set():
                    yield DeltaEvent(request.request_id, epoch, seq, (), "", "abort")
                    return
                sent.append(7 + seq % 100)
                tokens = tuple(sent) if BUG == "cumulative" else (sent[-1],)
                final = "length" if seq == request.max_tokens - 1 else None
                yield DeltaEvent(request.request_id, epoch, seq, tokens, "t", final)
        finally:
            if BUG != "cancel_not_idempotent":
                with stage.lock:
                    stage.inflight.pop(request.request_id, None)


    @hookimpl
    def cancel(stage, request_id):
        with stage.lock:
            flag = stage.inflight.get(request_id) if BUG == "cancel_not_idempotent" else stage.inflight.pop(request_id, None)
        if flag is None:
            return False
        flag.set()
        return True


    @hookimpl
    def stop_stage(stage):
        if BUG != "leaks_child":
            stage.child.kill()
            stage.child.wait()
        return True


    @hookimpl
    def verify_device(device):
        if not _owns(device):
            return None
        evidence = dict(device.evidence)
        if BUG != "verify_keeps_evidence":
            evidence["runnable"] = "B"
        return device.replace(evidence=evidence)
''')

TEST_MODULE = textwrap.dedent('''
    import {module}
    from edge_core.testing import BackendConformance


    class TestFake(BackendConformance):
        plugin = {module}
        plugin_name = "fake"
''')


def run_suite(pytester: pytest.Pytester, bug: str = ""):
    module = f"fake_backend_{bug or 'ok'}"
    pytester.makepyfile(**{module: FAKE_BACKEND.format(bug=bug), f"test_{module}": TEST_MODULE.format(module=module)})
    pytester.syspathinsert()
    try:
        return pytester.runpytest("-p", "no:cacheprovider", "-rfs")
    finally:
        _kill_recorded_child(pytester.path)


def _kill_recorded_child(where: Path) -> None:
    """The fake stage's child process, when a bug left it running: end it by its recorded pid."""
    pid_file = where / "child.pid"
    if not pid_file.exists():
        return
    import psutil

    pid = int(pid_file.read_text())
    try:
        child = psutil.Process(pid)
        if child.ppid() == os.getpid():
            child.send_signal(signal.SIGKILL)
            child.wait(30)
    except psutil.NoSuchProcess:
        pass


def failed_checks(result) -> set[str]:
    names = set()
    for line in result.outlines:
        if line.startswith("FAILED "):
            test = line.split("::")[-1].split(" ")[0]
            names.add(test.split("[")[0])
    return names


def test_a_well_behaved_backend_passes_every_check_including_the_stage(pytester):
    result = run_suite(pytester)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0, result.stdout.str()
    # Only the installed-entry-point check may skip (the fake is not installed).
    assert outcomes.get("skipped", 0) == 1, result.stdout.str()
    assert outcomes["passed"] >= 18


#: Each bug and the checks it must fail — exactly these: a bug that trips unrelated
#: checks would mean the suite reports the wrong reason.
BROKEN = [
    ("heavy_import", {"test_import_and_probe_stay_cheap"}),
    ("probe_raises", {"test_probe_never_raises_on_a_foreign_host"}),
    ("duplicate_id", {"test_device_ids_are_unique_and_stable"}),
    ("unstable_id", {"test_device_ids_are_unique_and_stable"}),
    ("answers_foreign", {"test_planning_hooks_answer_only_for_owned_devices"}),
    ("double_counts_weights", {"test_hook_reserve_memory_terms_are_well_formed"}),
    ("wrong_device", {"test_hook_start_stage_reports_the_device_that_executed_it"}),
    # A stream that breaks the contract also breaks the cancel check, which streams too.
    ("cumulative", {"test_hook_stream_yields_delta_events_in_sequence", "test_hook_cancel_retires_the_epoch_and_is_idempotent"}),
    ("ignores_epoch", {"test_hook_stream_yields_delta_events_in_sequence", "test_hook_cancel_retires_the_epoch_and_is_idempotent"}),
    ("cancel_not_idempotent", {"test_hook_cancel_retires_the_epoch_and_is_idempotent"}),
    ("leaks_child", {"test_hook_stop_stage_leaves_nothing_running"}),
    ("verify_keeps_evidence", {"test_hook_verify_device_upgrades_evidence"}),
]


@pytest.mark.parametrize("bug,checks", BROKEN, ids=[bug for bug, _ in BROKEN])
def test_each_broken_contract_fails_its_check(pytester, bug, checks):
    result = run_suite(pytester, bug)
    assert failed_checks(result) == checks, result.stdout.str()
