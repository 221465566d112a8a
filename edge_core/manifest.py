"""What a model is and where it came from: the record of one checkpoint or exported graph, read from its files.

:class:`Manifest` is built by the artifact layer (:func:`edge_core.artifact.read_manifest`) and handed to
every planning hook; :class:`ModelSource` says where the planned directory came from (a local path, the
Hugging Face cache, or headers fetched from the Hub).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Protocol


class TensorRecords(Protocol):
    """Every tensor of a checkpoint, read from its headers (:class:`edge_core.artifact.header.TensorTable`)."""

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...

    def shards(self) -> Sequence[Any]:
        """One record per shard file, with the ``names`` and ``nbytes`` of its tensors in file order."""
        ...


#: Hex characters of the short artifact id (a digest of config and headers).
ARTIFACT_ID_HEX_CHARS = 16


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint or exported graph is, read from its files (evidence class D).

    ``config`` is the *text* model's config: for a multimodal wrapper the nested
    ``text_config`` with the outer ``quantization_config`` and dtype carried in
    when only the wrapper has them (``text_config_key`` says which key was
    resolved). ``dtype_bytes`` is keyed by the dtype code as the file writes it
    (safetensors ``BF16``, ONNX ``FLOAT16``). ``artifact_id`` digests config and
    headers only; ``content_digest`` (every weight byte) is computed on request.
    ``config_defaults`` lists the fields ``config`` holds that the published
    config left to its library (field -> value, from transformers'
    configuration class for its model_type); ``config_defaults_source`` names
    that class and version, or why none could be filled (None: none needed).
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
    config_defaults: dict[str, Any] = field(default_factory=dict)
    config_defaults_source: str | None = None
    #: The scheme behind ``weight_format`` (bits, group size, symmetry, scale granularity,
    #: static/dynamic activations: :data:`edge_core.artifact.formats.SCHEME_KEYS`), derived from
    #: ``quantization`` by the reader; None for an unquantized model.
    quantization_scheme: dict[str, Any] | None = None
    #: Every tensor of a checkpoint as (name, dtype, shape, nbytes, file), iterated on
    #: demand (:class:`edge_core.artifact.header.TensorTable`); None for a graph. Not part of ``to_dict``.
    tensors: TensorRecords | None = field(default=None, compare=False, repr=False)

    @property
    def text_config(self) -> dict[str, Any]:
        """The language model's config (alias of ``config``, named for readers of multimodal code)."""
        return self.config

    @property
    def quantized(self) -> bool:
        return self.weight_format not in ("dense", "onnx:fp32", "onnx:fp16", "onnx:bf16")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "tensors"}
        out["files"] = [{"name": name, "size_bytes": size} for name, size in self.files]
        out["evidence"] = "D"
        return out


@dataclass(frozen=True)
class ModelSource:
    """Where a model came from and the directory planned.

    ``kind``: ``local`` (a path the user gave), ``cache`` (a complete snapshot in
    the Hugging Face cache), ``hub`` (headers fetched from the Hub into edge's
    metadata cache; ``weights_present`` False). ``fetched_bytes`` counts what
    this resolution transferred (0 when the metadata cache had it).
    """

    kind: str
    path: str
    repo: str | None = None
    revision: str | None = None
    commit: str | None = None
    weights_present: bool = True
    fetched_bytes: int = 0
    remote_bytes: int | None = None
    weight_files: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "repo": self.repo, "revision": self.revision,
                "commit": self.commit, "weights_present": self.weights_present,
                "fetched_bytes": self.fetched_bytes, "remote_bytes": self.remote_bytes}

    def describe(self) -> str:
        """One line for the text output, e.g. ``hub Qwen/Qwen2.5-7B@main (a1b2c3d): fetched 412 KiB of 15.2 GB``."""
        if self.kind == "local":
            return f"local {self.path}"
        where = f"{self.repo}@{self.revision or 'main'} ({(self.commit or '?')[:12]})"
        if self.kind == "cache":
            return f"cache {where}: {self.path}"
        got = f"fetched {transfer_size(self.fetched_bytes)}" if self.fetched_bytes else "headers from edge's metadata cache"
        of = f" of a {transfer_size(self.remote_bytes)} checkpoint" if self.remote_bytes else ""
        return f"hub {where}: {got}{of}; weights not downloaded"


def transfer_size(n: int | None) -> str:
    """A byte count as the Hub's pages write it: decimal GB and MB, KiB below."""
    n = n or 0
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if unit != "KiB" else f"{n // 1024} KiB"
    return f"{n} B"
