"""How a running stage hands its output to the caller, and how a request is stopped.

The contracts of a stage's output, independent of any engine so every backend
uses the same ones:

* :class:`DeltaEvent` — only what is new since the previous event, a sequence
  number that exposes loss, and an epoch that can be retired;
* :class:`StateHandle` — an opaque reference to backend-owned state (the KV
  cache), tied to the artifact that produced it and never usable from another
  backend;
* :class:`BoundedStream` — a queue bounded in events *and* bytes whose full
  state blocks the producer (backpressure), with an epoch fence;
* :class:`SequenceChecker` — the consumer-side check that no event was lost,
  duplicated or reordered;
* :class:`StreamRun` — one request driven end to end: a producer thread pumps
  the backend's iterator into a bounded stream, the caller iterates, and
  :meth:`StreamRun.cancel` stops it in the order fence, abort, close, join.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .errors import StageError

#: Default bounds of a request's stream. 64 events and 1 MiB hold several
#: seconds of token deltas (a few dozen bytes each) while keeping a stalled
#: consumer from letting a producer run ahead by more than that (estimate, E).
DEFAULT_MAX_EVENTS = 64
DEFAULT_MAX_BYTES = 1 << 20

#: How long cancel waits for the producer thread before returning without it.
#: The join only shortens cleanup when the backend unwinds quickly; a backend
#: that hangs while unwinding must not hold the caller (SPEC section 8).
DEFAULT_JOIN_TIMEOUT_S = 2.0

#: Bytes charged per token id by :attr:`DeltaEvent.size_bytes` (an int64 id).
TOKEN_ID_BYTES = 8

FINISH_REASONS = ("stop", "length", "abort", "error")


def new_request_id() -> str:
    """Return a fresh request id, unique within and across processes."""
    return f"req-{uuid.uuid4().hex[:16]}"


def _payload_nbytes(value: Any) -> int:
    """Bytes held by one tensor payload: numpy/torch arrays, bytes, memoryviews."""
    if value is None:
        return 0
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    try:
        return memoryview(value).nbytes
    except TypeError:
        raise TypeError(
            f"tensor payload of type {type(value).__name__} has neither .nbytes nor the "
            "buffer protocol; pass a numpy array, bytes or a memoryview"
        ) from None


def _describe_payload(value: Any) -> dict[str, Any]:
    """JSON-safe description of a tensor payload (never the data itself)."""
    out: dict[str, Any] = {"nbytes": _payload_nbytes(value)}
    shape = getattr(value, "shape", None)
    if shape is not None:
        out["shape"] = [int(d) for d in shape]
    dtype = getattr(value, "dtype", None)
    if dtype is not None:
        out["dtype"] = str(dtype)
    return out


@dataclass(frozen=True)
class DeltaEvent:
    """What a stage produced since its previous event for one request.

    ``token_ids`` and ``text`` carry only the new tokens and the new text, never
    the running total. ``seq`` counts events of one (request, epoch) from 0, so
    a consumer sees a hole as a jump. ``epoch`` names the attempt: once retired,
    no event of it reaches the consumer. ``finish_reason`` is None until the
    last event. ``tensors`` is for stages whose output is not tokens (an ONNX
    graph stage returns named arrays): name -> array-like or bytes-like.
    """

    request_id: str
    epoch: int
    seq: int
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finish_reason: str | None = None
    tensors: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, tuple):
            object.__setattr__(self, "token_ids", tuple(self.token_ids))
        problems = []
        if not isinstance(self.epoch, int) or self.epoch < 0:
            problems.append(f"epoch must be a non-negative int, got {self.epoch!r}")
        if not isinstance(self.seq, int) or self.seq < 0:
            problems.append(f"seq must be a non-negative int, got {self.seq!r}")
        if self.finish_reason is not None and self.finish_reason not in FINISH_REASONS:
            problems.append(f"finish_reason {self.finish_reason!r} is not one of {', '.join(FINISH_REASONS)}")
        if problems:
            raise ValueError(f"invalid delta event for request {self.request_id!r}: " + "; ".join(problems))

    @property
    def size_bytes(self) -> int:
        """Approximate payload bytes, the unit of :class:`BoundedStream`'s byte bound."""
        size = len(self.text.encode("utf-8")) + TOKEN_ID_BYTES * len(self.token_ids)
        if self.tensors:
            size += sum(_payload_nbytes(v) for v in self.tensors.values())
        return size

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "epoch": self.epoch,
            "seq": self.seq,
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "tensors": (
                None if self.tensors is None
                else {name: _describe_payload(v) for name, v in self.tensors.items()}
            ),
            "size_bytes": self.size_bytes,
        }


@dataclass(frozen=True, kw_only=True)
class StageRequest:
    """One request to a started stage.

    A text stage takes ``prompt`` or ``prompt_token_ids``; a graph stage takes
    ``inputs`` (name -> array-like). ``epoch`` is stamped by the backend on every
    event it yields for this request; a retry of the same request id uses a new
    epoch so events of the abandoned attempt can be fenced off.
    """

    request_id: str = field(default_factory=new_request_id)
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    max_tokens: int = 16
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None
    inputs: Mapping[str, Any] | None = None
    epoch: int = 0

    def __post_init__(self) -> None:
        if self.prompt_token_ids is not None and not isinstance(self.prompt_token_ids, tuple):
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        problems = []
        if self.prompt is None and self.prompt_token_ids is None and self.inputs is None:
            problems.append("give prompt, prompt_token_ids or inputs")
        if self.prompt is not None and self.prompt_token_ids is not None:
            problems.append("give prompt or prompt_token_ids, not both")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            problems.append(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.epoch, int) or self.epoch < 0:
            problems.append(f"epoch must be a non-negative int, got {self.epoch!r}")
        if problems:
            raise ValueError(f"invalid stage request {self.request_id!r}: " + "; ".join(problems))

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": None if self.prompt_token_ids is None else list(self.prompt_token_ids),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "ignore_eos": self.ignore_eos,
            "seed": self.seed,
            "inputs": (
                None if self.inputs is None
                else {name: _describe_payload(v) for name, v in self.inputs.items()}
            ),
            "epoch": self.epoch,
        }


@dataclass(frozen=True)
class StateHandle:
    """Opaque reference to state a backend owns (a stage's KV cache).

    ``ref`` means something only to the backend that issued it; the handle is
    tied to the artifact that produced the state and is never migratable
    between backends.
    """

    backend: str
    device_id: str
    artifact_id: str
    ref: str

    def check_compatible(self, backend: str, artifact_id: str) -> None:
        """Raise :class:`StageError` unless ``backend`` and ``artifact_id`` own this state."""
        if backend != self.backend:
            raise StageError(
                f"state {self.ref!r} belongs to backend {self.backend!r} on {self.device_id}, "
                f"not {backend!r}: backend state is never migratable between backends; "
                f"re-run the prompt on {backend!r} to rebuild it there"
            )
        if artifact_id != self.artifact_id:
            raise StageError(
                f"state {self.ref!r} on {self.device_id} was produced by artifact "
                f"{self.artifact_id!r}, not {artifact_id!r}: a KV cache is only valid for "
                "the weights that computed it; re-run the prompt with this artifact"
            )

    def to_dict(self) -> dict[str, str]:
        return {
            "backend": self.backend,
            "device_id": self.device_id,
            "artifact_id": self.artifact_id,
            "ref": self.ref,
        }


@dataclass(frozen=True)
class StreamStats:
    """A snapshot of a :class:`BoundedStream`'s counters.

    The high-water marks are the most events and bytes ever queued at once;
    ``high_water_bytes`` may exceed ``max_bytes`` only through
    ``oversize_passed`` (one event larger than the bound, let in on an empty
    queue).
    """

    max_events: int
    max_bytes: int
    queued_events: int
    queued_bytes: int
    high_water_events: int
    high_water_bytes: int
    #: Largest byte total ever queued while more than one event was queued.
    high_water_bytes_multi: int
    accepted_events: int
    delivered_events: int
    discarded_by_fence: int
    dropped_after_close: int
    blocked_puts: int
    producers_waiting: int
    oversize_passed: int
    closed: bool
    retired_epochs: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_events": self.max_events,
            "max_bytes": self.max_bytes,
            "queued_events": self.queued_events,
            "queued_bytes": self.queued_bytes,
            "high_water_events": self.high_water_events,
            "high_water_bytes": self.high_water_bytes,
            "high_water_bytes_multi": self.high_water_bytes_multi,
            "accepted_events": self.accepted_events,
            "delivered_events": self.delivered_events,
            "discarded_by_fence": self.discarded_by_fence,
            "dropped_after_close": self.dropped_after_close,
            "blocked_puts": self.blocked_puts,
            "producers_waiting": self.producers_waiting,
            "oversize_passed": self.oversize_passed,
            "closed": self.closed,
            "retired_epochs": list(self.retired_epochs),
        }


class BoundedStream:
    """A FIFO of :class:`DeltaEvent` bounded in events and in bytes, with an epoch fence.

    * ``put`` blocks while the queue is full — the backpressure that keeps a
      fast engine from buffering without limit behind a slow consumer. An event
      larger than ``max_bytes`` is let in when the queue is empty, or it could
      never pass.
    * ``get`` returns the next event, or None once the stream is closed and
      drained; if the stream was closed with an error, that error is raised
      instead of None.
    * ``retire(epoch)`` drops queued events of that epoch and every later one
      offered by ``put`` or met by ``get``; each is counted in
      ``discarded_by_fence``. ``get`` is the delivery point: an event it has
      returned was delivered, a retire after that cannot take it back.
    * ``close`` wakes every waiting producer and consumer; later puts are
      dropped and counted. Events already queued can still be drained.
    """

    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS, max_bytes: int = DEFAULT_MAX_BYTES):
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_events = max_events
        self.max_bytes = max_bytes
        self._cond = threading.Condition(threading.Lock())
        # (event, size_bytes): the size is computed once, outside the lock.
        self._queue: collections.deque[tuple[DeltaEvent, int]] = collections.deque()
        self._bytes = 0
        self._retired: set[int] = set()
        self._closed = False
        self._error: BaseException | None = None
        self._hw_events = 0
        self._hw_bytes = 0
        self._hw_bytes_multi = 0
        self._accepted = 0
        self._delivered = 0
        self._fenced = 0
        self._dropped = 0
        self._blocked_puts = 0
        self._waiting = 0
        self._oversize = 0

    # -- producer side -------------------------------------------------------

    def _has_room(self, size: int) -> bool:
        if not self._queue:
            return True  # the single-oversize rule: an empty queue takes anything
        return len(self._queue) < self.max_events and self._bytes + size <= self.max_bytes

    def put(self, event: DeltaEvent, timeout: float | None = None) -> bool:
        """Queue ``event``, blocking while the stream is full.

        Returns True when queued, False when it was discarded by the epoch fence
        or dropped because the stream is closed (the producer should stop).
        Raises :class:`TimeoutError` if ``timeout`` seconds pass with no room.
        """
        size = event.size_bytes
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            blocked = False
            while True:
                # The fence is checked before "closed" so a cancelled request's
                # late events are counted as fenced, the number cancel reports.
                if event.epoch in self._retired:
                    self._fenced += 1
                    return False
                if self._closed:
                    self._dropped += 1
                    return False
                if self._has_room(size):
                    break
                if not blocked:
                    blocked = True
                    self._blocked_puts += 1
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"stream full ({len(self._queue)} events, {self._bytes} bytes) "
                        f"for {timeout} s: the consumer is not reading"
                    )
                self._waiting += 1
                self._cond.notify_all()  # lets wait_for() observe a blocked producer
                try:
                    self._cond.wait(remaining)
                finally:
                    self._waiting -= 1
            if not self._queue and size > self.max_bytes:
                self._oversize += 1
            self._queue.append((event, size))
            self._bytes += size
            self._accepted += 1
            self._hw_events = max(self._hw_events, len(self._queue))
            self._hw_bytes = max(self._hw_bytes, self._bytes)
            if len(self._queue) > 1:
                self._hw_bytes_multi = max(self._hw_bytes_multi, self._bytes)
            self._cond.notify_all()
            return True

    # -- consumer side -------------------------------------------------------

    def get(self, timeout: float | None = None) -> DeltaEvent | None:
        """Return the next event, or None when the stream is closed and drained.

        Raises the error the stream was closed with, once drained, and
        :class:`TimeoutError` if ``timeout`` seconds pass with nothing to return.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                while self._queue:
                    event, size = self._queue.popleft()
                    self._bytes -= size
                    self._cond.notify_all()  # room for a blocked producer
                    if event.epoch in self._retired:
                        self._fenced += 1
                        continue
                    self._delivered += 1
                    return event
                if self._closed:
                    if self._error is not None:
                        raise self._error
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no event within {timeout} s")
                self._cond.wait(remaining)

    # -- control ---------------------------------------------------------------

    def retire(self, epoch: int) -> int:
        """Fence off ``epoch``: drop its queued events and every later one.

        Returns how many queued events were dropped now.
        """
        with self._cond:
            self._retired.add(epoch)
            kept = collections.deque(item for item in self._queue if item[0].epoch != epoch)
            dropped = len(self._queue) - len(kept)
            if dropped:
                self._queue = kept
                self._bytes = sum(size for _, size in kept)
                self._fenced += dropped
            self._cond.notify_all()
            return dropped

    def is_retired(self, epoch: int) -> bool:
        with self._cond:
            return epoch in self._retired

    def close(self, error: BaseException | None = None) -> None:
        """Close the stream; ``error`` (first one wins) is raised to the consumer once drained."""
        with self._cond:
            if not self._closed:
                self._closed = True
                self._error = error
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def stats(self) -> StreamStats:
        with self._cond:
            return self._stats_locked()

    def _stats_locked(self) -> StreamStats:
        return StreamStats(
            max_events=self.max_events,
            max_bytes=self.max_bytes,
            queued_events=len(self._queue),
            queued_bytes=self._bytes,
            high_water_events=self._hw_events,
            high_water_bytes=self._hw_bytes,
            high_water_bytes_multi=self._hw_bytes_multi,
            accepted_events=self._accepted,
            delivered_events=self._delivered,
            discarded_by_fence=self._fenced,
            dropped_after_close=self._dropped,
            blocked_puts=self._blocked_puts,
            producers_waiting=self._waiting,
            oversize_passed=self._oversize,
            closed=self._closed,
            retired_epochs=tuple(sorted(self._retired)),
        )

    def wait_for(self, predicate: Callable[[StreamStats], bool], timeout: float | None = None) -> bool:
        """Block until ``predicate(stats)`` holds; return False if ``timeout`` passed first.

        Lets a caller (or a test) wait for a state — "a producer is blocked",
        "N events delivered" — without polling or sleeping.
        """
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self._stats_locked()), timeout)


@dataclass(frozen=True)
class SeqGap:
    """One sequence anomaly seen by the consumer.

    ``kind`` is ``missing`` (seq jumped from ``expected_seq`` to ``got_seq``:
    the events between were not seen, yet), ``late`` (an event that was missing
    arrived after a later one: reordered), ``duplicate`` (a seq already
    delivered) or ``after_final`` (an event after the one with a finish reason).
    """

    request_id: str
    epoch: int
    expected_seq: int
    got_seq: int
    kind: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "epoch": self.epoch,
            "expected_seq": self.expected_seq,
            "got_seq": self.got_seq,
            "kind": self.kind,
        }

    def describe(self) -> str:
        return (
            f"request {self.request_id} epoch {self.epoch}: {self.kind} event, "
            f"expected seq {self.expected_seq}, got {self.got_seq}"
        )


class SequenceChecker:
    """Consumer-side check of ``seq`` per (request, epoch).

    It records every anomaly in :attr:`gaps` rather than raising, so one
    checker can serve a report that counts them; :class:`StreamRun` raises on
    the first one because a token stream with a hole is a wrong answer.
    """

    def __init__(self) -> None:
        self.gaps: list[SeqGap] = []
        self._next: dict[tuple[str, int], int] = {}
        self._missing: dict[tuple[str, int], set[int]] = {}
        self._finished: set[tuple[str, int]] = set()

    def check(self, event: DeltaEvent) -> SeqGap | None:
        """Record ``event``; return the anomaly it shows, or None when it is in order."""
        key = (event.request_id, event.epoch)
        expected = self._next.get(key, 0)
        missing = self._missing.setdefault(key, set())
        gap = None
        if key in self._finished:
            gap = SeqGap(event.request_id, event.epoch, expected, event.seq, "after_final")
        elif event.seq == expected:
            self._next[key] = expected + 1
        elif event.seq > expected:
            missing.update(range(expected, event.seq))
            self._next[key] = event.seq + 1
            gap = SeqGap(event.request_id, event.epoch, expected, event.seq, "missing")
        elif event.seq in missing:
            missing.discard(event.seq)
            gap = SeqGap(event.request_id, event.epoch, expected, event.seq, "late")
        else:
            gap = SeqGap(event.request_id, event.epoch, expected, event.seq, "duplicate")
        if event.final:
            self._finished.add(key)
        if gap is not None:
            self.gaps.append(gap)
        return gap

    def unresolved(self) -> dict[tuple[str, int], tuple[int, ...]]:
        """Seqs still missing per (request, epoch): lost, unless they arrive later."""
        return {key: tuple(sorted(s)) for key, s in self._missing.items() if s}


#: What a cancel report says about memory, because it is the first thing people misread.
CANCEL_MEMORY_NOTE = (
    "cancel frees the request's in-flight work, not device memory: an engine that "
    "pre-allocates its KV pool (vLLM does) keeps it, so the device counter does not drop; "
    "what drops is the in-flight count"
)


@dataclass(frozen=True)
class CancelReport:
    """What :meth:`StreamRun.cancel` did, in the order it did it.

    ``steps`` lists the steps taken (``retire``, ``abort``, ``close``,
    ``join``); ``discarded_by_fence`` and ``events_delivered`` are counted when
    cancel returned. ``producer_joined`` is False when the backend was still
    unwinding after ``join_timeout_s``: the caller was not held, cleanup goes
    on in the background.
    """

    request_id: str
    epoch: int
    was_in_flight: bool
    steps: tuple[str, ...]
    discarded_by_fence: int
    events_delivered: int
    abort_returned: Any
    abort_error: str | None
    producer_joined: bool
    join_timeout_s: float
    cancel_to_closed_s: float
    cancel_to_return_s: float
    note: str = CANCEL_MEMORY_NOTE

    def to_dict(self) -> dict[str, Any]:
        abort_returned = self.abort_returned
        if not isinstance(abort_returned, (bool, int, float, str, type(None))):
            abort_returned = repr(abort_returned)
        return {
            "request_id": self.request_id,
            "epoch": self.epoch,
            "was_in_flight": self.was_in_flight,
            "steps": list(self.steps),
            "discarded_by_fence": self.discarded_by_fence,
            "events_delivered": self.events_delivered,
            "abort_returned": abort_returned,
            "abort_error": self.abort_error,
            "producer_joined": self.producer_joined,
            "join_timeout_s": self.join_timeout_s,
            "cancel_to_closed_s": self.cancel_to_closed_s,
            "cancel_to_return_s": self.cancel_to_return_s,
            "note": self.note,
        }


_run_counter = itertools.count()


class StreamRun:
    """Drive one request: pump the backend's iterator into a bounded stream, let the caller iterate.

    ``events`` is what the backend's ``stream`` hook returned; ``abort`` is a
    zero-argument callable that aborts the request in the backend (the
    ``cancel`` hook bound to the stage and request id). The producer thread
    starts on :meth:`start` (or the first iteration).

    Iterating yields events in order and stops after the final one. An
    exception raised by the backend's iterator reaches the consumer as a
    :class:`StageError` (chained to the original); so does a sequence anomaly
    (after cancelling the request) and an iterator that ends without a final
    event. After :meth:`cancel`, iteration ends quietly.
    """

    def __init__(
        self,
        events: Iterable[DeltaEvent],
        abort: Callable[[], Any],
        *,
        request_id: str,
        epoch: int = 0,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
        label: str = "backend",
    ):
        self.request_id = request_id
        self.epoch = epoch
        self.label = label
        self.join_timeout_s = join_timeout_s
        self.stream = BoundedStream(max_events=max_events, max_bytes=max_bytes)
        self.checker = SequenceChecker()
        self._events = events
        self._abort = abort
        self._lock = threading.Lock()
        self._cancel_lock = threading.Lock()
        self._cancel_report: CancelReport | None = None
        self._cancelling = threading.Event()
        self._finished = threading.Event()  # the final event was queued
        self._thread = threading.Thread(
            target=self._pump, name=f"edge-stream-{request_id}-{next(_run_counter)}", daemon=True
        )
        self._started = False

    # -- producer --------------------------------------------------------------

    def start(self) -> StreamRun:
        with self._lock:
            # A run cancelled before it started never starts its producer.
            if not self._started and not self._cancelling.is_set():
                self._started = True
                self._thread.start()
        return self

    def _stage_error(self, what: str) -> StageError:
        return StageError(f"{self.label}: request {self.request_id} (epoch {self.epoch}) {what}")

    def _pump(self) -> None:
        iterator: Iterator[DeltaEvent] | None = None
        error: BaseException | None = None
        try:
            iterator = iter(self._events)
            for event in iterator:
                if not self.stream.put(event):
                    if self._cancelling.is_set():
                        # cancel() owns the order: its abort must reach the
                        # backend before this thread unwinds the iterator, so
                        # wait for the close that follows the abort.
                        self.stream.wait_for(lambda stats: stats.closed)
                    break
                if event.final:
                    self._finished.set()
                    break
            else:
                if not self._cancelling.is_set():
                    error = self._stage_error(
                        "ended without a final event; the backend must set finish_reason on its last event"
                    )
        except Exception as exc:  # noqa: BLE001 — every backend failure must reach the consumer
            if not self._cancelling.is_set():
                error = self._stage_error(f"failed in the backend stream: {type(exc).__name__}: {exc}")
                error.__cause__ = exc
        # Release the consumer before unwinding the backend's iterator: closing a
        # generator runs its cleanup, which may be slow or hang.
        self.stream.close(error)
        close = getattr(iterator, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 — the request is over; an unwinding error changes nothing
                pass

    # -- consumer --------------------------------------------------------------

    def __iter__(self) -> Iterator[DeltaEvent]:
        return self.events()

    def events(self, idle_timeout_s: float | None = None) -> Iterator[DeltaEvent]:
        """Yield events until the final one; ``idle_timeout_s`` bounds the wait for each."""
        self.start()
        while True:
            try:
                event = self.stream.get(timeout=idle_timeout_s)
            except TimeoutError:
                raise self._stage_error(f"produced nothing for {idle_timeout_s} s") from None
            if event is None:
                return
            gap = self.checker.check(event)
            if gap is None and event.request_id != self.request_id:
                gap = SeqGap(event.request_id, event.epoch, -1, event.seq, "foreign_request")
                self.checker.gaps.append(gap)
            if gap is not None:
                self.cancel()
                raise self._stage_error(f"stream broke its sequence: {gap.describe()}")
            yield event
            if event.final:
                return

    def collect(self, idle_timeout_s: float | None = None) -> list[DeltaEvent]:
        """Iterate to the end and return every event."""
        return list(self.events(idle_timeout_s))

    # -- cancel ----------------------------------------------------------------

    @property
    def producer_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the producer thread; return True once it has ended."""
        if self._started:
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def cancel(self) -> CancelReport:
        """Stop the request: retire the epoch, abort in the backend, close, then join.

        The order is the contract (SPEC section 8): the fence goes up first so
        nothing of this epoch reaches the consumer from here on; the backend is
        told to abort before the stream closes, so by the time the consumer sees
        the end the engine has already dropped the request (a caller that
        starts the next request is not racing the old one); the stream is
        closed, releasing every waiter; only then is the producer joined, with a
        timeout, so a backend that hangs while unwinding delays cleanup, not the
        caller. Idempotent: later calls return the first report.
        """
        with self._cancel_lock:
            if self._cancel_report is not None:
                return self._cancel_report
            t0 = time.monotonic()
            with self._lock:  # from here on start() will not start the producer
                self._cancelling.set()
                started = self._started
            was_in_flight = started and not self._finished.is_set() and not self.stream.closed
            steps = ["retire"]
            self.stream.retire(self.epoch)
            abort_returned: Any = None
            abort_error = None
            steps.append("abort")
            try:
                abort_returned = self._abort()
            except Exception as exc:  # noqa: BLE001 — cleanup must go on; the report says what failed
                abort_error = f"{type(exc).__name__}: {exc}"
            finally:
                # Even a KeyboardInterrupt inside abort closes the stream: the
                # producer and consumer are waiting on it.
                steps.append("close")
                self.stream.close()
            closed_at = time.monotonic()
            steps.append("join")
            joined = self.join(self.join_timeout_s) if started else True
            done = time.monotonic()
            stats = self.stream.stats()
            self._cancel_report = CancelReport(
                request_id=self.request_id,
                epoch=self.epoch,
                was_in_flight=was_in_flight,
                steps=tuple(steps),
                discarded_by_fence=stats.discarded_by_fence,
                events_delivered=stats.delivered_events,
                abort_returned=abort_returned,
                abort_error=abort_error,
                producer_joined=joined,
                join_timeout_s=self.join_timeout_s,
                cancel_to_closed_s=closed_at - t0,
                cancel_to_return_s=done - t0,
            )
            return self._cancel_report

    @property
    def cancel_report(self) -> CancelReport | None:
        return self._cancel_report
