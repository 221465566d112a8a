"""Plain vLLM CPU against edge's engine at the same engine arguments: tree-PSS peak, speed, token ids (issue 26).

One checkpoint, one set of engine arguments (``engine_kwargs`` from ``edge plan
--json`` at ``--max-model-len``, plus ``load_format="dummy"``: vLLM fills the
weights with its seeded random values, the same in both runs), two engines, one
at a time, in alternating order (pair 1 plain first, pair 2 edge first, ...).
Each engine runs in a child process of this script with edge's runtime
environment (``edge_core.runtime.env``) and the plan's process layout (its
``execution.env``: one process for one vLLM CPU rank, as ``edge run`` runs it);
what differs is edge's engine mark (``EDGE_ENGINE``): the edge run has it, as
every engine edge starts, so edge-cpu's vLLM plugins act (heap trim, packing
levers; ``--edge-env EDGE_CPU_ONE_TABLE=0`` turns one off); the plain run
has not, so none of them does and vLLM is as it ships (edge-cpu's AMX
permission request excepted: a fix vLLM needs on AMX hosts, not a lever,
plugins/edge_cpu/README.md). From outside both, the child's process tree is
sampled every 0.1 s for PSS. Each child measures

* prefill: a ``--prefill-tokens`` (1,024) token prompt, one output token, median of
  ``--prefill-repeats`` (3) after one unmeasured warm-up; each repeat is a different prompt (the same
  ones in both runs), so vLLM's prefix cache (on by default; CPU blocks of 128 tokens) serves none of
  it: a repeated prompt would recompute only its last block. The tree's minor page faults
  (``/proc/PID/stat`` minflt, every process) are counted over each measured prefill;
* decode: ``--decode-tokens`` (32) greedy tokens after a short prompt, less that
  prompt's one-token time, best of 2;
* token ids: 3 prompts x 24 greedy tokens (``ignore_eos``), compared between the two runs.

    python bench/memory_vs_vllm.py --out /tmp/mvv --sizes 0.6b-tied --pairs 1 --results /tmp/mvv/r.jsonl
    python bench/memory_vs_vllm.py --report /tmp/mvv/r.jsonl

Geometries are bench/budget_by_size.py's header-only Qwen3 checkpoints (its
``--sizes`` names, plus ``0.6b-tied``: Qwen3-0.6B as published, tied) and
``llama-1b-untied`` (Llama-3.2-1B's geometry with its LM head stored). On a
shared host speed ratios are noisy: alternate, take medians (``--report``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_by_size as sizes  # noqa: E402 - the checkpoint writer shared with that benchmark

MIB = 1 << 20
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
SIZES = dict(sizes.SIZES, **{"0.6b-tied": (1024, 3072, 151936, True, 1)})
#: Llama-3.2-1B's geometry with its LM head stored (untied): 16 layers, 32 heads and 8 KV heads of 64.
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "bos_token_id": 1,
    "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": False, "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 128256,
}


def llama_tensors(c: dict) -> dict[str, list[int]]:
    h, hd, inter, vocab = c["hidden_size"], c["head_dim"], c["intermediate_size"], c["vocab_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    t: dict[str, list[int]] = {"model.embed_tokens.weight": [vocab, h]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t.update({
            p + "input_layernorm.weight": [h], p + "post_attention_layernorm.weight": [h],
            p + "self_attn.q_proj.weight": [q, h], p + "self_attn.k_proj.weight": [kv, h],
            p + "self_attn.v_proj.weight": [kv, h], p + "self_attn.o_proj.weight": [h, q],
            p + "mlp.gate_proj.weight": [inter, h], p + "mlp.up_proj.weight": [inter, h],
            p + "mlp.down_proj.weight": [h, inter],
        })
    t["model.norm.weight"] = [h]
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = [vocab, h]
    return t


def build(out: Path, name: str) -> Path:
    if name in sizes.SIZES:
        return sizes.build(out, name)[0]
    d = out / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    if name == "0.6b-tied":
        cfg = sizes.qwen3_config(*SIZES[name][:4])
        tensors = sizes.qwen3_tensors(cfg)
    elif name == "llama-1b-untied":
        cfg, tensors = LLAMA_1B, llama_tensors(LLAMA_1B)
    else:
        raise SystemExit(f"unknown size {name!r}: one of {', '.join([*SIZES, 'llama-1b-untied'])}")
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(sizes.DEMO / f, d / f)
    sizes.write_header_only(d / "model.safetensors", tensors)
    return d


def engine_kwargs(edge: str, model: Path, max_model_len: int) -> dict:
    """The plan's engine arguments with ``load_format="dummy"``, and its process layout's environment as ``_env``."""
    out = subprocess.run([edge, "plan", "--model", str(model), "--max-model-len", str(max_model_len), "--json"],
                         capture_output=True, text=True, check=False)
    plan = json.loads(out.stdout)
    if not plan.get("admitted"):
        raise SystemExit(f"edge plan refused {model}: {plan.get('refusals')}")
    return dict(plan["engine_kwargs"], load_format="dummy", _env=(plan.get("execution") or {}).get("env") or {})


# ---------------------------------------------------------------- the child: one engine


def tree_minflt(pid: int) -> int:
    """Minor page faults so far of ``pid`` and its descendants (``/proc/PID/stat`` field 10)."""
    total = 0
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/stat") as f:
                total += int(f.read().rsplit(")", 1)[1].split()[7])
        except (OSError, IndexError, ValueError):
            pass
    return total


def child(side: str, kwargs: dict, prefill_tokens: int, decode_tokens: int, prefill_repeats: int = 3) -> None:
    from edge_core.runtime.env import apply_runtime_env

    apply_runtime_env(edge_engine=side == "edge", layout_env=kwargs.pop("_env", {}), layout_why="the plan's")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    vocab = kwargs.pop("_vocab")
    llm = LLM(**kwargs)
    print("PHASE loaded", flush=True)

    def timed(prompt: TokensPrompt | str, n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - t0

    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    ids = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    # Repeat r's first token differs from every other repeat's, so no block of it is in the prefix cache.
    long_prompts = [TokensPrompt(prompt_token_ids=[(i * 7919 + r * 104729) % (vocab - 3) + 3
                                                   for i in range(prefill_tokens)])
                    for r in range(prefill_repeats + 1)]
    short = TokensPrompt(prompt_token_ids=[3, 5, 7, 11])
    timed(long_prompts[0], 1)  # warm-up: oneDNN's kernels for this shape, the activations' first pages
    prefills, faults = [], []
    for prompt in long_prompts[1:]:
        before = tree_minflt(os.getpid())
        prefills.append(timed(prompt, 1))
        faults.append(tree_minflt(os.getpid()) - before)
    prefill = statistics.median(prefills)
    cached = timed(long_prompts[-1], 1)  # the last prompt again: what a repeated prompt measures (not the ratio)
    decode = min(timed(short, decode_tokens + 1) - timed(short, 1) for _ in range(2))
    print("PHASE done", flush=True)
    result = {"side": side, "token_ids": ids, "prefill_s": prefill, "decode_s": decode, "prefills_s": prefills,
              "prefill_minflt": statistics.median(faults), "prefill_cached_s": cached,
              "prefill_tok_s": prefill_tokens / prefill, "decode_tok_s": decode_tokens / decode}
    print("RESULT " + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------- the parent: sampling from outside


def tree_pss(root: psutil.Process) -> int:
    total = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            pass
    return total


def run_side(side: str, kwargs: dict, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if side == "edge":
        env.update(kv.split("=", 1) for kv in args.edge_env)
    elif args.plain_layout == "separate":  # vLLM's own layout: engine core and worker apart, its own binding
        kwargs = {k: v for k, v in kwargs.items() if k != "distributed_executor_backend"}
        kwargs["_env"] = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    cmd = [sys.executable, __file__, "--child", side, "--kwargs", json.dumps(kwargs),
           "--prefill-tokens", str(args.prefill_tokens), "--decode-tokens", str(args.decode_tokens),
           "--prefill-repeats", str(args.prefill_repeats)]
    samples: list[tuple[float, int, str]] = []
    phase = ["start"]
    lines: list[str] = []
    t0 = time.monotonic()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env) as proc:
        root = psutil.Process(proc.pid)
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.monotonic() - t0, tree_pss(root), phase[0]))
                stop.wait(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("PHASE "):
                phase[0] = line.split()[1]
        proc.wait()
        stop.set()
        sampler.join()
    result = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
    if proc.returncode != 0 or result is None:
        raise SystemExit(f"{side} run exited {proc.returncode}:\n{''.join(lines[-40:])}")
    steady = [pss for _, pss, ph in samples if ph == "loaded"]
    top = max(samples, key=lambda sample: sample[1])
    result.update(peak_at=(round(top[0], 1), top[2]),
                  timeline=[(round(t, 1), pss >> 20, ph) for t, pss, ph in samples[::5]],
                  peak_pss=max(pss for _, pss, _ in samples), steady_pss=statistics.median(steady) if steady else 0,
                  wall_s=round(time.monotonic() - t0, 1), edge_env=args.edge_env if side == "edge" else [])
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/mvv"), help="where the checkpoints go")
    ap.add_argument("--sizes", default="0.6b-tied,1.7b,llama-1b-untied")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--first-pair", type=int, default=1, help="number of the first pair (its parity sets the order)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--prefill-repeats", type=int, default=3, help="measured prefills (distinct prompts), after a warm-up")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--edge-env", action="append", default=[], help="VAR=VALUE for the edge run (repeatable)")
    ap.add_argument("--plain-layout", choices=("plan", "separate"), default="plan",
                    help="plain vLLM in the plan's process layout (default) or in vLLM's own (engine core apart)")
    ap.add_argument("--edge", default=str(Path(sys.executable).with_name("edge")))
    ap.add_argument("--results", type=Path, help="append one JSON line per pair here")
    ap.add_argument("--report", type=Path, help="print the medians of a --results file and exit")
    ap.add_argument("--child", choices=("plain", "edge"), help=argparse.SUPPRESS)
    ap.add_argument("--kwargs", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, json.loads(args.kwargs), args.prefill_tokens, args.decode_tokens, args.prefill_repeats)
        return 0
    if args.report:
        return report(args.report)
    for name in args.sizes.split(","):
        model = build(args.out, name)
        kwargs = engine_kwargs(args.edge, model, args.max_model_len)
        kwargs["_vocab"] = json.loads((model / "config.json").read_text())["vocab_size"]
        for pair in range(args.first_pair, args.first_pair + args.pairs):
            order = ("plain", "edge") if pair % 2 else ("edge", "plain")
            runs = {side: run_side(side, kwargs, args) for side in order}
            plain, edge = runs["plain"], runs["edge"]
            row = {"size": name, "pair": pair, "order": list(order), "edge_env": args.edge_env,
                   "plain_layout": args.plain_layout,
                   "max_model_len": args.max_model_len,
                   "peak_ratio": edge["peak_pss"] / plain["peak_pss"],
                   "steady_ratio": edge["steady_pss"] / plain["steady_pss"],
                   "decode_ratio": edge["decode_tok_s"] / plain["decode_tok_s"],
                   "prefill_ratio": edge["prefill_tok_s"] / plain["prefill_tok_s"],
                   "identical": edge["token_ids"] == plain["token_ids"],
                   "plain": {k: v for k, v in plain.items() if k != "token_ids"},  # timelines: (s, MiB, phase)
                   "edge": {k: v for k, v in edge.items() if k != "token_ids"}}
            print(f"{name} pair {pair} ({' then '.join(order)}): peak {plain['peak_pss'] / MIB:,.0f} -> "
                  f"{edge['peak_pss'] / MIB:,.0f} MiB ({row['peak_ratio']:.3f}), steady "
                  f"{plain['steady_pss'] / MIB:,.0f} -> {edge['steady_pss'] / MIB:,.0f} MiB "
                  f"({row['steady_ratio']:.3f}), decode {row['decode_ratio']:.3f} "
                  f"({plain['decode_tok_s']:.1f} / {edge['decode_tok_s']:.1f} tok/s), prefill "
                  f"{row['prefill_ratio']:.3f} ({plain['prefill_tok_s']:.0f} / {edge['prefill_tok_s']:.0f} tok/s, minor "
                  f"faults {plain['prefill_minflt']:,.0f} / {edge['prefill_minflt']:,.0f}), token ids {'identical' if row['identical'] else 'DIFFER'}", flush=True)
            if args.results:
                with args.results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


def report(path: Path) -> int:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["size"], " ".join(r["edge_env"]) or "levers on", r.get("plain_layout", "plan")),
                          []).append(r)
    print("| geometry | edge levers | plain layout | pairs | plain peak | edge peak | peak ratio | steady ratio "
          "| decode ratio | prefill ratio | token ids |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for (size, env, layout), rs in groups.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("peak_ratio", "steady_ratio", "decode_ratio",
                                                              "prefill_ratio")}
        plain = statistics.median(r["plain"]["peak_pss"] for r in rs) / MIB
        edge = statistics.median(r["edge"]["peak_pss"] for r in rs) / MIB
        same = "identical" if all(r["identical"] for r in rs) else "DIFFER"
        print(f"| {size} | {env} | {layout} | {len(rs)} | {plain:,.0f} MiB | {edge:,.0f} MiB | **{med['peak_ratio']:.3f}** | "
              f"{med['steady_ratio']:.3f} | {med['decode_ratio']:.3f} | {med['prefill_ratio']:.3f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
