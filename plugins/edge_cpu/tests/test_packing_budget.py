"""What the plan budgets for vLLM CPU's packed tables and re-packing with edge-cpu's packing levers as set."""

from __future__ import annotations

import types

import pytest

from edge_core.host import HostFacts
from edge_cpu import _memory, _packing, _vllm_support

GIB = 1 << 30
ON = {_packing.ONE_TABLE_ENV: True, _packing.SHARED_TABLE_ENV: True, _packing.REPACK_TRIM_ENV: True}


def host() -> HostFacts:
    return HostFacts(system="linux", mem_total_bytes=32 * GIB, mem_available_bytes=28 * GIB,
                     cgroup_limit_bytes=None, cgroup_usage_bytes=None, logical_cores=8, physical_cores=4,
                     cpu_model="x", machine="x86_64", isa_flags=("avx512f",), numa_nodes=())


def manifest(*, tied: bool, vocab: int = 151936, hidden: int = 2048, shards=(GIB // 4,) * 12, tensors=None):
    config = {"vocab_size": vocab, "hidden_size": hidden, "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}
    files = tuple((f"model-{i:05d}.safetensors", size) for i, size in enumerate(shards, 1))
    return types.SimpleNamespace(config=config, dtype="bfloat16", files=files, weight_bytes=sum(shards),
                                 tensors=tensors, architecture="Qwen3ForCausalLM")


def terms(m, levers=ON, share=None) -> dict[str, int]:
    return {t.purpose: t.bytes for t in _memory.reservations(m, None, host(), share, levers=levers)}


TABLE = 151936 * 2048 * 2


def test_a_tied_table_is_held_once_with_every_lever_on():
    t = terms(manifest(tied=True))
    assert t["embedding_packed_copy"] == 0
    # no tensor table: the holes bound stays the flat share of the float matrices (the 256 MiB mapping is a phase
    # before it: the tree PSS shows the larger, admission only the holes)
    holes = int(_memory.REPACK_HOLES_SHARE * (3 * GIB - TABLE))
    assert t["linear_repack_transient"] == holes


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
