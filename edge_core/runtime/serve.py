"""``edge serve``: an admitted plan in front of the runtime's own OpenAI-compatible server, watched while it serves.

:func:`serve_plan` is the order of things, the same for every backend that
implements ``start_server``:

1. the address is bound before anything loads (:func:`bind_listener`), so a
   port in use is an error naming the port and its holder in milliseconds;
2. the backend prepares the device (``prepare_stage``), the session's reaper
   starts (:class:`~edge_core.runtime.reaper.SessionReaper`: if edge is killed
   without a chance to stop, ``kill -9`` or the OOM killer, the engine
   processes die with it), then the memory baseline is taken and the 0.25 s
   process-tree sampler starts: the same
   :class:`~edge_core.runtime.session.StageSession` as ``edge run``, told
   that the server starts the engine;
3. the backend's server runs in this thread until SIGTERM or SIGINT, with
   edge's endpoints beside the runtime's: ``/edge/`` (a page: the plan drawn
   against capacity, the live memory against the prediction), ``/edge/plan``
   (the plan document), ``/edge/memory`` (predicted vs sampled, JSON) and
   ``/edge/metrics`` (the same as Prometheus gauges);
4. a watcher compares the sampled peak with the prediction every period: the
   first time the measurement exceeds it, it says so loudly, once, and counts
   it (``edge_memory_over_prediction_total``) — the plan was wrong;
5. after the stop: every engine process reaped, the port free, the lifetime
   summary (requests served, predicted vs sampled peak) as a record.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import StageError, UsageError
from ..page import PAGE_PATH, live_page
from ..server import ServerOptions
from ..services.host_ledger import current, set_state
from .documents import enveloped
from .env import versions
from .logs import EngineLog
from .measure import DEFAULT_PERIOD_S, ProcessTreeSampler, read_title
from .processes import children_alive
from .session import Observer, SilentObserver, StageSession, plan_summary

if TYPE_CHECKING:
    from ..plans import Plan
    from ..services.registry import Registry

#: Addresses that reach only this machine; anything else without an API key gets a warning.
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or a UsageError naming the port and, when found, its holder."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise UsageError(f"port {port} on {host} is already in use{port_holder(port)}; stop that process or "
                             "pick another with --port") from None
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; check --host and --port") from None
    sock.set_inheritable(False)
    return sock


def port_holder(port: int) -> str:
    """`` by pid N (command)`` for the process listening on ``port``, when this user may see it."""
    import psutil

    try:
        for conn in psutil.net_connections(kind="tcp"):
            if conn.laddr and conn.laddr.port == port and conn.status == psutil.CONN_LISTEN and conn.pid:
                try:
                    cmd = " ".join(psutil.Process(conn.pid).cmdline()[:4])
                except psutil.Error:
                    cmd = "?"
                return f" by pid {conn.pid} ({cmd})"
    except (psutil.Error, OSError):
        pass
    return ""


class MemoryWatch:
    """Predicted vs sampled while the server runs: the live figures, and a loud note the first time it is exceeded."""

    def __init__(self, plan: Plan, sampler: ProcessTreeSampler, observer: Observer, counter: str):
        assert plan.peak is not None
        self.plan = plan
        self.sampler = sampler
        self.observer = observer
        self.counter = counter
        self.predicted_bytes = plan.peak.predicted_bytes
        self.held_bytes = plan.peak.held_bytes
        self.kv_pool_bytes = sum(r.bytes for r in plan.reservations if r.purpose == "kv_cache")
        #: The server's ``kv_cache_usage`` (:class:`~edge_core.server.ServerHandle`), once it has one.
        self.kv_usage: Callable[[], float | None] | None = None
        self.kv_cache_usage: float | None = None
        self.exceeded = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="edge-memory-watch", daemon=True)

    def start(self) -> MemoryWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def snapshot(self) -> dict[str, Any]:
        self.read_kv_usage()
        report = self.sampler.report()
        entry = report.counter(self.counter)
        last = self.sampler.last_sample
        current = last.value(self.counter) if last is not None else None
        baseline = entry.baseline_bytes
        usage = self.kv_cache_usage
        return {
            "counter": self.counter,
            "predicted_peak_bytes": self.predicted_bytes,
            "held_peak_bytes": self.held_bytes,
            "admission_bytes": self.plan.peak.admission_bytes if self.plan.peak is not None else None,
            "kv_pool_bytes": self.kv_pool_bytes,
            "kv_cache_usage": usage,
            "kv_cache_used_bytes": int(usage * self.kv_pool_bytes) if usage is not None else None,
            "measured_peak_bytes": entry.attributable_peak_bytes,
            "measured_current_bytes": (current - baseline) if current is not None and baseline is not None else None,
            "ratio": (round(self.predicted_bytes / entry.attributable_peak_bytes, 4)
                      if entry.attributable_peak_bytes else None),
            "exceeded_count": self.exceeded,
            "samples": report.sample_count,
            "note": report.note,
            "ranks": rank_memory(self.plan, last.process_pss_bytes if last is not None else ()),
        }

    def _loop(self) -> None:
        while not self._stop.wait(DEFAULT_PERIOD_S):
            self.read_kv_usage()
            peak = self.sampler.report().counter(self.counter).attributable_peak_bytes
            if peak is not None and peak > self.predicted_bytes:
                self.exceeded += 1
                if self.exceeded == 1:
                    self.observer.message(
                        f"WARNING: measured {self.counter} peak {peak / 2**20:,.0f} MiB exceeds the predicted "
                        f"{self.predicted_bytes / 2**20:,.0f} MiB: the plan under-predicted this session; "
                        "please report it with `edge plan --json` and this server's /edge/memory")

    def read_kv_usage(self) -> None:
        """Ask the server how much of its KV pool is in use; a change goes into this session's ledger record."""
        usage = self.kv_usage() if self.kv_usage is not None else None
        if usage is not None and usage != self.kv_cache_usage:
            self.kv_cache_usage = min(max(float(usage), 0.0), 1.0)
            registration = current()
            if registration is not None:
                registration.update(kv_cache_usage=self.kv_cache_usage)

    def prometheus(self) -> bytes:
        snap = self.snapshot()
        lines = [
            "# HELP edge_memory_predicted_peak_bytes The plan's predicted session peak.",
            "# TYPE edge_memory_predicted_peak_bytes gauge",
            f'edge_memory_predicted_peak_bytes{{counter="{self.counter}"}} {snap["predicted_peak_bytes"]}',
            "# HELP edge_memory_measured_peak_bytes Sampled attributable peak (a lower bound).",
            "# TYPE edge_memory_measured_peak_bytes gauge",
            f'edge_memory_measured_peak_bytes{{counter="{self.counter}"}} {snap["measured_peak_bytes"] or 0}',
            "# HELP edge_memory_measured_current_bytes Sampled attributable bytes now.",
            "# TYPE edge_memory_measured_current_bytes gauge",
            f'edge_memory_measured_current_bytes{{counter="{self.counter}"}} {snap["measured_current_bytes"] or 0}',
            "# HELP edge_memory_over_prediction_total Samples whose peak exceeded the prediction.",
            "# TYPE edge_memory_over_prediction_total counter",
            f"edge_memory_over_prediction_total {self.exceeded}",
            "# HELP edge_memory_held_peak_bytes The plan's held peak (what admission counts, less headroom).",
            "# TYPE edge_memory_held_peak_bytes gauge",
            f"edge_memory_held_peak_bytes {self.held_bytes}",
            "# HELP edge_kv_pool_bytes The plan's KV pool on this device.",
            "# TYPE edge_kv_pool_bytes gauge",
            f"edge_kv_pool_bytes {self.kv_pool_bytes}",
        ]
        if snap["kv_cache_used_bytes"] is not None:
            lines += ["# HELP edge_kv_pool_used_bytes The KV pool in use (the engine's usage times the plan's pool).",
                      "# TYPE edge_kv_pool_used_bytes gauge",
                      f"edge_kv_pool_used_bytes {snap['kv_cache_used_bytes']}"]
        return ("\n".join(lines) + "\n").encode()


#: vLLM's multiprocessing executor titles each worker ``VLLM::Worker[_PP<p>][_TP<t>]`` (its
#: ``set_process_title``); the suffixes are present only where that group has more than one rank.
WORKER_TITLE = re.compile(r"::Worker(?:_DP\d+)?(?:_PP(?P<pp>\d+))?(?:_PCP\d+)?(?:_TP(?P<tp>\d+))?(?:_|$)")


def rank_memory(plan: Plan, processes: Iterable[tuple[int, int]],
                title_of: Callable[[int], str | None] | None = None) -> list[dict[str, Any]]:
    """Each of this host's ranks of a parallel plan with its worker's PSS; [] for a one-device plan.

    A worker is told by its process title (``title_of``: default :func:`~.measure.read_title`), matched to
    the plan's rank with the same TP and PP rank.
    """
    ranks = (plan.parallel or {}).get("ranks") or ()
    if len(ranks) < 2:
        return []
    by_group = {(int(r.get("tp_rank", 0)), int(r.get("pp_rank", 0))): r for r in ranks}
    found = []
    for pid, pss in processes:
        title = (title_of or read_title)(pid)
        match = WORKER_TITLE.search(title or "")
        if match is None:
            continue
        rank = by_group.get((int(match["tp"] or 0), int(match["pp"] or 0)))
        if rank is not None:
            found.append({"rank": rank.get("rank"), "tp_rank": rank.get("tp_rank"), "pp_rank": rank.get("pp_rank"),
                          "pid": pid, "pss_bytes": pss})
    return sorted(found, key=lambda r: (r["rank"] is None, r["rank"]))


def serve_plan(plan: Plan, registry: Registry, *, host: str, port: int, served_model_name: str,
               api_key: str | None = None, drain_timeout_s: float = 5.0, observer: Observer | None = None,
               engine_log: EngineLog | None = None, plan_document: dict[str, Any] | None = None) -> dict[str, Any]:
    """Serve an admitted ``plan`` until SIGTERM/SIGINT; return the lifetime record.

    ``plan_document`` is what ``/edge/plan`` answers, as the ``edge.plan`` document (default: ``plan.to_dict()``).
    Raises :class:`UsageError` for an address that cannot be bound and
    :class:`StageError` when the backend cannot serve or its server fails.
    """
    said: Observer = observer or SilentObserver()
    device, manifest = plan.selected()
    owner = registry.owner(device)
    if owner is None or "start_server" not in owner.hooks:
        raise StageError(f"serve_unsupported: the backend that runs {device.device_id} ({plan.backend}) has no "
                         "start_server hook, so edge cannot put this plan behind a server; `edge run` runs it once")
    if host not in LOOPBACK_HOSTS and not api_key:
        said.message(f"WARNING: serving on {host}, reachable from other machines, without --api-key: anyone who "
                     "can reach the port can use the model")
    sock = bind_listener(host, port)
    # The engine is the server's to start: the session prepares, reaps and measures around it.
    session = StageSession(plan, registry, said, engine_log=engine_log, starts_stage=False)
    try:
        with session:
            assert session.sampler is not None
            # A private pool is watched on the backend's device counter; without one, on the process tree.
            headline = "device" if device.memory_pool != "host_ram" and session.counter is not None else "tree_pss"
            watch = MemoryWatch(plan, session.sampler, said, headline).start()
            try:
                served = _run_server(plan, registry, watch, said, ServerOptions(
                    host=host, port=port, served_model_name=served_model_name, sock=sock, api_key=api_key,
                    drain_timeout_s=drain_timeout_s, max_connections=plan.session.max_connections), plan_document)
            finally:
                watch.stop()
    finally:
        sock.close()
    return {
        "outcome": "stopped",
        "stopped_by": served.report.stopped_by,
        "model": plan.model_path,
        "served_model_name": served_model_name,
        "artifact_id": manifest.artifact_id,
        "device": device.device_id,
        "url": served.url,
        "timings": {"ready_s": round(served.ready_s, 3) if served.ready_s is not None else None,
                    "lifetime_s": round(time.monotonic() - served.started, 3)},
        "server": served.report.to_dict(),
        "memory": session.memory(),
        "memory_exceeded_count": watch.exceeded,
        "processes_left": children_alive(),
        "plan": plan_summary(plan),
        "node_prep": session.node_prep.to_dict() if session.node_prep is not None else None,
        "versions": versions(),
    }


@dataclass
class Served:
    """How the backend's server ran: its report, when it started (monotonic) and, once ready, where and how soon."""

    report: Any = None
    started: float = 0.0
    url: str | None = None
    ready_s: float | None = None


def _run_server(plan: Plan, registry: Registry, watch: MemoryWatch, said: Observer, options: ServerOptions,
                plan_document: dict[str, Any] | None) -> Served:
    """The backend's server with edge's endpoints beside its own, run in this thread until it stops."""
    device, manifest = plan.selected()
    name, api_key = options.served_model_name, options.api_key
    document = enveloped("plan", plan_document if plan_document is not None else plan.to_dict())
    page = live_page(document).encode()
    served = Served()
    loading = contextlib.ExitStack()  # the "loading" step: ended "done" when the server is ready
    loading.enter_context(said.step(f"loading {manifest.architecture or manifest.model_type} on {device.device_id} "
                                    f"for {name}"))

    def on_ready(url: str) -> None:
        served.url, served.ready_s = url, time.monotonic() - served.started
        set_state("serving")  # the host ledger's record (edge ps)
        loading.close()
        said.message(f"serving {name} at {url}/v1 (plan: {device.device_id}, "
                     f"{plan.session.max_num_seqs} sequences x {plan.session.max_model_len} tokens, predicted "
                     f"peak {watch.predicted_bytes / 2**20:,.0f} MiB); page at {url}{PAGE_PATH}"
                     f"{'?key=KEY' if api_key else ''}; plan at {url}/edge/plan; Ctrl-C stops")

    options = dataclasses.replace(options, on_ready=on_ready, routes={
        PAGE_PATH: lambda: ("text/html; charset=utf-8", page),
        "/edge/plan": lambda: ("application/json", json.dumps(document, default=str).encode()),
        "/edge/memory": lambda: ("application/json", json.dumps(enveloped("memory", watch.snapshot())).encode()),
        "/edge/metrics": lambda: ("text/plain; version=0.0.4", watch.prometheus()),
    })
    try:
        served.started = time.monotonic()
        handle = registry.call_owner(device, "start_server", plan=plan, options=options)
        if handle is None:
            owner = registry.owner(device)
            raise StageError(f"serve_unsupported: {owner.name if owner else plan.backend}'s start_server returned "
                             f"no server for {device.device_id}")
        watch.kv_usage = getattr(handle, "kv_cache_usage", None)
        served.report = handle.run()
    finally:
        loading.__exit__(StageError, None, None)  # never ready: the step ends "stopped" (a no-op once closed)
    return served
