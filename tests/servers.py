"""One real ``edge serve`` process for the tests that talk to a server, and the small HTTP helpers they share.

An engine start costs 25-45 s on two cores, so the tests that exercise
different behaviour of the same server share one (``demo_server`` in
conftest.py): the page in a browser (tests/test_page_browser.py), the OpenAI
endpoints and edge's routes (tests/test_serve.py), and last, its SIGTERM stop.
A test that stops the shared server leaves the next user a fresh one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

#: The question the demo model (SmolLM2-135M-Instruct) answers with "Paris" in the tests. Not "What is the capital
#: of France?": there the model's first answer token is a near-tie ("L" -1.83 against "The" -1.96 in vLLM CPU
#: bf16 here; llama.cpp on the Q4_1 file itself answers "L'Étoile, ..."), while this phrasing leads by 1.4 nats.
DEMO_QUESTION = "Name the capital of France."
#: Seconds a demo server may take to answer /health on 2 cores (40-50 s on a busy machine).
READY_TIMEOUT_S = 240
#: The shared server's API key: vLLM's endpoints and edge's page both sit behind it.
KEY = "edge-test-key"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def get(url: str, key: str | None = KEY) -> tuple[int, bytes]:
    """GET with the bearer key (``key=None`` sends none); (0, b"") while nothing listens."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def post(url: str, body: bytes, key: str | None = KEY) -> int:
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            answer.read()
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def short_tmp(prefix: str) -> Path:
    """A private folder directly under the system's temporary directory, for an engine's ``TMPDIR``: vLLM puts
    its ZMQ sockets there, and a socket path longer than 107 bytes fails (pytest's nested tmp paths can be)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


class Server:
    """One ``edge serve`` process on the demo, in a session of its own so a signal reaches only it.

    Its engine log is the default one, in a private folder under its own ``TMPDIR`` (:func:`short_tmp`), so a
    clean stop can be checked to remove it.
    """

    def __init__(self, *extra: str):
        self.port = free_port()
        self.tmp = short_tmp("edge-serve-")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edge_core", "serve", "--port", str(self.port), "--drain-timeout", "3", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": str(self.tmp)}, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def log_folder(self) -> Path:
        return self.tmp / f"edge-logs-{os.getuid()}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"edge serve exited {self.proc.returncode}: {self.proc.stderr.read()[-3000:]}")
            if get(f"{self.url}/health", None)[0] == 200:
                return
            time.sleep(0.5)
        raise AssertionError("edge serve did not become ready")

    def running(self) -> bool:
        return self.proc.poll() is None

    def tree(self) -> list[int]:
        try:
            return [p.pid for p in psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            return []

    def stop(self, signum: int) -> tuple[int, str, str]:
        self.proc.send_signal(signum)
        out, err = self.proc.communicate(timeout=120)
        return self.proc.returncode, out, err

    def kill(self) -> None:
        if self.proc.poll() is None:
            for pid in self.tree():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            self.proc.kill()
            self.proc.communicate()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


class SharedServer:
    """The suite's one demo server, started on first use and again only after a test stopped it."""

    def __init__(self) -> None:
        self._servers: list[Server] = []

    def ready(self) -> Server:
        if not self._servers or not self._servers[-1].running():
            self._servers.append(Server("--api-key", KEY))
            self._servers[-1].wait_ready()
        return self._servers[-1]

    def close(self) -> None:
        for server in self._servers:
            server.close()
