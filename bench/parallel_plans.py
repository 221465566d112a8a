"""What planning across several devices costs, against planning the same model on one device in the same run.

    python bench/parallel_plans.py [--runs 5]

Writes header-only Llama checkpoints (3.1-8B, 3.1-70B, a 405B-class one) with
the test suite's factories and plans each against captured device lists
(tests/data/devices-*.json), each plan in a fresh process with no backend
loaded (``EDGE_PLUGINS=none-installed``, as on a machine planning for another):

* baseline: Llama-3.1-8B at 8192 tokens on 2x RTX 4090 — one card takes it,
  no layout is tried;
* Llama-3.1-8B at 131072 tokens on the same list — no card takes it, TP 2 is planned;
* Llama-3.1-70B on 8x H100 — TP 2 refused, TP 4 admitted;
* the 405B-class model on two 8x H100 hosts — every one-host layout refused,
  PP 2 x TP 8 on Ray admitted.

Prints the median wall time and the plan's own ``decision_time_s`` (without
the interpreter start), and each against the baseline. Target (issue 14):
every decision well under a second (< 0.5 s).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
sys.path.insert(0, str(ROOT / "tests"))


def write_models(root: Path) -> dict[str, Path]:
    from factories import KNOWN_CONFIGS, llama_like_tensors, write_checkpoint

    out = {}
    for name, key, extra in (("llama-8b", "meta-llama/Llama-3.1-8B", {}), ("llama-70b", "meta-llama/Llama-3.1-70B", {}),
                             ("llama-405b", "meta-llama/Llama-3.1-70B",
                              {"hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128,
                               "num_key_value_heads": 8, "num_hidden_layers": 126})):
        config = {**KNOWN_CONFIGS[key], **extra}
        out[name] = write_checkpoint(root / name, config, llama_like_tensors(config), shards=8)
    return out


def plan(args: list[str], env: dict[str, str]) -> tuple[float, dict]:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "edge_core", "plan", "--json", *args], capture_output=True,
                          text=True, env=env, timeout=120)
    wall = time.perf_counter() - started
    return wall, json.loads(proc.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    opts = parser.parse_args()
    env = {**os.environ, "EDGE_PLUGINS": "none-installed"}
    with tempfile.TemporaryDirectory(prefix="edge-bench-parallel-") as tmp:
        env["EDGE_HEADER_CACHE_DIR"] = str(Path(tmp) / "headers")
        models = write_models(Path(tmp))
        two_4090 = ["--devices", str(DATA / "devices-2x4090.json")]
        h100 = ["--devices", str(DATA / "devices-8xh100.json")]
        cases = {
            "8B, 8192 tokens, 2x 4090 (baseline: one card)": ["--model", str(models["llama-8b"]), *two_4090,
                                                               "--max-model-len", "8192"],
            "8B, 131072 tokens, 2x 4090": ["--model", str(models["llama-8b"]), *two_4090],
            "70B, 131072 tokens, 8x H100": ["--model", str(models["llama-70b"]), *h100],
            "405B, 16384 tokens, 2 hosts x 8x H100": ["--model", str(models["llama-405b"]), *h100, "--devices",
                                                      str(DATA / "devices-8xh100-b.json"), "--max-model-len", "16384"],
        }
        results = {}
        for label, args in cases.items():
            plan(args, env)  # warm the header cache and the file cache: the runs measure planning
            walls, decisions, layout = [], [], "-"
            for _ in range(opts.runs):
                wall, doc = plan(args, env)
                walls.append(wall)
                decisions.append(doc["decision_time_s"])
                par = doc.get("parallel")
                layout = par["label"] if par else ("one device" if doc["admitted"] else "refused")
            results[label] = (statistics.median(walls), statistics.median(decisions), layout)
    base_wall, base_decision, _ = next(iter(results.values()))
    print(f"{'case':44} {'layout':22} {'wall s':>8} {'decide s':>9} {'x base':>7}")
    for label, (wall, decision, layout) in results.items():
        print(f"{label:44} {layout:22} {wall:8.3f} {decision:9.3f} {decision / base_decision:7.2f}")
    print(f"medians of {opts.runs} fresh processes each; 'x base' is decide s over the one-card baseline's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
