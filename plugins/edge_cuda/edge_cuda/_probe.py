"""Which NVIDIA GPUs this process can see through NVML, as ``cuda:N`` devices.

NVML (``pynvml`` from nvidia-ml-py) is a thin wrapper over the driver's
``libnvidia-ml``: a probe costs milliseconds and needs neither torch nor a CUDA
context. Whether the GPUs are *runnable* is decided from installed metadata
(:func:`edge_core.builds.vllm_build_for`), never by importing vLLM.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from edge_core import builds
from edge_core.devices import Device

from ._capability import BACKEND, MIN_SM, formats_for

log = logging.getLogger(__name__)

#: Evidence of a row read from NVML; formats are derived from the read capability.
_EVIDENCE = {
    "found": "D",
    "memory_bytes": "D",
    "compute_capability": "D",
    "weight_formats": "D",
    "runnable": "D",
}


def _text(value: Any) -> str:
    # nvidia-ml-py returned bytes before 11.5 and str since; accept both.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _note(message: str) -> tuple[list[Device], str]:
    log.debug("edge-cuda found no devices: %s", message)
    return [], message


def probe(
    host: Any = None,
    nvml: ModuleType | Any | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[Device], str | None]:
    """Return the GPUs this process sees and, when there are none, why.

    ``nvml`` is the pynvml module (imported here when None; tests pass a fake);
    ``environ`` supplies ``CUDA_VISIBLE_DEVICES``. Never raises for a missing
    library, driver or GPU, and always pairs ``nvmlInit`` with ``nvmlShutdown``.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return _note(
                f"NVML bindings are not installed ({exc}): pip install nvidia-ml-py "
                "(edge-cuda depends on it unless installed with --no-deps)"
            )
    error = getattr(nvml, "NVMLError", Exception)
    try:
        nvml.nvmlInit()
    except error as exc:
        return _note(f"NVML could not start ({exc}): no NVIDIA driver is loaded here")
    try:
        return _read_devices(nvml, error, os.environ if environ is None else environ)
    except error as exc:
        return _note(f"NVML failed while listing GPUs ({exc}); check nvidia-smi")
    finally:
        try:
            nvml.nvmlShutdown()
        except error:
            pass


def _read_devices(nvml: Any, error: type, environ: Mapping[str, str]) -> tuple[list[Device], str | None]:
    count = int(nvml.nvmlDeviceGetCount())
    if count == 0:
        return _note("NVML is running but sees no NVIDIA GPU")
    visible, env_note = visible_indices(nvml, error, count, environ)
    if not visible:
        return _note(env_note or "no GPU is visible to this process")
    if env_note:
        log.debug("edge-cuda: %s", env_note)
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
    except error:
        driver = None
    runtime_reason = _runtime_reason()
    devices = [
        _device(nvml, error, ordinal, index, driver, runtime_reason)
        for ordinal, index in enumerate(visible)
    ]
    return devices, None


def visible_indices(
    nvml: Any, error: type, count: int, environ: Mapping[str, str]
) -> tuple[list[int], str | None]:
    """NVML indices in CUDA ordinal order: ``cuda:N`` is the N-th entry.

    Mirrors how the CUDA runtime reads ``CUDA_VISIBLE_DEVICES``: integer indices
    or ``GPU-`` UUID prefixes, and the list ends at the first entry that names
    no GPU, so the id ``cuda:0`` always means the card torch and vLLM would use.
    """
    raw = environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(count)), None
    uuids: list[str] | None = None
    chosen: list[int] = []
    stopped_at = None
    for token in (part.strip() for part in raw.split(",")):
        index = None
        if token.isdigit() and int(token) < count:
            index = int(token)
        elif token.startswith("GPU-"):
            if uuids is None:
                uuids = [_uuid(nvml, error, i) or "" for i in range(count)]
            matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(token)]
            index = matches[0] if len(matches) == 1 else None
        if index is None or index in chosen:
            stopped_at = token
            break
        chosen.append(index)
    note = None
    if stopped_at is not None or len(chosen) < count:
        note = (
            f"CUDA_VISIBLE_DEVICES={raw!r} makes {len(chosen)} of the {count} GPUs NVML sees "
            "visible to this process"
        )
        if stopped_at:
            note += f"; entry {stopped_at!r} names no GPU (MIG instances are not supported)"
    return chosen, note


def _uuid(nvml: Any, error: type, index: int) -> str | None:
    try:
        return _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index)))
    except (error, AttributeError):
        return None


def _runtime_reason() -> str | None:
    """None when a CUDA build of vLLM is installed here, else why not and what to do."""
    build, why = builds.vllm_build_for("cuda")
    if build is not None:
        return None
    installed = builds.vllm_builds()
    if not installed:
        return (
            f"{why}: pip install edge-cuda (pulls vllm, the CUDA build), or pip install vllm "
            "if edge-cuda was installed with --no-deps"
        )
    if any(b.platform == "cuda" for b in installed):
        return why  # two builds collide; the message already says keep one
    return f"{why}: pip install edge-cuda (pulls vllm, the CUDA build) in a separate venv"


def _device(
    nvml: Any, error: type, ordinal: int, index: int, driver: str | None, runtime_reason: str | None
) -> Device:
    device_id = f"cuda:{ordinal}"
    extras: dict[str, Any] = {"nvml_index": index, "driver_version": driver}
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(nvml.nvmlDeviceGetName(handle))
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except error as exc:
        # One unreadable card (lost from the bus, no permission) must not hide the others.
        return Device(
            device_id=device_id, kind="gpu_discrete", vendor="nvidia",
            name="NVIDIA GPU (unreadable)", backend=BACKEND, runnable=False,
            memory_pool="vram", memory_bytes=0, evidence={"found": "D"},
            reason=f"NVML could not read GPU {index} ({exc}); check nvidia-smi",
            extras=extras,
        )
    extras["uuid"] = _uuid(nvml, error, index)
    try:
        extras["pci_bus_id"] = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    except (error, AttributeError):
        extras["pci_bus_id"] = None
    sm = int(major) * 10 + int(minor)
    reason = runtime_reason
    build, _ = builds.vllm_build_for("cuda")
    if build is not None:
        extras["runtime"] = f"{build.distribution} {build.version}"
    # vLLM's executors split a session over several like cards (tensor / pipeline parallel).
    extras["parallel"] = "vllm"
    if sm < MIN_SM:
        reason = (
            f"{name} is sm_{sm}; vLLM's CUDA build needs SM >= {MIN_SM / 10:.1f}: "
            "use the CPU backend (pip install edge-core edge-cpu in a CPU venv)"
        )
    return Device(
        device_id=device_id,
        kind="gpu_discrete",
        vendor="nvidia",
        name=name,
        backend=BACKEND,
        runnable=reason is None,
        memory_pool="vram",
        memory_bytes=int(memory.total),
        memory_available_bytes=int(memory.free),
        compute_capability=f"sm_{sm}",
        weight_formats=formats_for(sm),
        evidence=_EVIDENCE,
        reason=reason,
        extras=extras,
    )
