"""Capture what the planner answers, so a refactor can show it changed nothing.

Writes one JSON file per case under OUT: ``edge plan --json`` on the bundled
demo, the hd16 demo, Llama-3.1-70B as header-only shards, a two-host device
list (plain and pinned pipeline-parallel), every published checkpoint of
``tests/reference_set.py``; and ``kv.json``, the KV layout, charge and inverse
of every published config the tests carry, under several session settings.
Timing fields are dropped and the checkout's own path is written ``<repo>``,
so two checkouts compare with ``diff -r``:

    python scripts/plan_snapshot.py /tmp/before
    # ... change the code ...
    python scripts/plan_snapshot.py /tmp/after --devices-json /tmp/before/devices.json
    diff -r /tmp/before /tmp/after && echo identical

Every plan reads one saved device list (this host's, captured by the first
run), so free memory moving between runs changes nothing. No engine starts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Keys whose values are wall-clock timings, not decisions.
TIMING_KEY = re.compile(r"(^|_)(time|elapsed|duration|took)(_|$)|_ms$|_seconds$")
#: Paths that differ between runs and checkouts -> what the snapshot writes instead.
PLACES: dict[str, str] = {str(ROOT): "<repo>"}


def _strip(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items() if not TIMING_KEY.search(k)}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    if isinstance(value, str):
        for place, label in PLACES.items():
            value = value.replace(place, label)
        return value
    return value


def _write(out: Path, name: str, document: Any) -> None:
    (out / f"{name}.json").write_text(json.dumps(_strip(document), indent=1, sort_keys=True) + "\n")


def _edge(*args: str, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "edge_core", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, check=False)
    try:
        document = json.loads(done.stdout)
    except json.JSONDecodeError:
        document = {"stdout": done.stdout, "stderr": done.stderr}
    return {"exit_code": done.returncode, "document": document}


def _device_lists(work: Path, saved: Path | None, out: Path, env: dict[str, str]) -> dict[str, Path]:
    if saved is not None:
        doc = json.loads(saved.read_text())
    else:
        doc = _edge("devices", "--json", env=env)["document"]
        doc["host"]["allowed_cpus"] = [0, 1]
    (out / "devices.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    lists = {"here": work / "here.json"}
    lists["here"].write_text(json.dumps(doc))
    for host in ("node-a", "node-b"):
        doc["host"]["hostname"] = host
        lists[host] = work / f"{host}.json"
        lists[host].write_text(json.dumps(doc))
    return lists


def _kv_cases() -> dict[str, Any]:
    """Layout, charge and inverse of every published config the tests carry, in process."""
    from factories import KNOWN_CONFIGS
    from published_configs import PUBLISHED
    from reference_set import ENTRIES

    from edge_core.artifact.config import resolve_text_config
    from edge_core.artifact.library_defaults import fill_library_defaults
    from edge_core.errors import EdgeError
    from edge_core.plan.kv import estimate_kv, kv_layout, max_model_len_for

    configs = {**{f"known:{k}": v for k, v in KNOWN_CONFIGS.items()},
               **{f"published:{k}": v for k, v in PUBLISHED.items()},
               **{f"reference:{e.repo}": e.config for e in ENTRIES}}
    sessions = ({}, {"max_num_seqs": 4, "max_num_batched_tokens": 512, "block_size": 128},
                {"kv_dtype": "fp8", "block_size": 16, "concurrent_batches": 2, "enable_prefix_caching": False},
                {"tp_size": 2, "block_size": 128, "mamba_ssm_cache_dtype": "auto"})
    out: dict[str, Any] = {}
    for name, raw in sorted(configs.items()):
        text, key = resolve_text_config(raw)
        text, defaults = fill_library_defaults(text, raw, key)
        case: dict[str, Any] = {"defaults": [defaults.values, defaults.source, list(defaults.files)]}
        try:
            case["layout"] = kv_layout(text).to_dict()
            case["layout_tp2"] = kv_layout(text, 2).to_dict()
            case["estimates"] = [estimate_kv(text, max_model_len=4096, **s).to_dict() for s in sessions]
            case["inverse"] = [max_model_len_for(text, 1 << b, rule=r, block_size=128)
                               for b in (20, 26, 30) for r in ("flat", "by_layer_type", "vllm")]
        except EdgeError as exc:
            case["error"] = [type(exc).__name__, str(exc), getattr(exc, "remedy", None)]
        out[name] = case
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--devices-json", type=Path, help="a device list an earlier run saved (devices.json)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT / "tests"))
    from factories import KNOWN_CONFIGS, llama_like_tensors, write_checkpoint
    from reference_set import ENTRIES, write_published

    with tempfile.TemporaryDirectory(prefix="edge-snapshot-") as tmp:
        work = Path(tmp)
        PLACES[str(work)] = "<tmp>"
        env = {**os.environ, "EDGE_LEDGER_DIR": str(work / "ledger"),
               "EDGE_HEADER_CACHE_DIR": str(work / "headers"), "HF_HUB_OFFLINE": "1"}
        lists = _device_lists(work, args.devices_json, args.out, env)
        here = ("--devices", str(lists["here"]))
        two = ("--devices", str(lists["node-a"]), "--devices", str(lists["node-b"]))
        demo = str(ROOT / "edge_core/demo/tiny-llama")
        config = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-70B"])
        big = write_checkpoint(work / "llama70b", config, llama_like_tensors(config), shards=8)
        cases = {
            "demo": (demo, *here),
            "demo_hd16": (str(ROOT / "edge_core/demo/tiny-llama-hd16"), *here),
            "llama70b": (str(big), *here),
            "llama70b_8k_fp8": (str(big), *here, "--max-model-len", "8192", "--kv-dtype", "fp8"),
            "two_hosts": (demo, *two),
            "two_hosts_pp2": (demo, *two, "--pipeline-parallel-size", "2", "--device-ids", "node-a/cpu,node-b/cpu"),
        }
        for entry in ENTRIES:
            root = write_published(entry, work / entry.name)
            cases[f"reference_{entry.name}"] = (str(root), *here, "--max-model-len", "8192")
        for name, (model, *rest) in cases.items():
            _write(args.out, name, _edge("plan", "--json", "--model", model, *rest, env=env))
    _write(args.out, "kv", _kv_cases())
    print(f"{len(cases) + 1} snapshots in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
