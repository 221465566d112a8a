"""``edge models``: the models in the local Hugging Face cache, and which of them this interpreter can run.

Each cached revision is planned like ``edge plan --model DIR`` at the model's
own context (headers only: planning a shelf of models costs milliseconds
each); the answer is the device it would run on, or the refusal code.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..errors import EXIT_OK
from ._common import common_options, mask_from, mask_option, mib, registry_from, write_document


def add_models_command(sub: Any) -> None:
    models = sub.add_parser(
        "models", help="list the models in the Hugging Face cache and whether each can run here",
        description=("List every model revision in the Hugging Face cache (HF_HUB_CACHE / HF_HOME, as "
                     "huggingface_hub finds it) with its size on disk, and plan each one against this "
                     "interpreter's devices at the model's own context: the device it would run on, or why not. "
                     "Nothing is loaded or downloaded."),
    )
    common_options(models)
    mask_option(models)
    models.set_defaults(handler=cmd_models)


def cached_revisions() -> tuple[str, list[dict[str, Any]], list[str]]:
    """The cache directory, one row per cached model revision, and the cache scan's warnings."""
    from huggingface_hub import scan_cache_dir

    from ..artifact.hub_settings import HubSettings

    cache = HubSettings.from_env().cache_dir
    if not cache.is_dir():
        return str(cache), [], []
    info = scan_cache_dir(cache)
    rows = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        for rev in sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True):
            rows.append({"repo": repo.repo_id, "refs": sorted(rev.refs), "commit": rev.commit_hash,
                         "size_on_disk_bytes": rev.size_on_disk, "path": str(rev.snapshot_path)})
    return str(cache), rows, [str(w) for w in info.warnings]


def cmd_models(args: argparse.Namespace) -> int:
    from ..plans import SessionSpec
    from ..runtime.admission import make_plan
    from ..services.registry import discover

    started = time.perf_counter()
    cache, rows, warnings = cached_revisions()
    registry = registry_from(args)
    host, devices = discover(registry, mask_from(args))
    for row in rows:
        plan = make_plan(row["path"], session=SessionSpec(), devices=devices, host=host, registry=registry)
        row["admitted"] = plan.admitted
        row["device_id"] = plan.selected_device.device_id if plan.selected_device is not None else None
        row["backend"] = plan.backend
        row["max_model_len"] = plan.session.max_model_len
        row["refusals"] = [{"code": r.code, "device_id": r.device_id, "message": r.message} for r in plan.refusals]
        row["fallbacks"] = list(plan.fallbacks)
    elapsed = time.perf_counter() - started
    if args.json:
        write_document({"cache_dir": cache, "models": rows, "warnings": warnings,
                        "decision_time_s": round(elapsed, 4)}, "models")
        return EXIT_OK
    if not rows:
        print(f"no models in the Hugging Face cache ({cache}); `edge plan --model ORG/NAME` plans one from the Hub "
              "without downloading it")
        return EXIT_OK
    print(f"models in {cache}:")
    for row in rows:
        refs = ",".join(row["refs"]) or "-"
        if row["admitted"]:
            verdict = f"runs on {row['device_id']} ({row['backend']})"
        else:
            codes = sorted({r["code"] for r in row["refusals"]})
            shorter = next((f["max_model_len"] for f in row["fallbacks"] if f.get("kind") == "shorter_context"), None)
            verdict = f"refused: {', '.join(codes)}" + (f" (fits with --max-model-len auto: {shorter})" if shorter else "")
        print(f"  {row['repo']:<44} {refs:<10} {row['commit'][:12]}  {mib(row['size_on_disk_bytes']):>12}  {verdict}")
    for warning in warnings:
        print(f"edge: cache warning: {warning}", file=sys.stderr)
    print(f"  planned {len(rows)} revision(s) at their own context in {elapsed * 1000:.0f} ms, nothing loaded")
    return EXIT_OK
