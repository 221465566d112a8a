"""What the host machine offers: RAM, cgroup limit, NUMA nodes, CPU model and ISA, and the cores this process may use.

Everything is read from ``/proc`` and ``/sys`` under a root directory that tests
replace with a fake tree. No subprocess is started and nothing heavy is
imported; on a platform without ``/proc`` the figures come from psutil.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: ISA flags the planner and backends care about, in the order they are shown.
INTERESTING_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp8",
    "asimd", "sve",
)

#: cgroup v1 reports "no limit" as a huge page-aligned number; anything above this is unlimited.
_CGROUP_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class NumaNode:
    """One NUMA node as vLLM's CPU backend measures it.

    ``reclaimable_bytes`` is MemFree + Active(file) + Inactive(file) + SReclaimable
    from the node's own meminfo: the figure vLLM's CPU worker checks its KV pool
    against when it binds to this node (docs/vllm-cpu-facts.md, 'The NUMA node on a VM').
    """

    node_id: int
    total_bytes: int
    reclaimable_bytes: int
    cpus: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "total_bytes": self.total_bytes,
            "reclaimable_bytes": self.reclaimable_bytes,
            "cpus": list(self.cpus),
        }


@dataclass(frozen=True)
class HostFacts:
    """The host as this process sees it. All sizes in bytes."""

    system: str
    mem_total_bytes: int
    mem_available_bytes: int
    #: The memory limit that binds this process: the least room over its cgroup and every ancestor's
    #: (:func:`read_cgroup_memory`), or None when there is none.
    cgroup_limit_bytes: int | None
    #: Bytes that cgroup already holds and the kernel cannot reclaim (usage less file pages), so
    #: available = limit - this.
    cgroup_usage_bytes: int | None
    logical_cores: int
    physical_cores: int
    cpu_model: str
    machine: str
    isa_flags: tuple[str, ...] = ()
    numa_nodes: tuple[NumaNode, ...] = ()
    is_wsl: bool = False
    extras: dict[str, Any] = field(default_factory=dict)
    #: The host's name (a multi-host plan labels each device list's devices with it; Ray's head address).
    hostname: str = ""
    #: The CPUs this process may run on (its affinity mask, ``Cpus_allowed_list``); empty when unknown.
    allowed_cpus: tuple[int, ...] = ()
    #: The cgroup's CPU quota in cores (``cpu.max`` quota / period), or None when there is none.
    cpu_quota_cores: float | None = None
    #: The cgroup whose limit is ``cgroup_limit_bytes`` (``v1:/path`` or ``v2:/path``), or None.
    cgroup_memory_path: str | None = None

    @property
    def usable_cpus(self) -> tuple[int, ...]:
        """The CPUs this process may run on: the affinity mask, else every CPU of the host."""
        if self.allowed_cpus:
            return self.allowed_cpus
        on_nodes = sorted({c for n in self.numa_nodes for c in n.cpus})
        return tuple(on_nodes) or tuple(range(self.logical_cores))

    @property
    def usable_cores(self) -> int:
        """How many CPUs this process can keep busy at once: its allowed CPUs, capped by the cgroup quota."""
        count = len(self.usable_cpus)
        if self.cpu_quota_cores is not None:
            count = min(count, max(int(self.cpu_quota_cores), 1))
        return count

    def allowed_nodes(self) -> tuple[NumaNode, ...]:
        """The NUMA nodes holding an allowed CPU, each with only its allowed CPUs (vLLM binds ranks by these)."""
        allowed = set(self.usable_cpus)
        out = []
        for node in self.numa_nodes:
            cpus = tuple(c for c in node.cpus if c in allowed)
            if cpus:
                out.append(NumaNode(node.node_id, node.total_bytes, node.reclaimable_bytes, cpus))
        return tuple(out)

    @property
    def usable_bytes(self) -> int:
        """Host RAM available to this process: MemAvailable clamped by the cgroup limit."""
        usable = self.mem_available_bytes
        if self.cgroup_limit_bytes is not None:
            headroom = self.cgroup_limit_bytes - (self.cgroup_usage_bytes or 0)
            usable = min(usable, max(headroom, 0))
        return usable

    @property
    def capacity_bytes(self) -> int:
        """Host RAM total as this process may use it: MemTotal clamped by the cgroup limit."""
        if self.cgroup_limit_bytes is not None:
            return min(self.mem_total_bytes, self.cgroup_limit_bytes)
        return self.mem_total_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "system": self.system,
            "machine": self.machine,
            "mem_total_bytes": self.mem_total_bytes,
            "mem_available_bytes": self.mem_available_bytes,
            "cgroup_limit_bytes": self.cgroup_limit_bytes,
            "cgroup_usage_bytes": self.cgroup_usage_bytes,
            "cgroup_memory_path": self.cgroup_memory_path,
            "usable_bytes": self.usable_bytes,
            "logical_cores": self.logical_cores,
            "physical_cores": self.physical_cores,
            "cpu_model": self.cpu_model,
            "isa_flags": list(self.isa_flags),
            "numa_nodes": [node.to_dict() for node in self.numa_nodes],
            "is_wsl": self.is_wsl,
            "hostname": self.hostname,
            "allowed_cpus": list(self.allowed_cpus),
            "cpu_quota_cores": self.cpu_quota_cores,
            "usable_cores": self.usable_cores,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HostFacts:
        """Rebuild from ``to_dict`` output (a device list captured elsewhere).

        ``data`` is trusted to have the documented types: a device list's host
        section is checked field by field on load
        (:data:`edge_core.devices.HOST_SECTION_FIELDS`, which a test keeps
        equal to what this reads), where the file can be named.
        """
        nodes = tuple(
            NumaNode(
                node_id=int(n["node_id"]),
                total_bytes=int(n["total_bytes"]),
                reclaimable_bytes=int(n["reclaimable_bytes"]),
                cpus=tuple(n.get("cpus") or ()),
            )
            for n in data.get("numa_nodes") or ()
        )
        return cls(
            system=str(data.get("system", "unknown")),
            machine=str(data.get("machine", "unknown")),
            mem_total_bytes=int(data.get("mem_total_bytes", 0)),
            mem_available_bytes=int(data.get("mem_available_bytes", 0)),
            cgroup_limit_bytes=data.get("cgroup_limit_bytes"),
            cgroup_usage_bytes=data.get("cgroup_usage_bytes"),
            cgroup_memory_path=data.get("cgroup_memory_path"),
            logical_cores=int(data.get("logical_cores", 0)),
            physical_cores=int(data.get("physical_cores", 0)),
            cpu_model=str(data.get("cpu_model", "")),
            isa_flags=tuple(data.get("isa_flags") or ()),
            numa_nodes=nodes,
            is_wsl=bool(data.get("is_wsl", False)),
            hostname=str(data.get("hostname") or ""),
            allowed_cpus=tuple(data.get("allowed_cpus") or ()),
            cpu_quota_cores=(float(data["cpu_quota_cores"]) if data.get("cpu_quota_cores") is not None else None),
        )


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def parse_meminfo(text: str) -> dict[str, int]:
    """Parse ``/proc/meminfo`` or a node's ``meminfo`` into bytes per key.

    Node files prefix each line with ``Node 0``; both shapes are accepted.
    """
    out: dict[str, int] = {}
    for line in text.splitlines():
        match = re.match(r"^(?:Node\s+\d+\s+)?([\w()]+):\s+(\d+)(?:\s+kB)?", line.strip())
        if match:
            key, value = match.group(1), int(match.group(2))
            out[key] = value * 1024 if line.rstrip().endswith("kB") else value
    return out


def _parse_cpulist(text: str) -> tuple[int, ...]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return tuple(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """CPUs in the kernel's list form (``0-3,8``): what ``taskset -c`` and ``VLLM_CPU_OMP_THREADS_BIND`` read."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


def read_numa_nodes(root: Path) -> tuple[NumaNode, ...]:
    base = root / "sys/devices/system/node"
    nodes = []
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return ()
    for entry in entries:
        match = re.fullmatch(r"node(\d+)", entry.name)
        if not match:
            continue
        info = parse_meminfo(_read(entry / "meminfo") or "")
        reclaimable = sum(
            info.get(key, 0) for key in ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
        )
        cpulist = _read(entry / "cpulist") or ""
        try:
            cpus = _parse_cpulist(cpulist)
        except ValueError:
            cpus = ()
        nodes.append(
            NumaNode(
                node_id=int(match.group(1)),
                total_bytes=info.get("MemTotal", 0),
                reclaimable_bytes=reclaimable,
                cpus=cpus,
            )
        )
    return tuple(sorted(nodes, key=lambda n: n.node_id))


@dataclass(frozen=True)
class CgroupMemory:
    """The memory limit that binds this process, read from its own cgroup and every ancestor's.

    ``limit_bytes`` is the limit of the level with the least room left
    (limit less what is held there), ``held_bytes`` what that level already
    holds that the kernel cannot reclaim (usage less its file pages: anonymous
    memory, shmem, kernel memory), ``path`` the cgroup it belongs to (as the
    process's own cgroup line names it, with ``v1:`` or ``v2:``). All None
    without a limit anywhere.
    """

    limit_bytes: int | None = None
    held_bytes: int | None = None
    path: str | None = None


def read_cgroup_memory(root: Path) -> CgroupMemory:
    """The binding memory limit of this process's cgroup (v2 and v1), or an empty :class:`CgroupMemory`.

    The process's own cgroup comes from ``/proc/self/cgroup`` (v2: the ``0::``
    line; v1: the line naming the ``memory`` controller), found under the
    hierarchy's mount (``/proc/self/mountinfo``; else ``/sys/fs/cgroup`` for
    v2, ``/sys/fs/cgroup/memory`` for v1). Every level from it up to the
    mount that has a limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``)
    counts, and v1's ``hierarchical_memory_limit`` (memory.stat) catches an
    ancestor above the mount. Each level's room is its limit less what it
    holds and cannot reclaim: usage (``memory.current`` / ``memory.usage_in_bytes``)
    less its file pages (``active_file`` + ``inactive_file``; v1's hierarchical
    ``total_`` counters), which the kernel drops before it OOM-kills. The level
    with the least room binds.
    """
    own = _own_cgroups(root)
    mounts = _cgroup_mounts(root)
    levels: list[tuple[int, int, str]] = []  # (limit, held, path)
    v2 = own.get("v2")
    if v2 is not None and mounts.get("v2") is not None:
        mount, mount_root = mounts["v2"]
        for directory, path in _levels(mount, mount_root, v2):
            raw = (_read(directory / "memory.max") or "").strip()
            if raw.isdigit():
                levels.append((int(raw), _held(directory, "memory.current", ""), f"v2:{path}"))
    v1 = own.get("v1")
    if v1 is not None and mounts.get("v1") is not None:
        mount, mount_root = mounts["v1"]
        walked = list(_levels(mount, mount_root, v1))
        for directory, path in walked:
            raw = (_read(directory / "memory.limit_in_bytes") or "").strip()
            if raw.isdigit() and int(raw) < _CGROUP_UNLIMITED:
                levels.append((int(raw), _held(directory, "memory.usage_in_bytes", "total_"), f"v1:{path}"))
        if walked:
            leaf, path = walked[0]
            hierarchical = _stat(leaf).get("hierarchical_memory_limit")
            if hierarchical is not None and hierarchical < min((lim for lim, _, _ in levels), default=_CGROUP_UNLIMITED):
                levels.append((hierarchical, _held(leaf, "memory.usage_in_bytes", "total_"),
                               f"v1:{path} (hierarchical_memory_limit: an ancestor's)"))
    if not levels:
        return CgroupMemory()
    limit, held, path = min(levels, key=lambda level: (level[0] - level[1], level[0]))
    return CgroupMemory(limit, held, path)


def _stat(directory: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (_read(directory / "memory.stat") or "").splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value.strip())
    return out


def _held(directory: Path, usage_file: str, prefix: str) -> int:
    """What a cgroup holds and cannot reclaim: its usage less its file pages (never below zero)."""
    usage = (_read(directory / usage_file) or "").strip()
    stat = _stat(directory)
    files = stat.get(f"{prefix}active_file", 0) + stat.get(f"{prefix}inactive_file", 0)
    return max(int(usage) - files, 0) if usage.isdigit() else 0


def _own_cgroups(root: Path) -> dict[str, str]:
    """This process's cgroup paths: ``v2`` (the ``0::`` line) and ``v1`` (the line naming ``memory``)."""
    out: dict[str, str] = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            out["v2"] = path.strip() or "/"
        elif "memory" in controllers.split(","):
            out["v1"] = path.strip() or "/"
    return out


def _cgroup_mounts(root: Path) -> dict[str, tuple[Path, str]]:
    """Where the v2 hierarchy and v1's memory hierarchy are mounted, with the cgroup each mount shows as its root."""
    out: dict[str, tuple[Path, str]] = {}
    text = _read(root / "proc/self/mountinfo")
    for line in (text or "").splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount = root / fields[4].lstrip("/")
        if tail[0] == "cgroup2" and "v2" not in out:
            out["v2"] = (mount, fields[3])
        elif tail[0] == "cgroup" and "memory" in tail[2].split(",") and "v1" not in out:
            out["v1"] = (mount, fields[3])
    if text is None:  # no mount table (a tree written by a test, or not Linux): the usual places
        base = root / "sys/fs/cgroup"
        out["v2"] = (base / "unified" if (base / "unified").is_dir() else base, "/")
        out["v1"] = (base / "memory", "/")
    return out


def _levels(mount: Path, mount_root: str, path: str) -> list[tuple[Path, str]]:
    """The process's cgroup directory and each ancestor's under ``mount``, leaf first, each with its cgroup path."""
    rel = path
    prefix = mount_root.rstrip("/")
    if prefix and (rel == prefix or rel.startswith(prefix + "/")):
        rel = rel[len(prefix):]  # the mount shows a subtree (a cgroup namespace or a container's view)
    parts = [part for part in rel.split("/") if part and part != ".."]
    out = []
    for depth in range(len(parts), -1, -1):
        directory = mount.joinpath(*parts[:depth])
        if not directory.is_dir():
            continue
        out.append((directory, prefix + "/" + "/".join(parts[:depth]) if depth else (prefix or "/")))
    return out


def _cgroup_dirs(root: Path) -> list[Path]:
    cgroup_text = _read(root / "proc/self/cgroup") or ""
    rel = ""
    for line in cgroup_text.splitlines():
        if line.startswith("0::"):
            rel = line[3:].strip().lstrip("/")
    return [root / "sys/fs/cgroup" / rel, root / "sys/fs/cgroup"] if rel else [root / "sys/fs/cgroup"]


def read_cgroup_cpu_quota(root: Path) -> float | None:
    """This process's cgroup CPU quota in cores (v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``), or None."""
    for directory in _cgroup_dirs(root):
        raw = _read(directory / "cpu.max")
        if raw is not None:
            parts = raw.split()
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit() and int(parts[1]) > 0:
                return int(parts[0]) / int(parts[1])
            return None
    quota = (_read(root / "sys/fs/cgroup/cpu/cpu.cfs_quota_us") or "").strip()
    period = (_read(root / "sys/fs/cgroup/cpu/cpu.cfs_period_us") or "").strip()
    if quota.isdigit() and period.isdigit() and int(period) > 0:  # "-1" (no quota) is not digits
        return int(quota) / int(period)
    return None


def read_allowed_cpus(root: Path) -> tuple[int, ...]:
    """The CPUs this process may run on: ``Cpus_allowed_list`` of ``/proc/self/status`` (what taskset sets).

    On the real root without that file, ``os.sched_getaffinity``; empty when neither answers.
    """
    for line in (_read(root / "proc/self/status") or "").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            try:
                return _parse_cpulist(line.partition(":")[2])
            except ValueError:
                return ()
    if str(root) == "/" and hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return ()


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...], int, int]:
    """Return (model name, interesting flags, logical cores, physical cores) from /proc/cpuinfo."""
    model = ""
    flags: set[str] = set()
    logical = 0
    cores: set[tuple[str, str]] = set()
    physical_id = core_id = ""
    for line in text.splitlines():
        if ":" not in line:
            if physical_id or core_id:
                cores.add((physical_id, core_id))
            physical_id = core_id = ""
            continue
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "processor":
            logical += 1
        elif key in ("model name", "Model", "cpu model") and not model:
            model = value
        elif key in ("flags", "Features"):
            flags.update(value.split())
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            core_id = value
    if physical_id or core_id:
        cores.add((physical_id, core_id))
    ordered = tuple(flag for flag in INTERESTING_FLAGS if flag in flags)
    return model, ordered, logical, len(cores) or logical


def read_host(root: str | os.PathLike[str] = "/") -> HostFacts:
    """Read the host's facts under ``root`` (``/`` in production, a fake tree in tests)."""
    base = Path(root)
    meminfo_text = _read(base / "proc/meminfo")
    cpuinfo_text = _read(base / "proc/cpuinfo")
    if meminfo_text is not None:
        meminfo = parse_meminfo(meminfo_text)
        total = meminfo.get("MemTotal", 0)
        available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    else:  # not Linux: psutil answers cheaply on every OS
        import psutil

        virtual = psutil.virtual_memory()
        total, available = int(virtual.total), int(virtual.available)
    if cpuinfo_text is not None:
        model, flags, logical, physical = parse_cpuinfo(cpuinfo_text)
    else:
        import platform

        import psutil

        model, flags = platform.processor(), ()
        logical = psutil.cpu_count(logical=True) or 0
        physical = psutil.cpu_count(logical=False) or logical
    cgroup = read_cgroup_memory(base)
    osrelease = (_read(base / "proc/sys/kernel/osrelease") or "").lower()
    is_wsl = "microsoft" in osrelease or "wsl" in osrelease
    system, machine, node = _uname()
    return HostFacts(
        system=system.lower() if str(root) == "/" else "linux",
        machine=machine or "unknown",
        mem_total_bytes=total,
        mem_available_bytes=available,
        cgroup_limit_bytes=cgroup.limit_bytes,
        cgroup_usage_bytes=cgroup.held_bytes,
        cgroup_memory_path=cgroup.path,
        logical_cores=logical,
        physical_cores=physical,
        cpu_model=model,
        isa_flags=flags,
        numa_nodes=read_numa_nodes(base),
        is_wsl=is_wsl,
        hostname=(node if str(root) == "/" else (_read(base / "proc/sys/kernel/hostname") or "").strip()),
        allowed_cpus=read_allowed_cpus(base),
        cpu_quota_cores=read_cgroup_cpu_quota(base),
    )


def _uname() -> tuple[str, str, str]:
    """This machine's (system, machine, node name): ``os.uname`` where the OS has one, ``platform`` elsewhere.

    ``platform`` answers the same from the same call on POSIX, but importing it costs every command ~2 ms.
    """
    if hasattr(os, "uname"):
        name = os.uname()
        return name.sysname, name.machine, name.nodename
    import platform

    return platform.system(), platform.machine(), platform.node()
