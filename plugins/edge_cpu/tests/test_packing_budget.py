"""What the plan budgets for vLLM CPU's packed tables and re-packing with edge-cpu's packing levers as set."""

from __future__ import annotations

import types

import pytest

from edge_core.host import HostFacts
from edge_cpu import _memory, _packing, _vllm_support

GIB = 1 << 30
ON = {_packing.ONE_TABLE_ENV: True, _packing.SHARED_TABLE_ENV: True, _packing.REPACK_TRIM_ENV: True}


#: This project's host (Sapphire Rapids): vLLM CPU loads its build with sgl-kernel's packed GEMM here.
PACKED_GEMM = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile")


def host(flags: tuple[str, ...] = PACKED_GEMM, machine: str = "x86_64") -> HostFacts:
    return HostFacts(system="linux", mem_total_bytes=32 * GIB, mem_available_bytes=28 * GIB,
                     cgroup_limit_bytes=None, cgroup_usage_bytes=None, logical_cores=8, physical_cores=4,
                     cpu_model="x", machine=machine, isa_flags=flags, numa_nodes=())


def manifest(*, tied: bool, vocab: int = 151936, hidden: int = 2048, shards=(GIB // 4,) * 12, tensors=None):
    config = {"vocab_size": vocab, "hidden_size": hidden, "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}
    files = tuple((f"model-{i:05d}.safetensors", size) for i, size in enumerate(shards, 1))
    return types.SimpleNamespace(config=config, dtype="bfloat16", files=files, weight_bytes=sum(shards),
                                 tensors=tensors, architecture="Qwen3ForCausalLM")


def terms(m, levers=ON, share=None, on=None, session=None) -> dict[str, int]:
    return {t.purpose: t.bytes for t in _memory.reservations(m, session, on or host(), share, levers=levers)}


TABLE = 151936 * 2048 * 2


def test_a_tied_table_is_held_once_with_every_lever_on():
    t = terms(manifest(tied=True))
    assert t["embedding_packed_copy"] == 0
    # no tensor table: the holes bound stays the flat share of the float matrices (the 256 MiB mapping is a phase
    # before it: the tree PSS shows the larger, admission only the holes)
    holes = int(_memory.REPACK_HOLES_SHARE * (3 * GIB - TABLE))
    assert t["linear_repack_transient"] == holes


@pytest.mark.parametrize("flags,machine", [
    (("avx2", "avx512f", "avx512bw", "avx512vl"), "x86_64"),  # AVX-512 without BF16: vLLM loads _C_AVX512
    (("avx2", "fma"), "x86_64"),  # AVX2 only: _C_AVX2
    (("asimd", "sve"), "aarch64"),
])
def test_where_the_host_has_no_packed_gemm_the_tied_head_holds_vllms_copy(flags, machine):
    # The engine packs the tied head as vLLM does there (test_packing.py forces that branch): one more table.
    assert terms(manifest(tied=True), on=host(flags, machine))["embedding_packed_copy"] == TABLE


def test_a_table_outside_the_packed_layout_holds_vllms_copy_even_where_the_gemm_is():
    m = manifest(tied=True)
    m.dtype = "float16"  # sgl-kernel's blocks are bfloat16 only
    assert terms(m)["embedding_packed_copy"] == TABLE  # float16: 2 bytes an element, as bfloat16
    assert terms(manifest(tied=True))["embedding_packed_copy"] == 0


def test_the_runtime_baseline_is_the_plans_process_layout():
    m = manifest(tied=True)
    one = types.SimpleNamespace(enforce_eager=True, in_process=True)
    apart = types.SimpleNamespace(enforce_eager=True, in_process=False)
    assert terms(m, session=one)["runtime_baseline"] == _memory.RUNTIME_BASELINE_ONE_PROCESS_BYTES
    assert terms(m, session=apart)["runtime_baseline"] == _memory.RUNTIME_BASELINE_BYTES
    assert terms(m)["runtime_baseline"] == _memory.RUNTIME_BASELINE_BYTES  # no session: the layout vLLM defaults to
    assert _memory.RUNTIME_BASELINE_ONE_PROCESS_BYTES < _memory.RUNTIME_BASELINE_BYTES


def test_a_tied_head_packs_one_copy_without_the_shared_table():
    t = terms(manifest(tied=True), levers={**ON, _packing.SHARED_TABLE_ENV: False})
    assert t["embedding_packed_copy"] == TABLE  # vLLM as it is: 2 x TABLE (tests/test_cpu_backend.py)


def test_an_untied_head_replaces_its_float_and_both_exist_while_it_is_packed():
    t = terms(manifest(tied=False))
    assert t["embedding_packed_copy"] == 0
    holes = int(_memory.REPACK_HOLES_SHARE * (3 * GIB - 2 * TABLE))
    assert t["linear_repack_transient"] == TABLE + holes


def test_a_class_that_computes_logits_from_the_embedding_packs_it_once(monkeypatch):
    monkeypatch.setattr(_vllm_support, "logits_from_embedding", lambda src, arch: True)
    assert terms(manifest(tied=True))["embedding_packed_copy"] == TABLE


class _Shard:
    def __init__(self, rows):
        self.names = [r[0] for r in rows]
        self.dtypes = [r[1] for r in rows]
        self.nbytes = [r[2] for r in rows]


class _Table:
    def __init__(self, rows):
        self._shards = [_Shard(rows)]

    def __len__(self):
        return len(self._shards[0].names)

    def shards(self):
        return self._shards


def test_with_each_hole_trimmed_repacking_holds_one_matrix_beside_its_copy():
    mib = 1 << 20
    rows = [("model.embed_tokens.weight", "BF16", TABLE), ("lm_head.weight", "BF16", TABLE),
            ("model.layers.0.mlp.gate_proj.weight", "BF16", 24 * mib),
            ("model.layers.0.mlp.experts.0.up_proj.weight", "BF16", 96 * mib),
            ("model.layers.0.self_attn.q_proj.weight", "BF16", 8 * mib),
            ("model.layers.0.mlp.down_proj.weight", "I8", 48 * mib)]
    m = manifest(tied=False, shards=(GIB // 8,) * 24, tensors=_Table(rows))
    t = terms(m)
    assert _memory.largest_linear_bytes(m) == 2 * 24 * mib  # tables, experts and int8 weights left out
    assert t["linear_repack_transient"] == TABLE + 48 * mib


def test_the_levers_are_read_from_the_environment_the_engine_inherits(monkeypatch):
    m = manifest(tied=True)
    for name in ON:
        monkeypatch.delenv(name, raising=False)
    assert terms(m, levers=None)["embedding_packed_copy"] == 0
    monkeypatch.setenv(_packing.ONE_TABLE_ENV, "0")
    assert terms(m, levers=None)["embedding_packed_copy"] == 2 * TABLE


@pytest.mark.parametrize("tp,pp,tied,held,transient", [
    (2, 1, True, 0, 0),           # one tied table per rank, shared: nothing packed
    (2, 1, False, 0, 1024),       # each rank's untied head slice: float beside packed while packing
    (1, 2, True, 0, 1024),        # tied under PP: the last stage's head is its own, untied there
    (2, 2, True, 0, 1024),
])
def test_each_rank_holds_its_slice_of_the_tables(tp, pp, tied, held, transient):
    from edge_core.layout import DeviceShare, Layout

    layout = Layout(tp=tp, pp=pp)
    share = DeviceShare(layout=layout, ranks=tuple(range(tp * pp)), weight_bytes=GIB,
                        rank_weight_bytes=GIB // (tp * pp), layers=None if pp > 1 else (0, 2),
                        pp_rank=None if pp > 1 else 0)
    m = manifest(tied=tied, vocab=1000, hidden=256, shards=(GIB,))
    packed, head = _memory.one_table_bytes(m, share, head_module=True, shared_table=True)
    assert (packed, head) == (held * 256 * 2, transient * 256 * 2)


INT8_HOST = (*PACKED_GEMM, "avx512_vnni")


def quantized(m):
    m.config["quantization_config"] = {"quant_method": "compressed-tensors"}
    return m


def test_a_quantized_checkpoints_tied_table_held_as_int8_is_budgeted_while_it_is_made():
    plain = terms(manifest(tied=True), levers={**ON, _packing.INT8_HEAD_ENV: True}, on=host(INT8_HOST))
    q = terms(quantized(manifest(tied=True)), levers={**ON, _packing.INT8_HEAD_ENV: True}, on=host(INT8_HOST))
    # int8 values, the int32 sum and the float32 scale of each of the 151,936 rows, beside the float table
    int8_table = 151936 * (2048 + 4 + 4)
    assert q["embedding_packed_copy"] == plain["embedding_packed_copy"] == 0
    assert q["linear_repack_transient"] - plain["linear_repack_transient"] == int8_table
    off = terms(quantized(manifest(tied=True)), levers={**ON, _packing.INT8_HEAD_ENV: False}, on=host(INT8_HOST))
    assert off == plain


def test_without_the_int8_gemm_a_quantized_checkpoints_table_is_budgeted_as_the_shared_one():
    q = terms(quantized(manifest(tied=True)), levers={**ON, _packing.INT8_HEAD_ENV: True}, on=host(PACKED_GEMM))
    assert q == terms(manifest(tied=True))
