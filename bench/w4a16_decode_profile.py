"""Where a W4A16 decode step's time goes on vLLM CPU: torch.profiler over batch-1 decode (issue 38).

    python bench/w4a16_decode_profile.py --model DIR [--tokens 64] [--w4a8 1|0] [--top 15]

vLLM's engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
uniproc executor) with edge's runtime environment and edge's plan's engine
arguments, so the profiler sees the model's forward, the sampler and the
scheduler's Python in one trace. One warm-up generation, then ``--tokens``
greedy tokens (``ignore_eos``) after a short prompt under the profiler; the
table is the operators' self CPU time per decode step, largest first, and what
share of the step's wall time they are. ``--w4a8`` sets
``VLLM_CPU_INT4_W4A8`` (vLLM's default 1 on AMX hosts: int4 weights times
int8-quantized activations through ``int4_scaled_mm_cpu``; 0: bf16 activations
through ``cpu_gemm_wna16``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--w4a8", choices=("0", "1"), default="1")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--max-model-len", type=int, default=8192)
    args = parser.parse_args()
    os.environ["VLLM_CPU_INT4_W4A8"] = args.w4a8
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    edge = str(Path(sys.executable).with_name("edge"))
    plan = json.loads(subprocess.run([edge, "plan", "--model", args.model, "--max-model-len", str(args.max_model_len),
                                      "--json"], capture_output=True, text=True, check=True).stdout)
    kwargs = dict(plan["engine_kwargs"], distributed_executor_backend="uni")
    from edge_core.runtime.env import apply_runtime_env

    apply_runtime_env()
    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(**kwargs)
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    plain_s = time.perf_counter() - t0
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        wall = time.perf_counter() - t0
    steps = args.tokens
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    print(f"{args.model}: VLLM_CPU_INT4_W4A8={args.w4a8}, torch {torch.__version__}, threads "
          f"{torch.get_num_threads()}; {steps} tokens in {plain_s:.3f} s without the profiler "
          f"({steps / plain_s:.1f} tok/s), {wall:.3f} s under it")
    print("| operator | calls per step | self CPU ms per step | share of the step |")
    print("|---|---|---|---|")
    for e in rows[: args.top]:
        per_step_ms = e.self_cpu_time_total / 1000 / steps
        print(f"| `{e.key}` | {e.count / steps:.1f} | {per_step_ms:.3f} | {per_step_ms / (wall * 1000 / steps):.1%} |")
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
