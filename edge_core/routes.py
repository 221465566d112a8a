"""Which runtime reaches a device from here — this interpreter, another one, or none — and why.

An iGPU or an NPU is reached through a *route*: a runtime distribution (ONNX
Runtime's DirectML or VitisAI build, torch-directml) living in some kind of
interpreter (a native Windows Python, Linux under WSL, native Linux). Two
backends share this mechanism (edge-dml's two DirectML routes and edge-vitisai's
VitisAI route), so it lives once, here, and stays import-free: a route resolves
from installed metadata, never by importing the runtime.

Routes are listed in a backend's order of preference as runs found it, not an
assumed one: DirectML under WSL ran slower than the CPU it shares memory with
(docs/igpu-npu-facts.md), so that route ranks last and says so. Every route that does
not resolve says why: not installed here (what to install), installed beside
a clashing build, or living in another interpreter (which one, and how to reach
it). The statuses travel in ``Device.extras["routes"]`` so a planner — even one
reading a device list captured on another machine — can name the route a
refusal is about without importing the backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import builds

if TYPE_CHECKING:
    from .devices import Device

#: Interpreter kinds a route can live in. ``wsl`` is Linux under WSL 2, where a
#: Windows interpreter is reachable as another process (``python.exe`` through
#: WSL interop), but the Windows-only runtimes cannot load into this one.
INTERPRETERS = ("windows", "wsl", "linux")

#: The key of ``Device.extras`` that carries the route statuses (best first).
ROUTES_EXTRA = "routes"

#: Which interpreter kinds can hand work to an interpreter of another kind on
#: the same machine: from WSL, a Windows Python is one ``python.exe`` away.
REACHABLE_FROM = {"wsl": ("windows",)}

#: How a message names each interpreter kind.
INTERPRETER_NAMES = {
    "windows": "a native Windows Python",
    "wsl": "a Linux Python under WSL 2",
    "linux": "a native Linux Python",
}


@dataclass(frozen=True)
class Route:
    """One way to reach a device: a runtime, the interpreter it lives in, what it executes.

    ``provider`` is the ONNX Runtime execution provider the route targets (None
    for a torch route). ``preference_note`` carries the measurement behind the
    route's rank where there is one.
    """

    backend: str
    interpreter: str
    distribution: str
    formats: tuple[str, ...]
    install: str
    provider: str | None = None
    #: Distributions that install the same import package and overwrite it.
    conflicts: tuple[str, ...] = ()
    preference_note: str | None = None

    def __post_init__(self) -> None:
        if self.interpreter not in INTERPRETERS:
            raise ValueError(f"route {self.backend!r}: interpreter {self.interpreter!r} is not one of "
                             f"{', '.join(INTERPRETERS)}")
        object.__setattr__(self, "formats", tuple(self.formats))

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "interpreter": self.interpreter,
            "distribution": self.distribution,
            "formats": list(self.formats),
            "provider": self.provider,
            "install": self.install,
            "preference_note": self.preference_note,
        }


@dataclass(frozen=True)
class RouteStatus:
    """A route as seen from this interpreter: usable here, or why not and where it would be.

    ``where`` is ``here`` (this interpreter), ``another_interpreter`` (it lives
    in an interpreter this one can start, e.g. Windows Python from WSL) or
    ``elsewhere`` (not on this machine's reach from here). ``rank`` is the
    route's place in the backend's preference order (0 first).
    """

    route: Route
    rank: int
    available: bool
    where: str
    reason: str | None = None
    version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.route.to_dict(),
            "rank": self.rank,
            "available": self.available,
            "where": self.where,
            "reason": self.reason,
            "version": self.version,
        }


@dataclass(frozen=True)
class Resolution:
    """Every route's status in preference order, and the one that resolved (or None)."""

    statuses: tuple[RouteStatus, ...]

    @property
    def resolved(self) -> RouteStatus | None:
        return next((s for s in self.statuses if s.available), None)

    @property
    def reason(self) -> str | None:
        """Why no route resolved, every route's reason joined; None when one did."""
        if self.resolved is not None:
            return None
        # Routes out of reach from here (a WSL route seen from Windows) are noise in a remedy.
        near = [s.reason for s in self.statuses if s.reason and s.where != "elsewhere"]
        reasons = near or [s.reason for s in self.statuses if s.reason]
        return "; ".join(reasons) or "no route to this device is known"

    def to_list(self) -> list[dict[str, Any]]:
        return [s.to_dict() for s in self.statuses]


#: Looks up an installed distribution: name -> version, or None when absent.
VersionOf = Callable[[str], "str | None"]
#: Decides whether a route's runtime is installed here: route -> (version, why not).
Check = Callable[[Route], "tuple[str | None, str | None]"]


def default_check(version_of: VersionOf) -> Check:
    """Installed and not clashing with a build that overwrites the same import package."""

    def check(route: Route) -> tuple[str | None, str | None]:
        version = version_of(route.distribution)
        if version is None:
            return None, f"{route.distribution} is not installed in this interpreter: {route.install}"
        clashing = [name for name in route.conflicts if version_of(name) is not None]
        if clashing:
            return None, (f"{route.distribution} {version} is installed beside {', '.join(clashing)}; they "
                          f"overwrite the same package: pip uninstall {' '.join(clashing)}, then reinstall "
                          f"{route.distribution}")
        return version, None

    return check


def resolve(routes: Iterable[Route], here: str, *, check: Check | None = None,
            version_of: VersionOf | None = None) -> Resolution:
    """Resolve ``routes`` (in preference order) from an interpreter of kind ``here``.

    A route living in this kind of interpreter resolves when ``check`` says its
    runtime is installed (default: :func:`default_check` over ``version_of``,
    itself defaulting to :func:`edge_core.builds.installed_version`). A route
    of another interpreter kind never resolves here; its reason names that
    interpreter and whether this one can reach it.
    """
    if check is None:
        if version_of is None:
            def version_of(name: str) -> str | None:  # looked up at call time: tests patch it
                return builds.installed_version(name)

        check = default_check(version_of)
    statuses = []
    for rank, route in enumerate(routes):
        if route.interpreter == here:
            version, why = check(route)
            statuses.append(RouteStatus(route, rank, version is not None and why is None, "here", why, version))
            continue
        lives_in = INTERPRETER_NAMES[route.interpreter]
        if route.interpreter in REACHABLE_FROM.get(here, ()):
            this = INTERPRETER_NAMES.get(here, here)
            why = (f"{route.backend} lives in {lives_in}, not in this interpreter ({this}): run edge from that "
                   f"interpreter, with {route.install}")
            statuses.append(RouteStatus(route, rank, False, "another_interpreter", why))
        else:
            why = f"{route.backend} lives in {lives_in}; this is {INTERPRETER_NAMES.get(here, here)}"
            statuses.append(RouteStatus(route, rank, False, "elsewhere", why))
    return Resolution(tuple(statuses))


def statuses_of(device: Device) -> list[Mapping[str, Any]]:
    """The route statuses a backend recorded on ``device`` (dicts, best first); [] when none."""
    extras = getattr(device, "extras", None) or {}
    routes = extras.get(ROUTES_EXTRA) if isinstance(extras, Mapping) else None
    return [r for r in routes if isinstance(r, Mapping)] if isinstance(routes, list) else []


def resolved_of(device: Device) -> Mapping[str, Any] | None:
    """The route that resolved for ``device``: the first available one matching its backend."""
    statuses = statuses_of(device)
    for status in statuses:
        if status.get("available") and status.get("backend") == getattr(device, "backend", None):
            return status
    return next((s for s in statuses if s.get("available")), None)
