"""Which hosts and devices are not this machine? The foreign ones a backend must answer for without raising."""

from __future__ import annotations

from ..devices import KINDS, Device
from ..host import HostFacts, NumaNode

#: The plugin name stamped on devices the backend did not report.
FOREIGN_PLUGIN = "conformance-foreign"

#: Each kind's memory pool: a discrete GPU has its own, every other kind shares the host's.
POOL_OF_KIND = {"cpu": "host_ram", "gpu_integrated": "host_ram", "npu": "host_ram", "gpu_discrete": "vram"}

_GIB = 1 << 30


def fake_hosts() -> dict[str, HostFacts]:
    """Hosts unlike the one the tests run on: the probe must answer for each without raising."""
    return {
        "bare-riscv": HostFacts(
            system="linux", mem_total_bytes=1 * _GIB, mem_available_bytes=_GIB // 2, cgroup_limit_bytes=None,
            cgroup_usage_bytes=None, logical_cores=1, physical_cores=1, cpu_model="", machine="riscv64",
        ),
        "windows-laptop": HostFacts(
            system="windows", mem_total_bytes=32 * _GIB, mem_available_bytes=20 * _GIB, cgroup_limit_bytes=None,
            cgroup_usage_bytes=None, logical_cores=24, physical_cores=12, cpu_model="AMD Ryzen AI 9 HX 370",
            machine="AMD64", isa_flags=("avx2", "avx512f", "avx512_bf16"),
        ),
        "wsl-two-sockets-cgroup": HostFacts(
            system="linux", mem_total_bytes=64 * _GIB, mem_available_bytes=60 * _GIB, cgroup_limit_bytes=4 * _GIB,
            cgroup_usage_bytes=_GIB, logical_cores=8, physical_cores=4, cpu_model="Intel(R) Xeon(R)",
            machine="x86_64", isa_flags=("avx2",), is_wsl=True,
            numa_nodes=(NumaNode(0, 32 * _GIB, 30 * _GIB, (0, 1, 2, 3)), NumaNode(1, 32 * _GIB, 30 * _GIB, (4, 5, 6, 7))),
        ),
    }



def foreign_devices() -> list[Device]:
    """One device of every kind, reported by a plugin that is not the one under test."""
    out = []
    for kind in KINDS:
        pool = POOL_OF_KIND[kind]
        out.append(Device(
            device_id=f"{kind}:conformance-foreign", kind=kind, vendor="foreign", name=f"foreign {kind}",
            backend="foreign:runtime", runnable=True, memory_pool=pool,
            memory_bytes=0 if kind in ("gpu_integrated", "npu") else 8 * _GIB,
            weight_formats=("dense", "onnx:fp16"), evidence={"found": "D"}, plugin=FOREIGN_PLUGIN,
        ))
    return out
