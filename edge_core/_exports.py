"""Names a package re-exports from its submodules, imported on first use (PEP 562).

``edge devices`` imports every backend, and every backend imports
``edge_core.plan`` for :class:`~edge_core.plan.Refusal`; loading the whole
planner (KV arithmetic, manifests, graph stages) on that path cost about
0.1 s of CPU in a fresh interpreter (docs/benchmarks.md, 'The layering, before
and after'). A layer package therefore imports its types
eagerly and the rest of its public face through :func:`lazy_exports`. The
import still points down (a package to its own submodule); type checkers see
the plain imports under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, table: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``table`` maps each name to its submodule (``.planner``)."""

    def __getattr__(name: str) -> Any:
        submodule = table.get(name)
        if submodule is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(submodule, package), name)
        namespace[name] = value  # the next lookup is a plain global
        return value

    return __getattr__
