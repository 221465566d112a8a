"""edge-vitisai: the AMD XDNA NPU through ONNX Runtime's VitisAI execution provider.

Registered in the ``edge.backends`` entry-point group as ``vitisai``. The NPU
is reported as ``npu:amd``, drawing on host RAM (0 bytes of its own), executing
``onnx:a16w8`` graphs only. Probing reads ``/sys`` and installed metadata;
``verify_device`` is the one place that imports onnxruntime.
"""

from __future__ import annotations

from typing import Any

from edge_core import hookimpl

from . import _probe
from ._probe import BACKEND, DEVICE_ID, FORMATS

EDGE_API_VERSION = 1

#: Why the last probe found no devices, or None. The registry reads it.
last_probe_note: str | None = None

__all__ = [
    "EDGE_API_VERSION",
    "FORMATS",
    "last_probe_note",
    "probe_devices",
    "verify_device",
    "weight_formats",
]


def _owns(device: Any) -> bool:
    return device.device_id == DEVICE_ID and device.backend == BACKEND


@hookimpl
def probe_devices(host: Any) -> list:
    global last_probe_note
    devices, last_probe_note = _probe.probe(host)
    return devices


@hookimpl
def weight_formats(device: Any) -> list[str] | None:
    return list(FORMATS) if _owns(device) else None


@hookimpl
def verify_device(device: Any) -> Any:
    return _probe.verify(device) if _owns(device) else None
