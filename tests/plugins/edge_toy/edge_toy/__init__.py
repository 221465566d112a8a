"""A third-party backend for tests: its devices come from the JSON file in ``EDGE_TOY_DEVICES``."""

from __future__ import annotations

import os

from edge_core import Device, HostFacts, hookimpl
from edge_core.devices import load_device_list

__all__ = ["EDGE_API_VERSION", "probe_devices"]

EDGE_API_VERSION = 1
last_probe_note: str | None = None


@hookimpl
def probe_devices(host: HostFacts) -> list[Device]:
    global last_probe_note
    path = os.environ.get("EDGE_TOY_DEVICES")
    if not path:
        last_probe_note = "EDGE_TOY_DEVICES is not set"
        return []
    devices, _ = load_device_list(path)
    return devices
