"""What ``edge serve``'s vLLM CPU worker keeps for every batch size it has run, and what bounding it costs.

    python bench/serve_shapes.py [--model DIR] [--distinct 600] [--cycle 64] [--rounds 4]
                                 [--env NAME=VALUE ...] [--json FILE]

vLLM CPU runs each linear layer through a oneDNN matmul primitive made for
the number of rows of the batch (M: the tokens of one forward pass); vLLM
keeps the last 32 primitives per weight shape (``create_onednn_mm(..., 32)``,
an LRU keyed by M) and oneDNN keeps the primitives it made in its own global
cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, 1024 by default). A server whose
requests come in many lengths makes a primitive per new M, and the worker's
memory grows with them.

Starts ``edge serve`` (``bench/serve_load.py``'s start; ``--env`` sets
variables in its environment, ``--server-arg`` adds flags) and sends one
request at a time, ``max_tokens 1``, each prompt random token ids so that no
prefix is cached and the forward pass has exactly the prompt's tokens:

1. 200 requests of one length: what repeating one M costs (nothing, expected);
2. ``--distinct`` requests of lengths never seen before (101..2047, shuffled):
   the tree's PSS per process every 100, the worker's growth;
3. ``--rounds`` rounds over ``--cycle`` lengths (more than vLLM's 32 per shape,
   fewer than oneDNN's cache holds): seconds per request in each round after
   the first, what a smaller oneDNN cache costs when Ms come back.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from serve_load import MIB, get, rollup, start_server, stop_server, tree


def post(url: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Authorization": f"Bearer {key}", "content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:  # noqa: S310 — our own loopback server
        return dict(json.loads(answer.read()))


def pss_by_title(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for proc in tree(pid):
        try:
            title = "edge" if proc.pid == pid else Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(
                b"\0")[0].decode(errors="replace").strip().rsplit("/", 1)[-1]
        except OSError:
            continue
        out[title] = out.get(title, 0) + rollup(proc.pid).get("Pss", 0)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/work/models/smollm2-135m-instruct")
    parser.add_argument("--distinct", type=int, default=600)
    parser.add_argument("--cycle", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--server-arg", action="append", default=[])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(argv)
    for item in args.env:
        name, _, value = item.partition("=")
        os.environ[name] = value

    key = "serve-shapes-key"
    proc, url = start_server(args.model, 8, key, args.server_arg)
    report: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "env": args.env,
                              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "readings": []}
    rng = random.Random(args.seed)
    try:
        model = json.loads(get(f"{url}/v1/models", key))["data"][0]["id"]

        def one(tokens: int) -> float:
            started = time.monotonic()
            post(url, key, {"model": model, "prompt": [rng.randint(1000, 40000) for _ in range(tokens)],
                            "max_tokens": 1})
            return time.monotonic() - started

        def read(label: str, seen: int) -> None:
            time.sleep(1)
            reading = pss_by_title(proc.pid)
            report["readings"].append({"phase": label, "distinct_m": seen, "pss_bytes": reading})
            print(f"{label:>10} {seen:4d} distinct M: " + ", ".join(
                f"{k} {v / MIB:,.1f}" for k, v in sorted(reading.items())) + " MiB", flush=True)

        for _ in range(5):
            one(100)
        read("start", 2)
        for _ in range(200):
            one(100)
        read("same M", 2)
        lengths = list(range(101, 2048, 2))
        rng.shuffle(lengths)
        for i, tokens in enumerate(lengths[:args.distinct], 1):
            one(tokens)
            if i % 100 == 0 or i == args.distinct:
                read("distinct", 2 + i)
        cycle = lengths[args.distinct:args.distinct + args.cycle]
        rounds = []
        for r in range(args.rounds):
            rounds.append(statistics.fmean(one(tokens) for tokens in cycle))
            print(f"round {r + 1} over {len(cycle)} lengths: {rounds[-1] * 1000:.1f} ms per request", flush=True)
        read("cycled", 2 + args.distinct + len(cycle))
        report["round_mean_s"] = rounds
        report["repeat_mean_s"] = statistics.fmean(rounds[1:]) if len(rounds) > 1 else None
    finally:
        report["server_exit"] = stop_server(proc)[0]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
