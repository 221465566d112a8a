"""Two checkouts of edge, the same cheap commands, interleaved in one run: did a change make them slower?

    git worktree add /tmp/before <commit>
    python bench/compare_trees.py /tmp/before . [--runs 21]

Each command runs in a fresh interpreter with ``PYTHONPATH`` set to one tree
(and its ``plugins/edge_cpu``, so the backend comes from the same tree), the
two trees alternating run by run so a busy machine slows both alike. Wall and
CPU time (user + system of the child) are reported as medians, with the ratio
after/before. Compile both trees first (``python -m compileall -q TREE``)
where ``PYTHONDONTWRITEBYTECODE`` is set, or the first tree to run pays for
compiling.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

COMMANDS = {
    "edge devices --json": ["-m", "edge_core", "devices", "--json"],
    "edge plugins --json": ["-m", "edge_core", "plugins", "--json"],
    "edge plan (hd16 demo)": ["-m", "edge_core", "plan", "--model",
                              str(Path(__file__).resolve().parents[1] / "edge_core" / "demo" / "tiny-llama-hd16")],
    "import edge_core": ["-c", "import edge_core"],
}


def once(tree: str, argv: list[str]) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{tree}/plugins/edge_cpu")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    import time

    started = time.perf_counter()
    subprocess.run([sys.executable, *argv], env=env, cwd="/", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--runs", type=int, default=21)
    args = parser.parse_args()
    trees = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    for name, argv in COMMANDS.items():
        walls: dict[str, list[float]] = {k: [] for k in trees}
        cpus: dict[str, list[float]] = {k: [] for k in trees}
        for tree in trees.values():
            once(tree, argv)  # warm the page cache
        for _ in range(args.runs):
            for key, tree in trees.items():
                wall, cpu = once(tree, argv)
                walls[key].append(wall)
                cpus[key].append(cpu)
        w = {k: statistics.median(v) for k, v in walls.items()}
        c = {k: statistics.median(v) for k, v in cpus.items()}
        print(f"{name:<24} wall {w['before'] * 1000:6.1f} -> {w['after'] * 1000:6.1f} ms ({w['after'] / w['before']:.3f})"
              f" | cpu {c['before'] * 1000:6.1f} -> {c['after'] * 1000:6.1f} ms ({c['after'] / c['before']:.3f})"
              f"  [{args.runs} interleaved runs each]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
