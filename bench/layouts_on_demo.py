"""Every TP x PP layout of the demo on this host: what ``edge plan`` says, and what ``edge run`` then does (issue 24).

    python bench/layouts_on_demo.py [--max 4] [--taskset 0] [--markdown]

For TP and PP from 1 to ``--max``, with the process's affinity as it is and
under ``taskset -c CPUS`` (``--taskset``): ``edge plan --json`` (timed, the
interpreter's start included) and, for each admitted layout, ``edge run --json
--max-tokens 8 --ignore-eos`` on the same prompt. A row says the verdict, the
refusal codes and the dimension they name, and the run's exit code, token count,
token ids and engine start. edge's promise is that every admitted row generates
and every refused one is refused in well under a second. Start engines one at a
time (``flock``): an admitted TP 2 uses every core.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PROMPT = "The capital of France is"


def edge(args: list[str], cpus: str | None, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    prefix = ["taskset", "-c", cpus] if cpus is not None else []
    started = time.monotonic()
    done = subprocess.run([*prefix, sys.executable, "-m", "edge_core", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
    return done, time.monotonic() - started


def row(tp: int, pp: int, cpus: str | None) -> dict:
    layout = ["--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp)]
    planned, plan_s = edge(["plan", "--json", *layout], cpus, 60)
    plan = json.loads(planned.stdout)
    out: dict = {"tp": tp, "pp": pp, "taskset": cpus, "plan_exit": planned.returncode, "plan_s": round(plan_s, 2),
                 "admitted": plan.get("admitted"),
                 "codes": sorted({r["code"] for r in plan.get("refusals", [])}),
                 "dimensions": sorted({str((r.get("details") or {}).get("dimension"))
                                       for r in plan.get("refusals", []) if (r.get("details") or {}).get("dimension")})}
    if plan.get("admitted"):
        bind = ((plan.get("parallel") or {}).get("env") or {}).get("VLLM_CPU_OMP_THREADS_BIND")
        out["bind"] = bind
        ran, run_s = edge(["run", "--json", *layout, "--max-tokens", "8", "--ignore-eos", "--prompt", PROMPT],
                          cpus, 900)
        record = json.loads(ran.stdout) if ran.stdout.strip().startswith("{") else {}
        out.update(run_exit=ran.returncode, run_s=round(run_s, 1), tokens=record.get("tokens"),
                   token_ids=record.get("token_ids"),
                   engine_start_s=(record.get("timings") or {}).get("engine_start_s"))
        if ran.returncode:
            out["run_error"] = ran.stderr.strip().splitlines()[-1:] if ran.stderr.strip() else []
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max", type=int, default=4, help="largest TP and PP size (4)")
    ap.add_argument("--taskset", default="0", help="the CPU list of the restricted pass ('' skips it; 0)")
    ap.add_argument("--markdown", action="store_true", help="print a table instead of JSON lines")
    args = ap.parse_args()
    rows = []
    for cpus in [None, *([args.taskset] if args.taskset else [])]:
        for tp in range(1, args.max + 1):
            for pp in range(1, args.max + 1):
                rows.append(row(tp, pp, cpus))
                if not args.markdown:
                    print(json.dumps(rows[-1]), flush=True)
    if args.markdown:
        print("| layout | taskset | verdict (plan s) | codes / dimension | edge run |")
        print("|---|---|---|---|---|")
        for r in rows:
            verdict = f"{'admitted' if r['admitted'] else 'refused'} ({r['plan_s']} s)"
            if r["admitted"]:
                verdict += f", bind `{r.get('bind')}`" if r.get("bind") else ""
                ran = (f"exit {r['run_exit']}, {r['tokens']} tokens {r['token_ids']}, engine start "
                       f"{r['engine_start_s']} s") if r["run_exit"] == 0 else f"exit {r['run_exit']}: {r.get('run_error')}"
            else:
                ran = "not started"
            why = f"{', '.join(r['codes'])} / {', '.join(r['dimensions'])}" if r["codes"] else "-"
            print(f"| TP {r['tp']} x PP {r['pp']} | {('-c ' + r['taskset']) if r['taskset'] else 'none'} | "
                  f"{verdict} | {why} | {ran} |")
    bad = [r for r in rows if (r["admitted"] and r.get("run_exit") != 0) or (not r["admitted"] and r["plan_s"] >= 1.0)]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
