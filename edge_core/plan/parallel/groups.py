"""Which devices may form one parallel group, and which layouts to try on it, in what order."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...layout import EXECUTOR_MP, Layout
from ...plans import STAGE_ONLY_KINDS, Refusal

if TYPE_CHECKING:
    from ...devices import Device
    from ...host import HostFacts


def group_key(device: Device) -> tuple[Any, ...]:
    """Devices that may form one parallel group share this key: backend, kind, model and memory.

    The runtime build is one per interpreter, so it can only differ between
    hosts; :func:`host_refusals` checks it there and names both builds.
    """
    return (device.plugin, device.backend, device.kind, device.name, device.memory_bytes,
            device.compute_capability)


def host_of(device: Device) -> str:
    """The host label a device list gave this device (``extras["host"]``), or ``local``."""
    extras = device.extras if isinstance(device.extras, dict) else {}
    return str(extras.get("host") or "local")


def mixed_group_refusal(devices: list[Device]) -> Refusal | None:
    """``parallel_layout_invalid`` when pinned devices differ in model, memory, backend or runtime build."""
    keys = {group_key(d) for d in devices}
    if len(keys) <= 1:
        return None
    rows = "; ".join(f"{d.device_id}: {d.name}, {d.memory_bytes / 2**30:.0f} GiB, "
                     f"{(d.extras or {}).get('runtime') or d.backend}" for d in devices)
    return Refusal(code="parallel_layout_invalid", device_id=devices[0].device_id,
                   message=f"the devices of one parallel group must be alike (vLLM gives every rank the same "
                           f"share and the same KV pool); these differ: {rows}",
                   remedy="pick devices of one model and memory size with --device-ids, and the same runtime "
                          "build on every host",
                   details={"dimension": "devices", "devices": [d.device_id for d in devices]})


def candidate_layouts(per_host: list[int], tp: int | None = None, pp: int | None = None,
                      executor: str = EXECUTOR_MP) -> list[Layout]:
    """Layouts to try: one host before several, TP before PP, then fewest devices.

    ``per_host`` is how many like devices each host has, largest first. On
    one host every tensor-parallel size is tried (smallest first) before any
    pipeline stage: TP splits every rank's KV pool and weights alike and keeps
    all ranks busy, PP within a host only helps where TP cannot divide the
    model. Across hosts TP stays within a host (its all-reduce runs every
    layer) and each host runs whole pipeline stages; a layout one host could
    run alone is never spread over two. A pinned ``tp``/``pp`` keeps only
    layouts of that size; every layout runs on ``executor``.
    """
    if not per_host:
        return []
    most = per_host[0]
    found = [Layout(t, p) for t in range(1, most + 1) for p in range(1, most // t + 1) if t * p > 1]
    for hosts in range(2, len(per_host) + 1):
        each = per_host[hosts - 1]  # the smallest of the hosts used
        found += [Layout(t, q * hosts, hosts) for t in range(1, each + 1) for q in range(1, each // t + 1)
                  if t * q * hosts > most]
    found = [replace(l, executor=executor) for l in found if (tp is None or l.tp == tp) and (pp is None or l.pp == pp)]
    return sorted(found, key=lambda l: (l.hosts, l.pp, l.world_size))


def groupable(device: Device) -> bool:
    """True when the device's backend runs vLLM's parallel executors (it says so in ``extras["parallel"]``)."""
    extras = device.extras if isinstance(device.extras, dict) else {}
    return (device.runnable and not device.masked and device.kind not in STAGE_ONLY_KINDS
            and extras.get("parallel") == "vllm")


def like_groups(devices: list[Device]) -> list[dict[str, list[Device]]]:
    """Like devices by host (hosts with most devices first), groups with private pools first, then larger."""
    by_key: dict[tuple[Any, ...], dict[str, list[Device]]] = {}
    for device in sorted(devices, key=lambda d: (host_of(d), d.device_id)):
        if groupable(device):
            by_key.setdefault(group_key(device), {}).setdefault(host_of(device), []).append(device)
    groups = [dict(sorted(hosts.items(), key=lambda kv: (-len(kv[1]), kv[0]))) for hosts in by_key.values()]
    return sorted(groups, key=lambda g: (next(iter(g.values()))[0].memory_pool != "vram",
                                         -next(iter(g.values()))[0].memory_bytes))


def rank_capacity(group: Mapping[str, list[Device]], facts: Mapping[str, HostFacts | None]) -> int | None:
    """How many ranks a group of like devices can host: one per device, or on vLLM CPU one per usable core.

    None when a CPU host's facts are unknown (nothing to cap by).
    """
    first = next(iter(group.values()))[0]
    if first.kind != "cpu":
        return sum(len(v) for v in group.values())
    total = 0
    for host in group:
        known = facts.get(host)
        if known is None:
            return None
        total += known.usable_cores
    return total
