"""What is in this checkpoint directory — format, weight bytes, dtype, tensors — read from its headers.

A checkpoint's ``config.json`` and its safetensors headers say everything the
planner needs: the quantization scheme (which decides which devices can
*execute* it), the exact weight bytes (evidence class D), and the layer
geometry the KV arithmetic reads. Nothing here imports torch, safetensors or
transformers, unpickles, or reads a tensor's bytes (unless a content digest is
asked for). Shards are read through :mod:`._files`, which refuses anything
that is not a regular file; sharded checkpoints go through
``model.safetensors.index.json``, whose names must stay inside the directory.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, NoReturn

from ..errors import ArtifactError
from ._files import canonical, check_contained, content_digest, open_regular, read_json, reject_duplicates
from .config import (
    CONFIG_NAME,
    fill_library_defaults,
    identity,
    quantization_of,
    read_config_sized,
    resolve_text_config,
)
from .formats import weight_format_for
from .manifest import ARTIFACT_ID_HEX_CHARS, Manifest

INDEX_NAME = "model.safetensors.index.json"
#: ModelOpt writes its scheme here when config.json carries none (vLLM reads it too).
MODELOPT_CONFIG_NAME = "hf_quant_config.json"

#: The safetensors reader's own cap on the JSON header; a larger length prefix
#: is a lie or an attack, and honouring it would allocate that much memory.
MAX_HEADER_BYTES = 100_000_000
#: safetensors dtype code -> (bits per element, torch-style name). Sub-byte
#: types pack elements; a tensor must still end on a byte boundary.
SAFETENSORS_DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (8, "bool"),
    "U8": (8, "uint8"),
    "I8": (8, "int8"),
    "F8_E5M2": (8, "float8_e5m2"),
    "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"),
    "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "F8_E8M0": (8, "float8_e8m0fnu"),
    "I16": (16, "int16"),
    "U16": (16, "uint16"),
    "F16": (16, "float16"),
    "BF16": (16, "bfloat16"),
    "I32": (32, "int32"),
    "U32": (32, "uint32"),
    "F32": (32, "float32"),
    "C64": (64, "complex64"),
    "F64": (64, "float64"),
    "I64": (64, "int64"),
    "U64": (64, "uint64"),
    "F4": (4, "float4_e2m1"),
    "F6_E2M3": (6, "float6_e2m3"),
    "F6_E3M2": (6, "float6_e3m2"),
}
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


@dataclass(frozen=True)
class _Shard:
    name: str
    size_bytes: int
    header: bytes
    #: tensor name -> (dtype code, bytes)
    tensors: dict[str, tuple[str, int]]



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

    shard_names, weight_map = _shard_names(root, names, files)
    shards = [_read_safetensors_header(root, name) for name in shard_names]
    for shard in shards:
        files.append((shard.name, shard.size_bytes))
    dtype_bytes, tensor_count = _check_tensors(root, shards, weight_map)

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
    for shard in sorted(shards, key=lambda s: s.name):
        ident.update(shard.name.encode("utf-8", "surrogatepass") + b"\0")
        ident.update(len(shard.header).to_bytes(8, "little") + shard.header)

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
        tensor_count=tensor_count,
        files=tuple(files),
        total_file_bytes=sum(size for _, size in files),
        config=config,
        quantization=copy.deepcopy(quantization),
        artifact_id=ident.hexdigest()[:ARTIFACT_ID_HEX_CHARS],
        content_digest=content_digest(root, [s.name for s in shards]) if digest_weights else None,
        text_config_key=text_key,
        config_defaults=defaults.values,
        config_defaults_source=defaults.source,
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



def _shard_names(root: str, names: set[str], files: list[tuple[str, int]]) -> tuple[list[str], dict[str, str] | None]:
    if INDEX_NAME not in names:
        return sorted(n for n in names if n.endswith(".safetensors")), None
    index, size = read_json(os.path.join(root, INDEX_NAME), INDEX_NAME, "artifact_invalid", root)
    files.append((INDEX_NAME, size))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ArtifactError("artifact_invalid", f"{root}/{INDEX_NAME} has no weight_map of tensor -> file names",
                            "restore the index from the model's source", root)
    shard_names = sorted(set(weight_map.values()))
    for name in shard_names:
        check_contained(root, name, INDEX_NAME)
        if not os.path.lexists(os.path.join(root, name)):
            raise ArtifactError("artifact_invalid", f"{root}/{INDEX_NAME} names shard {name!r}, which is missing",
                                "finish the download (every shard in the index must be present)", root)
    return shard_names, weight_map



def _read_safetensors_header(root: str, name: str) -> _Shard:
    path = os.path.join(root, name)
    with open_regular(path, f"shard {name}", "artifact_invalid", root) as (f, size):
        prefix = f.read(8)
        if len(prefix) < 8:
            _bad(root, name, f"is {size} bytes, too short for the 8-byte header length")
        header_len = int.from_bytes(prefix, "little")
        if header_len > MAX_HEADER_BYTES:
            _bad(root, name, f"claims a {header_len}-byte header (limit {MAX_HEADER_BYTES})")
        if 8 + header_len > size:
            _bad(root, name, f"claims a {header_len}-byte header but the file is only {size} bytes (truncated?)")
        raw = f.read(header_len)
    if len(raw) != header_len:
        _bad(root, name, "changed size while being read")
    try:
        header = _parse_header(raw)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        _bad(root, name, f"has a header that is not JSON ({exc})")
    if not isinstance(header, dict):
        _bad(root, name, "has a header that is not a JSON object")
    data_bytes = size - 8 - header_len
    tensors: dict[str, tuple[str, int]] = {}
    ranges: list[tuple[int, int, str]] = []
    for key, info in header.items():
        if key == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                _bad(root, name, "has __metadata__ that is not a map of strings")
            continue
        dtype, nbytes, begin, end = _tensor_entry(root, name, key, info, data_bytes)
        tensors[key] = (dtype, nbytes)
        ranges.append((begin, end, key))
    # The safetensors loader requires tensors to tile the data section exactly;
    # anything else is a file it would refuse at load time.
    cursor, previous = 0, None
    for begin, end, key in sorted(ranges):
        if begin < cursor:
            _bad(root, name, f"has overlapping tensors {previous!r} and {key!r}")
        if begin > cursor:
            _bad(root, name, f"has bytes [{cursor}, {begin}) that belong to no tensor")
        cursor, previous = end, key
    if cursor != data_bytes:
        _bad(root, name, f"has {data_bytes - cursor} trailing bytes after the last tensor")
    return _Shard(name=name, size_bytes=size, header=raw, tensors=tensors)


#: The keys of a tensor entry; a header whose raw text names each exactly once per tensor has no duplicates of them.
_ENTRY_KEYS = (b'"dtype"', b'"shape"', b'"data_offsets"')


def _parse_header(raw: bytes) -> Any:
    """The header as JSON, refusing duplicate keys (a duplicated tensor or field would be silently dropped).

    Checking duplicates with ``object_pairs_hook`` costs a Python call per
    object, doubling the parse of a 90,000-tensor header. The fast path parses
    plainly, then counts each entry key in the raw text: when every count equals
    the number of tensors parsed, no tensor name or entry field appeared twice.
    Any difference (a duplicate, an escaped key, a key quoted inside metadata)
    re-parses with the hook, which names the duplicate.
    """
    text = raw.decode("utf-8")
    header = json.loads(text)
    if isinstance(header, dict):
        tensors = len(header) - ("__metadata__" in header)
        if all(raw.count(key) == tensors for key in _ENTRY_KEYS):
            return header
    return json.loads(text, object_pairs_hook=reject_duplicates)


def _tensor_entry(root: str, name: str, key: str, info: Any, data_bytes: int) -> tuple[str, int, int, int]:
    # ``type(x) is int`` rather than isinstance: it excludes bool, and this runs once per tensor
    # (90,000 in DeepSeek-V3), so the checks are written out flat.
    if type(info) is not dict:
        _bad(root, name, f"describes tensor {key!r} with a {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if type(dtype) is not str or dtype not in SAFETENSORS_DTYPES:
        _bad(root, name, f"gives tensor {key!r} unknown dtype {dtype!r}")
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
            or type(offsets[1]) is not int or offsets[0] < 0 or offsets[0] > offsets[1]):
        _bad(root, name, f"gives tensor {key!r} data_offsets {offsets!r}; expected [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_bytes:
        _bad(root, name, f"places tensor {key!r} at bytes [{begin}, {end}) but the data section has only "
                         f"{data_bytes} bytes (truncated download?)")
    if type(shape) is not list:
        _bad(root, name, f"gives tensor {key!r} shape {shape!r}; expected a list of non-negative integers")
    budget_bits = (end - begin) * 8
    elements_bits, empty = SAFETENSORS_DTYPES[dtype][0], False
    for dim in shape:
        if type(dim) is not int or dim < 0:
            _bad(root, name, f"gives tensor {key!r} shape {shape!r}; expected a list of non-negative integers")
        if dim == 0:
            empty = True
        elif elements_bits <= budget_bits:  # stop multiplying before a hostile shape builds a huge integer
            elements_bits *= dim
    if empty:
        elements_bits = 0
    if elements_bits % 8:
        _bad(root, name, f"gives sub-byte tensor {key!r} ({dtype}, shape {shape}) a size that is not whole bytes")
    if elements_bits != budget_bits:
        _bad(root, name, f"gives tensor {key!r} ({dtype}, shape {shape}) {end - begin} bytes; "
                         f"its shape needs {'more' if elements_bits > budget_bits else elements_bits // 8}")
    return dtype, end - begin, begin, end


def _check_tensors(root: str, shards: list[_Shard], weight_map: dict[str, str] | None) -> tuple[dict[str, int], int]:
    owner: dict[str, str] = {}
    dtype_bytes: dict[str, int] = {}
    for shard in shards:
        for key, (dtype, nbytes) in shard.tensors.items():
            if key in owner:
                raise ArtifactError("artifact_invalid", f"tensor {key!r} is in both {owner[key]} and {shard.name}",
                                    "remove stray .safetensors files so each tensor is stored once", root)
            owner[key] = shard.name
            dtype_bytes[dtype] = dtype_bytes.get(dtype, 0) + nbytes
    for key, name in (weight_map or {}).items():
        if owner.get(key) != name:
            raise ArtifactError("artifact_invalid",
                                f"{INDEX_NAME} places tensor {key!r} in {name}, whose header does not hold it",
                                "restore the index and shards from the same revision of the model", root)
    if not owner:
        raise ArtifactError("artifact_invalid", f"the safetensors files in {root} hold no tensors",
                            "download the model's weights into the directory", root)
    return dict(sorted(dtype_bytes.items())), len(owner)



def _bad(root: str, name: str, what: str) -> NoReturn:
    raise ArtifactError("artifact_invalid", f"safetensors file {name} in {root} {what}",
                        "re-download the file (or re-save it with safetensors); edge reads only valid headers", root)

