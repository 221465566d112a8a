"""``edge run``, ``edge accept`` and ``edge parity``: what happens when an admitted plan actually runs?

Each command plans first and refuses (exit 2) before anything loads. Then:

* ``run`` streams one prompt's tokens to the terminal as they arrive and
  prints the budget against the memory it measured;
* ``accept`` is the acceptance run (SPEC section 10): decisions with the device
  visible and masked, twelve fixed prompts to 128 greedy tokens, the budget
  against every counter it covers, and a cancel in the middle of a request
  that must leak nothing;
* ``parity`` runs the same prompts through plain ``vllm.LLM`` and through
  edge's stage, one engine after the other, and compares token ids.

Memory is sampled over the whole process tree (:class:`ProcessTreeSampler`,
0.25 s) from a baseline taken before vLLM is imported, so the peak is
attributable to the session. No module here imports vLLM at top level.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .commands import _positive_int
from .errors import EXIT_DIVERGED, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_OK, EXIT_REFUSED, StageError, UsageError

#: The acceptance and parity prompts: fixed, so two runs (or two machines)
#: compare the same work. Short, varied, plain ASCII; none is near a context limit.
PROMPTS = (
    "The gateway box in the cupboard has sixteen gigabytes of memory and",
    "Which device in this interpreter can run the checkpoint? The answer is",
    "Tokens arrive one at a time, and each one",
    "A refusal names the reason and the remedy, for example",
    "Numbers without a source are guesses; a measured number",
    "Once upon a time, in a data centre far away,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "Memory budget: weights, KV cache, activations, runtime baseline,",
    "1, 2, 3, 5, 8, 13, 21,",
    "Cancel is not stop reading: retire the epoch, abort, close, and",
    "In summary, the plan admitted the session because",
)
#: Greedy tokens per acceptance / parity prompt (``ignore_eos``).
ACCEPT_TOKENS = 128
#: Delta events the acceptance cancel lets through before it cancels: enough
#: that the request is surely in decode, far from its end.
CANCEL_AFTER_EVENTS = 16
#: Seconds the acceptance run waits for the in-flight count to return to zero
#: after a cancel (the engine drops an aborted request within one step; this
#: only bounds a hang).
IDLE_WAIT_S = 30.0
#: Default prompt for ``edge run`` with neither --prompt nor piped stdin.
DEFAULT_PROMPT = "The gateway box in the cupboard can run this model because"

#: Which budget bounds which counter. The predicted peak is a forecast of the
#: tree's PSS. Two counters are reported but not checked: tree RSS counts
#: shared library pages once per process (measured 0.39-0.43 GiB above PSS for
#: vLLM CPU's 4 processes), and host available memory moves with every process
#: on the host (measured: a 2.23 GiB drop during an acceptance run whose tree
#: PSS rose 1.34 GiB, while other jobs ran on the machine). NVML's used bytes
#: are the whole card's; on a GPU the session is what fills it.
COVERED_COUNTERS = {
    "host_ram": {"tree_pss": "predicted"},
    "vram": {"device": "predicted"},
}


# ---------------------------------------------------------------- options



def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"temperature must be >= 0, got {value}")
    return value


def _file_json_options(parser: argparse.ArgumentParser) -> None:
    """``--json FILE`` (a path, ``-`` for stdout) plus the plugin options every command has."""
    parser.add_argument("--json", metavar="FILE", help="write the JSON record to FILE ('-' for stdout)")
    parser.add_argument("--plugins", metavar="NAMES",
                        help="comma-separated allow-list of backends to load (env EDGE_PLUGINS)")
    parser.add_argument("--block", metavar="NAMES", help="comma-separated backends never to import")


def add_run_commands(sub: Any, common: Callable[..., None], mask_option: Callable[..., None],
                     planning_options: Callable[..., None]) -> None:
    run = sub.add_parser(
        "run", help="plan, then run one prompt and stream its tokens",
        description=("Plan first (a refusal prints the plan and exits 2 before anything loads), start the stage "
                     "on the selected device, stream the prompt's tokens as they arrive, then print the "
                     "predicted memory peak against the measured one. Ctrl-C cancels cleanly (exit 130)."),
    )
    common(run)
    mask_option(run)
    planning_options(run)
    run.add_argument("--prompt", metavar="TEXT", help="the prompt (default: stdin when piped, else a demo prompt)")
    run.add_argument("--max-tokens", type=_positive_int, default=64, metavar="N", help="tokens to generate (64)")
    run.add_argument("--temperature", type=_temperature, default=0.0, metavar="T", help="0 = greedy (default)")
    run.add_argument("--seed", type=int, metavar="N", help="sampling seed (with --temperature > 0)")
    run.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    run.set_defaults(handler=cmd_run)

    accept = sub.add_parser(
        "accept", help="the acceptance run: decisions, twelve prompts, budget vs measured, a leak-free cancel",
        description=("Plan with the device visible and masked (both must decide; the masked one must refuse "
                     f"without an engine), run {len(PROMPTS)} fixed prompts to {ACCEPT_TOKENS} greedy tokens, "
                     "check the budget bounds the measured peak on every counter it covers, and cancel a request "
                     "mid-decode: in-flight back to zero, stream closed, no process left after stop. Exit 0 "
                     "when every criterion passes, 1 naming the failing ones, 2 if the plan is refused."),
    )
    _file_json_options(accept)
    mask_option(accept)
    planning_options(accept)
    accept.set_defaults(handler=cmd_accept)

    parity = sub.add_parser(
        "parity", help="the same prompts through plain vLLM and through edge's stage; compare token ids",
        description=(f"Run the {len(PROMPTS)} acceptance prompts to {ACCEPT_TOKENS} greedy tokens (ignore_eos) "
                     "through plain vllm.LLM and then through edge's stage, with the plan's engine arguments "
                     "and the same runtime environment; the first engine's processes are gone before the "
                     "second starts. Exit 0 identical, 3 on any divergence (first divergent position recorded)."),
    )
    _file_json_options(parity)
    mask_option(parity)
    planning_options(parity)
    parity.add_argument("--max-tokens", type=_positive_int, default=ACCEPT_TOKENS, metavar="N",
                        help=f"tokens per prompt ({ACCEPT_TOKENS})")
    parity.set_defaults(handler=cmd_parity)


# ---------------------------------------------------------------- pieces

def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Ticker:
    """Shows that a long step is alive: elapsed seconds on a terminal, a start and an end line otherwise."""

    def __init__(self, what: str):
        self.what = what
        self.tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started = 0.0

    def __enter__(self) -> "_Ticker":
        self.started = time.perf_counter()
        if self.tty:
            self._thread = threading.Thread(target=self._tick, name="edge-progress", daemon=True)
            self._thread.start()
        else:
            _say(f"edge: {self.what} ...")
        return self

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            sys.stderr.write(f"\redge: {self.what} ... {time.perf_counter() - self.started:4.0f} s")
            sys.stderr.flush()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        took = time.perf_counter() - self.started
        end = "\r" if self.tty else ""
        status = "done" if exc_type is None else "stopped"
        sys.stderr.write(f"{end}edge: {self.what} ... {status} in {took:.1f} s\n")
        sys.stderr.flush()


def _progress_bar(done: int, total: int, note: str) -> None:
    width = 24
    filled = width * done // max(total, 1)
    line = f"edge: [{'#' * filled}{'-' * (width - filled)}] {done}/{total} {note}"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + line + ("\n" if done == total else ""))
    else:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _write_record(document: dict[str, Any], kind: str, target: str | None) -> None:
    from .cli import SCHEMA_VERSION

    payload = {"schema": f"edge.{kind}", "schema_version": SCHEMA_VERSION, **document}
    if target in (None, ""):
        return
    if target == "-":
        json.dump(payload, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return
    try:
        with open(target, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, indent=2, default=str)
            handle.write("\n")
    except OSError as exc:
        raise UsageError(f"cannot write the JSON record to {target}: {exc.strerror}") from None


def _plan(args: argparse.Namespace) -> tuple[Any, Any, float]:
    from .commands import plan_from_args

    if getattr(args, "devices", None):
        raise UsageError("--devices plans against another machine's device list; a run needs this machine's "
                         "devices (drop --devices, or use `edge plan --devices FILE`)")
    started = time.perf_counter()
    plan, registry = plan_from_args(args)
    return plan, registry, time.perf_counter() - started


def _print_plan_beside(plan: Any, elapsed_s: float, json_target: str | None) -> None:
    """The refused plan, on stderr when stdout carries the JSON record (``--json -``)."""
    import contextlib

    from .commands import print_plan

    with contextlib.redirect_stdout(sys.stderr if json_target == "-" else sys.stdout):
        print_plan(plan, elapsed_s)


def _plan_summary(plan: Any) -> dict[str, Any]:
    return {
        "admitted": plan.admitted,
        "selected_device": plan.selected_device.device_id if plan.selected_device is not None else None,
        "backend": plan.backend,
        "session": plan.session.to_dict(),
        "predicted_peak_bytes": plan.peak.predicted_bytes if plan.peak is not None else None,
        "headroom_bytes": plan.peak.headroom_bytes if plan.peak is not None else None,
        "admission_bytes": plan.peak.admission_bytes if plan.peak is not None else None,
        "capacity_bytes": plan.capacity_bytes,
        "reservations": [r.to_dict() for r in plan.reservations],
        "engine_kwargs": dict(plan.engine_kwargs),
        "refusals": [r.to_dict() for r in plan.refusals],
    }


def _prepare_node(plan: Any) -> Any:
    """The vLLM CPU node check, before the memory baseline (see node_memory)."""
    if not str(plan.backend or "").startswith("vllm"):
        return None
    from .vllm_stage import prepare_node_for

    shown = {"last": 0.0}

    def progress(touched: int, short: int) -> None:
        now = time.monotonic()
        if now - shown["last"] >= 1.0:
            shown["last"] = now
            _say(f"edge: growing NUMA node memory for the KV pool: touched {touched / 2**30:.1f} GiB "
                 f"(node short by {short / 2**30:.1f} GiB)")

    prep = prepare_node_for(plan, progress=progress)
    if prep is not None and prep.touched_bytes:
        _say(f"edge: {prep.note} ({prep.touched_bytes / 2**30:.1f} GiB touched and released in "
             f"{prep.seconds:.1f} s)")
    return prep


def _device_counter(device: Any) -> tuple[Callable[[], int | None] | None, str]:
    """The backend's device counter for the sampler: NVML used bytes for a CUDA card, else none."""
    if device.memory_pool != "vram" or not str(device.backend or "").startswith("vllm:cuda"):
        return None, "none"
    try:
        import pynvml  # nvidia-ml-py, installed with edge-cuda
    except ImportError:
        return None, "none"
    try:
        pynvml.nvmlInit()
        index = device.extras.get("nvml_index") if isinstance(device.extras, dict) else None
        if index is None:
            index = int(str(device.device_id).partition(":")[2] or 0)
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(index))
    except Exception:  # noqa: BLE001 — no driver: the record says there was no device counter
        return None, "none"
    return (lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)), "nvml used bytes (whole card)"


def _sampler(device: Any) -> Any:
    from .measure import DEFAULT_PERIOD_S, ProcessTreeSampler

    counter, source = _device_counter(device)
    return ProcessTreeSampler(os.getpid(), DEFAULT_PERIOD_S, device_counter=counter, device_source=source)


def _start_stage(registry: Any, device: Any, plan: Any) -> tuple[Any, float]:
    with _Ticker(f"starting {device.backend} on {device.device_id} (plan's engine arguments, nothing else)"):
        started = time.perf_counter()
        stage = registry.call_owner(device, "start_stage", plan=plan)
        took = time.perf_counter() - started
    if stage is None:
        raise StageError(f"the backend that owns {device.device_id} ({device.plugin}) does not implement "
                         "start_stage; it can plan but not run")
    return stage, took


def _stop_stage(registry: Any, device: Any, stage: Any) -> tuple[Any, float]:
    """Stop the stage with Ctrl-C held off: an interrupted stop would leave engine processes behind."""
    started = time.perf_counter()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        answer = registry.call_owner(device, "stop_stage", stage=stage)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    return answer, time.perf_counter() - started


class _TerminationAsInterrupt:
    """SIGTERM and SIGHUP take the Ctrl-C path (cancel, stop, report) while a stage runs.

    The stage's processes live in their own process group (vllm_stage), so a
    signal that ends edge without cleanup would leave them running; routed
    through KeyboardInterrupt they are stopped like after Ctrl-C.
    """

    SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))

    def __enter__(self) -> "_TerminationAsInterrupt":
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._raise)
        return self

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    def __exit__(self, *exc: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _stage_info(stage: Any) -> dict[str, Any]:
    to_dict = getattr(stage, "to_dict", None)
    return to_dict() if callable(to_dict) else {"executed_on": getattr(stage, "executed_on", None)}


@dataclass(frozen=True)
class RequestResult:
    """One request as the consumer saw it. Times in seconds from submission."""

    request_id: str
    prompt: str | None
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    events: int
    time_to_first_token_s: float | None
    decode_tokens_per_s: float | None
    duration_s: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "tokens": len(self.token_ids),
            "token_ids": list(self.token_ids),
            "text": self.text,
            "finish_reason": self.finish_reason,
            "events": self.events,
            "time_to_first_token_s": _round(self.time_to_first_token_s),
            "decode_tokens_per_s": _round(self.decode_tokens_per_s, 2),
            "duration_s": _round(self.duration_s),
        }


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


class _Consumer:
    """Drives one request through :class:`StreamRun`, timing it; ``run`` is there to cancel from outside."""

    def __init__(self, registry: Any, device: Any, stage: Any, request: Any):
        from .stream import StreamRun

        self.request = request
        self.submitted = time.perf_counter()
        events = registry.call_owner(device, "stream", stage=stage, request=request)
        if events is None:
            raise StageError(f"the backend that owns {device.device_id} does not implement stream")
        self.run = StreamRun(
            events,
            lambda: registry.call_owner(device, "cancel", stage=stage, request_id=request.request_id),
            request_id=request.request_id, epoch=request.epoch, label=f"{device.backend} on {device.device_id}",
        )
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.events = 0
        self.first_at: float | None = None
        self.first_tokens = 0
        self.last_at: float | None = None
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[Any]:
        for event in self.run:
            now = time.perf_counter()
            if event.token_ids:
                if self.first_at is None:
                    self.first_at, self.first_tokens = now, len(event.token_ids)
                self.last_at = now
            self.token_ids.extend(event.token_ids)
            self.text.append(event.text)
            self.events += 1
            if event.finish_reason is not None:
                self.finish_reason = event.finish_reason
            yield event

    def drain(self, on_event: Callable[[Any], None] | None = None) -> RequestResult:
        for event in self:
            if on_event is not None:
                on_event(event)
        return self.result()

    def result(self) -> RequestResult:
        ttft = None if self.first_at is None else self.first_at - self.submitted
        rate = None
        later = len(self.token_ids) - self.first_tokens
        if self.first_at is not None and self.last_at is not None and self.last_at > self.first_at and later > 0:
            rate = later / (self.last_at - self.first_at)
        return RequestResult(
            request_id=self.request.request_id, prompt=self.request.prompt, token_ids=tuple(self.token_ids),
            text="".join(self.text), finish_reason=self.finish_reason, events=self.events,
            time_to_first_token_s=ttft, decode_tokens_per_s=rate,
            duration_s=(self.last_at or time.perf_counter()) - self.submitted,
        )


def memory_record(plan: Any, report: Any) -> dict[str, Any]:
    """Budget against measurement, one entry per counter, never summed (SPEC section 9)."""
    from .measure import compare

    peak = plan.peak
    budgets = {"predicted": peak.predicted_bytes}
    covered = COVERED_COUNTERS.get(plan.selected_device.memory_pool, {})
    counters = {}
    for counter in report.counters:
        which = covered.get(counter.name)
        entry = counter.to_dict()
        entry["budget"] = which
        entry["budget_bytes"] = budgets[which] if which else None
        if which:
            verdict = compare(budgets[which], report, counter.name)
            entry.update(ratio=_round(verdict["ratio"], 4), verdict=verdict["verdict"], is_bug=verdict["is_bug"])
        else:
            entry.update(ratio=None, verdict="not_covered", is_bug=False)
        counters[counter.name] = entry
    headline = counters.get("tree_pss") if plan.selected_device.memory_pool == "host_ram" else counters.get("device")
    return {
        "predicted_peak_bytes": peak.predicted_bytes,
        "headroom_bytes": peak.headroom_bytes,
        "admission_bytes": peak.admission_bytes,
        "measured_counter": headline["name"] if headline else None,
        "measured_attributable_bytes": headline["attributable_peak_bytes"] if headline else None,
        "ratio": headline["ratio"] if headline else None,
        "verdict": headline["verdict"] if headline else "no_measurement",
        "counters": counters,
        "covered": {name: which for name, which in covered.items()},
        "sampler": report.to_dict(),
        "note": report.note,
    }


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f} MiB"


def budget_lines(memory: dict[str, Any]) -> list[str]:
    counter = memory["measured_counter"] or "tree_pss"
    ratio = memory["ratio"]
    shown = "-" if ratio is None else f"{ratio:.3f}"
    lines = [
        f"budget    predicted session peak {_mib(memory['predicted_peak_bytes'])} vs measured attributable "
        f"{counter.replace('_', '-').replace('tree-pss', 'tree-PSS')} peak {_mib(memory['measured_attributable_bytes'])}: "
        f"ratio {shown} ({memory['verdict']}); full admission budget {_mib(memory['admission_bytes'])} "
        f"(+{_mib(memory['headroom_bytes'])} headroom)",
    ]
    others = []
    for name, entry in memory["counters"].items():
        if name == counter or entry.get("attributable_peak_bytes") is None:
            continue
        sign = "-" if entry["direction"] == "available" else "+"
        others.append(f"{name.replace('_', ' ')} {sign}{_mib(entry['attributable_peak_bytes'])}"
                      + (f" (budget {entry['budget']}: {entry['verdict']})" if entry["budget"] else ""))
    if others:
        lines.append("          " + "; ".join(others))
    lines.append(f"          {memory['note']}")
    return lines


def _prompt_from(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        if not args.prompt.strip():
            raise UsageError("--prompt is empty; give some text")
        return args.prompt
    if sys.stdin is not None and not sys.stdin.isatty():
        text = sys.stdin.read()
        if text.strip():
            return text
    # No prompt anywhere (a terminal, /dev/null, an empty pipe): the demo prompt,
    # so `edge run` with no arguments shows the whole path.
    return DEFAULT_PROMPT


def _children_alive() -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


# ---------------------------------------------------------------- edge run

def _run_graph(args: argparse.Namespace, plan: Any, registry: Any, plan_s: float) -> int:
    """``edge run --model GRAPH.onnx``: one request of sample tensors, then the placement and numeric gates."""
    from .cli import emit_json
    from .commands import print_plan
    from .stages import describe_stage_record, run_graph_stage

    if not args.json:
        print_plan(plan, plan_s)
        print(flush=True)
    record = run_graph_stage(plan, registry, seed=args.seed or 0) if plan.admitted else {
        "admitted": False, "passed": False, "refusals": [r.to_dict() for r in plan.refusals]}
    if args.json:
        emit_json({"outcome": "passed" if record.get("passed") else "refused", "plan": plan.to_dict(),
                   "stage_run": record}, "run")
    elif plan.admitted:
        print(describe_stage_record(record))
    return EXIT_OK if record.get("passed") else EXIT_REFUSED


def cmd_run(args: argparse.Namespace) -> int:
    from .cli import emit_json
    from .commands import print_plan
    from .stream import StageRequest

    plan, registry, plan_s = _plan(args)
    if getattr(plan, "stage", None) is not None or (plan.manifest is not None and plan.manifest.kind == "onnx"):
        return _run_graph(args, plan, registry, plan_s)
    prompt = _prompt_from(args)
    if not plan.admitted:
        if args.json:
            emit_json({"outcome": "refused", "plan": plan.to_dict()}, "run")
        else:
            print_plan(plan, plan_s)
        return EXIT_REFUSED
    try:
        request = StageRequest(prompt=prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                               ignore_eos=args.ignore_eos, seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not args.json:
        print_plan(plan, plan_s)
        print(flush=True)
    device = plan.selected_device
    node_prep = _prepare_node(plan)
    sampler = _sampler(device)
    sampler.baseline()  # before vLLM is imported: everything above it is the session's
    sampler.start()
    stage = consumer = cancel_report = stop_answer = None
    start_s = stop_s = 0.0
    outcome = "completed"

    def show(event: Any) -> None:
        if not args.json and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()

    with _TerminationAsInterrupt():
        try:
            stage, start_s = _start_stage(registry, device, plan)
            consumer = _Consumer(registry, device, stage, request)
            consumer.drain(show)
        except KeyboardInterrupt:
            outcome = "cancelled"
            if consumer is not None:
                cancel_report = consumer.run.cancel()
        finally:
            if stage is not None:
                stop_answer, stop_s = _stop_stage(registry, device, stage)
            sampler.stop()
    report = sampler.report()
    memory = memory_record(plan, report)
    result = consumer.result() if consumer is not None else None
    if not args.json:
        if result is not None and result.text and not result.text.endswith("\n"):
            print()
        if outcome == "cancelled":
            if cancel_report is not None:
                _say(f"edge: cancelled request {cancel_report.request_id}: {cancel_report.events_delivered} "
                     f"events ({len(result.token_ids) if result else 0} tokens) delivered, "
                     f"{cancel_report.discarded_by_fence} discarded by the epoch fence, abort "
                     f"{'reached the engine' if cancel_report.abort_returned else 'found nothing in flight'}; "
                     f"{cancel_report.note}")
            else:
                _say("edge: interrupted while the engine was starting; no request ran")
        if result is not None and result.token_ids:
            rate = "-" if result.decode_tokens_per_s is None else f"{result.decode_tokens_per_s:.1f}"
            print(f"tokens    {len(result.token_ids)} ({result.finish_reason or outcome}); engine start "
                  f"{start_s:.1f} s, first token {result.time_to_first_token_s or 0:.3f} s, decode {rate} tok/s")
        for line in budget_lines(memory):
            print(line)
    stage_info = _stage_info(stage) if stage is not None else {}
    if args.json:
        emit_json({
            "outcome": outcome,
            "model": plan.model_path,
            "artifact_id": plan.manifest.artifact_id,
            "device": device.device_id,
            "executed_on": getattr(stage, "executed_on", None),
            "request": request.to_dict(),
            "tokens": len(result.token_ids) if result else 0,
            "token_ids": list(result.token_ids) if result else [],
            "text": result.text if result else "",
            "finish_reason": result.finish_reason if result else None,
            "timings": {
                "plan_s": round(plan_s, 4),
                "engine_start_s": round(start_s, 3),
                "vllm_import_s": stage_info.get("import_s"),
                "vllm_engine_s": stage_info.get("engine_start_s"),
                "time_to_first_token_s": _round(result.time_to_first_token_s) if result else None,
                "decode_tokens_per_s": _round(result.decode_tokens_per_s, 2) if result else None,
                "stop_s": round(stop_s, 3),
            },
            "memory": memory,
            "plan": _plan_summary(plan),
            "node_prep": node_prep.to_dict() if node_prep is not None else None,
            "stage": stage_info,
            "versions": stage_info.get("versions") or _versions(),
            "cancel": cancel_report.to_dict() if cancel_report is not None else None,
            "stopped": stop_answer,
        }, "run")
    return EXIT_INTERRUPTED if outcome == "cancelled" else EXIT_OK


def _versions() -> dict[str, str]:
    from .vllm_stage import versions

    return versions()


# ---------------------------------------------------------------- edge accept

@dataclass(frozen=True)
class Criterion:
    """One acceptance criterion and its evidence."""

    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


def _masked_args(args: argparse.Namespace, kind: str) -> argparse.Namespace:
    from .cli import _mask

    masked = argparse.Namespace(**vars(args))
    masked.mask = ",".join(sorted(set(_mask(args)) | {kind}))
    return masked


def cmd_accept(args: argparse.Namespace) -> int:
    from .commands import plan_from_args
    from .stream import StageRequest

    if not args.json:
        raise UsageError("edge accept writes its record with --json FILE ('-' for stdout); name a file")
    criteria: list[Criterion] = []
    plan, registry, visible_s = _plan(args)
    criteria.append(Criterion("decision_visible", plan.admitted,
                              f"{'admitted on ' + plan.selected_device.device_id if plan.admitted else 'refused'} "
                              f"in {visible_s * 1000:.0f} ms"))
    if not plan.admitted:
        _print_plan_beside(plan, visible_s, args.json)
        _write_record({"outcome": "refused", "criteria": [c.to_dict() for c in criteria], "plan": plan.to_dict()},
                      "accept", args.json)
        return EXIT_REFUSED
    device = plan.selected_device
    # The masked decision comes before anything imports vLLM, so "no engine" is checkable.
    started = time.perf_counter()
    masked_plan, _ = plan_from_args(_masked_args(args, device.kind))
    masked_s = time.perf_counter() - started
    engine_free = "vllm" not in sys.modules and not _children_alive()
    criteria.append(Criterion(
        "decision_masked", not masked_plan.admitted and engine_free,
        f"with {device.kind} masked: {'admitted (should refuse)' if masked_plan.admitted else 'refused'} "
        f"[{', '.join(r.code for r in masked_plan.refusals)}] in {masked_s * 1000:.0f} ms; "
        f"{'no engine, vLLM not imported' if engine_free else 'an engine or vLLM was already loaded'}",
    ))

    node_prep = _prepare_node(plan)
    sampler = _sampler(device)
    sampler.baseline()
    sampler.start()
    stage = None
    results: list[RequestResult] = []
    cancel_info: dict[str, Any] = {}
    stop_s = start_s = 0.0
    stop_answer = None
    stage_pids: tuple[int, ...] = ()
    with _TerminationAsInterrupt():
        try:
            stage, start_s = _start_stage(registry, device, plan)
            stage_pids = tuple(getattr(stage, "stage_pids", ()))
            for index, prompt in enumerate(PROMPTS):
                request = StageRequest(prompt=prompt, max_tokens=ACCEPT_TOKENS, temperature=0.0, ignore_eos=True)
                results.append(_Consumer(registry, device, stage, request).drain())
                last = results[-1]
                _progress_bar(index + 1, len(PROMPTS),
                              f"prompts, {len(last.token_ids)} tokens, {last.decode_tokens_per_s or 0:.0f} tok/s")
            cancel_info = _cancel_mid_request(registry, device, stage, plan)
        finally:
            if stage is not None:
                stop_answer, stop_s = _stop_stage(registry, device, stage)
            sampler.stop()
    leftover = [pid for pid in stage_pids if _alive(pid)]
    children = _children_alive()

    complete = [r for r in results if len(r.token_ids) == ACCEPT_TOKENS and r.finish_reason == "length"]
    criteria.append(Criterion(
        "prompts_complete", len(complete) == len(PROMPTS),
        f"{len(complete)}/{len(PROMPTS)} prompts reached {ACCEPT_TOKENS} greedy tokens (finish_reason length)",
    ))
    memory = memory_record(plan, sampler.report())
    bounded = []
    for name, which in memory["covered"].items():
        entry = memory["counters"].get(name)
        if entry is None or entry["verdict"] == "no_measurement":
            continue
        bounded.append(Criterion(
            f"budget_bounds_{name}", entry["verdict"] == "bounds",
            f"{which} budget {_mib(entry['budget_bytes'])} vs measured attributable "
            f"{_mib(entry['attributable_peak_bytes'])} (ratio {entry['ratio']})",
        ))
    criteria.extend(bounded or [Criterion("budget_bounds", False, "no covered counter had a measurement")])
    criteria.append(Criterion(
        "cancel_leaks_nothing",
        bool(cancel_info.get("ok")) and not leftover and not children,
        f"{cancel_info.get('detail', 'not run')}; after stop: "
        f"{'no process left' if not leftover and not children else f'processes left: {leftover or children}'}",
    ))

    ttfts = [r.time_to_first_token_s for r in results if r.time_to_first_token_s is not None]
    rates = [r.decode_tokens_per_s for r in results if r.decode_tokens_per_s is not None]
    stage_info = _stage_info(stage) if stage is not None else {}
    failed = [c for c in criteria if not c.passed]
    document = {
        "outcome": "passed" if not failed else "failed",
        "failed": [c.name for c in failed],
        "criteria": [c.to_dict() for c in criteria],
        "model": plan.model_path,
        "artifact_id": plan.manifest.artifact_id,
        "device": device.device_id,
        "executed_on": stage_info.get("executed_on"),
        "versions": stage_info.get("versions") or _versions(),
        "medians": {
            "time_to_first_token_s": _round(statistics.median(ttfts)) if ttfts else None,
            "decode_tokens_per_s": _round(statistics.median(rates), 2) if rates else None,
        },
        "timings": {"plan_visible_s": round(visible_s, 4), "plan_masked_s": round(masked_s, 4),
                    "engine_start_s": round(start_s, 3), "stop_s": round(stop_s, 3)},
        "memory": memory,
        "prompts": [r.to_dict() for r in results],
        "cancel": cancel_info,
        "plan": _plan_summary(plan),
        "masked_plan": {"admitted": masked_plan.admitted, "refusals": [r.to_dict() for r in masked_plan.refusals]},
        "node_prep": node_prep.to_dict() if node_prep is not None else None,
        "stage": stage_info,
        "stopped": stop_answer,
    }
    _write_record(document, "accept", args.json)
    for criterion in criteria:
        _say(f"edge: {'PASS' if criterion.passed else 'FAIL'} {criterion.name}: {criterion.detail}")
    for line in budget_lines(memory):
        _say("edge: " + line)
    if failed:
        _say(f"edge: accept FAILED: {', '.join(c.name for c in failed)}")
        return EXIT_INTERNAL
    _say(f"edge: accept passed ({len(criteria)} criteria)")
    return EXIT_OK


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cancel_mid_request(registry: Any, device: Any, stage: Any, plan: Any) -> dict[str, Any]:
    """Cancel a long request mid-decode and check nothing of it is left."""
    from .stream import StageRequest

    # As long as the context allows, so the request is surely still decoding
    # when the consumer has seen CANCEL_AFTER_EVENTS events.
    budget = max(plan.session.max_model_len - 64, CANCEL_AFTER_EVENTS * 4)
    request = StageRequest(prompt=PROMPTS[0], max_tokens=budget, temperature=0.0, ignore_eos=True)
    consumer = _Consumer(registry, device, stage, request)
    seen = 0
    report = None
    for _ in consumer:
        seen += 1
        if seen == CANCEL_AFTER_EVENTS:
            report = consumer.run.cancel()
            break
    after = sum(1 for _ in consumer.run)  # must be zero: the epoch is retired and the stream closed
    wait_idle = getattr(stage, "wait_idle", None)
    idle = wait_idle(IDLE_WAIT_S) if callable(wait_idle) else None
    in_flight = getattr(stage, "in_flight_count", None)
    unfinished_fn = getattr(stage, "engine_unfinished", None)
    unfinished = unfinished_fn() if callable(unfinished_fn) else None
    closed = consumer.run.stream.closed
    ok = (report is not None and report.was_in_flight and after == 0 and closed and in_flight in (0, None)
          and unfinished in (0, None) and idle in (True, None))
    detail = (f"cancelled after {seen} events of a {budget}-token request: "
              f"{'in flight' if report and report.was_in_flight else 'NOT in flight'} at cancel, "
              f"{after} retired-epoch events delivered after it, "
              f"{report.discarded_by_fence if report else '?'} discarded by the fence, stream "
              f"{'closed' if closed else 'OPEN'}, in-flight {in_flight}, engine unfinished {unfinished}")
    return {"ok": ok, "detail": detail, "events_before_cancel": seen, "events_after_cancel": after,
            "in_flight_after": in_flight, "engine_unfinished_after": unfinished, "stream_closed": closed,
            "report": report.to_dict() if report is not None else None}


# ---------------------------------------------------------------- edge parity

def plain_vllm_token_ids(engine_kwargs: dict[str, Any], prompts: tuple[str, ...], max_tokens: int
                         ) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy token ids from plain ``vllm.LLM`` with ``engine_kwargs``; returns after its processes are gone.

    The caller applies the runtime environment first (:func:`edge_core.runtime_env.apply_runtime_env`).
    """
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs)
    start_s = time.perf_counter() - started
    pids = tuple(p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(list(prompts), params, use_tqdm=False)
    ids = [list(out.outputs[0].token_ids) for out in outputs]
    # vllm.LLM has no close(); its engine client's shutdown ends the engine core,
    # which ends the worker. Then the same reaping as edge's stage.
    llm.llm_engine.engine_core.shutdown()
    del llm, outputs
    gc.collect()
    from .vllm_stage import _reap

    leftover, terminated, killed = _reap(pids)
    return ids, {"engine_start_s": round(start_s, 3), "pids": list(pids), "leftover_pids": list(leftover),
                 "terminated_pids": list(terminated), "killed_pids": list(killed)}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token id, the shorter length if one is a prefix, None if equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def cmd_parity(args: argparse.Namespace) -> int:
    from .runtime_env import apply_runtime_env
    from .stream import StageRequest

    plan, registry, plan_s = _plan(args)
    if not plan.admitted:
        _print_plan_beside(plan, plan_s, args.json)
        _write_record({"outcome": "refused", "plan": plan.to_dict()}, "parity", args.json)
        return EXIT_REFUSED
    device = plan.selected_device
    if not str(plan.backend or "").startswith("vllm"):
        raise UsageError(f"parity compares plain vLLM with edge's vLLM stage; {device.device_id} runs "
                         f"{plan.backend}")
    env = apply_runtime_env()
    node_prep = _prepare_node(plan)
    with _Ticker(f"plain vllm.LLM: {len(PROMPTS)} prompts x {args.max_tokens} greedy tokens"):
        plain_ids, plain_info = plain_vllm_token_ids(dict(plan.engine_kwargs), PROMPTS, args.max_tokens)
    if plain_info["leftover_pids"]:
        raise StageError(f"plain vLLM left processes {plain_info['leftover_pids']} running; the second engine "
                         "must not start beside them")
    edge_ids: list[list[int]] = []
    with _TerminationAsInterrupt():
        stage, start_s = _start_stage(registry, device, plan)
        try:
            for index, prompt in enumerate(PROMPTS):
                request = StageRequest(prompt=prompt, max_tokens=args.max_tokens, temperature=0.0,
                                       ignore_eos=True)
                edge_ids.append(list(_Consumer(registry, device, stage, request).drain().token_ids))
                _progress_bar(index + 1, len(PROMPTS), "prompts through edge's stage")
        finally:
            stop_answer, stop_s = _stop_stage(registry, device, stage)
    rows = []
    for prompt, ours, theirs in zip(PROMPTS, edge_ids, plain_ids):
        position = first_divergence(ours, theirs)
        rows.append({"prompt": prompt, "identical": position is None, "first_divergent_position": position,
                     "edge_tokens": len(ours), "vllm_tokens": len(theirs),
                     "edge_token_ids": ours, "vllm_token_ids": theirs})
    diverged = [row for row in rows if not row["identical"]]
    stage_info = _stage_info(stage)
    document = {
        "outcome": "identical" if not diverged else "diverged",
        "model": plan.model_path,
        "artifact_id": plan.manifest.artifact_id,
        "device": device.device_id,
        "max_tokens": args.max_tokens,
        "engine_kwargs": dict(plan.engine_kwargs),
        "runtime_env": env.to_dict(),
        "node_prep": node_prep.to_dict() if node_prep is not None else None,
        "plain_vllm": plain_info,
        "edge": {"engine_start_s": round(start_s, 3), "stop_s": round(stop_s, 3), "stopped": stop_answer,
                 "stage": stage_info},
        "versions": stage_info.get("versions") or _versions(),
        "prompts": rows,
    }
    _write_record(document, "parity", args.json)
    same = len(rows) - len(diverged)
    print(f"parity    {same}/{len(rows)} prompts token-for-token identical ({args.max_tokens} greedy tokens each, "
          f"plain vllm.LLM vs edge's stage on {device.device_id})", file=sys.stderr if args.json == "-" else sys.stdout)
    for row in diverged:
        print(f"  diverged at token {row['first_divergent_position']}: {row['prompt'][:60]!r}",
              file=sys.stderr if args.json == "-" else sys.stdout)
    return EXIT_DIVERGED if diverged else EXIT_OK
