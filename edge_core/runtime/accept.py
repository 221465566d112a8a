"""Does an admitted plan pass the acceptance run? A record of criteria, each with its evidence.

Decisions with the device visible and masked (both must decide; the masked
one must refuse without an engine), twelve fixed prompts to 128 greedy tokens
(``ignore_eos``), the budget against every counter it covers, and a cancel in
the middle of a request that must leak nothing. :func:`run_acceptance` runs
it and returns the record; the CLI writes and renders it.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..stream import StageRequest
from .logs import EngineLog
from .processes import alive, children_alive
from .session import Observer, SilentObserver, StageSession, plan_summary, round_or_none

if TYPE_CHECKING:
    from ..plans import Plan
    from ..services.registry import Registry

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


@dataclass(frozen=True)
class Criterion:
    """One acceptance criterion and its evidence."""

    name: str
    passed: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail}


def decision_criteria(plan: Plan, visible_s: float, masked_plan: Plan, masked_s: float) -> list[Criterion]:
    """Both startups reach a decision; the masked one refuses before any engine exists."""
    assert plan.selected_device is not None
    kind = plan.selected_device.kind
    engine_free = "vllm" not in sys.modules and not children_alive()
    return [
        Criterion("decision_visible", plan.admitted,
                  f"{'admitted on ' + plan.selected_device.device_id if plan.admitted else 'refused'} "
                  f"in {visible_s * 1000:.0f} ms"),
        Criterion("decision_masked", not masked_plan.admitted and engine_free,
                  f"with {kind} masked: {'admitted (should refuse)' if masked_plan.admitted else 'refused'} "
                  f"[{', '.join(r.code for r in masked_plan.refusals)}] in {masked_s * 1000:.0f} ms; "
                  f"{'no engine, vLLM not imported' if engine_free else 'an engine or vLLM was already loaded'}"),
    ]


def cancel_mid_request(session: StageSession) -> dict[str, Any]:
    """Cancel a long request mid-decode and check nothing of it is left."""
    stage = session.stage
    # As long as the context allows, so the request is surely still decoding
    # when the consumer has seen CANCEL_AFTER_EVENTS events.
    budget = max(int(session.plan.session.max_model_len or 0) - 64, CANCEL_AFTER_EVENTS * 4)
    request = StageRequest(prompt=PROMPTS[0], max_tokens=budget, temperature=0.0, ignore_eos=True)
    consumer = session.request(request)
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


def run_acceptance(plan: Plan, registry: Registry, *, visible_s: float, masked_plan: Plan, masked_s: float,
                   observer: Observer | None = None, engine_log: EngineLog | None = None,
                   keep_log: bool = False) -> dict[str, Any]:
    """The acceptance run of an admitted ``plan``; ``masked_plan`` was planned with its device kind masked.

    ``keep_log`` keeps the engine log after a clean run (a path the user named).

    Returns the record: ``outcome`` ``passed`` or ``failed``, the failed
    criteria by name, every criterion with its evidence, medians, timings,
    memory against the budget, each prompt's tokens and the cancel's report.
    """
    said: Observer = observer or SilentObserver()
    criteria = decision_criteria(plan, visible_s, masked_plan, masked_s)
    results = []
    cancel_info: dict[str, Any] = {}
    session = StageSession(plan, registry, said, engine_log=engine_log, keep_log=keep_log)
    with session:
        for index, prompt in enumerate(PROMPTS):
            request = StageRequest(prompt=prompt, max_tokens=ACCEPT_TOKENS, temperature=0.0, ignore_eos=True)
            results.append(session.request(request).drain())
            last = results[-1]
            said.progress(index + 1, len(PROMPTS),
                              f"prompts, {len(last.token_ids)} tokens, {last.decode_tokens_per_s or 0:.0f} tok/s")
        cancel_info = cancel_mid_request(session)
    leftover = [pid for pid in session.stage_pids if alive(pid)]
    children = children_alive()

    complete = [r for r in results if len(r.token_ids) == ACCEPT_TOKENS and r.finish_reason == "length"]
    criteria.append(Criterion(
        "prompts_complete", len(complete) == len(PROMPTS),
        f"{len(complete)}/{len(PROMPTS)} prompts reached {ACCEPT_TOKENS} greedy tokens (finish_reason length)",
    ))
    memory = session.memory()
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
    info = session.info()
    failed = [c for c in criteria if not c.passed]
    assert plan.manifest is not None and plan.selected_device is not None
    return {
        "outcome": "passed" if not failed else "failed",
        "failed": [c.name for c in failed],
        "criteria": [c.to_dict() for c in criteria],
        "model": plan.model_path,
        "artifact_id": plan.manifest.artifact_id,
        "device": plan.selected_device.device_id,
        "executed_on": info.get("executed_on"),
        "versions": session.versions(),
        "medians": {
            "time_to_first_token_s": round_or_none(statistics.median(ttfts)) if ttfts else None,
            "decode_tokens_per_s": round_or_none(statistics.median(rates), 2) if rates else None,
        },
        "timings": {"plan_visible_s": round(visible_s, 4), "plan_masked_s": round(masked_s, 4),
                    "engine_start_s": round(session.start_s, 3), "stop_s": round(session.stop_s, 3)},
        "memory": memory,
        "prompts": [r.to_dict() for r in results],
        "cancel": cancel_info,
        "plan": plan_summary(plan),
        "masked_plan": {"admitted": masked_plan.admitted, "refusals": [r.to_dict() for r in masked_plan.refusals]},
        "node_prep": session.node_prep.to_dict() if session.node_prep is not None else None,
        "stage": info,
        "stopped": session.stop_answer,
    }


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f} MiB"
