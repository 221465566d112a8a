"""vLLM CPU's tensor parallel run end to end: `edge accept` and `parity` with `--tensor-parallel-size 2`.

Two ranks on this host's cores (``VLLM_CPU_OMP_THREADS_BIND="0|1"`` on a
2-core machine; vLLM's default binding asserts without NUMA nodes), each
with the plan's per-rank KV pool; the run's measured peak is checked against
the plan that budgets both rank processes, and nothing is left running.
One acceptance run's record (conftest's ``tp2_accept``, which the two-node test
reads too) serves the run checks and the acceptance checks (a cancel among
them); a TP 2 engine stopped by SIGINT is tests/test_serve.py's TP 2 server.
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
from edge_core.runtime.accept import ACCEPT_TOKENS

NEEDS = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.engine,
    pytest.mark.alone,
    pytest.mark.slow,
    pytest.mark.skipif(bool(NEEDS), reason=f"needs the real vLLM CPU build and edge-cpu; missing: {NEEDS}"),
    pytest.mark.skipif((psutil.cpu_count() or 1) < 2, reason="two ranks need two cores"),
]


def test_tp2_runs_on_vllm_cpu_with_per_rank_kv_and_leaves_nothing_running(tp2_accept):
    _, record = tp2_accept
    assert all(len(p["token_ids"]) == ACCEPT_TOKENS for p in record["prompts"]), [len(p["token_ids"]) for p in record["prompts"]]
    plan = record["plan"]
    parallel = plan["parallel"]
    assert parallel["tensor_parallel_size"] == 2 and parallel["executor"] == "mp"
    assert plan["engine_kwargs"]["tensor_parallel_size"] == 2
    # The engine ran with one CPU list per rank, and every rank's pool is the plan's per-rank figure.
    assert parallel["env"]["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1
    assert record["stage"]["device_pin"]["set"] == parallel["env"]
    assert parallel["env"]["TORCH_COMPILE_DISABLE"] == "1"  # eager: no inductor compile in the ranks
    assert [r["kv_cache_bytes"] for r in parallel["ranks"]] == [plan["engine_kwargs"]["kv_cache_memory_bytes"]] * 2
    # Every process the stage started is gone.
    pids = record["stage"]["stage_pids"]
    assert len(pids) >= 3  # the engine core and a worker per rank
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    # The measured peak against the budget that counts both rank processes.
    memory = record["memory"]
    assert memory["verdict"] != "under_predicted", memory


def test_accept_with_tp2_passes_every_criterion(tp2_accept):
    """Twelve prompts streamed through both ranks, the budget against the tree's peak, a leak-free cancel."""
    proc, doc = tp2_accept
    assert proc.returncode == 0, (doc.get("failed"), proc.stderr[-3000:])
    assert doc["outcome"] == "passed" and doc["failed"] == []
    assert doc["plan"]["parallel"]["tensor_parallel_size"] == 2
    passed = {c["name"] for c in doc["criteria"] if c["passed"]}
    assert {"decision_visible", "decision_masked", "prompts_complete", "budget_bounds_tree_pss",
            "cancel_leaks_nothing"} <= passed


@pytest.mark.engine(starts=2)  # the TP 2 stage, then plain vLLM on one device
def test_parity_of_tp2_against_one_device_reports_each_first_divergence(tmp_path):
    """Splitting the layers changes bf16 sums; the record says where each prompt's tokens first differ."""
    record = tmp_path / "parity.json"
    env = {**os.environ, "EDGE_LEDGER_DIR": str(tmp_path / "ledger")}
    proc = subprocess.run([sys.executable, "-m", "edge_core", "parity", "--model", str(DEMO_MODEL),
                           "--tensor-parallel-size", "2",
                           "--reference-tensor-parallel-size", "1", "--max-tokens", "32", "--json", str(record)],
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode in (0, 3), proc.stderr[-3000:]
    doc = json.loads(record.read_text())
    assert doc["layout"] == "TP 2" and doc["reference"]["layout"] == "one device"
    assert doc["engine_kwargs"]["tensor_parallel_size"] == 2
    assert doc["reference"]["engine_kwargs"].get("tensor_parallel_size", 1) == 1
    assert doc["plain_vllm"]["leftover_pids"] == []
    for row in doc["prompts"]:
        ours, theirs = row["edge_token_ids"], row["vllm_token_ids"]
        assert len(ours) == len(theirs) == 32
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        assert row["first_divergent_position"] == first and row["identical"] is (first is None)
    assert proc.returncode == (0 if doc["outcome"] == "identical" else 3)
