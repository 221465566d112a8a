"""What one open connection costs ``edge serve``: the server tree's PSS against the number of queued streams.

    python bench/serve_connections.py [--model DIR] [--max-num-seqs 8] [--levels 0,64,128,256]
                                      [--prompt-tokens 0] [--max-tokens 256] [--over-long 256] [--json FILE]

Starts ``edge serve`` (``bench/serve_load.py``'s start, ``--server-arg`` for
more flags; ``--max-connections`` twice the largest level unless given), sends a few requests to the end so that what grows once is in
the first reading, then holds ``K`` streaming clients open for each level of
``--levels`` in turn (ascending, on the same server: what a burst of ``K``
leaves is the high-water mark the next level starts from, as it is under
load). Each client sends a completion and reads it to the end, then sends
the next, so ``K`` connections stay open: ``--max-num-seqs`` of them run, the
rest wait in vLLM's queue. ``--prompt-tokens 0`` sends the load bench's short
chat prompts; ``N`` sends a text prompt of about ``N`` tokens (``hello``
repeated). At each level, once vLLM reports ``K`` requests running or waiting,
the tree's PSS per process (smaps_rollup; the median of five readings 0.5 s
apart). Then ``--over-long`` prompts longer than the context at once, each
answered 4xx by the front end, and one more reading: what refusing them
leaves behind.

Prints the readings and the least-squares slope of PSS against K (MiB per
connection) for the tree and for each process, which is what the plan's
per-connection term is built from (docs/benchmarks.md, "What an open
connection costs").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from serve_load import MIB, PROMPTS, get, metrics, rollup, start_server, stop_server, tree

#: Readings per level, and the gap between them: the median is what is kept.
READS = 5
READ_GAP_S = 0.5
#: Seconds a level may take to have every client's request running or waiting in vLLM.
LEVEL_TIMEOUT_S = 300


def tree_pss(pid: int) -> dict[str, int]:
    """PSS of every process of the tree by title (``edge`` for the root), summed as ``tree``: medians of reads."""
    reads: list[dict[str, int]] = []
    for _ in range(READS):
        row: dict[str, int] = {}
        for proc in tree(pid):
            try:
                title = "edge" if proc.pid == pid else Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(
                    b"\0")[0].decode(errors="replace").strip()
            except OSError:
                continue
            pss = rollup(proc.pid).get("Pss", 0)
            row[title] = row.get(title, 0) + pss
        row["tree"] = sum(row.values())
        reads.append(row)
        time.sleep(READ_GAP_S)
    keys = set().union(*reads)
    return {k: int(statistics.median(r.get(k, 0) for r in reads)) for k in keys}


def slope(xs: list[float], ys: list[float]) -> float | None:
    """The least-squares slope of ys against xs."""
    if len(xs) < 2:
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else None


class Clients:
    """``K`` streaming clients on one asyncio loop in a thread of their own; each keeps one request open."""

    def __init__(self, url: str, key: str, model: str, prompt_tokens: int, max_tokens: int):
        self.url, self.key, self.model = url, key, model
        self.prompt_tokens, self.max_tokens = prompt_tokens, max_tokens
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.tasks: list[Any] = []
        self.session: Any = None
        self.errors: list[str] = []
        self.completed = 0
        self.stopping = False

    def body(self, i: int) -> dict[str, Any]:
        prompt = PROMPTS[i % len(PROMPTS)] if not self.prompt_tokens else "hello " * self.prompt_tokens
        return {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "stream": True,
                "temperature": 0.7, "ignore_eos": True}  # no seed: vLLM CPU 0.32 dies on a seeded chunked prefill

    async def _client(self, i: int) -> None:
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
        headers = {"Authorization": f"Bearer {self.key}"}
        while not self.stopping:
            try:
                async with self.session.post(f"{self.url}/v1/completions", json=self.body(i), headers=headers) as r:
                    if r.status != 200:
                        self.errors.append(f"HTTP {r.status}: {(await r.text())[:200]}")
                        await asyncio.sleep(1)
                        continue
                    async for _ in r.content:
                        pass
                    self.completed += 1
            except Exception as exc:  # noqa: BLE001 — counted, the level's reading says how many were open
                if not self.stopping:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    await asyncio.sleep(1)

    def add(self, count: int) -> None:
        start = len(self.tasks)
        for i in range(start, start + count):
            self.tasks.append(asyncio.run_coroutine_threadsafe(self._client(i), self.loop))

    def close(self) -> None:
        self.stopping = True

        async def stop() -> None:
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            if self.session is not None:
                await self.session.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def over_long(url: str, key: str, model: str, count: int, tokens: int) -> dict[str, int]:
    """``count`` prompts of about ``tokens`` tokens at once: how many got a 4xx."""
    import aiohttp

    body = {"model": model, "prompt": "hello " * tokens, "max_tokens": 8}
    statuses: dict[str, int] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            async with session.post(f"{url}/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {key}"}) as r:
                await r.read()
                statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1

        await asyncio.gather(*(one() for _ in range(count)))
    return statuses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/work/models/smollm2-135m-instruct")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--levels", default="0,64,128,256", help="open connections at each reading, ascending")
    parser.add_argument("--prompt-tokens", type=int, default=0, help="0: the load bench's chat prompts")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--over-long", type=int, default=0, help="prompts longer than the context sent at once, after")
    parser.add_argument("--server-arg", action="append", default=[], help="more `edge serve` arguments")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    levels = sorted(int(k) for k in args.levels.split(","))

    key = "serve-connections-key"
    server_args = list(args.server_arg)
    if not any(a.startswith("--max-connections") for a in server_args):  # room for the largest level, and more
        server_args.append(f"--max-connections={2 * max(levels + [args.over_long, 1])}")
    proc, url = start_server(args.model, args.max_num_seqs, key, server_args)
    report: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]),
                              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "levels": []}
    clients = None
    try:
        plan = json.loads(get(f"{url}/edge/plan", key))
        plan = plan.get("plan", plan)
        max_model_len = int(plan["session"]["max_model_len"])
        report["plan"] = {"predicted_peak_bytes": plan.get("predicted_peak_bytes"), "max_model_len": max_model_len,
                          "reservations": {r["purpose"]: r["bytes"] for r in plan["reservations"]}}
        model = json.loads(get(f"{url}/v1/models", key))["data"][0]["id"]
        clients = Clients(url, key, model, args.prompt_tokens, args.max_tokens)
        clients.add(args.max_num_seqs)  # warm-up: every path a request takes, once
        deadline = time.monotonic() + LEVEL_TIMEOUT_S
        while clients.completed < 2 * args.max_num_seqs and time.monotonic() < deadline:
            time.sleep(0.5)
        clients.close()
        clients = Clients(url, key, model, args.prompt_tokens, args.max_tokens)
        deadline = time.monotonic() + LEVEL_TIMEOUT_S
        while time.monotonic() < deadline:
            now = metrics(url, key)
            if not now.get("vllm:num_requests_running") and not now.get("vllm:num_requests_waiting"):
                break
            time.sleep(0.5)
        time.sleep(3)
        for level in levels:
            clients.add(level - len(clients.tasks))
            deadline = time.monotonic() + LEVEL_TIMEOUT_S
            while time.monotonic() < deadline:
                now = metrics(url, key)
                open_ = now.get("vllm:num_requests_running", 0) + now.get("vllm:num_requests_waiting", 0)
                if open_ >= level:
                    break
                time.sleep(0.5)
            time.sleep(3)
            now = metrics(url, key)
            reading = tree_pss(proc.pid)
            row = {"connections": level, "running": now.get("vllm:num_requests_running"),
                   "waiting": now.get("vllm:num_requests_waiting"), "pss_bytes": reading}
            report["levels"].append(row)
            print(f"K={level:4d} running {row['running']:.0f} waiting {row['waiting']:.0f}: tree "
                  f"{reading['tree'] / MIB:,.1f} MiB; " + ", ".join(
                      f"{k} {v / MIB:,.1f}" for k, v in sorted(reading.items()) if k != "tree"), flush=True)
        clients.close()
        clients = None
        if args.over_long:
            statuses = asyncio.run(over_long(url, key, model, args.over_long, max_model_len + 64))
            time.sleep(3)
            reading = tree_pss(proc.pid)
            report["over_long"] = {"count": args.over_long, "statuses": statuses, "pss_bytes": reading}
            print(f"{args.over_long} over-long prompts at once ({statuses}): tree {reading['tree'] / MIB:,.1f} MiB",
                  flush=True)
    finally:
        if clients is not None:
            clients.close()
        report["server_exit"] = stop_server(proc)[0]
    xs = [float(r["connections"]) for r in report["levels"]]
    names = set().union(*(r["pss_bytes"] for r in report["levels"])) if report["levels"] else set()
    report["slope_bytes_per_connection"] = {
        name: slope(xs, [float(r["pss_bytes"].get(name, 0)) for r in report["levels"]]) for name in sorted(names)}
    for name, value in report["slope_bytes_per_connection"].items():
        print(f"slope {name}: {'-' if value is None else f'{value / 1024:,.1f} KiB'} per connection")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
