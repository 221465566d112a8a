"""Which engine tests share an xdist worker, and in what order the workers are handed them.

Tests that read one engine a module- or class-scoped fixture started share a group; the
groups costliest first (``engine(starts=N)``: how many engines a test, or its module's
fixtures, start; 1 when unsaid), so two workers end together instead of one waiting out the
last two-engine test (``nox -s cpu`` passes ``--no-loadscope-reorder``, which keeps this order).

Under ``--dist loadgroup`` (``nox -s cpu``'s engine phase) xdist keeps the tests of one
``xdist_group`` on one worker; it reads the groups in its own ``pytest_collection_modifyitems``,
registered on each worker after the suite's conftest, so it runs first unless this one is
``tryfirst``. Without ``tryfirst`` the groups set here arrived too late and every worker started
the shared engines again (tests/test_xdist_groups.py checks both).
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Group the engine tests, then order them by their group's cost."""
    group(items)
    items[:] = costliest_first(items)


def group(items):
    """Engine tests that share an engine a module- or class-scoped fixture started get one group; the others
    spread freely. A test that names its own group keeps it."""
    for item in items:
        if item.get_closest_marker("engine") is None or item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        scopes = {d.scope for defs in (info.name2fixturedefs.values() if info else ()) for d in defs}
        if "module" in scopes:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
        elif "class" in scopes and item.cls is not None:
            item.add_marker(pytest.mark.xdist_group(f"{item.nodeid.split('::')[0]}::{item.cls.__name__}"))


def costliest_first(items):
    """The engine tests, by group, costliest group first (stable); every other test keeps its place."""
    engine = [n for n, item in enumerate(items) if item.get_closest_marker("engine") is not None]
    units: dict[str, list] = {}
    for n in engine:
        units.setdefault(unit_of(items[n]), []).append(items[n])
    ordered = sorted(units.values(), key=lambda unit: -max(starts(item) for item in unit))
    out = list(items)
    for n, item in zip(engine, (item for unit in ordered for item in unit)):
        out[n] = item
    return out


def unit_of(item) -> str:
    marker = item.get_closest_marker("xdist_group")
    return f"@{marker.args[0]}" if marker is not None and marker.args else item.nodeid


def starts(item) -> int:
    marker = item.get_closest_marker("engine")
    return int(marker.kwargs.get("starts", 1)) if marker is not None else 0
