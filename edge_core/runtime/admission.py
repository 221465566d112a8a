"""Which plan a command that starts an engine runs, and how it is admitted on this host.

``edge run``, ``serve``, ``accept`` and ``parity`` (and ``edge plan``, which
stops before admission) plan through here: the devices (probed, or device
lists saved elsewhere, :func:`find_devices`), then :func:`plan_model`, which
reads the model (:func:`make_plan`: the I/O the pure planner,
:func:`edge_core.plan.plan_artifact`, does not do), counts what the other
live edge sessions hold (:mod:`edge_core.services.host_ledger`) and, for a
command that starts an engine, downloads an admitted Hub model's
weights (:func:`fetch_model`) and admits the plan under the ledger's lock
(:func:`admit`). Nothing here parses arguments; what a person should read is
handed to ``say`` (one line, without the ``edge:`` prefix).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..devices import apply_mask, load_device_list
from ..errors import ArtifactError, UsageError
from ..host import HostFacts
from ..plans import Plan, Refusal, SessionSpec

if TYPE_CHECKING:
    from ..artifact.graph_facts import GraphFacts
    from ..devices import Device
    from ..manifest import Manifest, ModelSource
    from ..plan.parallel import ParallelRequest
    from ..services.host_ledger import LedgerView
    from ..services.registry import Registry

#: Where a line for a person goes (the CLI prints ``edge: <line>`` on stderr).
Say = Callable[[str], None]
#: One plan of ``model`` at ``revision`` beside ``ledger`` (None: without the other sessions).
PlanOnce = Callable[[str, "LedgerView | None", "str | None"], Plan]


def _silent(text: str) -> None:
    pass


@dataclass(frozen=True)
class FoundDevices:
    """The devices a plan is made against, their hosts' facts, and where they came from (``probed``, ``file:...``)."""

    host: HostFacts | None
    devices: list[Device]
    source: str
    hosts: dict[str, Any] = field(default_factory=dict)


def find_devices(registry: Registry, mask: frozenset[str], device_files: tuple[str, ...] = (),
                 backend: str | None = None, say: Say = _silent) -> FoundDevices:
    """This interpreter's devices, or the saved lists (one per host); only ``backend``'s when one is named."""
    from ..plan import only_backend
    from ..services.registry import discover

    hosts: dict[str, Any] = {}
    if device_files:
        host, devices, hosts = load_device_sets(list(device_files), registry, mask)
        source = "file:" + ",".join(device_files)
    else:
        host, devices = discover(registry, mask)
        source = "probed"
    for warning in registry.warnings:  # as `edge plugins` and `edge devices` say them
        say(f"warning: {warning}")
    return FoundDevices(host, only_backend(devices, backend, registry), source, hosts)


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


@dataclass(frozen=True)
class PlanRequest:
    """What a command asks to plan: the model, the session, the layout, and how it is admitted."""

    model: str
    session: SessionSpec
    parallel: ParallelRequest
    revision: str | None = None
    digest_weights: bool = False
    #: The command the ledger record names (``run`` -> ``edge run``).
    command: str = "plan"
    #: The model as the user gave it (None: the bundled demo); the ledger record names it.
    requested_model: str | None = None
    #: How long admission retries while only other sessions' memory is in the way.
    wait_s: float = 0.0


def plan_model(request: PlanRequest, found: FoundDevices, registry: Registry, *, fetch_weights: bool = False,
               count_others: bool = True, say: Say = _silent) -> Plan:
    """Plan ``request`` against ``found``; with ``fetch_weights`` (a command that starts an engine), admit it.

    Every plan counts what the other live edge sessions on this host hold.
    With ``fetch_weights`` the plan is also an admission: made under the
    ledger's lock and, if admitted, registered there before the lock is
    released, so two sessions started together cannot both take the last free
    bytes; ``wait_s`` retries while the only obstacle is another session's
    memory. Before that, an admitted plan of a Hub model whose weights are not
    in the Hugging Face cache downloads them (after checking the disk), so the
    engine starts on local files and never touches the network itself. A
    refused plan downloads nothing. ``count_others=False`` plans without the
    ledger (a second layout planned inside a session the ledger already
    holds, for ``edge parity``).
    """
    from ..artifact.hub import looks_like_hub_id

    parallel = with_node_address(request.parallel, found)

    def plan_once(path: str, ledger: LedgerView | None, rev: str | None) -> Plan:
        return make_plan(path, session=request.session, devices=found.devices, host=found.host, registry=registry,
                         devices_source=found.source, digest_weights=request.digest_weights, revision=rev,
                         ledger=ledger, parallel=parallel, hosts=found.hosts)

    model, revision = request.model, request.revision
    if not fetch_weights:
        return plan_once(model, ledger_view(say) if count_others else None, revision)
    downloaded = None
    if looks_like_hub_id(model) and not os.path.lexists(model):
        # Plan from the headers first: a refused model downloads nothing, an admitted one its weights.
        plan = plan_once(model, ledger_view(say), revision)
        if not plan.admitted:
            return plan
        if plan.source is not None and not plan.source.weights_present:
            fetched = fetch_model(plan, say)
            if isinstance(fetched, Plan):
                return fetched
            downloaded = fetched
    return admit(plan_once, downloaded.path if downloaded else model, None if downloaded else revision,
                 command=request.command, requested_model=request.requested_model, wait_s=request.wait_s,
                 downloaded=downloaded)


def with_node_address(parallel: ParallelRequest, found: FoundDevices) -> ParallelRequest:
    """``parallel`` with the address this node's ranks use (a node of ``--nnodes`` planned on its own devices)."""
    if parallel.nnodes < 2 or found.source != "probed" or not parallel.master_addr:
        return parallel
    from ..plan.parallel import MASTER_PORT
    from .node_address import read_node_address

    return replace(parallel, address=read_node_address(parallel.master_addr, parallel.master_port or MASTER_PORT,
                                                       parallel.node_rank))


def make_plan(model_path: str, *, session: SessionSpec, devices: list[Device], host: HostFacts | None,
              registry: Registry | None = None, devices_source: str = "probed", digest_weights: bool = False,
              revision: str | None = None, ledger: LedgerView | None = None,
              parallel: ParallelRequest | None = None, hosts: Mapping[str, HostFacts | None] | None = None) -> Plan:
    """Resolve and read ``model_path`` without loading a weight, then plan it: admitted, or refused with reasons.

    ``model_path`` is a directory, an ONNX file, or a Hub id (``org/name``, at
    ``revision``), resolved by :func:`~edge_core.artifact.hub.resolve_model`;
    the plan's ``source`` says which it was. A model that cannot be resolved
    or read is a refused plan naming why. The other arguments are
    :func:`edge_core.plan.plan_artifact`'s, which plans what was read.
    """
    from ..artifact import read_manifest
    from ..artifact.hub import resolve_model
    from ..plan import only_devices, plan_artifact, unreadable_artifact

    if parallel is not None and parallel.device_ids:
        only_devices(devices, parallel.device_ids)  # an unknown id is a usage error before anything is read
    try:
        source = resolve_model(str(model_path), revision)  # imports huggingface_hub for Hub ids only
    except ArtifactError as exc:
        return unreadable_artifact(str(model_path), exc, session=session, devices_source=devices_source)
    try:
        manifest = read_manifest(source.path, digest_weights=digest_weights)
    except ArtifactError as exc:
        plan = unreadable_artifact(source.path, exc, session=session, devices_source=devices_source)
    else:
        plan = plan_artifact(manifest, model=str(model_path), session=session, devices=devices, host=host,
                             registry=registry, devices_source=devices_source, ledger=ledger, parallel=parallel,
                             hosts=hosts, graph=_graph_facts(manifest))
    return replace(plan, source=source)


def _graph_facts(manifest: Manifest) -> GraphFacts | ArtifactError | None:
    """What the stage planner needs from an exported graph beyond its manifest, or why it cannot be read."""
    if manifest.kind != "onnx":
        return None
    from ..artifact.graph_facts import read_graph_facts

    try:
        return read_graph_facts(manifest)
    except ArtifactError as exc:  # the planner refuses with it, after its own first gates
        return exc


def admit(plan_once: PlanOnce, model: str, revision: str | None, *, command: str, requested_model: str | None,
          wait_s: float = 0.0, downloaded: ModelSource | None = None) -> Plan:
    """Plan under the host ledger's lock and register an admitted plan; wait up to ``wait_s`` for other sessions."""
    from ..plan.committed import ledger_bytes
    from ..services.host_ledger import admission

    deadline = time.monotonic() + float(wait_s or 0)
    while True:
        with admission() as taken:
            plan = plan_once(model, taken.view, revision)
            if downloaded is not None:
                plan = replace(plan, source=downloaded)
            if plan.admitted:
                assert plan.peak is not None and plan.selected_device is not None
                taken.register(command=_record_label(plan, command), model=requested_model or plan.model_path,
                               artifact_id=plan.manifest.artifact_id if plan.manifest else None,
                               device_ids=(plan.selected_device.device_id,), reserved_bytes=ledger_bytes(plan),
                               predicted_peak_bytes=plan.peak.predicted_bytes,
                               headroom_bytes=plan.peak.headroom_bytes, held_peak_bytes=plan.peak.held_bytes,
                               kv_pool_bytes=sum(r.bytes for r in plan.reservations if r.purpose == "kv_cache"))
                return plan
        waiting = {r.code for r in plan.refusals} == {"device_committed"}
        if not waiting or time.monotonic() >= deadline:
            return plan
        time.sleep(1.0)


def _record_label(plan: Plan, command: str) -> str:
    """``edge run``, with the node and its ranks for a node of a multi-node plan (``edge ps`` shows it)."""
    node = (plan.parallel or {}).get("node")
    if not node:
        return f"edge {command}"
    ranks = f"rank{'s' if len(node['ranks']) > 1 else ''} {','.join(map(str, node['ranks']))}"
    return f"edge {command} (node {node['node_rank']} of {node['nnodes']}, {ranks})"


def ledger_view(say: Say = _silent) -> LedgerView | None:
    """The other live sessions on this host; None (with a warning) when the ledger cannot be trusted."""
    from ..services.host_ledger import read_ledger

    try:
        view = read_ledger()
    except UsageError as exc:
        say(f"warning: {exc}; planning without the other sessions' reservations")
        return None
    for warning in view.warnings:
        say(f"warning: session ledger: {warning}")
    return view


def fetch_model(plan: Plan, say: Say = _silent) -> ModelSource | Plan:
    """Download an admitted Hub plan's weights into the Hugging Face cache; a refused plan if that cannot be done."""
    from ..artifact.hub import download

    assert plan.source is not None
    say(f"{plan.source.describe()}; downloading the weights into the Hugging Face cache")
    try:
        return download(plan.source)
    except ArtifactError as exc:
        return replace(plan, admitted=False, refusals=(Refusal(code=exc.code, message=str(exc), remedy=exc.remedy),),
                       selected_device=None, reservations=(), peak=None, capacity_bytes=None, engine_kwargs={})
