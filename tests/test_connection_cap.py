"""The connection cap ``edge serve`` holds its server to (edge_core/runtime/connection_cap.py).

On a real FastAPI app wired the way vLLM's server is (edge's parts added by
:meth:`VllmServer._add_edge_parts`), driven through httpx's ASGI transport:
requests held open inside the app fill the cap, one more is refused at once
with the reason, watchers still get through, and a finished or failed
request gives its place back. No engine, no socket.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json

import pytest

from edge_core.runtime.connection_cap import RETRY_AFTER_S, ConnectionCap

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("fastapi", "httpx")),
    reason="the cap runs on vLLM's FastAPI app; needs fastapi and httpx (installed with vLLM)")


def capped_app(limit: int | None):
    """A FastAPI app whose POST holds each request until released, with edge's parts added as the server adds them."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    from edge_core.runtime.vllm_server import VllmServer
    from edge_core.server import ServerOptions

    app = FastAPI()
    app.state.inside = 0
    app.state.release = asyncio.Event()

    @app.post("/v1/completions")
    async def complete(body: dict):  # a string annotation FastAPI resolves from builtins
        app.state.inside += 1
        try:
            await app.state.release.wait()
            if body.get("fail"):
                raise RuntimeError("the engine failed this one")
            return JSONResponse({"choices": [{"text": "ok", "finish_reason": "stop"}]})
        finally:
            app.state.inside -= 1

    @app.get("/health")
    async def health():
        return {}

    app.middleware_stack = app.build_middleware_stack()  # vLLM's app comes to edge with its stack built
    server = VllmServer.__new__(VllmServer)  # only edge's parts: no plan, no engine
    server.options = ServerOptions(host="127.0.0.1", port=0, served_model_name="demo", sock=None,
                                   max_connections=limit)
    server._add_edge_parts(app)
    return app


async def fill(client, app, count: int, **body):
    """``count`` POSTs held inside the app (tasks), once every one of them is in."""
    tasks = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(count)]
    for _ in range(500):
        if app.state.inside == count:
            return tasks
        await asyncio.sleep(0.01)
    raise AssertionError(f"{app.state.inside} of {count} requests reached the app")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_one_request_over_the_cap_is_refused_at_once_with_the_reason_and_the_cap():
    import httpx

    async def scenario():
        app = capped_app(3)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as client:
            held = await fill(client, app, 3)
            over = await client.post("/v1/completions", json={})
            watched = await client.get("/health")  # a watcher is not a connection to the model
            inside_when_refused = app.state.inside
            app.state.release.set()
            done = await asyncio.gather(*held)
        return over, watched, inside_when_refused, done

    over, watched, inside, done = run(scenario())
    assert over.status_code == 503
    assert over.headers["retry-after"] == str(RETRY_AFTER_S) and over.headers["connection"] == "close"
    error = over.json()["error"]
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "connection cap" in error["message"] and "--max-connections 3" in error["message"]
    assert inside == 3  # the refused request never reached the app
    assert watched.status_code == 200
    assert [answer.status_code for answer in done] == [200, 200, 200]


def test_a_finished_or_failed_request_gives_its_place_back():
    import httpx

    async def scenario():
        app = capped_app(2)
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            failing = await fill(client, app, 2, fail=True)
            app.state.release.set()
            failed = await asyncio.gather(*failing)
            app.state.release.clear()
            again = await fill(client, app, 2)  # both places are free again
            over = await client.post("/v1/completions", json={})
            app.state.release.set()
            return failed, await asyncio.gather(*again), over

    failed, again, over = run(scenario())
    assert [answer.status_code for answer in failed] == [500, 500]
    assert [answer.status_code for answer in again] == [200, 200]
    assert over.status_code == 503


def test_without_a_cap_nothing_is_refused():
    import httpx

    async def scenario():
        app = capped_app(None)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as client:
            held = await fill(client, app, 20)
            app.state.release.set()
            return await asyncio.gather(*held)

    assert {answer.status_code for answer in run(scenario())} == {200}


@pytest.mark.parametrize("limit", [0, -1])
def test_a_cap_below_one_is_refused(limit):
    with pytest.raises(ValueError, match="at least 1"):
        ConnectionCap(lambda scope, receive, send: None, limit)


def test_the_refusal_body_is_the_openai_error_shape_vllm_uses():
    from edge_core.runtime.connection_cap import over_cap_body

    body = json.loads(over_cap_body(64))
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
