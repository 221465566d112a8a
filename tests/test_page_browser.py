"""``edge serve``'s page (/edge/) in a real headless Chromium, against one real server on the demo.

The server is the suite's shared one (conftest's ``demo_server``: vLLM CPU, a
free loopback port, ``--api-key``).
The browser is Debian's ``chromium`` driven over the DevTools pipe
(tests/browser.py); where it is not installed the tests skip and say so.
Screenshots are written under pytest's tmp path and, when
``EDGE_TEST_ARTIFACTS`` names a directory, copied there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest
from browser import NO_BROWSER, Browser, chromium_or_skip, find_chromium, install_pending
from servers import KEY, get, post

from edge_core.artifact.demo import DEMO_NAME

NEEDS = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]
#: Present, or being installed by .ci/run (the tests then wait for it: chromium_or_skip).
BROWSER_EXPECTED = find_chromium() is not None or install_pending()
pytestmark = [
    pytest.mark.engine, pytest.mark.slow, pytest.mark.vllm,
    pytest.mark.xdist_group("demo_server"),  # on one xdist worker with tests/test_serve.py's server tests
    pytest.mark.skipif(bool(NEEDS), reason=f"needs the real vLLM CPU build and edge-cpu; missing: {NEEDS}"),
    pytest.mark.skipif(not BROWSER_EXPECTED, reason=NO_BROWSER),
]
MIB = 1 << 20
#: The page polls every 2 s (live.js POLL_MS); a chart with this many points has seen several polls.
MIN_POINTS = 3


def complete(url: str, prompt: str, tokens: int) -> None:
    body = json.dumps({"model": DEMO_NAME, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    assert post(f"{url}/v1/completions", body) == 200


class Traffic:
    """Completions from two threads until stopped, so vLLM's metrics and the memory move."""

    def __init__(self, url: str):
        self.url = url
        self.stop = threading.Event()
        self.done = 0
        self.threads = [threading.Thread(target=self._loop, args=(n,), daemon=True) for n in range(2)]

    def _loop(self, n: int) -> None:
        while not self.stop.is_set():
            complete(self.url, f"Request {n} number {self.done}", 48)
            self.done += 1

    def __enter__(self) -> Traffic:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(120)


@pytest.fixture(scope="module")
def server(demo_server):
    """The suite's shared demo server (conftest.py), behind ``--api-key``: its URL."""
    return demo_server.ready().url


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    chromium = Browser(chromium_or_skip(), tmp_path_factory.mktemp("chromium"))
    try:
        yield chromium
    finally:
        chromium.close()


def keep(path: Path) -> None:
    """Copy a screenshot to ``EDGE_TEST_ARTIFACTS`` (CI keeps that directory) when it is set."""
    where = os.environ.get("EDGE_TEST_ARTIFACTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(where) / path.name)


def shown_mib(text: str) -> float:
    match = re.fullmatch(r"([\d,]+\.\d) MiB", text)
    assert match, f"not a size in MiB: {text!r}"
    return float(match.group(1).replace(",", ""))


def figure(browser: Browser, element: str) -> str:
    return browser.evaluate(f"document.getElementById({json.dumps(element)}).textContent")


def test_the_page_without_the_key_is_401_and_with_it_a_few_tens_of_kb(server):
    assert get(f"{server}/edge/", None)[0] == 401
    assert get(f"{server}/edge/?key=wrong", None)[0] == 401
    status, body = get(f"{server}/edge/?key={KEY}", None)
    assert status == 200 and body.startswith(b"<!doctype html>")
    assert 5_000 < len(body) < 40_000


def test_the_live_page_draws_points_shows_the_servers_figures_and_stays_on_loopback(server, browser, tmp_path):
    browser.navigate(f"{server}/edge/?key={KEY}")
    with Traffic(server) as traffic:
        deadline = time.monotonic() + 60
        points = tps = 0
        while time.monotonic() < deadline:
            points = int(browser.evaluate("document.getElementById('chart').getAttribute('data-points') || 0"))
            shown = figure(browser, "m-tps")
            tps = float(shown.split()[0]) if shown.endswith("tok/s") else 0.0
            if points >= MIN_POINTS and tps > 0:
                break
            time.sleep(0.5)
        running = figure(browser, "m-running")
    assert traffic.done > 0
    assert points >= MIN_POINTS, f"the chart has {points} points after a minute of traffic"
    assert tps > 0, "the page shows no generated tokens/s from vLLM's metrics while requests ran"
    assert running.isdigit()  # vLLM's vllm:num_requests_running, read by the page
    # Traffic over: the peak stops moving; what the page shows is what /edge/memory says, within its rounding.
    time.sleep(5)
    before = json.loads(get(f"{server}/edge/memory")[1])
    time.sleep(2.5)  # at least one more poll of the page
    page = {key: figure(browser, key) for key in ("m-predicted", "m-peak", "m-current", "m-exceeded")}
    after = json.loads(get(f"{server}/edge/memory")[1])
    assert after["schema"] == "edge.memory"
    assert shown_mib(page["m-predicted"]) == round(after["predicted_peak_bytes"] / MIB, 1)
    low, high = (sorted((before["measured_peak_bytes"], after["measured_peak_bytes"])))
    assert low / MIB - 0.05 <= shown_mib(page["m-peak"]) <= high / MIB + 0.05
    # The current reading moves between two reads of an idle server by a few pages, and on a busy machine the
    # page's last poll may be one before `before` (seen: 4.3 MiB below it in CI): one of them, within 16 MiB.
    low, high = sorted((before["measured_current_bytes"], after["measured_current_bytes"]))
    assert low / MIB - 16 <= shown_mib(page["m-current"]) <= high / MIB + 16
    assert int(page["m-exceeded"]) == after["exceeded_count"]
    # Nothing left 127.0.0.1: every request the page made went to this server.
    urls = browser.requested_urls()
    assert urls and all(u.startswith(f"{server}/") for u in urls), urls
    assert {"/edge/memory", "/metrics"} <= {u[len(server):].split("?")[0] for u in urls}
    assert not browser.console_errors()
    keep(browser.screenshot(tmp_path / "edge-page.png"))
    assert (tmp_path / "edge-page.png").stat().st_size > 10_000


def test_a_narrow_window_needs_no_sideways_scroll(server, browser, tmp_path):
    browser.resize(380, 900)
    try:
        browser.navigate(f"{server}/edge/?key={KEY}")
        time.sleep(3)
        overflow = browser.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        keep(browser.screenshot(tmp_path / "edge-page-narrow.png"))
    finally:
        browser.resize(1100, 1400)
    assert overflow <= 0, f"the page is {overflow} px wider than a 380 px window"
