"""``edge ps`` and ``edge stop``: the live edge sessions on this host, from the host-wide ledger.

Every session that runs an engine (``run``, ``serve``, ``accept``, ``parity``)
registers in :mod:`edge_core.services.host_ledger` when it is admitted, whatever venv
it runs in; ``ps`` lists them with the prediction beside the measurement,
``stop`` sends them SIGTERM (edge's clean stop) and waits for their records to go.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from ..errors import EXIT_INTERNAL, EXIT_OK, UsageError
from ._common import mib, write_document

if TYPE_CHECKING:
    from ..services.host_ledger import SessionRecord

#: Seconds `edge stop` waits for a session's record to go after SIGTERM, unless --timeout says otherwise.
STOP_TIMEOUT_S = 60.0


def add_session_commands(sub: Any) -> None:
    ps = sub.add_parser(
        "ps", help="list the live edge sessions on this host (any venv): model, devices, predicted vs measured",
        description=("List every live edge session of this user on this host, from the host-wide ledger "
                     "($XDG_RUNTIME_DIR/edge): pid, command, venv, model, devices, state, age, the predicted "
                     "peak it was admitted with, and its measured current and peak memory. Stale records "
                     "(sessions that were killed) are removed on the way."),
    )
    ps.add_argument("--json", action="store_true", help="print a JSON document (schema in docs/json.md)")
    ps.set_defaults(handler=cmd_ps)
    stop = sub.add_parser(
        "stop", help="stop live edge sessions on this host (SIGTERM: each stops its engine cleanly)",
        description=("Send SIGTERM to the front process of the named session (a pid from `edge ps`), or of every "
                     "session with `all`, and wait until each has removed its ledger record, i.e. its engine "
                     "processes are gone. Only your own sessions can be stopped."),
    )
    stop.add_argument("target", metavar="PID|all", help="a pid from `edge ps`, or all")
    stop.add_argument("--timeout", type=float, default=STOP_TIMEOUT_S, metavar="S",
                      help=f"seconds to wait for each session to end (default {STOP_TIMEOUT_S:g})")
    stop.add_argument("--json", action="store_true", help="print a JSON document (schema in docs/json.md)")
    stop.set_defaults(handler=cmd_stop)


def _age(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def cmd_ps(args: argparse.Namespace) -> int:
    from ..services.host_ledger import read_ledger

    view = read_ledger()
    now = time.time()
    if args.json:
        write_document({"directory": view.directory, "sessions": [r.to_dict() for r in view.records],
                        "removed_stale": list(view.removed_stale), "warnings": list(view.warnings)}, "ps")
        return EXIT_OK
    for warning in view.warnings:
        print(f"edge: warning: {warning}")
    if not view.records:
        print(f"no live edge sessions on this host ({view.directory})")
        return EXIT_OK
    print(f"{'PID':>7}  {'COMMAND':<12} {'STATE':<8} {'AGE':>7}  {'DEVICES':<10} {'HELD':>11} {'PREDICTED':>11} "
          f"{'NOW':>11} {'PEAK':>11}  {'KV POOL':>17}  MODEL (VENV)")
    for r in sorted(view.records, key=lambda r: r.started_at):
        print(f"{r.pid:>7}  {r.command:<12} {r.state:<8} {_age(now - r.started_at):>7}  "
              f"{','.join(r.device_ids):<10} {mib(r.held_peak_bytes or None):>11} {mib(r.predicted_peak_bytes):>11} "
              f"{mib(r.measured_current_bytes):>11} {mib(r.measured_peak_bytes):>11}  {kv_pool_cell(r):>17}  "
              f"{r.model} ({r.venv or r.interpreter})")
    print("HELD: what the session was admitted to hold (plus headroom); PREDICTED: what its tree PSS may read, "
          "file pages included; NOW, PEAK: its tree PSS; KV POOL: the engine's pool in use, of the planned pool")
    return EXIT_OK


def kv_pool_cell(record: SessionRecord) -> str:
    """``12% of 1,024 MiB``: the engine's KV pool in use (where the session reports it) against the planned pool."""
    if not record.kv_pool_bytes:
        return "-"
    if record.kv_cache_usage is None:
        return mib(record.kv_pool_bytes)
    return f"{record.kv_cache_usage:.0%} of {mib(record.kv_pool_bytes)}"


def cmd_stop(args: argparse.Namespace) -> int:
    from ..services.host_ledger import is_live, read_ledger

    view = read_ledger()
    if args.target == "all":
        targets = list(view.records)
    else:
        try:
            pid = int(args.target)
        except ValueError:
            raise UsageError(f"edge stop takes a pid from `edge ps` or all, not {args.target!r}") from None
        targets = [r for r in view.records if r.pid == pid]
        if not targets:
            raise UsageError(f"no live edge session with pid {pid} on this host (`edge ps` lists them)")
    results = []
    for record in targets:
        try:
            os.kill(record.pid, signal.SIGTERM)
            sent = True
        except ProcessLookupError:
            sent = False  # already gone; its record goes with the next read
        except PermissionError:
            results.append({"pid": record.pid, "stopped": False, "why": "not your process"})
            continue
        deadline = time.monotonic() + args.timeout
        while is_live(record) and time.monotonic() < deadline:
            time.sleep(0.2)
        stopped = not is_live(record)
        results.append({"pid": record.pid, "model": record.model, "signalled": sent, "stopped": stopped,
                        "why": None if stopped else f"still running after {args.timeout:g} s"})
    read_ledger()  # removes the records of what ended
    if args.json:
        write_document({"sessions": results}, "stop")
    else:
        for r in results:
            print(f"{r['pid']}: {'stopped' if r['stopped'] else 'NOT stopped: ' + str(r['why'])}")
        if not results:
            print("no live edge sessions to stop")
    return EXIT_OK if all(r["stopped"] for r in results) else EXIT_INTERNAL
