"""edge-transformers against edge-core's conformance suite; the stage checks load the demo with transformers."""

from __future__ import annotations

import edge_transformers
from edge_core.testing import BackendConformance


class TestTransformersConformance(BackendConformance):
    plugin = edge_transformers
    plugin_name = "transformers"
