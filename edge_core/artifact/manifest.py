"""What a manifest is: the record of one checkpoint or exported graph, read from its files (evidence D)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .formats import quantization_scheme_for

if TYPE_CHECKING:
    from .header import TensorTable

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
    #: static/dynamic activations: :data:`.formats.SCHEME_KEYS`); derived from
    #: ``quantization`` when the reader leaves it None.
    quantization_scheme: dict[str, Any] | None = None
    #: Every tensor of a checkpoint as (name, dtype, shape, nbytes, file), iterated on
    #: demand (:class:`.header.TensorTable`); None for a graph. Not part of ``to_dict``.
    tensors: TensorTable | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.quantization_scheme is None and self.quantization is not None:
            object.__setattr__(self, "quantization_scheme", quantization_scheme_for(self.quantization))

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

