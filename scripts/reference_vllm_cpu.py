"""Run vLLM CPU itself on every cut copy of the reference set and store what it did.

For each entry of ``tests/reference_set.py`` this writes the cut copy
(header-only shards, the demo tokenizer), starts vLLM on it in a fresh
process with ``load_format="dummy"`` and the reference session (8192 tokens of
context at most, one sequence, 2048 batched tokens, eager), generates 16
greedy tokens from an 8-token prompt, and records:

- whether it ran, and if not the error vLLM raised (or the signal);
- vLLM's own KV admission figures, read from its allocator while it starts:
  the bytes ``_check_enough_kv_cache_memory`` needs for one request of
  ``max_model_len`` and the pool bytes it holds back (``minimum_kv_bytes`` is
  their sum: the smallest ``kv_cache_memory_bytes`` vLLM accepts), and the
  groups, block sizes and page sizes ``get_kv_cache_config_from_groups``
  laid out;
- how long the start and the 16 tokens took.

The engine gets a generous pool (``--kv-bytes``), so an entry never fails for
want of KV; the minimum is what vLLM computed, not what it was given.
It runs vLLM (about a minute an entry here) and is not part of CI:

    /work/venv/bin/python scripts/reference_vllm_cpu.py            # all, ~30 min
    /work/venv/bin/python scripts/reference_vllm_cpu.py --only Qwen--Qwen3-0.6B

The file it writes, ``tests/data/vllm_cpu_reference.json``, is what
``tests/test_reference_set.py`` compares edge's plans with; ``--only`` updates
those entries and keeps the rest. The engine runs in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the allocator can be read from here;
the allocator's arithmetic does not depend on the process layout.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "data" / "vllm_cpu_reference.json"
MARK = "REFERENCE_RESULT "
PROMPT_TOKEN_IDS = [1, 17, 42, 99, 123, 256, 300, 511]


def child(model: str, settings: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: start vLLM on ``model``, record its KV arithmetic, generate, report."""
    import torch

    if hasattr(torch.cpu, "_init_amx"):
        torch.cpu._init_amx()  # vLLM CPU 0.32's AMX attention never asks Linux for AMX itself
    from vllm.v1.core import kv_cache_utils as u

    record: dict[str, Any] = {"checks": [], "layouts": []}
    check = u._check_enough_kv_cache_memory
    from_groups = u.get_kv_cache_config_from_groups

    def recording_check(available, get_needed, max_model_len, estimate):  # type: ignore[no-untyped-def]
        needed = get_needed()
        record["checks"].append({"check_bytes": int(available), "needed_bytes": int(needed),
                                 "max_model_len": int(max_model_len)})
        return check(available, lambda: needed, max_model_len, estimate)

    def recording_layout(vllm_config, groups, available_memory):  # type: ignore[no-untyped-def]
        config = from_groups(vllm_config, groups, available_memory)
        record["layouts"].append({
            "available_bytes": int(available_memory), "num_blocks": int(config.num_blocks),
            "groups": [{"spec": type(g.kv_cache_spec).__name__, "layers": len(g.layer_names),
                        "block_size": int(g.kv_cache_spec.block_size),
                        "page_size_bytes": int(g.kv_cache_spec.page_size_bytes)} for g in config.kv_cache_groups],
        })
        return config

    u._check_enough_kv_cache_memory = recording_check
    u.get_kv_cache_config_from_groups = recording_layout

    from vllm import LLM, SamplingParams

    kwargs = {k: v for k, v in settings.items() if k != "tokens"}
    t0 = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", enforce_eager=True, seed=0, **kwargs)
    started = time.perf_counter()
    params = SamplingParams(max_tokens=settings["tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": PROMPT_TOKEN_IDS}], params, use_tqdm=False)
    done = time.perf_counter()
    ids = list(out[0].outputs[0].token_ids)
    record.update(engine_start_s=round(started - t0, 2), generate_s=round(done - started, 2), tokens=len(ids),
                  token_ids=ids)
    return record


def run_one(entry: Any, scratch: Path, kv_bytes: int, timeout: int) -> dict[str, Any]:
    import reference_set as ref

    from edge_core.artifact.demo import DEMO_MODEL

    model = ref.write_cut(entry, scratch / entry.name, tokenizer_from=DEMO_MODEL)
    text = ref.cut_config(entry)
    text = text.get("text_config") if isinstance(text.get("text_config"), dict) else text
    dtype = entry.config.get("torch_dtype") or text.get("torch_dtype")
    settings = {**ref.session_for(entry), "kv_cache_memory_bytes": kv_bytes, "tokens": ref.REFERENCE_TOKENS}
    if dtype in ("bfloat16", "float16", "float32"):
        settings["dtype"] = dtype  # as edge passes it (plan/decode.py engine_kwargs_for)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
           "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", str(model), json.dumps(settings)],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-3000:]
        return {"ran": False, "error": f"timed out after {timeout} s",
                "log_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail}
    wall = round(time.perf_counter() - t0, 1)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith(MARK)), None)
    result: dict[str, Any] = json.loads(line[len(MARK):]) if line else {}
    result.setdefault("ran", False)
    result["wall_s"] = wall
    result["session"] = {k: v for k, v in settings.items() if k != "tokens"}
    if not result["ran"]:
        result["returncode"] = proc.returncode
        result.setdefault("error", f"exit {proc.returncode} with no result")
        # vLLM logs to stdout, warnings go to stderr: keep the end of both.
        result["log_tail"] = (proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr[-1500:])
    return result


def summarize(record: dict[str, Any], kv_bytes: int) -> dict[str, Any]:
    """The allocator's minimum: needed bytes plus what the pool holds back (the given bytes less the checked)."""
    checks = record.get("checks") or []
    if checks:
        c = checks[0]
        record["minimum_kv_bytes"] = c["needed_bytes"] + (kv_bytes - c["check_bytes"])
        record["held_back_bytes"] = kv_bytes - c["check_bytes"]
    return record


def provenance() -> dict[str, Any]:
    from importlib.metadata import version

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    devices = subprocess.run([str(Path(sys.executable).parent / "edge"), "devices", "--json"],
                             capture_output=True, text=True)
    return {
        "script": "scripts/reference_vllm_cpu.py", "commit": commit.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "vllm": version("vllm-cpu"), "torch": version("torch"), "transformers": version("transformers"),
        "python": platform.python_version(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "load_format": "dummy", "prompt_token_ids": PROMPT_TOKEN_IDS,
        "host_devices": json.loads(devices.stdout) if devices.returncode == 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="entry names (repo id with / as --)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--kv-bytes", type=int, default=2 << 30, help="pool each engine gets (default 2 GiB)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per entry")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "SETTINGS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        try:
            result = {"ran": True, **child(args.child[0], json.loads(args.child[1]))}
        except BaseException as exc:  # noqa: BLE001 - the record is the point
            lines = traceback.format_exception_only(type(exc), exc)
            where = traceback.extract_tb(exc.__traceback__)[-3:]
            result = {"ran": False, "error": "".join(lines).strip()[-2000:],
                      "raised_at": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in where]}
        print(MARK + json.dumps(result), flush=True)
        os._exit(0)  # vLLM's atexit handlers can hang a single-process engine on the way out

    sys.path.insert(0, str(ROOT / "tests"))
    import reference_set as ref

    wanted = args.only or [e.name for e in ref.ENTRIES]
    unknown = sorted(set(wanted) - set(ref.BY_NAME))
    if unknown:
        parser.error(f"unknown entries: {', '.join(unknown)}; known: {', '.join(ref.BY_NAME)}")
    doc = json.loads(args.out.read_text()) if args.out.exists() and args.only else {"entries": {}}
    doc["provenance"] = provenance()
    with tempfile.TemporaryDirectory(prefix="edge-reference-") as scratch:
        for i, name in enumerate(wanted, start=1):
            entry = ref.BY_NAME[name]
            print(f"[{i}/{len(wanted)}] {entry.repo} ...", file=sys.stderr, flush=True)
            result = summarize(run_one(entry, Path(scratch), args.kv_bytes, args.timeout), args.kv_bytes)
            result["repo"] = entry.repo
            doc["entries"][name] = result
            status = "ran" if result["ran"] else f"failed: {result.get('error', '')[:160]}"
            print(f"    {status} ({result.get('wall_s')} s, minimum {result.get('minimum_kv_bytes')})",
                  file=sys.stderr, flush=True)
            args.out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
