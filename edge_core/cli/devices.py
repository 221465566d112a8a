"""``edge plugins`` and ``edge devices``: which backends this interpreter has, and what they see.

Parse -> the registry's probe -> render. Cheap by contract: nothing on this
path imports a runtime (``--verify`` is the exception, and says so).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..devices import EVIDENCE_LEGEND
from ..errors import EdgeError
from ..services.registry import Registry, discover, install_hint
from ._common import common_options, gib, mask_from, mask_option, registry_from, strict_exit, write_document


def add_device_commands(sub: Any) -> None:
    plugins = sub.add_parser("plugins", help="list installed backends and their status")
    common_options(plugins)
    plugins.set_defaults(handler=cmd_plugins)

    devices = sub.add_parser(
        "devices", help="list loaded backends and every device they see",
        description="List loaded backends, then every device: runnable, not here (with why) or masked.",
    )
    common_options(devices)
    mask_option(devices)
    devices.add_argument(
        "--verify", action="store_true",
        help="import each runtime and run something tiny on its devices (slow: seconds); evidence becomes B",
    )
    devices.set_defaults(handler=cmd_devices)


def print_plugins(registry: Registry) -> None:
    records = registry.plugins()
    if not records:
        print(f"No backends: {install_hint()}.")
        return
    print(f"Plugins ({len(records)})")
    for record in records:
        dist = f"{record.distribution or '?'} {record.version or ''}".strip()
        line = f"  {record.name:<14} {dist:<24} {record.status:<13} {record.load_time_s * 1000:6.1f} ms"
        print(line)
        if record.reason and record.status != "loaded":
            print(f"  {'':<14} {record.reason}")
    for warning in registry.warnings:
        print(f"  warning: {warning}")


def cmd_plugins(args: argparse.Namespace) -> int:
    registry = registry_from(args)
    registry.load()
    if args.json:
        write_document(
            {"plugins": [r.to_dict() for r in registry.plugins()], "warnings": list(registry.warnings)},
            "plugins",
        )
    else:
        print_plugins(registry)
    return strict_exit(args, registry)


def cmd_devices(args: argparse.Namespace) -> int:
    registry = registry_from(args)
    host, devices = discover(registry, mask_from(args))
    if args.verify:
        verified = []
        for device in devices:
            answer = None
            if device.runnable:
                try:
                    answer = registry.call_owner(device, "verify_device")
                except EdgeError as exc:
                    answer = device.replace(runnable=False, backend=None, reason=str(exc))
            verified.append(answer or device)
        devices = verified
    if args.json:
        write_document(
            {
                "interpreter": sys.executable,
                "host": host.to_dict(),
                "plugins": [r.to_dict() for r in registry.plugins()],
                "devices": [d.to_dict() for d in devices],
                "warnings": list(registry.warnings),
                "hint": None if registry.plugins() else install_hint(),
            },
            "devices",
        )
        return strict_exit(args, registry)
    print_plugins(registry)
    print()
    if not devices:
        print("No devices." if registry.plugins() else "No devices: nothing is installed to look for them.")
        return strict_exit(args, registry)
    print(f"Devices ({len(devices)})")
    print(f"  {'ID':<22} {'KIND':<15} {'STATUS':<9} {'BACKEND':<11} {'POOL':<9} {'MEMORY':>10}  FORMATS")
    for d in devices:
        memory = gib(d.memory_bytes) if d.memory_bytes else "shared"
        formats = ",".join(d.weight_formats) or "-"
        evidence = "".join(sorted(set(d.evidence.values()))) or "?"
        print(
            f"  {d.device_id:<22} {d.kind:<15} {d.status:<9} {d.backend or '-':<11} {d.memory_pool:<9} "
            f"{memory:>10}  {formats}  [{evidence}]"
        )
        if d.compute_capability:
            print(f"  {'':<22} compute capability {d.compute_capability}")
        if d.reason:
            print(f"  {'':<22} why: {d.reason}")
    print(f"  [..]: evidence behind each row: {EVIDENCE_LEGEND}")
    return strict_exit(args, registry)
