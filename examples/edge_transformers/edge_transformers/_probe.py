"""Can this interpreter run a checkpoint with transformers on the CPU? Decided from installed metadata only.

``import torch`` costs seconds; ``edge devices`` must answer in a fraction of
that, so the probe reads ``*.dist-info`` and the host facts the core gathered.
"""

from __future__ import annotations

import importlib.metadata as metadata

from edge_core import Device, HostFacts

#: ``cpu`` is edge-cpu's id; this backend's view of the same CPU is ``cpu:hf``.
DEVICE_ID = "cpu:hf"
BACKEND = "transformers:cpu"
#: Plain safetensors checkpoints; quantized formats need kernels this path does not bring.
FORMATS = ("dense",)
#: The distributions a stage imports.
REQUIRED = ("transformers", "torch")


def installed_version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _vendor(model: str) -> str:
    lowered = model.lower()
    for needle, vendor in (("amd", "amd"), ("intel", "intel"), ("apple", "apple"), ("arm", "arm")):
        if needle in lowered:
            return vendor
    return "unknown"


def probe(host: HostFacts) -> list[Device]:
    versions = {name: installed_version(name) for name in REQUIRED}
    missing = [name for name, version in versions.items() if version is None]
    reason = None
    if missing:
        reason = (
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed in this interpreter; "
            "`pip install edge-transformers` brings both (pin a CPU build of torch first)"
        )
    extras = {"logical_cores": host.logical_cores, "physical_cores": host.physical_cores}
    if not missing:
        extras["runtime"] = f"transformers {versions['transformers']}, torch {versions['torch']}"
    return [
        Device(
            device_id=DEVICE_ID,
            kind="cpu",
            vendor=_vendor(host.cpu_model),
            name=host.cpu_model or host.machine,
            backend=None if missing else BACKEND,
            runnable=not missing,
            memory_pool="host_ram",
            memory_bytes=host.capacity_bytes,
            memory_available_bytes=host.usable_bytes,
            weight_formats=FORMATS,
            evidence={"found": "D", "runnable": "D", "memory_bytes": "D", "weight_formats": "D"},
            reason=reason,
            extras=extras,
        )
    ]


def verify(device: Device) -> Device:
    """Import torch and run one small bf16 matmul: evidence B, or the reason it failed."""
    try:
        import torch

        a = torch.ones((64, 64), dtype=torch.bfloat16)
        result = float((a @ a)[0, 0])
        if result != 64.0:
            raise RuntimeError(f"a 64x64 bf16 matmul returned {result}, expected 64")
    except Exception as exc:  # installed but broken: a status, not a crash
        return device.replace(runnable=False, backend=None, reason=f"verification failed: {type(exc).__name__}: {exc}",
                              evidence={**device.evidence, "runnable": "B"})
    extras = {**device.extras, "verified": f"torch {torch.__version__} bf16 matmul"}
    return device.replace(evidence={**device.evidence, "runnable": "B"}, extras=extras)
