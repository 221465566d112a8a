"""The ``edge`` command: the one place that turns results and exceptions into output and exit codes.

Exit codes: 0 success/admitted, 2 refused, 3 parity divergence, 1 internal
error, 64 usage error, 130 interrupted. Every command has ``--json`` with a
versioned schema (docs/json.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from . import errors
from .errors import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, EdgeError, UsageError

#: Bumped when a JSON document changes incompatibly; each document carries it.
SCHEMA_VERSION = 1

#: Set to 1 to turn any plugin problem into a non-zero exit (same as --strict).
STRICT_ENV = "EDGE_STRICT"
#: Exit code under --strict when a plugin is unhealthy or a warning was raised.
EXIT_STRICT = 1


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors; edge reserves 2 for refusals and uses 64."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}\n{self.format_usage().strip()}")


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print a JSON document (schema in docs/json.md)")
    parser.add_argument(
        "--plugins", metavar="NAMES",
        help="comma-separated allow-list of backends to load (default: all installed; env EDGE_PLUGINS)",
    )
    parser.add_argument(
        "--block", metavar="NAMES",
        help="comma-separated backends never to import (env EDGE_BLOCK_PLUGINS)",
    )
    parser.add_argument(
        "--strict", action="store_true",
        help=f"exit {EXIT_STRICT} if any plugin failed to load or probe (env {STRICT_ENV}=1); for CI",
    )


def _mask_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mask", metavar="KINDS",
        help="hide device kinds as a policy, e.g. gpu_discrete (env EDGE_MASK); masked devices stay listed",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="edge",
        description=(
            "Decide, before loading anything, which device this interpreter can run a model "
            "checkpoint on and with how many bytes; refuse with a reason and a remedy when none can."
        ),
        epilog="exit codes: 0 ok/admitted, 2 refused, 3 parity divergence, 1 internal error, 64 usage error",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    plugins = sub.add_parser("plugins", help="list installed backends and their status")
    _common(plugins)

    devices = sub.add_parser(
        "devices", help="list loaded backends and every device they see",
        description="List loaded backends, then every device: runnable, not here (with why) or masked.",
    )
    _common(devices)
    _mask_option(devices)
    devices.add_argument(
        "--verify", action="store_true",
        help="import each runtime and run something tiny on its devices (slow: seconds); evidence becomes B",
    )

    from .commands import add_stage_commands

    add_stage_commands(sub, _common, _mask_option)
    return parser


def _registry(args: argparse.Namespace) -> Any:
    from .registry import Registry

    allow = [n.strip() for n in args.plugins.split(",") if n.strip()] if getattr(args, "plugins", None) else None
    block = [n.strip() for n in args.block.split(",") if n.strip()] if getattr(args, "block", None) else None
    return Registry(allow=allow, block=block)


def _mask(args: argparse.Namespace) -> frozenset[str]:
    from .devices import MASK_ENV, parse_mask

    text = getattr(args, "mask", None)
    if text is None:
        text = os.environ.get(MASK_ENV)
    try:
        return parse_mask(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def emit_json(document: dict[str, Any], kind: str) -> None:
    payload = {"schema": f"edge.{kind}", "schema_version": SCHEMA_VERSION, **document}
    json.dump(payload, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def gib(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**30:.1f} GiB"


def _strict(args: argparse.Namespace, registry: Any) -> int:
    strict = getattr(args, "strict", False) or os.environ.get(STRICT_ENV, "") not in ("", "0")
    if not strict:
        return EXIT_OK
    from .registry import HEALTHY, SKIPPED

    problems = [r for r in registry.plugins() if r.status not in HEALTHY + SKIPPED]
    if problems or registry.warnings:
        for record in problems:
            print(f"edge: strict: plugin {record.name!r} is {record.status}: {record.reason}", file=sys.stderr)
        for warning in registry.warnings:
            print(f"edge: strict: {warning}", file=sys.stderr)
        return EXIT_STRICT
    return EXIT_OK


def _print_plugins(registry: Any) -> None:
    from .registry import install_hint

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
    registry = _registry(args)
    registry.load()
    if args.json:
        emit_json(
            {"plugins": [r.to_dict() for r in registry.plugins()], "warnings": list(registry.warnings)},
            "plugins",
        )
    else:
        _print_plugins(registry)
    return _strict(args, registry)


def discover(args: argparse.Namespace) -> tuple[Any, Any, list[Any]]:
    """Host facts, registry and masked device list for this interpreter."""
    from .devices import apply_mask
    from .host import read_host

    host = read_host()
    registry = _registry(args)
    devices = apply_mask(registry.probe(host), _mask(args))
    return host, registry, devices


def cmd_devices(args: argparse.Namespace) -> int:
    host, registry, devices = discover(args)
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
        from .registry import install_hint

        emit_json(
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
        return _strict(args, registry)
    _print_plugins(registry)
    print()
    if not devices:
        print("No devices." if registry.plugins() else "No devices: nothing is installed to look for them.")
        return _strict(args, registry)
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
    return _strict(args, registry)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        handler = {"plugins": cmd_plugins, "devices": cmd_devices}.get(args.command) or args.handler
        return handler(args)
    except UsageError as exc:
        print(f"edge: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except EdgeError as exc:
        print(f"edge: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("edge: interrupted", file=sys.stderr)
        return errors.EXIT_INTERRUPTED
    except BrokenPipeError:
        return EXIT_OK
    except Exception as exc:  # a bug in edge: say so plainly, keep the traceback behind a flag
        if os.environ.get("EDGE_DEBUG"):
            raise
        print(
            f"edge: internal error: {type(exc).__name__}: {exc}\n"
            "This is a bug in edge; rerun with EDGE_DEBUG=1 for the traceback and report it.",
            file=sys.stderr,
        )
        return EXIT_INTERNAL
