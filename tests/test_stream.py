"""Tests for edge_core.stream: delta events, the bounded stream, its epoch fence, and cancel order.

No test measures time: ordering is proven with recorded call order and with
``BoundedStream.wait_for`` on the stream's own counters; timeouts are hang
guards only.
"""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from edge_core.errors import StageError
from edge_core.runtime.stream_queue import BoundedStream, SequenceChecker
from edge_core.runtime.stream_run import StreamRun
from edge_core.stream import CANCEL_MEMORY_NOTE, DeltaEvent, StageRequest, StateHandle, new_request_id

#: Hang guard for every blocking wait in this file; never reached when the code is right.
HANG_GUARD_S = 30.0


def ev(seq: int, epoch: int = 0, *, text: str = "", tokens=(), final: bool = False, rid: str = "r") -> DeltaEvent:
    return DeltaEvent(rid, epoch, seq, tuple(tokens), text, "length" if final else None)


def sized(seq: int, size: int, epoch: int = 0) -> DeltaEvent:
    """An event whose size_bytes is exactly ``size`` (ASCII text)."""
    return DeltaEvent("r", epoch, seq, (), "x" * size)


# -- data types ----------------------------------------------------------------


class FakeArray:
    """Stands in for a numpy array: has nbytes, shape and dtype."""

    nbytes = 4096
    shape = (1, 1024)
    dtype = "float32"


def test_delta_event_size_counts_text_tokens_and_tensors():
    event = DeltaEvent("r", 0, 0, [1, 2, 3], "hé", tensors={"a": b"12345", "b": memoryview(b"xy"), "c": FakeArray()})
    assert event.token_ids == (1, 2, 3)  # a list is stored as a tuple
    assert event.size_bytes == len("hé".encode()) + 8 * 3 + 5 + 2 + 4096
    data = event.to_dict()
    json.dumps(data)  # JSON-safe: tensors are described, not dumped
    assert data["tensors"]["c"] == {"nbytes": 4096, "shape": [1, 1024], "dtype": "float32"}
    assert data["size_bytes"] == event.size_bytes


def test_delta_event_rejects_bad_fields():
    with pytest.raises(ValueError, match="seq"):
        DeltaEvent("r", 0, -1)
    with pytest.raises(ValueError, match="finish_reason"):
        DeltaEvent("r", 0, 0, finish_reason="done-ish")
    with pytest.raises(TypeError, match="nbytes"):
        DeltaEvent("r", 0, 0, tensors={"x": object()}).size_bytes  # noqa: B018


def test_stage_request_validates_and_serialises():
    assert new_request_id() != new_request_id()
    req = StageRequest(prompt_token_ids=[1, 2], max_tokens=8, ignore_eos=True)
    assert req.prompt_token_ids == (1, 2)
    assert json.loads(json.dumps(req.to_dict()))["prompt_token_ids"] == [1, 2]
    graph = StageRequest(inputs={"input_ids": FakeArray()}, max_tokens=1)
    assert graph.to_dict()["inputs"]["input_ids"]["nbytes"] == 4096
    with pytest.raises(ValueError, match="prompt, prompt_token_ids, messages or inputs"):
        StageRequest(max_tokens=4)
    with pytest.raises(ValueError, match="not prompt and prompt_token_ids"):
        StageRequest(prompt="a", prompt_token_ids=(1,))
    chat = StageRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.messages == ({"role": "user", "content": "hi"},)
    assert json.loads(json.dumps(chat.to_dict()))["messages"] == [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="not prompt and messages"):
        StageRequest(prompt="a", messages=({"role": "user", "content": "hi"},))
    with pytest.raises(ValueError, match="each message is"):
        StageRequest(messages=({"role": "user"},))
    with pytest.raises(ValueError, match="messages is empty"):
        StageRequest(messages=())
    with pytest.raises(ValueError, match="max_tokens"):
        StageRequest(prompt="a", max_tokens=0)


def test_state_handle_is_tied_to_backend_and_artifact():
    handle = StateHandle("vllm:cuda", "cuda:0", "art-1", "kv-7")
    handle.check_compatible("vllm:cuda", "art-1")  # same owner: fine
    with pytest.raises(StageError, match="never migratable between backends") as info:
        handle.check_compatible("vllm:cpu", "art-1")
    assert "vllm:cuda" in str(info.value) and "cuda:0" in str(info.value)
    with pytest.raises(StageError, match="art-1.*art-2"):
        handle.check_compatible("vllm:cuda", "art-2")
    assert handle.to_dict()["ref"] == "kv-7"


# -- bounded stream ------------------------------------------------------------


def test_backpressure_blocks_producer_and_bounds_hold():
    stream = BoundedStream(max_events=4, max_bytes=350)
    total = 40
    sent = [sized(i, 100) for i in range(total)]

    def produce():
        for event in sent:
            assert stream.put(event)
        stream.close()

    producer = threading.Thread(target=produce)
    producer.start()
    received = []
    while True:
        # Slow consumer: read only once the producer is observed blocked on a full stream.
        if not stream.closed:
            # (A producer counts as waiting until it wakes, so "waiting" alone may be stale
            # right after a get; waiting on a full queue is not.)
            assert stream.wait_for(
                lambda s: s.closed or (s.producers_waiting == 1 and s.queued_bytes + 100 > 350), HANG_GUARD_S
            )
            stats = stream.stats()
            if not stats.closed:
                # Blocked with 3 x 100 bytes queued: the byte bound (350) binds before the event bound (4).
                assert stats.queued_events == 3 and stats.queued_bytes == 300
        event = stream.get(timeout=HANG_GUARD_S)
        if event is None:
            break
        received.append(event)
    producer.join(HANG_GUARD_S)
    stats = stream.stats()
    assert received == sent  # FIFO, nothing lost
    assert stats.high_water_events <= 4 and stats.high_water_bytes <= 350
    assert stats.blocked_puts >= total - 3
    assert stats.oversize_passed == 0


def test_event_bound_blocks_producer():
    stream = BoundedStream(max_events=2, max_bytes=10_000)
    assert stream.put(ev(0)) and stream.put(ev(1))
    with pytest.raises(TimeoutError, match="consumer is not reading"):
        stream.put(ev(2), timeout=0)
    assert stream.get().seq == 0
    assert stream.put(ev(2), timeout=0)


def test_single_oversize_event_passes_on_empty_queue_only():
    stream = BoundedStream(max_events=8, max_bytes=10)
    big = sized(0, 100)
    assert stream.put(big, timeout=0)  # timeout=0: it must not have to wait at all
    with pytest.raises(TimeoutError):
        stream.put(sized(1, 1), timeout=0)  # anything behind it waits: the bytes are over
    assert stream.get() is big
    assert stream.put(sized(1, 1), timeout=0)
    with pytest.raises(TimeoutError):
        stream.put(sized(2, 100), timeout=0)  # oversize on a non-empty queue waits too
    stats = stream.stats()
    assert stats.oversize_passed == 1 and stats.high_water_bytes == 100
    assert stats.high_water_bytes_multi <= 10


def test_epoch_fence_discards_queued_and_later_events():
    stream = BoundedStream(max_events=16, max_bytes=10_000)
    for i in range(3):
        stream.put(ev(i, epoch=0))
    stream.put(ev(0, epoch=1))
    assert stream.retire(0) == 3
    assert stream.put(ev(3, epoch=0)) is False  # fenced, not queued
    assert stream.put(ev(1, epoch=1)) is True
    stream.close()
    got = []
    while (event := stream.get()) is not None:
        got.append(event)
    assert [e.epoch for e in got] == [1, 1]
    stats = stream.stats()
    assert stats.discarded_by_fence == 4 and stats.delivered_events == 2
    assert stats.retired_epochs == (0,)


def test_close_wakes_consumer_and_drops_later_puts():
    stream = BoundedStream()
    result = []
    consumer = threading.Thread(target=lambda: result.append(stream.get()))
    consumer.start()
    stream.close()
    consumer.join(HANG_GUARD_S)
    assert result == [None]
    assert stream.put(ev(0)) is False
    assert stream.stats().dropped_after_close == 1


def test_close_wakes_blocked_producer():
    stream = BoundedStream(max_events=1)
    stream.put(ev(0))
    result = []
    producer = threading.Thread(target=lambda: result.append(stream.put(ev(1))))
    producer.start()
    assert stream.wait_for(lambda s: s.producers_waiting == 1, HANG_GUARD_S)
    stream.close()
    producer.join(HANG_GUARD_S)
    assert result == [False]
    assert stream.get().seq == 0  # what was queued can still be drained
    assert stream.get() is None


def test_close_with_error_raises_after_drain():
    stream = BoundedStream()
    stream.put(ev(0))
    stream.close(StageError("backend died"))
    assert stream.get().seq == 0
    with pytest.raises(StageError, match="backend died"):
        stream.get()


def test_get_timeout_is_an_error_not_an_end():
    with pytest.raises(TimeoutError):
        BoundedStream().get(timeout=0)


# -- sequence checking ---------------------------------------------------------


def test_sequence_checker_names_loss_reorder_duplicate_and_after_final():
    checker = SequenceChecker()
    assert checker.check(ev(0)) is None
    gap = checker.check(ev(3))
    assert (gap.kind, gap.expected_seq, gap.got_seq) == ("missing", 1, 3)
    assert checker.unresolved() == {("r", 0): (1, 2)}
    assert checker.check(ev(1)).kind == "late"
    assert checker.check(ev(3)).kind == "duplicate"
    assert checker.unresolved() == {("r", 0): (2,)}  # seq 2 is lost
    assert checker.check(ev(4, final=True)) is None
    assert checker.check(ev(5)).kind == "after_final"
    assert checker.check(ev(0, epoch=1)) is None  # a new epoch counts from 0
    assert [g.kind for g in checker.gaps] == ["missing", "late", "duplicate", "after_final"]


# -- stream runs ---------------------------------------------------------------


def blocked_on_full(stats) -> bool:
    """A producer is blocked on a full queue (``producers_waiting`` alone can be stale after a get)."""
    return stats.producers_waiting == 1 and stats.queued_events == stats.max_events


class FakeBackend:
    """A backend whose stream yields one token per event until aborted or done.

    ``hang_on_unwind`` makes the generator block in its cleanup until
    ``release`` is set: a backend that hangs while unwinding.
    """

    def __init__(self, n_tokens: int = 1000, hang_on_unwind: bool = False):
        self.n_tokens = n_tokens
        self.hang_on_unwind = hang_on_unwind
        self.calls: list[str] = []
        self.aborted = threading.Event()
        self.release = threading.Event()
        self.abort_saw: dict[str, bool] = {}
        self.run: StreamRun | None = None

    def stream(self, request_id: str, epoch: int = 0):
        try:
            for seq in range(self.n_tokens):
                if self.aborted.is_set():
                    return
                last = seq == self.n_tokens - 1
                yield DeltaEvent(request_id, epoch, seq, (100 + seq,), f"t{seq} ", "length" if last else None)
        finally:
            self.calls.append("unwind_start")
            if self.hang_on_unwind:
                self.release.wait(HANG_GUARD_S)
            self.calls.append("unwind_end")

    def abort(self) -> bool:
        self.calls.append("abort")
        # What the stream looked like when the backend was asked to abort.
        self.abort_saw = {"retired": self.run.stream.is_retired(self.run.epoch), "closed": self.run.stream.closed}
        self.aborted.set()
        return True

    def start(self, **kwargs) -> StreamRun:
        self.run = StreamRun(self.stream("r"), self.abort, request_id="r", **kwargs)
        return self.run


def test_run_streams_to_the_final_event_and_closes():
    backend = FakeBackend(n_tokens=10)
    run = backend.start(max_events=3)
    events = run.collect(idle_timeout_s=HANG_GUARD_S)
    assert [e.seq for e in events] == list(range(10))
    assert [t for e in events for t in e.token_ids] == list(range(100, 110))
    assert events[-1].finish_reason == "length"
    assert run.join(HANG_GUARD_S)
    assert run.stream.closed and run.checker.gaps == []
    assert backend.calls == ["unwind_start", "unwind_end"]  # the iterator was closed
    report = run.cancel()  # after completion: nothing in flight, still a report
    assert report.was_in_flight is False and report.discarded_by_fence == 0


def test_run_cancel_order_and_fence_count():
    backend = FakeBackend()
    run = backend.start(max_events=4, max_bytes=1 << 20, join_timeout_s=HANG_GUARD_S)
    it = run.events(idle_timeout_s=HANG_GUARD_S)
    delivered = [next(it) for _ in range(3)]
    # The producer has refilled the queue (4 events) and is blocked with a fifth.
    assert run.stream.wait_for(blocked_on_full, HANG_GUARD_S)
    report = run.cancel()
    assert list(it) == []  # zero events of the retired epoch reach the consumer
    assert report.steps == ("retire", "abort", "close", "join")
    assert backend.abort_saw == {"retired": True, "closed": False}
    assert report.producer_joined and report.abort_returned is True and report.was_in_flight
    assert report.events_delivered == len(delivered) == 3
    assert report.discarded_by_fence == 4 + 1  # the queued four plus the blocked fifth
    assert report.note == CANCEL_MEMORY_NOTE
    json.dumps(report.to_dict())
    assert run.cancel() is report  # idempotent
    assert backend.calls.count("abort") == 1


def test_cancel_does_not_wait_for_a_backend_hanging_while_unwinding():
    backend = FakeBackend(hang_on_unwind=True)
    run = backend.start(max_events=2, join_timeout_s=0.05)
    it = run.events(idle_timeout_s=HANG_GUARD_S)
    next(it)
    assert run.stream.wait_for(blocked_on_full, HANG_GUARD_S)
    report = run.cancel()
    # cancel returned while the producer thread is still stuck in the backend's cleanup.
    assert run.producer_alive
    assert report.producer_joined is False
    assert report.steps == ("retire", "abort", "close", "join")
    assert backend.abort_saw == {"retired": True, "closed": False}
    assert list(it) == []
    backend.release.set()
    assert run.join(HANG_GUARD_S)
    # The backend unwound only after it had been told to abort.
    assert backend.calls == ["abort", "unwind_start", "unwind_end"]
    assert run.stream.stats().discarded_by_fence == 2 + 1


def test_cancel_from_another_thread_ends_a_blocked_consumer():
    stall = threading.Event()

    def stalls():
        yield ev(0)
        stall.wait(HANG_GUARD_S)  # the engine produces nothing until aborted

    run = StreamRun(stalls(), stall.set, request_id="r", join_timeout_s=HANG_GUARD_S)
    it = run.events()
    assert next(it).seq == 0
    canceller = threading.Thread(target=run.cancel)
    assert run.stream.wait_for(lambda s: s.delivered_events == 1, HANG_GUARD_S)
    canceller.start()
    assert list(it) == []  # the blocked get() is released by the close
    canceller.join(HANG_GUARD_S)
    assert run.cancel_report.producer_joined


def test_producer_exception_reaches_consumer_as_stage_error():
    def broken():
        yield ev(0)
        raise RuntimeError("CUDA error: illegal memory access")

    run = StreamRun(broken(), lambda: False, request_id="r", label="vllm:cuda cuda:0")
    it = run.events(idle_timeout_s=HANG_GUARD_S)
    assert next(it).seq == 0
    with pytest.raises(StageError, match="vllm:cuda cuda:0.*illegal memory access") as info:
        next(it)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_iterator_ending_without_final_event_is_an_error():
    run = StreamRun(iter([ev(0), ev(1)]), lambda: False, request_id="r")
    with pytest.raises(StageError, match="without a final event"):
        run.collect(idle_timeout_s=HANG_GUARD_S)


def test_lost_event_is_detected_and_cancels_the_request():
    aborted = []
    run = StreamRun(iter([ev(0), ev(2), ev(3, final=True)]), lambda: aborted.append(1), request_id="r")
    with pytest.raises(StageError, match="missing event, expected seq 1, got 2"):
        run.collect(idle_timeout_s=HANG_GUARD_S)
    assert aborted == [1] and run.cancel_report is not None
    assert [g.kind for g in run.checker.gaps] == ["missing"]


def test_abort_failure_is_reported_and_cleanup_still_happens():
    def boom():
        raise RuntimeError("engine already gone")

    run = StreamRun(iter([ev(0, final=True)]), boom, request_id="r")
    report = run.cancel()  # before start: the producer never starts
    assert report.abort_error == "RuntimeError: engine already gone"
    assert report.steps == ("retire", "abort", "close", "join") and report.producer_joined
    assert run.collect() == [] and not run.producer_alive


# -- random interleavings ------------------------------------------------------


class StreamMachine(RuleBasedStateMachine):
    """Random put/get/retire/close against a model FIFO (single thread, non-blocking puts)."""

    MAX_EVENTS = 4
    MAX_BYTES = 64

    def __init__(self):
        super().__init__()
        self.stream = BoundedStream(self.MAX_EVENTS, self.MAX_BYTES)
        self.model: list[DeltaEvent] = []
        self.retired: set[int] = set()
        self.closed = False
        self.fenced = 0
        self.seq = 0

    @rule(epoch=st.integers(0, 3), size=st.integers(0, 100))
    def put(self, epoch, size):
        event = sized(self.seq, size, epoch)
        self.seq += 1
        model_bytes = sum(e.size_bytes for e in self.model)
        room = not self.model or (len(self.model) < self.MAX_EVENTS and model_bytes + size <= self.MAX_BYTES)
        if epoch in self.retired:
            assert self.stream.put(event, timeout=0) is False
            self.fenced += 1
        elif self.closed:
            assert self.stream.put(event, timeout=0) is False
        elif room:
            assert self.stream.put(event, timeout=0) is True
            self.model.append(event)
        else:
            with pytest.raises(TimeoutError):
                self.stream.put(event, timeout=0)

    @precondition(lambda self: self.model or self.closed)
    @rule()
    def get(self):
        got = self.stream.get(timeout=0)
        if self.model:
            assert got is self.model.pop(0)
            assert got.epoch not in self.retired
        else:
            assert got is None

    @rule(epoch=st.integers(0, 3))
    def retire(self, epoch):
        before = len(self.model)
        self.model = [e for e in self.model if e.epoch != epoch]
        self.fenced += before - len(self.model)
        self.retired.add(epoch)
        assert self.stream.retire(epoch) == before - len(self.model)

    @rule()
    def close(self):
        self.closed = True
        self.stream.close()

    @invariant()
    def bounds_hold(self):
        stats = self.stream.stats()
        assert stats.queued_events == len(self.model) <= self.MAX_EVENTS
        assert stats.queued_bytes == sum(e.size_bytes for e in self.model)
        # The byte bound holds except for one oversize event alone in the queue.
        assert stats.queued_bytes <= self.MAX_BYTES or stats.queued_events == 1
        assert stats.high_water_bytes_multi <= self.MAX_BYTES
        assert stats.high_water_events <= self.MAX_EVENTS
        assert stats.discarded_by_fence == self.fenced


TestStreamMachine = StreamMachine.TestCase
TestStreamMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
