"""The checkpoints bundled with edge-core (random weights, made by ``scripts/make_demo_checkpoints.py``).

``tiny-llama`` is what ``edge plan`` / ``edge run`` use with no ``--model``;
``tiny-llama-hd16`` has ``head_dim=16``, which vLLM CPU loads and then crashes
on, and edge refuses in milliseconds.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"
DEMO_MODEL = DEMO_DIR / "tiny-llama"
DEMO_MODEL_HD16 = DEMO_DIR / "tiny-llama-hd16"
