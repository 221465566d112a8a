"""The model's ``config.json``: read safely, the text model's part resolved, its identity named.

Multimodal wrappers nest the language model under ``text_config`` (or a
sibling key); the planner reads one dict either way. Never ``trust_remote_code``:
the file is JSON and nothing else. Fields a config leaves to its library's
defaults are filled by :mod:`.library_defaults`.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from ..errors import ArtifactError
from ._files import read_json

CONFIG_NAME = "config.json"
#: Multimodal wrappers nest the language model's config under one of these.
TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config")


def read_config(root: str | os.PathLike[str]) -> dict[str, Any]:
    """The raw ``config.json`` of a model directory as a dict; ``config_unreadable`` otherwise."""
    return read_config_sized(os.path.abspath(os.fspath(root)))[0]


def read_config_sized(root: str) -> tuple[dict[str, Any], int]:
    config, size = read_json(os.path.join(root, CONFIG_NAME), "config.json", "config_unreadable", root)
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


def quantization_of(config: dict[str, Any]) -> Any:
    # compressed-tensors checkpoints from before 2024 wrote "compression_config".
    for key in ("quantization_config", "compression_config"):
        if config.get(key) is not None:
            return config[key]
    for key in TEXT_CONFIG_KEYS:
        nested = config.get(key)
        if isinstance(nested, dict) and nested.get("quantization_config") is not None:
            return nested["quantization_config"]
    return None
