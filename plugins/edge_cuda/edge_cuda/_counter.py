"""The card's own memory counter for the run's sampler: NVML used bytes (whole card, every process).

The sampler reads it every period beside the process-tree counters, never
summed with them (:mod:`edge_core.runtime.measure`). On a GPU the session is what fills the
card, so this is the counter the budget is checked against.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from edge_core.devices import Device, DeviceCounter

#: What the counter counts, as the run record names it.
SOURCE = "nvml used bytes (whole card)"


def nvml_counter(device: Device, nvml: ModuleType | Any | None = None) -> DeviceCounter | None:
    """A counter for ``device``'s card, or None when NVML or its driver is not there (the run says so).

    The card is found by the NVML index the probe recorded (``extras["nvml_index"]``),
    else by the number in ``cuda:N``. ``nvml`` is the pynvml module (tests pass a fake).
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
        index = device.extras.get("nvml_index")
        if index is None:
            index = int(str(device.device_id).partition(":")[2] or 0)
        handle = nvml.nvmlDeviceGetHandleByIndex(int(index))
    except Exception:  # noqa: BLE001 — no driver or no such card: the run records no device counter
        return None
    return DeviceCounter(read=lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).used), source=SOURCE)
