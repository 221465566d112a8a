"""Where a decode step's time goes in one vLLM CPU process, and what the OpenMP binding does to it (issue 38).

One engine per variant, each in a child process: ``vllm.LLM`` with the plan's
engine arguments (``edge plan --json``) in one process (the layout ``edge run``
plans for one CPU rank), with edge's engine mark (``--side edge``: edge-cpu's
levers act) or without (``--side plain``), and the variant's OpenMP variables
set before vLLM is imported. The child wraps the model runner's
``execute_model``, the model's ``forward``, the LM head's ``cpu_linear``,
``compute_logits``, the sampler, the scheduler and the output processor with
timers, then drives ``LLMEngine.step()`` itself over ``--reps`` greedy requests
of ``--max-tokens`` tokens, and prints decode tok/s per request (tokens after
the first over first-to-last) and each part's median per step. Variants run
in order, ``--rounds`` times (alternating); run it under the engine lock.

    /work/bin/engine-lock measure python bench/decode_in_process.py --model /work/models/smollm2-135m-instruct \\
        --variant '{}' --variant '{"OMP_NUM_THREADS": "2", "OMP_PLACES": "{0},{1}", "OMP_PROC_BIND": "close"}'
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = "The capital of France is Paris. The capital of Germany is"


def child(spec: dict[str, Any]) -> None:
    from edge_core.runtime.env import apply_runtime_env

    apply_runtime_env(edge_engine=spec["side"] == "edge",
                      layout_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **spec["variant"]}, layout_why="the variant")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    t1 = time.perf_counter()
    llm = LLM(**spec["kwargs"])
    t2 = time.perf_counter()
    import torch

    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    model = runner.model
    times: dict[str, list[float]] = {}

    def timed(owner: Any, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times.setdefault(key, []).append(time.perf_counter() - started)

        setattr(owner, name, wrapper)

    for owner, name in ((runner, "execute_model"), (runner, "sample_tokens"), (model, "forward"),
                        (model, "compute_logits"), (model.lm_head, "cpu_linear"), (core.scheduler, "schedule"),
                        (engine.output_processor, "process_outputs")):
        if hasattr(owner, name):
            timed(owner, name, name if owner is not model.lm_head else "lm_head")
    rates, steps = [], []
    for rep in range(spec["reps"]):
        for values in times.values():
            values.clear()
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(str(rep), PROMPT, params)
        first = last = None
        count = first_count = 0
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            outputs = engine.step()
            steps.append(time.perf_counter() - started)
            for out in outputs:
                new = len(out.outputs[0].token_ids)
                if new:
                    now = time.perf_counter()
                    if first is None:
                        first, first_count = now, new
                    last, count = now, count + new
        assert first is not None and last is not None
        rates.append((count - first_count) / (last - first))
    parts = {key: round(statistics.median(v[2:]) * 1e3, 3) for key, v in times.items() if len(v) > 3}
    print("RESULT " + json.dumps({"variant": spec["variant"], "side": spec["side"], "import_s": round(t1 - t0, 2),
                                  "engine_s": round(t2 - t1, 2), "threads": torch.get_num_threads(),
                                  "tok_s": [round(r, 2) for r in rates],
                                  "step_ms": round(statistics.median(steps) * 1e3, 3), "parts_ms": parts}),
          flush=True)
    engine.engine_core.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/models/smollm2-135m-instruct")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3, help="requests per engine")
    ap.add_argument("--rounds", type=int, default=1, help="times every variant runs, alternating")
    ap.add_argument("--side", choices=("edge", "plain"), default="edge")
    ap.add_argument("--variant", action="append", default=[], help="OpenMP variables as JSON (repeatable)")
    ap.add_argument("--edge", default=str(Path(sys.executable).with_name("edge")))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    plan = json.loads(subprocess.run([args.edge, "plan", "--model", args.model, "--max-model-len",
                                      str(args.max_model_len), "--json"], capture_output=True, text=True).stdout)
    kwargs = plan["engine_kwargs"]
    for _ in range(args.rounds):
        for variant in args.variant or ["{}"]:
            spec = {"variant": json.loads(variant), "side": args.side, "kwargs": kwargs, "reps": args.reps,
                    "max_tokens": args.max_tokens}
            out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True,
                                 text=True, env=dict(os.environ))
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
            print(line[7:] if line else f"FAILED {variant}: {out.stderr[-1500:]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
