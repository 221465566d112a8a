"""The memory only the vLLM CPU runtime knows about: its process baseline, and what packing the weights holds.

A vLLM CPU session runs in edge's own process (one rank: the engine core and
its worker in it) or in several processes (the front end, the engine core, a
worker), each importing torch and vLLM; the plan's ``execution`` says which
(``session.in_process``), and the runtime baseline is that layout's. That is
real memory before a single weight is read, and the planner must count it. A
tensor- or pipeline-parallel session runs one more worker per extra rank on
the same host (each bound to its own cores), and each worker maps, packs and
repacks its own slice of the weights.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from itertools import compress, repeat
from typing import TYPE_CHECKING, Any

from edge_core import HostFacts, Reservation
from edge_core.host import read_host
from edge_core.kit.vllm_hooks import architectures

from . import _packing, _vllm_support

if TYPE_CHECKING:
    from edge_core.layout import DeviceShare

#: Tree PSS of a vLLM CPU session (front end, engine core, one worker) beside its weights and KV, in bytes (E):
#: the largest read, a first run after install on the demo, rounded up (docs/vllm-cpu-facts.md, "Memory of the
#: process tree (PSS, GiB)"). Admitted as held: it includes the libraries' mapped pages (~130 MiB of Pss_File),
#: which are file-backed but in use, so a limit that reclaims them makes the session fault them back. A
#: calibration constant: re-fit it against the least memory limit a session runs under (issue 36), not PSS alone.
RUNTIME_BASELINE_BYTES = int(1.53 * 2**30)
#: Tree PSS of a vLLM CPU session whose engine core and worker run in edge's own process (one process) beside its
#: weights and KV, in bytes (E): read from ``edge run`` alone, ~585 MiB on tiny-llama (603 MiB attributable in
#: all) and up to 670 MiB on SmolLM2-135M (8,192 tokens: 1,167 MiB less weights, pool and activations). One
#: figure between them: tiny-llama's budget reads 1.13x its measurement, SmolLM2's 1.01-1.08x; against the least
#: memory limit, admission / limit is 1.02-1.10 over six geometries (docs/benchmarks.md, "One process for one
#: user" and "The least memory a session runs under"). PSS splits the libraries' pages among the processes that
#: map them, so it reads lower while other vLLM processes run.
RUNTIME_BASELINE_ONE_PROCESS_BYTES = int(0.65 * 2**30)
#: What the same one process's libraries' clean file pages can add to its tree PSS beyond that, in bytes (E): a
#: fresh install maps more of each library around every fault (libtorch_cpu 86 against 48 MiB, libtriton 93
#: against 66) and read 1,318 against 1,165 MiB for the same SmolLM2 run (docs/benchmarks.md, "One process for
#: one user"). Reclaimable: in the predicted peak the tree PSS is checked against, never in admission.
RUNTIME_FILE_PAGES_ONE_PROCESS_BYTES = 160 << 20
#: What vLLM's compiled mode (torch.compile / inductor, ``enforce_eager=False``) adds to the tree while it
#: compiles and warms the model up, in bytes (evidence E): 512 MiB covers the 450-500 MiB seen on the demo
#: (docs/vllm-cpu-facts.md, "What compiled mode and a second rank add"). The compile's code cache is on disk
#: (~/.cache/vllm).
COMPILE_WORKSPACE_BYTES = 512 << 20
#: What each rank past the first adds to the tree, in bytes (evidence E): one more vLLM worker process
#: importing torch and vLLM, with its share of the ranks' shared-memory all-reduce buffers (two 4 MiB
#: segments): ~430 MiB on the demo (docs/vllm-cpu-facts.md, "What compiled mode and a second rank add").
#: That is with ``TORCH_COMPILE_DISABLE`` set, as the plan sets it for an eager TP session
#: (``edge_core.engines.vllm_launch.EAGER_TP_CPU_ENV``); without it inductor's compiler processes add more while
#: they run. A compiled session counts its own workspace per worker (:data:`COMPILE_WORKSPACE_BYTES`).
EXTRA_RANK_WORKER_BYTES = 512 << 20
#: What a served session's worker holds in oneDNN matmul primitives, one per batch size (rows) and weight shape,
#: in bytes (E): vLLM keeps the last 32 per shape and edge's environment leaves oneDNN's own cache empty
#: (``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``, edge_core/runtime/env.py); the demo's worker plateaued at +485 MiB over
#: 900 prompt lengths (docs/benchmarks.md, "What a served worker keeps per batch size").
GEMM_PRIMITIVES_BYTES = 512 << 20
#: What one open request to the model holds in a served session's tree (vLLM's API server and engine core) beside
#: its tokens, in bytes (E): the intercept of a least-squares line through the per-connection slopes measured with
#: 0-256 queued streams of ~10, 3,801 and 7,601-token prompts (docs/benchmarks.md, "What an open connection costs").
CONNECTION_BYTES = 44 << 10
#: What each token of an open request adds (its ids, held by the API server and the engine core), in bytes (E): that
#: line's slope. A request holds at most ``max_model_len`` tokens, prompt and output (a longer prompt is refused
#: before it is queued).
CONNECTION_TOKEN_BYTES = 90


#: vLLM pads the vocabulary to a multiple of this before splitting the embedding and LM head across
#: tensor-parallel ranks (``DEFAULT_VOCAB_PADDING_SIZE``, model_executor/layers/vocab_parallel_embedding.py).
VOCAB_PADDING_SIZE = 64
#: Bytes per element of the dtypes vLLM CPU runs a checkpoint in (its ``--dtype``).
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
#: safetensors dtype codes of the unquantized weights vLLM CPU re-packs for oneDNN.
_FLOAT_CODES = frozenset({"BF16", "F16", "F32"})
#: How the vocab tables' tensors are named in a checkpoint (left out of the linear matrices).
_TABLE_NAMES = ("embed_tokens.weight", "lm_head.weight")
#: glibc's largest dynamic mmap threshold on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``): a block of this size
#: or more is always mmapped, so freeing it gives it back; smaller ones may come from the main heap.
MMAP_THRESHOLD_MAX = 32 << 20
#: Of the linear weights a worker holds in tensors under :data:`MMAP_THRESHOLD_MAX`, the most left as
#: heap holes while vLLM CPU re-packs them for oneDNN, before edge-cpu's trim gives them back (evidence
#: E, see :func:`reservations`).
REPACK_HOLES_SHARE = 0.5


def _shard_sizes(manifest: Any) -> list[int]:
    files = getattr(manifest, "files", ()) or ()
    return [size for name, size in files if name.endswith(".safetensors")]


def _weight_bytes(manifest: Any) -> int:
    weight_bytes = getattr(manifest, "weight_bytes", None)
    if isinstance(weight_bytes, int):
        return weight_bytes
    return sum(_shard_sizes(manifest))


def mapped_shard_bytes(manifest: Any, share: DeviceShare | None = None) -> int:
    """Bytes of safetensors files the loading workers map at once: the largest shard per rank, at most all of them.

    vLLM's loader (``safetensors_weights_iterator``) opens every shard in every
    rank and reads every tensor before the model's ``load_weights`` narrows it
    to the rank's slice or skips another stage's layer, so each rank maps the
    whole checkpoint, one shard at a time. The ranks load concurrently; pages
    they map together are counted once (PSS splits them), so the ranks hold
    one shard each at worst and never more than the checkpoint's files.
    """
    shards = _shard_sizes(manifest)
    ranks = share.ranks_here if share is not None else 1
    return min(ranks * max(shards, default=0), sum(shards))


def _text_config(manifest: Any) -> dict[str, Any]:
    config = getattr(manifest, "config", None) or {}
    text = config.get("text_config")
    return text if isinstance(text, dict) else config


def _table_rows(vocab: int, tied: bool, share: DeviceShare | None) -> int:
    """Rows of the vocab x hidden tables the workers hold, summed over the ranks of ``share``.

    Alone: the embedding, and the LM head unless tied (``vocab_size`` rows
    each). Under a share each rank holds ``padded_vocab / tp`` rows of a table
    (vLLM's VocabParallelEmbedding pads the vocabulary, then splits it): the
    first stage's ranks the embedding, the last stage's the LM head; with tied
    embeddings a stage that is both holds one table, and a last stage that is
    not the first builds its own copy as the LM head. Summed over every rank of
    a layout (vLLM CPU runs them all here) that is the whole padded table once
    per stage holding it.
    """
    if share is None:
        return vocab * (1 if tied else 2)
    tp, last = share.layout.tp, share.layout.pp - 1
    per_rank = -(-vocab // VOCAB_PADDING_SIZE) * VOCAB_PADDING_SIZE // tp
    rows = 0
    for rank in share.ranks:
        stage = rank // tp
        first_or_last = (stage == 0) + (stage == last)
        rows += per_rank * (min(first_or_last, 1) if tied else first_or_last)
    return rows


def _tables(manifest: Any, share: DeviceShare | None, one_module: bool) -> int:
    """Bytes of the vocab x hidden tables in ``one_module`` (tied and shared) or two, rows by :func:`_table_rows`.

    From config.json (``text_config`` for a multimodal wrapper): the rows x
    hidden_size x the run dtype's bytes; capped at the weights this device
    loads, and 0 where the config does not say.
    """
    config = getattr(manifest, "config", None) or {}
    text = _text_config(manifest)
    vocab, hidden = text.get("vocab_size", config.get("vocab_size")), text.get("hidden_size")
    if not isinstance(vocab, int) or not isinstance(hidden, int):
        return 0
    dtype_bytes = _DTYPE_BYTES.get(str(getattr(manifest, "dtype", None) or text.get("torch_dtype")), 2)
    tables = _table_rows(vocab, one_module, share) * hidden * dtype_bytes
    weights = _weight_bytes(manifest)
    return min(tables, weights) if weights else tables


def _tied(manifest: Any) -> bool:
    config = getattr(manifest, "config", None) or {}
    return bool(_text_config(manifest).get("tie_word_embeddings", config.get("tie_word_embeddings", False)))


def embedding_table_bytes(manifest: Any, share: DeviceShare | None = None) -> int:
    """Bytes of the vocab x hidden tables the weights hold: the input embedding, and the LM head unless
    it is tied to it (then one table); each rank's slice under ``share``."""
    return _tables(manifest, share, _tied(manifest))


def packed_table_bytes(manifest: Any, share: DeviceShare | None = None, head_module: bool = True) -> int:
    """Bytes of the oneDNN copies vLLM CPU packs of the vocab x hidden tables, one per module holding one.

    The input embedding and the LM head are two modules even when tied (tying
    shares the weight tensor, and each module still packs its own copy:
    docs/vllm-cpu-facts.md, "Memory of the process tree (PSS, GiB)"), unless the model class builds
    no LM head and computes logits from the embedding (``head_module`` False:
    gemma2, commandr).
    """
    return _tables(manifest, share, _tied(manifest) and not head_module)


def _float_bytes(manifest: Any, share: DeviceShare | None) -> int:
    """Bytes this device loads in float dtypes: the checkpoint's, scaled to the share's slice of the weights."""
    by_dtype = getattr(manifest, "dtype_bytes", None)
    if not isinstance(by_dtype, dict) or not by_dtype:
        return _weight_bytes(manifest)
    floats = sum(int(n) for code, n in by_dtype.items() if code in _FLOAT_CODES)
    stored = sum(int(n) for n in by_dtype.values())
    return floats if share is None or not stored else floats * _weight_bytes(manifest) // stored


def small_float_bytes(manifest: Any, share: DeviceShare | None = None) -> int | None:
    """Bytes of float tensors (MoE experts aside) whose slice on a rank is under :data:`MMAP_THRESHOLD_MAX`:
    the ones whose re-packing can leave heap holes; None where the manifest has no tensor table.

    Each tensor's bytes are divided by the tensor-parallel size under ``share``
    before the comparison, and the sum is scaled to the weights this device
    loads. Experts are left out: vLLM fuses them into one 3-D parameter per
    layer, far over the threshold. The checkpoint's tensors are the unmerged
    ones (vLLM packs q/k/v and gate/up merged, larger), so this errs high.
    Asked of whole columns, in C: 13-19 ms for Qwen3-Next's 74,391 and
    DeepSeek-V3's 90,369 tensors here.
    """
    table = getattr(manifest, "tensors", None)
    if table is None or not len(table):
        return None
    limit = MMAP_THRESHOLD_MAX * (share.layout.tp if share is not None else 1)
    small = stored = 0
    for shard in table.shards():
        floats = map(operator.and_, map(_FLOAT_CODES.__contains__, shard.dtypes),
                     map(operator.not_, map(operator.contains, shard.names, repeat(".experts."))))
        small += sum(compress(shard.nbytes, map(operator.and_, floats, map(limit.__gt__, shard.nbytes))))
        stored += sum(shard.nbytes)
    return small if share is None or not stored else small * _weight_bytes(manifest) // stored


def _stage_rows(vocab: int, share: DeviceShare | None, first: bool) -> int:
    """Rows of one vocab table summed over the ranks of the last stage, those also in the first (``first``) or not."""
    if share is None:
        return vocab if first else 0
    tp, last = share.layout.tp, share.layout.pp - 1
    per_rank = -(-vocab // VOCAB_PADDING_SIZE) * VOCAB_PADDING_SIZE // tp
    return sum(per_rank for rank in share.ranks if rank // tp == last and (rank // tp == 0) == first)


def _table_row_bytes(manifest: Any) -> tuple[int, int]:
    """(vocab, bytes of one row) of the vocab tables, from config.json; (0, 0) where it does not say."""
    config = getattr(manifest, "config", None) or {}
    text = _text_config(manifest)
    vocab, hidden = text.get("vocab_size", config.get("vocab_size")), text.get("hidden_size")
    if not isinstance(vocab, int) or not isinstance(hidden, int):
        return 0, 0
    return vocab, hidden * _DTYPE_BYTES.get(str(getattr(manifest, "dtype", None) or text.get("torch_dtype")), 2)


def _rank_table(manifest: Any, share: DeviceShare | None) -> tuple[int, int, str] | None:
    """(rows, hidden, dtype) of the vocab table one rank holds (the padded vocabulary over its TP ranks), from
    config.json; None where it does not say. What the packing levers ask their layout questions of."""
    vocab, row = _table_row_bytes(manifest)
    if not vocab or not row:
        return None
    text = _text_config(manifest)
    dtype = str(getattr(manifest, "dtype", None) or text.get("torch_dtype") or "bfloat16")
    rows = -(-vocab // VOCAB_PADDING_SIZE) * VOCAB_PADDING_SIZE // (share.layout.tp if share is not None else 1)
    return rows, int(text.get("hidden_size") or 0), dtype


def shared_table_packs(manifest: Any, host: HostFacts | None, share: DeviceShare | None = None) -> bool:
    """Whether ``EDGE_CPU_SHARED_TABLE`` packs a tied table in place on ``host`` (:func:`._packing.packs_in_place`):
    its ISA flags give vLLM CPU's build with sgl-kernel's packed GEMM and each rank's rows fit its blocks. Where
    not, the engine packs the tied head as vLLM does, one more table (:func:`one_table_bytes`)."""
    table = _rank_table(manifest, share)
    return host is not None and table is not None and _packing.packs_in_place(host.isa_flags, host.machine, *table)


def _quantized(manifest: Any) -> bool:
    """Whether config.json says the checkpoint's weights are quantized (what vLLM's ``model_config.quantization`` reads)."""
    config = getattr(manifest, "config", None) or {}
    return bool(_text_config(manifest).get("quantization_config") or config.get("quantization_config"))


def int8_head_holds(manifest: Any, host: HostFacts | None, share: DeviceShare | None = None) -> bool:
    """Whether ``EDGE_CPU_INT8_HEAD`` holds a tied table once as int8 on ``host`` (:func:`._packing.int8_head_here`):
    a quantized checkpoint with tied embeddings, vLLM CPU's int8 GEMM on this host, rows that fit its blocks."""
    table = _rank_table(manifest, share)
    return (host is not None and table is not None and _tied(manifest)
            and _packing.int8_head_here(host.isa_flags, host.machine, *table, _quantized(manifest)))


def int8_table_bytes(manifest: Any, share: DeviceShare | None = None) -> int:
    """Bytes of a tied table held as int8 (:func:`._packing.share_int8_table`): per row, its int8 values, its
    int32 sum and its float32 scale; summed over the ranks of ``share`` holding a tied table."""
    vocab, _ = _table_row_bytes(manifest)
    hidden = _text_config(manifest).get("hidden_size")
    if not vocab or not isinstance(hidden, int):
        return 0
    return _stage_rows(vocab, share, True) * (hidden + _packing.INT8_ROW_EXTRA + 4)


def one_table_bytes(manifest: Any, share: DeviceShare | None, head_module: bool, shared_table: bool
                    ) -> tuple[int, int]:
    """(held, transient) bytes of packed vocab tables with edge-cpu's ``EDGE_CPU_ONE_TABLE`` lever on.

    The embedding is packed only when asked for a product (a class without
    an LM head module), an untied head drops its float weight once packed (so
    its packed copy replaces it, but both exist while it is packed: the
    transient), and a tied head packs one copy beside the float table, or
    none with ``EDGE_CPU_SHARED_TABLE``: the table is re-laid out in place, a
    few rows at a time, and both modules read it (edge_cpu/_packing.py). Per rank of
    ``share``: a last stage that is not the first holds its head untied.
    """
    vocab, row = _table_row_bytes(manifest)
    tied = _tied(manifest)
    both, last_only = _stage_rows(vocab, share, True), _stage_rows(vocab, share, False)
    held = both * row if tied and (not head_module or not shared_table) else 0
    transient = (last_only + (0 if tied else both)) * row
    weights = _weight_bytes(manifest)
    return (min(held, weights), min(transient, weights)) if weights else (held, transient)


def largest_linear_bytes(manifest: Any, share: DeviceShare | None = None) -> int | None:
    """Twice the largest float matrix outside the vocab tables and experts, summed over the ranks of ``share``:
    what re-packing holds beside the weights at once when each freed original is trimmed as it goes (a merged
    gate/up or q/k/v matrix is packed beside its float copy); None where the manifest has no tensor table."""
    table = getattr(manifest, "tensors", None)
    if table is None or not len(table):
        return None
    largest = 0
    for shard in table.shards():  # whole columns, in C, as small_float_bytes asks them
        floats = map(operator.and_, map(_FLOAT_CODES.__contains__, shard.dtypes),
                     map(operator.not_, map(operator.or_, map(operator.contains, shard.names, repeat(".experts.")),
                                            map(str.endswith, shard.names, repeat(_TABLE_NAMES)))))
        largest = max(largest, max(compress(shard.nbytes, floats), default=0))
    ranks = share.ranks_here if share is not None else 1
    tp = share.layout.tp if share is not None else 1
    return 2 * ranks * (largest // tp)


def reservations(manifest: Any, session: Any, host: HostFacts, share: DeviceShare | None = None,
                 levers: Mapping[str, bool] | None = None) -> list[Reservation]:
    """vLLM CPU's own terms for a session; with ``share``, for every rank of a parallel layout it runs here.

    ``levers`` (by variable, default: this process's environment, as the
    engine edge starts will read it under its engine mark) says which of
    edge-cpu's packing levers are on (edge_cpu/_packing.py); the table and
    re-packing terms follow them, and the shared table only where ``host``
    packs it in place (:func:`shared_table_packs`). ``session.in_process``
    picks the runtime baseline of the plan's process layout.
    Under a share ``manifest.weight_bytes`` is already the ranks' slices
    summed (the core replaced it), so the repack term follows them; the file
    mapping and the packed tables are counted per rank (:func:`mapped_shard_bytes`,
    :func:`_table_rows`), and each rank past the first is one more worker process.
    """
    shard = mapped_shard_bytes(manifest, share)
    tables = embedding_table_bytes(manifest, share)
    linear = max(0, _weight_bytes(manifest) - tables)
    architecture = next(iter(architectures(manifest)), None)
    head_module = architecture is None or _vllm_support.logits_from_embedding(
        _vllm_support.installed_source(), architecture) is not True
    on = _packing.levers() if levers is None else levers
    one_table, trim_each = on.get(_packing.ONE_TABLE_ENV, False), on.get(_packing.REPACK_TRIM_ENV, False)
    shared_table = one_table and on.get(_packing.SHARED_TABLE_ENV, False) and shared_table_packs(manifest, host, share)
    int8_head = (one_table and head_module and on.get(_packing.INT8_HEAD_ENV, False)
                 and int8_head_holds(manifest, host, share))
    int8_table = int8_table_bytes(manifest, share) if int8_head else 0
    if one_table:
        packed, head_transient = one_table_bytes(manifest, share, head_module, shared_table or int8_head)
        head_transient += int8_table
    else:
        packed, head_transient = packed_table_bytes(manifest, share, head_module), 0
    # Only float weights are re-packed this way (the checkpoint's bytes per dtype bound them); the tensor
    # table then says which of them are small enough to leave holes (the held load path counts them).
    holes = int(REPACK_HOLES_SHARE * min(linear, max(0, _float_bytes(manifest, share) - tables)))
    if trim_each:  # each hole trimmed as it appears: one matrix beside its packed copy at a time
        largest = largest_linear_bytes(manifest, share)
        holes = holes if largest is None else min(holes, largest)
    else:
        small = small_float_bytes(manifest, share)
        holes = holes if small is None else min(holes, int(REPACK_HOLES_SHARE * small))
    packed_copies = ("one packed copy per distinct table with edge-cpu's levers: "
                     + (f"none, the tied table is held once as int8 ({int8_table >> 20} MiB with its sums and scales) "
                        "and the float table is freed; the budget keeps the float table's bytes in the weights, "
                        "which the int8 table undercuts (EDGE_CPU_INT8_HEAD: a quantized checkpoint's head "
                        "computes in int8)" if int8_head else
                        "none, the tied table is re-laid out in place once and both modules read it" if packed == 0 and _tied(
                         manifest) else ("the tied head's" + (
                             "" if not on.get(_packing.SHARED_TABLE_ENV, False) or not head_module else
                             " (the shared table is not packed in place here: no AVX-512 BF16 build of vLLM CPU's "
                             "packed GEMM on this host, or the table's shape or dtype does not fit its blocks)"))
                        if _tied(manifest) else
                        "none held: the untied head's packed copy replaces its float weight")
                     if one_table else
                     "vLLM CPU packs the embedding and the LM head for oneDNN and keeps the originals "
                     "(remove_weight=False): one more vocab x hidden table per module, tied or not ("
                     + ("this model class computes logits from the embedding, one module" if not head_module else
                        "Qwen3-0.6B's two tables: +594 MiB; Qwen3-1.7B's one tied table, packed by both modules: "
                        "+1,187 MiB; measured") + ")")
    ranks = share.ranks_here if share is not None else 1
    one_process = bool(getattr(session, "in_process", False)) and ranks == 1
    per_rank = f" (each of the {ranks} ranks maps the shard it is reading)" if ranks > 1 else ""
    sliced = (f"; each rank's slice ({share.layout.label()}), summed over ranks {', '.join(map(str, share.ranks))}"
              if share is not None else "")
    terms = [
        Reservation(
            purpose="weights_file_mapping",
            bytes=shard,
            pool="host_ram",
            lifetime="load",
            evidence="E",
            reclaimable=True,
            note="vLLM's loader maps a safetensors shard in the worker while it copies the weights out; "
            "the mapping is gone once they are loaded (tree Pss_File rose by the shard, 147-3,282 MiB, "
            "and fell back to ~130 MiB of libraries before the KV pool was allocated; measured). Clean page "
            f"cache: the tree PSS shows it, the kernel reclaims it under a limit, admission leaves it out{per_rank}",
        ),
        Reservation(
            purpose="embedding_packed_copy",
            bytes=packed,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            note=packed_copies + sliced,
        ),
        Reservation(
            purpose="linear_repack_transient",
            bytes=packed + head_transient + holes,
            pool="host_ram",
            lifetime="load",
            evidence="E",
            note=f"re-packing the weights for oneDNN, once they are read and the shard mapping is gone: the "
            f"packed tables ({packed >> 20} MiB)"
            + (f", an untied head's float weight beside its packed copy ({head_transient >> 20} MiB)"
               if head_transient - int8_table else "")
            + (f", the int8 table beside the float one while it is made ({int8_table >> 20} MiB)"
               if int8_table else "")
            + (f" plus one matrix beside its packed copy at a time ({holes >> 20} MiB; edge-cpu trims each "
               "freed original as it goes)" if trim_each else
               f" plus heap holes, up to {REPACK_HOLES_SHARE:g} x the weights in tensors under glibc's "
               f"{MMAP_THRESHOLD_MAX >> 20} MiB mmap threshold ({holes >> 20} MiB; 0.16-0.49 measured, 150M-1.7B "
               "geometries)")
            + "; it follows the shard mapping (reading, then re-packing: the tree PSS shows the larger of the two), "
            f"and edge-cpu's malloc_trim gives any holes back before the KV pool is allocated{sliced}",
        ),
        Reservation(
            purpose="runtime_baseline",
            bytes=RUNTIME_BASELINE_ONE_PROCESS_BYTES if one_process else RUNTIME_BASELINE_BYTES,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            held_during_load=True,
            note=("edge's process with vLLM CPU's engine core and worker in it, importing torch once (tree PSS "
                  "measured before weights and KV, docs/benchmarks.md 'One process for one user')" if one_process
                  else "vLLM CPU front end + engine core + worker processes, each importing torch "
                  "(tree PSS measured before weights and KV)"),
        ),
    ]
    if one_process:
        terms.append(Reservation(
            purpose="runtime_file_pages",
            bytes=RUNTIME_FILE_PAGES_ONE_PROCESS_BYTES,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            reclaimable=True,
            held_during_load=True,
            note="the libraries' clean file pages a fresh install maps beyond the runtime term (150 MiB more tree "
                 "PSS measured for the same run): the tree PSS shows them, the kernel reclaims them under a limit, "
                 "admission leaves them out",
        ))
    if share is not None and ranks > 1:
        terms.append(Reservation(
            purpose="rank_worker_processes",
            bytes=(ranks - 1) * EXTRA_RANK_WORKER_BYTES,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            held_during_load=True,
            note=f"{ranks - 1} more vLLM CPU worker process{'es' if ranks > 2 else ''} for ranks "
            f"{', '.join(map(str, share.ranks[1:]))} of {share.layout.label()} "
            f"({EXTRA_RANK_WORKER_BYTES >> 20} MiB each: one more process importing torch; tree PSS "
            "1,997 MiB with TP 2 against 1,563-1,570 MiB with one worker on the demo, measured)",
        ))
    terms += served_reservations(session, ranks)
    if getattr(session, "enforce_eager", True) is False:  # None: not decided yet, no compile
        terms.append(Reservation(
            purpose="compile_workspace",
            bytes=ranks * COMPILE_WORKSPACE_BYTES,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            note="torch.compile while vLLM warms the compiled model up, beside the KV pool (measured +450-500 MiB "
            "on the demo); mostly released once compiled",
        ))
    return terms


def served_reservations(session: Any, ranks: int = 1) -> list[Reservation]:
    """What serving adds to a vLLM CPU session (none for one that is not served): the requests its server holds
    open, at most ``session.max_connections`` with prompts of up to ``max_model_len`` tokens, and each of the
    ``ranks`` workers' matmul primitives for the many batch sizes a server's traffic runs."""
    if not getattr(session, "served", False):
        return []
    terms = [Reservation(
        purpose="gemm_primitives",
        bytes=ranks * GEMM_PRIMITIVES_BYTES,
        pool="host_ram",
        lifetime="session",
        evidence="E",
        note="the worker's oneDNN matmul primitives, one per batch size and weight shape: vLLM keeps 32 per "
        "shape, oneDNN's own cache is left empty (ONEDNN_PRIMITIVE_CACHE_CAPACITY=0); +485 MiB on the demo "
        "over 900 prompt lengths, measured" + (f"; one set per worker, x {ranks} ranks" if ranks > 1 else ""),
    )]
    connections = getattr(session, "max_connections", None)
    if connections:
        tokens = int(getattr(session, "max_model_len", 0) or 0)
        each = CONNECTION_BYTES + tokens * CONNECTION_TOKEN_BYTES
        terms.append(Reservation(
            purpose="open_connections",
            bytes=connections * each,
            pool="host_ram",
            lifetime="request",
            evidence="E",
            note=f"{connections} requests held open by the server (--max-connections), running, queued or "
            f"streaming: {CONNECTION_BYTES >> 10} KiB each in vLLM's API server and engine core plus "
            f"{CONNECTION_TOKEN_BYTES} B per token it holds, up to {tokens:,} ({each / 2**10:,.0f} KiB each; "
            "least squares over 0-256 queued streams of three prompt lengths, measured)",
        ))
    return terms


def prepare_node(plan: Any, progress: Callable[[str], None] | None) -> Any:
    """Grow the NUMA node(s) vLLM CPU will bind to until they can hold the plan's KV pool (the ``prepare_stage`` hook).

    Which node that is, is this backend's rule (:func:`._gates.bound_node`,
    the one the planner's node gate uses too); the node arithmetic and the
    growing are edge-core's (:func:`edge_core.runtime.vllm_stage.prepare_node_for`).
    A tensor-parallel plan binds each rank to its own CPU list
    (``plan.parallel["env"]["VLLM_CPU_OMP_THREADS_BIND"]``, one list per rank):
    every node a rank lands on is grown for the ranks bound there, and the
    answer is rank 0's node with the others in ``other_nodes``.
    """
    from dataclasses import replace

    from edge_core.runtime.vllm_stage import prepare_node_for

    from ._gates import bound_node

    host = read_host()
    parallel = getattr(plan, "parallel", None) or {}
    bind = str((parallel.get("env") or {}).get("VLLM_CPU_OMP_THREADS_BIND") or "")
    lists = bind.split("|") if bind else []
    if len(lists) <= 1 or not host.numa_nodes:  # one worker: the node the environment binds it to
        node = bound_node(host)
        return prepare_node_for(plan, node.node_id if node is not None else None, progress)
    by_node: dict[int | None, list[int]] = {}
    for rank, cpus in enumerate(lists):
        node = bound_node(host, {"VLLM_CPU_OMP_THREADS_BIND": cpus})
        by_node.setdefault(node.node_id if node is not None else None, []).append(rank)
    preps = [prepare_node_for(plan, node_id, progress, ranks=ranks) for node_id, ranks in by_node.items()]
    return replace(preps[0], other_nodes=tuple(preps[1:]))
