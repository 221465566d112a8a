"""Plan a read artifact against devices: pick the planner, say which devices count.

:func:`plan_artifact` is the one entry for every command that plans (``plan``,
``run``, ``accept``, ``parity``): a checkpoint goes to
:func:`~edge_core.plan.decode.plan_checkpoint` (and a layout across
devices to :mod:`.parallel`), an exported graph to
:func:`~edge_core.plan.graph_stage.plan_graph_stage`. It is handed the
manifest, the devices and the ledger view; resolving a Hub id, reading the
artifact and the device lists are the caller's (:mod:`edge_core.runtime.admission`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import UsageError
from ..plans import Plan, Refusal, SessionSpec
from .decode import plan_checkpoint
from .parallel import ParallelRequest, plan_parallel

if TYPE_CHECKING:
    from ..artifact.graph_facts import GraphFacts
    from ..devices import Device
    from ..errors import ArtifactError
    from ..host import HostFacts
    from ..manifest import Manifest
    from ..services.host_ledger import LedgerView
    from ..services.registry import Registry


def plan_artifact(manifest: Manifest, *, model: str, session: SessionSpec, devices: list[Device],
                  host: HostFacts | None, registry: Registry | None = None, devices_source: str = "probed",
                  ledger: LedgerView | None = None, parallel: ParallelRequest | None = None,
                  hosts: Mapping[str, HostFacts | None] | None = None,
                  graph: GraphFacts | ArtifactError | None = None) -> Plan:
    """Plan the artifact ``manifest`` describes: admitted, or refused with reasons.

    ``model`` is the model as the command named it (a node's command line
    repeats it). ``ledger`` is what the other live edge sessions on this host
    hold (:func:`edge_core.services.host_ledger.read_ledger`). ``parallel``
    pins a tensor/pipeline-parallel layout or a device group (:mod:`.parallel`;
    unpinned, one is tried only when no single device fits); ``hosts`` are the
    host facts of other machines' device lists, by the label their devices
    carry in ``extras["host"]``. ``graph`` is, for an exported graph, what
    the caller read from it beyond the manifest (or why it could not).
    Reading the artifact is the caller's (:func:`edge_core.runtime.admission.make_plan`
    resolves a path or Hub id and reads both).
    """
    request = parallel or ParallelRequest()
    named = only_devices(devices, request.device_ids) if request.device_ids else devices

    def plan_on(candidates: list[Device], asked: ParallelRequest) -> Plan:
        if manifest.kind == "onnx":
            # Loaded for graphs only: most plans are checkpoints, and `edge plan` stays cheap.
            from .graph_stage import plan_graph_stage

            if graph is None:
                raise ValueError(f"planning the graph {manifest.path} needs the facts read from it (graph=)")
            return plan_graph_stage(manifest, graph, devices=candidates, host=host, registry=registry,
                                    devices_source=devices_source, session=session, ledger=ledger)
        plan = plan_checkpoint(manifest, session=session, devices=candidates, host=host, registry=registry,
                               devices_source=devices_source, ledger=ledger, hosts=hosts)
        return plan_parallel(manifest, plan, request=asked, devices=candidates, host=host, hosts=hosts,
                             registry=registry, ledger=ledger, command_model=model)

    plan = plan_on(named, request)
    if (not plan.admitted and len(named) < len(devices)
            and any(r.code == "budget_exceeds_device" for r in plan.refusals)):
        plan = _beyond_the_named_devices(plan, request, plan_on(devices, replace(request, device_ids=())))
    return plan


def unreadable_artifact(model_path: str, error: ArtifactError, *, session: SessionSpec,
                        devices_source: str = "probed") -> Plan:
    """The plan of an artifact that could not be resolved or read: refused with the reader's reason."""
    return Plan(admitted=False, model_path=str(model_path), session=session, devices_source=devices_source,
                refusals=(Refusal(code=error.code, message=str(error), remedy=error.remedy),))


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
