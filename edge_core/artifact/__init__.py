"""What is this model? A checkpoint or exported graph, read without loading a single weight.

The artifact layer: everything here reads files (``config.json``, safetensors
headers, ONNX protobuf) and nothing else — no torch, no transformers, no
unpickling, no ``trust_remote_code``. :func:`read_manifest` is the entry;
any input it cannot read safely is an :class:`~edge_core.errors.ArtifactError`
carrying the refusal code the planner reports.

The manifest type and the bundled demo paths are imported with the package;
the readers on first use (:mod:`edge_core._exports` says why).
"""

from typing import TYPE_CHECKING

from .._exports import lazy_exports
from .demo import DEMO_DIR, DEMO_MODEL, DEMO_MODEL_HD16
from .manifest import ARTIFACT_ID_HEX_CHARS, Manifest

if TYPE_CHECKING:
    from .checkpoint import INDEX_NAME, PICKLE_SUFFIXES
    from .config import CONFIG_NAME, TEXT_CONFIG_KEYS, identity, read_config, resolve_text_config
    from .formats import KNOWN_QUANT_METHODS, weight_format_for
    from .header import MAX_HEADER_BYTES, SAFETENSORS_DTYPES, TensorInfo, TensorTable
    from .reader import INTERNAL_MARK, read_manifest

__all__ = [
    "ARTIFACT_ID_HEX_CHARS",
    "CONFIG_NAME",
    "DEMO_DIR",
    "DEMO_MODEL",
    "DEMO_MODEL_HD16",
    "INDEX_NAME",
    "INTERNAL_MARK",
    "KNOWN_QUANT_METHODS",
    "MAX_HEADER_BYTES",
    "Manifest",
    "PICKLE_SUFFIXES",
    "SAFETENSORS_DTYPES",
    "TEXT_CONFIG_KEYS",
    "TensorInfo",
    "TensorTable",
    "identity",
    "read_config",
    "read_manifest",
    "resolve_text_config",
    "weight_format_for",
]

__getattr__ = lazy_exports(__name__, {
    "INDEX_NAME": ".checkpoint", "PICKLE_SUFFIXES": ".checkpoint",
    "MAX_HEADER_BYTES": ".header", "SAFETENSORS_DTYPES": ".header", "TensorInfo": ".header", "TensorTable": ".header",
    "CONFIG_NAME": ".config", "TEXT_CONFIG_KEYS": ".config", "identity": ".config", "read_config": ".config",
    "resolve_text_config": ".config",
    "KNOWN_QUANT_METHODS": ".formats", "weight_format_for": ".formats",
    "INTERNAL_MARK": ".reader", "read_manifest": ".reader",
}, globals())
