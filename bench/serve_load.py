"""``edge serve`` under overload and for minutes: nothing lost, nothing hung, memory within the plan, no leak.

    python bench/serve_load.py [--model DIR] [--max-num-seqs 8] [--clients 256] [--duration 30]
                               [--warmup 20] [--settle 15] [--slow-read-s 0.5] [--json FILE] [--url URL --key KEY]

Starts ``edge serve --max-num-seqs N`` on a free loopback port (or loads one
already running at ``--url``) and runs ``--clients`` concurrent clients for
``--duration`` seconds, each starting its next request when the last ended
(one asyncio loop, aiohttp, raw SSE). The mix, by client (rounded):

* 55 % streaming readers: chat or text completions of 8-64 tokens, read to the end;
* 10 % non-streaming requests;
* 10 % slow readers: a stream read one event every ``--slow-read-s`` seconds;
* 20 % clients that disconnect mid-stream (after 1-8 events, or while still
  queued, 0.5-5 s after sending) from requests of 512 tokens: their requests
  must be aborted in vLLM (the tokens vLLM generates after they left, and
  nothing running or queued when the last client has finished);
* 5 % prompts longer than the context: each must get a 4xx that says why
  (one such request every 2 s per client).

Every request ends as exactly one of: ``completed`` (a finish reason and
``[DONE]``), ``refused`` (a 4xx/5xx whose body says why: an over-long
prompt's 400, or the 503 of a server at its ``--max-connections``, after
which that client waits the ``Retry-After`` it was given), ``disconnected``
(ours, on purpose), ``lost`` (a connection error, a stream cut without a
finish, an error without a reason) or ``hung`` (no end within
``--request-timeout``); lost and hung must be 0. After the duration no new
request starts and the clients finish what is in flight.

Around it: a warm-up of the same mix (``--warmup`` s) and a settle
(``--settle`` s after vLLM reports no request running or waiting), then the
**before** reading of the whole server tree — PSS (smaps_rollup), open files
(``/proc/PID/fd``) and threads, every process — and vLLM's ``/metrics``; the
soak; the same settle and the **after** reading. The warm-up is there so that
what grows once (thread pools, allocator arenas, the prefix cache's tables)
is in "before": a leak is growth with traffic. While it runs a thread reads
``/edge/memory`` every 0.25 s and counts readings whose measured tree PSS
(above edge's baseline) exceeds the plan's predicted peak.

Reports p50/p99 time to first token and total latency of completed streams,
tokens/s (the clients' own count and vLLM's ``generation_tokens_total``),
the outcome counts, the aborts' evidence, the idle state after (requests
running/waiting, KV cache usage) and the drift (per process, and open files by
kind: socket, pipe, anon_inode, file); exit 1 when a criterion fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 900
MIB = 1 << 20
#: The client mix: (kind, share of the clients).
MIX = (("stream", 0.55), ("plain", 0.10), ("slow", 0.10), ("disconnect", 0.20), ("too_long", 0.05))
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about a gateway box in a cupboard.",
    "Explain in two sentences what a KV cache is.",
    "List three uses of a small language model at home.",
    "Why does memory matter when running a model on a CPU?",
    "Tell me a short story about a lighthouse keeper.",
    "What is 17 times 23? Answer briefly.",
    "Describe the colour blue to someone who cannot see.",
)
#: Pass criteria (the issue's): PSS within 3 %, open files and threads unchanged.
PSS_DRIFT_LIMIT = 0.03
#: Tokens vLLM may generate for a request after its client left (those already in flight); one not aborted
#: would run to its 512.
ABORT_SLACK_TOKENS = 32


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def get(url: str, key: str | None, timeout: float = 10) -> bytes:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return bytes(answer.read())


def metrics(url: str, key: str | None) -> dict[str, float]:
    """vLLM's Prometheus gauges and counters we read, summed over their labels (finish reasons kept apart)."""
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:generation_tokens_total", "vllm:prompt_tokens_total")
    out: dict[str, float] = {}
    for line in get(f"{url}/metrics", key).decode().splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base in wanted:
            out[base] = out.get(base, 0.0) + float(value)
        elif base == "vllm:request_success_total":
            reason = name.split('finished_reason="', 1)[1].split('"', 1)[0] if "finished_reason" in name else "?"
            out[f"finished:{reason}"] = out.get(f"finished:{reason}", 0.0) + float(value)
    return out


# ---------------------------------------------------------------- the server's tree

def tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def rollup(pid: int) -> dict[str, int]:
    """``Pss``, ``Pss_Anon`` and ``Pss_File`` of ``pid`` from smaps_rollup, in bytes ({} once it is gone)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("Pss", "Pss_Anon", "Pss_File"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        return {}
    return out


def fd_kinds(pid: int) -> dict[str, int]:
    """Open files by kind: ``socket``, ``pipe``, ``anon_inode`` (eventfd, epoll, pidfd...), ``file``; files under
    ``/proc`` are left out (edge's memory sampler opens them for a moment four times a second)."""
    out: Counter[str] = Counter()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("/proc/"):
            continue
        out["file" if target.startswith("/") else target.split(":", 1)[0]] += 1
    return dict(out)


def steady_fd_kinds(pid: int, reads: int = 5, gap_s: float = 0.2) -> dict[str, int]:
    """The fewest open files of each kind over ``reads`` readings: what the process holds, not a moment's read."""
    low: dict[str, int] | None = None
    for _ in range(reads):
        now = fd_kinds(pid)
        low = now if low is None else {k: min(v, now.get(k, 0)) for k, v in low.items()}
        time.sleep(gap_s)
    return {k: v for k, v in (low or {}).items() if v}


def tree_reading(pid: int) -> dict[str, Any]:
    """PSS, open files and threads of every process of the server's tree, and their sums."""
    rows = []
    for proc in tree(pid):
        try:
            kinds = steady_fd_kinds(proc.pid)
            memory = rollup(proc.pid)
            rows.append({"pid": proc.pid, "title": Path(f"/proc/{proc.pid}/cmdline").read_bytes()
                         .split(b"\0")[0].decode(errors="replace").strip()[-40:],
                         "pss_bytes": memory.get("Pss", 0), "pss_anon_bytes": memory.get("Pss_Anon", 0),
                         "pss_file_bytes": memory.get("Pss_File", 0), "fds": sum(kinds.values()),
                         "fd_kinds": kinds, "threads": proc.num_threads()})
        except (OSError, psutil.Error):
            continue
    return {"pss_bytes": sum(r["pss_bytes"] for r in rows), "pss_anon_bytes": sum(r["pss_anon_bytes"] for r in rows),
            "pss_file_bytes": sum(r["pss_file_bytes"] for r in rows), "fds": sum(r["fds"] for r in rows),
            "threads": sum(r["threads"] for r in rows), "processes": rows}


class MemoryPoller(threading.Thread):
    """Reads ``/edge/memory`` every ``period_s``; counts readings above the plan's predicted peak."""

    def __init__(self, url: str, key: str | None, server_pid: int | None, period_s: float = 0.25):
        super().__init__(name="memory-poller", daemon=True)
        self.url, self.key, self.server_pid, self.period_s = url, key, server_pid, period_s
        self.readings = 0
        self.above_plan = 0
        self.failed = 0
        self.max_current = 0
        self.max_tree_pss = 0
        self.max_tree_anon = 0
        self.predicted = None
        self.first_above: dict[str, Any] | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        deadline = time.monotonic()
        while not self._halt.is_set():
            try:
                doc = json.loads(get(f"{self.url}/edge/memory", self.key, timeout=5))
                body = doc.get("memory", doc)
                current, predicted = body.get("measured_current_bytes"), body.get("predicted_peak_bytes")
                self.predicted = predicted
                self.readings += 1
                if current is not None:
                    self.max_current = max(self.max_current, current)
                    if predicted is not None and current > predicted:
                        self.above_plan += 1
                        self.first_above = self.first_above or {"at": time.monotonic(), "current": current}
            except (OSError, ValueError):
                self.failed += 1
            if self.server_pid is not None:
                readings = [rollup(p.pid) for p in tree(self.server_pid)]
                self.max_tree_pss = max(self.max_tree_pss, sum(r.get("Pss", 0) for r in readings))
                self.max_tree_anon = max(self.max_tree_anon, sum(r.get("Pss_Anon", 0) for r in readings))
            deadline += self.period_s
            self._halt.wait(max(0.0, deadline - time.monotonic()))

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


# ---------------------------------------------------------------- the clients

@dataclass
class Outcome:
    kind: str
    outcome: str  # completed | refused | disconnected | lost | hung
    status: int | None = None
    reason: str | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    tokens: int = 0
    started_s: float = 0.0
    retry_after_s: float | None = None


@dataclass
class Load:
    url: str
    key: str | None
    model: str
    max_model_len: int
    slow_read_s: float
    request_timeout_s: float
    outcomes: list[Outcome] = field(default_factory=list)

    def headers(self) -> dict[str, str]:
        out = {"content-type": "application/json"}
        if self.key:
            out["Authorization"] = f"Bearer {self.key}"
        return out

    def body(self, kind: str, rng: random.Random) -> tuple[str, dict[str, Any]]:
        prompt = rng.choice(PROMPTS)
        stream = kind != "plain"
        max_tokens = rng.randint(8, 32) if kind == "slow" else rng.randint(8, 64)
        if kind == "disconnect":
            max_tokens = 512  # long enough that a request vLLM failed to abort would still be running after
        if kind == "too_long":
            # Longer than the context whatever the tokenizer does with it: at least one token per word.
            prompt = "hello " * (self.max_model_len + 64)
        common: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens, "stream": stream,
                                  "temperature": 0.7, "seed": rng.randint(0, 1 << 30)}
        if stream:
            common["stream_options"] = {"include_usage": True}
        if rng.random() < 0.5:
            return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/completions", {**common, "prompt": prompt}

    async def one(self, session: Any, kind: str, rng: random.Random) -> Outcome:
        path, body = self.body(kind, rng)
        started = time.monotonic()
        result = Outcome(kind=kind, outcome="lost", started_s=started)
        try:
            await asyncio.wait_for(self._exchange(session, kind, path, body, rng, result, started),
                                   self.request_timeout_s)
        except asyncio.TimeoutError:
            result.outcome, result.reason = "hung", f"no end within {self.request_timeout_s:.0f} s"
        except Exception as exc:  # noqa: BLE001 — every failure is an outcome: lost, with what it was
            if result.outcome != "disconnected":
                result.outcome, result.reason = "lost", f"{type(exc).__name__}: {exc}"
        result.total_s = time.monotonic() - started
        return result

    async def _exchange(self, session: Any, kind: str, path: str, body: dict[str, Any], rng: random.Random,
                        result: Outcome, started: float) -> None:
        disconnect_after = None
        disconnect_at = None
        if kind == "disconnect":
            if rng.random() < 0.25:
                disconnect_at = started + rng.uniform(0.5, 5.0)  # while still queued, most likely
            else:
                disconnect_after = rng.randint(1, 8)
        response = await session.post(f"{self.url}{path}", json=body, headers=self.headers())
        events = 0
        try:
            result.status = response.status
            if response.status >= 400:
                retry = response.headers.get("Retry-After")
                result.retry_after_s = float(retry) if retry and retry.isdigit() else None
                text = await response.text()
                try:
                    message = json.loads(text).get("error", {}).get("message") or json.loads(text).get("message")
                except (ValueError, AttributeError):
                    message = None
                if message:
                    result.outcome, result.reason = "refused", str(message)[:300]
                else:
                    result.outcome, result.reason = "lost", f"HTTP {response.status} without a reason: {text[:200]}"
                return
            if not body["stream"]:
                doc = await response.json()
                choice = doc["choices"][0]
                result.tokens = int(doc.get("usage", {}).get("completion_tokens") or 0)
                if choice.get("finish_reason"):
                    result.outcome = "completed"
                    result.ttft_s = time.monotonic() - started
                else:
                    result.reason = "a response without a finish reason"
                return
            finish = None
            done = False
            while True:
                if disconnect_at is not None:
                    remaining = disconnect_at - time.monotonic()
                    if remaining <= 0:
                        result.outcome, result.reason = "disconnected", f"after {events} events"
                        return
                    try:
                        line = await asyncio.wait_for(response.content.readline(), remaining)
                    except asyncio.TimeoutError:
                        result.outcome, result.reason = "disconnected", f"after {events} events"
                        return
                else:
                    line = await response.content.readline()
                if not line:
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk and not chunk.get("choices"):
                    message = (chunk["error"] or {}).get("message") if isinstance(chunk["error"], dict) else None
                    result.outcome = "refused" if message else "lost"
                    result.reason = f"in-stream error: {message or chunk}"[:300]
                    return
                for choice in chunk.get("choices") or ():
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if piece and result.ttft_s is None:
                        result.ttft_s = time.monotonic() - started
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                    if piece:
                        events += 1
                usage = chunk.get("usage")
                if usage:
                    result.tokens = int(usage.get("completion_tokens") or 0)
                if disconnect_after is not None and events >= disconnect_after and finish is None:
                    result.outcome, result.reason = "disconnected", f"after {events} events"
                    return
                if kind == "slow":
                    await asyncio.sleep(self.slow_read_s)
            if finish is not None and done:
                result.outcome = "completed"
            else:
                result.reason = f"stream ended without {'a finish reason' if finish is None else '[DONE]'}"
        finally:
            if result.outcome == "disconnected":
                response.close()  # the connection goes away mid-stream, as a client that quits
                result.tokens = events  # what it received: vLLM streams about a token an event
            else:
                response.release()

    async def client(self, session: Any, kind: str, seed: int, until: float) -> None:
        rng = random.Random(seed)
        await asyncio.sleep(rng.uniform(0, 2.0))  # not all at the same instant
        while time.monotonic() < until:
            outcome = await self.one(session, kind, rng)
            self.outcomes.append(outcome)
            if outcome.status == 503 and outcome.outcome == "refused":  # the server at its connection cap
                await asyncio.sleep(outcome.retry_after_s or 1.0)
            elif kind == "too_long":
                await asyncio.sleep(2.0)

    async def run(self, clients: int, duration_s: float, seed: int) -> float:
        import aiohttp

        kinds = []
        for kind, share in MIX:
            kinds += [kind] * max(1, round(clients * share))
        kinds = kinds[:clients] + ["stream"] * max(0, clients - len(kinds))
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30)
        started = time.monotonic()
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            until = started + duration_s
            await asyncio.gather(*(self.client(session, kind, seed * 1000 + i, until) for i, kind in enumerate(kinds)))
        return time.monotonic() - started


# ---------------------------------------------------------------- the run

def start_server(model: str, max_num_seqs: int, key: str, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "edge_core", "serve", "--model", model, "--port", str(port), "--max-num-seqs",
           str(max_num_seqs), "--api-key", key, "--json", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"edge serve exited {proc.returncode} before it was ready: {proc.stderr.read()[-3000:]}")
        try:
            if get(f"{url}/health", None, timeout=2) is not None:
                return proc, url
        except (OSError, urllib.error.HTTPError):
            time.sleep(0.5)
    raise SystemExit("edge serve was not ready in time")


def stop_server(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return proc.returncode, out, err


def settle(url: str, key: str | None, seconds: float, timeout_s: float = 600) -> dict[str, float]:
    """Wait until vLLM runs and queues nothing, then ``seconds`` more; vLLM's metrics then."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = metrics(url, key)
        if now.get("vllm:num_requests_running", 0) == 0 and now.get("vllm:num_requests_waiting", 0) == 0:
            break
        time.sleep(0.5)
    time.sleep(seconds)
    return metrics(url, key)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def summarise(outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    counts = Counter(o.outcome for o in outcomes)
    by_kind: dict[str, Counter[str]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.outcome] += 1
    streams = [o for o in outcomes if o.outcome == "completed" and o.kind in ("stream", "slow")]
    fast = [o for o in streams if o.kind == "stream"]
    tokens = sum(o.tokens for o in outcomes if o.outcome == "completed")
    too_long = [o for o in outcomes if o.kind == "too_long" and o.status != 503]  # a 503: never read, at the cap
    at_cap = [o for o in outcomes if o.outcome == "refused" and o.status == 503]
    return {
        "requests": len(outcomes),
        "outcomes": dict(counts),
        "by_kind": {k: dict(v) for k, v in by_kind.items()},
        "ttft_p50_s": percentile([o.ttft_s for o in fast if o.ttft_s is not None], 0.50),
        "ttft_p99_s": percentile([o.ttft_s for o in fast if o.ttft_s is not None], 0.99),
        "total_p50_s": percentile([o.total_s for o in fast if o.total_s is not None], 0.50),
        "total_p99_s": percentile([o.total_s for o in fast if o.total_s is not None], 0.99),
        "completed_tokens": tokens,
        "client_tokens_per_s": tokens / wall_s if wall_s else None,
        "too_long_refused_4xx": sum(1 for o in too_long if o.outcome == "refused" and o.status and 400 <= o.status < 500),
        "refused_at_cap_503": len(at_cap),
        "refused_at_cap_reason": next((o.reason for o in at_cap), None),
        "too_long": len(too_long),
        "too_long_reason": next((o.reason for o in too_long if o.reason), None),
        "unexpected_refusals": [asdict(o) for o in outcomes if o.outcome == "refused" and o.kind != "too_long"
                                and o.status != 503][:10],
        "lost": [asdict(o) for o in outcomes if o.outcome == "lost"][:20],
        "hung": [asdict(o) for o in outcomes if o.outcome == "hung"][:20],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/work/models/smollm2-135m-instruct")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of mixed traffic (600 for the soak)")
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--settle", type=float, default=15.0)
    parser.add_argument("--slow-read-s", type=float, default=0.5)
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--url", help="an edge serve already running (then --key, and nothing is started)")
    parser.add_argument("--key", default=None)
    parser.add_argument("--server-arg", action="append", default=[], help="more `edge serve` arguments")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)

    proc = None
    key = args.key
    if args.url:
        url = args.url.rstrip("/")
        server_pid = None
    else:
        key = key or "serve-load-key"
        started = time.monotonic()
        proc, url = start_server(args.model, args.max_num_seqs, key, args.server_arg)
        server_pid = proc.pid
        print(f"edge serve ready at {url} in {time.monotonic() - started:.1f} s (pid {server_pid})", flush=True)
    report: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "clients": args.clients,
                              "duration_s": args.duration, "max_num_seqs": args.max_num_seqs,
                              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    failures: list[str] = []
    try:
        plan = json.loads(get(f"{url}/edge/plan", key))
        plan = plan.get("plan", plan)
        model = json.loads(get(f"{url}/v1/models", key))["data"][0]["id"]
        max_model_len = int(plan["session"]["max_model_len"])
        report["plan"] = {"predicted_peak_bytes": plan.get("predicted_peak_bytes"),
                          "admission_bytes": plan.get("admission_bytes"), "max_model_len": max_model_len,
                          "max_num_seqs": plan["session"]["max_num_seqs"]}
        if server_pid is None:
            server_pid = next((c.pid for c in psutil.net_connections("tcp") if c.laddr and c.status == "LISTEN"
                               and c.laddr.port == int(url.rsplit(":", 1)[1])), None)
        load = Load(url=url, key=key, model=model, max_model_len=max_model_len, slow_read_s=args.slow_read_s,
                    request_timeout_s=args.request_timeout)
        if args.warmup > 0:
            print(f"warm-up: {args.clients} clients for {args.warmup:.0f} s", flush=True)
            asyncio.run(load.run(args.clients, args.warmup, args.seed + 1))
            report["warmup"] = summarise(load.outcomes, args.warmup)
            load.outcomes = []
        idle_before = settle(url, key, args.settle)
        before = tree_reading(server_pid) if server_pid else None
        memory_before = json.loads(get(f"{url}/edge/memory", key))
        poller = MemoryPoller(url, key, server_pid)
        poller.start()
        print(f"soak: {args.clients} clients for {args.duration:.0f} s", flush=True)
        wall = asyncio.run(load.run(args.clients, args.duration, args.seed))
        traffic_end = metrics(url, key)
        idle_after = settle(url, key, args.settle)
        poller.stop()
        after = tree_reading(server_pid) if server_pid else None
        memory_after = json.loads(get(f"{url}/edge/memory", key))
        summary = summarise(load.outcomes, wall)
        summary["wall_s"] = wall
        generated = idle_after.get("vllm:generation_tokens_total", 0) - idle_before.get("vllm:generation_tokens_total", 0)
        summary["vllm_generated_tokens"] = generated
        summary["vllm_tokens_per_s"] = generated / wall if wall else None
        # vLLM 0.32 counts no finish reason for a request whose client left (request_success stays at 0 for
        # "abort"): the evidence is the tokens it generated after the clients left, and nothing left running.
        delivered = sum(o.tokens for o in load.outcomes if o.outcome in ("completed", "disconnected"))
        after_leaving = generated - delivered
        summary["tokens_after_clients_left"] = after_leaving
        report.update(
            soak=summary,
            vllm={"tokens_after_clients_left": after_leaving, "finished": {k: idle_after[k] - idle_before.get(k, 0) for k in idle_after
                                                   if k.startswith("finished:")},
                  "at_traffic_end": {k: traffic_end.get(k) for k in ("vllm:num_requests_running",
                                                                      "vllm:num_requests_waiting",
                                                                      "vllm:kv_cache_usage_perc")},
                  "idle_after": {k: idle_after.get(k) for k in ("vllm:num_requests_running",
                                                                "vllm:num_requests_waiting",
                                                                "vllm:kv_cache_usage_perc")}},
            memory={"readings": poller.readings, "above_plan": poller.above_plan, "poll_failures": poller.failed,
                    "max_measured_current_bytes": poller.max_current, "predicted_peak_bytes": poller.predicted,
                    "max_tree_pss_bytes": poller.max_tree_pss, "max_tree_pss_anon_bytes": poller.max_tree_anon,
                    "first_above": poller.first_above,
                    "edge_before": memory_before.get("memory", memory_before),
                    "edge_after": memory_after.get("memory", memory_after)},
            before=before, after=after)
        counts = summary["outcomes"]
        disconnected = counts.get("disconnected", 0)
        if counts.get("lost") or counts.get("hung"):
            failures.append(f"lost {counts.get('lost', 0)}, hung {counts.get('hung', 0)} (must be 0)")
        if summary["unexpected_refusals"]:
            failures.append(f"{len(summary['unexpected_refusals'])}+ requests refused that should have been "
                            f"served: {summary['unexpected_refusals'][0]['reason']}")
        if summary["too_long"] != summary["too_long_refused_4xx"]:
            failures.append(f"{summary['too_long'] - summary['too_long_refused_4xx']} over-long prompts not refused "
                            "with a 4xx that says why")
        if poller.above_plan:
            failures.append(f"{poller.above_plan} /edge/memory readings above the plan's predicted peak")
        idle = report["vllm"]["idle_after"]
        if idle.get("vllm:num_requests_running") or idle.get("vllm:num_requests_waiting") or \
                idle.get("vllm:kv_cache_usage_perc"):
            failures.append(f"vLLM not idle after the soak: {idle}")
        at_end = report["vllm"]["at_traffic_end"]
        if at_end.get("vllm:num_requests_running") or at_end.get("vllm:num_requests_waiting"):
            failures.append(f"vLLM still ran or queued requests when the last client had finished: {at_end}")
        if disconnected and after_leaving > disconnected * ABORT_SLACK_TOKENS:
            failures.append(f"vLLM generated {after_leaving:.0f} tokens after {disconnected} clients left "
                            f"(more than {ABORT_SLACK_TOKENS} each): disconnected requests were not aborted")
        if before and after:
            drift = (after["pss_bytes"] - before["pss_bytes"]) / before["pss_bytes"]
            report["drift"] = {"pss": drift, "fds": after["fds"] - before["fds"],
                               "threads": after["threads"] - before["threads"]}
            if abs(drift) > PSS_DRIFT_LIMIT or after["fds"] != before["fds"] or after["threads"] != before["threads"]:
                failures.append(f"drift after the soak: PSS {drift:+.2%}, open files {after['fds'] - before['fds']:+d}, "
                                f"threads {after['threads'] - before['threads']:+d}")
    finally:
        if proc is not None:
            code, out, err = stop_server(proc)
            report["server_exit"] = code
            report["server_stderr_tail"] = err[-2000:]
            if code != 0:
                failures.append(f"edge serve exited {code} on SIGTERM")
    report["failures"] = failures
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 1 if failures else 0


def print_table(report: dict[str, Any]) -> None:
    soak = report.get("soak")
    if not soak:
        print(json.dumps(report, indent=2, default=str))
        return
    counts = soak["outcomes"]

    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    rows = [
        ("clients / max_num_seqs", f"{report['clients']} / {report['max_num_seqs']}"),
        ("traffic", f"{soak['wall_s']:.0f} s ({report['duration_s']:.0f} s of new requests, then in-flight finished)"),
        ("requests", f"{soak['requests']}: completed {counts.get('completed', 0)}, refused with a reason "
                     f"{counts.get('refused', 0)}, disconnected by the client {counts.get('disconnected', 0)}, "
                     f"lost {counts.get('lost', 0)}, hung {counts.get('hung', 0)}"),
        ("by client kind", "; ".join(f"{k} {dict(v)}" for k, v in soak["by_kind"].items())),
        ("refused at the connection cap", f"{soak['refused_at_cap_503']} with 503 (each client then waited its "
                                          f"Retry-After): \"{(soak['refused_at_cap_reason'] or '')[:160]}\""),
        ("over-long prompts", f"{soak['too_long_refused_4xx']} of {soak['too_long']} refused 4xx: "
                              f"\"{(soak['too_long_reason'] or '')[:120]}\""),
        ("disconnects aborted in vLLM", f"{report['vllm']['tokens_after_clients_left']:.0f} tokens generated after "
                                        f"{counts.get('disconnected', 0)} clients left (each asked 512); running/"
                                        f"waiting when the last client finished: "
                                        f"{report['vllm']['at_traffic_end']['vllm:num_requests_running']:.0f}/"
                                        f"{report['vllm']['at_traffic_end']['vllm:num_requests_waiting']:.0f}"),
        ("idle after the settle", "running {:.0f}, waiting {:.0f}, KV cache usage {:.3f}".format(
            *(report["vllm"]["idle_after"][k] for k in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                                                         "vllm:kv_cache_usage_perc")))),
        ("TTFT p50 / p99 (streams)", f"{s(soak['ttft_p50_s'])} / {s(soak['ttft_p99_s'])}"),
        ("total p50 / p99 (streams)", f"{s(soak['total_p50_s'])} / {s(soak['total_p99_s'])}"),
        ("throughput", f"{soak['client_tokens_per_s']:.1f} tok/s completed at the clients, "
                       f"{soak['vllm_tokens_per_s']:.1f} tok/s generated by vLLM"),
        ("memory readings above plan", f"{report['memory']['above_plan']} of {report['memory']['readings']} "
                                       f"(max {report['memory']['max_measured_current_bytes'] / MIB:,.0f} MiB over "
                                       f"baseline vs predicted {(report['memory']['predicted_peak_bytes'] or 0) / MIB:,.0f} MiB)"),
    ]
    if report.get("drift"):
        b, a = report["before"], report["after"]
        rows.append(("server tree before -> after", f"PSS {b['pss_bytes'] / MIB:,.1f} -> {a['pss_bytes'] / MIB:,.1f} MiB "
                     f"({report['drift']['pss']:+.2%}; anonymous {b['pss_anon_bytes'] / MIB:,.1f} -> "
                     f"{a['pss_anon_bytes'] / MIB:,.1f}, file-backed {b['pss_file_bytes'] / MIB:,.1f} -> "
                     f"{a['pss_file_bytes'] / MIB:,.1f}), open files {b['fds']} -> {a['fds']}, "
                     f"threads {b['threads']} -> {a['threads']}"))
    print("| measure | value |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print("PASS" if not report["failures"] else "FAIL: " + "; ".join(report["failures"]))


if __name__ == "__main__":
    raise SystemExit(main())
