"""Two nodes in two network namespaces, and what each fault does to them: the fault table of docs/benchmarks.md.

Each fault starts its own pair (tests/netns.py: two namespaces joined by a
veth pair, a private /dev/shm each, node 0 on core 0 and node 1 on core 1,
``edge serve --nnodes 2`` TP 2 on the demo, the head serving at its veth
address) and reports what happened, the seconds from the fault to each node's
named exit, and what was left running in either namespace::

    /work/bin/engine-lock measure .venv/bin/python bench/nodes_faults.py [--faults link_down,late_node,...]
         [--json OUT]      # as root

Faults: ``link_down`` (node 1's veth taken down mid-stream), ``late_node``
(node 1 started 60 s after the head), ``twice`` (a second node 1 while the
first serves), ``master_port_taken`` (vLLM's master port held on the head's
host before it starts), ``no_route`` (node 1 given a master address its host
has no route to), ``latency`` (decode tok/s on the veth, then on a user-space
wire between two TUN devices without and with 50 ms added to every packet from
node 1 to the head: this kernel has no netem). Needs root; says why not
otherwise (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from netns import Namespaces, Pair, launch_node, launch_pair, start_pair, unavailable  # noqa: E402

from edge_core.artifact import DEMO_MODEL  # noqa: E402

#: The model and layout every pair runs (tiny-llama: 4 heads and 2 KV heads split across TP 2); ``--model`` and
#: ``--layout`` change them (SmolLM2-135M: ``--layout "--pipeline-parallel-size 2"``, its 9 heads do not split).
MODEL_ARGS = ["--model", str(DEMO_MODEL), "--tensor-parallel-size", "2"]
#: The model's directory (None: tiny-llama) and the name the pair serves it under (the directory's name).
MODEL: str | None = None
SERVED = "tiny-llama"
PROMPT = "The gateway box in the cupboard has sixteen gigabytes of memory and"
#: Seconds to wait for a node to end after a fault before calling it hung.
EXIT_WAIT_S = 120


def wait_exits(pair: Pair, since: float, timeout_s: float = EXIT_WAIT_S,
               which: tuple[str, ...] = ("head", "node")) -> dict[str, Any]:
    """Each node's exit code and seconds since ``since`` (None: still running after ``timeout_s``); waits for
    those in ``which``."""
    out: dict[str, Any] = {}
    deadline = since + timeout_s
    while time.monotonic() < deadline and any(k not in out for k in which):
        for name, proc in (("head", pair.head), ("node", pair.node)):
            if name not in out and proc.poll() is not None:
                out[name] = {"rc": proc.returncode, "s": round(time.monotonic() - since, 1)}
        time.sleep(0.1)
    for name in ("head", "node"):
        out.setdefault(name, {"rc": None, "s": None})
    return out


def named(err: str) -> str | None:
    """The ``edge: CODE: message`` line a node ended with, if any."""
    codes = ("node_lost", "head_lost", "node_unreachable", "master_port_in_use", "node_rank_taken", "head_failed",
             "node_join_timeout", "head_refused", "node_refused")
    for line in reversed(err.splitlines()):
        for code in codes:
            if line.startswith(f"edge: {code}:") or f"[{code}]" in line:
                return line.strip()[:300]
    return None


def left(pair: Pair) -> dict[str, list[int]]:
    return {"head": pair.spaces.running(pair.spaces.head), "node": pair.spaces.running(pair.spaces.node)}


def greedy(pair: Pair, tokens: int = 8) -> list[int]:
    answer = pair.complete({"model": SERVED, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True})
    return list(answer["choices"][0]["token_ids"])


def decode_rate(pair: Pair, tokens: int) -> float:
    """Decode tokens/s of one greedy stream: chunks after the first over the time they took."""
    client = pair.post("/v1/completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": tokens,
                                           "temperature": 0, "ignore_eos": True, "stream": True}, 600)
    out, _ = client.communicate(timeout=900)
    stamps = [float(line.split(" ", 1)[0]) for line in out.splitlines()
              if line[:1].isdigit() and '"text"' in line]
    return round((len(stamps) - 1) / (stamps[-1] - stamps[0]), 2)


def stopped(pair: Pair) -> dict[str, Any]:
    """SIGTERM to the head; each node's exit and seconds, and what was left in either namespace."""
    since = time.monotonic()
    pair.head.terminate()
    exits = wait_exits(pair, since)
    return {"stop": exits, "left": left(pair)}


def fault_link_down(tmp: Path) -> dict[str, Any]:
    """Node 1's veth taken down while the head streams a long completion."""
    with Namespaces("l") as spaces:
        pair = start_pair(spaces, tmp / "link_down", MODEL_ARGS, port=8101, master_port=29601)
        client = pair.post("/v1/completions", {"model": SERVED, "prompt": PROMPT, "max_tokens": 480,
                                               "temperature": 0, "ignore_eos": True, "stream": True}, 300)
        assert client.stdout is not None
        chunks = [client.stdout.readline() for _ in range(5)]
        since = time.monotonic()
        spaces.set_link(spaces.node, up=False)
        exits = wait_exits(pair, since)
        rest, _ = client.communicate(timeout=60)
        still = left(pair)
        pair.stop()
    return {"fault": "link down mid-stream (node 1's veth)", "exits": exits,
            "client_end": [line[:200] for line in rest.splitlines() if line.partition(" ")[2].strip()
                           or line.startswith(("END", "ERROR"))][-3:],
            "streamed_before": len(chunks),
            "head_says": named(pair.err("head")), "node_says": named(pair.err("node")), "left": still,
            "left_after_cleanup": spaces.left}


def fault_late_node(tmp: Path, delay_s: float = 60.0) -> dict[str, Any]:
    """Node 1 started ``delay_s`` after the head: the head waits (up to its join timeout), then serves."""
    with Namespaces("n") as spaces:
        pair = start_pair(spaces, tmp / "late_node", MODEL_ARGS, port=8102, master_port=29611, node_delay_s=delay_s)
        ready_after_node = round(pair.ready_s - delay_s, 1)
        ids = greedy(pair)
        end = stopped(pair)
    return {"fault": f"node 1 started {delay_s:.0f} s after the head", "ready_s": round(pair.ready_s, 1),
            "ready_after_node_s": ready_after_node, "greedy_ids": ids, **end, "left_after_cleanup": spaces.left}


def fault_twice(tmp: Path) -> dict[str, Any]:
    """A second node 1 started while the first serves: it is turned away by name, the first keeps serving."""
    with Namespaces("t") as spaces:
        pair = start_pair(spaces, tmp / "twice", MODEL_ARGS, port=8103, master_port=29621)
        before = greedy(pair)
        common = [*MODEL_ARGS, "--nnodes", "2", "--master-port", "29621", "--max-model-len", "512", "--json",
                  "--master-addr", spaces.head_ip, "--node-rank", "1"]
        since = time.monotonic()
        second = launch_node(spaces, pair.logs, "node2", common)
        second.wait(120)
        second_s = round(time.monotonic() - since, 1)
        after = greedy(pair)
        end = stopped(pair)
    return {"fault": "a second node 1 while the first serves", "second": {"rc": second.returncode, "s": second_s},
            "second_says": named(pair.err("node2")), "head_says": [line for line in pair.err("head").splitlines()
                                                                  if "turned away" in line][:1],
            "first_still_serves": before == after, **end, "left_after_cleanup": spaces.left}


def fault_master_port_taken(tmp: Path) -> dict[str, Any]:
    """vLLM's master port held by another process on the head's host before the nodes start."""
    with Namespaces("m") as spaces:
        holder = subprocess.Popen(["ip", "netns", "exec", spaces.head, sys.executable, "-c",
                                   "import socket, time; s = socket.create_server(('', 29631)); print('up', flush=True);"
                                   " time.sleep(600)"], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "up"
        pair = launch_pair(spaces, tmp / "master_port", MODEL_ARGS, port=8104, master_port=29631)
        exits = wait_exits(pair, pair.started)
        still = left(pair)
        holder.kill()
        holder.wait(10)
        pair.stop()
    return {"fault": "master port held on the head's host", "holder_pid": holder.pid, "exits": exits,
            "head_says": named(pair.err("head")), "node_says": named(pair.err("node")),
            "left": {k: [p for p in v if p != holder.pid] for k, v in still.items()},
            "left_after_cleanup": spaces.left}


def fault_no_route(tmp: Path) -> dict[str, Any]:
    """Node 1 given a master address its host has no route to (the head's is right): refused before it loads."""
    with Namespaces("r") as spaces:
        pair = launch_pair(spaces, tmp / "no_route", MODEL_ARGS, port=8105, master_port=29641,
                           node_args=["--master-addr", "10.232.0.1"])
        node_exit = wait_exits(pair, pair.started, timeout_s=90, which=("node",))["node"]
        end = stopped(pair)
    return {"fault": "node 1 has no route to --master-addr", "node_exit": node_exit,
            "node_says": named(pair.err("node")), **end, "left_after_cleanup": spaces.left}


def fault_latency(tmp: Path, delay_ms: float = 50.0, tokens: int = 48) -> dict[str, Any]:
    """The pair on the veth, then on a user-space wire without and with ``delay_ms`` added to every packet from
    node 1 to the head (netem's ``delay`` on node 1's end): decode tok/s of each."""
    rates: dict[str, Any] = {}
    for label, delay in (("veth", None), ("wire, 0 ms", (0.0, 0.0)), (f"wire, {delay_ms:.0f} ms", (0.0, delay_ms))):
        with Namespaces("d", wire_delay_ms=delay) as spaces:
            logs = tmp / f"latency-{'veth' if delay is None else f'{delay[1]:.0f}'}"
            pair = start_pair(spaces, logs, MODEL_ARGS, port=8106, master_port=29651)
            ids = greedy(pair)
            rate = decode_rate(pair, tokens)
            end = stopped(pair)
        rates[label] = {"ready_s": round(pair.ready_s, 1), "decode_tok_s": rate, "greedy_ids": ids, **end,
                        "left_after_cleanup": spaces.left}
    return {"fault": f"{delay_ms:.0f} ms added to node 1 -> head", "runs": rates}


def fault_none(tmp: Path, tokens: int = 16) -> dict[str, Any]:
    """No fault: the pair's greedy answer against one node's (``edge run`` of the same model, prompt and tokens)."""
    one = subprocess.run([sys.executable, "-m", "edge_core", "run", *(["--model", MODEL] if MODEL else []),
                          "--prompt", PROMPT, "--max-tokens", str(tokens), "--ignore-eos", "--max-model-len", "512",
                          "--json"], capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    record = json.loads(one.stdout) if one.returncode == 0 else {"error": one.stderr[-2000:]}
    with Namespaces("o") as spaces:
        pair = start_pair(spaces, tmp / "none", MODEL_ARGS, port=8107, master_port=29661)
        answer = pair.complete({"model": SERVED, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0,
                                "ignore_eos": True, "return_token_ids": True})["choices"][0]
        end = stopped(pair)
    return {"fault": "none: two namespaces against one node", "layout": MODEL_ARGS, "ready_s": round(pair.ready_s, 1),
            "pair_text": answer["text"], "one_node_text": record.get("text"), "one_node_error": record.get("error"),
            "one_node_decode_tok_s": (record.get("timings") or {}).get("decode_tokens_per_s"),
            "same_ids": answer["token_ids"] == record.get("token_ids"), **end, "left_after_cleanup": spaces.left}


FAULTS = {"none": fault_none, "link_down": fault_link_down, "late_node": fault_late_node, "twice": fault_twice,
          "master_port_taken": fault_master_port_taken, "no_route": fault_no_route, "latency": fault_latency}


def main() -> int:
    global MODEL, MODEL_ARGS, SERVED, PROMPT
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    parser.add_argument("--json", metavar="OUT", help="write the rows as JSON here")
    parser.add_argument("--model", metavar="DIR", help="the model every pair serves (default: tiny-llama, random weights)")
    parser.add_argument("--layout", default="--tensor-parallel-size 2", help="the layout flags across the two nodes")
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args()
    MODEL = os.path.abspath(args.model) if args.model else str(DEMO_MODEL)
    MODEL_ARGS = [*(["--model", MODEL] if MODEL else []), *args.layout.split()]
    SERVED = Path(args.model).name if args.model else SERVED
    PROMPT = args.prompt
    why = unavailable()
    if why is not None:
        print(f"skipped: {why}", file=sys.stderr)
        return 2
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="edge-nodes-faults-"))
    os.environ.setdefault("EDGE_LEDGER_DIR", str(tmp / "ledger"))
    for name in args.faults.split(","):
        started = time.monotonic()
        try:
            row = FAULTS[name](tmp)
        except Exception as exc:  # noqa: BLE001 — one fault's failure is its row; the others still run
            row = {"fault": name, "error": f"{type(exc).__name__}: {exc}"[:4000]}
        row["wall_s"] = round(time.monotonic() - started, 1)
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"logs: {tmp}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
