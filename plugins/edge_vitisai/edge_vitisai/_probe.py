"""Is there an AMD XDNA NPU this process can drive, through ONNX Runtime's VitisAI EP?

* Linux: the ``amdxdna`` kernel driver binds the NPU as a DRM accel device,
  ``/sys/class/accel/accelN/device/driver -> .../amdxdna``, with its node at
  ``/dev/accel/accelN``.
* WSL: the NPU stays with the Windows driver; ``/dev/dxg`` shares GPUs only, so
  no accel node exists. The NPU is listed (unreachable) only when the CPU model
  says it has one (``Ryzen AI``); otherwise nothing is listed.
* Windows: no cheap device file; the NPU is listed when the CPU model says it
  has one or the VitisAI runtime is installed, and ``verify_device`` asks the
  runtime itself.

The runtime is found from installed metadata only: importing onnxruntime costs
hundreds of milliseconds, so it happens in ``verify_device`` and nowhere here.
"""

from __future__ import annotations

import logging
import os
import platform as _platform
import re
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

from edge_core import builds
from edge_core.devices import Device
from edge_core.routes import ROUTES_EXTRA, Resolution, Route
from edge_core.routes import resolve as resolve_routes

log = logging.getLogger(__name__)

DEVICE_ID = "npu:amd"
BACKEND = "ort:vitisai"
#: XDNA2 executes 16-bit-activation, 8-bit-weight graphs; fp32 and A8W8 graphs
#: are accepted by the runtime but every node silently stays on the CPU (docs/igpu-npu-facts.md).
FORMATS = ("onnx:a16w8",)
DRIVER = "amdxdna"

#: AMD brands every XDNA2-equipped mobile CPU "Ryzen AI" (e.g. "AMD Ryzen AI 9 HX
#: 370 w/ Radeon 890M"). Evidence E: a product name, not the device itself.
NPU_CPU_PATTERN = re.compile(r"\bRyzen AI\b", re.IGNORECASE)

#: Distributions that carry ONNX Runtime's VitisAI EP. Ryzen AI Software
#: installs ``onnxruntime-vitisai``; a build shipped as plain ``onnxruntime`` is
#: recognised by the provider library listed in its RECORD.
RUNTIME_DISTRIBUTIONS = ("onnxruntime-vitisai", "onnxruntime")
_PROVIDER_FILE = re.compile(r"onnxruntime_providers_vitisai\.(dll|so)$")

RUNTIME_REMEDY = (
    "install AMD's Ryzen AI Software into this environment (it provides "
    "onnxruntime-vitisai, which is not on PyPI)"
)
#: ONNX Runtime's name for the VitisAI execution provider: the stage's target.
PROVIDER = "VitisAIExecutionProvider"

#: The VitisAI EP lives in ONNX Runtime builds AMD ships with Ryzen AI Software,
#: for Windows first and for Linux (amdxdna) since. One route per interpreter
#: kind, through the core's shared route mechanism; from WSL the Windows route is
#: "another interpreter", which is what the refusal names.
ROUTES: tuple[Route, ...] = (
    Route(backend=BACKEND, interpreter="windows", distribution="onnxruntime-vitisai", formats=FORMATS,
          install=RUNTIME_REMEDY + ", and edge-core and edge-vitisai in that Python", provider=PROVIDER),
    Route(backend=BACKEND, interpreter="linux", distribution="onnxruntime-vitisai", formats=FORMATS,
          install=RUNTIME_REMEDY + " (Linux build)", provider=PROVIDER),
)

WSL_REASON = (
    "device_unreachable_from_this_process: the XDNA NPU is driven by the Windows driver; "
    "WSL has no amdxdna device. Run edge from a Windows Python with edge-vitisai installed"
)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _files(distribution: str) -> list[str] | None:
    try:
        return [str(f) for f in metadata.files(distribution) or ()]
    except metadata.PackageNotFoundError:
        return None


def find_runtime(
    version_of: Callable[[str], str | None] | None = None,
    files_of: Callable[[str], Iterable[str] | None] | None = None,
) -> tuple[str, str] | None:
    """(distribution, version) of an installed ONNX Runtime with the VitisAI EP, or None."""
    version_of = version_of or (lambda name: builds.installed_version(name))
    files_of = files_of or _files
    for name in RUNTIME_DISTRIBUTIONS:
        version = version_of(name)
        if version is None:
            continue
        if name == "onnxruntime-vitisai" or any(
            _PROVIDER_FILE.search(f) for f in files_of(name) or ()
        ):
            return name, version
    return None


def resolve(
    where: str,
    version_of: Callable[[str], str | None] | None = None,
    files_of: Callable[[str], Iterable[str] | None] | None = None,
) -> Resolution:
    """The VitisAI routes' statuses from an interpreter of kind ``where``.

    A route resolves when an ONNX Runtime carrying the VitisAI EP is installed
    (:func:`find_runtime`: ``onnxruntime-vitisai``, or a plain ``onnxruntime``
    that ships the provider library).
    """

    def check(route: Route) -> tuple[str | None, str | None]:
        runtime = find_runtime(version_of, files_of)
        if runtime is None:
            return None, f"no ONNX Runtime with the VitisAI EP is installed: {route.install}"
        return runtime[1], None

    return resolve_routes(ROUTES, where, check=check)


def amdxdna_nodes(root: Path) -> list[str]:
    """Names (``accel0``...) of accel devices bound to the amdxdna driver."""
    try:
        entries = sorted(p for p in (root / "sys/class/accel").iterdir()
                         if re.fullmatch(r"accel\d+", p.name))
    except OSError:
        return []
    return [
        entry.name
        for entry in entries
        if os.path.basename(os.path.realpath(entry / "device/driver")) == DRIVER
    ]


def _cpu_model(host: Any, root: Path) -> str:
    model = getattr(host, "cpu_model", None)
    if model:
        return model
    for line in (_read(root / "proc/cpuinfo") or "").splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return ""


def probe(
    host: Any = None,
    root: str | Path = "/",
    system: str | None = None,
    version_of: Callable[[str], str | None] | None = None,
    files_of: Callable[[str], Iterable[str] | None] | None = None,
) -> tuple[list[Device], str | None]:
    """Return ``[npu:amd]`` or ``[]`` and, when empty, why.

    Seams for tests: ``root`` (filesystem root), ``system`` (what
    :func:`platform.system` says), ``version_of`` / ``files_of`` (installed
    distribution metadata).
    """
    root = Path(root)
    system = (system or _platform.system()).lower()
    cpu = _cpu_model(host, root)
    cpu_says_npu = bool(NPU_CPU_PATTERN.search(cpu))
    if system == "linux":
        nodes = amdxdna_nodes(root)
        if nodes:
            routes = resolve("linux", version_of, files_of)
            return [_linux_device(root, nodes[0], find_runtime(version_of, files_of), routes)], None
        osrelease = (_read(root / "proc/sys/kernel/osrelease") or "").lower()
        if "microsoft" in osrelease and (root / "dev/dxg").exists():
            if not cpu_says_npu:
                return _note("WSL, and the CPU model names no NPU; the XDNA NPU is only "
                             "reachable from Windows")
            extras = {"cpu_model": cpu, "platform": "wsl", ROUTES_EXTRA: resolve("wsl", version_of, files_of).to_list()}
            return [_device(False, WSL_REASON, {"found": "E"}, extras)], None
        hint = (f"; this CPU ({cpu}) has one: load the amdxdna driver (Linux 6.14+)"
                if cpu_says_npu else "")
        return _note(f"no accel device bound to the {DRIVER} driver under /sys/class/accel{hint}")
    if system == "windows":
        runtime = find_runtime(version_of, files_of)
        if not cpu_says_npu and runtime is None:
            return _note("the CPU model names no NPU and no ONNX Runtime with the VitisAI EP is installed")
        extras = {"cpu_model": cpu, "platform": "windows", "runtime": _runtime_text(runtime),
                  ROUTES_EXTRA: resolve("windows", version_of, files_of).to_list()}
        reason = None if runtime else f"no ONNX Runtime with the VitisAI EP is installed: {RUNTIME_REMEDY}"
        return [_device(runtime is not None, reason, {"found": "E", "runnable": "D"}, extras)], None
    return _note(f"the XDNA NPU is driven on Linux (amdxdna) or Windows; this is {system}")


def _runtime_text(runtime: tuple[str, str] | None) -> str | None:
    return f"{runtime[0]} {runtime[1]}" if runtime else None


def _linux_device(root: Path, node: str, runtime: tuple[str, str] | None, routes: Resolution) -> Device:
    dev = root / "dev/accel" / node
    pci = (_read(root / "sys/class/accel" / node / "device/device") or "").strip() or None
    extras = {"platform": "linux", "accel": node, "pci_device": pci, "runtime": _runtime_text(runtime),
              ROUTES_EXTRA: routes.to_list()}
    if runtime is None:
        reason = f"the XDNA NPU is here ({DRIVER} driver) but no ONNX Runtime with the VitisAI EP is installed: {RUNTIME_REMEDY}"
    elif not dev.exists():
        reason = f"{DRIVER} is bound but /dev/accel/{node} is missing; check udev and the driver log (dmesg)"
    elif not os.access(dev, os.R_OK | os.W_OK):
        reason = f"this user cannot open /dev/accel/{node}: add it to the group owning the node (usually render), then log in again"
    else:
        reason = None
    return _device(reason is None, reason, {"found": "D", "runnable": "D"}, extras)


def _device(runnable: bool, reason: str | None, evidence: dict, extras: dict) -> Device:
    return Device(
        device_id=DEVICE_ID,
        kind="npu",
        vendor="amd",
        name="AMD XDNA NPU",
        backend=BACKEND,
        runnable=runnable,
        memory_pool="host_ram",
        memory_bytes=0,  # the NPU draws on host RAM, which the CPU row already counts
        weight_formats=FORMATS,
        evidence={**evidence, "weight_formats": "D"},
        reason=reason,
        extras=extras,
    )


def _note(message: str) -> tuple[list[Device], str]:
    log.debug("edge-vitisai found no devices: %s", message)
    return [], message


def verify(device: Device, ort: Any = None) -> Device:
    """Ask ONNX Runtime itself whether it offers the VitisAI EP in this process.

    This imports onnxruntime (the only place that does). A listed EP still
    proves no placement: graphs it cannot take run on the CPU silently, which
    only a stage's profiled placement shows.
    """
    if ort is None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            return device.replace(
                runnable=False,
                reason=f"onnxruntime cannot be imported here ({exc}): {RUNTIME_REMEDY}",
                evidence={**device.evidence, "runnable": "B"},
            )
    providers = list(ort.get_available_providers())
    extras = {**device.extras, "providers": providers}
    evidence = {**device.evidence, "runnable": "B"}
    if "VitisAIExecutionProvider" in providers:
        # Confirms a runnable device; a device refused for another reason (WSL) stays refused.
        return device.replace(extras=extras, evidence=evidence if device.runnable else device.evidence)
    version = getattr(ort, "__version__", "?")
    return device.replace(
        runnable=False,
        reason=(
            f"onnxruntime {version} loads but offers no VitisAIExecutionProvider "
            f"(it offers {', '.join(providers) or 'none'}): {RUNTIME_REMEDY}"
        ),
        extras=extras,
        evidence=evidence,
    )
