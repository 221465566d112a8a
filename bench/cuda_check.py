"""On a machine with an NVIDIA GPU and vLLM's CUDA build: the plan against what vLLM CUDA does, eager and compiled.

    python bench/cuda_check.py [--model DIR] [--max-num-seqs 1] [--tokens 256] [--out cuda_check.json]

Needs edge-core, edge-cuda, vLLM's CUDA build and nvidia-ml-py in this
interpreter, and one GPU edge can plan the model on; it says what is missing
and exits 2 otherwise. On a shared machine wrap it in the engine lock
(``flock /tmp/edge-engine.lock python bench/cuda_check.py ...``): it starts two
engines, one after the other.

For each mode, vLLM CUDA's default (torch.compile + CUDA graphs) and
``--enforce-eager``, it runs ``edge plan --json`` and then ``edge run --json``
(greedy, ``--ignore-eos``, ``--tokens`` tokens) with the engine's own log kept,
and reports:

- the plan: execution mode, capture sizes, the ``cuda_graph_*`` terms, the
  predicted peak;
- the run: the NVML counter's attributable peak (used bytes above the
  pre-load baseline) against the predicted peak, and edge's own verdict;
- vLLM's own lines from the engine log: "Model loading took X GiB",
  "Estimated CUDA graph memory", "Graph capturing finished in N secs, took X
  GiB", "Available KV cache memory" (with ``kv_cache_memory_bytes`` set vLLM
  skips profiling and logs the reserved pool instead), against edge's terms;
- decode tokens per second, compiled over eager, measured in the same run.

The JSON written to ``--out`` holds every figure; docs/benchmarks.md says how
to read it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "edge_core" / "demo" / "tiny-llama"
GIB = 1 << 30
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
RUN_TIMEOUT_S = 1800

#: vLLM CUDA's log lines this check reads (vllm 0.32 ``gpu_model_runner.py`` / ``gpu_worker.py``).
LOG_LINES = {
    "model_loading_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "estimated_graph_gib": re.compile(r"Estimated CUDA graph memory: ([\d.]+) GiB"),
    "graph_capture_gib": re.compile(r"Graph capturing finished in \d+ secs?, took (-?[\d.]+) GiB"),
    "graph_pool_actual_gib": re.compile(r"CUDA graph pool memory: (-?[\d.]+) GiB \(actual\)"),
    "available_kv_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
    "reserved_kv_gib": re.compile(r"reserved ([\d.]+) GiB memory for KV Cache"),
}


def missing() -> list[str]:
    """What this interpreter lacks to run the check."""
    from edge_core.kit.vllm_source import installed_vllm

    needs = {"pynvml": "nvidia-ml-py", "edge_cuda": "edge-cuda (pip install -e plugins/edge_cuda)"}
    lacking = [what for module, what in needs.items() if importlib.util.find_spec(module) is None]
    distribution, version, _ = installed_vllm()
    if distribution != "vllm":
        lacking.insert(0, f"vLLM's CUDA build (pip install vllm; found {distribution or 'no vLLM'} {version or ''})")
    return lacking


def edge(*args: str, timeout: float = 120) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "edge_core", *args], capture_output=True, text=True,
                          timeout=timeout)
    try:
        return done.returncode, json.loads(done.stdout)
    except ValueError:
        return done.returncode, {"error": (done.stderr or done.stdout)[-2000:]}


def read_log(path: Path) -> dict[str, float | None]:
    """vLLM's own memory figures from its engine log (the last of each: a TP run logs one per rank)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return {key: None for key in LOG_LINES}
    out: dict[str, float | None] = {}
    for key, pattern in LOG_LINES.items():
        found = pattern.findall(text)
        out[key] = float(found[-1]) if found else None
    return out


def graph_terms(plan: dict) -> dict[str, int]:
    return {r["purpose"]: r["bytes"] for r in plan.get("reservations", []) if r["purpose"].startswith("cuda_graph")}


def one_mode(model: str, flag: str | None, args: argparse.Namespace, logs: Path) -> dict:
    common = ["--model", model, "--backend", "cuda", "--max-num-seqs", str(args.max_num_seqs)]
    if args.max_model_len:
        common += ["--max-model-len", str(args.max_model_len)]
    if flag:
        common.append(flag)
    code, plan = edge("plan", "--json", *common)
    row: dict = {"flag": flag or "(backend default)", "plan_exit": code, "execution": plan.get("execution"),
                 "graph_terms": graph_terms(plan), "predicted_peak_bytes": plan.get("predicted_peak_bytes")}
    if code != 0:
        row["error"] = plan.get("refusals") or plan.get("error")
        return row
    log = logs / f"engine-{'eager' if flag == '--enforce-eager' else 'compiled'}.log"
    started = time.monotonic()
    code, run = edge("run", "--json", *common, "--prompt", PROMPT, "--max-tokens", str(args.tokens),
                     "--ignore-eos", "--engine-log", str(log), timeout=RUN_TIMEOUT_S)
    row["wall_s"] = round(time.monotonic() - started, 1)
    row["run_exit"] = code
    if code != 0 or run.get("outcome") != "completed":
        row["error"] = run.get("error") or run.get("outcome")
        return row
    memory = run.get("memory") or {}
    nvml = (memory.get("counters") or {}).get("device")  # edge-cuda's memory_counter: NVML used bytes
    row.update(
        timings=run.get("timings"),
        decode_tokens_per_s=(run.get("timings") or {}).get("decode_tokens_per_s"),
        memory_verdict=memory.get("verdict"), memory_ratio=memory.get("ratio"),
        measured_counter=memory.get("measured_counter"), nvml=nvml,
        vllm_log=read_log(log), engine_log=str(log),
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEMO), help="checkpoint directory or Hub id (default: the demo)")
    parser.add_argument("--max-num-seqs", type=int, default=1)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--tokens", type=int, default=256, help="greedy tokens per run (ignore_eos)")
    parser.add_argument("--out", default="cuda_check.json")
    args = parser.parse_args()
    lacking = missing()
    if lacking:
        print(f"cuda_check: this interpreter lacks {', '.join(lacking)}; nothing was run", file=sys.stderr)
        return 2
    logs = Path(tempfile.mkdtemp(prefix="edge-cuda-check-"))
    rows = [one_mode(args.model, None, args, logs), one_mode(args.model, "--enforce-eager", args, logs)]
    compiled, eager = rows
    result = {"model": args.model, "max_num_seqs": args.max_num_seqs, "tokens": args.tokens, "modes": rows,
              "date": time.strftime("%Y-%m-%d")}
    fast, slow = compiled.get("decode_tokens_per_s"), eager.get("decode_tokens_per_s")
    result["compiled_over_eager_decode"] = round(fast / slow, 2) if fast and slow else None
    terms = sum(compiled.get("graph_terms", {}).values())
    logged = (compiled.get("vllm_log") or {}).get("graph_capture_gib")
    result["graph_terms_over_vllm_capture"] = round(terms / (logged * GIB), 2) if terms and logged else None
    Path(args.out).write_text(json.dumps(result, indent=2))
    for row in rows:
        nvml = row.get("nvml") or {}
        peak = nvml.get("attributable_peak_bytes") or nvml.get("peak_bytes")
        predicted = row.get("predicted_peak_bytes")
        print(f"{row['flag']:>20}: mode {(row.get('execution') or {}).get('mode')}, graph terms "
              f"{sum(row.get('graph_terms', {}).values()) / GIB:.2f} GiB, predicted peak "
              f"{(predicted or 0) / GIB:.2f} GiB, NVML attributable peak "
              f"{(peak or 0) / GIB:.2f} GiB, verdict {row.get('memory_verdict')}, decode "
              f"{row.get('decode_tokens_per_s')} tok/s, vLLM log {row.get('vllm_log')}"
              + (f", error {row['error']}" if row.get("error") else ""))
    print(f"compiled / eager decode: {result['compiled_over_eager_decode']}; edge's graph terms / vLLM's "
          f"'Graph capturing ... took': {result['graph_terms_over_vllm_capture']}; written to {args.out}")
    return 0 if all(not row.get("error") for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
