"""edge-transformers: an example third-party edge backend running Hugging Face transformers on the CPU.

Everything it uses from edge is public: the ``hookimpl`` marker and the record
types (``edge_core``, ``edge_core.plan.Refusal``, ``edge_core.stream``). The
hooks below are plain module-level functions; the work lives in private
modules (``_probe``, ``_plan``, ``_stage``), and torch/transformers are
imported only when a stage starts.

Device id ``cpu:hf``: the id ``cpu`` belongs to edge-cpu, and ids must be
unique across plugins. See README.md for the choices and measurements.
"""

from __future__ import annotations

from typing import Any

from edge_core import Device, HostFacts, hookimpl

from . import _plan, _probe

__all__ = [
    "EDGE_API_VERSION",
    "EDGE_PRIORITY",
    "cancel",
    "gate_plan",
    "last_probe_note",
    "probe_devices",
    "reserve_memory",
    "start_stage",
    "stop_stage",
    "stream",
    "verify_device",
    "weight_formats",
]

#: The edge hook API this backend implements (edge_core.API_VERSION).
EDGE_API_VERSION = 1
#: After edge-cpu (200): where a vLLM CPU build exists it is the better engine.
EDGE_PRIORITY = 300
#: The probe always reports its device (runnable or with a reason), so this stays None.
last_probe_note: str | None = None

PLUGIN_NAME = "transformers"


def _owns(device: Device) -> bool:
    return device.device_id == _probe.DEVICE_ID and device.plugin in (None, PLUGIN_NAME)


@hookimpl
def probe_devices(host: HostFacts) -> list[Device]:
    return _probe.probe(host)


@hookimpl
def weight_formats(device: Device) -> list[str] | None:
    return list(_probe.FORMATS) if _owns(device) else None


@hookimpl
def reserve_memory(device: Device, manifest: Any, session: Any, host: HostFacts) -> list[Any] | None:
    return _plan.reservations(manifest, session) if _owns(device) else None


@hookimpl
def gate_plan(device: Device, manifest: Any) -> list[Any] | None:
    return _plan.gate(device, manifest) if _owns(device) else None


@hookimpl
def start_stage(device: Device, plan: Any) -> Any:
    from . import _stage

    return _stage.start(device, plan)


@hookimpl
def stream(stage: Any, request: Any) -> Any:
    from . import _stage

    return _stage.stream(stage, request)


@hookimpl
def cancel(stage: Any, request_id: str) -> bool:
    from . import _stage

    return _stage.cancel(stage, request_id)


@hookimpl
def stop_stage(stage: Any) -> bool:
    from . import _stage

    return _stage.stop(stage)


@hookimpl
def verify_device(device: Device) -> Device | None:
    if not _owns(device) or not device.runnable:
        return None
    return _probe.verify(device)
