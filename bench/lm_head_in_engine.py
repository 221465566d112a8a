"""What the LM head costs inside a vLLM CPU worker during decode, read from the worker (issue 26).

One engine (``--side edge``: edge's engine mark set, every edge-cpu plugin acting, as
``edge run``; ``--side plain``: without it, as bench/memory_vs_vllm.py's plain run) on one of
that script's header-only geometries, ``load_format="dummy"``, the engine
arguments of ``edge plan --json``. Through ``collective_rpc`` the worker reports

* its threads (``torch.get_num_threads``, the CPUs it may run on) and the LM head's
  weight (shape, strides, contiguity) and which ``cpu_linear`` it was given;
* the head's product on one row, timed in the worker, median of 15 after 2 warm-ups:
  its own ``cpu_linear``, ``torch.nn.functional.linear`` on the float table, and a
  oneDNN copy packed on the spot (vLLM's ``create_onednn_mm``);
* then, wrapped around the head's ``cpu_linear`` and the model runner's
  ``execute_model``, every call's time and input rows while ``--tokens`` greedy
  tokens are generated: the head's share of each decode step.

    flock /tmp/edge-engine.lock python bench/lm_head_in_engine.py --size 0.6b-tied --side edge
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory_vs_vllm as mvv  # noqa: E402 - the geometries and the plan's engine arguments


def _median_ms(fn: Any, repeats: int = 15) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def facts(worker: Any) -> dict[str, Any]:
    """In the worker: threads, the head's weight and kernel, the head's one-row product three ways."""
    import torch
    from vllm import _custom_ops as ops

    from edge_cpu._packing import packed, shared_packed

    head = worker.model_runner.model.lm_head
    w = head.weight
    x = torch.randn(1, w.shape[1], dtype=w.dtype)
    out = {"threads": torch.get_num_threads(), "affinity": sorted(os.sched_getaffinity(0)),
           "weight": {"shape": list(w.shape), "stride": list(w.stride()), "contiguous": w.is_contiguous(),
                      "dtype": str(w.dtype), "align_64": w.data_ptr() % 64 == 0},
           "head_packed": packed(head), "shared_packed": shared_packed(head), "cpu_linear": getattr(head.cpu_linear, "__qualname__", repr(head.cpu_linear))}
    out["own_ms"] = _median_ms(lambda: head.cpu_linear(x, w, None))
    out["f_linear_ms"] = _median_ms(lambda: torch.nn.functional.linear(x, w))  # on a packed table: timing only
    if not out["shared_packed"]:  # a packed copy beside the float table: 1-2 tables more for a moment
        handler = ops.create_onednn_mm(w.t(), 32)
        out["onednn_ms"] = _median_ms(lambda: ops.onednn_mm(handler, x, None))
    return out


def instrument(worker: Any) -> bool:
    """In the worker: time every call of the head's ``cpu_linear`` and of ``execute_model`` (seconds, rows)."""
    head, runner = worker.model_runner.model.lm_head, worker.model_runner
    calls: dict[str, list[tuple[float, int]]] = {"head": [], "step": []}
    worker.edge_bench_calls = calls  # on the worker: this script's functions are pickled by value
    linear, execute = head.cpu_linear, runner.execute_model

    def timed_linear(x: Any, weight: Any, bias: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return linear(x, weight, bias)
        finally:
            calls["head"].append((time.perf_counter() - t0, int(x.shape[0])))

    def timed_execute(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return execute(*args, **kwargs)
        finally:
            calls["step"].append((time.perf_counter() - t0, 0))

    head.cpu_linear, runner.execute_model = timed_linear, timed_execute
    return True


def readback(worker: Any) -> dict[str, list[tuple[float, int]]]:
    return {k: list(v) for k, v in worker.edge_bench_calls.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("/tmp/mvv"))
    ap.add_argument("--size", default="0.6b-tied")
    ap.add_argument("--side", choices=("plain", "edge"), default="edge")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--edge", default=str(Path(sys.executable).with_name("edge")))
    args = ap.parse_args(argv)
    model = mvv.build(args.out, args.size)
    kwargs = mvv.engine_kwargs(args.edge, model, args.max_model_len)

    from edge_core.runtime.env import apply_runtime_env

    apply_runtime_env(edge_engine=args.side == "edge", layout_env=kwargs.pop("_env", {}), layout_why="the plan's")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of this script's functions
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, detokenize=False)
    prompt = TokensPrompt(prompt_token_ids=[3, 5, 7, 11])
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    found = llm.collective_rpc(facts)[0]
    llm.collective_rpc(instrument)
    t0 = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    calls = llm.collective_rpc(readback)[0]
    decode_heads = [s for s, rows in calls["head"][1:]]
    steps = [s for s, _ in calls["step"][1:]]
    found.update(size=args.size, side=args.side, generate_s=wall, head_rows=sorted({r for _, r in calls["head"]}),
                 decode_head_ms=statistics.median(decode_heads) * 1e3, decode_step_ms=statistics.median(steps) * 1e3,
                 head_calls=len(calls["head"]), steps=len(calls["step"]))
    print("FACTS " + json.dumps(found), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
