"""Tools for testing edge backends: the conformance suite every backend's tests subclass.

```python
import edge_mybackend
from edge_core.testing import BackendConformance

class TestMyBackendConformance(BackendConformance):
    plugin = edge_mybackend
    plugin_name = "mybackend"      # the entry-point name in edge.backends
```

``fake_hosts`` are hosts unlike this one (:mod:`.hosts`); ``write_fake_vllm_models`` writes a cut vLLM source tree for gates that read
vLLM's model registry (:mod:`edge_core.kit.vllm_source`).

Needs pytest (``pip install 'edge-core[test]'``); nothing here is imported by
the ``edge`` command.
"""

from .conformance import HEAVY_MODULES, BackendConformance
from .hosts import FOREIGN_PLUGIN, fake_hosts
from .vllm_tree import FAKE_VLLM_MODELS, write_fake_vllm_models

__all__ = ["FAKE_VLLM_MODELS", "FOREIGN_PLUGIN", "HEAVY_MODULES", "BackendConformance", "fake_hosts",
           "write_fake_vllm_models"]
