"""Where the engine's own output goes, and what to show of it when the engine dies.

An engine start prints 30+ lines of vLLM warnings (Triton, LD_PRELOAD, eager
mode, NUMA binding) between edge's plan and the tokens. By default each
session sends them to a log file of its own, private to the user
(:func:`default_log_dir`) — the path is printed, the file is kept when the
engine fails, removed after a clean run unless asked to keep it
(``--engine-log PATH``) — and ``-v`` / ``--engine-log -`` shows them live
instead.

Three channels carry the engine's output, and each is routed:

* vLLM's loggers in every process: ``VLLM_LOGGING_CONFIG_PATH`` names a
  logging config (written next to the log) whose only handler appends to the
  log, set before vLLM is imported;
* anything else the engine processes write to stdout/stderr (C++ warnings,
  ``print``): they are spawned with both descriptors on the log
  (:class:`~edge_core.runtime.processes.OwnProcessGroup` takes the log's fd);
* edge's own messages stay on the terminal.

The session names the log through :data:`ENGINE_LOG_ENV`, so the stage
runtimes a backend's hooks start read the same destination.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, TextIO

from ..errors import UsageError

#: The session's engine log: a file path, or ``-`` for the terminal.
ENGINE_LOG_ENV = "EDGE_ENGINE_LOG"
#: Where logs go when the user names none: one file per session, in a folder of this user's alone
#: (0700; the files 0600): an engine log can hold prompts.
LOG_DIR_NAME = "edge-logs-{uid}"
#: Lines of a failed engine's log that say why, in the order they appear.
CAUSE_PATTERN = re.compile(
    r"(Error|Exception|Traceback|FATAL|Fatal|fatal|Killed|SIGILL|SIGSEGV|SIGKILL|SIGABRT|Aborted|"
    r"Illegal instruction|Segmentation fault|out of memory|OOM|refus)", re.ASCII)
#: How many cause lines a failure message shows.
CAUSE_LINES = 8


def default_log_dir() -> str:
    """``<tmp>/edge-logs-<uid>``, made 0700 if new; refused when it is not this user's own private folder."""
    path = os.path.join(tempfile.gettempdir(), LOG_DIR_NAME.format(uid=os.getuid()))
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(f"cannot make the engine log folder {path}: {exc.strerror or exc}; name a file with "
                         "--engine-log PATH (or -v for the terminal)") from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        raise UsageError(f"the engine log folder {path} is not a folder of yours; remove it, or name a file with "
                         "--engine-log PATH (or -v for the terminal)")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


@dataclass(frozen=True)
class EngineLog:
    """One session's engine log file (``path`` None: the terminal)."""

    path: str | None

    @classmethod
    def for_session(cls, choice: str | None, label: str) -> EngineLog:
        """``choice`` ``-`` is the terminal, a path is that file, None a new file in :func:`default_log_dir`.

        The file is created here, 0600 (a file the user named keeps the mode it has), before vLLM's
        logging or any engine process opens it with the umask's mode.
        """
        if choice == "-":
            return cls(None)
        if choice:
            path = os.path.abspath(choice)
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            safe = re.sub(r"[^A-Za-z0-9_.-]+", "-", label)[:40]
            path = os.path.join(default_log_dir(), f"{stamp}-{safe}-{os.getpid()}.log")
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))
        except OSError as exc:
            raise UsageError(f"cannot write the engine log {path}: {exc.strerror or exc}; name another with "
                             "--engine-log PATH (or -v for the terminal)") from None
        return cls(path)

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> EngineLog:
        value = (os.environ if environ is None else environ).get(ENGINE_LOG_ENV)
        return cls(None if value in (None, "", "-") else value)

    def export(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Name this log in the environment, for the stage runtime and every engine process."""
        env = os.environ if environ is None else environ
        env[ENGINE_LOG_ENV] = self.path or "-"

    def route_runtime_logging(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Point vLLM's loggers (this process and every engine process) at the file; call before ``import vllm``."""
        if self.path is None:
            return
        env = os.environ if environ is None else environ
        config_path = self.path + ".logging.json"
        config = {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(process)d %(name)s: %(message)s"}},
            "handlers": {"file": {"class": "logging.FileHandler", "filename": self.path, "mode": "a",
                                  "formatter": "plain", "level": "DEBUG"}},
            "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False}},
        }
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(os.open(config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as handle:
            json.dump(config, handle)
        env["VLLM_CONFIGURE_LOGGING"] = "1"
        env["VLLM_LOGGING_CONFIG_PATH"] = config_path

    def server_logging(self) -> dict[str, object] | None:
        """uvicorn's logging config for vLLM's server: its loggers append to this log (None: uvicorn's own).

        uvicorn configures its loggers itself, onto stderr: its report of a stream cancelled when a stop outlasts
        the drain (a traceback) would otherwise land between edge's lines.
        """
        if self.path is None:
            return None
        return {"version": 1, "disable_existing_loggers": False,
                "formatters": {"plain": {"format": "%(levelname)s %(asctime)s %(process)d %(name)s: %(message)s"}},
                "handlers": {"file": {"class": "logging.FileHandler", "filename": self.path, "mode": "a",
                                      "formatter": "plain"}},
                "loggers": {name: {"handlers": ["file"], "level": "INFO", "propagate": False}
                            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")}}

    def open_fd(self) -> int | None:
        """A write descriptor on the log for spawned processes' stdout/stderr (None: they keep the terminal)."""
        if self.path is None:
            return None
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o600)

    def causes(self, limit: int = CAUSE_LINES) -> list[str]:
        """The last ``limit`` lines of the log that name a cause (errors, signals, OOM)."""
        if self.path is None or not os.path.isfile(self.path):
            return []
        try:
            with open(self.path, encoding="utf-8", errors="replace") as handle:
                lines = handle.read()[-1_000_000:].splitlines()
        except OSError:
            return []
        hits = [line.strip() for line in lines if CAUSE_PATTERN.search(line)]
        return hits[-limit:]

    @contextlib.contextmanager
    def capture_prints(self) -> Iterator[None]:
        """Python-level stdout/stderr of this process into the log while the block runs (e.g. the runtime's import)."""
        if self.path is None:
            yield
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as handle, contextlib.redirect_stderr(handle), \
                contextlib.redirect_stdout(handle):
            yield

    @contextlib.contextmanager
    def capture_engine_start(self) -> Iterator[None]:
        """While an engine starts inside this process: everything it writes goes to the log.

        Its native writes to descriptors 1 and 2 (C++ warnings such as
        ``init_cpu_memory_env``'s NUMA line, which a spawned engine process
        writes to its own descriptors, already on the log) and the calling
        thread's Python-level output (the loader's progress bars); the other
        threads' Python-level output (edge's progress on stderr) goes where
        it went before, through copies of the two descriptors.
        """
        if self.path is None:
            yield
            return
        log_fd = self.open_fd()
        assert log_fd is not None
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        terminal = {fd: io.TextIOWrapper(io.FileIO(saved[fd], "w", closefd=False), write_through=True,
                                         encoding=getattr(stream, "encoding", None) or "utf-8", errors="replace")
                    for fd, stream in ((1, sys.stdout), (2, sys.stderr))}
        try:
            with open(log_fd, "a", encoding="utf-8", closefd=False) as handle:
                out, err = _ThreadRouted(handle, terminal[1]), _ThreadRouted(handle, terminal[2])
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    for fd in (1, 2):
                        os.dup2(log_fd, fd)
                    try:
                        yield
                    finally:
                        for fd in (1, 2):
                            os.dup2(saved[fd], fd)
        finally:
            for fd in (*saved.values(), log_fd):
                os.close(fd)

    def remove(self) -> None:
        """Drop the log and its logging config after a clean session."""
        for path in (self.path, (self.path or "") + ".logging.json"):
            if path and os.path.isfile(path):
                try:
                    os.unlink(path)
                except OSError:
                    pass


class _ThreadRouted:
    """A text stream that sends the writes of the thread that made it to ``mine`` and every other thread's to
    ``others`` (what ``sys.stdout``/``sys.stderr`` were)."""

    def __init__(self, mine: TextIO, others: TextIO) -> None:
        self.mine, self.others, self.owner = mine, others, threading.get_ident()

    def _target(self) -> TextIO:
        return self.mine if threading.get_ident() == self.owner else self.others

    def write(self, text: str) -> int:
        return self._target().write(text)

    def flush(self) -> None:
        self._target().flush()

    def isatty(self) -> bool:
        return self._target().isatty()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._target(), name)
