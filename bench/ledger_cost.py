"""What the host-wide session ledger adds to `edge plan` (issue 13: under 5 ms with ten live records).

    python bench/ledger_cost.py [--runs 15] [--records 10]

Ten live records (each names a sleeping child of this script, so the liveness
check does its real work) in a temporary ``EDGE_LEDGER_DIR``. Measured in the
same run:

1. in-process ``read_ledger()`` (list, open no-follow, parse, check each record's
   processes): median of 200 calls;
2. `edge plan --json` on the bundled demo in a fresh process, alternating an empty
   ledger and the ten-record one, ``--runs`` each: medians of wall time and of the
   plan's own ``decision_time_s``, and their differences.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--records", type=int, default=10)
    args = parser.parse_args()
    from edge_core.services import host_ledger as hl

    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
                for _ in range(args.records)]
    try:
        with tempfile.TemporaryDirectory(prefix="edge-ledger-bench-") as tmp:
            full, empty = Path(tmp) / "full", Path(tmp) / "empty"
            for directory in (full, empty):
                directory.mkdir(mode=0o700)
            time.sleep(0.5)
            for i, child in enumerate(sleepers):
                record = hl.SessionRecord(
                    session_id=f"bench{i}", pid=child.pid, processes=((child.pid, hl.start_time(child.pid) or 0.0),),
                    command="edge serve", interpreter=sys.executable, venv=None, model=f"org/model-{i}",
                    artifact_id=None, device_ids=("cpu",), reserved_bytes={"host_ram": 1 << 30},
                    predicted_peak_bytes=1 << 30, headroom_bytes=0, started_at=time.time(),
                    measured_current_bytes=1 << 29, updated_at=time.time())
                (full / f"bench{i}.json").write_text(json.dumps(record.to_dict()))
            assert len(hl.read_ledger(full).records) == args.records
            reads = []
            for _ in range(200):
                t = time.perf_counter()
                hl.read_ledger(full, clean=False)
                reads.append(time.perf_counter() - t)
            walls: dict[str, list[float]] = {"empty": [], "full": []}
            decisions: dict[str, list[float]] = {"empty": [], "full": []}
            for _ in range(args.runs):
                for name, directory in (("empty", empty), ("full", full)):
                    env = {**os.environ, "EDGE_LEDGER_DIR": str(directory)}
                    t = time.perf_counter()
                    proc = subprocess.run([sys.executable, "-m", "edge_core", "plan", "--json"], env=env,
                                          capture_output=True, text=True)
                    walls[name].append(time.perf_counter() - t)
                    decisions[name].append(json.loads(proc.stdout)["decision_time_s"])
    finally:
        for child in sleepers:
            child.kill()
            child.wait()
    med = statistics.median
    print(f"read_ledger() with {args.records} live records: median {med(reads) * 1000:.2f} ms (200 calls)")
    for name in ("empty", "full"):
        print(f"edge plan, {name:5s} ledger: wall {med(walls[name]) * 1000:.0f} ms, decision "
              f"{med(decisions[name]) * 1000:.1f} ms (median of {args.runs})")
    print(f"added by {args.records} records: decision {(med(decisions['full']) - med(decisions['empty'])) * 1000:+.1f} ms,"
          f" wall {(med(walls['full']) - med(walls['empty'])) * 1000:+.0f} ms; ratio of decision medians "
          f"{med(decisions['full']) / med(decisions['empty']):.3f} (target: under 5 ms added)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
