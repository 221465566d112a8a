"""How long edge takes to decide on each published checkpoint of the reference set (issue 10: under 0.5 s).

    python bench/reference_plans.py [--runs 3]

Needs edge-cpu (and the vLLM build it reads) in this interpreter. For every
entry of tests/reference_set.py it writes the published checkpoint
(header-only shards of the full tensor inventory) and times, in a fresh
process each time, `edge plan --model DIR --json` on the recording host's
device list (tests/data/vllm_cpu_reference.json): the median wall time of
``--runs`` runs, and the plan's own ``decision_time_s``. Baseline, measured in
the same run: a fresh ``python -c "import vllm"``, the least any tool that
loads the engine to find out spends before it knows anything.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_S = 0.5


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    started = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return time.perf_counter() - started, proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import reference_set as ref

    recorded = json.loads((ROOT / "tests" / "data" / "vllm_cpu_reference.json").read_text())["provenance"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="edge-bench-") as tmp:
        devices = Path(tmp) / "devices.json"
        devices.write_text(json.dumps(recorded["host_devices"]))
        for entry in ref.ENTRIES:
            model = ref.write_published(entry, Path(tmp) / entry.name)
            walls, decisions, verdict = [], [], ""
            for _ in range(args.runs):
                wall, proc = timed([sys.executable, "-m", "edge_core", "plan", "--model", str(model), "--devices",
                                    str(devices), "--json"])
                doc = json.loads(proc.stdout)
                walls.append(wall)
                decisions.append(doc["decision_time_s"])
                verdict = "admitted" if doc["admitted"] else ",".join(sorted({r["code"] for r in doc["refusals"]}))
            tensors = len(ref.tensors_for(entry, entry.config))
            rows.append((entry.repo, tensors, statistics.median(walls), statistics.median(decisions), verdict))
            print(f"{entry.repo:48s} {tensors:7d} tensors  wall {rows[-1][2]:.3f} s  decision "
                  f"{rows[-1][3]:.3f} s  {verdict}", flush=True)
    vllm = [timed([sys.executable, "-c", "import vllm"])[0] for _ in range(args.runs)]
    worst = max(r[2] for r in rows)
    print(f"\nentries: {len(rows)}; median wall {statistics.median(r[2] for r in rows):.3f} s, worst {worst:.3f} s "
          f"({max(rows, key=lambda r: r[2])[0]}); worst decision_time_s {max(r[3] for r in rows):.3f} s")
    print(f"worst wall / {TARGET_S} s target: {worst / TARGET_S:.2f}")
    print(f"baseline `python -c 'import vllm'`: median {statistics.median(vllm):.2f} s; "
          f"ratio worst edge plan / import vllm: {worst / statistics.median(vllm):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
