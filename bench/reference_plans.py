"""How long edge takes to decide on each published checkpoint of the reference set (issue 10: under 0.5 s).

    python bench/reference_plans.py [--runs 3] [--only REPO ...]

Needs edge-cpu (and the vLLM build it reads) in this interpreter. For every
entry of tests/reference_set.py it writes the published checkpoint
(header-only shards of the full tensor inventory) and times, in a fresh
process each time, `edge plan --model DIR --json` on the recording host's
device list (tests/data/vllm_cpu_reference.json): the median wall time of
``--runs`` runs, and the plan's own ``decision_time_s``, twice:

- cold: edge's header cache emptied before each run (the first plan of a
  checkpoint: every header parsed and checked);
- warm: after a plan of the same checkpoint (header sets of 1 MiB or more
  are then verified against the cached verdict instead of parsed; smaller
  ones are parsed every time, so their two figures agree).

The runs share one temporary ``XDG_CACHE_HOME``, primed first, so the other
caches there (vLLM's parsed source) are warm in both. Baseline, measured in
the same run: a fresh ``python -c "import vllm"``, the least any tool that
loads the engine to find out spends before it knows anything.

``--in-process`` times ``read_manifest`` alone in this interpreter instead
(wall and CPU seconds, cold and warm as above): the artifact layer's share,
without the interpreter start, plugin discovery or the planner.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 0.5


def timed(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return time.perf_counter() - started, proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="repository ids to time (default: all 32)")
    parser.add_argument("--in-process", action="store_true", help="time read_manifest() here, not `edge plan`")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import reference_set as ref

    if args.in_process:
        return in_process(ref, args.runs, args.only)

    recorded = json.loads((ROOT / "tests" / "data" / "vllm_cpu_reference.json").read_text())["provenance"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="edge-bench-") as tmp:
        devices = Path(tmp) / "devices.json"
        devices.write_text(json.dumps(recorded["host_devices"]))
        env = dict(os.environ, XDG_CACHE_HOME=str(Path(tmp) / "xdg"))
        headers = Path(tmp) / "xdg" / "edge" / "headers"

        def plan(model: Path) -> tuple[float, float, str]:
            wall, proc = timed([sys.executable, "-m", "edge_core", "plan", "--model", str(model), "--devices",
                                str(devices), "--json"], env)
            doc = json.loads(proc.stdout)
            verdict = "admitted" if doc["admitted"] else ",".join(sorted({r["code"] for r in doc["refusals"]}))
            return wall, doc["decision_time_s"], verdict

        entries = [e for e in ref.ENTRIES if args.only is None or e.repo in args.only]
        for entry in entries:
            model = ref.write_published(entry, Path(tmp) / entry.name)
            plan(model)  # primes XDG_CACHE_HOME (vLLM's parsed source) and this checkpoint's verdict
            cold, warm = [], []
            for _ in range(args.runs):
                shutil.rmtree(headers, ignore_errors=True)
                cold.append(plan(model))
                warm.append(plan(model))
            verdict = cold[-1][2]
            assert all(run[2] == verdict for run in cold + warm), (entry.repo, cold, warm)
            tensors = len(ref.tensors_for(entry, entry.config))
            rows.append((entry.repo, tensors, *(statistics.median(run[i] for run in runs)
                                                for runs in (cold, warm) for i in (0, 1)), verdict))
            print(f"{entry.repo:48s} {tensors:7d} tensors  cold wall {rows[-1][2]:.3f} s decision {rows[-1][3]:.3f} s"
                  f"  warm wall {rows[-1][4]:.3f} s decision {rows[-1][5]:.3f} s  {verdict}", flush=True)
    vllm = [timed([sys.executable, "-c", "import vllm"])[0] for _ in range(args.runs)]
    print(f"\nentries: {len(rows)}")
    for label, wall, decision in (("cold", 2, 3), ("warm", 4, 5)):
        worst = max(rows, key=lambda r: r[wall])
        print(f"{label}: median wall {statistics.median(r[wall] for r in rows):.3f} s, worst {worst[wall]:.3f} s "
              f"({worst[0]}); worst decision_time_s {max(r[decision] for r in rows):.3f} s; "
              f"under {TARGET_S} s: {sum(r[wall] < TARGET_S for r in rows)} of {len(rows)}; "
              f"worst wall / {TARGET_S} s target: {worst[wall] / TARGET_S:.2f}")
    worst = max(r[4] for r in rows)
    print(f"baseline `python -c 'import vllm'`: median {statistics.median(vllm):.2f} s; "
          f"ratio worst warm edge plan / import vllm: {worst / statistics.median(vllm):.3f}")
    return 0


def in_process(ref: Any, runs: int, only: list[str] | None) -> int:
    from edge_core.artifact import read_manifest

    with tempfile.TemporaryDirectory(prefix="edge-bench-") as tmp:
        os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / "xdg")
        headers = Path(tmp) / "xdg" / "edge" / "headers"
        for entry in (e for e in ref.ENTRIES if only is None or e.repo in only):
            model = ref.write_published(entry, Path(tmp) / entry.name)
            read_manifest(model)
            figures: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
            for _ in range(runs):
                for label in ("cold", "warm"):
                    if label == "cold":
                        shutil.rmtree(headers, ignore_errors=True)
                    wall, cpu = time.perf_counter(), time.process_time()
                    read_manifest(model)
                    figures[label].append((time.perf_counter() - wall, time.process_time() - cpu))
            line = "  ".join(f"{label} wall {statistics.median(w for w, _ in runs_):.3f} s cpu "
                             f"{statistics.median(c for _, c in runs_):.3f} s" for label, runs_ in figures.items())
            print(f"{entry.repo:48s} {len(ref.tensors_for(entry, entry.config)):7d} tensors  {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
