"""``edge run``, ``edge accept`` and ``edge parity``: plan, then run the admitted plan and render what happened.

Each command plans first and refuses (exit 2) before anything loads, then
calls the runtime (:func:`~edge_core.runtime.run_session`,
:func:`~edge_core.runtime.run_acceptance`, :func:`~edge_core.runtime.run_parity`,
:func:`~edge_core.runtime.run_graph_stage`) and renders its record. The
runtime is imported inside the handlers: building the parser for ``edge plan``
must not pay for it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import stat
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import EXIT_DIVERGED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_REFUSED, UsageError
from ..plans import GraphStagePlan, Plan
from ..services.registry import Registry
from ..stream import StageRequest
from ._common import common_options, mask_from, mask_option, mib, plugin_options, positive_int, write_document
from .plan import plan_from_args, planning_options, print_plan
from .progress import TerminalObserver, say

if TYPE_CHECKING:
    from ..runtime.logs import EngineLog
    from ..stream import DeltaEvent

#: Default prompt for ``edge run`` with neither --prompt nor piped stdin. Not "What is the capital of France?":
#: through its chat template the demo model (SmolLM2-135M-Instruct) is at a near-tie on that one's first token and
#: answers greedily without Paris, as llama.cpp does on the model's own file (docs/vllm-cpu-facts.md, "The demo
#: model"); this one it answers "The capital of France is Paris."
DEFAULT_PROMPT = "Name the capital of France."
#: Mirrors :data:`edge_core.runtime.accept.PROMPTS` / ``ACCEPT_TOKENS`` for --help
#: without importing the runtime (a test keeps them equal).
PROMPT_COUNT = 12
ACCEPT_TOKENS = 128


def temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"temperature must be >= 0, got {value}")
    return value


def record_options(parser: argparse.ArgumentParser) -> None:
    """``--json FILE`` (a path, ``-`` for stdout) plus the plugin selection."""
    parser.add_argument("--json", metavar="FILE", help="write the JSON record to FILE ('-' for stdout)")
    plugin_options(parser)


def engine_log_options(parser: argparse.ArgumentParser) -> None:
    """Where the engine's own output goes: a log file per session (default), a named file, or the terminal."""
    parser.add_argument("--engine-log", metavar="PATH",
                        help="write the engine's own output here, and keep it ('-': the terminal); default: a new "
                             "file in <tmp>/edge-logs-<uid> (0700, the file 0600), printed at start, kept only when "
                             "the engine fails or a server is force-stopped")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the engine's output live (= --engine-log -)")


def engine_log_from(args: argparse.Namespace, label: str) -> tuple[EngineLog, bool]:
    """The session's engine log and whether to keep it after a clean run (a path the user named is kept)."""
    from ..runtime.logs import EngineLog

    choice = "-" if getattr(args, "verbose", False) else getattr(args, "engine_log", None)
    return EngineLog.for_session(choice, label), choice is not None


def add_run_commands(sub: Any) -> None:
    run = sub.add_parser(
        "run", help="plan, then run one prompt and stream its tokens",
        description=("Plan first (a refusal prints the plan and exits 2 before anything loads), start the stage "
                     "on the selected device, stream the prompt's tokens as they arrive, then print the "
                     "predicted memory peak against the measured one. Ctrl-C cancels cleanly (exit 130)."),
    )
    common_options(run)
    mask_option(run)
    planning_options(run)
    run.add_argument("--prompt", metavar="TEXT", help="the prompt (default: stdin when piped, an empty pipe being an error; else "
                                                         f"{DEFAULT_PROMPT!r})")
    run.add_argument("--max-tokens", type=positive_int, default=64, metavar="N", help="tokens to generate (64)")
    run.add_argument("--temperature", type=temperature, default=0.0, metavar="T", help="0 = greedy (default)")
    run.add_argument("--seed", type=int, metavar="N", help="sampling seed (with --temperature > 0)")
    run.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    run.add_argument("--raw", action="store_true",
                     help="send the prompt as it is (default: as a user turn through the model's chat template, "
                          "when it has one; a base model without a template gets the prompt as it is, and edge "
                          "says so)")
    engine_log_options(run)
    run.set_defaults(handler=cmd_run)

    accept = sub.add_parser(
        "accept", help="the acceptance run: decisions, twelve prompts, budget vs measured, a leak-free cancel",
        description=("Plan with the device visible and masked (both must decide; the masked one must refuse "
                     f"without an engine), run {PROMPT_COUNT} fixed prompts to {ACCEPT_TOKENS} greedy tokens, "
                     "check the budget bounds the measured peak on every counter it covers, and cancel a request "
                     "mid-decode: in-flight back to zero, stream closed, no process left after stop. Exit 0 "
                     "when every criterion passes, 1 naming the failing ones, 2 if the plan is refused."),
    )
    record_options(accept)
    mask_option(accept)
    planning_options(accept)
    engine_log_options(accept)
    accept.set_defaults(handler=cmd_accept)

    parity = sub.add_parser(
        "parity", help="the same prompts through plain vLLM and through edge's stage; compare token ids",
        description=(f"Run the {PROMPT_COUNT} acceptance prompts to {ACCEPT_TOKENS} greedy tokens (ignore_eos) "
                     "through plain vllm.LLM and then through edge's stage, with the plan's engine arguments "
                     "and the same runtime environment; the first engine's processes are gone before the "
                     "second starts. Exit 0 identical, 3 on any divergence (first divergent position recorded). "
                     "Across nodes (--nnodes), node 0 runs edge's stage joined with the others first, then the "
                     "reference on itself alone (one device unless --reference-tensor-parallel-size); a node > 0 "
                     "runs its ranks headless for the stage's life."),
    )
    record_options(parity)
    mask_option(parity)
    planning_options(parity)
    parity.add_argument("--max-tokens", type=positive_int, default=ACCEPT_TOKENS, metavar="N",
                        help=f"tokens per prompt ({ACCEPT_TOKENS})")
    parity.add_argument("--reference-tensor-parallel-size", type=positive_int, metavar="N",
                        help="run the runtime-alone reference at tensor parallel size N, planned on its own "
                             "(1: one device), to compare a --tensor-parallel-size stage with another layout's "
                             "tokens (default: the same plan both ways)")
    engine_log_options(parity)
    parity.set_defaults(handler=cmd_parity)


# ---------------------------------------------------------------- shared pieces

def plan_here(args: argparse.Namespace, mask: frozenset[str] | None = None) -> tuple[Plan, Registry, float]:
    """Plan against this machine's devices (a run cannot use another machine's list); returns the seconds too."""
    if len(getattr(args, "devices", None) or ()) == 1:
        raise UsageError("--devices plans against another machine's device list; a run needs this machine's "
                         "devices (drop --devices, or use `edge plan --devices FILE`); a Ray layout across "
                         "hosts gives one list per host (--devices A.json --devices B.json)")
    started = time.perf_counter()
    plan, registry = plan_from_args(args, mask, fetch_weights=True)
    return plan, registry, time.perf_counter() - started


def print_plan_beside(plan: Plan, elapsed_s: float, json_target: str | None, explain: bool = False) -> None:
    """The plan, on stderr when stdout carries the JSON record (``--json -``)."""
    with contextlib.redirect_stdout(sys.stderr if json_target == "-" else sys.stdout):
        print_plan(plan, elapsed_s, explain=explain)


def refused(args: argparse.Namespace, plan: Plan, plan_s: float, kind: str) -> int:
    """A command's answer to a refused plan: the ``edge.<kind>`` document with ``--json``, else the plan; exit 2."""
    if args.json:
        write_document({"outcome": "refused", "plan": plan.to_dict()}, kind)
    else:
        print_plan(plan, plan_s, explain=args.explain)
    tell_nodes(args, plan)
    return EXIT_REFUSED


def budget_lines(memory: Mapping[str, Any]) -> list[str]:
    """The run record's memory section as the lines ``edge run`` and ``edge accept`` print."""
    counter = memory["measured_counter"] or "tree_pss"
    ratio = memory["ratio"]
    shown = "-" if ratio is None else f"{ratio:.3f}"
    lines = [
        f"budget    predicted session peak {mib(memory['predicted_peak_bytes'])} vs measured attributable "
        f"{counter.replace('_', '-').replace('tree-pss', 'tree-PSS')} peak {mib(memory['measured_attributable_bytes'])}: "
        f"ratio {shown} ({memory['verdict']}); admitted on held peak {mib(memory.get('held_peak_bytes'))} "
        f"+ {mib(memory['headroom_bytes'])} headroom = {mib(memory['admission_bytes'])} (the predicted peak adds "
        "file pages the kernel reclaims)",
    ]
    others = []
    for name, entry in memory["counters"].items():
        if name == counter or entry.get("attributable_peak_bytes") is None:
            continue
        sign = "-" if entry["direction"] == "available" else "+"
        others.append(f"{name.replace('_', ' ')} {sign}{mib(entry['attributable_peak_bytes'])}"
                      + (f" (budget {entry['budget']}: {entry['verdict']})" if entry["budget"] else ""))
    if others:
        lines.append("          " + "; ".join(others))
    lines.append(f"          {memory['note']}")
    return lines


def describe_stage_record(record: Mapping[str, Any]) -> str:
    """The record of :func:`~edge_core.runtime.run_graph_stage` as ``edge run --model GRAPH.onnx`` prints it."""
    verdict = "PASSED" if record.get("passed") else "REFUSED"
    where = f" on {record['device_id']} ({record.get('backend')})" if record.get("device_id") else ""
    lines = [f"{verdict}{where}: {record.get('model_path')}"]
    if record.get("stand_in"):
        lines.append(f"  stand-in  {record['stand_in']}")
    placement = record.get("placement")
    if placement and "node_share" in placement:
        kernels = ", ".join(f"{p} {n}" for p, n in placement["kernels_by_provider"].items()) or "none"
        lines.append(f"  placement {placement['target_provider']}: {placement['node_share']:.0%} of "
                     f"{placement['kernels']} nodes, {placement['time_share']:.0%} of the time (threshold "
                     f"{placement['threshold']:.0%}) -> {'placed' if placement['placed'] else 'not placed'}; "
                     f"kernels by provider: {kernels} [B: measured]")
    elif placement:
        lines.append(f"  placement {placement.get('target_provider')}: not measured ({placement.get('problem')})")
    gate = record.get("numeric_gate")
    if gate:
        reference = str(gate["reference"].get("graph", "")).rsplit("/", 1)[-1]
        lines.append(f"  numeric   max abs error {gate['max_abs_error']:.3g}, {gate['max_rel_error']:.3g} of the "
                     f"reference's peak vs {reference} on {gate['reference'].get('provider')} (tolerance "
                     f"{gate['tolerance']:g}) -> {'passed' if gate['passed'] else 'failed'} [B: measured]")
    for refusal in record.get("refusals") or ():
        lines.append(f"  refused   [{refusal['code']}] {refusal.get('device_id') or '-'}: {refusal['message']}")
        lines.append(f"            remedy: {refusal['remedy']}")
    memory = record.get("memory") or {}
    if memory.get("attributable_peak_bytes") is not None and memory.get("predicted_peak_bytes"):
        lines.append(f"  memory    {memory['attributable_peak_bytes'] / 2**20:,.0f} MiB attributable PSS (a lower "
                     f"bound) against {memory['predicted_peak_bytes'] / 2**20:,.0f} MiB predicted")
    timings = record.get("timings_s") or {}
    if timings:
        lines.append("  timings   " + ", ".join(f"{k} {v:.3f} s" for k, v in timings.items()))
    return "\n".join(lines)


#: Shown for a control character or an undecodable byte (U+FFFD) of generated text on the terminal.
UNPRINTABLE_MARK = "\u00b7"
#: C0 and C1 controls but newline and tab, DEL, and U+FFFD: what a terminal would act on or show as breakage.
UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufffd]")


def printable(text: str) -> str:
    """Generated text as the terminal gets it: no escape sequence or control byte reaches it (JSON keeps the text)."""
    return UNPRINTABLE.sub(UNPRINTABLE_MARK, text)


def is_demo(model_path: str) -> bool:
    """True for the bundled random-weight checkpoints."""
    from ..artifact.demo import DEMO_MODEL, DEMO_MODEL_HD16

    here = os.path.realpath(model_path)
    return any(here == os.path.realpath(demo) for demo in (DEMO_MODEL, DEMO_MODEL_HD16))


def chat_template_of(plan: Plan) -> str | None:
    """The file holding the planned checkpoint's chat template, None when it has none."""
    from ..artifact.tokenizer import chat_template_source

    return chat_template_source(plan.model_path) if plan.manifest is not None and plan.manifest.kind != "onnx" \
        else None


def finish_note(reason: str, generated: int, asked: int, context: int | None) -> str:
    """Why the output ended; a ``length`` stop short of ``--max-tokens`` was the context, and says so."""
    if reason != "length" or generated >= asked:
        return reason
    return (f"length: cut at the {context}-token context, which holds the prompt and these {generated}; "
            f"--max-tokens asked for {asked}")


def prompt_from(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("--prompt is empty; give some text")
        return str(args.prompt)
    if sys.stdin is not None and not sys.stdin.isatty():
        text = sys.stdin.read()
        if text.strip():
            return text
        if piped(sys.stdin):
            raise UsageError("the prompt piped to stdin is empty; pipe some text, or give --prompt TEXT")
    # No prompt anywhere (a terminal, /dev/null): the demo prompt, so `edge run`
    # with no arguments shows the whole path.
    return DEFAULT_PROMPT


def piped(stream: Any) -> bool:
    """True when ``stream`` is a pipe or a regular file (something meant as input), not a terminal or /dev/null."""
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode)


# ---------------------------------------------------------------- nodes of a --nnodes session

def headless(args: argparse.Namespace) -> bool:
    """True on a node past the head (``--nnodes N --node-rank R``, R > 0): it runs its ranks, headless."""
    return (getattr(args, "nnodes", 1) or 1) > 1 and (getattr(args, "node_rank", 0) or 0) > 0


def builds_of(plan: Plan) -> dict[str, str]:
    """What the nodes of one session must run alike: the backend's runtime build and the stack's versions."""
    from ..runtime.env import versions

    out = {k: v for k, v in versions().items() if k != "python"}
    extras = plan.selected_device.extras if plan.selected_device is not None else None
    if isinstance(extras, dict) and extras.get("runtime"):
        out["runtime"] = str(extras["runtime"])
    return out


def tell_nodes(args: argparse.Namespace, plan: Plan) -> None:
    """A refused plan on a node of a ``--nnodes`` session: tell the other nodes, so none waits for this one."""
    if (getattr(args, "nnodes", 1) or 1) < 2:
        return
    from ..plan.parallel import MASTER_PORT
    from ..runtime.nodes import tell_early_end

    node = {"nnodes": args.nnodes, "node_rank": args.node_rank or 0, "master_addr": args.master_addr,
            "master_port": args.master_port or MASTER_PORT}
    theirs = tell_early_end(plan, builds_of(plan), node, TerminalObserver().message)
    if theirs is not None:
        say(f"edge: {theirs}")


@contextlib.contextmanager
def joined_nodes(plan: Plan) -> Any:
    """Meet the session's other nodes (a no-op for one node); a node lost while inside is raised on leaving."""
    from ..runtime.nodes import joined

    with joined(plan, builds_of(plan), TerminalObserver().message) as line:
        yield line
    if line is not None and line.lost is not None:
        raise line.lost


def run_node(args: argparse.Namespace, plan: Plan, registry: Registry, plan_s: float, kind: str) -> int:
    """A node > 0 of any command: its ranks, headless, until the head stops (exit 0) or goes away (exit 1)."""
    target = "-" if args.json is True else (args.json or None)
    if not plan.admitted:
        print_plan_beside(plan, plan_s, target, args.explain)
        write_document({"outcome": "refused", "plan": plan.to_dict()}, kind, target)
        tell_nodes(args, plan)
        return EXIT_REFUSED
    from ..runtime.headless import run_headless

    print_plan_beside(plan, plan_s, target, args.explain)
    engine_log, keep = engine_log_from(args, kind)
    with joined_nodes(plan) as line:
        record = run_headless(plan, registry, line, observer=TerminalObserver(), engine_log=engine_log)
    if not keep and engine_log.path is not None:
        engine_log.remove()
    if target:
        write_document({**record, "plan": plan.to_dict()}, kind, target)
        return EXIT_OK
    say(f"edge: node {record['node']['node_rank']} stopped by {record['stopped_by']} after "
        f"{record['timings']['lifetime_s']:.1f} s; "
        f"{'no process left' if not record['processes_left'] else 'processes left: ' + str(record['processes_left'])}")
    return EXIT_OK


# ---------------------------------------------------------------- edge run

def run_graph(args: argparse.Namespace, plan: Plan, registry: Registry, plan_s: float) -> int:
    """``edge run --model GRAPH.onnx``: one request of sample tensors, then the placement and numeric gates."""
    from ..runtime.graph_run import run_graph_stage

    if not args.json:
        print_plan(plan, plan_s, explain=args.explain)
        print(flush=True)
    record = run_graph_stage(plan, registry, seed=args.seed or 0) if isinstance(plan, GraphStagePlan) \
        and plan.admitted else {
        "admitted": False, "passed": False, "refusals": [r.to_dict() for r in plan.refusals]}
    if args.json:
        write_document({"outcome": "passed" if record.get("passed") else "refused", "plan": plan.to_dict(),
                        "stage_run": record}, "run")
    elif plan.admitted:
        print(describe_stage_record(record))
    return EXIT_OK if record.get("passed") else EXIT_REFUSED


def cmd_run(args: argparse.Namespace) -> int:
    # Without --model the demo is run: a prompt that is a usage error is said before the demo is built or refused.
    early = prompt_from(args) if args.model is None and not headless(args) else None
    plan, registry, plan_s = plan_here(args)
    if headless(args):
        return run_node(args, plan, registry, plan_s, "run")
    if isinstance(plan, GraphStagePlan) or (plan.manifest is not None and plan.manifest.kind == "onnx"):
        return run_graph(args, plan, registry, plan_s)
    prompt = early if early is not None else prompt_from(args)
    if not plan.admitted:
        return refused(args, plan, plan_s, "run")
    as_chat = not args.raw and chat_template_of(plan) is not None
    if not args.raw and not as_chat and not args.json and not is_demo(plan.model_path):
        say(f"edge: {plan.model_path} has no chat template (a base model): the prompt is sent as it is")
    try:
        text = {"messages": ({"role": "user", "content": prompt},)} if as_chat else {"prompt": prompt}
        request = StageRequest(**text, max_tokens=args.max_tokens, temperature=args.temperature,
                               ignore_eos=args.ignore_eos, seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not args.json:
        print_plan(plan, plan_s, explain=args.explain)
        print(flush=True)
    context = plan.session.max_model_len
    if context is not None and args.max_tokens >= context:
        say(f"edge: warning: --max-tokens {args.max_tokens} does not fit the {context}-token context beside the "
            f"prompt; the output stops when the context is full (--max-model-len sets it)")
    from ..runtime.session import run_session

    if not args.json and is_demo(plan.model_path):
        say("edge: the demo checkpoint has random weights: the text below is noise (bytes that are no "
            f"printable text shown as {UNPRINTABLE_MARK}); the plan, the engine and the stream are real")

    def show(event: DeltaEvent) -> None:
        if not args.json and event.text:
            sys.stdout.write(printable(event.text))
            sys.stdout.flush()

    engine_log, keep = engine_log_from(args, "run")
    with joined_nodes(plan):
        outcome = run_session(plan, registry, request, observer=TerminalObserver(), on_event=show,
                              engine_log=engine_log, keep_log=keep)
    if args.json:
        write_document(outcome.to_dict(plan, plan_s), "run")
    else:
        result, report = outcome.result, outcome.cancel_report
        if result is not None and result.text and not result.text.endswith("\n"):
            print()
        if outcome.outcome == "cancelled":
            if report is not None:
                say(f"edge: cancelled request {report.request_id}: {report.events_delivered} "
                    f"events ({len(result.token_ids) if result else 0} tokens) delivered, "
                    f"{report.discarded_by_fence} discarded by the epoch fence, abort "
                    f"{'reached the engine' if report.abort_returned else 'found nothing in flight'}; "
                    f"{report.note}")
            else:
                say("edge: interrupted while the engine was starting; no request ran")
        if result is not None and result.token_ids:
            rate = "-" if result.decode_tokens_per_s is None else f"{result.decode_tokens_per_s:.1f}"
            ended = finish_note(result.finish_reason or outcome.outcome, len(result.token_ids), args.max_tokens,
                                context)
            print(f"tokens    {len(result.token_ids)} ({ended}); engine start "
                  f"{outcome.start_s:.1f} s, first token {result.time_to_first_token_s or 0:.3f} s, "
                  f"decode {rate} tok/s")
        for line in budget_lines(outcome.memory):
            print(line)
    return EXIT_INTERRUPTED if outcome.outcome == "cancelled" else EXIT_OK


# ---------------------------------------------------------------- edge accept

def cmd_accept(args: argparse.Namespace) -> int:
    if not args.json:
        raise UsageError("edge accept writes its record with --json FILE ('-' for stdout); name a file")
    plan, registry, visible_s = plan_here(args)
    if headless(args):
        return run_node(args, plan, registry, visible_s, "accept")
    if not plan.admitted or plan.selected_device is None:
        print_plan_beside(plan, visible_s, args.json, args.explain)
        write_document({"outcome": "refused", "criteria": [{
            "name": "decision_visible", "passed": False, "detail": f"refused in {visible_s * 1000:.0f} ms"}],
            "plan": plan.to_dict()}, "accept", args.json)
        tell_nodes(args, plan)
        return EXIT_REFUSED
    # The masked decision comes before anything imports vLLM, so "no engine" is checkable.
    masked_plan, _, masked_s = plan_here(args, mask_from(args) | {plan.selected_device.kind})
    from ..runtime.accept import run_acceptance

    engine_log, keep = engine_log_from(args, "accept")
    with joined_nodes(plan):
        document = run_acceptance(plan, registry, visible_s=visible_s, masked_plan=masked_plan, masked_s=masked_s,
                                  observer=TerminalObserver(), engine_log=engine_log, keep_log=keep)
    write_document(document, "accept", args.json)
    for criterion in document["criteria"]:
        say(f"edge: {'PASS' if criterion['passed'] else 'FAIL'} {criterion['name']}: {criterion['detail']}")
    for line in budget_lines(document["memory"]):
        say("edge: " + line)
    if document["failed"]:
        say(f"edge: accept FAILED: {', '.join(document['failed'])}")
        return EXIT_INTERNAL
    say(f"edge: accept passed ({len(document['criteria'])} criteria)")
    return EXIT_OK


# ---------------------------------------------------------------- edge parity

def cmd_parity(args: argparse.Namespace) -> int:
    plan, registry, plan_s = plan_here(args)
    if headless(args):  # a node > 0: its ranks serve the head's stage, then leave
        return run_node(args, plan, registry, plan_s, "parity")
    if not plan.admitted:
        print_plan_beside(plan, plan_s, args.json, args.explain)
        write_document({"outcome": "refused", "plan": plan.to_dict()}, "parity", args.json)
        tell_nodes(args, plan)
        return EXIT_REFUSED
    across = (getattr(args, "nnodes", 1) or 1) > 1
    reference = None
    if args.reference_tensor_parallel_size is not None or across:
        # The same model (already resolved), another layout; not admitted on its own: the two engines run one
        # after the other inside this session, which the ledger already holds. Across nodes the reference runs
        # on this node alone (one device unless --reference-tensor-parallel-size says otherwise).
        wanted = argparse.Namespace(**{**vars(args), "model": plan.model_path, "revision": None,
                                       "tensor_parallel_size": args.reference_tensor_parallel_size or 1,
                                       "pipeline_parallel_size": None, "nnodes": 1, "node_rank": 0,
                                       "master_addr": None, "master_port": None})
        reference, _ = plan_from_args(wanted, count_others=False)
        if not reference.admitted:
            say(f"edge: the reference layout (--reference-tensor-parallel-size {wanted.tensor_parallel_size}) "
                "is refused; edge's own plan was admitted")
            print_plan_beside(reference, plan_s, args.json, args.explain)
            write_document({"outcome": "refused", "plan": plan.to_dict(), "reference_plan": reference.to_dict()},
                           "parity", args.json)
            tell_nodes(args, reference)
            return EXIT_REFUSED
    from ..runtime.parity import run_parity

    engine_log, keep = engine_log_from(args, "parity")
    document = run_parity(plan, registry, max_tokens=args.max_tokens, observer=TerminalObserver(),
                          engine_log=engine_log, reference_plan=reference, keep_log=keep,
                          nodes=joined_nodes(plan) if across else None)
    write_document(document, "parity", args.json)
    rows = document["prompts"]
    diverged = [row for row in rows if not row["identical"]]
    out = sys.stderr if args.json == "-" else sys.stdout
    against = document["reference"]
    layouts = ("" if against["layout"] == document["layout"]
               else f" ({against['layout']} on {against['device']} vs {document['layout']})")
    print(f"parity    {len(rows) - len(diverged)}/{len(rows)} prompts token-for-token identical ({args.max_tokens} "
          f"greedy tokens each, plain vllm.LLM vs edge's stage on {document['device']}{layouts})", file=out)
    for row in diverged:
        print(f"  diverged at token {row['first_divergent_position']}: {row['prompt'][:60]!r}", file=out)
    return EXIT_DIVERGED if diverged else EXIT_OK
