"""vLLM CUDA's default execution mode (compiled, CUDA graphs) and what its graphs cost, as edge-cuda plans them.

The capture sizes are checked against vLLM's own published lists; the memory
terms by what drives them (capture sizes, layers, hidden size, dtype, eager),
never by the constants' values, which are checked instead to be what the
published logs fit (bench/cuda_graph_calibration.py, docs/vllm-cuda-facts.md).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import edge_cuda
from edge_core.artifact import DEMO_MODEL, read_manifest
from edge_core.devices import Device
from edge_core.plan import resolve_session
from edge_core.plans import SessionSpec
from edge_cuda import _graphs

ROOT = Path(__file__).resolve().parents[3]
H100 = ROOT / "tests" / "data" / "devices-h100.json"
KIB, MIB = 1 << 10, 1 << 20

#: vLLM's capture list for max_num_seqs 256 as a published engine config prints it
#: (community-scripts/ProxmoxVED#2047: 'cudagraph_capture_sizes': [1, 2, 4, 8, 16, ..., 496, 512]).
PUBLISHED_256 = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def _h100(cc: str = "sm_90") -> Device:
    return Device.from_dict({
        "device_id": "cuda:0", "kind": "gpu_discrete", "vendor": "nvidia", "name": "NVIDIA H100 80GB HBM3",
        "backend": "vllm:cuda", "plugin": "cuda", "runnable": True, "memory_pool": "vram",
        "memory_bytes": 80 << 30, "compute_capability": cc,
    })


def test_capture_sizes_are_vllms_published_defaults():
    assert list(_graphs.capture_sizes(256, 8192)) == PUBLISHED_256
    graphs = _graphs.graph_set(256, 8192)
    # "Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=35 (largest=256)" (LMCache/LMCache#3430).
    assert (len(graphs.piecewise), graphs.piecewise[-1], len(graphs.full), graphs.full[-1]) == (51, 512, 35, 256)


def test_capture_sizes_follow_max_num_seqs_the_token_budget_and_blackwell():
    assert _graphs.capture_sizes(1, 2048) == (1, 2)  # min(2 x 1, 512)
    assert _graphs.capture_sizes(8, 2048) == (1, 2, 4, 8, 16)
    assert _graphs.capture_sizes(64, 40) == (1, 2, 4, 8, 16, 24, 32, 40)  # capped at max_num_batched_tokens
    assert _graphs.capture_sizes(12, 2048) == (1, 2, 4, 8, 12, 16, 24)  # max_num_seqs itself is captured
    assert _graphs.capture_sizes(1024, 8192)[-1] == 512
    assert _graphs.capture_sizes(1024, 8192, sm=100)[-1] == 1024  # data-center Blackwell's ceiling
    assert _graphs.capture_sizes(1024, 8192, sm=120)[-1] == 512  # a GeForce Blackwell keeps 512


def test_hook_execution_mode_is_compiled_with_the_sessions_capture_sizes():
    manifest = read_manifest(str(DEMO_MODEL))
    session = resolve_session(manifest, SessionSpec(max_num_seqs=256, max_num_batched_tokens=8192))
    mode = edge_cuda.execution_mode(device=_h100(), manifest=manifest, session=session)
    assert mode.enforce_eager is False and mode.mode == "compiled" and mode.source == "backend"
    assert list(mode.cudagraph_capture_sizes) == PUBLISHED_256
    assert "torch.compile" in mode.reason and "CUDA graphs" in mode.reason
    other = Device.from_dict({**_h100().to_dict(), "device_id": "cpu", "backend": "vllm:cpu", "plugin": "cpu",
                              "kind": "cpu", "memory_pool": "host_ram"})
    assert edge_cuda.execution_mode(device=other, manifest=manifest, session=session) is None


# --------------------------------------------------------------- plans on a captured H100 list


@pytest.fixture(scope="module")
def installed():
    try:
        md.distribution("edge-cuda")
    except md.PackageNotFoundError:
        pytest.skip("edge-cuda is not installed in this interpreter: the CLI would not load it")


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    from factories import KNOWN_CONFIGS, llama_like_tensors, write_checkpoint

    def write(layers: int) -> Path:
        config = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"], num_hidden_layers=layers)
        return write_checkpoint(tmp_path_factory.mktemp(f"llama8b-{layers}"), config, llama_like_tensors(config),
                                shards=2)
    return write


def plan(*args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "edge_core", "plan", "--devices", str(H100), "--json", *args],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def graph_terms(doc: dict) -> dict[str, int]:
    return {r["purpose"]: r["bytes"] for r in doc["reservations"] if r["purpose"].startswith("cuda_graph")}


def test_tiny_llama_plans_compiled_by_default_and_eager_when_asked(installed):
    tiny = ("--model", str(DEMO_MODEL))
    compiled = plan(*tiny)
    assert compiled["execution"]["mode"] == "compiled" and compiled["execution"]["source"] == "backend"
    assert compiled["engine_kwargs"]["enforce_eager"] is False and compiled["session"]["enforce_eager"] is False
    assert compiled["execution"]["cudagraph_capture_sizes"] == [1, 2]
    one = graph_terms(compiled)
    assert set(one) == {"cuda_graph_pool", "cuda_graph_nodes"} and all(v > 0 for v in one.values())
    many = graph_terms(plan(*tiny, "--max-num-seqs", "64"))
    assert many["cuda_graph_pool"] > one["cuda_graph_pool"] and many["cuda_graph_nodes"] > one["cuda_graph_nodes"]
    eager = plan(*tiny, "--enforce-eager")
    assert eager["execution"] == {"mode": "eager", "enforce_eager": True, "source": "--enforce-eager",
                                  "reason": eager["execution"]["reason"], "cudagraph_capture_sizes": [],
                                  "processes": "separate", "in_process": False,
                                  "processes_reason": eager["execution"]["processes_reason"],
                                  "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}}
    assert "GPU" in eager["execution"]["processes_reason"]  # vLLM's own layout on a GPU
    assert eager["engine_kwargs"]["enforce_eager"] is True and graph_terms(eager) == {}
    assert plan(*tiny, "--compile")["execution"]["source"] == "--compile"


def test_llama8b_graph_terms_grow_with_max_num_seqs_layers_and_hidden_size(installed, llama8b):
    model = str(llama8b(32))
    one = graph_terms(plan("--model", model, "--max-model-len", "1024"))
    many_plan = plan("--model", model, "--max-model-len", "1024", "--max-num-seqs", "64")
    many = graph_terms(many_plan)
    # max_num_seqs 64: up to min(2 x 64, 512) = 128, vLLM's 1, 2, 4, every 8 (19 sizes)
    assert many_plan["execution"]["cudagraph_capture_sizes"] == [1, 2, 4, *range(8, 129, 8)]
    assert many["cuda_graph_pool"] > one["cuda_graph_pool"] and many["cuda_graph_nodes"] > one["cuda_graph_nodes"]
    half = graph_terms(plan("--model", str(llama8b(16)), "--max-model-len", "1024", "--max-num-seqs", "64"))
    # Halving the layers leaves the pool alone and shrinks the graphs as vLLM splits them: 19 PIECEWISE sizes of
    # layers + 1 pieces and the 11 FULL sizes <= 64 of all layers, per layer covered.
    assert half["cuda_graph_pool"] == many["cuda_graph_pool"]
    assert many["cuda_graph_nodes"] * (19 * 17 + 11 * 16) == half["cuda_graph_nodes"] * (19 * 33 + 11 * 32)
    # The pool's growth with the captured tokens is per hidden-size vector: tiny-llama (hidden 128, bf16, the same
    # capture sizes) grows by 128/4096 of Llama's.
    tiny = ("--model", str(DEMO_MODEL))
    demo_one, demo_many = graph_terms(plan(*tiny)), graph_terms(plan(*tiny, "--max-num-seqs", "64"))
    assert ((many["cuda_graph_pool"] - one["cuda_graph_pool"]) * 128
            == (demo_many["cuda_graph_pool"] - demo_one["cuda_graph_pool"]) * 4096)
    eager = plan("--model", model, "--max-model-len", "1024", "--max-num-seqs", "64", "--enforce-eager")
    assert graph_terms(eager) == {} and eager["execution"]["mode"] == "eager"
    assert eager["predicted_peak_bytes"] < many_plan["predicted_peak_bytes"]


# --------------------------------------------------------------- the formula and its calibration


def _pool(piecewise=(), full=(), layers=32, hidden=4096, width=2):
    return _graphs.graph_pool_bytes(_graphs.GraphSet(piecewise=tuple(piecewise), full=tuple(full)), layers=layers,
                                    hidden_size=hidden, dtype_bytes=width)


def test_graph_pool_is_affine_in_captured_tokens_and_the_graphs_in_layers_covered():
    assert _pool() == _graphs.GraphPool(pool_bytes=0, node_bytes=0)  # nothing captured, nothing kept
    a, b, c = (1, 2, 4, 8), (1, 2), (16, 32, 64)
    # pool(A) - pool(B) is proportional to the tokens between them, whatever the constants
    assert ((_pool(a).pool_bytes - _pool(b).pool_bytes) * (sum(c) - sum(b))
            == (_pool(c).pool_bytes - _pool(b).pool_bytes) * (sum(a) - sum(b)))
    # its per-token part doubles with the dtype width and with the hidden size; the graphs do not move
    wide, tall = _pool(a, width=4), _pool(a, hidden=8192)
    assert wide.pool_bytes - _pool(b, width=4).pool_bytes == 2 * (_pool(a).pool_bytes - _pool(b).pool_bytes)
    assert tall.pool_bytes - _pool(b, hidden=8192).pool_bytes == 2 * (_pool(a).pool_bytes - _pool(b).pool_bytes)
    assert wide.node_bytes == tall.node_bytes == _pool(a).node_bytes
    # a PIECEWISE size covers layers + 1 pieces, a FULL size the layers once
    assert _pool(a, layers=10).node_bytes == 4 * _pool((64,), layers=10).node_bytes  # per graph, not per token
    assert _pool(piecewise=(8,), layers=10).node_bytes * 10 == _pool(full=(8,), layers=10).node_bytes * 11


def test_the_constants_are_what_the_published_logs_fit(monkeypatch):
    spec = importlib.util.spec_from_file_location("cuda_graph_calibration", ROOT / "bench" / "cuda_graph_calibration.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclass resolves its module
    spec.loader.exec_module(bench)
    result = bench.fit()
    assert result["constants"] == {"workspace_bytes": _graphs.CAPTURE_WORKSPACE_BYTES,
                                   "bytes_per_layer": _graphs.GRAPH_BYTES_PER_LAYER,
                                   "vectors_per_token": _graphs.VECTORS_PER_CAPTURED_TOKEN}
    measured = [r for r in bench.rows() if r["measure"] == "measured" and r["role"] in ("fit", "check")]
    assert len(measured) >= 10 and all(r["url"].startswith("https://github.com/") for r in bench.rows())
    assert all(r["ratio"] is not None for r in measured)
    assert all(r["note"] for r in measured if not r["in_window"])  # every miss is named with its reason
