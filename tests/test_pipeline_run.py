"""vLLM CPU's pipeline parallel run end to end: `edge run --pipeline-parallel-size 2`, eager.

vLLM CPU 0.32 alone dies in the first request of an eager PP run (the later
stage's receive buffers are never allocated); edge-cpu's vLLM plugin
(edge_cpu/_pp.py) allocates them, so the run generates, with the plan's bind
list and per-stage layers, and leaves nothing running.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import psutil
import pytest

from edge_core.artifact import DEMO_MODEL

NEEDS = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]
pytestmark = [
    pytest.mark.engine,
    pytest.mark.alone,
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(bool(NEEDS), reason=f"needs the real vLLM CPU build and edge-cpu; missing: {NEEDS}"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two stages need two usable cores"),
]


def test_pp2_generates_in_eager_mode_and_leaves_nothing_running(tmp_path):
    env = {**os.environ, "EDGE_LEDGER_DIR": str(tmp_path / "ledger")}
    env.pop("VLLM_PLUGINS", None)  # every general plugin edge-cpu registers, as a user's run has them
    proc = subprocess.run([sys.executable, "-m", "edge_core", "run", "--model", str(DEMO_MODEL),
                           "--pipeline-parallel-size", "2",
                           "--prompt", "Hello there", "--max-tokens", "8", "--ignore-eos", "--json"],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    assert record["outcome"] == "completed" and len(record["token_ids"]) == 8
    parallel = record["plan"]["parallel"]
    assert (parallel["tensor_parallel_size"], parallel["pipeline_parallel_size"]) == (1, 2)
    assert record["plan"]["engine_kwargs"]["enforce_eager"] is True
    assert parallel["env"]["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1  # one CPU list per stage
    layers = [tuple(r["layers"]) for r in parallel["ranks"]]
    assert layers[0][0] == 0 and layers[0][1] == layers[1][0] and layers[0][1] > 0
    pids = record["stage"]["stage_pids"]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
