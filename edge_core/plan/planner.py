"""Plan a model path against devices: read the manifest, pick the planner, say which devices count.

:func:`make_plan` is the one entry for every command that plans (``plan``,
``run``, ``accept``, ``parity``): a checkpoint goes to
:func:`~edge_core.plan.checkpoint.plan_checkpoint`, an exported graph to
:func:`~edge_core.plan.graph_stage.plan_graph_stage`. :func:`load_devices` reads devices captured on another machine
(:func:`edge_core.services.registry.discover` probes this one). Nothing here imports a runtime.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..artifact import read_manifest
from ..artifact.hub import resolve_model
from ..devices import apply_mask, load_device_list
from ..errors import ArtifactError, UsageError
from ..host import HostFacts
from ..plans import GraphStagePlan, Plan, Refusal, SessionSpec
from ..services.registry import Registry
from .checkpoint import plan_checkpoint
from .parallel import ParallelRequest, plan_parallel

if TYPE_CHECKING:
    from ..devices import Device
    from ..services.host_ledger import LedgerView


def make_plan(model_path: str, *, session: SessionSpec, devices: list[Device], host: HostFacts | None,
              registry: Registry | None = None, devices_source: str = "probed", digest_weights: bool = False,
              revision: str | None = None, ledger: LedgerView | None = None,
              parallel: ParallelRequest | None = None, hosts: Mapping[str, HostFacts | None] | None = None) -> Plan:
    """Read ``model_path`` without loading a weight and plan it: admitted, or refused with reasons.

    ``model_path`` is a directory, an ONNX file, or a Hub id (``org/name``, at
    ``revision``), resolved by :func:`~edge_core.artifact.hub.resolve_model`;
    the plan's ``source`` says which it was. ``ledger`` is what the other live
    edge sessions on this host hold (:func:`edge_core.services.host_ledger.read_ledger`).
    ``parallel`` pins a tensor/pipeline-parallel layout or a device group
    (:mod:`.parallel`; unpinned, one is tried only when no single device
    fits); ``hosts`` are the host facts of other machines' device lists, by
    the label their devices carry in ``extras["host"]``.
    """
    request = parallel or ParallelRequest()
    named = only_devices(devices, request.device_ids) if request.device_ids else devices
    try:
        source = resolve_model(str(model_path), revision)  # imports huggingface_hub for Hub ids only
    except ArtifactError as exc:
        return Plan(admitted=False, model_path=str(model_path), session=session, devices_source=devices_source,
                    refusals=(Refusal(code=exc.code, message=str(exc), remedy=exc.remedy),))

    def plan_on(candidates: list[Device], asked: ParallelRequest) -> Plan:
        plan = _plan_path(source.path, session=session, devices=candidates, host=host, registry=registry,
                          devices_source=devices_source, digest_weights=digest_weights, ledger=ledger, hosts=hosts)
        if plan.manifest is not None and plan.manifest.kind != "onnx" and not isinstance(plan, GraphStagePlan):
            plan = plan_parallel(plan.manifest, plan, request=asked, devices=candidates, host=host, hosts=hosts,
                                 registry=registry, ledger=ledger, command_model=str(model_path))
        return plan

    plan = plan_on(named, request)
    if (not plan.admitted and plan.manifest is not None and len(named) < len(devices)
            and any(r.code == "budget_exceeds_device" for r in plan.refusals)):
        plan = _beyond_the_named_devices(plan, request, plan_on(devices, replace(request, device_ids=())))
    return replace(plan, source=source)


def _beyond_the_named_devices(plan: Plan, request: ParallelRequest, wider: Plan) -> Plan:
    """A plan refused on the devices ``--device-ids`` named, and ``wider``, the same request on every device.

    When ``wider`` is admitted, each memory refusal's remedy names its layout
    (or its one device): "nothing fits on cuda:0" comes with "TP 4 on
    cuda:0..3 does".
    """
    if not wider.admitted or wider.selected_device is None:
        return plan
    if wider.parallel:
        ids = ",".join(dict.fromkeys(str(r["device_id"]) for r in wider.parallel.get("ranks") or ()))
        tp, pp = int(wider.parallel["tensor_parallel_size"]), int(wider.parallel["pipeline_parallel_size"])
        flags = f"--device-ids {ids} --tensor-parallel-size {tp}" + (f" --pipeline-parallel-size {pp}" if pp > 1 else "")
        what = f"{wider.parallel.get('label')} on {ids}"
    else:
        flags = f"--device-ids {wider.selected_device.device_id}"
        what = f"{wider.selected_device.device_id} alone"
    hint = f"beyond --device-ids {','.join(request.device_ids)}, {what} takes this session ({flags})"
    refusals = tuple(replace(r, remedy=f"{r.remedy}; or {hint}") if r.code == "budget_exceeds_device" else r
                     for r in plan.refusals)
    return replace(plan, refusals=refusals)


def only_devices(devices: list[Device], ids: Iterable[str]) -> list[Device]:
    """The devices ``--device-ids`` names, in the order given; an id no device has is a usage error."""
    by_id = {d.device_id: d for d in devices}
    wanted = list(ids)
    unknown = [i for i in wanted if i not in by_id]
    if unknown:
        raise UsageError(f"--device-ids: no device is named {', '.join(unknown)}; "
                         f"known here: {', '.join(by_id) or 'none'}")
    return [by_id[i] for i in wanted]


def _plan_path(model_path: str, *, session: SessionSpec, devices: list[Device], host: HostFacts | None,
               registry: Registry | None, devices_source: str, digest_weights: bool,
               ledger: LedgerView | None, hosts: Mapping[str, HostFacts | None] | None = None) -> Plan:
    try:
        manifest = read_manifest(model_path, digest_weights=digest_weights)
    except ArtifactError as exc:
        return Plan(admitted=False, model_path=str(model_path), session=session, devices_source=devices_source,
                    refusals=(Refusal(code=exc.code, message=str(exc), remedy=exc.remedy),))
    if manifest.kind == "onnx":
        # Loaded for graphs only: most plans are checkpoints, and `edge plan` stays cheap.
        from .graph_stage import plan_graph_stage

        return plan_graph_stage(manifest, devices=devices, host=host, registry=registry,
                                devices_source=devices_source, session=session)
    return plan_checkpoint(manifest, session=session, devices=devices, host=host, registry=registry,
                           devices_source=devices_source, ledger=ledger, hosts=hosts)


def load_devices(path: str, registry: Registry, mask: frozenset[str] = frozenset()
                 ) -> tuple[HostFacts | None, list[Device]]:
    """A device list captured with ``edge devices --json`` (maybe elsewhere), masked kinds marked.

    Backends installed here still apply their own gates and memory terms to
    the devices they own in the list (so the registry is loaded); the others
    are planned from the list alone, and the plan notes which. A malformed
    list is a :class:`~edge_core.errors.UsageError` naming the file.
    """
    try:
        devices, host_doc = load_device_list(path)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    cpus = [i for i, d in enumerate(devices) if d.kind == "cpu"]
    if cpus and not host_doc:
        raise UsageError(f"device list {path}: devices[{cpus[0]}] is a CPU ({devices[cpus[0]].device_id}) but the "
                         "list has no 'host' section (its memory and NUMA nodes, which a CPU plan reads); save "
                         "the whole output of `edge devices --json` on that machine")
    registry.load()
    return (HostFacts.from_dict(host_doc) if host_doc else None), apply_mask(devices, mask)


def load_device_sets(paths: list[str], registry: Registry, mask: frozenset[str] = frozenset()
                     ) -> tuple[HostFacts | None, list[Device], dict[str, HostFacts | None]]:
    """Device lists captured on one or several hosts: ``(first host, every device, host facts by label)``.

    With one list this is :func:`load_devices`. With several, each host's
    devices are renamed ``LABEL/ID`` and carry ``extras["host"] = LABEL`` — the
    host's name from its list (else the file's stem) — so a plan across hosts
    says which machine each rank runs on. Two lists from one host (the same
    label) are a usage error.
    """
    if len(paths) == 1:
        host, devices = load_devices(paths[0], registry, mask)
        return host, devices, {}
    first: HostFacts | None = None
    merged: list[Device] = []
    hosts: dict[str, HostFacts | None] = {}
    for path in paths:
        host, devices = load_devices(path, registry, mask)
        label = (host.hostname if host is not None and host.hostname else Path(path).stem)
        if label in hosts:
            raise UsageError(f"--devices {path}: a list for host {label!r} was already given; pass one list per host")
        hosts[label] = host
        first = first if first is not None else host
        merged += [d.replace(device_id=f"{label}/{d.device_id}",
                             extras={**(d.extras if isinstance(d.extras, dict) else {}), "host": label})
                   for d in devices]
    return first, merged, hosts


def only_backend(devices: Iterable[Device], name: str | None, registry: Registry | None) -> list[Device]:
    """The devices ``--backend NAME`` selects: those of plugin NAME, or whose backend is NAME.

    An installed plugin with no device gives an empty list, which the planner
    refuses with why; a name nothing carries is a usage error.
    """
    devices = list(devices)
    if not name:
        return devices
    chosen = [d for d in devices if name in (d.plugin, d.backend)]
    installed = {r.name for r in registry.plugins()} if registry is not None else set()
    if chosen or name in installed:
        return chosen
    known = sorted(installed | {d.plugin for d in devices if d.plugin} | {d.backend for d in devices if d.backend})
    raise UsageError(f"--backend {name}: no installed plugin or device backend is named {name!r}; "
                     f"known here: {', '.join(known) or 'none'}")
