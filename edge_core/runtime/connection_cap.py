"""How many requests to the model ``edge serve`` holds open at once, and what one more is told.

Each request that reaches the engine holds its connection and some state
in the server and the engine core while it runs, waits behind
``--max-num-seqs`` or streams to a slow reader; the plan reserves that state
for ``--max-connections`` of them. :class:`ConnectionCap` is the ASGI
middleware that holds the server to it: one request over the cap is answered
at once with 503, an OpenAI-style error body that names the cap and the
flag, ``Retry-After`` and ``Connection: close``, and never reaches the app.
GET and HEAD requests (``/health``, ``/metrics``, ``/v1/models``, edge's
``/edge/...``) hold no engine state and are not counted, so a server at its
cap can still be watched.

uvicorn's own ``limit_concurrency`` is not used: it answers before the app
with a bare ``Service Unavailable`` and counts every connection, watchers
included.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Methods that read the server's state and never reach the engine: not counted against the cap.
UNCOUNTED_METHODS = frozenset({"GET", "HEAD"})
#: Seconds a refused client is asked to wait before it tries again (``Retry-After``).
RETRY_AFTER_S = 1


def over_cap_body(limit: int) -> bytes:
    """The 503's body, in the OpenAI error format vLLM's own errors use: what happened, the cap, and what to do."""
    message = (f"edge serve is at its connection cap: {limit} requests to the model are open (running, queued "
               f"or streaming; --max-connections {limit}); retry in {RETRY_AFTER_S} s, or start the server with a "
               "larger --max-connections (the plan reserves memory for each)")
    return json.dumps({"error": {"message": message, "type": "ServiceUnavailableError", "param": None,
                                 "code": 503}}).encode()


class ConnectionCap:
    """ASGI middleware: at most ``limit`` counted requests in the app at once; one more gets :func:`over_cap_body`."""

    def __init__(self, app: App, limit: int):
        if limit < 1:
            raise ValueError(f"a connection cap must be at least 1, got {limit}")
        self.app = app
        self.limit = limit
        self.open = 0
        self.refused = 0
        self._body = over_cap_body(limit)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in UNCOUNTED_METHODS:
            await self.app(scope, receive, send)
            return
        if self.open >= self.limit:
            self.refused += 1
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(self._body)).encode()),
                (b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": self._body})
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
