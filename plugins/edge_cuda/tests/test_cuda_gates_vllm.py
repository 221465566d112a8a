"""edge-cuda's format and attention verdicts against a real vLLM CUDA wheel's own functions, without a GPU.

``vllm_cuda_verdicts.py`` runs the wheel's Python (each scheme's minimum
capability, Marlin's type query, the int8 kernel chooser, and
``CudaPlatform.get_valid_backends``) for the SM numbers of every captured
device list in tests/data, plus sm_80 and sm_100; edge's verdicts come from
the same wheel read the way a plan reads it (:mod:`edge_cuda._vllm_support`,
no import). The wheel is unpacked by ``scripts/fetch_vllm_cuda_wheel.sh``;
without it, or without torch here, the tests skip and say so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import edge_cuda
from edge_cuda import _capability, _vllm_support

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "tests" / "data"
VERSION = "0.32.0"
WHEEL = Path(os.environ.get("EDGE_VLLM_CUDA_WHEEL") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edge" / "vllm-cuda" / VERSION)
#: Every format edge names a CUDA rule for, and one vLLM registers no method for.
FORMATS = tuple(rule.name for rule in _capability.RULES) + ("bitsandbytes",)
#: Where edge is stricter than vLLM on purpose (native NVFP4 needs SM >= 10.0): below that vLLM still
#: loads NVFP4, weight-only through Marlin, which edge does not plan as NVFP4
#: (docs/vllm-cuda-facts.md, 'The hand-kept format rules').
EDGE_ONLY_NATIVE = {"modelopt_fp4": 100}


def captured_sms() -> list[int]:
    found = set()
    for path in DATA.glob("devices-*.json"):
        for device in json.loads(path.read_text())["devices"]:
            sm = _capability.sm_number(device.get("compute_capability"))
            if sm is not None:
                found.add(sm)
    return sorted(found)


SMS = sorted(set(captured_sms()) | {80, 100})

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_says():
    if not (WHEEL / "vllm" / "platforms" / "cuda.py").is_file():
        pytest.skip(f"no unpacked vLLM {VERSION} CUDA wheel at {WHEEL} (scripts/fetch_vllm_cuda_wheel.sh)")
    pytest.importorskip("torch", reason="the wheel's Python imports torch")
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_cuda_verdicts.py")), *map(str, SMS)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(WHEEL)})
    assert done.returncode == 0, done.stderr[-4000:]
    said = json.loads(done.stdout)
    assert said["vllm"] == VERSION
    return said


@pytest.fixture(scope="module")
def edge_table():
    if not (WHEEL / "vllm").is_dir():
        pytest.skip(f"no unpacked vLLM {VERSION} CUDA wheel at {WHEEL}")
    support = _vllm_support.read_support(WHEEL / "vllm", distribution="vllm", version=VERSION)
    assert support.unread == {}, support.unread
    return _capability.rules(support)


def test_the_captured_lists_cover_ampere_ada_hopper_and_blackwell():
    assert {86, 89, 90, 120} <= set(captured_sms())


def test_edge_reads_the_int8_ceiling_and_the_minimums_from_the_wheel(vllm_says, edge_table):
    by_name = {rule.name: rule for rule in edge_table}
    assert by_name["compressed-tensors:int8"].below_sm == vllm_says["int8_ceiling_message"] == 100
    assert (by_name["compressed-tensors:fp8"].min_sm, by_name["gptq"].min_sm, by_name["mxfp4"].min_sm) == (89, 75, 80)


@pytest.mark.parametrize("sm", SMS)
def test_every_format_verdict_agrees_with_vllms_own_functions(vllm_says, edge_table, sm):
    runs_here = set(_capability.formats_for(sm, edge_table))
    vllm_runs = {fmt for fmt, ok in vllm_says["sm"][str(sm)]["runs"].items() if ok}
    stricter = {fmt for fmt, native in EDGE_ONLY_NATIVE.items() if sm < native}
    for fmt in FORMATS:
        expected = fmt in vllm_runs and fmt not in stricter
        assert (fmt in runs_here) == expected, (
            f"sm_{sm} {fmt}: edge says {'runs' if fmt in runs_here else 'refused'}, vLLM {VERSION}'s functions say "
            f"{'runs' if fmt in vllm_runs else 'refused'} (int8 kernel {vllm_says['sm'][str(sm)]['int8_kernel']})")
    if sm >= 100:  # the hole: vLLM picks CUTLASS int8, whose compiled dispatch has no SM >= 100 path
        assert "compressed-tensors:int8" not in runs_here
        assert vllm_says["sm"][str(sm)]["int8_kernel"] == _vllm_support.CUTLASS_INT8


@pytest.mark.parametrize("sm", SMS)
def test_no_head_size_or_mla_model_is_refused_and_vllm_has_a_backend_for_each(vllm_says, sm):
    device = _capability.Device.from_dict({
        "device_id": "cuda:0", "kind": "gpu_discrete", "vendor": "nvidia", "name": f"sm_{sm}",
        "backend": "vllm:cuda", "plugin": "cuda", "runnable": True, "memory_pool": "vram",
        "memory_bytes": 80 << 30, "compute_capability": f"sm_{sm}"})
    for key, backends in vllm_says["sm"][str(sm)]["attention"].items():
        kind, size = key.split(":")
        config = {"head_dim": int(size), "torch_dtype": "bfloat16"}
        if kind == "mla":
            config.update(kv_lora_rank=512, qk_rope_head_dim=64)
        manifest = types.SimpleNamespace(dtype="bfloat16", config=config, architecture="LlamaForCausalLM")
        assert edge_cuda.gate_plan(device=device, manifest=manifest, session=None, host=None, share=None) == []
        assert backends, f"sm_{sm} {key}: vLLM {VERSION} finds no attention backend, edge would admit it"
