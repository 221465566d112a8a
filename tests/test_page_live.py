"""The page's live part (edge_core/page/live.js) in a real headless Chromium, against a scripted loopback server.

No engine: a small HTTP server on 127.0.0.1 answers /edge/ with the live page
of a real plan, /edge/memory with readings that cross the prediction after a
few polls, and /metrics with vLLM's series moving by known amounts. What the
page must show follows from those scripted answers.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from browser import NO_BROWSER, Browser, chromium_or_skip, find_chromium, install_pending

from edge_core.artifact import DEMO_MODEL
from edge_core.cli import main
from edge_core.page import PAGE_PATH, live_page
from edge_core.runtime.documents import enveloped

#: Present, or being installed by .ci/run (the tests then wait for it: chromium_or_skip).
BROWSER_EXPECTED = find_chromium() is not None or install_pending()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not BROWSER_EXPECTED, reason=NO_BROWSER),
]
DATA = Path(__file__).parent / "data"
MIB = 1 << 20
#: Polls answered below the prediction before the scripted measurement crosses it.
BELOW = 2
TOKENS_PER_POLL = 120


class Script:
    """The scripted server's state: how many readings were given, and the Prometheus counter's value."""

    def __init__(self, plan: dict):
        self.plan = plan
        self.page = live_page(enveloped("plan", plan)).encode()
        self.readings = 0
        self.tokens = 0
        self.lock = threading.Lock()

    def memory(self) -> bytes:
        with self.lock:
            self.readings += 1
            n = self.readings
        predicted = self.plan["predicted_peak_bytes"]
        current = predicted // 2 if n <= BELOW else predicted + 50 * MIB
        return json.dumps(enveloped("memory", {
            "counter": "tree_pss", "predicted_peak_bytes": predicted, "measured_peak_bytes": current,
            "measured_current_bytes": current, "ratio": round(predicted / current, 4),
            "exceeded_count": max(0, n - BELOW), "samples": 4 * n, "note": "scripted"})).encode()

    def metrics(self) -> bytes:
        with self.lock:
            self.tokens += TOKENS_PER_POLL
            tokens = self.tokens
        return ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                "# TYPE vllm:num_requests_running gauge\n"
                'vllm:num_requests_running{engine="0",model_name="demo"} 2.0\n'
                'vllm:num_requests_waiting{engine="0",model_name="demo"} 1.0\n'
                'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0\n'
                f'vllm:generation_tokens_total{{engine="0",model_name="demo"}} {tokens}.0\n').encode()


@pytest.fixture
def scripted(capsys, monkeypatch):
    monkeypatch.setenv("EDGE_PLUGINS", "none-installed")
    assert main(["plan", "--json", "--model", str(DEMO_MODEL), "--devices", str(DATA / "devices-h100.json")]) == 0
    script = Script(json.loads(capsys.readouterr().out))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 — http.server's name
            path = self.path.split("?")[0]
            answer = {PAGE_PATH: ("text/html", lambda: script.page), "/edge/memory": ("application/json",
                      script.memory), "/metrics": ("text/plain", script.metrics)}.get(path)
            if answer is None:
                self.send_error(404)
                return
            body = answer[1]()
            self.send_response(200)
            self.send_header("Content-Type", answer[0])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield script, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_page_marks_the_first_reading_over_the_prediction_and_reads_vllms_metrics(scripted, tmp_path):
    script, url = scripted
    browser = Browser(chromium_or_skip(), tmp_path / "profile")
    try:
        browser.navigate(f"{url}{PAGE_PATH}")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and script.readings < BELOW + 2:
            time.sleep(0.2)
        time.sleep(0.5)  # the last answer drawn
        status = browser.evaluate("document.getElementById('status').className + '|' + "
                                  "document.getElementById('status').textContent")
        over_marks = browser.evaluate("document.querySelectorAll('#chart line.over').length")
        label = browser.evaluate("Array.from(document.querySelectorAll('#chart text')).map(t => t.textContent)"
                                 ".filter(t => t.startsWith('first over prediction')).length")
        points = int(browser.evaluate("document.getElementById('chart').getAttribute('data-points')"))
        shown = {key: browser.evaluate(f"document.getElementById('{key}').textContent")
                 for key in ("m-running", "m-waiting", "m-tps", "m-exceeded", "m-current")}
        readings = script.readings
        browser.screenshot(tmp_path / "over.png")
        errors = browser.console_errors()
    finally:
        browser.close()
    assert readings >= BELOW + 2
    assert status.startswith("over|measured peak") and "exceeds the predicted" in status
    assert over_marks == 1 and label == 1  # marked once, however many readings are over
    assert points >= BELOW + 1
    # Sums over every label set of a series, and only that series (not ..._by_reason).
    assert shown["m-running"] == "2" and shown["m-waiting"] == "1"
    # 120 tokens per poll over a 2 s period (live.js POLL_MS) plus the time a poll takes.
    tps = float(shown["m-tps"].split()[0])
    assert shown["m-tps"].endswith(" tok/s") and 0 < tps <= TOKENS_PER_POLL / 2
    assert int(shown["m-exceeded"]) >= 1
    assert not errors
