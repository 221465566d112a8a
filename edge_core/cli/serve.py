"""``edge serve``: plan, then put the admitted plan behind the runtime's own OpenAI-compatible server.

Parse -> plan (a refusal exits 2 before any port is opened) ->
:func:`edge_core.runtime.serve.serve_plan` -> render the lifetime summary.
Exit 0 after SIGTERM, 130 after SIGINT, 64 for an address that cannot be bound.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_REFUSED, UsageError
from ..plans import Refusal
from ._common import mask_option, mib, plugin_options, positive_int, write_document
from .plan import planning_options, print_plan
from .progress import TerminalObserver, say
from .run import engine_log_from, engine_log_options, headless, joined_nodes, plan_here, refused, run_node

#: Sequences decoded at once when serving, unless --max-num-seqs says otherwise: an editor, a chat UI
#: and a script or two talk to one local server at a time; more wait. They share one KV pool (sized to
#: hold this many at full context where that fits); the plan prints how many it holds and how many the
#: device could take.
SERVE_MAX_NUM_SEQS = 8
#: Seconds in-flight requests may finish after SIGTERM/SIGINT before they are aborted.
DEFAULT_DRAIN_TIMEOUT_S = 5.0
#: Requests to the model held open at once unless --max-connections says otherwise (or twice --max-num-seqs, where
#: that is more): 8 running and 56 waiting; 3 MiB reserved at short prompts, 48 MiB at SmolLM2's 8,192 tokens
#: (docs/benchmarks.md, "What an open connection costs").
SERVE_MAX_CONNECTIONS = 64


def add_serve_command(sub: Any) -> None:
    serve = sub.add_parser(
        "serve", help="plan, then serve the model through vLLM's OpenAI-compatible server",
        description=("Plan first (a refusal exits 2 before any port is opened or anything loads), check the "
                     "address, then start vLLM's own OpenAI-compatible server with the plan's engine arguments. "
                     "Besides vLLM's /v1 endpoints: /edge/ (a page: the plan against capacity and the live "
                     "memory), /edge/plan (the plan), /edge/memory and /edge/metrics (predicted vs measured "
                     "memory). SIGTERM drains and exits 0; Ctrl-C drains and exits 130; a second Ctrl-C forces "
                     "the stop."),
    )
    serve.add_argument("--json", action="store_true", help="print the lifetime record as JSON when the server stops")
    plugin_options(serve)
    mask_option(serve)
    planning_options(serve, max_num_seqs=SERVE_MAX_NUM_SEQS)
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default 127.0.0.1: this machine only; another address without "
                            "--api-key prints a warning)")
    serve.add_argument("--port", type=positive_int, default=8000, help="port to bind (default 8000)")
    serve.add_argument("--served-model-name", metavar="NAME",
                       help="the model name clients ask for (default: the model directory's name)")
    serve.add_argument("--api-key", metavar="KEY", default=os.environ.get("EDGE_API_KEY"),
                       help="require this bearer key on /v1 and /edge (passed to vLLM's server; env EDGE_API_KEY); "
                            "a browser gives it to /edge/ as ?key=KEY")
    serve.add_argument("--max-connections", type=positive_int, metavar="N",
                       help=f"requests to the model held open at once: running, queued behind --max-num-seqs or "
                            f"streaming (default {SERVE_MAX_CONNECTIONS}, or twice --max-num-seqs where that is "
                            "more); one more is answered 503 with the reason at once. The plan reserves memory for "
                            "each; GET endpoints are not counted")
    serve.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S, metavar="S",
                       help=f"seconds in-flight requests may finish after a stop signal (default "
                            f"{DEFAULT_DRAIN_TIMEOUT_S:g})")
    engine_log_options(serve)
    serve.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.max_connections is None:  # as many may wait as run, at least
        args.max_connections = default_max_connections(args.max_num_seqs)
    plan, registry, plan_s = plan_here(args)
    if headless(args):
        return run_node(args, plan, registry, plan_s, "serve")
    if not plan.admitted:
        return refused(args, plan, plan_s, "serve")
    device, manifest = plan.selected()
    owner = registry.owner(device)
    if owner is None or "start_server" not in owner.hooks:
        refusal = Refusal(code="serve_unsupported", device_id=device.device_id,
                          message=f"the backend that runs {device.device_id} ({plan.backend}) cannot serve: it has "
                                  "no start_server hook",
                          remedy="run the model once with `edge run`, or install a backend that serves this device")
        if args.json:
            write_document({"outcome": "refused", "refusals": [refusal.to_dict()], "plan": plan.to_dict()}, "serve")
        else:
            print_plan(plan, plan_s, explain=args.explain)
            print(f"  refused   [{refusal.code}] {device.device_id}: {refusal.message}")
            print(f"            remedy: {refusal.remedy}")
        return EXIT_REFUSED
    from ..plan.concurrency import full_context_sequences
    from ..runtime.serve import serve_plan

    fit = full_context_sequences(plan, registry)
    document = {**plan.to_dict(), "decision_time_s": round(plan_s, 4), "full_context_sequences_that_fit": fit}
    if not args.json:
        print_plan(plan, plan_s, explain=args.explain)
        held = plan.kv.pool.full_length_sequences if plan.kv is not None and plan.kv.pool is not None else 0
        print(f"  serve     up to {plan.session.max_num_seqs} sequences at once (--max-num-seqs), the rest waiting, "
              f"{plan.session.max_connections} requests open at most (--max-connections; one more is answered 503); "
              f"the KV pool holds {held} of {plan.session.max_model_len:,} tokens at full context, and a pool "
              f"holding {fit} would fit on {device.device_id} (--kv-cache-memory)", flush=True)
    name = args.served_model_name or os.path.basename(os.path.normpath(manifest.path))
    engine_log, keep = engine_log_from(args, "serve")
    try:
        with joined_nodes(plan):
            record = serve_plan(plan, registry, host=args.host, port=args.port, served_model_name=name,
                                api_key=args.api_key, drain_timeout_s=max(args.drain_timeout, 0.0),
                                observer=TerminalObserver(), engine_log=engine_log, plan_document=document)
    except UsageError:  # the address, before anything started: the log is still empty
        if not keep:
            engine_log.remove()
        raise
    server = record["server"]
    memory = record["memory"]
    if args.json:
        write_document(record, "serve")
    else:
        ratio = memory["ratio"]
        say(f"edge: stopped by {server['stopped_by'] or 'the server'}: {plural(server['requests_served'], 'request')} "
            f"served ({server['requests_failed']} failed{refused_at_cap(server)}), "
            f"{'drained' if server['drained'] else 'in-flight aborted'}; "
            f"predicted peak {mib(memory['predicted_peak_bytes'])} vs measured "
            f"{mib(memory['measured_attributable_bytes'])} ({'-' if ratio is None else f'{ratio:.3f}'}); "
            f"{'no process left' if not record['processes_left'] else 'processes left: ' + str(record['processes_left'])}")
    sys.stdout.flush()
    quiet_exit(engine_log, keep=keep or bool(record["processes_left"]))
    return EXIT_INTERRUPTED if server["stopped_by"] == "SIGINT" else EXIT_OK


def default_max_connections(max_num_seqs: int) -> int:
    """``--max-connections`` when it is not given: :data:`SERVE_MAX_CONNECTIONS`, or twice ``max_num_seqs``."""
    return max(SERVE_MAX_CONNECTIONS, 2 * max_num_seqs)


def refused_at_cap(server: dict[str, Any]) -> str:
    """``, N refused at the connection cap`` when the server refused any (vLLM's server reports no such count)."""
    refused = server.get("requests_refused_at_cap") or 0
    return f", {refused} refused at the connection cap" if refused else ""


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def quiet_exit(engine_log: Any, keep: bool) -> None:
    """After the summary, the runtime's exit-time noise goes to its log, which a clean stop then removes.

    The log is kept when asked for (``--engine-log PATH``) or when a process was left; a server that
    failed never gets here (the error quotes the log and keeps it).
    """
    if engine_log.path is None:
        return
    sys.stderr.flush()
    fd = engine_log.open_fd()
    if not keep:
        engine_log.remove()  # the descriptor stays writable: what comes after the summary goes nowhere
    if fd is not None:
        os.dup2(fd, 2)
        os.close(fd)
