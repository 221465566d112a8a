"""How one request is driven end to end: a producer thread pumps the backend's iterator into a bounded stream.

The caller iterates; :meth:`StreamRun.cancel` stops the request in the order
fence, abort, close, join.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..errors import EngineDied, StageError
from ..stream import CancelReport, DeltaEvent
from .stream_queue import DEFAULT_MAX_BYTES, DEFAULT_MAX_EVENTS, BoundedStream, SeqGap, SequenceChecker

#: How long cancel waits for the producer thread before returning without it.
#: The join only shortens cleanup when the backend unwinds quickly; a backend
#: that hangs while unwinding must not hold the caller.
DEFAULT_JOIN_TIMEOUT_S = 2.0

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
            if isinstance(exc, EngineDied):  # already names the engine, the request and the death
                error = exc
            elif not self._cancelling.is_set():
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

        The order is the contract: the fence goes up first so
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
