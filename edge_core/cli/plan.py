"""``edge plan``: read the model, walk every device through the gates, print the plan.

Parse -> :func:`edge_core.plan.make_plan` -> render. Also the planning
options every command that takes a model shares (``run``, ``accept``,
``parity``), and :func:`plan_from_args`, which they all plan through. Nothing
here imports a runtime.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from ..artifact import DEMO_MODEL
from ..errors import EXIT_OK, EXIT_REFUSED
from ..plan import Plan, SessionSpec
from ..registry import Registry, discover
from ._common import common_options, mask_from, mask_option, mib, positive_int, registry_from, write_document


def planning_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="DIR",
                        help=f"checkpoint directory or ONNX graph (default: the bundled demo, {DEMO_MODEL.name})")
    parser.add_argument("--max-model-len", type=positive_int, metavar="N",
                        help="context length to budget for (default: the model's max_position_embeddings)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=1, metavar="N",
                        help="sequences decoded at once (default 1)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N",
                        help="tokens per forward pass (default min(max-model-len, 2048))")
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                        help="KV cache dtype (auto = the model's dtype)")
    parser.add_argument("--devices", metavar="FILE",
                        help="plan against a device list saved from `edge devices --json` on another machine")
    parser.add_argument("--backend", metavar="NAME",
                        help="only this backend's devices: a plugin name from `edge plugins` (cpu, transformers, "
                             "...) or a device's backend (vllm:cpu)")
    parser.add_argument("--digest-weights", action="store_true",
                        help="also hash every weight byte into the manifest (slow for big checkpoints)")


def add_plan_command(sub: Any) -> None:
    plan = sub.add_parser(
        "plan", help="decide which device can run a model, with how many bytes, or why none can",
        description=("Read the checkpoint's config and safetensors headers (no weight is loaded), walk every "
                     "device through the gates, and print the plan: ADMITTED with every reservation, or "
                     "REFUSED with a code, a message and a remedy for each device. Exit 0 admitted, 2 refused."),
    )
    common_options(plan)
    mask_option(plan)
    planning_options(plan)
    plan.set_defaults(handler=cmd_plan)


def session_from(args: argparse.Namespace) -> SessionSpec:
    return SessionSpec(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, kv_dtype=args.kv_dtype)


def plan_from_args(args: argparse.Namespace, mask: frozenset[str] | None = None) -> tuple[Plan, Registry]:
    """Plan for ``args.model`` against this interpreter's devices, or a saved device list."""
    # The planner is imported here, not with the module: `edge devices` builds this parser too.
    from ..plan import load_devices, make_plan, only_backend

    model = args.model or str(DEMO_MODEL)
    registry = registry_from(args)
    mask = mask_from(args) if mask is None else mask
    if args.devices:
        host, devices = load_devices(args.devices, registry, mask)
        source = f"file:{args.devices}"
    else:
        host, devices = discover(registry, mask)
        source = "probed"
    devices = only_backend(devices, getattr(args, "backend", None), registry)
    plan = make_plan(model, session=session_from(args), devices=devices, host=host, registry=registry,
                     devices_source=source, digest_weights=args.digest_weights)
    return plan, registry


def print_plan(plan: Plan, elapsed_s: float) -> None:
    verdict = "ADMITTED" if plan.admitted else "REFUSED"
    manifest = plan.manifest
    what = f"{manifest.architecture or manifest.model_type} {manifest.weight_format} {mib(manifest.weight_bytes)}" \
        if manifest is not None else plan.model_path
    where = f" on {plan.selected_device.device_id} ({plan.backend})" if plan.selected_device is not None else ""
    print(f"{verdict}{where}: {plan.model_path}")
    print(f"  model     {what}" + (f"  [artifact {manifest.artifact_id}]" if manifest is not None else ""))
    if plan.devices_source != "probed":
        print(f"  devices   planned against {plan.devices_source.removeprefix('file:')} (not this machine)")
    for refusal in plan.refusals:
        print(f"  refused   [{refusal.code}] {refusal.device_id or '-'}: {refusal.message}")
        print(f"            remedy: {refusal.remedy}")
    stage = getattr(plan, "stage", None)  # a graph-stage plan (edge_core.stages) has no decode session
    if plan.admitted and stage:
        route = stage.get("route") or {}
        print(f"  stage     {stage.get('stage') or 'graph'} via {route.get('backend') or plan.backend} "
              f"({route.get('where', 'here')}); target {stage.get('target_provider')}, placed when it runs "
              f">= {stage.get('placement_threshold'):.0%} of nodes and time; numeric tolerance "
              f"{stage.get('numeric_tolerance'):g} vs {Path(stage.get('reference_graph') or '').name}")
    elif plan.admitted:
        print(f"  session   max_model_len {plan.session.max_model_len}, max_num_seqs {plan.session.max_num_seqs}, "
              f"max_num_batched_tokens {plan.session.max_num_batched_tokens}")
    if plan.admitted and plan.reservations:
        print(f"  {'purpose':<22} {'bytes':>12}  {'pool':<9} {'lifetime':<16} ev")
        for term in plan.reservations:
            mark = "  (headroom)" if term.headroom else ""
            print(f"  {term.purpose:<22} {mib(term.bytes):>12}  {term.pool:<9} {term.lifetime:<16} {term.evidence}{mark}")
    if plan.admitted and plan.peak is not None:
        peak = plan.peak
        print(f"  predicted peak {mib(peak.predicted_bytes)} (max of load path {mib(peak.load_path_bytes)} and "
              f"steady state {mib(peak.steady_state_bytes)}) + headroom {mib(peak.headroom_bytes)} = "
              f"{mib(peak.admission_bytes)} of {mib(plan.capacity_bytes)}")
    if plan.kv is not None:
        kv = plan.kv
        counts = ", ".join(f"{n} {kind}" for kind, n in kv.layer_counts.items() if n)
        print(f"  kv        {mib(kv.bytes_vllm)} reserved (vLLM rule); flat {mib(kv.bytes_flat)}, by layer type "
              f"{mib(kv.bytes_by_layer_type)}; {kv.bytes_per_token_flat:,} B/token flat; layers: {counts}")
    if plan.engine_kwargs:
        shown = ", ".join(f"{k}={v}" for k, v in plan.engine_kwargs.items() if k != "model")
        print(f"  engine    {shown}")
    for verdict_row in plan.verdicts:
        if not verdict_row.selected and (plan.admitted or verdict_row.note):
            why = verdict_row.note or "; ".join(f"[{r.code}] {r.message}" for r in verdict_row.refusals)
            print(f"  not used  {verdict_row.device_id}: {why}")
    for fallback in plan.fallbacks:
        print(f"  fallback  {fallback['kind']} {fallback.get('device_id', '')} "
              f"{fallback.get('max_model_len', '')} ({fallback['note']})".replace("  ", " "))
    for note in plan.notes:
        print(f"  note      {note}")
    print(f"  decided in {elapsed_s * 1000:.0f} ms, nothing loaded")


def cmd_plan(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    plan, _ = plan_from_args(args)
    elapsed = time.perf_counter() - started
    if args.json:
        write_document({**plan.to_dict(), "decision_time_s": round(elapsed, 4)}, "plan")
    else:
        print_plan(plan, elapsed)
    return EXIT_OK if plan.admitted else EXIT_REFUSED
