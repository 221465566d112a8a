"""How events wait between a stage's producer and its consumer: a bounded, fenced queue and the sequence check.

* :class:`BoundedStream` — a queue bounded in events *and* bytes whose full
  state blocks the producer (backpressure), with an epoch fence;
* :class:`SequenceChecker` — the consumer-side check that no event was lost,
  duplicated or reordered.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..stream import DeltaEvent

#: Default bounds of a request's stream. 64 events and 1 MiB hold several
#: seconds of token deltas (a few dozen bytes each) while keeping a stalled
#: consumer from letting a producer run ahead by more than that (estimate, E).
DEFAULT_MAX_EVENTS = 64
DEFAULT_MAX_BYTES = 1 << 20

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
