"""Long work shows progress: an elapsed-seconds ticker on a terminal, start and end lines otherwise.

:class:`TerminalObserver` is the runtime's :class:`~edge_core.runtime.session.Observer`
as the CLI renders it: status lines and counted progress on stderr, so stdout
stays for tokens and JSON.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Ticker:
    """Shows that a long step is alive: elapsed seconds on a terminal, a start and an end line otherwise."""

    def __init__(self, what: str):
        self.what = what
        self.tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = 0.0

    def __enter__(self) -> Ticker:
        self.started = time.perf_counter()
        if self.tty:
            self._thread = threading.Thread(target=self._tick, name="edge-progress", daemon=True)
            self._thread.start()
        else:
            say(f"edge: {self.what} ...")
        return self

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            sys.stderr.write(f"\redge: {self.what} ... {time.perf_counter() - self.started:4.0f} s")
            sys.stderr.flush()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        took = time.perf_counter() - self.started
        end = "\r" if self.tty else ""
        status = "done" if exc_type is None else "stopped"
        sys.stderr.write(f"{end}edge: {self.what} ... {status} in {took:.1f} s\n")
        sys.stderr.flush()


def progress_bar(done: int, total: int, note: str) -> None:
    width = 24
    filled = width * done // max(total, 1)
    line = f"edge: [{'#' * filled}{'-' * (width - filled)}] {done}/{total} {note}"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line + ("\n" if done == total else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


class TerminalObserver:
    """The runtime's observer for a person at a terminal (duck-typed: message, step, progress)."""

    def message(self, text: str) -> None:
        say(f"edge: {text}")

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        with Ticker(what):
            yield

    def progress(self, done: int, total: int, note: str) -> None:
        progress_bar(done, total, note)
