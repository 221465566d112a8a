"""What devices exist, which this interpreter can drive, and how they are described.

A :class:`Device` is one row of ``edge devices``: a stable id, what kind of
hardware it is, which backend drives it (or why none does), its memory pool and
the formats it executes, each claim tagged with an evidence class.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Device kinds (SPEC section 3). The planner ranks private pools before shared.
KINDS = ("cpu", "gpu_discrete", "gpu_integrated", "npu")

#: Memory pools: ``vram`` is private to the device; ``host_ram`` is shared with the CPU.
POOLS = ("vram", "host_ram")

#: Evidence classes. ``D`` read from an artifact or the OS, ``B`` the backend ran
#: something here, ``E`` an estimate.
EVIDENCE = ("D", "B", "E")

#: Environment variable holding a comma-separated list of kinds to mask.
MASK_ENV = "EDGE_MASK"


@dataclass(frozen=True)
class Device:
    """One device as a backend sees it from this process.

    ``memory_bytes`` is the device's own memory: the VRAM total for a private
    pool, the host total for the CPU, and 0 for an iGPU or NPU (they draw on the
    host pool the CPU row already carries, so nobody counts the same RAM twice).
    """

    device_id: str
    kind: str
    vendor: str
    name: str
    backend: str | None
    runnable: bool
    memory_pool: str
    memory_bytes: int
    #: "sm_90"-style string for CUDA; None where there is no such notion.
    compute_capability: str | None = None
    weight_formats: tuple[str, ...] = ()
    #: Evidence class per claim, e.g. {"found": "D", "runnable": "D", "memory_bytes": "D"}.
    evidence: Mapping[str, str] = field(default_factory=dict)
    #: Why the device is not runnable here, and what to do about it. None when runnable.
    reason: str | None = None
    masked: bool = False
    #: Free bytes in the pool at probe time, where the backend can read it.
    memory_available_bytes: int | None = None
    #: Name of the plugin that reported the device (filled in by the registry).
    plugin: str | None = None
    extras: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        if not isinstance(self.device_id, str) or not self.device_id:
            problems.append("device_id must be a non-empty string")
        elif self.device_id.isdigit():
            problems.append(f"device_id {self.device_id!r} is a bare index; use e.g. 'cuda:0'")
        if self.kind not in KINDS:
            problems.append(f"kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.memory_pool not in POOLS:
            problems.append(f"memory_pool {self.memory_pool!r} is not one of {', '.join(POOLS)}")
        if not isinstance(self.memory_bytes, int) or self.memory_bytes < 0:
            problems.append("memory_bytes must be a non-negative int")
        if self.kind in ("gpu_integrated", "npu") and self.memory_bytes != 0:
            problems.append(
                f"{self.kind} draws from host RAM and must carry memory_bytes=0, "
                f"not {self.memory_bytes}"
            )
        for claim, cls in dict(self.evidence).items():
            if cls not in EVIDENCE:
                problems.append(f"evidence for {claim!r} is {cls!r}, not one of D/B/E")
        if not self.runnable and not self.reason:
            problems.append("a device that is not runnable needs a reason")
        if problems:
            raise ValueError(f"invalid device record {self.device_id!r}: " + "; ".join(problems))
        object.__setattr__(self, "weight_formats", tuple(self.weight_formats))
        object.__setattr__(self, "evidence", dict(self.evidence))
        object.__setattr__(self, "extras", dict(self.extras))

    @property
    def status(self) -> str:
        """``runnable``, ``masked`` or ``not here`` — the one-word column of ``edge devices``."""
        if self.masked:
            return "masked"
        return "runnable" if self.runnable else "not here"

    def replace(self, **changes: Any) -> Device:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device_id": self.device_id,
            "kind": self.kind,
            "vendor": self.vendor,
            "name": self.name,
            "backend": self.backend,
            "runnable": self.runnable,
            "memory_pool": self.memory_pool,
            "memory_bytes": self.memory_bytes,
            "memory_available_bytes": self.memory_available_bytes,
            "compute_capability": self.compute_capability,
            "weight_formats": list(self.weight_formats),
            "evidence": dict(self.evidence),
            "reason": self.reason,
            "masked": self.masked,
            "plugin": self.plugin,
            "extras": dict(self.extras),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Device:
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        kwargs["weight_formats"] = tuple(kwargs.get("weight_formats") or ())
        return cls(**kwargs)


@dataclass(frozen=True)
class DeviceCounter:
    """A device's own memory counter: ``read()`` returns used bytes now (None when unreadable).

    ``source`` says what it counts, e.g. ``nvml used bytes (whole card)``;
    it is reported beside the process-tree counters, never summed with them.
    """

    read: Callable[[], int | None]
    source: str


def parse_mask(text: str | None) -> frozenset[str]:
    """Parse ``"gpu_discrete,npu"`` into a set of kinds; unknown kinds raise ValueError."""
    if not text:
        return frozenset()
    kinds = frozenset(part.strip() for part in text.split(",") if part.strip())
    unknown = sorted(kinds - set(KINDS))
    if unknown:
        raise ValueError(
            f"cannot mask {', '.join(unknown)}: kinds are {', '.join(KINDS)}"
        )
    return kinds


def apply_mask(devices: Iterable[Device], kinds: frozenset[str]) -> list[Device]:
    """Mark devices of the masked kinds; they stay listed with their real memory."""
    out = []
    for device in devices:
        if device.kind in kinds and not device.masked:
            device = device.replace(
                masked=True,
                runnable=False,
                reason=(device.reason or f"masked by policy (kind {device.kind})"),
            )
        out.append(device)
    return out


def load_device_list(path: str) -> tuple[list[Device], dict[str, Any]]:
    """Read the document ``edge devices --json`` printed, maybe on another machine.

    Returns the devices and the document's ``host`` section (empty if absent).
    Raises ValueError with a message naming the file on anything malformed.
    """
    try:
        with open(path, encoding="utf-8") as handle:
            doc = json.load(handle)
    except OSError as exc:
        raise ValueError(f"cannot read device list {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"device list {path} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("devices"), list):
        raise ValueError(
            f"device list {path} has no 'devices' list; save the output of `edge devices --json`"
        )
    devices = []
    for index, row in enumerate(doc["devices"]):
        if not isinstance(row, dict):
            raise ValueError(f"device list {path}: devices[{index}] is not an object")
        try:
            devices.append(Device.from_dict(row))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"device list {path}: devices[{index}]: {exc}") from None
    host = doc.get("host")
    return devices, dict(host) if isinstance(host, dict) else {}
