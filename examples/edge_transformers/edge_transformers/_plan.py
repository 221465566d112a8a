"""What this backend adds to a plan: its memory term and its reasons to refuse.

Both answer from the manifest and installed files; nothing is imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from edge_core import Reservation
from edge_core.plans import Refusal

#: PSS of a process running a transformers stage, minus weights and KV (bytes, evidence E).
#: Measured on a 2-core x86-64 VM with torch 2.13.0+cpu and transformers 5.19 in a venv whose
#: libraries no other process maps (so PSS is not discounted by sharing): 475 MiB after
#: `import torch, transformers`, 540 MiB after 128 greedy tokens on the demo checkpoint
#: (weights 1.8 MB), 525 MiB attributable tree PSS in `edge run`. Where another process maps
#: the same torch files PSS reads lower (437-440 MiB). Rounded up by ~12% for longer requests.
RUNTIME_BASELINE_BYTES = 608 << 20


def reservations(manifest: Any, session: Any) -> list[Reservation]:
    return [
        Reservation(
            purpose="runtime_baseline",
            bytes=RUNTIME_BASELINE_BYTES,
            pool="host_ram",
            lifetime="session",
            evidence="E",
            held_during_load=True,
            note="torch + transformers imported in this process, plus kernel workspaces "
            "(PSS 540 MiB measured after 128 tokens, unshared); weights are mmap'd, not copied, "
            "so they are counted once by the weights term",
        )
    ]


def _transformers_models_dir() -> Path | None:
    # find_spec on a top-level package reads the path finder only; it does not import it.
    spec = importlib.util.find_spec("transformers")
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) / "models" if locations else None


def gate(device: Any, manifest: Any) -> list[Refusal]:
    """Refuse a checkpoint whose architecture this transformers has no code for.

    Such a checkpoint would need ``trust_remote_code``, which edge never sets.
    """
    model_type = str(manifest.model_type or manifest.config.get("model_type") or "")
    models = _transformers_models_dir()
    if models is None or not model_type:
        return []
    if (models / model_type.replace("-", "_")).is_dir():
        return []
    remote = "auto_map" in manifest.config
    return [Refusal(
        code="kernel_unsupported",
        device_id=device.device_id,
        message=(f"transformers installed here has no implementation of model_type {model_type!r}"
                 + (" (the checkpoint ships its own code in auto_map, which edge never runs)" if remote else "")),
        remedy=("upgrade transformers (`pip install -U transformers`) to a release that knows "
                f"{model_type!r}, or run the checkpoint on a backend whose runtime supports it"),
        details={"model_type": model_type},
    )]
