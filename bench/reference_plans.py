"""How long edge takes to decide on each published checkpoint of the reference set (issue 10: under 0.5 s).

    python bench/reference_plans.py [--runs 3] [--only REPO ...] [--before DIR] [--in-process]

Needs edge-cpu (and the vLLM build it reads) in this interpreter. For every
entry of tests/reference_set.py it writes the published checkpoint
(header-only shards of the full tensor inventory) and times, in a fresh
process each time, `edge plan --model DIR --json` on the recording host's
device list (tests/data/vllm_cpu_reference.json): the median wall time of
``--runs`` runs, the CPU seconds the process used (user + system: steadier
than wall time on a shared VM whose speed drifts from minute to minute), and
the plan's own ``decision_time_s``, twice:

- cold: edge's header cache emptied before each run (the first plan of a
  checkpoint: every header parsed and checked);
- warm: after a plan of the same checkpoint (header sets of 1 MiB or more
  are then verified against the cached verdict instead of parsed; smaller
  ones are parsed every time, so their two figures agree).

The runs share one temporary ``XDG_CACHE_HOME``, primed first, so the other
caches there (vLLM's parsed source) are warm in both. ``--before DIR`` also
times another checkout of edge (e.g. ``git archive 7e0f3e8 | tar -x -C DIR``:
its ``edge_core`` and ``plugins/edge_cpu`` first on ``PYTHONPATH``, with a cache
directory of its own, primed too, its header cache emptied before each run:
cold, to compare with this checkout's cold), each of its runs next to one of
this checkout's, so a busy machine slows both alike.
Baseline, measured in the same run: a fresh ``python -c "import vllm"``, the
least any tool that loads the engine to find out spends before it knows
anything.

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


def timed(cmd: list[str], env: dict[str, str] | None = None,
          cwd: str | None = None) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    """Wall seconds, the child's CPU seconds (user + system) and the finished process."""
    before, started = os.times(), time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd)
    wall, after = time.perf_counter() - started, os.times()
    return wall, (after.children_user - before.children_user) + (after.children_system - before.children_system), proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=None, help="repository ids to time (default: all 32)")
    parser.add_argument("--before", type=Path, default=None, help="another edge checkout to time alongside")
    parser.add_argument("--in-process", action="store_true", help="time read_manifest() here, not `edge plan`")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import reference_set as ref

    entries = [e for e in ref.ENTRIES if args.only is None or e.repo in args.only]
    if args.in_process:
        return in_process(ref, entries, args.runs)
    recorded = json.loads((ROOT / "tests" / "data" / "vllm_cpu_reference.json").read_text())["provenance"]
    kinds = ("cold", "warm", *(("before",) if args.before else ()))
    rows: list[tuple[str, int, dict[str, tuple[float, float, float]]]] = []
    with tempfile.TemporaryDirectory(prefix="edge-bench-") as tmp:
        devices = Path(tmp) / "devices.json"
        devices.write_text(json.dumps(recorded["host_devices"]))
        env = dict(os.environ, XDG_CACHE_HOME=str(Path(tmp) / "xdg"))
        headers = Path(tmp) / "xdg" / "edge" / "headers"
        before_env = None
        if args.before:
            before = args.before.resolve()
            # Its own cache directory: the two checkouts' caches of vLLM's parsed source have one file name
            # and different keys, and would evict each other on every run.
            before_env = dict(env, XDG_CACHE_HOME=str(Path(tmp) / "xdg-before"),
                              PYTHONPATH=os.pathsep.join([str(before), str(before / "plugins" / "edge_cpu")]))

        def plan(model: Path, kind: str) -> tuple[float, float, float, str]:
            # ``-m`` puts the working directory first on sys.path: the earlier checkout runs from elsewhere.
            wall, cpu, proc = timed([sys.executable, "-m", "edge_core", "plan", "--model", str(model), "--devices",
                                str(devices), "--json"], before_env if kind == "before" else env,
                               cwd=tmp if kind == "before" else None)
            doc = json.loads(proc.stdout)
            verdict = "admitted" if doc["admitted"] else ",".join(sorted({r["code"] for r in doc["refusals"]}))
            return wall, cpu, doc["decision_time_s"], verdict

        for entry in entries:
            model = ref.write_published(entry, Path(tmp) / entry.name)
            for kind in kinds:
                plan(model, kind)  # primes XDG_CACHE_HOME (vLLM's parsed source) and this checkpoint's verdict
            runs: dict[str, list[tuple[float, float, float, str]]] = {kind: [] for kind in kinds}
            for _ in range(args.runs):
                for kind in kinds:
                    if kind == "cold":
                        shutil.rmtree(headers, ignore_errors=True)
                    elif kind == "before":  # the other checkout's first plan too: cold against cold
                        shutil.rmtree(Path(tmp) / "xdg-before" / "edge" / "headers", ignore_errors=True)
                    runs[kind].append(plan(model, kind))
            verdicts = {run[3] for kind in ("cold", "warm") for run in runs[kind]}
            assert len(verdicts) == 1, (entry.repo, runs)
            tensors = len(ref.tensors_for(entry, entry.config))
            medians = {kind: tuple(statistics.median(r[i] for r in runs[kind]) for i in range(3)) for kind in kinds}
            rows.append((entry.repo, tensors, medians))
            print(f"{entry.repo:48s} {tensors:7d} tensors  " + "  ".join(
                f"{kind} wall {wall:.3f} s cpu {cpu:.3f} s decision {decision:.3f} s"
                for kind, (wall, cpu, decision) in medians.items())
                + f"  {verdicts.pop()}", flush=True)
    vllm = [timed([sys.executable, "-c", "import vllm"])[0] for _ in range(args.runs)]
    print(f"\nentries: {len(rows)}")
    for kind in kinds:
        worst = max(rows, key=lambda r: r[2][kind][0])
        print(f"{kind}: median wall {statistics.median(r[2][kind][0] for r in rows):.3f} s, worst "
              f"{worst[2][kind][0]:.3f} s ({worst[0]}); worst cpu {max(r[2][kind][1] for r in rows):.3f} s; "
              f"worst decision_time_s {max(r[2][kind][2] for r in rows):.3f} s; under {TARGET_S} s: "
              f"{sum(r[2][kind][0] < TARGET_S for r in rows)} of {len(rows)}; worst wall / {TARGET_S} s target: "
              f"{worst[2][kind][0] / TARGET_S:.2f}")
    worst_warm = max(r[2]["warm"][0] for r in rows)
    print(f"baseline `python -c 'import vllm'`: median {statistics.median(vllm):.2f} s; "
          f"ratio worst warm edge plan / import vllm: {worst_warm / statistics.median(vllm):.3f}")
    return 0


def in_process(ref: Any, entries: list[Any], runs: int) -> int:
    from edge_core.artifact import read_manifest

    with tempfile.TemporaryDirectory(prefix="edge-bench-") as tmp:
        os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / "xdg")
        headers = Path(tmp) / "xdg" / "edge" / "headers"
        for entry in entries:
            model = ref.write_published(entry, Path(tmp) / entry.name)
            read_manifest(model)
            figures: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
            for _ in range(runs):
                for kind in figures:
                    if kind == "cold":
                        shutil.rmtree(headers, ignore_errors=True)
                    elif kind == "before":  # the other checkout's first plan too: cold against cold
                        shutil.rmtree(Path(tmp) / "xdg-before" / "edge" / "headers", ignore_errors=True)
                    wall, cpu = time.perf_counter(), time.process_time()
                    read_manifest(model)
                    figures[kind].append((time.perf_counter() - wall, time.process_time() - cpu))
            line = "  ".join(f"{kind} wall {statistics.median(w for w, _ in got):.3f} s cpu "
                             f"{statistics.median(c for _, c in got):.3f} s" for kind, got in figures.items())
            print(f"{entry.repo:48s} {len(ref.tensors_for(entry, entry.config)):7d} tensors  {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
