"""What is this model directory — format, weight bytes, dtype, geometry — read without loading a weight.

A checkpoint's ``config.json`` and its safetensors headers say everything the
planner needs: the quantization scheme (which decides which devices can
*execute* it), the exact weight bytes (evidence class D), and the layer
geometry the KV arithmetic reads. Nothing here imports torch, safetensors or
transformers, unpickles, or reads a tensor's bytes (unless a content digest is
asked for); every file is checked to be a regular file before it is opened, so
a FIFO or a device named as a shard is refused instead of hanging the reader.
Any bad input becomes an :class:`~edge_core.errors.ArtifactError` with a code
the planner reports: ``config_unreadable`` or ``artifact_invalid``.

Exported ONNX graphs are read by :mod:`edge_core.graph`.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import stat
from dataclasses import dataclass, fields
from typing import Any, BinaryIO, Iterator, NoReturn

from .errors import ArtifactError

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
#: ModelOpt writes its scheme here when config.json carries none (vLLM reads it too).
MODELOPT_CONFIG_NAME = "hf_quant_config.json"

#: The safetensors reader's own cap on the JSON header; a larger length prefix
#: is a lie or an attack, and honouring it would allocate that much memory.
MAX_HEADER_BYTES = 100_000_000
#: Real config.json and index files are kilobytes to a few MiB.
MAX_JSON_BYTES = 64 * 1024 * 1024
DIGEST_CHUNK_BYTES = 8 * 1024 * 1024
ARTIFACT_ID_HEX_CHARS = 16
#: Appears in a refusal only when input reached a case no check anticipated.
INTERNAL_MARK = "unanticipated input (an edge bug)"

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

#: quant_method values edge can name a format for (SPEC section 4).
KNOWN_QUANT_METHODS = ("compressed-tensors", "gptq", "awq", "fp8", "modelopt", "bitsandbytes")
#: Multimodal wrappers nest the language model's config under one of these.
TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")
#: Weights that can only be read by unpickling, i.e. by executing code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
PICKLE_REMEDY = (
    "convert it to safetensors in a trusted, isolated environment: load each file with "
    "torch.load(path, weights_only=True) and write the state dict with "
    "safetensors.torch.save_file(state_dict, 'model.safetensors') (shard large models and "
    "write model.safetensors.index.json), then point edge at that directory"
)


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint or exported graph is, read from its files (evidence class D).

    ``config`` is the *text* model's config: for a multimodal wrapper the nested
    ``text_config`` with the outer ``quantization_config`` and dtype carried in
    when only the wrapper has them (``text_config_key`` says which key was
    resolved). ``dtype_bytes`` is keyed by the dtype code as the file writes it
    (safetensors ``BF16``, ONNX ``FLOAT16``). ``artifact_id`` digests config and
    headers only; ``content_digest`` (every weight byte) is computed on request.
    """

    path: str
    kind: str
    weight_format: str
    weight_bytes: int
    dtype: str | None
    dtype_bytes: dict[str, int]
    architecture: str | None
    model_type: str | None
    tensor_count: int
    files: tuple[tuple[str, int], ...]
    total_file_bytes: int
    config: dict[str, Any]
    quantization: dict[str, Any] | None
    artifact_id: str
    content_digest: str | None = None
    onnx: dict[str, Any] | None = None
    text_config_key: str | None = None

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config (alias of ``config``, named for readers of multimodal code)."""
        return self.config

    @property
    def quantized(self) -> bool:
        return self.weight_format not in ("dense", "onnx:fp32", "onnx:fp16", "onnx:bf16")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}
        out["files"] = [{"name": name, "size_bytes": size} for name, size in self.files]
        out["evidence"] = "D"
        return out


@dataclass(frozen=True)
class _Shard:
    name: str
    size_bytes: int
    header: bytes
    #: tensor name -> (dtype code, bytes)
    tensors: dict[str, tuple[str, int]]


def read_manifest(path: str | os.PathLike, digest_weights: bool = False) -> Manifest:
    """Read a checkpoint directory, a ``.onnx`` file, or a directory holding one graph.

    Raises :class:`ArtifactError` (and nothing else) for any input that cannot be
    read safely; ``digest_weights`` streams every weight byte through sha256.
    """
    try:
        root = os.path.abspath(os.fspath(path))
    except (TypeError, ValueError) as exc:
        raise ArtifactError("artifact_invalid", f"{path!r} is not a usable path: {exc}",
                            "pass the path of a model directory", None) from None
    try:
        return _read(root, digest_weights)
    except ArtifactError:
        raise
    except RecursionError:
        raise ArtifactError("artifact_invalid", f"{root}: a file nests structures too deeply to read",
                            "re-export the model with a standard tool", root) from None
    except (OSError, ValueError) as exc:
        # The named checks cover the known cases; this keeps the promise that
        # no input ends in a traceback (e.g. a file vanishing mid-read).
        raise ArtifactError("artifact_invalid", f"{root}: could not be read: {exc}",
                            "check the files are complete and readable", root) from None
    except (TypeError, KeyError, IndexError, AttributeError) as exc:
        # A shape of input no check anticipated: still a refusal, but marked
        # as edge's own gap so it gets reported (the property tests look for it).
        raise ArtifactError("artifact_invalid", f"{root}: {INTERNAL_MARK} while reading: "
                            f"{type(exc).__name__}: {exc}",
                            "report this to edge's maintainers with the file that caused it", root) from None


def _read(root: str, digest_weights: bool) -> Manifest:
    if os.path.isfile(root):
        if root.lower().endswith(".onnx"):
            from .graph import read_graph_manifest

            return read_graph_manifest(os.path.dirname(root), os.path.basename(root), digest_weights)
        raise ArtifactError("artifact_invalid", f"{root} is a file, not a model directory",
                            "pass the directory that holds config.json and the *.safetensors files, or a .onnx graph",
                            root)
    if os.path.lexists(root) and not os.path.isdir(root):
        raise ArtifactError("artifact_invalid", f"{root} is neither a regular file nor a directory",
                            "pass the model directory or a .onnx file", root)
    if not os.path.isdir(root):
        raise ArtifactError("artifact_invalid", f"{root} does not exist or is not a directory",
                            "download the model first (e.g. `huggingface-cli download <repo> --local-dir DIR`) "
                            "and pass that directory", root)
    names = _listdir(root)
    has_safetensors = INDEX_NAME in names or any(n.endswith(".safetensors") for n in names)
    graphs = sorted(n for n in names if n.lower().endswith(".onnx"))
    if not has_safetensors and graphs:
        if len(graphs) > 1:
            raise ArtifactError("artifact_invalid", f"{root} holds {len(graphs)} ONNX graphs ({', '.join(graphs)})",
                                "pass the one .onnx file to plan for", root)
        from .graph import read_graph_manifest

        return read_graph_manifest(root, graphs[0], digest_weights)
    return _read_checkpoint(root, names, has_safetensors, digest_weights)


def _read_checkpoint(root: str, names: set[str], has_safetensors: bool, digest_weights: bool) -> Manifest:
    raw_config, config_size = _read_config(root)
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
    if _quantization_of(raw_config) is None and MODELOPT_CONFIG_NAME in names:
        hf_quant, size = _read_json(os.path.join(root, MODELOPT_CONFIG_NAME), MODELOPT_CONFIG_NAME,
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
    quantization = _quantization_of(raw_config) if hf_quant is None else hf_quant
    weight_format = weight_format_for(quantization, where=f"{root}/config.json")

    ident = hashlib.sha256(b"edge-artifact-v1\0")
    ident.update(_canonical(raw_config))
    if hf_quant is not None:
        ident.update(_canonical(hf_quant))
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
    )


# ---------------------------------------------------------------- config


def read_config(root: str | os.PathLike) -> dict[str, Any]:
    """The raw ``config.json`` of a model directory as a dict; ``config_unreadable`` otherwise."""
    return _read_config(os.path.abspath(os.fspath(root)))[0]


def _read_config(root: str) -> tuple[dict[str, Any], int]:
    config, size = _read_json(os.path.join(root, CONFIG_NAME), "config.json", "config_unreadable", root)
    if not isinstance(config, dict):
        raise ArtifactError("config_unreadable",
                            f"{root}/config.json holds a JSON {type(config).__name__}, not an object",
                            "restore the model's config.json from its source", root)
    return config, size


def resolve_text_config(raw: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The language model's config and the key it was nested under (None when top-level).

    Multimodal wrappers (Llava, Gemma 3, Mistral 3, ...) keep the decoder's
    geometry in ``text_config`` but often write ``quantization_config`` and the
    dtype only on the wrapper; those are carried in so one dict answers both.
    """
    for key in TEXT_CONFIG_KEYS:
        nested = raw.get(key)
        if isinstance(nested, dict):
            text = copy.deepcopy(nested)
            for carried in ("quantization_config", "compression_config", "torch_dtype", "dtype"):
                if carried not in text and carried in raw:
                    text[carried] = copy.deepcopy(raw[carried])
            return text, key
    return copy.deepcopy(raw), None


def identity(raw: dict[str, Any]) -> tuple[str | None, str | None]:
    """(architecture, model_type) as the loader dispatches on them: the outer config's."""
    archs = raw.get("architectures")
    architecture = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    model_type = raw.get("model_type")
    return architecture, model_type if isinstance(model_type, str) else None


def _quantization_of(config: dict[str, Any]) -> Any:
    # compressed-tensors checkpoints from before 2024 wrote "compression_config".
    for key in ("quantization_config", "compression_config"):
        if config.get(key) is not None:
            return config[key]
    for key in TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and nested.get("quantization_config") is not None:
            return nested["quantization_config"]
    return None


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


# ---------------------------------------------------------------- formats


def weight_format_for(quantization: dict[str, Any] | None, where: str = "config.json") -> str:
    """SPEC section 4's format name for a ``quantization_config`` (``dense`` for None)."""
    if quantization is None:
        return "dense"
    if not isinstance(quantization, dict):
        raise ArtifactError("artifact_invalid", f"quantization_config in {where} is not a JSON object",
                            "fix or re-download the checkpoint's config", where)
    method = quantization.get("quant_method")
    if not isinstance(method, str) or not method:
        raise ArtifactError("artifact_invalid", f"quantization_config in {where} names no quant_method",
                            f"fix the checkpoint's config; edge knows {', '.join(KNOWN_QUANT_METHODS)}", where)
    method = method.lower()
    if method == "compressed_tensors":
        method = "compressed-tensors"
    if method == "compressed-tensors":
        return _compressed_tensors_format(quantization, where)
    if method in ("gptq", "awq", "fp8", "bitsandbytes"):
        return method
    if method.startswith("modelopt"):
        return _modelopt_format(quantization, where)
    raise ArtifactError("artifact_invalid",
                        f"quantization method {method!r} in {where} is not one edge knows "
                        f"(known: {', '.join(KNOWN_QUANT_METHODS)})",
                        "use a checkpoint in one of the known formats, or a dense (unquantized) checkpoint", where)


def _modelopt_format(q: dict[str, Any], where: str) -> str:
    # ModelOpt writes either {"quantization": {"quant_algo": ...}} or a flat quant_algo.
    nested = q.get("quantization")
    algo = (nested if isinstance(nested, dict) else q).get("quant_algo")
    algo = algo.upper() if isinstance(algo, str) else None
    if algo in ("NVFP4", "W4A16_NVFP4"):
        return "modelopt_fp4"
    if algo in ("FP8", "FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO"):
        return "fp8"
    raise ArtifactError("artifact_invalid", f"ModelOpt quant_algo {algo!r} in {where} is not one edge knows "
                        "(known: NVFP4, W4A16_NVFP4, FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO)",
                        "use an NVFP4 or FP8 ModelOpt export, or the dense checkpoint", where)


#: compressed-tensors storage formats that pin the scheme when config_groups is silent.
_CT_FORMAT_HINTS = {
    "int-quantized": "compressed-tensors:int8",
    "float-quantized": "compressed-tensors:fp8",
    "pack-quantized": "compressed-tensors:w4a16",
    "nvfp4-pack-quantized": "compressed-tensors:nvfp4",
    "mxfp4-pack-quantized": "compressed-tensors:mxfp4",
}


def _compressed_tensors_format(q: dict[str, Any], where: str) -> str:
    hint = q.get("format") if isinstance(q.get("format"), str) else None
    groups = q.get("config_groups")
    if groups is not None and not isinstance(groups, dict):
        raise ArtifactError("artifact_invalid", f"compressed-tensors config_groups in {where} is not an object",
                            "re-export the checkpoint with llm-compressor", where)
    schemes = set()
    for name, group in (groups or {}).items():
        if not isinstance(group, dict):
            raise ArtifactError("artifact_invalid", f"compressed-tensors group {name!r} in {where} is not an object",
                                "re-export the checkpoint with llm-compressor", where)
        weights = group.get("weights")
        if weights is None:
            continue  # activation- or KV-only group: the weights stay dense
        schemes.add(_ct_scheme(weights, group.get("input_activations"), hint, name, where))
    if len(schemes) == 1:
        return schemes.pop()
    if len(schemes) > 1:
        return "compressed-tensors:mixed"
    if hint in _CT_FORMAT_HINTS:
        return _CT_FORMAT_HINTS[hint]
    if hint in (None, "dense", "sparse-bitmask", "sparse-24-bitmask"):
        return "dense"  # sparsity-only or KV-only compression: weights are full precision
    raise ArtifactError("artifact_invalid", f"compressed-tensors format {hint!r} in {where} names no weight scheme "
                        "and config_groups is empty", "re-export the checkpoint with llm-compressor", where)


def _ct_scheme(weights: Any, acts: Any, hint: str | None, group: str, where: str) -> str:
    if not isinstance(weights, dict) or (acts is not None and not isinstance(acts, dict)):
        raise ArtifactError("artifact_invalid", f"compressed-tensors group {group!r} in {where} has malformed "
                            "weights/input_activations", "re-export the checkpoint with llm-compressor", where)
    wbits, wtype = weights.get("num_bits"), weights.get("type", "int")
    if not _is_int(wbits):
        if hint in _CT_FORMAT_HINTS:
            return _CT_FORMAT_HINTS[hint]
        raise ArtifactError("artifact_invalid", f"compressed-tensors group {group!r} in {where} has no weight num_bits",
                            "re-export the checkpoint with llm-compressor", where)
    abits = acts.get("num_bits") if acts else None
    atype = acts.get("type", "int") if acts else None
    if wtype == "int" and wbits == 8 and atype == "int" and abits == 8:
        return "compressed-tensors:int8"
    if wtype == "float" and wbits == 8 and (acts is None or (atype == "float" and abits == 8)):
        return "compressed-tensors:fp8"
    if wtype == "int" and wbits == 4 and acts is None:
        return "compressed-tensors:w4a16"
    if wtype == "float" and wbits == 4 and hint in _CT_FORMAT_HINTS:
        return _CT_FORMAT_HINTS[hint]
    # A scheme SPEC does not name still gets a precise name, so a refusal can say what it is.
    suffix = "" if wtype == "int" else f"-{wtype}"
    return f"compressed-tensors:w{wbits}a{abits if _is_int(abits) else 16}{suffix}"


# ---------------------------------------------------------------- safetensors


def _shard_names(root: str, names: set[str], files: list[tuple[str, int]]) -> tuple[list[str], dict[str, str] | None]:
    if INDEX_NAME not in names:
        return sorted(n for n in names if n.endswith(".safetensors")), None
    index, size = _read_json(os.path.join(root, INDEX_NAME), INDEX_NAME, "artifact_invalid", root)
    files.append((INDEX_NAME, size))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ArtifactError("artifact_invalid", f"{root}/{INDEX_NAME} has no weight_map of tensor -> file names",
                            "restore the index from the model's source", root)
    shard_names = sorted(set(weight_map.values()))
    for name in shard_names:
        _check_contained(root, name)
        if not os.path.lexists(os.path.join(root, name)):
            raise ArtifactError("artifact_invalid", f"{root}/{INDEX_NAME} names shard {name!r}, which is missing",
                                "finish the download (every shard in the index must be present)", root)
    return shard_names, weight_map


def _check_contained(root: str, name: str, source: str = INDEX_NAME) -> None:
    # The check is on the *name*: the Hugging Face cache links shards into
    # ../../blobs/, so where a link resolves to says nothing about intent.
    parts = name.replace("\\", "/").split("/")
    if (not name or "\0" in name or os.path.isabs(name) or name.startswith(("/", "\\"))
            or os.path.splitdrive(name)[0] or ".." in parts or "" in parts):
        raise ArtifactError("artifact_invalid",
                            f"{root}/{source} names {name!r}, which is outside the model directory",
                            "keep every file the artifact names inside its directory, named relative to it "
                            "(e.g. model-00001-of-00002.safetensors)", root)


def _read_safetensors_header(root: str, name: str) -> _Shard:
    path = os.path.join(root, name)
    with _open_regular(path, f"shard {name}", "artifact_invalid", root) as (f, size):
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
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
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


def _tensor_entry(root: str, name: str, key: str, info: Any, data_bytes: int) -> tuple[str, int, int, int]:
    if not isinstance(info, dict):
        _bad(root, name, f"describes tensor {key!r} with a {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        _bad(root, name, f"gives tensor {key!r} unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        _bad(root, name, f"gives tensor {key!r} shape {shape!r}; expected a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or offsets[0] < 0 or offsets[0] > offsets[1]):
        _bad(root, name, f"gives tensor {key!r} data_offsets {offsets!r}; expected [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_bytes:
        _bad(root, name, f"places tensor {key!r} at bytes [{begin}, {end}) but the data section has only "
                         f"{data_bytes} bytes (truncated download?)")
    bits = SAFETENSORS_DTYPES[dtype][0]
    budget_bits = (end - begin) * 8
    elements_bits = 0 if 0 in shape else bits
    for dim in shape:
        elements_bits *= dim
        if elements_bits > budget_bits:  # stop before a hostile shape builds a huge integer
            break
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


def content_digest(root: str, names: list[str]) -> str:
    """sha256 over each named file's name and every byte, in name order, read in chunks."""
    digest = hashlib.sha256(b"edge-content-v1\0")
    for name in sorted(names):
        digest.update(name.encode("utf-8", "surrogatepass") + b"\0")
        with _open_regular(os.path.join(root, name), name, "artifact_invalid", root) as (f, _):
            while chunk := f.read(DIGEST_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


# ---------------------------------------------------------------- files


@contextlib.contextmanager
def _open_regular(path: str, what: str, code: str, root: str) -> Iterator[tuple[BinaryIO, int]]:
    """Open a file for reading only if it is a regular file; yields (file, size_bytes).

    The stat comes first so a FIFO or device is refused without being opened;
    the open is non-blocking and re-checked with fstat in case the path was
    swapped between the two calls.
    """
    _regular_file(path, what, code, root)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ArtifactError(code, f"{what} ({path}) cannot be opened: {exc.strerror}",
                            "check the file's permissions", root) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _not_regular(path, what, code, root, st)
    with os.fdopen(fd, "rb") as f:
        yield f, st.st_size


def _regular_file(path: str, what: str, code: str, root: str | None = None) -> os.stat_result:
    try:
        st = os.stat(path)  # follows links: HF cache shards are links into blobs/
    except FileNotFoundError:
        raise ArtifactError(code, f"{what} ({path}) is missing" + (" or a dangling link" if os.path.islink(path) else ""),
                            "download the complete model into the directory", root or path) from None
    except OSError as exc:
        raise ArtifactError(code, f"{what} ({path}) cannot be examined: {exc.strerror}",
                            "check the file's permissions", root or path) from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, what, code, root or path, st)
    return st


def _not_regular(path: str, what: str, code: str, root: str, st: os.stat_result) -> ArtifactError:
    kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a directory" if stat.S_ISDIR(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
            else "not a regular file")
    return ArtifactError(code, f"{what} ({path}) is {kind}; reading it could block or never end, so edge does not open it",
                         "replace it with the real file from the model's source", root)


def _read_json(path: str, what: str, code: str, root: str) -> tuple[Any, int]:
    with _open_regular(path, what, code, root) as (f, size):
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise ArtifactError(code, f"{what} in {root} is larger than {MAX_JSON_BYTES} bytes",
                            "restore the file from the model's source", root)
    if not data.strip():
        raise ArtifactError(code, f"{what} in {root} is empty", "restore the file from the model's source", root)
    try:
        return json.loads(data.decode("utf-8-sig")), size
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ArtifactError(code, f"{what} in {root} is not valid JSON: {exc}",
                            "restore the file from the model's source", root) from None


def _listdir(root: str) -> set[str]:
    try:
        return set(os.listdir(root))
    except OSError as exc:
        raise ArtifactError("artifact_invalid", f"{root} cannot be listed: {exc.strerror}",
                            "check the directory's permissions", root) from None


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _bad(root: str, name: str, what: str) -> NoReturn:
    raise ArtifactError("artifact_invalid", f"safetensors file {name} in {root} {what}",
                        "re-download the file (or re-save it with safetensors); edge reads only valid headers", root)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()
