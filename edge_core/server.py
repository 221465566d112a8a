"""What a backend's server is asked to do: the address, the names, and edge's own endpoints beside the runtime's.

``edge serve`` puts an admitted plan in front of the runtime's own
OpenAI-compatible server (vLLM's, for the vLLM backends). The core binds the
listening socket before anything loads (so a port in use is an error in
milliseconds, not after a 20 s engine start) and hands it over in
:class:`ServerOptions`, with the GET endpoints edge adds (``/edge/plan``,
``/edge/memory``, ``/edge/metrics``) as callables. The backend's
``start_server`` hook returns a :class:`ServerHandle`; its ``run()`` serves in
the calling thread (the main thread: the server owns SIGINT and SIGTERM) until
one of them arrives, and returns a :class:`ServerReport`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

#: A GET endpoint edge adds: returns (media type, body).
Route = Callable[[], tuple[str, bytes]]


@dataclass(frozen=True)
class ServerOptions:
    """How to serve: where, under which model name, with which key, and what edge adds.

    ``sock`` is already bound and listening on ``host:port``. ``drain_timeout_s``
    is how long in-flight requests may finish after a stop signal before they
    are aborted. ``on_ready`` is called once with the base URL when the
    server answers ``/health``. Where the runtime's own output goes is the
    session's engine log (``EDGE_ENGINE_LOG``), as for every engine start.
    ``max_connections`` is the plan's cap on requests to the model open at
    once (``--max-connections``; None: no cap): the server answers one more
    with 503 and why (:class:`edge_core.runtime.connection_cap.ConnectionCap`).
    """

    host: str
    port: int
    served_model_name: str
    sock: socket.socket
    api_key: str | None = None
    drain_timeout_s: float = 5.0
    max_connections: int | None = None
    routes: Mapping[str, Route] = field(default_factory=dict)
    on_ready: Callable[[str], None] | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class ServerReport:
    """How a server's life ended: the signal that stopped it, requests served, and its processes."""

    stopped_by: str | None
    requests_served: int
    requests_failed: int
    stage_pids: tuple[int, ...]
    leftover_pids: tuple[int, ...]
    drained: bool
    seconds: float
    extras: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "stopped_by": self.stopped_by,
            "requests_served": self.requests_served,
            "requests_failed": self.requests_failed,
            "stage_pids": list(self.stage_pids),
            "leftover_pids": list(self.leftover_pids),
            "drained": self.drained,
            "seconds": round(self.seconds, 3),
            **dict(self.extras),
        }


class ServerHandle(Protocol):
    """What ``start_server`` returns.

    A handle may also have ``kv_cache_usage() -> float | None``: the share of
    the engine's KV pool in use now (0..1; vLLM's ``vllm:kv_cache_usage_perc``),
    None before the engine reports it. ``edge serve`` shows it against the
    plan's pool (``/edge/memory``, ``edge ps``); a handle without it shows none.
    """

    def run(self) -> ServerReport:
        """Start the engine, serve until SIGTERM/SIGINT, stop, and report; blocks the calling (main) thread."""
        ...
