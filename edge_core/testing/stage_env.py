"""What does one class's started stage hold, and what did it leave running? The stage checks' fixture."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..devices import Device
    from ..host import HostFacts
    from ..services.registry import Registry

#: The multiprocessing helpers Python itself keeps for the life of the parent
#: (the resource tracker, the forkserver); they are not the stage's processes.
_PYTHON_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def live_children(exclude: set[int]) -> list[Any]:
    """This process's descendants that still run, minus Python's own helpers and ``exclude``."""
    import psutil

    alive = []
    for child in psutil.Process().children(recursive=True):
        if child.pid in exclude:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            cmdline = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if any(helper in cmdline for helper in _PYTHON_HELPERS):
            continue
        alive.append(child)
    return alive


def non_daemon_threads(exclude: set[int]) -> list[threading.Thread]:
    """Threads still running that would keep the interpreter from exiting, minus ``exclude``."""
    return [t for t in threading.enumerate()
            if t.is_alive() and not t.daemon and t is not threading.main_thread() and t.ident not in exclude]


class StageEnv:
    """One class's stage: the registry, the device it was planned on, and the handle once started."""

    def __init__(self, registry: Registry, name: str, host: HostFacts, devices: list[Device], device: Device,
                 plan: Any) -> None:
        self.registry = registry
        self.name = name
        self.host = host
        self.devices = devices
        self.device = device
        self.plan = plan
        self.handle: Any = None
        self.stopped = False
        self.children_before: set[int] = set()
        self.threads_before: set[int] = set()

    def call(self, hook: str, **kwargs: Any) -> Any:
        return self.registry.call_owner(self.device, hook, **kwargs)

    def started(self) -> Any:
        """The running stage, started on first use (and again if a check stopped it)."""
        if self.handle is None or self.stopped:
            import psutil

            self.children_before = {p.pid for p in psutil.Process().children(recursive=True)}
            self.threads_before = {t.ident for t in threading.enumerate() if t.ident is not None}
            self.call("prepare_stage", plan=self.plan, progress=None)  # optional hook: None when absent
            self.handle = self.call("start_stage", plan=self.plan)
            self.stopped = False
            assert self.handle is not None, (
                f"plugin {self.name!r} start_stage returned None for {self.device.device_id}: "
                "it must return a stage handle (or raise with a reason)"
            )
        return self.handle

    def stop(self) -> Any:
        if self.handle is None or self.stopped:
            return None
        self.stopped = True
        return self.call("stop_stage", stage=self.handle)
