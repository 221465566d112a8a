"""Shared fixtures: fake host trees and throwaway plugins, always cleaned up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:  # lets tests import the helper modules beside them (factories, fakes)
    sys.path.insert(0, str(TESTS))

from fakes import FakeEntryPoint, write_host_tree  # noqa: E402


@pytest.fixture
def host_tree(tmp_path: Path):
    """A function writing a fake /proc + /sys root and returning its path."""

    def make(**kwargs):
        return write_host_tree(tmp_path / "root", **kwargs)

    return make


@pytest.fixture
def fake_entry_point():
    return FakeEntryPoint
