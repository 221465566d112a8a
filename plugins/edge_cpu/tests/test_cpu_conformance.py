"""edge-cpu against edge-core's conformance suite.

The stage checks start one real vLLM CPU engine on the bundled demo checkpoint
for the whole class (tens of seconds on a small machine); they carry the
``slow`` mark, so ``pytest -m "not slow"`` keeps only the probe and planning
checks.
"""

from __future__ import annotations

import edge_cpu
from edge_core.testing import BackendConformance


class TestCpuConformance(BackendConformance):
    plugin = edge_cpu
    plugin_name = "cpu"
