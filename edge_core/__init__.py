"""edge-core: decide before loading which device can run a checkpoint, and with how many bytes.

Backends are separate packages registered in the ``edge.backends`` entry-point
group; they implement the hooks in :mod:`edge_core.hookspecs` with
``@edge_core.hookimpl``.
"""

from .budget import Reservation
from .devices import Device
from .hookspecs import API_VERSION, hookimpl
from .host import HostFacts, NumaNode

__version__ = "0.1.0"

__all__ = [
    "API_VERSION",
    "Device",
    "HostFacts",
    "NumaNode",
    "Reservation",
    "hookimpl",
    "__version__",
]
