"""What every command shares: the common options, the registry and mask they select, JSON output.

Every ``--json`` document goes through :func:`write_document`: it carries
``schema`` and ``schema_version`` (docs/json.md) and goes to stdout or a file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ..devices import MASK_ENV, parse_mask
from ..errors import UsageError
from ..runtime.documents import enveloped
from ..services.registry import HEALTHY, SKIPPED, Registry

#: Set to 1 to turn any plugin problem into a non-zero exit (same as --strict).
STRICT_ENV = "EDGE_STRICT"
#: Exit code under --strict when a plugin is unhealthy or a warning was raised.
EXIT_STRICT = 1


class ArgumentError(UsageError):
    """A command line argparse rejected; the message already starts with the command (``edge plan: ...``)."""


class Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors; edge reserves 2 for refusals and uses 64."""

    #: The command parsers by name (the top-level parser's; empty on a command's own).
    commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> Any:
        raise ArgumentError(f"{self.prog}: {message}\n{self.format_usage().strip()}")


def plugin_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugins", metavar="NAMES",
        help="comma-separated allow-list of backends to load (default: all installed; env EDGE_PLUGINS)",
    )
    parser.add_argument(
        "--block", metavar="NAMES",
        help="comma-separated backends never to import (env EDGE_BLOCK_PLUGINS)",
    )


def common_options(parser: argparse.ArgumentParser) -> None:
    """``--json`` (to stdout), the plugin selection, ``--strict``."""
    parser.add_argument("--json", action="store_true", help="print a JSON document (schema in docs/json.md)")
    plugin_options(parser)
    parser.add_argument(
        "--strict", action="store_true",
        help=f"exit {EXIT_STRICT} if any plugin failed to load or probe (env {STRICT_ENV}=1); for CI",
    )


def mask_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mask", metavar="KINDS",
        help="hide device kinds as a policy, e.g. gpu_discrete (env EDGE_MASK); masked devices stay listed",
    )


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def registry_from(args: argparse.Namespace) -> Registry:
    """The registry the command's ``--plugins`` / ``--block`` select (env defaults apply inside)."""
    allow = [n.strip() for n in args.plugins.split(",") if n.strip()] if getattr(args, "plugins", None) else None
    block = [n.strip() for n in args.block.split(",") if n.strip()] if getattr(args, "block", None) else None
    return Registry(allow=allow, block=block)


def mask_from(args: argparse.Namespace) -> frozenset[str]:
    """The kinds ``--mask`` (or ``EDGE_MASK``) hides; an unknown kind is a usage error."""
    text = getattr(args, "mask", None)
    if text is None:
        text = os.environ.get(MASK_ENV)
    try:
        return parse_mask(text)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def write_document(document: dict[str, Any], kind: str, target: str | None = "-") -> None:
    """Write ``document`` as ``edge.<kind>`` JSON to stdout (``-``) or the file ``target``; None writes nothing."""
    if target in (None, ""):
        return
    payload = enveloped(kind, document)
    if target == "-":
        json.dump(payload, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return
    try:
        with open(str(target), "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2, default=str)
            handle.write("\n")
    except OSError as exc:
        raise UsageError(f"cannot write the JSON record to {target}: {exc.strerror}") from None


def strict_exit(args: argparse.Namespace, registry: Registry) -> int:
    """0, or :data:`EXIT_STRICT` under ``--strict`` when a plugin is unhealthy or warned (said on stderr)."""
    strict = getattr(args, "strict", False) or os.environ.get(STRICT_ENV, "") not in ("", "0")
    if not strict:
        return 0
    problems = [r for r in registry.plugins() if r.status not in HEALTHY + SKIPPED]
    if problems or registry.warnings:
        for record in problems:
            print(f"edge: strict: plugin {record.name!r} is {record.status}: {record.reason}", file=sys.stderr)
        for warning in registry.warnings:
            print(f"edge: strict: {warning}", file=sys.stderr)
        return EXIT_STRICT
    return 0


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.1f} GiB"


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f} MiB"
