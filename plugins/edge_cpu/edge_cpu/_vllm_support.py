"""What does the installed vLLM build support? Read from its source with ``ast``, never imported.

``import vllm`` costs seconds and pulls torch; ``edge devices`` and ``edge
plan`` must not. So the tables the CPU gates rest on are parsed out of the
installed package's files; what each table is and how it is read is
:mod:`._vllm_tables`, this module finds vLLM and caches what was read. Whether a model class implements ``SupportsPP`` is read from its own
module only when a pipeline-parallel plan asks (:func:`pp_support`), and
whether it computes logits from its input embedding (how many packed tables
the memory budget counts) when a plan is budgeted (:func:`logits_from_embedding`).

The parts every vLLM backend shares (finding the package, the ``ast``
helpers, the model registry, ``SupportsPP``) are :mod:`edge_core.kit.vllm_source`;
this package adds the CPU platform's tables and the cache.

Each piece that cannot be read (a file moved, a symbol reshaped) is reported
in :attr:`VllmSource.unread` with the file and symbol, and left None: the gates
then say they could not check instead of refusing or crashing.

Cached per installed vLLM: in memory, and as one JSON file under
``$XDG_CACHE_HOME/edge`` (default ``~/.cache/edge``). Parsing the ~17 files
costs more than a whole ``edge plan`` on the demo; the JSON file brings the
cost back to about a millisecond (docs/benchmarks.md, "Time to decision"). It is keyed by the distribution,
version and location of vLLM, and invalidated when any file it was read from
changes size or mtime (a source checkout edited in place keeps its version
string) or when this reader changes. A cache that cannot be read or written
is ignored: the source is parsed again.
"""


from __future__ import annotations

import hashlib
import json
import re
import threading
from pathlib import Path
from typing import Any

from edge_core.kit.vllm_source import (
    MODEL_REGISTRY,
    PPSupport,
    SourceTree,
    Unreadable,
    cache_file,
    default_cache_dir,
    files_unchanged,
    installed_vllm,
    model_module,
    write_json,
)
from edge_core.kit.vllm_source import pp_support as _pp_support

from ._vllm_tables import (
    AWQ_CONFIG,
    CPU_PLATFORM,
    CT_WNA16,
    GPTQ_CONFIG,
    GPTQ_UTILS,
    HOST_PROBES,
    LINEAR_KERNELS,
    MARLIN_UTILS,
    MXFP4_MOE_ORACLE,
    QUANT_REGISTRY,
    SOURCES,
    Kernel,
    VllmSource,
    parse_all,
)

__all__ = [
    "AWQ_CONFIG", "CACHE_SCHEMA", "CPU_PLATFORM", "CT_WNA16", "GPTQ_CONFIG", "GPTQ_UTILS", "HOST_PROBES",
    "LINEAR_KERNELS", "MARLIN_UTILS", "MODEL_REGISTRY", "MXFP4_MOE_ORACLE", "QUANT_REGISTRY", "SOURCES", "Kernel",
    "VllmSource", "installed_source", "installed_vllm", "logits_from_embedding", "pp_support", "read_source",
]

#: Bump when the JSON layout changes (the reader's own digest is in the key as well).
CACHE_SCHEMA = 2

# ---------------------------------------------------------------- finding vLLM


_MEMO: dict[tuple[str, str | None], VllmSource] = {}
_LOCK = threading.Lock()


def installed_source(cache_dir: Path | None = None) -> VllmSource:
    """The tables of the vLLM installed here (memoised; see the module docstring for the disk cache)."""
    distribution, version, root = installed_vllm()
    if root is None:
        return VllmSource(distribution, version, None, unread={
            piece: "vLLM is not installed in this interpreter" for piece in SOURCES})
    key = (str(root), version)
    with _LOCK:
        cached = _MEMO.get(key)
    if cached is not None:
        return cached
    found = read_source(root, distribution=distribution, version=version,
                        cache_dir=default_cache_dir() if cache_dir is None else cache_dir)
    with _LOCK:
        _MEMO[key] = found
    return found


def _reader_digest() -> str:
    """This reader's own source, its table readers and the shared one they call (:mod:`edge_core.kit.vllm_source`)."""
    from edge_core.kit import vllm_source

    from . import _vllm_tables

    digest = hashlib.sha256()
    try:
        for path in (__file__, _vllm_tables.__file__, vllm_source.__file__):
            digest.update(Path(path).read_bytes())
    except OSError:
        return "unknown"
    return digest.hexdigest()[:16]


def _cache_path(cache_dir: Path, root: Path, distribution: str | None, version: str | None) -> Path:
    return cache_file(cache_dir, "vllm-source", root, distribution, version)


def _load_cache(path: Path, root: Path, key: dict[str, Any]) -> VllmSource | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("key") != key:
            return None
        found = VllmSource.from_json(data["source"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return found if _well_formed(found) and files_unchanged(root, found.files) else None


def _well_formed(found: VllmSource) -> bool:
    """A cache file is only trusted in the shapes the parser writes (it lives in a user-writable place)."""
    def strings(values: Any) -> bool:
        return isinstance(values, (tuple, list)) and all(isinstance(v, str) for v in values)

    def str_map(values: Any) -> bool:
        return values is None or (isinstance(values, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                   for k, v in values.items()))

    return (
        isinstance(found.unread, dict)
        and (found.quant_methods is None or strings(found.quant_methods))
        and (found.platform_quantization is None or strings(found.platform_quantization))
        and (found.cpu_kernels is None or all(isinstance(k, Kernel) and strings(k.requires)
                                              for ks in found.cpu_kernels.values() for k in ks))
        and (found.cpu_marlin_types is None or all(strings(v) for v in found.cpu_marlin_types.values()))
        and str_map(found.gptq_types) and str_map(found.awq_types) and str_map(found.ct_wna16_types)
        and (found.gptq_desc_act is None or all(isinstance(v, bool) for v in found.gptq_desc_act.values()))
        and (found.models is None or all(isinstance(v, list) and len(v) == 3 and strings(v)
                                         for v in found.models.values()))
        and str_map(found.previously_supported) and str_map(found.out_of_tree)
    )


def _store_cache(path: Path, key: dict[str, Any], found: VllmSource) -> None:
    write_json(path, {"key": key, "source": found.to_json()})  # a read-only home: the next call parses again


def read_source(root: Path | str, *, distribution: str | None = None, version: str | None = None,
                cache_dir: Path | None = None) -> VllmSource:
    """Parse the vLLM package at ``root`` (a cache file under ``cache_dir`` when given). Never raises."""
    root = Path(root)
    key = {"schema": CACHE_SCHEMA, "reader": _reader_digest(), "root": str(root),
           "distribution": distribution, "version": version}
    path = _cache_path(cache_dir, root, distribution, version) if cache_dir is not None else None
    if path is not None:
        cached = _load_cache(path, root, key)
        if cached is not None:
            return cached
    found = parse_all(root, distribution, version)
    if path is not None and found.files:
        _store_cache(path, key, found)
    return found


def pp_support(src: VllmSource, architecture: str) -> PPSupport:
    """Whether vLLM's class for ``architecture`` implements ``SupportsPP``
    (:func:`edge_core.kit.vllm_source.pp_support` on this source's registry); never raises.

    The class's module is read only when asked, outside the JSON cache: only a
    plan with ``pp > 1`` pays for the parse.
    """
    return _pp_support(src.root, src.models, architecture)


#: A model class that computes its logits from the input embedding module (gemma2, commandr, cohere2):
#: it builds no ``ParallelLMHead`` of its own. Every other class does, tied or not (tying shares the
#: weight tensor, not the module: ``ParallelLMHead.tie_weights``).
_LOGITS_FROM_EMBEDDING = re.compile(rb"logits_processor\(\s*self(?:\.model)?\.embed_tokens\b")
_HEAD_MEMO: dict[tuple[str, int, int], bool] = {}


def logits_from_embedding(src: VllmSource, architecture: str) -> bool | None:
    """Whether vLLM's module for ``architecture`` computes logits from ``embed_tokens`` (no LM-head module).

    vLLM CPU packs a oneDNN copy of the table in each module that holds one
    (``UnquantizedEmbeddingMethod.process_weights_after_loading``), so this is
    what says how many packed copies a tied checkpoint gets. Read from the
    module's text when asked (one file, memoised per stat); None when the
    registry does not name the module or the file cannot be read.
    """
    entry = (src.models or {}).get(architecture)
    if src.root is None or not entry or len(entry) < 3 or not entry[2]:
        return None
    try:
        path = Path(src.root) / SourceTree(src.root).module_file(model_module(entry[2]))
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        with _LOCK:
            known = _HEAD_MEMO.get(key)
        if known is None:
            known = _LOGITS_FROM_EMBEDDING.search(path.read_bytes()) is not None
            with _LOCK:
                _HEAD_MEMO[key] = known
        return known
    except (OSError, Unreadable):
        return None
