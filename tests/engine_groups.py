"""Which engine tests share an xdist worker: those that read one engine a module- or class-scoped fixture started.

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
