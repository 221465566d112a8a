"""edge-dml: AMD and Intel integrated GPUs through DirectML.

Registered in the ``edge.backends`` entry-point group as ``dml``. An iGPU is
reported as ``gpu_integrated:<vendor>`` drawing on host RAM (0 bytes of its
own). Which DirectML route resolves here (``_routes.py``: onnxruntime-directml
on Windows, torch-directml under WSL) decides the backend and the exported
formats it executes; with no route the format set is empty and the reason
names what to install.
"""

from __future__ import annotations

from typing import Any

from edge_core import hookimpl

from . import _probe
from ._routes import ROUTES, ROUTES_BY_BACKEND

EDGE_API_VERSION = 1

#: Why the last probe found no devices, or None. The registry reads it.
last_probe_note: str | None = None

__all__ = ["EDGE_API_VERSION", "ROUTES", "last_probe_note", "probe_devices", "weight_formats"]


@hookimpl
def probe_devices(host: Any) -> list:
    global last_probe_note
    devices, last_probe_note = _probe.probe(host)
    return devices


@hookimpl
def weight_formats(device: Any) -> list[str] | None:
    if not device.device_id.startswith("gpu_integrated:"):
        return None
    route = ROUTES_BY_BACKEND.get(device.backend)
    return list(route.formats) if route else []
