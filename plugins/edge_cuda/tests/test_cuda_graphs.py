"""vLLM CUDA's default execution mode (compiled, CUDA graphs) and what its graphs cost, as edge-cuda plans them.

The capture sizes are checked against vLLM's own published lists; the memory
terms against the formula of docs/vllm-cuda-facts.md written out here, figure
by figure, for the demo and a Llama-3.1-8B header set on a captured H100 list.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

import pytest

import edge_cuda
from edge_core.artifact import DEMO_MODEL, read_manifest
from edge_core.devices import Device
from edge_core.plan import SessionSpec, resolve_session
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


def test_the_demo_plans_compiled_by_default_and_eager_when_asked(installed):
    compiled = plan()
    assert compiled["execution"]["mode"] == "compiled" and compiled["execution"]["source"] == "backend"
    assert compiled["engine_kwargs"]["enforce_eager"] is False and compiled["session"]["enforce_eager"] is False
    assert compiled["execution"]["cudagraph_capture_sizes"] == [1, 2]
    # demo: 4 layers, hidden 128, bf16; max_num_seqs 1 -> PIECEWISE (1, 2), FULL (1,)
    assert graph_terms(compiled) == {"cuda_graph_pool": 64 * MIB + (1 + 2 + 1) * 128 * 2,
                                     "cuda_graph_nodes": (2 * 5 + 1 * 4) * 176 * KIB}
    eager = plan("--enforce-eager")
    assert eager["execution"] == {"mode": "eager", "enforce_eager": True, "source": "--enforce-eager",
                                  "reason": eager["execution"]["reason"], "cudagraph_capture_sizes": []}
    assert eager["engine_kwargs"]["enforce_eager"] is True and graph_terms(eager) == {}
    assert plan("--compile")["execution"]["source"] == "--compile"


def test_llama8b_graph_terms_grow_with_max_num_seqs_and_layers(installed, llama8b):
    model = str(llama8b(32))
    one = plan("--model", model, "--max-model-len", "1024")
    # max_num_seqs 1, 1024 tokens a pass: PIECEWISE (1, 2) of 33 pieces, FULL (1,) of 32 layers
    assert graph_terms(one) == {"cuda_graph_pool": 64 * MIB + (1 + 2 + 1) * 4096 * 2,
                                "cuda_graph_nodes": (2 * 33 + 1 * 32) * 176 * KIB}
    many = plan("--model", model, "--max-model-len", "1024", "--max-num-seqs", "64")
    # max_num_seqs 64: up to min(2 x 64, 512) = 128: 1, 2, 4, 8..128 (19 sizes, 1,095 tokens) PIECEWISE,
    # the 11 of them <= 64 (295 tokens) FULL
    assert many["execution"]["cudagraph_capture_sizes"] == [1, 2, 4, *range(8, 129, 8)]
    assert graph_terms(many) == {"cuda_graph_pool": 64 * MIB + (1095 + 295) * 4096 * 2,
                                 "cuda_graph_nodes": (19 * 33 + 11 * 32) * 176 * KIB}
    half = plan("--model", str(llama8b(16)), "--max-model-len", "1024", "--max-num-seqs", "64")
    assert graph_terms(half) == {"cuda_graph_pool": 64 * MIB + (1095 + 295) * 4096 * 2,
                                 "cuda_graph_nodes": (19 * 17 + 11 * 16) * 176 * KIB}
    eager = plan("--model", model, "--max-model-len", "1024", "--max-num-seqs", "64", "--enforce-eager")
    assert graph_terms(eager) == {} and eager["execution"]["mode"] == "eager"
    assert eager["predicted_peak_bytes"] < many["predicted_peak_bytes"]
