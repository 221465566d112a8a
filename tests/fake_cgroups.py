"""Fake roots for the memory cgroup and the kernel log: ``proc/self/cgroup``, ``proc/self/mountinfo`` and the
files of cgroup v1's memory controller or v2, and ``/dev/kmsg`` records (tests/test_deaths.py, tests/test_reaper.py).

Every figure a test expects is one it wrote here, not one the code under test computed.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

MIB = 1 << 20
UNLIMITED_V1 = 9223372036854771712


def mib(value: int) -> str:
    return f"{value / MIB:,.0f} MiB"


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v1_root(root: Path, *, own: str = "/process_api/abc/edge", limit: int | None = 1536 * MIB,
            parent_limit: int | None = None, oom_kill: int = 0, under_oom: int = 0, failcnt: int = 0,
            usage: int = 700 * MIB, mount_root: str = "/", mountinfo: bool = True) -> Path:
    """A cgroup v1 host: memory controller at /sys/fs/cgroup/memory, this process in ``own``."""
    write(root / "proc/self/cgroup", f"9:name=systemd:/\n4:memory:{own}\n3:cpuset:/\n0::/\n")
    if mountinfo:
        write(root / "proc/self/mountinfo",
              f"35 31 0:32 {mount_root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
              "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
    relative = own[len(mount_root.rstrip("/")):] if mount_root != "/" else own
    base = root / "sys/fs/cgroup/memory"
    own_dir = base / relative.strip("/")
    parent_dir = own_dir.parent
    write(own_dir / "memory.limit_in_bytes", f"{limit if limit is not None else UNLIMITED_V1}\n")
    write(parent_dir / "memory.limit_in_bytes", f"{parent_limit if parent_limit is not None else UNLIMITED_V1}\n")
    write(base / "memory.limit_in_bytes", f"{UNLIMITED_V1}\n")
    write(own_dir / "memory.oom_control", f"oom_kill_disable 0\nunder_oom {under_oom}\noom_kill {oom_kill}\n")
    write(own_dir / "memory.failcnt", f"{failcnt}\n")
    write(own_dir / "memory.usage_in_bytes", f"{usage}\n")
    write(own_dir / "memory.max_usage_in_bytes", f"{usage + 10 * MIB}\n")
    # The unified hierarchy without the memory controller, as on this project's VM.
    write(root / "sys/fs/cgroup/unified/cgroup.controllers", "")
    return root


def v2_root(root: Path, *, own: str = "/user.slice/edge", own_max: str = "max", parent_max: str = "2147483648",
            own_kills: int = 0, parent_kills: int = 0, own_events: bool = True) -> Path:
    write(root / "proc/self/cgroup", f"0::{own}\n")
    write(root / "proc/self/mountinfo", "30 23 0:26 / /sys/fs/cgroup rw,relatime - cgroup2 cgroup2 rw\n")
    base = root / "sys/fs/cgroup"
    own_dir = base / own.strip("/")
    if own_events:
        write(own_dir / "memory.events", f"low 0\nhigh 0\nmax 7\noom 1\noom_kill {own_kills}\noom_group_kill 0\n")
        write(own_dir / "memory.max", f"{own_max}\n")
        write(own_dir / "memory.current", f"{300 * MIB}\n")
        write(own_dir / "memory.peak", f"{400 * MIB}\n")
    write(own_dir.parent / "memory.events", f"low 0\nhigh 0\nmax 9\noom 2\noom_kill {parent_kills}\n")
    write(own_dir.parent / "memory.max", f"{parent_max}\n")
    return root


def kmsg_record(seq: int, message: str) -> str:
    return f"3,{seq},{seq * 1000},-;{message}\n"


def oom_lines(pid: int, name: str, memcg: str, seq: int = 500) -> str:
    return (kmsg_record(seq, f"oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
                             f"oom_memcg={memcg},task_memcg={memcg},task={name},pid={pid},uid=0")
            + kmsg_record(seq + 1, f"Memory cgroup out of memory: Killed process {pid} ({name}) total-vm:4261640kB, "
                                   "anon-rss:1261504kB, file-rss:6636kB, shmem-rss:0kB, UID:0 pgtables:5720kB "
                                   "oom_score_adj:0")
            + " SUBSYSTEM=memory\n")


class FakePeak:
    def __init__(self, predicted: int, headroom: int, reclaimable: int = 256 * MIB):
        # Admission is the held peak (the predicted one less the reclaimable file pages) + headroom.
        self.predicted_bytes, self.headroom_bytes = predicted, headroom
        self.held_bytes = predicted - reclaimable
        self.admission_bytes = self.held_bytes + headroom


class FakePlan:
    """What a death's account reads of a plan: its peak, and (for the reaper's facts) the model, device and layout."""

    def __init__(self, predicted: int, headroom: int, *, in_process: bool = True):
        self.peak = FakePeak(predicted, headroom)
        self.model_path = "/models/SmolLM2-135M-Instruct"
        self.selected_device = SimpleNamespace(device_id="cpu")
        self.execution = SimpleNamespace(in_process=in_process)


def bump_v1(root: Path, *, own: str = "/process_api/abc/edge", oom_kill: int, failcnt: int = 0) -> None:
    own_dir = root / "sys/fs/cgroup/memory" / own.strip("/")
    (own_dir / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n")
    (own_dir / "memory.failcnt").write_text(f"{failcnt}\n")
