"""Plans across several devices, from captured device lists (tests/data/devices-*.json) and header-only checkpoints.

Every expected byte count is derived here from the architecture (a Llama
layer's projections, vLLM's padded vocabulary, its per-rank KV heads and
block rule), never read back from the planner. No backend is loaded
(``EDGE_PLUGINS=none-installed``): the devices are planned from their lists,
as on a machine that only plans for another.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from factories import KNOWN_CONFIGS, llama_like_tensors, write_checkpoint

from edge_core.cli import main
from edge_core.layout import Layout
from edge_core.plan.parallel import candidate_layouts, pp_partition

DATA = Path(__file__).parent / "data"
GIB = 1 << 30
CUDA_BLOCK = 16  # the kv_block_size the CUDA lists record
BF16 = 2


def _plan(capsys, *args: str) -> tuple[int, dict]:
    code = main(["plan", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture(autouse=True)
def _no_backends(monkeypatch):
    monkeypatch.setenv("EDGE_PLUGINS", "none-installed")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Llama-3.1-70B, Llama-3.1-8B, Mistral-7B, a 405B-class Llama and Qwen2-72B GPTQ, header-only."""
    root = tmp_path_factory.mktemp("parallel")
    out = {}
    for name, key in (("l70", "meta-llama/Llama-3.1-70B"), ("l8", "meta-llama/Llama-3.1-8B"),
                      ("m7", "mistralai/Mistral-7B-v0.1")):
        config = dict(KNOWN_CONFIGS[key])
        out[name] = (write_checkpoint(root / name, config, llama_like_tensors(config), shards=4), config)
    # Llama-3.1-405B's published geometry.
    config = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-70B"], hidden_size=16384, intermediate_size=53248,
                  num_attention_heads=128, num_key_value_heads=8, num_hidden_layers=126)
    out["l405"] = (write_checkpoint(root / "l405", config, llama_like_tensors(config), shards=8), config)
    # Qwen2-72B-Instruct-GPTQ-Int4's geometry: intermediate 29568 = 231 groups of 128, odd, so no even TP
    # split leaves whole groups per rank (Qwen later published a padded 29696 build for this).
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 8192,
              "intermediate_size": 29568, "num_attention_heads": 64, "num_key_value_heads": 8,
              "num_hidden_layers": 80, "vocab_size": 152064, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "torch_dtype": "float16", "tie_word_embeddings": False,
              "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                      "sym": True}}
    out["qwen72_gptq"] = (write_checkpoint(root / "qwen72", config, llama_like_tensors(config), shards=4), config)
    return out


# ------------------------------------------------------------- the formulas

def padded(vocab: int) -> int:
    return -(-vocab // 64) * 64


def llama_rank_weights(c: dict, tp: int, layers: int, first: bool = True, last: bool = True) -> int:
    """One rank's bf16 bytes: attention and MLP split by TP (KV heads by min(tp, kv)), norms whole,
    embedding and LM head by padded vocabulary rows."""
    h, heads, kv, i = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    hd = h // heads
    per_layer = (2 * h * heads * hd) // tp + (2 * h * kv * hd) // min(tp, kv) + (3 * h * i) // tp + 2 * h
    rows = padded(c["vocab_size"]) // tp if tp > 1 else c["vocab_size"]
    total = layers * per_layer
    if first:
        total += rows * h
    if last:
        total += rows * h + h  # LM head and the final norm
    return total * BF16


def llama_rank_kv(c: dict, tp: int, layers: int, max_model_len: int, block: int = CUDA_BLOCK) -> int:
    """vLLM's per-rank pool: each layer holds whole blocks of max_model_len tokens, plus the null block."""
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c["hidden_size"] // heads
    per_token_layer = 2 * max(1, kv // tp) * hd * BF16
    return layers * (-(-max_model_len // block) + 1) * block * per_token_layer


# ------------------------------------------------------------------- tests

def test_pp_partition_is_vllms(monkeypatch):
    utils = pytest.importorskip("vllm.distributed.utils")
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    for layers, pp in ((126, 2), (80, 3), (61, 4), (32, 5), (27, 2), (7, 7)):
        assert pp_partition(layers, pp) == [utils.get_pp_indices(layers, r, pp) for r in range(pp)]


def test_layouts_try_tp_on_one_host_before_pp_and_before_other_hosts():
    order = candidate_layouts([8, 8])
    assert order[:3] == [Layout(2, 1), Layout(3, 1), Layout(4, 1)]
    assert order.index(Layout(8, 1)) < order.index(Layout(2, 2)) < order.index(Layout(8, 2, 2))
    assert all(l.world_size > 8 for l in order if l.hosts == 2)
    assert candidate_layouts([8], tp=2, pp=2) == [Layout(2, 2)]


def test_llama70b_takes_tp4_on_h100s_with_per_rank_budgets(capsys, checkpoints):
    path, c = checkpoints["l70"]
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(DATA / "devices-8xh100.json"))
    assert code == 0 and doc["admitted"]
    par = doc["parallel"]
    # One H100 (80 GiB) cannot hold 131 GiB of weights; at 131072 tokens TP 2 ranks need 66 GiB of weights and
    # 20 GiB of KV each, so TP 4 is the smallest layout that fits.
    assert (par["tensor_parallel_size"], par["pipeline_parallel_size"], par["executor"]) == (4, 1, "mp")
    assert [r["device_id"] for r in par["ranks"]] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    layers, ctx = c["num_hidden_layers"], c["max_position_embeddings"]
    for rank in par["ranks"]:
        assert rank["weight_bytes"] == llama_rank_weights(c, 4, layers)
        assert rank["kv_cache_bytes"] == llama_rank_kv(c, 4, layers, ctx)
    kwargs = doc["engine_kwargs"]
    assert kwargs["tensor_parallel_size"] == 4 and kwargs["distributed_executor_backend"] == "mp"
    assert kwargs["kv_cache_memory_bytes"] == llama_rank_kv(c, 4, layers, ctx)
    uuids = [d["extras"]["uuid"] for d in json.loads((DATA / "devices-8xh100.json").read_text())["devices"][:4]]
    assert par["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(uuids)
    # The plan's own table is rank 0's device: its weights term is the rank's slice.
    assert next(r["bytes"] for r in doc["reservations"] if r["purpose"] == "weights") == \
        llama_rank_weights(c, 4, layers)


def test_llama70b_on_two_4090s_is_refused_naming_a_quantized_build(capsys, checkpoints):
    path, _ = checkpoints["l70"]
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(DATA / "devices-2x4090.json"))
    assert code == 2 and not doc["admitted"] and doc["parallel"] is None
    widest = [r for r in doc["refusals"] if r["message"].startswith("even split")]
    assert len(widest) == 1 and "TP 2" in widest[0]["message"]
    assert "4-bit build" in widest[0]["remedy"] and "GPTQ or AWQ" in widest[0]["remedy"]


def test_llama8b_needs_two_4090s_at_its_full_context(capsys, checkpoints):
    path, c = checkpoints["l8"]
    devices = str(DATA / "devices-2x4090.json")
    # At 8192 tokens one card is enough, and is what the planner picks.
    code, doc = _plan(capsys, "--model", str(path), "--devices", devices, "--max-model-len", "8192")
    assert code == 0 and doc["parallel"] is None and doc["selected_device"] == "cuda:0"
    # At 131072 tokens (16 GiB of KV beside 15 GiB of weights) it is not; TP 2 halves both.
    code, doc = _plan(capsys, "--model", str(path), "--devices", devices)
    assert code == 0 and doc["parallel"]["tensor_parallel_size"] == 2
    single = next(v for v in doc["devices"] if v["device_id"] == "cuda:0")
    assert single["selected"]
    for rank in doc["parallel"]["ranks"]:
        assert rank["weight_bytes"] == llama_rank_weights(c, 2, c["num_hidden_layers"])
        assert rank["kv_cache_bytes"] == llama_rank_kv(c, 2, c["num_hidden_layers"], c["max_position_embeddings"])


@pytest.mark.parametrize("kept,env", [
    ("nvml_index", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1"}),
    (None, {}),  # a hand-written list: cuda:N is an ordinal where it was written, so visibility is left alone
])
def test_the_group_is_pinned_by_what_the_list_records_and_never_by_its_ordinals(capsys, checkpoints, tmp_path,
                                                                                 kept, env):
    path, _ = checkpoints["l8"]
    doc = json.loads((DATA / "devices-2x4090.json").read_text())
    for device in doc["devices"]:
        device["extras"] = {k: v for k, v in device["extras"].items() if k not in ("uuid", "nvml_index") or k == kept}
    listed = tmp_path / "devices.json"
    listed.write_text(json.dumps(doc))
    code, plan = _plan(capsys, "--model", str(path), "--devices", str(listed))
    assert code == 0 and plan["parallel"]["tensor_parallel_size"] == 2
    assert plan["parallel"]["env"] == env
    unpinned = [n for n in plan["notes"] if "neither a UUID nor an NVML index" in n]
    assert bool(unpinned) is (kept is None)


def _layout_refusals(doc: dict) -> dict[str, dict]:
    return {r["details"]["dimension"]: r for r in doc["refusals"] if r["code"] == "parallel_layout_invalid"}


def test_kv_heads_that_do_not_divide_by_the_tp_size_are_refused_with_the_sizes_that_work(capsys, checkpoints):
    path, c = checkpoints["l8"]
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(DATA / "devices-8xh100.json"),
                      "--tensor-parallel-size", "6")
    assert code == 2
    found = _layout_refusals(doc)
    assert "8 KV heads are not divisible by 6" in found["kv_heads"]["message"]
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    works = [k for k in range(1, 17) if heads % k == 0 and (kv % k == 0 or k % kv == 0)
             and padded(c["vocab_size"]) % k == 0 and c["intermediate_size"] % k == 0]
    assert works == [1, 2, 4, 8, 16]
    # Only the sizes the list's eight cards can host are offered.
    assert found["kv_heads"]["details"]["valid_tensor_parallel_sizes"] == [k for k in works if k <= 8]
    assert "attention_heads" in found  # 32 heads do not split 6 ways either


def test_a_32000_vocabulary_does_not_split_three_ways(capsys, checkpoints):
    path, c = checkpoints["m7"]
    assert c["vocab_size"] == 32000 and padded(32000) % 3
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(DATA / "devices-4xa6000.json"),
                      "--tensor-parallel-size", "3")
    assert code == 2
    vocab = _layout_refusals(doc)["vocab"]
    assert vocab["details"]["padded_vocab_size"] == 32000 and "not divisible by 3" in vocab["message"]


def test_gptq_groups_must_stay_whole_per_rank(capsys, checkpoints):
    path, c = checkpoints["qwen72_gptq"]
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(DATA / "devices-8xh100.json"),
                      "--tensor-parallel-size", "8")
    assert code == 2
    group = _layout_refusals(doc)["quantization_group"]
    per_rank = c["intermediate_size"] // 8
    assert per_rank % 128 and f"is {per_rank} columns per rank" in group["message"]
    assert set(_layout_refusals(doc)) == {"quantization_group"}  # heads, KV heads, vocab all divide by 8


def test_mla_latent_is_not_split_by_tp(capsys, tmp_path):
    from reference_set import BY_NAME, write_published

    entry = BY_NAME["deepseek-ai--DeepSeek-V2-Lite"]
    path = write_published(entry, tmp_path / "dsv2")
    c = entry.config
    args = ("--model", str(path), "--devices", str(DATA / "devices-2x4090.json"), "--max-model-len", "8192")
    code, one = _plan(capsys, *args)
    code2, two = _plan(capsys, *args, "--tensor-parallel-size", "2")
    assert code == 0 and code2 == 0
    # One latent of kv_lora_rank + qk_rope_head_dim per token per layer, whole on every rank.
    latent = (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * BF16
    expected = c["num_hidden_layers"] * (-(-8192 // CUDA_BLOCK) + 1) * CUDA_BLOCK * latent
    assert one["engine_kwargs"]["kv_cache_memory_bytes"] == expected
    assert [r["kv_cache_bytes"] for r in two["parallel"]["ranks"]] == [expected, expected]
    # The weights do split: each rank holds well under the whole checkpoint (experts and projections by TP).
    weights = one["manifest"]["weight_bytes"]
    assert all(weights / 2 < r["weight_bytes"] < weights * 0.6 for r in two["parallel"]["ranks"])


def test_a_405b_model_spans_two_hosts_as_pp2_x_tp8_on_the_multi_node_executor(capsys, checkpoints):
    path, c = checkpoints["l405"]
    a, b = str(DATA / "devices-8xh100.json"), str(DATA / "devices-8xh100-b.json")
    code, doc = _plan(capsys, "--model", str(path), "--devices", a, "--devices", b, "--max-model-len", "16384")
    assert code == 0
    par = doc["parallel"]
    assert (par["tensor_parallel_size"], par["pipeline_parallel_size"], par["executor"]) == (8, 2, "mp")
    assert par["hosts"] == ["node-a", "node-b"]
    stages = pp_partition(c["num_hidden_layers"], 2)
    assert stages == [(0, 63), (63, 126)]
    for rank in par["ranks"]:
        stage = rank["rank"] // 8
        assert rank["host"] == ("node-a", "node-b")[stage] and tuple(rank["layers"]) == stages[stage]
        assert rank["weight_bytes"] == llama_rank_weights(c, 8, 63, first=stage == 0, last=stage == 1)
        assert rank["kv_cache_bytes"] == llama_rank_kv(c, 8, 63, 16384)
    # One vllm serve per node, joined by vLLM's multi-node mode; node 1 runs ranks 8-15 headless.
    commands = [(x["host"], x["node_rank"], x["ranks"], x["command"]) for x in par["commands"]]
    assert [c[:3] for c in commands] == [("node-a", 0, list(range(8))), ("node-b", 1, list(range(8, 16)))]
    assert all("--tensor-parallel-size 8 --pipeline-parallel-size 2 --distributed-executor-backend mp --nnodes 2"
               in c[3] for c in commands)
    assert commands[1][3].endswith("--node-rank 1 --master-addr node-a --master-port 29501 --headless")
    kwargs = doc["engine_kwargs"]
    assert (kwargs["distributed_executor_backend"], kwargs["nnodes"], kwargs["node_rank"]) == ("mp", 2, 0)


def test_ray_is_the_executor_only_when_chosen(capsys, checkpoints):
    path, _ = checkpoints["l405"]
    a, b = str(DATA / "devices-8xh100.json"), str(DATA / "devices-8xh100-b.json")
    code, doc = _plan(capsys, "--model", str(path), "--devices", a, "--devices", b, "--max-model-len", "16384",
                      "--distributed-executor-backend", "ray")
    assert code == 0
    par = doc["parallel"]
    assert par["executor"] == "ray" and doc["engine_kwargs"]["distributed_executor_backend"] == "ray"
    commands = [(x["host"], x["command"]) for x in par["commands"]]
    assert commands[0] == ("node-a", "ray start --head --port=6379")
    assert commands[1] == ("node-b", "ray start --address=node-a:6379")
    assert commands[2][0] == "node-a" and f"--devices {a} --devices {b}" in commands[2][1]
    assert "--distributed-executor-backend ray" in commands[2][1]


def test_hosts_with_different_runtime_builds_are_refused(capsys, checkpoints, tmp_path):
    path, _ = checkpoints["l405"]
    other = json.loads((DATA / "devices-8xh100-b.json").read_text())
    for device in other["devices"]:
        device["extras"]["runtime"] = "vllm 0.31.0"
    b = tmp_path / "b.json"
    b.write_text(json.dumps(other))
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(DATA / "devices-8xh100.json"),
                      "--devices", str(b), "--max-model-len", "16384")
    assert code == 2
    runtime = _layout_refusals(doc)["runtime"]
    assert "vllm 0.32.0" in runtime["message"] and "vllm 0.31.0" in runtime["message"]


def test_unlike_devices_do_not_form_a_group(capsys, checkpoints, tmp_path):
    path, _ = checkpoints["l8"]
    mixed = json.loads((DATA / "devices-2x4090.json").read_text())
    mixed["devices"][1].update(name="NVIDIA GeForce RTX 3090", compute_capability="sm_86")
    doc_path = tmp_path / "mixed.json"
    doc_path.write_text(json.dumps(mixed))
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(doc_path), "--tensor-parallel-size", "2")
    assert code == 2
    devices = _layout_refusals(doc)["devices"]
    assert "RTX 3090" in devices["message"] and "RTX 4090" in devices["message"]


def test_more_stages_than_layers_is_refused(capsys):
    from edge_core.artifact import DEMO_MODEL

    layers = json.loads((Path(DEMO_MODEL) / "config.json").read_text())["num_hidden_layers"]
    code, doc = _plan(capsys, "--model", str(DEMO_MODEL), "--devices", str(DATA / "devices-8xh100.json"),
                      "--pipeline-parallel-size", str(layers * 2))
    assert code == 2
    assert f"{layers} layers cannot fill {layers * 2} pipeline stages" in _layout_refusals(doc)["layers"]["message"]


def test_vllm_cpu_ranks_bind_one_numa_node_each(capsys, checkpoints):
    path, c = checkpoints["l8"]
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(DATA / "devices-cpu-2socket.json"),
                      "--tensor-parallel-size", "2", "--max-model-len", "8192")
    assert code == 0
    par = doc["parallel"]
    # Eager (the default): inductor is kept out of the embedding's masked lookup, which vLLM compiles at TP > 1.
    assert par["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-31|32-63", "TORCH_COMPILE_DISABLE": "1"}
    assert [r["device_id"] for r in par["ranks"]] == ["cpu", "cpu"]
    # Both ranks share the host pool: the device's budget holds both ranks' slices and pools.
    kv = {r["purpose"]: r["bytes"] for r in par["devices"][0]["reservations"]}
    assert kv["weights"] == 2 * llama_rank_weights(c, 2, c["num_hidden_layers"])
    assert kv["kv_cache"] == 2 * llama_rank_kv(c, 2, c["num_hidden_layers"], 8192, block=128)


def test_device_ids_restrict_the_candidates(capsys, checkpoints):
    path, _ = checkpoints["l8"]
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(DATA / "devices-8xh100.json"),
                      "--device-ids", "cuda:5,cuda:6", "--tensor-parallel-size", "2")
    assert code == 0 and [r["device_id"] for r in doc["parallel"]["ranks"]] == ["cuda:5", "cuda:6"]
    assert main(["plan", "--model", str(path), "--devices", str(DATA / "devices-8xh100.json"),
                 "--device-ids", "cuda:9"]) == 64
    assert "no device is named cuda:9" in capsys.readouterr().err


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_each_hosts_device_is_planned_against_its_own_hosts_memory(capsys, checkpoints, tmp_path):
    """Two CPU hosts' lists: the 8B model fits the 32 GiB one only, whichever list comes first."""
    path, _ = checkpoints["l8"]
    big = json.loads((DATA / "devices-cpu-32g.json").read_text())
    big["host"]["hostname"] = "big"
    small = json.loads(json.dumps(big))
    small["host"].update(hostname="small", mem_total_bytes=8 * GIB, mem_available_bytes=7 * GIB)
    small["devices"][0]["memory_bytes"] = 8 * GIB
    lists = []
    for doc in (small, big):
        listed = tmp_path / f"{doc['host']['hostname']}.json"
        listed.write_text(json.dumps(doc))
        lists += ["--devices", str(listed)]
    code, doc = _plan(capsys, "--model", str(path), *lists, "--max-model-len", "8192")
    assert code == 0 and doc["admitted"] and doc["selected_device"] == "big/cpu"
    small_verdict = next(v for v in doc["devices"] if v["device_id"] == "small/cpu")
    assert not small_verdict["selected"] and small_verdict["refusals"]


def test_a_memory_refusal_on_the_named_devices_names_the_layout_that_fits_on_the_whole_list(capsys, checkpoints):
    path, _ = checkpoints["l70"]
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(DATA / "devices-8xh100.json"),
                      "--device-ids", "cuda:0")
    assert code == 2 and not doc["admitted"] and doc["parallel"] is None
    [refusal] = [r for r in doc["refusals"] if r["code"] == "budget_exceeds_device"]
    # 131 GiB of weights: one 80 GiB card cannot, TP 4 on four of the list's eight can (the TP 4 test above).
    assert "TP 4 on cuda:0,cuda:1,cuda:2,cuda:3" in refusal["remedy"]
    assert "--device-ids cuda:0,cuda:1,cuda:2,cuda:3 --tensor-parallel-size 4" in refusal["remedy"]
    code, doc = _plan(capsys, "--model", str(path), "--devices", str(DATA / "devices-2x4090.json"),
                      "--device-ids", "cuda:0")
    assert "beyond --device-ids" not in json.dumps(doc["refusals"])  # nothing on the whole list fits either
