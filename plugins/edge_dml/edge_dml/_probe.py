"""Which AMD or Intel GPUs DirectML could reach from this process.

Three places answer, all cheap and import-free:

* Linux and WSL: ``/sys/class/drm/card*/device/vendor`` (PCI vendor ids);
* WSL: ``/dev/dxg``, the DirectX paravirtualization device. It proves a
  Windows GPU is shared into WSL but names no vendor, so the device is
  ``gpu_integrated:dxg`` with vendor ``unknown`` unless ``/sys`` names one.
  torch-directml uses Windows' default adapter, which on a machine with a
  discrete card may be that card;
* Windows: the display-adapter class in the registry (``winreg``), whose
  ``MatchingDeviceId`` carries the PCI vendor id.

NVIDIA GPUs are edge-cuda's and are skipped. Every AMD or Intel GPU is taken as
integrated: a discrete Radeon or Arc card would be listed the same way.
"""

from __future__ import annotations

import logging
import os
import platform as _platform
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edge_core.devices import Device
from edge_core.routes import ROUTES_EXTRA

from ._routes import resolve

log = logging.getLogger(__name__)

#: PCI vendor ids. 0x10de (NVIDIA) is listed so it can be recognised and left to edge-cuda.
VENDORS = {"0x1002": "amd", "0x8086": "intel", "0x10de": "nvidia"}
_LABELS = {"amd": "AMD", "intel": "Intel"}

#: Registry key of the Display adapters device class (a fixed Windows GUID).
DISPLAY_CLASS_KEY = r"SYSTEM\CurrentControlSet\Control\Class\{4d36e968-e325-11ce-bfc1-08002be10318}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def sysfs_adapters(root: Path) -> list[tuple[str, str]]:
    """(vendor, name) for each DRM card, in card order."""
    found = []
    drm = root / "sys/class/drm"
    try:
        cards = sorted((p for p in drm.iterdir() if re.fullmatch(r"card\d+", p.name)),
                       key=lambda p: int(p.name[4:]))
    except OSError:
        return []
    for card in cards:
        vendor = VENDORS.get((_read(card / "device/vendor") or "").strip().lower())
        if vendor:
            slot = os.path.basename(os.path.realpath(card / "device"))
            found.append((vendor, f"{_LABELS.get(vendor, vendor)} GPU ({card.name}, {slot})"))
    return found


def windows_adapters(winreg: Any = None) -> list[tuple[str, str]]:
    """(vendor, DriverDesc) for each display adapter registered with Windows."""
    if winreg is None:
        import winreg  # stdlib on Windows only; this path runs only there
    found = []
    try:
        cls = winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, DISPLAY_CLASS_KEY)
    except OSError:
        return []
    with cls:
        index = 0
        while True:
            try:
                sub = winreg.EnumKey(cls, index)
            except OSError:
                break
            index += 1
            if not sub.isdigit():  # "Properties" and "Configuration" are not adapters
                continue
            try:
                with winreg.OpenKey(cls, sub) as adapter:
                    matching = str(winreg.QueryValueEx(adapter, "MatchingDeviceId")[0])
                    name = str(winreg.QueryValueEx(adapter, "DriverDesc")[0])
            except OSError:
                continue
            match = re.search(r"ven_([0-9a-f]{4})", matching, re.IGNORECASE)
            vendor = VENDORS.get(f"0x{match.group(1).lower()}") if match else None
            if vendor:
                found.append((vendor, name))
    return found


def probe(
    host: Any = None,
    root: str | Path = "/",
    system: str | None = None,
    winreg: Any = None,
    version_of: Callable[[str], str | None] | None = None,
) -> tuple[list[Device], str | None]:
    """Return the iGPUs DirectML could reach and, when there are none, why.

    ``root`` is the filesystem root (tests pass a fake tree), ``system`` what
    :func:`platform.system` says, ``winreg`` the registry module on Windows, and
    ``version_of`` the installed-distribution lookup.
    """
    root = Path(root)
    system = (system or _platform.system()).lower()
    osrelease = (_read(root / "proc/sys/kernel/osrelease") or "").lower()
    if system == "windows":
        where, adapters = "windows", windows_adapters(winreg)
    elif system == "linux" and "microsoft" in osrelease:
        if not (root / "dev/dxg").exists():
            return _note("WSL without /dev/dxg: GPU sharing is off (it needs WSL 2 and a "
                         "current Windows GPU driver)")
        where = "wsl"
        adapters = sysfs_adapters(root) or [("dxg", "Windows GPU shared through /dev/dxg")]
    elif system == "linux":
        where, adapters = "linux", sysfs_adapters(root)
    else:
        return _note(f"DirectML needs Windows or WSL; this is {system}")
    adapters = [(vendor, name) for vendor, name in adapters if vendor != "nvidia"]
    if not adapters:
        return _note("no AMD or Intel GPU found (NVIDIA GPUs are edge-cuda's)")
    resolution = resolve(where, version_of)
    resolved = resolution.resolved
    route = resolved.route if resolved else None
    # The route a remedy names: the resolved one, else the best one that could live here.
    candidate = route or next((s.route for s in resolution.statuses if s.where == "here"), None)
    devices, seen = [], set()
    for vendor, name in adapters:
        device_id = f"gpu_integrated:{vendor}"
        if device_id in seen:  # one row per vendor: a second card would reuse the id
            continue
        seen.add(device_id)
        extras: dict[str, Any] = {"platform": where, ROUTES_EXTRA: resolution.to_list()}
        if candidate is not None:
            extras["route"] = candidate.backend
            if candidate.preference_note:
                extras["route_note"] = candidate.preference_note
        reason = resolution.reason
        if where == "linux":
            reason = ("DirectML needs Windows or WSL; on native Linux this GPU is driven by "
                      "ROCm or oneAPI, not by edge-dml")
        devices.append(
            Device(
                device_id=device_id,
                kind="gpu_integrated",
                vendor=vendor if vendor in _LABELS else "unknown",
                name=name,
                backend=route.backend if route else None,
                runnable=route is not None,
                memory_pool="host_ram",
                memory_bytes=0,  # draws on the host pool the CPU row already counts
                weight_formats=route.formats if route else (),
                evidence={"found": "D", "runnable": "D", "weight_formats": "D"},
                reason=None if route else reason,
                extras=extras,
            )
        )
    return devices, None


def _note(message: str) -> tuple[list[Device], str]:
    log.debug("edge-dml found no devices: %s", message)
    return [], message


def verify(device: Device, ort: Any = None, torch_directml: Any = None) -> Device:
    """Ask the route's runtime itself whether it reaches DirectML in this process (evidence B).

    ``ort:dml``: ONNX Runtime must offer ``DmlExecutionProvider`` in its
    provider list. ``torch:dml``: torch-directml must count at least one
    device. This imports the runtime (the only place besides a stage start
    that does). A listed provider still proves no placement: graphs it cannot
    take run on the CPU silently, which only a stage's profiled placement shows.
    """
    evidence = {**device.evidence, "runnable": "B"}
    if device.backend == "ort:dml":
        if ort is None:
            try:
                import onnxruntime as ort
            except ImportError as exc:
                return device.replace(runnable=False, evidence=evidence,
                                      reason=f"onnxruntime cannot be imported here ({exc}): pip install edge-dml")
        providers = list(ort.get_available_providers())
        extras = {**device.extras, "providers": providers}
        if "DmlExecutionProvider" in providers:
            return device.replace(extras=extras, evidence=evidence)
        return device.replace(
            runnable=False, extras=extras, evidence=evidence,
            reason=(f"onnxruntime {getattr(ort, '__version__', '?')} loads but offers no DmlExecutionProvider "
                    f"(it offers {', '.join(providers) or 'none'}): another onnxruntime build overwrote "
                    "onnxruntime-directml; pip uninstall onnxruntime onnxruntime-gpu, then reinstall "
                    "onnxruntime-directml"),
        )
    if device.backend == "torch:dml":
        if torch_directml is None:
            try:
                import torch_directml
            except Exception as exc:  # noqa: BLE001 - torch-directml fails to import in many ways (ABI, driver)
                return device.replace(runnable=False, evidence=evidence,
                                      reason=f"torch_directml cannot be imported here ({type(exc).__name__}: {exc})")
        count = int(torch_directml.device_count())
        extras = {**device.extras, "dml_device_count": count}
        if count > 0:
            return device.replace(extras=extras, evidence=evidence)
        return device.replace(runnable=False, extras=extras, evidence=evidence,
                              reason="torch_directml sees no DirectML device: update the Windows GPU driver and WSL")
    return device
