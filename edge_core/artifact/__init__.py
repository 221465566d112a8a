"""What is this model? A checkpoint or exported graph, read without loading a single weight.

The artifact layer: everything here reads files (``config.json``, safetensors
headers, ONNX protobuf) and nothing else — no torch, no transformers, no
unpickling, no ``trust_remote_code``. :func:`read_manifest` is the entry;
any input it cannot read safely is an :class:`~edge_core.errors.ArtifactError`
carrying the refusal code the planner reports.

The manifest it returns is a contract type (:class:`edge_core.manifest.Manifest`):
backends are handed it and never import this package.
"""

from .checkpoint import INDEX_NAME, PICKLE_SUFFIXES
from .config import CONFIG_NAME, TEXT_CONFIG_KEYS, identity, read_config, resolve_text_config
from .demo import DEMO_DIR, DEMO_MODEL, DEMO_MODEL_HD16
from .formats import KNOWN_QUANT_METHODS, weight_format_for
from .header import MAX_HEADER_BYTES, SAFETENSORS_DTYPES, TensorInfo, TensorTable
from .reader import INTERNAL_MARK, read_manifest

__all__ = [
    "CONFIG_NAME",
    "DEMO_DIR",
    "DEMO_MODEL",
    "DEMO_MODEL_HD16",
    "INDEX_NAME",
    "INTERNAL_MARK",
    "KNOWN_QUANT_METHODS",
    "MAX_HEADER_BYTES",
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

