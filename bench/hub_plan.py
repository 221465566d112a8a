"""How fast edge decides on a model named by Hub id, against vLLM reaching a decision on the same ids.

    python bench/hub_plan.py [--runs 5] [--blackhole]

Serves a 30-shard, 70B-class header-only checkpoint (Llama-3.1-70B geometry)
from the test suite's fake Hub on 127.0.0.1 (tests/fake_hub.py), with empty
temporary ``HF_HOME`` and edge caches, and measures, each in a fresh process
(`edge plan --model ORG/NAME --devices tests/data/devices-h100.json --json`):

1. cold: nothing cached, headers fetched by range (bytes the server sent, too);
2. warm: the same revision again, from edge's metadata cache;
3. offline and not cached (``HF_HUB_OFFLINE=1``): the ``model_not_cached`` refusal;

plus the plan's own ``decision_time_s`` (in-process: what the process spent
deciding, without its interpreter start). Baselines in the same run: a fresh
process doing what vLLM does first with a model id,
``EngineArgs(model=ID).create_model_config()``, offline, against the same
fake Hub, and against a refused port; with ``--blackhole`` also against an
address that never answers (vLLM waited 96.9 s there once; this takes long).
Targets (issue 12): cold < 1 s, warm < 0.2 s, not-cached refusal < 0.2 s.
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
REPO = "bench/llama-70b"
VLLM_DECIDES = ("from vllm.engine.arg_utils import EngineArgs\n"
                "EngineArgs(model={repo!r}).create_model_config()\n")


def timed(cmd: list[str], env: dict[str, str], timeout: float = 300) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        proc = subprocess.CompletedProcess(cmd, -9, "", f"timed out after {timeout} s")
    return time.perf_counter() - started, proc


def edge_plan(env: dict[str, str]) -> tuple[float, dict]:
    wall, proc = timed([sys.executable, "-m", "edge_core", "plan", "--model", REPO, "--devices",
                        str(ROOT / "tests" / "data" / "devices-h100.json"), "--json"], env)
    doc = json.loads(proc.stdout)
    return wall, doc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--blackhole", action="store_true", help="also time vLLM against 10.255.255.1")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from factories import KNOWN_CONFIGS, llama_like_tensors, write_checkpoint
    from fake_hub import FakeHub, FakeRepo

    config = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-70B"])
    with tempfile.TemporaryDirectory(prefix="edge-hub-bench-") as tmp:
        model = write_checkpoint(Path(tmp) / "model", config, llama_like_tensors(config), shards=30)
        total = sum(p.stat().st_size for p in model.iterdir())
        cold, warm, cold_decision, warm_decision, sent = [], [], [], [], []
        with FakeHub({REPO: FakeRepo(model)}) as hub:
            for run in range(args.runs):
                env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": f"{tmp}/hf{run}",
                       "XDG_CACHE_HOME": f"{tmp}/xdg{run}"}
                env.pop("HF_HUB_OFFLINE", None)
                hub.reset_counters()
                wall, doc = edge_plan(env)
                sent.append(hub.bytes_sent)
                cold.append(wall)
                cold_decision.append(doc["decision_time_s"])
                wall, doc = edge_plan(env)
                warm.append(wall)
                warm_decision.append(doc["decision_time_s"])
            offline_env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": f"{tmp}/empty",
                           "XDG_CACHE_HOME": f"{tmp}/empty-xdg"}
            offline, offline_decision = [], []
            for _ in range(args.runs):
                wall, doc = edge_plan(offline_env)
                assert [r["code"] for r in doc["refusals"]] == ["model_not_cached"], doc["refusals"]
                offline.append(wall)
                offline_decision.append(doc["decision_time_s"])
            code = VLLM_DECIDES.format(repo=REPO)
            baselines = {
                "offline": {**offline_env},
                "fake Hub": {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HOME": f"{tmp}/vllm-hf"},
                "refused port": {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": f"{tmp}/vllm-hf2"},
            }
            if args.blackhole:
                baselines["blackhole"] = {**os.environ, "HF_ENDPOINT": "http://10.255.255.1",
                                          "HF_HOME": f"{tmp}/vllm-hf3"}
            vllm = {}
            for name, env in baselines.items():
                env.pop("HF_HUB_OFFLINE", None) if name != "offline" else None
                wall, proc = timed([sys.executable, "-c", code], env)
                last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1][:140]
                vllm[name] = (wall, proc.returncode, last)

    med = statistics.median
    print(f"checkpoint: {REPO}, 30 shards, {total / 1e9:.1f} GB; {args.runs} runs, fresh process each, medians")
    print(f"edge cold plan:   wall {med(cold):.3f} s, decision {med(cold_decision):.3f} s; server sent "
          f"{med(sent) / 1024:.0f} KiB = {med(sent) / total:.2e} of the checkpoint (target < 1e-4)")
    print(f"edge warm plan:   wall {med(warm):.3f} s, decision {med(warm_decision):.3f} s")
    print(f"edge offline, not cached (model_not_cached): wall {med(offline):.3f} s, decision "
          f"{med(offline_decision):.3f} s")
    for name, (wall, rc, last) in vllm.items():
        print(f"vLLM EngineArgs.create_model_config ({name}): {wall:.2f} s, exit {rc}: {last}")
    print(f"ratios: vLLM offline / edge not-cached refusal {vllm['offline'][0] / med(offline):.1f}x; "
          f"vLLM refused port / edge cold {vllm['refused port'][0] / med(cold):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
