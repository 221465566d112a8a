"""edge-core: decide before loading which device can run a checkpoint, and with how many bytes.

Backends are separate packages registered in the ``edge.backends`` entry-point
group; they implement the hooks in :mod:`edge_core.hookspecs` with
``@edge_core.hookimpl``. The top-level modules are that contract (the hooks and
every value that crosses them) and nothing else; the sub-packages are tiers
whose imports point down only: ``kit -> cli -> runtime -> plan -> engines ->
artifact -> services -> contract`` (README, "How the code is laid out").
"""

from ._version import __version__
from .budget import Reservation
from .devices import Device
from .errors import ArtifactError, EdgeError, StageError, UsageError
from .hookspecs import API_VERSION, hookimpl
from .host import HostFacts, NumaNode
from .plans import ExecutionMode, Plan, Refusal, SessionSpec
from .stream import DeltaEvent, StageRequest, StateHandle

__all__ = [
    "API_VERSION",
    "ArtifactError",
    "DeltaEvent",
    "Device",
    "EdgeError",
    "ExecutionMode",
    "HostFacts",
    "NumaNode",
    "Plan",
    "Refusal",
    "Reservation",
    "SessionSpec",
    "StageError",
    "StageRequest",
    "StateHandle",
    "UsageError",
    "hookimpl",
    "__version__",
]
