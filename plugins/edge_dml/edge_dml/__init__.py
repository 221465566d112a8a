"""edge-dml: AMD and Intel integrated GPUs through DirectML.

Registered in the ``edge.backends`` entry-point group as ``dml``. An iGPU is
reported as ``gpu_integrated:<vendor>`` drawing on host RAM (0 bytes of its
own). Which DirectML route resolves here (``_routes.py``, through edge-core's
shared route mechanism: onnxruntime-directml in a Windows Python,
torch-directml under WSL) decides the backend and the exported formats it
executes; with no route the format set is empty and the reason names what to
install or which interpreter to use. ONNX graph stages run through edge-core's
shared graph-stage runtime (:mod:`edge_core.runtime.ort_stage`) with DirectML as the
placement target, imported only when a stage starts.
"""

from __future__ import annotations

from typing import Any

from edge_core import hookimpl
from edge_core.kit.ort_hooks import stage_hooks

from . import _probe
from ._routes import DML_PROVIDER, ROUTES, ROUTES_BY_BACKEND

EDGE_API_VERSION = 1

#: Why the last probe found no devices, or None. The registry reads it.
last_probe_note: str | None = None

__all__ = [
    "EDGE_API_VERSION",
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

_ORT_ROUTE = "ort:dml"


def _owns(device: Any) -> bool:
    # An unreachable iGPU carries no backend; a reachable one names one of our routes.
    return device.local_id.startswith("gpu_integrated:") and (
        device.backend is None or device.backend in ROUTES_BY_BACKEND)


@hookimpl
def probe_devices(host: Any) -> list:
    global last_probe_note
    devices, last_probe_note = _probe.probe(host)
    return devices


@hookimpl
def weight_formats(device: Any) -> list[str] | None:
    if not _owns(device):
        return None
    route = ROUTES_BY_BACKEND.get(device.backend)
    return list(route.formats) if route else []


@hookimpl
def format_remedy(device: Any, weight_format: str) -> str | None:
    route = ROUTES_BY_BACKEND.get(device.backend) if _owns(device) else None
    if route is None:
        return None
    if route.backend == _ORT_ROUTE:
        return (f"{device.device_id} ({route.backend}) executes {', '.join(route.formats)}: export the stage in "
                "one of those (`python scripts/export_stage.py --model CHECKPOINT --out DIR --formats fp16,fp32`)"
                + ("; an A16W8 graph is the XDNA NPU's format (edge-vitisai)" if weight_format == "onnx:a16w8"
                   else ""))
    return (f"{device.device_id} is reached through {route.backend} here, which executes torch exports "
            f"({', '.join(route.formats)}), not {weight_format}: ONNX graphs run through onnxruntime-directml "
            "in a Windows Python (run edge from Windows with edge-dml installed)")


@hookimpl
def verify_device(device: Any) -> Any:
    return _probe.verify(device) if _owns(device) and device.backend in ROUTES_BY_BACKEND else None


@hookimpl
def start_stage(device: Any, plan: Any) -> Any:
    if not _owns(device):
        return None
    from edge_core.errors import StageError
    from edge_core.runtime import ort_stage

    if device.backend != _ORT_ROUTE:
        raise StageError(f"{device.device_id} is reached through {device.backend}, which runs torch exports; "
                         "edge runs ONNX graph stages through onnxruntime-directml (a Windows Python)")
    return ort_stage.start(device, plan, providers=(DML_PROVIDER, ort_stage.CPU_PROVIDER),
                           target_provider=DML_PROVIDER, configure=session_options_for_dml)


def session_options_for_dml(ort: Any, options: Any, providers: list[str]) -> None:
    """DirectML cannot run with memory patterns or parallel execution (ONNX Runtime's DML EP docs)."""
    if DML_PROVIDER in providers:
        options.enable_mem_pattern = False
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL


# Requests, cancels and shutdown of our graph stages go to the shared ONNX Runtime stage.
stream, cancel, stop_stage = stage_hooks(_ORT_ROUTE, DML_PROVIDER)
