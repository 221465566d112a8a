"""The vLLM stage runtime (edge_core/vllm_stage.py) against the real vLLM CPU build, on the demo checkpoint.

One stage is started for the module and reused by every test (an engine start
costs ~20 s on two cores); ``test_stop_*`` stops it and checks what is left,
and the holder restarts it for any test that runs later.
"""

from __future__ import annotations

import gc
import importlib.util
import random
import threading
import time

import psutil
import pytest

from edge_core.errors import StageError
from edge_core.runtime.stream_run import StreamRun
from edge_core.stream import DeltaEvent, StageRequest

NEEDS = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]
REAL_ENGINE = [
    pytest.mark.vllm,
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(bool(NEEDS), reason=f"needs the real vLLM CPU build and edge-cpu; missing: {NEEDS}"),
]

#: Seconds to wait for the in-flight count to reach zero after a cancel; only
#: bounds a hang (it returns as soon as the engine drops the request).
IDLE_WAIT_S = 30.0


class StageHolder:
    """The module's stage, planned like `edge plan` on the demo and started through the registry."""

    def __init__(self) -> None:
        from edge_core.cli import build_parser
        from edge_core.cli.plan import plan_from_args

        self.plan, self.registry = plan_from_args(build_parser().parse_args(["plan"]))
        assert self.plan.admitted, [r.message for r in self.plan.refusals]
        self.device = self.plan.selected_device
        self._stage = None

    @property
    def stage(self):
        if self._stage is None or self._stage.stopped:
            self._stage = self.registry.call_owner(self.device, "start_stage", plan=self.plan)
        return self._stage

    def run(self, request: StageRequest) -> StreamRun:
        stage = self.stage
        events = self.registry.call_owner(self.device, "stream", stage=stage, request=request)
        return StreamRun(
            events,
            lambda: self.registry.call_owner(self.device, "cancel", stage=stage, request_id=request.request_id),
            request_id=request.request_id, epoch=request.epoch,
        )

    def stop(self) -> None:
        if self._stage is not None:
            self.registry.call_owner(self.device, "stop_stage", stage=self._stage)


@pytest.fixture(scope="module")
def held():
    holder = StageHolder()
    try:
        yield holder
    finally:
        holder.stop()


def _tokens(events: list[DeltaEvent]) -> list[int]:
    return [token for event in events for token in event.token_ids]

def _check_clean_cancel(held, run: StreamRun, report, consumed: int, remaining) -> None:
    after = sum(1 for _ in remaining)
    assert after == 0, "no event of a retired epoch reaches the consumer"
    stats = run.stream.stats()
    assert stats.delivered_events == consumed
    assert stats.closed and run.epoch in stats.retired_epochs
    assert report.steps == ("retire", "abort", "close", "join")
    assert report.producer_joined
    assert held.stage.wait_idle(IDLE_WAIT_S), "in-flight count back to zero"
    assert held.stage.in_flight_count == 0
    assert held.stage.engine_unfinished() == 0


class TestRealStage:
    """Against the module's started stage."""

    pytestmark = REAL_ENGINE

    def test_stage_handle_names_where_it_runs(self, held):
        stage = held.stage
        assert stage.executed_on == "cpu"
        assert stage.state.backend == "vllm:cpu" and stage.state.device_id == "cpu"
        assert stage.state.artifact_id == held.plan.manifest.artifact_id
        assert stage.engine_kwargs == held.plan.engine_kwargs
        # The demo's plan runs its engine in this process (one vLLM CPU rank): nothing spawned, the plan's layout set.
        assert held.plan.execution.in_process and stage.stage_pids == ()
        values = stage.runtime_env.values
        assert values["VLLM_CPU_KVCACHE_SPACE"] is None and values["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        assert values["EDGE_ENGINE"] == "1"  # edge's engine: edge-cpu's levers act in it


    def test_stream_yields_deltas_in_order_and_exactly_max_tokens(self, held):
        request = StageRequest(prompt="The gateway box in the cupboard", max_tokens=48, ignore_eos=True, epoch=7)
        events = held.run(request).collect(idle_timeout_s=120)
        assert [e.seq for e in events] == list(range(len(events)))
        assert all(e.epoch == 7 and e.request_id == request.request_id for e in events)
        assert len(_tokens(events)) == 48
        assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
        assert events[-1].finish_reason == "length"
        # deltas, not running totals: the texts concatenate to the whole completion without repeats
        assert sum(len(e.token_ids) for e in events) == len(_tokens(events))
        assert held.stage.in_flight_count == 0 or held.stage.wait_idle(IDLE_WAIT_S)


    def test_greedy_is_deterministic_and_token_ids_prompt_matches(self, held):
        prompt = "Numbers without a source are guesses"
        first = _tokens(held.run(StageRequest(prompt=prompt, max_tokens=40, ignore_eos=True)).collect(120))
        second = _tokens(held.run(StageRequest(prompt=prompt, max_tokens=40, ignore_eos=True)).collect(120))
        assert first == second and len(first) == 40
        other = _tokens(held.run(StageRequest(prompt="A different prompt entirely", max_tokens=40,
                                              ignore_eos=True)).collect(120))
        assert other != first, "random weights still depend on the prompt"


    def test_a_slow_reader_gets_merged_deltas_with_nothing_lost(self, held):
        prompt = "The quick brown fox"
        reference = _tokens(held.run(StageRequest(prompt=prompt, max_tokens=120, ignore_eos=True)).collect(120))
        run = held.run(StageRequest(prompt=prompt, max_tokens=120, ignore_eos=True))
        slow = []
        for event in run.events(idle_timeout_s=120):
            slow.append(event)
            time.sleep(0.02)  # lets the engine run ahead, so deltas wait and are merged
        assert _tokens(slow) == reference, "merged deltas keep every token, in order"
        assert [e.seq for e in slow] == list(range(len(slow))) and slow[-1].finish_reason == "length"


    def test_max_tokens_without_ignore_eos_still_ends_with_a_reason(self, held):
        events = held.run(StageRequest(prompt="Hello", max_tokens=5)).collect(120)
        assert 1 <= len(_tokens(events)) <= 5 and events[-1].finish_reason in ("length", "stop")



    def test_cancel_in_prefill_twenty_times(self, held):
        rng = random.Random(20241130)
        # ~1,500 prompt tokens: the longest prefill the demo's 2,048-token context allows
        # beside a 256-token answer. Token ids go straight to the engine.
        prompt_ids = tuple(3 + (i * 37) % 500 for i in range(1500))
        probe = held.run(StageRequest(prompt_token_ids=prompt_ids, max_tokens=256, ignore_eos=True))
        started = time.perf_counter()
        first = next(iter(probe))
        to_first_event = time.perf_counter() - started
        probe.cancel()
        assert first.seq == 0
        fenced = 0
        for _attempt in range(20):
            request = StageRequest(prompt_token_ids=prompt_ids, max_tokens=256, ignore_eos=True,
                                   epoch=rng.randrange(1, 10_000))
            run = held.run(request).start()
            time.sleep(rng.uniform(0, to_first_event))  # a random point before the first token
            report = run.cancel()
            fenced += report.discarded_by_fence
            _check_clean_cancel(held, run, report, 0, run.events())
        # the engine is still healthy: a fresh request completes
        assert len(_tokens(held.run(StageRequest(prompt="after", max_tokens=8, ignore_eos=True)).collect(120))) == 8


    def test_cancel_in_decode_twenty_times(self, held):
        rng = random.Random(11)
        reference = _tokens(held.run(StageRequest(prompt="Tokens arrive one at a time", max_tokens=64,
                                                  ignore_eos=True)).collect(120))
        for _attempt in range(20):
            request = StageRequest(prompt="Tokens arrive one at a time", max_tokens=1500, ignore_eos=True,
                                   epoch=rng.randrange(1, 10_000))
            run = held.run(request)
            events = run.events(idle_timeout_s=120)
            consumed = rng.randint(1, 40)
            got = [next(events) for _ in range(consumed)]
            report = run.cancel()
            assert report.was_in_flight
            assert all(e.epoch == request.epoch for e in got)
            _check_clean_cancel(held, run, report, consumed, events)
        again = _tokens(held.run(StageRequest(prompt="Tokens arrive one at a time", max_tokens=64,
                                              ignore_eos=True)).collect(120))
        assert again == reference, "forty cancels left no trace in greedy output"


    def test_cancel_of_unknown_or_finished_request_is_false(self, held):
        stage = held.stage
        request = StageRequest(prompt="Hi", max_tokens=3, ignore_eos=True)
        held.run(request).collect(120)
        stage.wait_idle(IDLE_WAIT_S)
        assert held.registry.call_owner(held.device, "cancel", stage=stage, request_id=request.request_id) is False
        assert held.registry.call_owner(held.device, "cancel", stage=stage, request_id="req-never-sent") is False


    def test_a_request_whose_events_were_never_asked_for_is_not_left_in_flight(self, held):
        stage = held.stage
        request = StageRequest(prompt="Hi", max_tokens=3)
        unread = held.registry.call_owner(held.device, "stream", stage=stage, request=request)  # never iterated
        assert stage.in_flight_count == 1
        assert held.registry.call_owner(held.device, "cancel", stage=stage, request_id=request.request_id) is True
        assert stage.in_flight_count == 0
        (only,) = list(unread)  # read anyway, it ends at once with a final abort and no tokens
        assert only.finish_reason == "abort" and only.token_ids == () and only.seq == 0
        # and one that is simply dropped is forgotten with it
        events = held.registry.call_owner(held.device, "stream", stage=stage, request=StageRequest(prompt="Hi"))
        assert stage.in_flight_count == 1
        del events
        gc.collect()
        assert stage.in_flight_count == 0


    def test_tensor_inputs_are_refused_by_a_text_stage(self, held):
        with pytest.raises(StageError, match="tensor inputs"):
            held.stage.stream(StageRequest(inputs={"x": b"\x00" * 4}))


    def test_stop_under_a_live_request_leaves_no_process_or_thread(self, held):
        stage = held.stage
        pids = stage.stage_pids
        assert all(psutil.pid_exists(pid) for pid in pids)
        request = StageRequest(prompt="Cancel is not stop reading", max_tokens=1500, ignore_eos=True)
        run = held.run(request)
        events = run.events(idle_timeout_s=120)
        next(events)
        assert held.registry.call_owner(held.device, "stop_stage", stage=stage) is True
        report = stage.stop()  # idempotent: the same report
        assert report.clean, report.to_dict()
        alive = [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
        assert alive == []
        children = [p.pid for p in psutil.Process().children(recursive=True)]
        assert not set(children) & set(pids)
        assert not [t for t in threading.enumerate() if t.name.startswith("edge-vllm")]
        # the live request ended (with an error naming the stop, or quietly), never hangs
        with pytest.raises(StageError):
            list(events)
        run.cancel()
        with pytest.raises(StageError, match="stopped"):
            stage.stream(StageRequest(prompt="late", max_tokens=2))
        assert stage.cancel(request.request_id) is False


# ---------------------------------------------------------------- no engine needed

def test_merging_reader_joins_waiting_deltas_and_keeps_an_error_for_later():
    import queue

    from edge_core.runtime.vllm_stage import MergingReader

    outputs = queue.SimpleQueue()
    for item in [("out", ((1,), "a", None)), ("out", ((2, 3), "bc", None)), ("error", ValueError("boom")),
                 ("out", ((4,), "d", "length"))]:
        outputs.put(item)
    reader = MergingReader(outputs)
    assert reader.next() == ("out", ((1, 2, 3), "abc", None))
    kind, payload = reader.next()
    assert kind == "error" and str(payload) == "boom"
    assert reader.next() == ("out", ((4,), "d", "length"))


def test_merging_stops_at_the_final_delta():
    import queue

    from edge_core.runtime.vllm_stage import MergingReader

    outputs = queue.SimpleQueue()
    for item in [("out", ((1,), "a", None)), ("out", ((2,), "b", "length")), ("out", ((9,), "z", None))]:
        outputs.put(item)
    assert MergingReader(outputs).next() == ("out", ((1, 2), "ab", "length"))


def _gpu(**extras):
    from edge_core.devices import Device

    return Device(device_id="cuda:1", kind="gpu_discrete", vendor="nvidia", name="test card", backend="vllm:cuda",
                  runnable=True, memory_pool="vram", memory_bytes=8 << 30, evidence={"found": "D"},
                  extras=extras)


def test_a_cuda_stage_sees_only_the_card_it_was_planned_on():
    from edge_core.runtime.vllm_stage import pin_cuda_device

    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    pinned = pin_cuda_device(_gpu(uuid="GPU-1234abcd", nvml_index=1), env)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-1234abcd"
    assert pinned["previous"]["CUDA_VISIBLE_DEVICES"] == "0,1" and pinned["device_id"] == "cuda:1"
    env = {}
    pin_cuda_device(_gpu(nvml_index=3), env)
    assert env == {"CUDA_VISIBLE_DEVICES": "3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    env = {"CUDA_VISIBLE_DEVICES": "2"}
    assert "neither" in pin_cuda_device(_gpu(), env)["note"] and env == {"CUDA_VISIBLE_DEVICES": "2"}


def test_a_cpu_stage_changes_no_gpu_visibility():
    from edge_core.devices import Device
    from edge_core.runtime.vllm_stage import pin_cuda_device

    cpu = Device(device_id="cpu", kind="cpu", vendor="amd", name="EPYC", backend="vllm:cpu", runnable=True,
                 memory_pool="host_ram", memory_bytes=0, evidence={"found": "D"})
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    assert pin_cuda_device(cpu, env) is None and env == {"CUDA_VISIBLE_DEVICES": "0"}


def test_spawned_helper_lands_in_its_own_process_group():
    # What keeps a terminal's Ctrl-C away from vLLM's engine processes: multiprocessing's
    # spawn, while a stage starts, puts the child in a process group of its own.
    import multiprocessing
    import os

    from edge_core.runtime.processes import OwnProcessGroup

    context = multiprocessing.get_context("spawn")
    with OwnProcessGroup():
        child = context.Process(target=time.sleep, args=(5,))
        child.start()
    try:
        assert os.getpgid(child.pid) == child.pid != os.getpgid(0)
    finally:
        child.terminate()
        child.join(10)
    plain = context.Process(target=time.sleep, args=(0,))
    plain.start()
    try:
        assert os.getpgid(plain.pid) == os.getpgid(0), "outside a start, spawning is untouched"
    finally:
        plain.join(10)
