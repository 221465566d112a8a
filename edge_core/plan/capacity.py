"""How many bytes admission may take on a device's pool, and how that figure was read.

One meaning everywhere: **capacity** is what the plan's admission bytes are
checked against — the VRAM *total* for a private pool (the session fills the
card), the *usable* host RAM for the shared pool (MemAvailable, clamped by the
room left under the memory limit that binds the process: its own cgroup's or an
ancestor's, :func:`edge_core.host.read_cgroup_memory`). With no host facts (a device list from another
machine), the CPU row of the list carries the host pool.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..devices import Device
    from ..host import HostFacts


def capacity_of(device: Device, host: HostFacts | None, devices: Iterable[Device] = ()) -> tuple[int | None, str]:
    """``(capacity_bytes, how it was read)`` for ``device``'s pool; None when nothing says."""
    if device.memory_pool == "vram":
        return device.memory_bytes, f"{device.device_id} VRAM total"
    if host is not None:
        how = "host RAM available"
        if host.cgroup_limit_bytes is not None and host.usable_bytes < host.mem_available_bytes:
            how += (f", clamped by the cgroup memory limit {host.cgroup_limit_bytes / 2**20:,.0f} MiB of "
                    f"{host.cgroup_memory_path or 'this process'}"
                    + (f" ({host.cgroup_usage_bytes / 2**20:,.0f} MiB already held there)"
                       if host.cgroup_usage_bytes else ""))
        return host.usable_bytes, how
    for row in (device, *devices):
        if row.kind == "cpu" and row.memory_pool == "host_ram" and row.memory_bytes:
            if row.memory_available_bytes is not None:
                return row.memory_available_bytes, f"host RAM available as the {row.device_id} row recorded it"
            return row.memory_bytes, f"host RAM total as the {row.device_id} row recorded it"
    return None, "unknown"
