"""Does a backend keep the promises edge-core relies on? The conformance suite, in pytest style.

A backend's own tests subclass :class:`BackendConformance` and name the plugin
module (Hydra's ``class TestJoblibLauncher(LauncherTestSuite)`` pattern)::

    class TestCpuConformance(BackendConformance):
        plugin = edge_cpu
        plugin_name = "cpu"

Every check goes through a fresh :class:`edge_core.services.registry.Registry`, so the
backend is exercised exactly as ``edge`` drives it: statuses, owner dispatch,
the probe time limit. The checks come in three groups:

* **contract** — hooks register cleanly against this core's API; importing and
  probing stay cheap (no torch/vllm/transformers/onnxruntime);
* **probe and planning** — device records well formed and JSON round-trippable,
  no raise on foreign hosts, ids unique and stable, planning hooks answering
  only for devices the backend reported, ``reserve_memory`` terms well formed;
* **stage** (marked ``slow`` and ``engine``) — ``start_stage`` -> ``stream`` -> ``cancel`` ->
  ``stop_stage`` on a real device with :attr:`BackendConformance.stage_model`:
  delta-only events, sequence from 0, nothing of a retired epoch delivered,
  cancel idempotent, no process left behind, and the stage names the device
  that executed it. One stage is started per class and reused.

Checks that need hardware or a runtime skip themselves, saying why, when the
probe finds no runnable device. Timeouts below are hang guards, never speed
assertions.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import pytest
except ImportError as exc:  # pragma: no cover - only without the test extra
    raise ImportError(
        "edge_core.testing needs pytest; install it with `pip install 'edge-core[test]'`"
    ) from exc

from ..artifact import DEMO_MODEL, read_manifest
from ..budget import LIFETIMES, Reservation
from ..devices import EVIDENCE, POOLS, Device
from ..hookspecs import API_VERSION, BROADCAST_HOOKS, OWNER_HOOKS
from ..host import HostFacts, read_host
from ..plan import candidate_order, resolve_session
from ..plans import STAGE_ONLY_KINDS, SessionSpec
from ..runtime.admission import make_plan
from ..runtime.stream_run import StreamRun
from ..services.registry import ENTRY_POINT_GROUP, HEALTHY, LOADED, Registry
from ..stream import DeltaEvent, StageRequest, StateHandle
from .hosts import FOREIGN_PLUGIN, POOL_OF_KIND, fake_hosts, foreign_devices
from .stage_env import StageEnv, live_children, non_daemon_threads

#: Modules a backend must not import while being imported or probed: each costs
#: seconds, and ``edge devices`` answers in well under one.
HEAVY_MODULES = ("torch", "vllm", "transformers", "onnxruntime", "torch_directml", "tensorflow", "jax")

#: Reservation purposes the core reserves itself; a backend term with one of
#: these names would count the same bytes twice.
CORE_PURPOSES = ("weights", "kv_cache", "activations", "external_reserve", "safety_margin")

#: Format names edge knows, for asking a backend about formats its device lacks.
KNOWN_FORMATS = (
    "dense", "compressed-tensors:int8", "compressed-tensors:fp8", "compressed-tensors:w4a16", "gptq", "awq",
    "fp8", "modelopt_fp4", "bitsandbytes", "onnx:fp32", "onnx:fp16", "onnx:a16w8", "pt:fp32", "pt:fp16",
)


def _demo_model() -> Path:
    return DEMO_MODEL


def _json_roundtrip(data: Any) -> Any:
    return json.loads(json.dumps(data))


class BackendConformance:
    """Subclass in a backend's tests with ``plugin = <module>``; every ``test_*`` method runs against it.

    Class attributes a subclass may set:

    ``plugin``
        The backend's plugin module (required).
    ``plugin_name``
        Its entry-point name in ``edge.backends``. Defaults to the installed
        entry point whose value is the module, then to the module name. Owner
        checks in backends often compare ``device.plugin`` with it.
    ``host``
        The :class:`edge_core.HostFacts` for the "real host" checks; default:
        read from this machine.
    ``stage_model``
        The checkpoint the stage checks plan and run (default: the bundled
        demo, ``edge_core/demo/tiny-llama``).
    ``stage_max_model_len``, ``stage_prompt``, ``stage_max_tokens``,
    ``cancel_max_tokens``
        Limits of the stage checks; ``cancel_max_tokens`` must be long enough
        that the request is still producing when it is cancelled.
    ``stage_idle_timeout_s``, ``stage_join_timeout_s``
        Hang guards (seconds): a stage that produces nothing for this long, or
        whose stream does not unwind, fails instead of hanging the run.
    """

    plugin: Any = None
    plugin_name: str | None = None
    host: HostFacts | None = None
    stage_model: str | os.PathLike[str] | None = None
    stage_max_model_len: int = 256
    stage_prompt: str = "The quick brown fox jumps over the lazy dog"
    stage_max_tokens: int = 8
    cancel_max_tokens: int = 192
    stage_idle_timeout_s: float = 300.0
    stage_join_timeout_s: float = 60.0

    # -- helpers ---------------------------------------------------------------

    @classmethod
    def _plugin(cls) -> Any:
        if cls.plugin is None:
            pytest.fail(f"{cls.__name__} must set `plugin = <your backend module>`")
        return cls.plugin

    @classmethod
    def _name(cls) -> str:
        if cls.plugin_name:
            return cls.plugin_name
        module = getattr(cls._plugin(), "__name__", "")
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.value.split(":")[0] == module:
                return ep.name
        return module

    @classmethod
    def _host(cls) -> HostFacts:
        return cls.host if cls.host is not None else read_host()

    @classmethod
    def _fresh_registry(cls) -> tuple[Registry, Any]:
        # entry_points=[] and environ={}: only the plugin under test, whatever else is
        # installed, and no EDGE_* variable of the developer's shell leaks in.
        registry = Registry(entry_points=[], environ={})
        record = registry.register(cls._plugin(), cls._name())
        return registry, record

    @pytest.fixture
    def registry(self) -> Iterator[Registry]:
        registry, _ = self._fresh_registry()
        try:
            yield registry
        finally:
            registry.unregister(self._name())

    @classmethod
    def _probe(cls, registry: Registry, host: HostFacts) -> list[Device]:
        devices = registry.probe(host)
        record = registry.records[cls._name()]
        assert record.status in HEALTHY, (
            f"plugin {record.name!r} probing {host.system}/{host.machine} ended {record.status}: {record.reason}"
        )
        return devices

    @classmethod
    def _session_devices(cls, registry: Registry) -> list[Device]:
        """Runnable devices that could take a whole checkpoint session, or skip saying why."""

        devices = cls._probe(registry, cls._host())
        runnable = [d for d in devices if d.runnable and not d.masked]
        if not runnable:
            why = "; ".join(f"{d.device_id}: {d.reason}" for d in devices) or (
                getattr(cls._plugin(), "last_probe_note", None) or "the probe found no device")
            pytest.skip(f"plugin {cls._name()!r} has no runnable device here ({why})")
        whole = [d for d in runnable if d.kind not in STAGE_ONLY_KINDS]
        if not whole:
            pytest.skip(f"plugin {cls._name()!r}'s runnable devices "
                        f"({', '.join(d.device_id for d in runnable)}) take exported graph stages only")
        return whole

    # -- contract --------------------------------------------------------------

    def test_hooks_register_cleanly(self) -> None:
        registry, record = self._fresh_registry()
        try:
            plugin = self._plugin()
            assert getattr(plugin, "EDGE_API_VERSION", None) == API_VERSION, (
                f"{plugin.__name__}.EDGE_API_VERSION is {getattr(plugin, 'EDGE_API_VERSION', None)!r}; "
                f"this edge-core implements API {API_VERSION}"
            )
            assert record.status == LOADED, f"plugin {record.name!r} registered as {record.status}: {record.reason}"
            known = set(BROADCAST_HOOKS + OWNER_HOOKS)
            assert set(record.hooks) <= known, f"unknown hooks {sorted(set(record.hooks) - known)}"
            assert "probe_devices" in record.hooks, f"plugin {record.name!r} implements no probe_devices"
            priority = getattr(plugin, "EDGE_PRIORITY", 0)
            assert isinstance(priority, int) and not isinstance(priority, bool), (
                f"EDGE_PRIORITY must be an int, got {priority!r}"
            )
            if "start_stage" in record.hooks:
                missing = {"stream", "cancel", "stop_stage"} - set(record.hooks)
                assert not missing, f"a backend that starts stages must also implement {sorted(missing)}"
        finally:
            registry.unregister(record.name)

    def test_entry_point_names_this_module(self) -> None:
        module = self._plugin().__name__
        eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.value.split(":")[0] == module]
        if not eps:
            pytest.skip(f"{module} is not installed with an {ENTRY_POINT_GROUP} entry point (running from a checkout)")
        assert [ep.name for ep in eps] == [self._name()], (
            f"{module} is registered as {[ep.name for ep in eps]} in {ENTRY_POINT_GROUP}, "
            f"but the suite runs it as {self._name()!r}: set plugin_name to the entry-point name"
        )

    def test_import_and_probe_stay_cheap(self) -> None:
        """Importing and probing the backend pulls in no runtime: ``edge devices`` stays fast."""
        script = (
            "import importlib, json, sys\n"
            "heavy = json.loads(sys.argv[3])\n"
            "module = importlib.import_module(sys.argv[1])\n"
            "at_import = sorted(m for m in heavy if m in sys.modules)\n"
            "from edge_core.host import read_host\n"
            "from edge_core.services.registry import Registry\n"
            "registry = Registry(entry_points=[], environ={})\n"
            "registry.register(module, sys.argv[2])\n"
            "registry.probe(read_host())\n"
            "at_probe = sorted(m for m in heavy if m in sys.modules)\n"
            "print(json.dumps({'import': at_import, 'probe': at_probe}))\n"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        done = subprocess.run(
            [sys.executable, "-c", script, self._plugin().__name__, self._name(), json.dumps(HEAVY_MODULES)],
            capture_output=True, text=True, env=env, timeout=120,
        )
        assert done.returncode == 0, f"importing and probing in a fresh interpreter failed:\n{done.stderr}"
        loaded = json.loads(done.stdout.strip().splitlines()[-1])
        assert loaded["import"] == [], f"importing {self._plugin().__name__} imported {loaded['import']}"
        assert loaded["probe"] == [], f"probe_devices imported {loaded['probe']}; import runtimes inside stage hooks"

    # -- probe -----------------------------------------------------------------

    def _check_device(self, device: Device) -> None:
        where = f"plugin {self._name()!r} device {device.device_id!r}"
        assert isinstance(device, Device), f"{where}: not an edge_core.Device"
        assert device.plugin == self._name(), f"{where}: the registry should have tagged it"
        assert not device.masked, f"{where}: masking is the core's policy; a probe reports masked=False"
        assert device.memory_pool == POOL_OF_KIND[device.kind], (
            f"{where}: a {device.kind} draws from {POOL_OF_KIND[device.kind]}, not {device.memory_pool}"
        )
        if device.runnable:
            assert device.backend, f"{where}: a runnable device names the backend that drives it"
            assert device.reason is None, f"{where}: runnable, yet gives a reason it is not: {device.reason!r}"
        assert device.evidence, f"{where}: every claim needs an evidence class (D/B/E); evidence is empty"
        assert all(isinstance(k, str) and v in EVIDENCE for k, v in device.evidence.items()), device.evidence
        assert all(isinstance(f, str) and f for f in device.weight_formats), device.weight_formats
        assert device.memory_available_bytes is None or (
            isinstance(device.memory_available_bytes, int) and device.memory_available_bytes >= 0
        ), f"{where}: memory_available_bytes={device.memory_available_bytes!r}"
        try:
            data = _json_roundtrip(device.to_dict())
        except (TypeError, ValueError) as exc:
            pytest.fail(f"{where}: its record is not plain JSON ({exc}); `edge devices --json` must round-trip")
        again = Device.from_dict(data)
        assert _json_roundtrip(again.to_dict()) == data, f"{where}: does not survive a JSON round trip"

    def test_hook_probe_devices_returns_well_formed_devices(self, registry: Registry) -> None:
        devices = self._probe(registry, self._host())
        for device in devices:
            self._check_device(device)
        if not devices:
            note = getattr(self._plugin(), "last_probe_note", None)
            assert note is None or isinstance(note, str), f"last_probe_note must be a str or None, got {note!r}"

    @pytest.mark.parametrize("host_name", sorted(fake_hosts()))
    def test_probe_never_raises_on_a_foreign_host(self, registry: Registry, host_name: str) -> None:
        devices = self._probe(registry, fake_hosts()[host_name])
        for device in devices:
            self._check_device(device)

    def test_device_ids_are_unique_and_stable(self, registry: Registry) -> None:
        host = self._host()
        raw = registry.pm.hook.probe_devices(host=host)
        first = [d.device_id for answer in raw if answer for d in answer]
        assert len(first) == len(set(first)), f"plugin {self._name()!r} reported an id twice: {first}"
        second = [d.device_id for answer in registry.pm.hook.probe_devices(host=host) if answer for d in answer]
        assert first == second, f"device ids changed between two probes: {first} then {second}"
        self._probe(registry, host)
        assert not registry.warnings, registry.warnings

    # -- planning hooks ----------------------------------------------------------

    @pytest.mark.parametrize("hook", ["weight_formats", "format_remedy", "reserve_memory", "gate_plan"])
    def test_planning_hooks_answer_only_for_owned_devices(self, registry: Registry, hook: str) -> None:
        """A device another plugin reported gets None (the registry would also never send it)."""
        if hook not in registry.records[self._name()].hooks:
            pytest.skip(f"plugin {self._name()!r} does not implement {hook}")

        manifest = read_manifest(str(self.stage_model or _demo_model()))
        session = SessionSpec(max_model_len=self.stage_max_model_len, max_num_batched_tokens=self.stage_max_model_len)
        host = self._host()
        args = {"manifest": manifest, "session": session, "host": host, "reservations": [],
                "weight_format": "compressed-tensors:int8", "share": None}
        caller = getattr(registry.pm.hook, hook)
        for foreign in foreign_devices():
            kwargs = {name: args[name] for name in caller.spec.argnames if name != "device"}
            answer = caller(device=foreign, **kwargs)
            assert answer is None, (
                f"plugin {self._name()!r} answered {hook} for {foreign.device_id} (reported by "
                f"{FOREIGN_PLUGIN!r}) with {answer!r}; return None for devices you did not report"
            )

    def test_owned_devices_get_formats_and_remedies(self, registry: Registry) -> None:
        devices = self._probe(registry, self._host())
        if not devices:
            pytest.skip(f"plugin {self._name()!r} reported no device here")
        for device in devices:
            formats = registry.call_owner(device, "weight_formats")
            assert formats is None or (
                isinstance(formats, (list, tuple)) and all(isinstance(f, str) and f for f in formats)
            ), f"weight_formats({device.device_id}) returned {formats!r}; expected a list of format names"
            if "format_remedy" not in registry.records[self._name()].hooks:
                continue
            executes = set(formats if formats is not None else device.weight_formats)
            for fmt in sorted(set(KNOWN_FORMATS) - executes):
                remedy = registry.call_owner(device, "format_remedy", weight_format=fmt)
                assert remedy is None or (isinstance(remedy, str) and remedy.strip()), (
                    f"format_remedy({device.device_id}, {fmt!r}) returned {remedy!r}; a remedy is text or None"
                )

    def test_hook_reserve_memory_terms_are_well_formed(self, registry: Registry) -> None:

        if "reserve_memory" not in registry.records[self._name()].hooks:
            pytest.skip(f"plugin {self._name()!r} does not implement reserve_memory (it adds no memory terms)")
        devices = self._session_devices(registry)
        manifest = read_manifest(str(self.stage_model or _demo_model()))
        session = resolve_session(manifest, SessionSpec(max_model_len=self.stage_max_model_len))
        host = self._host()
        for device in devices:
            terms = registry.call_owner(device, "reserve_memory", manifest=manifest, session=session, host=host,
                                        share=None)
            assert terms is None or isinstance(terms, list), f"reserve_memory returned {type(terms).__name__}"
            for term in terms or []:
                where = f"plugin {self._name()!r} reserve_memory({device.device_id}) term {getattr(term, 'purpose', term)!r}"
                assert isinstance(term, Reservation), f"{where}: not an edge_core.Reservation"
                assert isinstance(term.bytes, int) and term.bytes >= 0, f"{where}: bytes={term.bytes!r}"
                assert term.pool in POOLS and term.pool in (device.memory_pool, "host_ram"), (
                    f"{where}: pool {term.pool!r} is neither the device's ({device.memory_pool}) nor host_ram"
                )
                assert term.lifetime in LIFETIMES, f"{where}: lifetime {term.lifetime!r}"
                assert term.evidence in EVIDENCE, f"{where}: evidence {term.evidence!r}"
                assert term.note.strip(), f"{where}: say where the number comes from in `note`"
                assert term.purpose not in CORE_PURPOSES, (
                    f"{where}: the core already reserves {term.purpose!r}; the same bytes would count twice"
                )
            again = registry.call_owner(device, "reserve_memory", manifest=manifest, session=session, host=host,
                                        share=None)
            assert again == terms, "reserve_memory gave different terms for the same plan twice"

    @pytest.mark.slow
    def test_hook_verify_device_upgrades_evidence(self, registry: Registry) -> None:
        """``edge devices --verify``: the same device back with ``runnable`` evidence B, or None."""
        if "verify_device" not in registry.records[self._name()].hooks:
            pytest.skip(f"plugin {self._name()!r} has no verify_device hook")
        devices = [d for d in self._probe(registry, self._host()) if d.runnable]
        if not devices:
            pytest.skip(f"plugin {self._name()!r} has no runnable device here to verify")
        for device in devices:
            answer = registry.call_owner(device, "verify_device")
            if answer is None:
                continue
            assert isinstance(answer, Device) and answer.device_id == device.device_id, (
                f"verify_device({device.device_id}) returned {answer!r}; return the same device or None"
            )
            assert answer.evidence.get("runnable") == "B", (
                f"verify_device({device.device_id}) ran something, so its runnable claim is evidence B, "
                f"got {answer.evidence.get('runnable')!r}"
            )
            if not answer.runnable:
                assert answer.reason, "a device that failed verification says why"

    # -- stage -----------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def stage_env(cls) -> Iterator[StageEnv]:

        registry, record = cls._fresh_registry()
        env: StageEnv | None = None
        try:
            if "start_stage" not in record.hooks:
                pytest.skip(f"plugin {record.name!r} does not run stages (no start_stage hook)")
            devices = cls._session_devices(registry)
            host = cls._host()
            model = str(cls.stage_model or _demo_model())
            refused = []
            for device in candidate_order(devices):
                plan = make_plan(model, session=SessionSpec(max_model_len=cls.stage_max_model_len),
                                 devices=[device], host=host, registry=registry)
                if plan.admitted:
                    env = StageEnv(registry, record.name, host, devices, device, plan)
                    break
                refused += [f"[{r.code}] {r.message} (remedy: {r.remedy})" for r in plan.refusals]
            if env is None:
                pytest.skip(f"{model} is refused on every runnable device of {record.name!r}: {'; '.join(refused)}")
            yield env
        finally:
            try:
                if env is not None:
                    env.stop()
            finally:
                registry.unregister(record.name)

    def _request(self, max_tokens: int, **changes: Any) -> StageRequest:
        return StageRequest(prompt=self.stage_prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            **changes)

    def _run(self, env: StageEnv, request: StageRequest, **bounds: Any) -> StreamRun:
        stage = env.started()
        events = env.call("stream", stage=stage, request=request)
        assert events is not None, f"plugin {env.name!r} stream returned None"
        return StreamRun(
            events, lambda: env.call("cancel", stage=stage, request_id=request.request_id),
            request_id=request.request_id, epoch=request.epoch, label=f"{env.name} on {env.device.device_id}",
            **bounds,
        )

    @pytest.mark.slow
    @pytest.mark.engine
    def test_hook_start_stage_reports_the_device_that_executed_it(self, stage_env: StageEnv) -> None:
        stage = stage_env.started()
        executed_on = getattr(stage, "executed_on", None)
        probed = list(stage_env.registry.records[stage_env.name].device_ids)
        assert executed_on in probed, f"stage.executed_on={executed_on!r} is not a device the probe reported {probed}"
        assert executed_on == stage_env.device.device_id, (
            f"planned on {stage_env.device.device_id} but executed on {executed_on}: a backend never moves a "
            "stage silently"
        )
        state = getattr(stage, "state", None)
        assert isinstance(state, StateHandle), f"stage.state must be an edge_core.stream.StateHandle, got {state!r}"
        assert state.device_id == executed_on
        assert state.backend == stage_env.device.backend
        assert state.artifact_id == stage_env.plan.manifest.artifact_id

    @pytest.mark.slow
    @pytest.mark.engine
    def test_hook_stream_yields_delta_events_in_sequence(self, stage_env: StageEnv) -> None:
        # A non-zero epoch: the backend must carry the request's epoch, not assume 0.
        request = self._request(self.stage_max_tokens, epoch=3)
        events = self._run(stage_env, request).collect(idle_timeout_s=self.stage_idle_timeout_s)
        assert events and all(isinstance(e, DeltaEvent) for e in events)
        assert [e.seq for e in events] == list(range(len(events))), "seq must count events from 0 without holes"
        assert {(e.request_id, e.epoch) for e in events} == {(request.request_id, 3)}
        assert [e.final for e in events].count(True) == 1 and events[-1].final, "exactly the last event is final"
        assert events[-1].finish_reason == "length", (
            f"ignore_eos with max_tokens={self.stage_max_tokens} ends with 'length', got {events[-1].finish_reason!r}"
        )
        tokens = [t for e in events for t in e.token_ids]
        # Deltas, not running totals: a backend re-sending earlier tokens overshoots the count.
        assert len(tokens) == self.stage_max_tokens, (
            f"{len(tokens)} token ids across {len(events)} events for max_tokens={self.stage_max_tokens}: "
            "each event must carry only the new tokens"
        )
        vocab = stage_env.plan.manifest.config.get("vocab_size")
        assert all(isinstance(t, int) and (vocab is None or 0 <= t < vocab) for t in tokens), tokens
        assert all(isinstance(e.text, str) for e in events)

    @pytest.mark.slow
    @pytest.mark.engine
    def test_greedy_decoding_repeats(self, stage_env: StageEnv) -> None:
        runs = [self._run(stage_env, self._request(self.stage_max_tokens)).collect(self.stage_idle_timeout_s)
                for _ in range(2)]
        first, second = ([t for e in events for t in e.token_ids] for events in runs)
        assert first == second, "greedy decoding of the same prompt gave different token ids"

    @pytest.mark.slow
    @pytest.mark.engine
    def test_hook_cancel_retires_the_epoch_and_is_idempotent(self, stage_env: StageEnv) -> None:
        request = self._request(self.cancel_max_tokens, epoch=1)
        # One event of room: after the first is read, the producer fills the queue and
        # blocks, so the request is provably still open when cancel runs.
        run = self._run(stage_env, request, max_events=1, join_timeout_s=self.stage_join_timeout_s)
        events = run.events(idle_timeout_s=self.stage_idle_timeout_s)
        first = next(events)
        assert first.seq == 0 and not first.final, "the first of many tokens should not be the last event"
        assert run.stream.wait_for(lambda s: s.producers_waiting > 0 or s.closed, self.stage_idle_timeout_s)
        delivered = run.stream.stats().delivered_events
        report = run.cancel()
        assert report.steps == ("retire", "abort", "close", "join"), report.steps
        assert report.abort_error is None, f"the backend's cancel raised: {report.abort_error}"
        assert isinstance(report.abort_returned, bool), f"cancel must return a bool, got {report.abort_returned!r}"
        assert list(events) == [], "an event of the retired epoch reached the consumer after cancel"
        assert run.stream.stats().delivered_events == delivered
        assert report.discarded_by_fence >= 1, "the queued event of the cancelled request was not fenced"
        assert run.join(self.stage_join_timeout_s), "the backend's stream did not unwind after cancel"
        assert run.cancel() is report
        stage = stage_env.started()
        again = stage_env.call("cancel", stage=stage, request_id=request.request_id)
        assert again is False, f"cancelling a request that is over must return False, got {again!r}"
        unknown = stage_env.call("cancel", stage=stage, request_id="req-conformance-never-started")
        assert unknown is False, f"cancelling an unknown request must return False, got {unknown!r}"
        # The stage still serves after a cancel.
        after = self._run(stage_env, self._request(self.stage_max_tokens)).collect(self.stage_idle_timeout_s)
        assert after[-1].finish_reason == "length"
        assert sum(len(e.token_ids) for e in after) == self.stage_max_tokens

    @pytest.mark.slow
    @pytest.mark.engine
    def test_hook_stop_stage_leaves_nothing_running(self, stage_env: StageEnv) -> None:
        stage_env.started()
        children_before, threads_before = stage_env.children_before, stage_env.threads_before
        stopped = stage_env.stop()
        assert stopped is True, f"stop_stage must return True once everything is gone, got {stopped!r}"
        left = live_children(children_before)
        assert not left, "stop_stage left processes running: " + ", ".join(
            f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left)
        threads = non_daemon_threads(threads_before)
        assert not threads, f"stop_stage left non-daemon threads: {[t.name for t in threads]}"


__all__ = ["BackendConformance", "FOREIGN_PLUGIN", "HEAVY_MODULES", "fake_hosts"]
