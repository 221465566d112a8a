"""Tools for testing edge backends: the conformance suite every backend's tests subclass.

```python
import edge_mybackend
from edge_core.testing import BackendConformance

class TestMyBackendConformance(BackendConformance):
    plugin = edge_mybackend
    plugin_name = "mybackend"      # the entry-point name in edge.backends
```

Needs pytest (``pip install 'edge-core[test]'``); nothing here is imported by
the ``edge`` command.
"""

from .conformance import FOREIGN_PLUGIN, HEAVY_MODULES, BackendConformance, fake_hosts

__all__ = ["FOREIGN_PLUGIN", "HEAVY_MODULES", "BackendConformance", "fake_hosts"]
