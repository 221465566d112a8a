"""What ``edge serve``'s own endpoints answer (edge_core/runtime/serve.py, runtime/vllm_server.py), without an engine.

A fake backend's ``start_server`` answers the core's routes over a real
loopback socket, so the bodies checked are the ones a client gets; the key
check runs on vLLM's own FastAPI app type through Starlette's test client.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import threading
import time
import types
import urllib.request

import pytest

from edge_core.artifact import DEMO_MODEL
from edge_core.page import PAGE_PATH, live_page
from edge_core.runtime.documents import SCHEMA_VERSION

MIB = 1 << 20
PATHS = ("/edge/plan", "/edge/memory", PAGE_PATH)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def answering_backend() -> types.ModuleType:
    """A backend whose server answers one GET of each of :data:`PATHS` from the core's routes, then stops."""
    from edge_core import Device, hookimpl
    from edge_core.server import ServerReport

    module = types.ModuleType("edge_answering_server")
    module.EDGE_API_VERSION = 1

    @hookimpl
    def probe_devices(host):
        return [Device(device_id="gpu_discrete:fake", kind="gpu_discrete", vendor="fake", name="Fake GPU",
                       backend="fake:gpu", runnable=True, memory_pool="vram", memory_bytes=8 << 30,
                       weight_formats=("dense",), evidence={"found": "D", "runnable": "D"})]

    class Handle:
        def __init__(self, options):
            self.options = options

        def kv_cache_usage(self):  # the optional method: a quarter of the KV pool in use
            return 0.25

        def run(self):
            self.options.on_ready(self.options.url)
            for _ in PATHS:
                conn, _ = self.options.sock.accept()
                path = conn.recv(4096).decode().split()[1]
                media_type, body = self.options.routes[path]()
                conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Type: {media_type}\r\nContent-Length: {len(body)}\r\n"
                             "Connection: close\r\n\r\n".encode() + body)
                conn.close()
            return ServerReport(stopped_by="SIGTERM", requests_served=0, requests_failed=0, stage_pids=(),
                                leftover_pids=(), drained=True, seconds=0.1)

    @hookimpl
    def start_server(device, plan, options):
        return Handle(options)

    module.probe_devices, module.start_server = probe_devices, start_server
    return module


class Said:
    """An observer that keeps what the server says."""

    def __init__(self):
        self.messages: list[str] = []

    def message(self, text: str) -> None:
        self.messages.append(text)

    def step(self, text: str):
        import contextlib

        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def served():
    """One fake server's answers to each path, its plan, and what it said."""
    from edge_core.host import read_host
    from edge_core.plans import SessionSpec
    from edge_core.runtime.admission import make_plan
    from edge_core.runtime.serve import serve_plan
    from edge_core.services.registry import Registry

    registry = Registry(allow=["fake"])
    registry.register(answering_backend(), "fake")
    answers: dict[str, tuple[str, bytes]] = {}
    said = Said()
    try:
        host = read_host()
        plan = make_plan(str(DEMO_MODEL), session=SessionSpec(max_model_len=256), devices=registry.probe(host),
                         host=host, registry=registry)
        assert plan.admitted, plan.refusals
        port = free_port()

        def client() -> None:
            for path in PATHS:
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    try:
                        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
                            answers[path] = (answer.headers["content-type"], answer.read())
                            break
                    except OSError:
                        time.sleep(0.05)

        thread = threading.Thread(target=client)
        thread.start()
        serve_plan(plan, registry, host="127.0.0.1", port=port, served_model_name="demo", api_key="sekret",
                   observer=said, plan_document={**plan.to_dict(), "extra": 1})
        thread.join(30)
    finally:
        registry.unregister("fake")
    return answers, plan, said.messages, port


def test_edge_plan_and_edge_memory_carry_the_json_envelope(served):
    answers, plan, _, _ = served
    document = json.loads(answers["/edge/plan"][1])
    assert (document["schema"], document["schema_version"]) == ("edge.plan", SCHEMA_VERSION)
    assert list(document)[:2] == ["schema", "schema_version"]
    assert document["selected_device"] == "gpu_discrete:fake" and document["extra"] == 1
    memory = json.loads(answers["/edge/memory"][1])
    assert (memory["schema"], memory["schema_version"]) == ("edge.memory", SCHEMA_VERSION)
    assert memory["predicted_peak_bytes"] == plan.peak.predicted_bytes
    assert memory["held_peak_bytes"] == plan.peak.held_bytes and memory["admission_bytes"] == plan.peak.admission_bytes
    # The pool's use, as the server reports it, against the plan's pool.
    pool = next(r.bytes for r in plan.reservations if r.purpose == "kv_cache")
    assert pool == plan.kv.pool.bytes and memory["kv_pool_bytes"] == pool
    assert memory["kv_cache_usage"] == 0.25 and memory["kv_cache_used_bytes"] == pool // 4


def test_the_page_is_the_live_page_of_the_plan_document_served_at_edge_plan(served):
    answers, _, _, _ = served
    media_type, body = answers[PAGE_PATH]
    assert media_type.startswith("text/html")
    assert body.decode() == live_page(json.loads(answers["/edge/plan"][1]))


def test_the_startup_line_names_the_page_beside_the_api(served):
    _, _, messages, port = served
    line = next(m for m in messages if m.startswith("serving demo at"))
    assert f"http://127.0.0.1:{port}/v1" in line
    assert f"page at http://127.0.0.1:{port}/edge/?key=KEY" in line  # the key itself is not printed
    assert "sekret" not in "\n".join(messages)


needs_fastapi = pytest.mark.skipif(
    any(importlib.util.find_spec(name) is None for name in ("fastapi", "httpx")),
    reason="the key check runs on vLLM's FastAPI app; needs fastapi and httpx (installed with vLLM)")


@needs_fastapi
@pytest.mark.parametrize("key,headers,query,status", [
    ("sekret", {}, "", 401),
    ("sekret", {"Authorization": "Bearer wrong"}, "", 401),
    ("sekret", {"Authorization": "sekret"}, "", 401),  # not a bearer header
    ("sekret", {}, "?key=wrong", 401),
    ("sekret", {"Authorization": "Bearer sekret"}, "", 200),
    ("sekret", {}, "?key=sekret", 200),  # a browser opening the page
    (None, {}, "", 200),
])
def test_edge_routes_are_behind_the_api_key(key, headers, query, status):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from edge_core.runtime.vllm_server import VllmServer
    from edge_core.server import ServerOptions

    server = VllmServer.__new__(VllmServer)  # only the routes: no plan, no engine
    server.options = ServerOptions(host="127.0.0.1", port=0, served_model_name="demo", sock=None, api_key=key,
                                   routes={PAGE_PATH: lambda: ("text/html", b"<!doctype html>"),
                                           "/edge/memory": lambda: ("application/json", b"{}")})
    app = FastAPI()
    server._add_edge_parts(app)
    client = TestClient(app)
    for path in (PAGE_PATH, "/edge/memory"):
        answer = client.get(path + query, headers=headers)
        assert answer.status_code == status, (path, answer.text)
        if status == 401:
            assert answer.json() == {"error": "missing or wrong API key"}


def test_each_rank_is_its_worker_told_by_vllms_process_title():
    from edge_core.runtime.serve import rank_memory

    ranks = [{"rank": n, "tp_rank": n % 2, "pp_rank": n // 2} for n in range(4)]  # TP 2 x PP 2
    plan = types.SimpleNamespace(parallel={"ranks": ranks})
    titles = {10: "python -m edge_core serve", 11: "VLLM::EngineCore", 12: "VLLM::Worker_PP0_TP0",
              13: "VLLM::Worker_PP0_TP1", 14: "VLLM::Worker_PP1_TP0", 15: "VLLM::Worker_PP1_TP1_EP1", 16: None}
    processes = [(pid, pid * MIB) for pid in titles]
    got = rank_memory(plan, processes, title_of=titles.get)
    assert [(r["rank"], r["pid"], r["pss_bytes"]) for r in got] == [(0, 12, 12 * MIB), (1, 13, 13 * MIB),
                                                                    (2, 14, 14 * MIB), (3, 15, 15 * MIB)]
    # One device: no ranks, whatever the titles say.
    assert rank_memory(types.SimpleNamespace(parallel=None), processes, title_of=titles.get) == []
    tp_only = types.SimpleNamespace(parallel={"ranks": ranks[:2]})
    assert [r["pid"] for r in rank_memory(tp_only, [(7, 1), (8, 2)], title_of={7: "VLLM::Worker_TP1",
                                                                             8: "VLLM::Worker_TP0"}.get)] == [8, 7]

