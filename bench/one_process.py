"""`edge run` for one user against plain vLLM at the same arguments: first token, decode, tree PSS, tokens (issue 38).

One checkpoint, one prompt, greedy with ``ignore_eos``. Each pair runs two
commands one after the other, in alternating order (odd pairs edge first):

* edge: ``edge run --model M --max-model-len L --prompt P --max-tokens N --ignore-eos --raw``
  exactly as a person runs it (text mode, the plan printed, then the tokens
  streamed to stdout);
* plain: this script as a child, which applies edge's runtime environment
  *without* edge's engine mark (``apply_runtime_env(edge_engine=False)``: none of
  edge-cpu's levers act) and the plan's process layout (``execution.env``), then
  drives ``vllm.LLM(**engine_kwargs)``'s own engine step by step and writes each
  token to stdout as it comes. ``engine_kwargs`` and ``execution.env`` are the
  plan's (``edge plan --json`` with the same flags), so both run vLLM with the
  same engine arguments in the same process layout; ``--plain-layout separate``
  runs plain vLLM in its own default layout instead (engine core and worker
  apart, its own thread binding), which is what a user gets from ``vllm``.

Measured from outside each command: seconds from starting the command to its
first token on stdout (edge: the first bytes after the plan), and the peak
tree PSS of the command's process tree (every process, every 0.1 s). From
inside: decode tok/s as edge reports it (tokens after the first over the time
from the first to the last), the same formula in the plain child, and the
token ids (edge's from a ``--json`` run of the same command at the end, with
``--ids``). ``--report FILE`` prints medians and ratios of a results file.

    /work/bin/engine-lock measure python bench/one_process.py --model /work/models/smollm2-135m-instruct \
        --pairs 3 --results /tmp/op/r.jsonl
    python bench/one_process.py --report /tmp/op/r.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_vs_vllm import tree_pss  # noqa: E402 - one tree-PSS reading for both benchmarks

MIB = 1 << 20
PROMPT = "The capital of France is Paris. The capital of Germany is"
#: edge run's summary line: "tokens    128 (...); engine start 3.1 s, first token 0.041 s, decode 27.3 tok/s".
SUMMARY = re.compile(r"^tokens\s+(\d+) .*decode ([0-9.]+|-) tok/s", re.M)


def plan_of(edge: str, model: str, max_model_len: int, extra: list[str]) -> dict:
    out = subprocess.run([edge, "plan", "--model", model, "--max-model-len", str(max_model_len), "--json", *extra],
                         capture_output=True, text=True, check=False)
    plan = json.loads(out.stdout)
    if not plan.get("admitted"):
        raise SystemExit(f"edge plan refused {model}: {plan.get('refusals')}")
    return plan


# ---------------------------------------------------------------- the plain child


def child(kwargs: dict, layout_env: dict, prompt: str, max_tokens: int) -> None:
    from edge_core.runtime.env import apply_runtime_env

    apply_runtime_env(edge_engine=False, layout_env=layout_env, layout_why="the plan's")
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    llm = LLM(**kwargs)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    ids: list[int] = []
    first = last = None
    first_count = 0
    engine.add_request("0", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            delta = out.outputs[0]
            if not delta.token_ids:
                continue
            now = time.perf_counter()
            if first is None:
                first, first_count = now, len(delta.token_ids)
            last = now
            ids.extend(delta.token_ids)
            sys.stdout.write(delta.text)
            sys.stdout.flush()
    rate = (len(ids) - first_count) / (last - first) if first is not None and last is not None and last > first else 0
    sys.stdout.write(f"\nRESULT {json.dumps({'token_ids': ids, 'decode_tok_s': rate})}\n")
    sys.stdout.flush()
    engine.engine_core.shutdown()


# ---------------------------------------------------------------- from outside


def watched(cmd: list[str], env: dict, first_after: str | None) -> dict:
    """Run ``cmd``; the seconds to its first output after the line ``first_after`` (None: the first byte), its
    tree-PSS peak (0.1 s), and its stdout."""
    started = time.monotonic()
    peak = [0]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as proc:
        root = psutil.Process(proc.pid)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], tree_pss(root))
                stop.wait(0.1)

        errors: list[bytes] = []
        threading.Thread(target=lambda: errors.append(proc.stderr.read()), daemon=True).start()  # type: ignore[union-attr]
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        out = bytearray()
        first_s = None
        assert proc.stdout is not None
        while chunk := os.read(proc.stdout.fileno(), 65536):
            out += chunk
            if first_s is None:
                text = out.decode("utf-8", "replace")
                after = text.split(first_after, 1)[1] if first_after is not None and first_after in text else (
                    text if first_after is None else "")
                if after.strip():
                    first_s = time.monotonic() - started
        proc.wait()
        stop.set()
        sampler.join()
    text = out.decode("utf-8", "replace")
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:3]} exited {proc.returncode}:\n{text[-2000:]}\n{b''.join(errors).decode()[-3000:]}")
    return {"first_token_s": first_s, "peak_pss": peak[0], "wall_s": time.monotonic() - started, "stdout": text}


def run_edge(args: argparse.Namespace) -> dict:
    # --raw: the prompt as it is, as the plain child sends it (edge run's default is the model's chat template).
    cmd = [args.edge, "run", "--model", args.model, "--max-model-len", str(args.max_model_len), "--prompt",
           args.prompt, "--max-tokens", str(args.max_tokens), "--ignore-eos", "--raw", *args.edge_arg]
    found = watched(cmd, dict(os.environ), first_after="nothing loaded\n\n")  # the plan's last line, then a blank
    match = SUMMARY.search(found["stdout"])
    if match is None:
        raise SystemExit(f"no summary line in edge run's output:\n{found['stdout'][-2000:]}")
    found.update(tokens=int(match[1]), decode_tok_s=float(match[2]) if match[2] != "-" else 0.0)
    return found


def run_plain(args: argparse.Namespace, plan: dict) -> dict:
    layout = plan["execution"]["env"] if args.plain_layout == "plan" else {}
    kwargs = dict(plan["engine_kwargs"])
    if args.plain_layout == "separate":
        kwargs.pop("distributed_executor_backend", None)
        layout = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cmd = [sys.executable, __file__, "--child", json.dumps({"kwargs": kwargs, "env": layout}), "--prompt", args.prompt,
           "--max-tokens", str(args.max_tokens)]
    found = watched(cmd, dict(os.environ), first_after=None)
    line = next(line for line in found["stdout"].splitlines() if line.startswith("RESULT "))
    found.update(json.loads(line[7:]))
    found["tokens"] = len(found["token_ids"])
    return found


def edge_ids(args: argparse.Namespace) -> list[int]:
    out = subprocess.run([args.edge, "run", "--model", args.model, "--max-model-len", str(args.max_model_len),
                          "--prompt", args.prompt, "--max-tokens", str(args.max_tokens), "--ignore-eos", "--raw",
                          *args.edge_arg, "--json"], capture_output=True, text=True, check=True)
    return list(json.loads(out.stdout)["token_ids"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/models/smollm2-135m-instruct")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--first-pair", type=int, default=1, help="number of the first pair (its parity sets the order)")
    ap.add_argument("--edge", default=str(Path(sys.executable).with_name("edge")))
    ap.add_argument("--edge-arg", action="append", default=[], help="one more `edge run` argument (repeatable)")
    ap.add_argument("--plain-layout", choices=("plan", "separate"), default="plan",
                    help="plain vLLM in the plan's process layout (default) or in vLLM's own (engine core apart)")
    ap.add_argument("--ids", action="store_true", help="also compare edge's token ids (one more `edge run --json`)")
    ap.add_argument("--results", type=Path, help="append one JSON line per pair here")
    ap.add_argument("--report", type=Path, help="print the medians of a --results file and exit")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        child(spec["kwargs"], spec["env"], args.prompt, args.max_tokens)
        return 0
    if args.report:
        return report(args.report)
    plan = plan_of(args.edge, args.model, args.max_model_len, args.edge_arg)
    for pair in range(args.first_pair, args.first_pair + args.pairs):
        order = ("edge", "plain") if pair % 2 else ("plain", "edge")
        runs = {side: (run_edge(args) if side == "edge" else run_plain(args, plan)) for side in order}
        edge, plain = runs["edge"], runs["plain"]
        row = {"model": args.model, "pair": pair, "order": list(order), "max_model_len": args.max_model_len,
               "max_tokens": args.max_tokens, "plain_layout": args.plain_layout, "edge_args": args.edge_arg,
               "execution": plan["execution"], "engine_kwargs": plan["engine_kwargs"],
               "decode_ratio": edge["decode_tok_s"] / plain["decode_tok_s"] if plain["decode_tok_s"] else None,
               "first_token_ratio": edge["first_token_s"] / plain["first_token_s"],
               "peak_ratio": edge["peak_pss"] / plain["peak_pss"],
               **{f"{side}_{key}": runs[side][key] for side in runs
                  for key in ("first_token_s", "decode_tok_s", "peak_pss", "wall_s", "tokens")}}
        print(f"pair {pair} ({' then '.join(order)}): first token {edge['first_token_s']:.2f} / "
              f"{plain['first_token_s']:.2f} s (edge / plain), decode {edge['decode_tok_s']:.1f} / "
              f"{plain['decode_tok_s']:.1f} tok/s ({row['decode_ratio']:.3f}), tree PSS peak "
              f"{edge['peak_pss'] / MIB:,.0f} / {plain['peak_pss'] / MIB:,.0f} MiB", flush=True)
        if args.results:
            with args.results.open("a") as f:
                f.write(json.dumps(row) + "\n")
    if args.ids:
        ours, theirs = edge_ids(args), run_plain(args, plan)["token_ids"]
        same = ours == theirs
        print(f"token ids: {'identical' if same else 'DIFFER'} ({len(ours)} / {len(theirs)})", flush=True)
        if args.results:
            with args.results.open("a") as f:
                f.write(json.dumps({"model": args.model, "ids_identical": same, "edge_ids": ours,
                                    "plain_ids": theirs}) + "\n")
    return 0


def report(path: Path) -> int:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    pairs = [r for r in rows if "pair" in r]
    groups: dict[tuple, list[dict]] = {}
    for r in pairs:
        groups.setdefault((r["model"], r["plain_layout"], " ".join(r["edge_args"])), []).append(r)
    print("| model | plain layout | edge args | pairs | first token edge / plain (s) | decode edge / plain (tok/s) "
          "| decode ratio | tree PSS peak edge / plain (MiB) |\n|---|---|---|---|---|---|---|---|")
    for (model, layout, extra), rs in groups.items():
        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] for r in rs)
        ratios = ", ".join(f"{r['decode_ratio']:.3f}" for r in rs)
        print(f"| {Path(model).name} | {layout} | {extra or '-'} | {len(rs)} | {med('edge_first_token_s'):.2f} / "
              f"{med('plain_first_token_s'):.2f} | {med('edge_decode_tok_s'):.1f} / {med('plain_decode_tok_s'):.1f} | "
              f"**{med('decode_ratio'):.3f}** ({ratios}) | {med('edge_peak_pss') / MIB:,.0f} / "
              f"{med('plain_peak_pss') / MIB:,.0f} |")
    for r in rows:
        if "ids_identical" in r:
            print(f"token ids {Path(r['model']).name}: {'identical' if r['ids_identical'] else 'DIFFER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
