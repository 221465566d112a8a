"""What devices exist, which this interpreter can drive, and how they are described.

A :class:`Device` is one row of ``edge devices``: a stable id, what kind of
hardware it is, which backend drives it (or why none does), its memory pool and
the formats it executes, each claim tagged with an evidence class.

A device list read back from JSON is user input (often written by hand):
:meth:`Device.from_dict` checks every field against the documented schema
(docs/json.md) and names the field, the value and what was expected, so a
typo never reaches a backend as a wrong type.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: Device kinds (docs/json.md, ``edge.devices``). The planner ranks private pools before shared.
KINDS = ("cpu", "gpu_discrete", "gpu_integrated", "npu")

#: Memory pools: ``vram`` is private to the device; ``host_ram`` is shared with the CPU.
POOLS = ("vram", "host_ram")

#: How a claim or a byte count is known, written as one letter in JSON (docs/json.md).
DETECTED = "D"  # read from an artifact or the OS: a file header, sysfs, NVML, installed metadata
EXECUTED = "B"  # the backend ran something on the device and saw it (``edge devices --verify``, a run)
ESTIMATED = "E"  # a formula or a constant, with its evidence in docs/
#: Evidence classes, strongest first after detection: D detected, B backend executed, E estimated.
EVIDENCE = (DETECTED, EXECUTED, ESTIMATED)
#: The letters explained, for people (``edge devices`` text, the page's evidence column).
EVIDENCE_LEGEND = "D read from the OS or an artifact, B the backend ran something here, E an estimate"

#: Environment variable holding a comma-separated list of kinds to mask.
MASK_ENV = "EDGE_MASK"

#: What to do about a malformed device list, said after what is wrong with it.
FIX_DEVICE_LIST = "fix the file, or capture the list again with `edge devices --json` on that machine"

#: ``compute_capability`` as edge-cuda writes it: ``sm_`` and major * 10 + minor.
COMPUTE_CAPABILITY_PATTERN = re.compile(r"sm_\d+")

#: How much of a bad value an error message quotes: enough to recognise it, never a whole document.
SHORT_REPR_CHARS = 60


def short_repr(value: Any) -> str:
    """``repr(value)`` cut to :data:`SHORT_REPR_CHARS`, for messages about user input."""
    text = repr(value)
    return text if len(text) <= SHORT_REPR_CHARS else text[: SHORT_REPR_CHARS - 3] + "..."


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_str_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def _is_count_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_count(v) for v in value)


def _is_evidence(value: Any) -> bool:
    return isinstance(value, Mapping) and all(isinstance(k, str) and v in EVIDENCE for k, v in value.items())


#: How a document field is checked: (required, is the value valid, what is expected).
FieldSpec = tuple[bool, Callable[[Any], bool], str]

#: Each field a device row may carry, as the device object of docs/json.md
#: describes it; a bool is never a count.
DEVICE_FIELDS: dict[str, FieldSpec] = {
    "device_id": (True, lambda v: isinstance(v, str) and bool(v), "a non-empty string such as 'cuda:0'"),
    "kind": (True, lambda v: v in KINDS, f"one of {', '.join(KINDS)}"),
    "vendor": (True, lambda v: isinstance(v, str), "a string"),
    "name": (True, lambda v: isinstance(v, str), "a string"),
    "backend": (True, lambda v: v is None or isinstance(v, str), "a string such as 'vllm:cpu', or null"),
    "runnable": (True, lambda v: isinstance(v, bool), "true or false"),
    "memory_pool": (True, lambda v: v in POOLS, f"one of {', '.join(POOLS)}"),
    "memory_bytes": (True, _is_count, "a whole number of bytes >= 0"),
    "memory_available_bytes": (False, lambda v: v is None or _is_count(v), "a whole number of bytes >= 0, or null"),
    "compute_capability": (False, lambda v: v is None or (
        isinstance(v, str) and COMPUTE_CAPABILITY_PATTERN.fullmatch(v) is not None),
        "a string like 'sm_90' (major * 10 + minor), or null"),
    "weight_formats": (False, lambda v: v is None or _is_str_list(v), "a list of format names such as ['dense']"),
    "evidence": (False, lambda v: v is None or _is_evidence(v),
                 "an object mapping each claim to an evidence class D, B or E, e.g. {\"found\": \"D\"}"),
    "reason": (False, lambda v: v is None or isinstance(v, str), "a string, or null"),
    "masked": (False, lambda v: isinstance(v, bool), "true or false"),
    "plugin": (False, lambda v: v is None or isinstance(v, str), "a string, or null"),
    "extras": (False, lambda v: v is None or (isinstance(v, Mapping) and all(isinstance(k, str) for k in v)),
               "an object (backend-specific keys)"),
}


#: The ``host`` section of a device list: every field ``HostFacts.from_dict``
#: reads (all optional), then each ``numa_nodes[]`` entry. Checked here, where
#: the file is named, so the planner never builds host facts from bad types;
#: ``edge_core.host`` cannot be imported from here (one layer), so a test keeps
#: these tables equal to what ``HostFacts.to_dict`` writes.
HOST_SECTION_FIELDS: dict[str, FieldSpec] = {
    "system": (False, lambda v: isinstance(v, str), "a string"),
    "machine": (False, lambda v: isinstance(v, str), "a string"),
    "cpu_model": (False, lambda v: isinstance(v, str), "a string"),
    "mem_total_bytes": (False, _is_count, "a whole number of bytes >= 0"),
    "mem_available_bytes": (False, _is_count, "a whole number of bytes >= 0"),
    "logical_cores": (False, _is_count, "a whole number >= 0"),
    "physical_cores": (False, _is_count, "a whole number >= 0"),
    "cgroup_limit_bytes": (False, lambda v: v is None or _is_count(v), "a whole number of bytes >= 0, or null"),
    "cgroup_usage_bytes": (False, lambda v: v is None or _is_count(v), "a whole number of bytes >= 0, or null"),
    "cgroup_memory_path": (False, lambda v: v is None or isinstance(v, str), "a string, or null"),
    "isa_flags": (False, lambda v: v is None or (isinstance(v, list) and _is_str_list(v)),
                  "a list of flag names such as ['avx2']"),
    "is_wsl": (False, lambda v: isinstance(v, bool), "true or false"),
    "hostname": (False, lambda v: isinstance(v, str), "a string"),
    "allowed_cpus": (False, lambda v: v is None or _is_count_list(v), "a list of CPU numbers"),
    "cpu_quota_cores": (False, lambda v: v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       and v > 0), "a number of cores > 0, or null"),
    "numa_nodes": (False, lambda v: v is None or isinstance(v, list), "a list of node objects"),
}
NUMA_NODE_FIELDS: dict[str, FieldSpec] = {
    "node_id": (True, _is_count, "a whole number >= 0"),
    "total_bytes": (True, _is_count, "a whole number of bytes >= 0"),
    "reclaimable_bytes": (True, _is_count, "a whole number of bytes >= 0"),
    "cpus": (False, lambda v: v is None or _is_count_list(v), "a list of CPU numbers"),
}


def field_problems(data: Mapping[str, Any], fields: Mapping[str, FieldSpec], prefix: str = "") -> list[str]:
    """Each field of ``data`` that ``fields`` says is missing or wrong, as ``prefix + field is VALUE: expected ...``.

    Fields ``fields`` does not list are ignored: a document written by a newer
    edge still reads here.
    """
    problems = []
    for name, (required, valid, expected) in fields.items():
        if name not in data:
            if required:
                problems.append(f"{prefix}{name} is missing: expected {expected}")
        elif not valid(data[name]):
            problems.append(f"{prefix}{name} is {short_repr(data[name])}: expected {expected}")
    return problems


def host_section_problems(host: Any, prefix: str = "host.") -> list[str]:
    """What is wrong with a device list's ``host`` section (:data:`HOST_SECTION_FIELDS`)."""
    if not isinstance(host, dict):
        return [f"{prefix.rstrip('.')} is {short_repr(host)}: expected an object (or leave it out)"]
    problems = field_problems(host, HOST_SECTION_FIELDS, prefix)
    nodes = host.get("numa_nodes")
    for i, node in enumerate(nodes if isinstance(nodes, list) else ()):
        if isinstance(node, dict):
            problems += field_problems(node, NUMA_NODE_FIELDS, f"{prefix}numa_nodes[{i}].")
        else:
            problems.append(f"{prefix}numa_nodes[{i}] is {short_repr(node)}: expected an object")
    return problems


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

    @property
    def local_id(self) -> str:
        """The id its backend gave the device on its own host: ``device_id`` without a multi-host plan's ``HOST/``.

        A backend recognises its devices by this (or by ``backend``), never by
        the literal ``device_id``: a plan across hosts renames every device
        ``HOST/ID`` (``extras["host"]`` is ``HOST``), and only the name changes.
        """
        host = self.extras.get("host")
        prefix = f"{host}/"
        return self.device_id[len(prefix):] if host and self.device_id.startswith(prefix) else self.device_id

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
    def from_dict(cls, data: Mapping[str, Any], prefix: str = "") -> Device:
        """Rebuild a device from its JSON row, checking every field first (:data:`DEVICE_FIELDS`).

        Raises ValueError naming ``prefix + field`` (e.g. ``devices[0].kind``),
        the value and what is expected; null containers read as empty, and
        unknown fields are ignored.
        """
        where = prefix.rstrip(".") or "device record"
        if not isinstance(data, Mapping):
            raise ValueError(f"{where} is {short_repr(data)}: expected an object")
        problems = field_problems(data, DEVICE_FIELDS, prefix)
        if problems:
            raise ValueError("; ".join(problems))
        kwargs = {k: v for k, v in data.items() if k in DEVICE_FIELDS}
        kwargs["weight_formats"] = tuple(kwargs.get("weight_formats") or ())
        kwargs["evidence"] = dict(kwargs.get("evidence") or {})
        kwargs["extras"] = dict(kwargs.get("extras") or {})
        try:  # each field is sound; what is left is the record's own consistency (__post_init__)
            return cls(**kwargs)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}" if prefix else str(exc)) from None


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
    Raises ValueError with a message naming the file on anything malformed:
    for a bad field, ``devices[i].<field>`` or ``host.<field>``, the value, and
    what is expected.
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
            devices.append(Device.from_dict(row, prefix=f"devices[{index}]."))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"device list {path}: {exc}; {FIX_DEVICE_LIST}") from None
    host = doc.get("host")
    problems = host_section_problems(host) if host is not None else []
    if problems:
        raise ValueError(f"device list {path}: " + "; ".join(problems) + f"; {FIX_DEVICE_LIST}")
    return devices, dict(host or {})
