"""Start the real vLLM CPU engine on a checkpoint and measure what it costs.

Answers the questions edge's planner rests on, by running vLLM rather than
reading it: how long an engine start takes, whether greedy output repeats,
how much PSS/RSS the whole process tree (this process + the spawned engine
core and worker) holds before start, after start and at peak during
generation, and how long a bad checkpoint takes to fail.

Memory is sampled every 0.25 s from /proc/<pid>/smaps_rollup of every process
in the tree (psutil children(recursive=True)); peaks are lower bounds.

    python scripts/probe_vllm_cpu.py --model demo/tiny-llama --kv-mib 64 \
        --json-out /tmp/probe.json 2> /tmp/probe.log

The result JSON also goes to stdout as one line prefixed ``PROBE_RESULT``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import psutil

PERIOD_S = 0.25
FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def smaps_rollup(pid: int) -> dict[str, int] | None:
    """Bytes per field from smaps_rollup; None if the process is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in FIELDS:
                    out[key] = int(rest.split()[0]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return out


def label(p: psutil.Process) -> str:
    try:
        # vLLM retitles its processes (VLLM::EngineCore, VLLM::Worker...).
        cmd = p.cmdline()
        return (" ".join(cmd) if cmd else p.name())[:100]
    except psutil.Error:
        return "?"


class TreeSampler(threading.Thread):
    """Samples the process tree rooted here; keeps per-phase peaks of tree PSS."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process()
        self.phase = "pre_import"
        self.peaks: dict[str, dict] = {}
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def snapshot(self) -> dict:
        procs = [self.root] + self.root.children(recursive=True)
        per = []
        for p in procs:
            r = smaps_rollup(p.pid)
            if r is not None:
                per.append({"pid": p.pid, "name": label(p), **{k.lower(): v for k, v in r.items()}})
        tot = {k.lower(): sum(x.get(k.lower(), 0) for x in per) for k in FIELDS}
        return {"t": time.time(), "nprocs": len(per), "tree": tot, "procs": per}

    def run(self) -> None:
        while not self.stop.is_set():
            s = self.snapshot()
            with self.lock:
                cur = self.peaks.get(self.phase)
                if cur is None or s["tree"]["pss"] > cur["tree"]["pss"]:
                    self.peaks[self.phase] = s
            self.stop.wait(PERIOD_S)

    def set_phase(self, phase: str) -> dict:
        """Switch phase and return an immediate snapshot as its start point."""
        s = self.snapshot()
        with self.lock:
            self.phase = phase
            self.peaks[phase] = s
        return s


def gib(b: int) -> float:
    return round(b / 2**30, 3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kv-mib", type=int, default=64, help="kv_cache_memory_bytes in MiB (0: unset)")
    ap.add_argument("--gpu-mem-util", type=float, default=None, help="gpu_memory_utilization (default: vLLM's)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hold-s", type=float, default=1.0, help="sample this long after start and after generation")
    ap.add_argument("--json-out")
    args = ap.parse_args()

    started_at = psutil.Process().create_time()
    sampler = TreeSampler()
    sampler.start()
    # --hold-s 0 times failures from process start: no settling sleeps then.
    settle = PERIOD_S if args.hold_s else 0.0
    time.sleep(settle)
    result: dict = {"model": args.model, "kv_mib": args.kv_mib, "gpu_mem_util": args.gpu_mem_util,
                    "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "LD_PRELOAD"))}}
    snaps: dict[str, dict] = {"pre_import": sampler.set_phase("imports")}

    t0 = time.time()
    import vllm
    from vllm import LLM, SamplingParams

    result["vllm_version"] = vllm.__version__
    result["import_s"] = round(time.time() - t0, 2)
    time.sleep(settle)
    snaps["after_import"] = sampler.set_phase("start")

    kwargs = dict(model=args.model, dtype="bfloat16", max_model_len=args.max_model_len,
                  max_num_seqs=1, enforce_eager=True, seed=0)
    if args.kv_mib:
        kwargs["kv_cache_memory_bytes"] = args.kv_mib * 2**20
    if args.gpu_mem_util is not None:
        kwargs["gpu_memory_utilization"] = args.gpu_mem_util
    result["engine_args"] = kwargs

    t0 = time.time()
    try:
        llm = LLM(**kwargs)
    except BaseException as e:  # report how long the failure took, then the error
        result["failed"] = {"phase": "start", "error": f"{type(e).__name__}: {e}",
                            "since_process_start_s": round(time.time() - started_at, 2),
                            "since_llm_call_s": round(time.time() - t0, 2)}
        return finish(result, sampler, snaps, args)
    result["engine_start_s"] = round(time.time() - t0, 2)
    time.sleep(args.hold_s)
    snaps["after_start"] = sampler.set_phase("generate")

    prompts = ["The gateway box sits in a cupboard", "Which device can run this checkpoint?",
               "Tokens arrive one at a time.", "Numbers without a source are guesses."]
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    t0 = time.time()
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    except BaseException as e:
        result["failed"] = {"phase": "generate", "error": f"{type(e).__name__}: {e}",
                            "since_process_start_s": round(time.time() - started_at, 2)}
        return finish(result, sampler, snaps, args)
    result["generate_s"] = round(time.time() - t0, 2)
    result["token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
    result["texts"] = [o.outputs[0].text[:80] for o in outs]
    time.sleep(args.hold_s)
    snaps["after_generate"] = sampler.set_phase("done")
    return finish(result, sampler, snaps, args)


def finish(result: dict, sampler: TreeSampler, snaps: dict, args) -> int:
    sampler.stop.set()
    sampler.join()
    peaks = sampler.peaks

    def brief(s: dict) -> dict:
        return {"nprocs": s["nprocs"], "tree_pss_gib": gib(s["tree"]["pss"]), "tree_rss_gib": gib(s["tree"]["rss"]),
                "tree": s["tree"],
                "procs": [{"pid": p["pid"], "name": p["name"], "pss_mib": round(p["pss"] / 2**20, 1),
                           "rss_mib": round(p["rss"] / 2**20, 1), "pss_anon_mib": round(p["pss_anon"] / 2**20, 1),
                           "pss_file_mib": round(p["pss_file"] / 2**20, 1),
                           "pss_shmem_mib": round(p["pss_shmem"] / 2**20, 1)} for p in s["procs"]]}

    result["snapshots"] = {k: brief(v) for k, v in snaps.items()}
    result["phase_peaks"] = {k: brief(v) for k, v in peaks.items()}
    line = json.dumps(result)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    print("PROBE_RESULT " + line, flush=True)
    return 1 if "failed" in result else 0


if __name__ == "__main__":
    sys.exit(main())
