"""A real headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``), for page tests.

No client library: the protocol is JSON messages separated by NUL bytes on
file descriptors 3 (commands) and 4 (answers and events). Every request the
page makes is recorded from ``Network.requestWillBeSent``; the browser is
started with a dead proxy and a host resolver that resolves nothing, so a
request that tried to leave 127.0.0.1 would also fail. Nothing here asserts:
the tests do.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

#: Debian's package installs ``chromium``; other distributions name it otherwise.
CANDIDATES = ("chromium", "chromium-browser", "google-chrome-stable", "google-chrome")


#: .ci/run installs chromium in the background while the first sessions run, holding a lock on this file
#: until the install has ended, so a page test waits for it instead of skipping.
INSTALL_LOCK = os.environ.get("EDGE_CHROMIUM_INSTALL_LOCK", "")


def find_chromium(*, wait: bool = False) -> str | None:
    """The browser's path, or None; with ``wait``, looked up once a pending install has ended."""
    if wait and install_pending():
        with open(INSTALL_LOCK) as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)  # blocks while .ci/run's install holds it
    return next((path for path in map(shutil.which, CANDIDATES) if path), None)


def install_pending() -> bool:
    """Whether .ci/run's background install of the browser is still running."""
    if not INSTALL_LOCK or not os.path.exists(INSTALL_LOCK):
        return False
    with open(INSTALL_LOCK) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
    return False


def chromium_or_skip() -> str:
    """The browser for a test that needs one, after any pending install; skips (saying why) without one."""
    import pytest

    path = find_chromium(wait=True)
    if path is None:
        pytest.skip(NO_BROWSER)
    return path


NO_BROWSER = ("no headless browser: Debian's chromium package is not installed "
              "(apt-get install chromium; .ci/run installs it where it can)")


class Browser:
    """One headless Chromium with one page (target), driven over the DevTools pipe."""

    def __init__(self, executable: str, profile: Path, *, width: int = 1100, height: int = 1400):
        self.events: list[dict[str, Any]] = []
        self._answers: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._next = 0
        # fds 3 and 4 in the child; make the parent's ends high so the dup2 below cannot clobber them.
        to_child_r, to_child_w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in os.pipe())
        from_child_r, from_child_w = (fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in os.pipe())

        def pipes_at_3_and_4() -> None:
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        profile.mkdir(parents=True, exist_ok=True)
        self.log = profile / "chromium.log"
        args = [executable, "--headless", "--remote-debugging-pipe", f"--user-data-dir={profile}",
                "--no-first-run", "--no-default-browser-check", "--disable-gpu", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-features=Translate,OptimizationHints,MediaRouter", "--hide-scrollbars",
                "--proxy-server=http://127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
                f"--window-size={width},{height}", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium's sandbox refuses to run as root (CI containers)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                         preexec_fn=pipes_at_3_and_4, pass_fds=(3, 4), start_new_session=True)
        os.close(to_child_r)
        os.close(from_child_w)
        self._write = to_child_w
        self._read = from_child_r
        threading.Thread(target=self._reader, name="cdp-reader", daemon=True).start()
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        for domain in ("Network", "Page", "Runtime"):
            self.call(f"{domain}.enable", session=True)

    def _reader(self) -> None:
        buffer = b""
        while True:
            try:
                chunk = os.read(self._read, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._cond.notify_all()
                return
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            with self._cond:
                for raw in messages:
                    message = json.loads(raw)
                    if "id" in message:
                        self._answers[message["id"]] = message
                    else:
                        self.events.append(message)
                self._cond.notify_all()

    def call(self, method: str, *, session: bool = False, timeout: float = 30, **params: Any) -> dict[str, Any]:
        with self._cond:
            self._next += 1
            number = self._next
        message: dict[str, Any] = {"id": number, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        with self._cond:
            while number not in self._answers:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise RuntimeError(f"chromium gave no answer to {method} (log: {self.log})")
                self._cond.wait(left)
            answer = self._answers.pop(number)
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return answer.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.evaluate("document.readyState") != "complete":
            time.sleep(0.1)

    def requested_urls(self) -> list[str]:
        with self._cond:
            return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def console_errors(self) -> list[str]:
        with self._cond:
            return [str(e["params"]) for e in self.events
                    if e.get("method") == "Runtime.exceptionThrown"
                    or (e.get("method") == "Runtime.consoleAPICalled" and e["params"].get("type") == "error")]

    def resize(self, width: int, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width, height=height,
                  deviceScaleFactor=1, mobile=False)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", session=True, format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.call("Browser.close", timeout=10)
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()
        for fd in (self._write, self._read):
            try:
                os.close(fd)
            except OSError:
                pass
