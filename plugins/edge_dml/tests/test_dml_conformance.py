"""edge-dml against edge-core's conformance suite.

Without the hardware (or its runtime) the probe reports no runnable device and
the checks that need one skip themselves, saying why; the contract, probe and
planning checks run everywhere.
"""

from __future__ import annotations

import pytest

from edge_core.testing import BackendConformance

edge_dml = pytest.importorskip("edge_dml", reason="edge-dml is not installed and its source is not beside these tests")


class TestDmlConformance(BackendConformance):
    plugin = edge_dml
    plugin_name = "dml"
