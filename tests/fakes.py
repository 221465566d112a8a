"""Fakes injected at edge's boundaries: a /proc + /sys tree, entry points, plugin modules."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1 << 30


def _kb(value: int) -> int:
    return value // 1024


def write_host_tree(
    root: Path,
    *,
    mem_total: int = 32 * GIB,
    mem_available: int = 28 * GIB,
    nodes: list[dict[str, int]] | None = None,
    cgroup_v2_limit: int | str | None = None,
    cgroup_v2_usage: int = 0,
    cpu_model: str = "AMD Ryzen AI 9 HX 370",
    flags: str = "fpu sse4_2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_bf16",
    cores: int = 4,
    osrelease: str = "6.8.0-generic",
    allowed_cpus: str | None = None,
    cpu_max: str | None = None,
) -> Path:
    """Write the files edge reads under a fake root.

    ``nodes`` is a list of {"total", "free", "active_file", "inactive_file",
    "sreclaimable", "first_cpu", "cpus"} per NUMA node. ``allowed_cpus`` is the
    affinity mask as ``/proc/self/status`` lists it ("0-3,6"), ``cpu_max`` the
    cgroup's ``cpu.max`` ("150000 100000").
    """
    proc = root / "proc"
    (proc / "sys/kernel").mkdir(parents=True, exist_ok=True)
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "meminfo").write_text(
        f"MemTotal:       {_kb(mem_total)} kB\nMemFree:        {_kb(mem_available) // 2} kB\n"
        f"MemAvailable:   {_kb(mem_available)} kB\n"
    )
    blocks = []
    for cpu in range(cores):
        blocks.append(
            f"processor\t: {cpu}\nvendor_id\t: AuthenticAMD\nmodel name\t: {cpu_model}\n"
            f"physical id\t: 0\ncore id\t\t: {cpu}\nflags\t\t: {flags}\n"
        )
    (proc / "cpuinfo").write_text("\n".join(blocks) + "\n")
    (proc / "sys/kernel/osrelease").write_text(osrelease + "\n")
    (proc / "self/cgroup").write_text("0::/\n")
    if allowed_cpus is not None:
        (proc / "self/status").write_text(f"Name:\tpython\nCpus_allowed:\tff\nCpus_allowed_list:\t{allowed_cpus}\n")
    cgroup = root / "sys/fs/cgroup"
    cgroup.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (cgroup / "cpu.max").write_text(f"{cpu_max}\n")
    if cgroup_v2_limit is not None:
        (cgroup / "memory.max").write_text(f"{cgroup_v2_limit}\n")
        (cgroup / "memory.current").write_text(f"{cgroup_v2_usage}\n")
    node_base = root / "sys/devices/system/node"
    node_base.mkdir(parents=True, exist_ok=True)
    next_cpu = 0
    for index, node in enumerate(nodes or []):
        directory = node_base / f"node{index}"
        directory.mkdir()
        lines = [
            ("MemTotal", node["total"]), ("MemFree", node["free"]), ("MemUsed", node["total"] - node["free"]),
            ("Active(file)", node.get("active_file", 0)), ("Inactive(file)", node.get("inactive_file", 0)),
            ("SReclaimable", node.get("sreclaimable", 0)),
        ]
        (directory / "meminfo").write_text(
            "".join(f"Node {index} {key}:{_kb(value):>16} kB\n" for key, value in lines)
        )
        count = node.get("cpus", cores // max(len(nodes or [1]), 1))
        (directory / "cpulist").write_text(f"{next_cpu}-{next_cpu + count - 1}\n")
        next_cpu += count
    return root


#: What cgroup v1 reads as "no limit" (a page-aligned 2**63 - 1, as this project's VMs show it).
V1_UNLIMITED = 9223372036854771712


def write_cgroup_tree(root: Path, version: int, own: str, levels: dict[str, dict[str, int | str]], *,
                      mount_root: str = "/", mountinfo: bool = True, hierarchical: int | None = None) -> Path:
    """A memory cgroup hierarchy under ``root`` as the kernel shows it: this process in ``own``.

    ``levels`` maps each cgroup path (``/``, ``/a``, ``/a/b``) to ``{"limit", "usage", "file"}``: the limit
    (v2: an int or ``"max"``; v1: an int, :data:`V1_UNLIMITED` for none), what it holds and of that how much
    is file pages (split evenly between active and inactive). v1 is mounted at ``sys/fs/cgroup/memory``, v2 at
    ``sys/fs/cgroup``; ``mount_root`` is the cgroup the mount shows as its root (a container's view), and
    ``hierarchical`` v1's ``hierarchical_memory_limit`` in the process's own cgroup.
    """
    proc = root / "proc/self"
    proc.mkdir(parents=True, exist_ok=True)
    mount = root / ("sys/fs/cgroup/memory" if version == 1 else "sys/fs/cgroup")
    lines = ["4:memory:" + own, "0::/"] if version == 1 else ["0::" + own]
    (proc / "cgroup").write_text("\n".join(lines) + "\n")
    if mountinfo:
        kind = "cgroup cgroup rw,memory" if version == 1 else "cgroup2 cgroup2 rw"
        (proc / "mountinfo").write_text(
            f"25 1 0:23 / / rw,relatime - ext4 /dev/root rw\n"
            f"35 25 0:32 {mount_root} /{mount.relative_to(root)} rw,relatime - {kind}\n")
    prefix = mount_root.rstrip("/")
    for path, level in levels.items():
        directory = mount / path.removeprefix(prefix).lstrip("/")
        directory.mkdir(parents=True, exist_ok=True)
        file_pages = int(level.get("file", 0))
        half = file_pages // 2
        if version == 1:
            (directory / "memory.limit_in_bytes").write_text(f"{level.get('limit', V1_UNLIMITED)}\n")
            (directory / "memory.usage_in_bytes").write_text(f"{level.get('usage', 0)}\n")
            stat = (f"cache {file_pages}\nrss {int(level.get('usage', 0)) - file_pages}\n"
                    f"total_active_file {half}\ntotal_inactive_file {file_pages - half}\n")
            if path == own and hierarchical is not None:
                stat += f"hierarchical_memory_limit {hierarchical}\n"
            (directory / "memory.stat").write_text(stat)
        elif path != "/":  # the v2 root has no memory.max
            (directory / "memory.max").write_text(f"{level.get('limit', 'max')}\n")
            (directory / "memory.current").write_text(f"{level.get('usage', 0)}\n")
            (directory / "memory.stat").write_text(
                f"anon {int(level.get('usage', 0)) - file_pages}\nfile {file_pages}\nactive_file {half}\n"
                f"inactive_file {file_pages - half}\n")
    return root


@dataclass
class FakeDist:
    name: str
    version: str = "0.0.1"

    @property
    def metadata(self) -> dict[str, str]:
        """What importlib.metadata's ``Distribution.metadata`` gives: the METADATA file's fields."""
        return {"Name": self.name, "Version": self.version}


class FakeEntryPoint:
    """Stands in for an importlib.metadata entry point; ``load`` runs the given loader."""

    def __init__(self, name: str, loader: Callable[[], Any], dist: str | None = None, value: str | None = None):
        self.name = name
        self.value = value or f"fake_{name}"
        self.dist = FakeDist(dist or f"edge-{name}")
        self._loader = loader
        self.loads = 0

    def load(self) -> Any:
        self.loads += 1
        return self._loader()


def plugin_module(name: str, api_version: Any = 1, **functions: Callable[..., Any]) -> types.ModuleType:
    """A throwaway plugin module whose hookimpls are the given functions."""
    from edge_core import hookimpl

    module = types.ModuleType(name)
    if api_version is not None:
        module.EDGE_API_VERSION = api_version
    for hook, function in functions.items():
        function.__name__ = hook
        setattr(module, hook, hookimpl(function))
    return module
