"""edge-cpu's packing levers: each vocab table packed once, holes trimmed while re-packing (edge_cpu/_packing.py)."""

from __future__ import annotations

import importlib.metadata as metadata
import sys
import textwrap
import types

import pytest

from edge_core.kit.vllm_source import SourceTree, installed_vllm
from edge_cpu import _engine, _imports, _packing


class Embedding:
    def __init__(self, weight: object) -> None:
        self.weight = weight


class Head(Embedding):
    pass


def fake_dispatch_module(calls: list[tuple]) -> types.ModuleType:
    module = types.ModuleType("fake_layers_utils")

    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        calls.append(("pack", layer.name, remove_weight))

        def cpu_linear(x, weight, bias, handler=None):
            return ("packed product", layer.name)

        layer.cpu_linear = cpu_linear

    module.dispatch_cpu_unquantized_gemm = dispatch_cpu_unquantized_gemm
    return module


def tables(tied: bool) -> tuple[Embedding, Head]:
    embed = Embedding(object())
    head = Head(embed.weight if tied else object())
    embed.name, head.name = "embed_tokens", "lm_head"
    return embed, head


@pytest.fixture(autouse=True)
def fresh_counts(monkeypatch):
    monkeypatch.setattr(_packing, "COUNTS", dict.fromkeys(_packing.COUNTS, 0))


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("off", False), ("false", False)])
def test_a_lever_is_on_unless_its_variable_says_0(value, on):
    environ = {} if value is None else {_packing.ONE_TABLE_ENV: value}
    assert _packing.enabled(_packing.ONE_TABLE_ENV, environ) is on


def test_a_head_holding_the_embeddings_weight_is_tied():
    embed, head = tables(tied=True)
    other = types.SimpleNamespace(weight=object())
    assert _packing.mark_tables([embed, other, head], Embedding, Head) == {"gather": 1, "tied_head": 1,
                                                                           "untied_head": 0}
    assert (getattr(embed, _packing.ROLE), getattr(head, _packing.ROLE)) == ("gather", "tied_head")
    assert not hasattr(other, _packing.ROLE)


def test_a_head_with_its_own_weight_is_untied():
    embed, head = tables(tied=False)
    _packing.mark_tables([embed, head], Embedding, Head)
    assert getattr(head, _packing.ROLE) == "untied_head"


def dispatched(tied: bool, **levers) -> tuple[list[tuple], list[int], Embedding, Head]:
    calls: list[tuple] = []
    trims: list[int] = []
    module = fake_dispatch_module(calls)
    assert _packing.wrap_dispatch(module, trimmer=lambda: trims.append(1) or True, **levers)
    embed, head = tables(tied)
    if levers.get("one_table"):
        _packing.mark_tables([embed, head], Embedding, Head)
    module.dispatch_cpu_unquantized_gemm(embed, remove_weight=False)
    module.dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return calls, trims, embed, head


def test_the_embedding_is_not_packed_until_a_product_is_asked_of_it():
    calls, _, embed, _ = dispatched(tied=True, one_table=True, repack_trim=False)
    assert ("pack", "embed_tokens", False) not in calls and _packing.COUNTS["tables_deferred"] == 1
    # a class that computes logits from the embedding (Gemma 2's) gets vLLM's packed copy on first use
    assert embed.cpu_linear("x", embed.weight, None) == ("packed product", "embed_tokens")
    assert ("pack", "embed_tokens", False) in calls and _packing.COUNTS["tables_packed_on_use"] == 1
    assert embed.cpu_linear("x", embed.weight, None) == ("packed product", "embed_tokens")
    assert calls.count(("pack", "embed_tokens", False)) == 1


def test_an_untied_head_drops_its_float_weight_once_packed():
    calls, _, _, _ = dispatched(tied=False, one_table=True, repack_trim=False)
    assert calls == [("pack", "lm_head", True)]


def test_a_tied_head_keeps_the_float_table_the_embedding_gathers_from():
    calls, _, _, head = dispatched(tied=True, one_table=True, repack_trim=False)
    assert calls == [("pack", "lm_head", False)]


def test_a_shared_table_head_whose_table_cannot_be_packed_in_place_is_packed_as_vllm_packs_it():
    pytest.importorskip("torch")
    calls, _, _, head = dispatched(tied=True, one_table=True, repack_trim=False, shared_table=True)
    # no tensor to re-lay out: vLLM's own copy beside the float table the embedding gathers from
    assert calls == [("pack", "lm_head", False)] and head.cpu_linear("x", None, None) == ("packed product", "lm_head")
    assert _packing.COUNTS["tied_heads_packed_apart"] == 1 and _packing.COUNTS["tables_shared_packed"] == 0


def test_with_one_table_off_vllm_packs_both_as_it_does():
    calls, trims, _, _ = dispatched(tied=True, one_table=False, repack_trim=False, shared_table=True)
    assert calls == [("pack", "embed_tokens", False), ("pack", "lm_head", False)] and trims == []


def test_the_heap_is_trimmed_after_every_repack_only_with_the_trim_on():
    _, trims, _, _ = dispatched(tied=False, one_table=False, repack_trim=True)
    assert trims == [1, 1] and _packing.COUNTS["repack_trims"] == 2


def test_wrapping_twice_wraps_once():
    calls: list[tuple] = []
    module = fake_dispatch_module(calls)
    trims: list[int] = []
    for _ in range(2):
        assert _packing.wrap_dispatch(module, one_table=False, repack_trim=True, trimmer=lambda: trims.append(1))
    layer = types.SimpleNamespace(name="q_proj")
    module.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
    assert calls == [("pack", "q_proj", True)] and trims == [1]


def test_the_loader_marks_the_tables_before_vllm_processes_them(monkeypatch):
    seen: list[str | None] = []
    vocab = types.ModuleType(_packing.TABLES_MODULE)
    vocab.VocabParallelEmbedding, vocab.ParallelLMHead = Embedding, Head
    monkeypatch.setitem(sys.modules, _packing.TABLES_MODULE, vocab)
    loader = types.ModuleType("fake_base_loader")
    embed, head = tables(tied=False)
    loader.process_weights_after_loading = lambda model, config, device: seen.append(
        getattr(head, _packing.ROLE, None))
    model = types.SimpleNamespace(modules=lambda: [embed, head])
    assert _packing.wrap_loader(loader)
    loader.process_weights_after_loading(model, "config", "cpu")
    assert seen == ["untied_head"]


@pytest.fixture
def no_finders(monkeypatch):
    """Only the packing's own finders counted: edge-cpu's other vLLM plugins (the heap trim, the PP buffers) may
    have left theirs in this process, and they are not these tests' business."""
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, _imports.AfterImport)])
    for name in (_packing.DISPATCH_MODULE, _packing.LOADER_MODULE):
        monkeypatch.delitem(sys.modules, name, raising=False)


def test_install_patches_nothing_in_an_engine_edge_did_not_start(no_finders, monkeypatch):
    monkeypatch.delenv(_engine.ENGINE_ENV, raising=False)  # a user's own vLLM in this venv: every lever on
    for name in _packing.levers():
        monkeypatch.delenv(name, raising=False)
    _packing.install()
    assert not [f for f in sys.meta_path if isinstance(f, _imports.AfterImport)]
    assert not any(_packing.active_levers().values()) and all(_packing.levers().values())


def test_install_patches_nothing_with_every_lever_off(no_finders, monkeypatch):
    monkeypatch.setenv(_engine.ENGINE_ENV, "1")
    for name in _packing.levers():
        monkeypatch.setenv(name, "0")
    _packing.install()
    assert not [f for f in sys.meta_path if isinstance(f, _imports.AfterImport)]
    for name in _packing.levers():
        monkeypatch.delenv(name)
    _packing.install()
    _packing.install()
    patched = sorted(f.module for f in sys.meta_path if isinstance(f, _imports.AfterImport))
    assert patched == sorted([_packing.DISPATCH_MODULE, _packing.LOADER_MODULE])


def test_the_patch_runs_once_the_module_has_been_imported(tmp_path, monkeypatch):
    name = "edge_test_packing_target"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent("""
        def dispatch_cpu_unquantized_gemm(layer, remove_weight):
            return "vLLM's"
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    patched: list[str] = []
    _imports.patch_on_import(name, lambda module: patched.append(module.__name__) or True)
    module = __import__(name)
    assert patched == [name] and module.dispatch_cpu_unquantized_gemm(None, True) == "vLLM's"
    sys.modules.pop(name, None)


def test_vllm_loads_it_as_a_general_plugin():
    points = {ep.name: ep.value for ep in metadata.entry_points(group="vllm.general_plugins")}
    assert points.get("edge_cpu_packing") == "edge_cpu._packing:install"


def test_the_installed_vllm_packs_where_the_levers_look():
    _, _, root = installed_vllm()
    if root is None:
        pytest.skip("no vLLM installed")
    tree = SourceTree(root)
    utils = (root / "model_executor/layers/utils.py").read_text()
    assert f"def {_packing.DISPATCH}(" in utils
    # the closures vLLM installs over a packed copy, which probe() recognises
    assert "ops.onednn_mm(handler, x, bias)" in utils and "packed_weight,\n" in utils
    # called by name at call time, so the wrapped module attribute is what runs
    embedding = (root / "model_executor/layers/vocab_parallel_embedding.py").read_text()
    assert f"from vllm.model_executor.layers.utils import {_packing.DISPATCH}" in embedding
    assert f"{_packing.DISPATCH}(layer, remove_weight=False)" in embedding
    base_loader = (root / "model_executor/model_loader/base_loader.py").read_text()
    assert f"    {_packing.PROCESS},\n" in base_loader or f"import {_packing.PROCESS}" in base_loader
    assert f"{_packing.PROCESS}(model, model_config, target_device)" in base_loader
    assert tree.module("model_executor/layers/vocab_parallel_embedding.py") is not None


def packed_modules(rows: int = 256, hidden: int = 64, dtype: str = "bfloat16"):
    """A tied embedding and head over one real table, with vLLM's per-module embedding method."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("vllm._custom_ops")
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(rows, hidden, generator=generator).to(getattr(torch, dtype)),
                                requires_grad=False)
    method = types.SimpleNamespace(embedding=lambda layer, ids: torch.nn.functional.embedding(ids, layer.weight))
    embed = types.SimpleNamespace(weight=weight, quant_method=method)
    head = types.SimpleNamespace(weight=weight, bias=None)
    return torch, weight.detach().clone(), embed, head


def packed_gemm_here() -> bool:
    """Whether the vLLM CPU build this host loads has sgl-kernel's packed GEMM (x86 AVX-512 BF16: ``vllm._C``)."""
    pytest.importorskip("torch")
    pytest.importorskip("vllm._custom_ops")
    return _packing._sgl_pack() is not None


#: Why the in-place path is skipped where the host's vLLM build lacks it; the fallback test runs everywhere.
NO_PACKED_GEMM = ("this host's vLLM CPU build has no sgl-kernel packed GEMM (it needs x86 AVX-512 with BF16, "
                  "which loads vllm._C; others load _C_AVX512/_C_AVX2): its fallback, vLLM's own copy of the tied "
                  "head, is tested by test_without_the_packed_gemm_the_tied_head_is_packed_as_vllm_packs_it")


def test_the_plan_asks_the_host_what_the_engine_finds():
    # The planner's question, from /proc/cpuinfo's flags, is the one the engine answers by looking up the ops.
    from edge_core.host import read_host

    host = read_host()
    assert _packing.host_has_packed_gemm(host.isa_flags, host.machine) == packed_gemm_here()


@pytest.mark.parametrize("flags,machine,packs", [
    (("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_tile"), "x86_64", True),  # Sapphire Rapids
    (("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"), "x86_64", True),  # Zen 4/5: no AMX, BF16
    (("avx2", "avx512f", "avx512bw", "avx512vl"), "x86_64", False),  # Skylake/Cascade Lake: no BF16
    (("avx2", "fma"), "x86_64", False),
    (("asimd", "sve"), "aarch64", False),
])
def test_the_packed_gemm_is_there_only_with_avx512_bf16(flags, machine, packs):
    assert _packing.host_has_packed_gemm(flags, machine) is packs


def test_a_shared_table_is_packed_once_in_place_for_both_modules():
    if not packed_gemm_here():
        pytest.skip(NO_PACKED_GEMM)
    torch, original, embed, head = packed_modules()
    address = embed.weight.data_ptr()
    assert _packing.share_packed_table(head, embed)
    assert embed.weight.data_ptr() == address and not torch.equal(embed.weight, original)  # rewritten in place
    ids = torch.tensor([[0, 1, 31, 32], [200, 255, 7, 7]])
    assert torch.equal(embed.quant_method.embedding(embed, ids), original[ids])  # rows read from the packed bytes
    x = torch.randn(3, 64).to(torch.bfloat16)
    logits = head.cpu_linear(x, head.weight, None)
    assert logits.shape == (3, 256) and torch.allclose(logits.float(), (x.float() @ original.float().T), atol=0.5)
    assert _packing.shared_packed(head) and _packing.COUNTS["tables_shared_packed"] == 1


@pytest.mark.parametrize("rows,hidden,dtype", [(250, 64, "bfloat16"), (256, 48, "bfloat16"), (256, 64, "float16")])
def test_a_table_the_layout_does_not_fit_is_left_as_it_is(rows, hidden, dtype):
    torch, original, embed, head = packed_modules(rows, hidden, dtype)
    assert not _packing.share_packed_table(head, embed)
    assert torch.equal(embed.weight, original) and not hasattr(head, "cpu_linear")
    # the plan asks the same question of the config, and budgets vLLM's copy of the head
    assert not _packing.table_fits_packed_layout(rows, hidden, dtype)


def test_without_the_packed_gemm_the_tied_head_is_packed_as_vllm_packs_it(monkeypatch):
    # Forced here whatever this host has: a vLLM CPU build without sgl-kernel's ops (_C_AVX512, _C_AVX2).
    torch, original, embed, head = packed_modules()
    monkeypatch.setattr(_packing, "_sgl_pack", lambda: None)
    calls: list[tuple] = []
    module = fake_dispatch_module(calls)
    assert _packing.wrap_dispatch(module, one_table=True, repack_trim=False, shared_table=True, trimmer=lambda: None)
    embed.name, head.name = "embed_tokens", "lm_head"
    setattr(head, _packing.ROLE, _packing.TIED_HEAD)  # as mark_tables marks a tied head
    head.__dict__[_packing.PARTNER] = embed
    module.dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    # vLLM's own packed copy beside the float table, which stays as it was for the embedding's lookups:
    # the table's bytes once more, which the plan budgets on such a host (test_packing_budget.py)
    assert calls == [("pack", "lm_head", False)] and torch.equal(embed.weight, original)
    assert head.cpu_linear("x", head.weight, None) == ("packed product", "lm_head")
    assert _packing.COUNTS["tied_heads_packed_apart"] == 1 and not _packing.shared_packed(head)


#: Why the int8 head's real-kernel tests are skipped where the host's vLLM build lacks the int8 GEMM.
NO_INT8_GEMM = ("this host's vLLM CPU build has no sgl-kernel int8 GEMM (it needs x86 AVX-512 with BF16 and VNNI, "
                "which loads vllm._C): there the tied head falls back to the shared float table or vLLM's copy, "
                "tested by test_a_tied_head_the_int8_table_cannot_hold_falls_back_to_the_float_table")


def int8_gemm_here() -> bool:
    pytest.importorskip("torch")
    pytest.importorskip("vllm._custom_ops")
    return _packing._sgl_int8() is not None


def test_an_int8_table_is_held_once_for_both_modules_and_the_float_table_is_freed():
    if not int8_gemm_here():
        pytest.skip(NO_INT8_GEMM)
    torch, original, embed, head = packed_modules(rows=1024, hidden=128)
    assert _packing.share_int8_table(head, embed)
    assert embed.weight.numel() == 0 and head.weight is embed.weight  # the float table is gone
    # each row: int8 round to nearest of row / (max |row| / 127), so a gathered row is within half a step
    ids = torch.tensor([[0, 1, 31, 32], [600, 1023, 7, 7]])
    step = original.float().abs().amax(dim=1) / 127
    rows = embed.quant_method.embedding(embed, ids)
    assert rows.dtype == torch.bfloat16 and rows.shape == (2, 4, 128)
    error = (rows.float() - original[ids].float()).abs()
    # half a step, plus bfloat16's rounding of the product (8 bits of mantissa: 2^-8 of the value)
    assert (error <= step[ids][..., None] / 2 + original[ids].float().abs() / 256 + 1e-6).all()
    # the head's product: activations rounded per token to int8, weights per row; against the float product
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits = head.cpu_linear(x, head.weight, None)
    exact = x.float() @ original.float().T
    assert logits.shape == (3, 1024)
    assert ((logits.float() - exact).norm() / exact.norm()).item() < 0.03
    assert torch.equal(logits.float().argmax(dim=1), exact.argmax(dim=1))
    assert _packing.shared_int8(head) and _packing.COUNTS["tables_shared_int8"] == 1


def test_the_int8_layout_the_gather_reads_is_the_kernels():
    # The packed bytes, written by vLLM's own packer, read back row by row: VNNI blocks of 32 rows, then the sums
    if not int8_gemm_here():
        pytest.skip(NO_INT8_GEMM)
    torch = pytest.importorskip("torch")
    values = torch.randint(-127, 128, (96, 64), generator=torch.Generator().manual_seed(2), dtype=torch.int8)
    packed = torch.ops._C.convert_weight_packed(values)
    assert packed.shape == (96, 64 + _packing.INT8_ROW_EXTRA)
    ids = torch.arange(96)
    assert torch.equal(_packing.gather_int8_rows(packed, torch.ones(96), ids, torch.float32), values.float())
    sums = packed.view(3, 32 * 68)[:, 32 * 64:].contiguous().view(torch.int32).reshape(96)
    assert torch.equal(sums, values.int().sum(dim=1) * 128)


def test_a_tied_head_the_int8_table_cannot_hold_falls_back_to_the_float_table(monkeypatch):
    # Forced whatever this host has: no int8 GEMM (a build without sgl-kernel's ops) leaves the table as it was.
    torch, original, embed, head = packed_modules()
    monkeypatch.setattr(_packing, "_sgl_int8", lambda: None)
    assert not _packing.share_int8_table(head, embed)
    assert torch.equal(embed.weight, original) and not hasattr(head, "cpu_linear")


def int8_dispatched(quantized: bool, monkeypatch) -> tuple[list[tuple], object]:
    """The tied head through the wrapped dispatch with the int8 head on; share_int8_table recorded, not run."""
    calls: list[tuple] = []
    module = fake_dispatch_module(calls)
    monkeypatch.setattr(_packing, "share_int8_table", lambda head, embed: calls.append(("int8", head.name)) or True)
    monkeypatch.setattr(_packing, "share_packed_table", lambda head, embed: calls.append(("shared", head.name)) or True)
    assert _packing.wrap_dispatch(module, one_table=True, repack_trim=False, shared_table=True, trimmer=lambda: None,
                                  int8_head=True)
    embed, head = tables(tied=True)
    _packing.mark_tables([embed, head], Embedding, Head)
    setattr(head, _packing.QUANTIZED, quantized)
    module.dispatch_cpu_unquantized_gemm(head, remove_weight=False)
    return calls, head


def test_only_a_quantized_checkpoints_tied_head_is_held_as_int8(monkeypatch):
    assert int8_dispatched(True, monkeypatch)[0] == [("int8", "lm_head")]
    # a float checkpoint keeps its float head (the shared table): the lever changes no float model's numbers
    assert int8_dispatched(False, monkeypatch)[0] == [("shared", "lm_head")]


def test_the_loader_tells_the_head_whether_the_checkpoint_is_quantized(monkeypatch):
    vocab = types.ModuleType(_packing.TABLES_MODULE)
    vocab.VocabParallelEmbedding, vocab.ParallelLMHead = Embedding, Head
    monkeypatch.setitem(sys.modules, _packing.TABLES_MODULE, vocab)
    for quantization, expected in (("compressed-tensors", True), (None, False)):
        loader = types.ModuleType("fake_base_loader")
        loader.process_weights_after_loading = lambda model, config, device: None
        embed, head = tables(tied=True)
        model = types.SimpleNamespace(modules=lambda e=embed, h=head: [e, h])
        assert _packing.wrap_loader(loader)
        loader.process_weights_after_loading(model, types.SimpleNamespace(quantization=quantization), "cpu")
        assert getattr(head, _packing.QUANTIZED) is expected


@pytest.mark.parametrize("flags,quantized,holds", [
    (("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"), True, True),
    (("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"), False, False),  # a float checkpoint
    (("avx512f", "avx512bw", "avx512vl", "avx512_vnni"), True, False),  # no BF16: vLLM loads _C_AVX512
    (("avx2", "fma"), True, False),
])
def test_the_plan_asks_for_the_int8_head_what_the_engine_does(flags, quantized, holds):
    assert _packing.int8_head_here(flags, "x86_64", 49152, 576, "bfloat16", quantized) is holds
