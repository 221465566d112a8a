"""edge-vitisai: the AMD XDNA NPU through ONNX Runtime's VitisAI execution provider.

Registered in the ``edge.backends`` entry-point group as ``vitisai``. The NPU
is reported as ``npu:amd``, drawing on host RAM (0 bytes of its own), executing
``onnx:a16w8`` graphs only, reached through the VitisAI route of this
interpreter kind (``_probe.ROUTES``: Windows, or Linux with amdxdna; from WSL the
Windows route is another interpreter). Probing reads ``/sys`` and installed
metadata; ``verify_device`` and the stage hooks are the only places that
import onnxruntime, through edge-core's shared graph-stage runtime
(:mod:`edge_core.runtime.ort_stage`), with VitisAI as the placement target.
"""

from __future__ import annotations

import os
from typing import Any

from edge_core import hookimpl
from edge_core.kit.ort_hooks import stage_hooks

from . import _probe
from ._probe import BACKEND, DEVICE_ID, FORMATS, PROVIDER, ROUTES

EDGE_API_VERSION = 1

#: Why the last probe found no devices, or None. The registry reads it.
last_probe_note: str | None = None

#: Where the VitisAI EP keeps the graphs it compiled for the NPU (its
#: ``cache_dir`` option; ``cache_key`` is the artifact id), so a second start
#: of the same stage does not compile again.
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "edge", "vitisai")

__all__ = [
    "EDGE_API_VERSION",
    "FORMATS",
    "PROVIDER",
    "ROUTES",
    "cancel",
    "format_remedy",
    "last_probe_note",
    "probe_devices",
    "start_stage",
    "stop_stage",
    "stream",
    "verify_device",
    "weight_formats",
]


def _owns(device: Any) -> bool:
    return device.local_id == DEVICE_ID and device.backend == BACKEND


@hookimpl
def probe_devices(host: Any) -> list:
    global last_probe_note
    devices, last_probe_note = _probe.probe(host)
    return devices


@hookimpl
def weight_formats(device: Any) -> list[str] | None:
    return list(FORMATS) if _owns(device) else None


@hookimpl
def format_remedy(device: Any, weight_format: str) -> str | None:
    if not _owns(device):
        return None
    return (f"{DEVICE_ID} executes {', '.join(FORMATS)} only (QDQ: 16-bit activations, 8-bit weights); ONNX "
            f"Runtime would not refuse a {weight_format} graph but leave every node on the CPU. Quantize the "
            "stage to A16W8: `python scripts/export_stage.py --model CHECKPOINT --out DIR` writes "
            "<stage>.a16w8.onnx (quantize_static: QUInt16 activations, QInt8 weights)")


@hookimpl
def verify_device(device: Any) -> Any:
    return _probe.verify(device) if _owns(device) else None


@hookimpl
def start_stage(device: Any, plan: Any) -> Any:
    if not _owns(device):
        return None
    from edge_core.runtime import ort_stage

    key = plan.manifest.artifact_id
    return ort_stage.start(device, plan, providers=(PROVIDER, ort_stage.CPU_PROVIDER), target_provider=PROVIDER,
                           provider_options={PROVIDER: {"cache_dir": CACHE_DIR, "cache_key": key}})


# Requests, cancels and shutdown of our graph stages go to the shared ONNX Runtime stage.
stream, cancel, stop_stage = stage_hooks(BACKEND, PROVIDER)
