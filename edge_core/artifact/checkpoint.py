"""What is in this checkpoint directory — format, weight bytes, dtype, tensors — read from its headers.

A checkpoint's ``config.json`` and its safetensors headers say everything the
planner needs: the quantization scheme (which decides which devices can
*execute* it), the exact weight bytes (evidence class D), and the layer
geometry the KV arithmetic reads. Nothing here imports torch, safetensors or
transformers, unpickles, or reads a tensor's bytes (unless a content digest is
asked for). Shards are read through :mod:`._files`, which refuses anything
that is not a regular file; sharded checkpoints go through
``model.safetensors.index.json``, whose names must stay inside the directory.
Each header is checked by :mod:`.header`; a checkpoint whose exact header
bytes were checked before takes the verdict from :mod:`.header_cache`.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import operator
import os
from itertools import chain, repeat
from typing import Any, NamedTuple

from ..errors import ArtifactError
from ..manifest import ARTIFACT_ID_HEX_CHARS, Manifest
from . import header_cache
from ._files import canonical, check_contained, content_digest, parse_json, read_bounded, read_json
from .config import CONFIG_NAME, identity, quantization_of, read_config_sized, resolve_text_config
from .formats import quantization_scheme_for, weight_format_for
from .header import SAFETENSORS_DTYPES, ShardHeader, ShardTensors, TensorTable, check_header, read_header
from .library_defaults import fill_library_defaults

INDEX_NAME = "model.safetensors.index.json"
#: ModelOpt writes its scheme here when config.json carries none (vLLM reads it too).
MODELOPT_CONFIG_NAME = "hf_quant_config.json"

#: Activation dtypes a model can be "in"; quantized integer payloads are not.
MODEL_DTYPES = ("float32", "float16", "bfloat16", "float64")
_DTYPE_ALIASES = {"float": "float32", "half": "float16", "double": "float64", "bf16": "bfloat16",
                  "fp16": "float16", "fp32": "float32"}

#: Weights that can only be read by unpickling, i.e. by executing code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
PICKLE_REMEDY = (
    "convert it to safetensors in a trusted, isolated environment: load each file with "
    "torch.load(path, weights_only=True) and write the state dict with "
    "safetensors.torch.save_file(state_dict, 'model.safetensors') (shard large models and "
    "write model.safetensors.index.json), then point edge at that directory"
)


class _Weights(NamedTuple):
    """What the shards hold: their raw headers, bytes per dtype, the tensor count and table."""

    headers: list[ShardHeader]
    dtype_bytes: dict[str, int]
    tensor_count: int
    tensors: TensorTable


def read_checkpoint(root: str, names: set[str], has_safetensors: bool, digest_weights: bool) -> Manifest:
    raw_config, config_size = read_config_sized(root)
    if not has_safetensors:
        pickles = sorted(n for n in names if n.lower().endswith(PICKLE_SUFFIXES) or n.endswith(".bin.index.json"))
        if pickles:
            raise ArtifactError("artifact_invalid",
                                f"{root} has only pickle weights ({', '.join(pickles[:4])}); reading them would "
                                "execute code, so edge does not open them", PICKLE_REMEDY, root)
        raise ArtifactError("artifact_invalid", f"{root} has config.json but no *.safetensors weights",
                            "download the safetensors weights into the directory (or pass the directory that has them)",
                            root)

    files: list[tuple[str, int]] = [(CONFIG_NAME, config_size)]
    hf_quant = None
    if quantization_of(raw_config) is None and MODELOPT_CONFIG_NAME in names:
        hf_quant, size = read_json(os.path.join(root, MODELOPT_CONFIG_NAME), MODELOPT_CONFIG_NAME,
                                    "artifact_invalid", root)
        files.append((MODELOPT_CONFIG_NAME, size))
        if not isinstance(hf_quant, dict):
            raise ArtifactError("artifact_invalid", f"{MODELOPT_CONFIG_NAME} in {root} is not a JSON object",
                                "re-export the checkpoint with NVIDIA ModelOpt", root)
        hf_quant = {"quant_method": "modelopt", **hf_quant}

    weights = _read_weights(root, names, files)
    files.extend((header.name, header.size_bytes) for header in weights.headers)
    dtype_bytes = weights.dtype_bytes

    config, text_key = resolve_text_config(raw_config)
    # Fields the config leaves to its library (gemma-3's text_config names six):
    # filled from transformers' configuration class, and listed in the manifest.
    config, defaults = fill_library_defaults(config, raw_config, text_key)
    quantization = quantization_of(raw_config) if hf_quant is None else hf_quant
    weight_format = weight_format_for(quantization, where=f"{root}/config.json")

    ident = hashlib.sha256(b"edge-artifact-v1\0")
    ident.update(canonical(raw_config))
    if hf_quant is not None:
        ident.update(canonical(hf_quant))
    for header in sorted(weights.headers, key=lambda h: h.name):
        ident.update(header.name.encode("utf-8", "surrogatepass") + b"\0")
        ident.update(len(header.raw).to_bytes(8, "little") + header.raw)

    architecture, model_type = identity(raw_config)
    return Manifest(
        path=root,
        kind="checkpoint",
        weight_format=weight_format,
        weight_bytes=sum(dtype_bytes.values()),
        dtype=_model_dtype(config, raw_config, dtype_bytes),
        dtype_bytes=dtype_bytes,
        architecture=architecture,
        model_type=model_type,
        tensor_count=weights.tensor_count,
        files=tuple(files),
        total_file_bytes=sum(size for _, size in files),
        config=config,
        quantization=copy.deepcopy(quantization),
        quantization_scheme=quantization_scheme_for(quantization) if quantization is not None else None,
        artifact_id=ident.hexdigest()[:ARTIFACT_ID_HEX_CHARS],
        content_digest=content_digest(root, [h.name for h in weights.headers]) if digest_weights else None,
        text_config_key=text_key,
        config_defaults=defaults.values,
        config_defaults_source=defaults.source,
        tensors=weights.tensors,
    )



def _model_dtype(config: dict[str, Any], raw: dict[str, Any], dtype_bytes: dict[str, int]) -> str | None:
    for source in (config, raw):
        for key in ("torch_dtype", "dtype"):
            value = source.get(key)
            if isinstance(value, str):
                name = value.removeprefix("torch.").lower()
                name = _DTYPE_ALIASES.get(name, name)
                if name in MODEL_DTYPES:
                    return name
    # No usable declaration ("auto" or absent): the float dtype holding most bytes.
    by_name: dict[str, int] = {}
    for code, nbytes in dtype_bytes.items():
        name = SAFETENSORS_DTYPES[code][1]
        by_name[name] = by_name.get(name, 0) + nbytes
    floats = {n: b for n, b in by_name.items() if n in MODEL_DTYPES}
    pool = floats or by_name
    return max(sorted(pool), key=pool.__getitem__) if pool else None



def _read_weights(root: str, names: set[str], files: list[tuple[str, int]]) -> _Weights:
    """The shards' headers, checked (or found in the header cache, verified against the bytes read now)."""
    index_raw = None
    if INDEX_NAME in names:
        index_raw, size = read_bounded(os.path.join(root, INDEX_NAME), INDEX_NAME, "artifact_invalid", root)
        files.append((INDEX_NAME, size))
    listed = sorted(n for n in names if n.endswith(".safetensors")) if index_raw is None else None
    key = header_cache.cache_key(index_raw, listed or [])
    verdict = header_cache.load(key)
    if key is not None and verdict is not None:
        headers = _verified_headers(root, verdict, listed)
        if headers is not None:
            table = TensorTable(root, headers, None, verdict.tensor_count,
                                load=functools.partial(header_cache.load_table, key, verdict, headers),
                                keep=functools.partial(header_cache.store_table, key, verdict))
            return _Weights(headers, dict(verdict.dtype_bytes), verdict.tensor_count, table)
    shard_names, weight_map = (listed, None) if listed is not None else _index_shards(root, index_raw or b"")
    headers = [read_header(root, name) for name in shard_names]
    shards = [check_header(root, header) for header in headers]
    dtype_bytes, tensor_count = check_tensors(root, shards, weight_map)
    keep = None
    parsed = len(index_raw or b"") + sum(len(header.raw) for header in headers)
    if key is not None and parsed >= header_cache.MIN_CACHED_BYTES:
        verdict = header_cache.verdict_for(headers, dtype_bytes, tensor_count)
        header_cache.store(key, verdict)
        keep = functools.partial(header_cache.store_table, key, verdict)
    return _Weights(headers, dtype_bytes, tensor_count, TensorTable(root, headers, shards, tensor_count, keep=keep))


def _verified_headers(root: str, verdict: header_cache.Verdict, listed: list[str] | None) -> list[ShardHeader] | None:
    """The shards' headers when they are the bytes ``verdict`` was reached on; None sends the reader the long way."""
    names = verdict.shard_names
    if listed is not None and names != listed:
        return None
    try:
        for name in names:
            check_contained(root, name, INDEX_NAME)
        headers = [read_header(root, name) for name in names]
    except ArtifactError:
        return None  # the long way reads again and names the problem
    return headers if verdict.holds_for(headers) else None


def _index_shards(root: str, index_raw: bytes) -> tuple[list[str], dict[str, str]]:
    index = parse_json(index_raw, INDEX_NAME, "artifact_invalid", root)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    # JSON object keys are always strings; the values are checked as one column.
    if not isinstance(weight_map, dict) or not weight_map or set(map(type, weight_map.values())) != {str}:
        raise ArtifactError("artifact_invalid", f"{root}/{INDEX_NAME} has no weight_map of tensor -> file names",
                            "restore the index from the model's source", root)
    shard_names = sorted(set(weight_map.values()))
    for name in shard_names:
        check_contained(root, name, INDEX_NAME)
        if not os.path.lexists(os.path.join(root, name)):
            raise ArtifactError("artifact_invalid", f"{root}/{INDEX_NAME} names shard {name!r}, which is missing",
                                "finish the download (every shard in the index must be present)", root)
    return shard_names, weight_map



def check_tensors(root: str, shards: list[ShardTensors], weight_map: dict[str, str] | None,
                   ) -> tuple[dict[str, int], int]:
    """Bytes per dtype and the tensor count, once each tensor is in one shard and where the index says.

    Asked of whole columns first, in C: with an index, every tensor of a shard
    maps to that shard and the counts agree (so no tensor is in two shards and
    every indexed one is held); without, the names are distinct. Only a failure
    walks the tensors, to name the first one at fault (or to accept tensors a
    shard holds beyond the index, which the index need not list).
    """
    total = sum(len(shard.names) for shard in shards)
    if weight_map is not None:
        agree = total == len(weight_map) and all(
            all(map(operator.eq, repeat(shard.name), map(weight_map.get, shard.names))) for shard in shards)
    else:
        agree = len(set(chain.from_iterable(shard.names for shard in shards))) == total
    owner: dict[str, str] = {}
    for shard in shards if not agree else ():
        for key in shard.names:
            if key in owner:
                raise ArtifactError("artifact_invalid", f"tensor {key!r} is in both {owner[key]} and {shard.name}",
                                    "remove stray .safetensors files so each tensor is stored once", root)
            owner[key] = shard.name
    for key, name in (weight_map or {}).items() if not agree else ():
        if owner.get(key) != name:
            raise ArtifactError("artifact_invalid",
                                f"{INDEX_NAME} places tensor {key!r} in {name}, whose header does not hold it",
                                "restore the index and shards from the same revision of the model", root)
    if not total:
        raise ArtifactError("artifact_invalid", f"the safetensors files in {root} hold no tensors",
                            "download the model's weights into the directory", root)
    dtype_bytes: dict[str, int] = {}
    for shard in shards:
        for dtype, nbytes in shard.dtype_bytes.items():
            dtype_bytes[dtype] = dtype_bytes.get(dtype, 0) + nbytes
    return dict(sorted(dtype_bytes.items())), total
