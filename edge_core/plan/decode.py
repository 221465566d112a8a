"""Can this checkpoint run here as one autoregressive session, on which device, with how many bytes?

The candidates are walked in a fixed order (private pool before shared, then
larger) through the gates: runnable, whole-session placement, weight format,
the backend's own gates (kernels, the runtime's own capacity check), and
capacity (the pipeline of :mod:`.gates`). The first device that passes every
gate is selected; the others are reported with why they were not used, and
those that also pass are pre-approved fallbacks. No remedy is ever applied
silently.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..engines.vllm_launch import EXECUTOR_UNI
from ..errors import ArtifactError, UsageError
from ..plans import STAGE_ONLY_KINDS, DeviceVerdict, ExecutionMode, Plan, Refusal, SessionSpec
from .capacity import capacity_of
from .committed import pool_key
from .execution import execution_mode, with_mode, with_processes
from .gates import Judgement, Owner, Walk, backend_budget, budget_gates, format_gate, walk
from .kv import estimate_kv
from .pool import choose_pool, fitted_context, largest_pool, with_context
from .remedies import capacity_refusal, no_backend_refusal, pool_too_small_refusal, shorter_context_fallbacks
from .terms import core_reservations

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ..budget import Peak, Reservation
    from ..devices import Device
    from ..host import HostFacts
    from ..kv import KVEstimate
    from ..layout import DeviceShare
    from ..manifest import Manifest
    from ..services.host_ledger import LedgerView
    from ..services.registry import PluginRecord, Registry
    from .gates import Budget

#: Engine default when the user sets no token budget per forward pass.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class DeviceOutcome:
    """What the gates said for one device: refusals and the gate that gave them, and the budget.

    The budget (``reservations``, ``peak``, ``kv``, ``capacity_bytes``) is
    kept whenever the arithmetic ran, refused or not, so a refusal can show
    the terms it was decided on; ``capacity_bytes`` is None where the pool's
    capacity is unknown (a device list without host facts). ``execution`` is
    the mode the budget was computed for (None before the format gate passed).
    """

    refusals: tuple[Refusal, ...] = ()
    gate: str | None = None
    reservations: tuple[Reservation, ...] = ()
    peak: Peak | None = None
    capacity_bytes: int | None = None
    kv: KVEstimate | None = None
    notes: tuple[str, ...] = field(default=())
    execution: ExecutionMode | None = None
    #: The session as this device plans it: ``--max-model-len auto`` fitted to its pool (None before the format gate).
    session: SessionSpec | None = None

    def verdict(self, device_id: str, selected: bool = False, note: str | None = None) -> DeviceVerdict:
        """This outcome as the plan's verdict row for ``device_id``."""
        return DeviceVerdict(device_id, selected, self.refusals, note=note, gate=self.gate,
                             reservations=self.reservations, peak=self.peak, kv=self.kv,
                             capacity_bytes=self.capacity_bytes)


def resolve_session(manifest: Manifest, session: SessionSpec) -> SessionSpec:
    """Fill the limits the user left open from the checkpoint; reject impossible ones."""
    config = manifest.config
    native = config.get("max_position_embeddings") or config.get("n_positions") or config.get("seq_length")
    max_model_len = (None if session.max_model_len_auto else session.max_model_len) or native
    if not isinstance(max_model_len, int) or max_model_len <= 0:
        raise UsageError(
            f"{manifest.path}: config.json gives no max_position_embeddings; pass --max-model-len N"
            + (" (auto fits up to the model's own context, which it does not state)"
               if session.max_model_len_auto else "")
        )
    if isinstance(native, int) and max_model_len > native:
        raise UsageError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings ({native}); "
            "vLLM would refuse it too"
        )
    if session.max_num_seqs < 1:
        raise UsageError("--max-num-seqs must be at least 1")
    batched = session.max_num_batched_tokens or min(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
    if batched < 1:
        raise UsageError("--max-num-batched-tokens must be at least 1")
    if session.kv_cache_memory_bytes is not None and session.kv_cache_memory_bytes < 1:
        raise UsageError("--kv-cache-memory must be at least 1 byte")
    if session.max_connections is not None and session.max_connections < 1:
        raise UsageError("--max-connections must be at least 1")
    return SessionSpec(
        max_model_len=max_model_len,
        max_num_seqs=session.max_num_seqs,
        max_num_batched_tokens=batched,
        kv_dtype=session.kv_dtype,
        enforce_eager=session.enforce_eager,
        max_model_len_auto=session.max_model_len_auto,
        kv_cache_memory_bytes=session.kv_cache_memory_bytes,
        served=session.served,
        max_connections=session.max_connections,
        in_process=session.in_process,
    )


def engine_kwargs_for(manifest: Manifest, session: SessionSpec, device: Device, kv: KVEstimate, peak: Peak,
                      capacity_bytes: int) -> dict[str, Any]:
    """vLLM engine arguments derived from the plan; never vLLM's defaults for memory.

    ``gpu_memory_utilization`` is computed on both pools, as a fraction of the
    device's total memory: vLLM's CPU backend reads it as a fraction of the
    NUMA node's RAM, and its 0.92 default asked for 28.4 GiB of a 30.9 GiB
    machine for a 6.55 GiB plan.
    """
    total = device.memory_bytes or capacity_bytes
    fraction = min(max(peak.admission_bytes / total, 0.01), 0.99) if total else 0.9
    kwargs: dict[str, Any] = {
        "model": manifest.path,
        "max_model_len": session.max_model_len,
        "max_num_seqs": session.max_num_seqs,
        "max_num_batched_tokens": session.max_num_batched_tokens,
        "enforce_eager": session.enforce_eager,
        "kv_cache_memory_bytes": kv.pool_bytes,
        "gpu_memory_utilization": round(fraction + 0.005, 2),
        "seed": 0,
    }
    if session.in_process:  # the engine core and its one worker in the caller's process (the plan's execution)
        kwargs["distributed_executor_backend"] = EXECUTOR_UNI
    if manifest.dtype in ("bfloat16", "float16", "float32"):
        kwargs["dtype"] = manifest.dtype
    if session.kv_dtype != "auto":
        kwargs["kv_cache_dtype"] = session.kv_dtype
    return kwargs


def _host_of(device: Device, host: HostFacts | None, hosts: Mapping[str, HostFacts | None] | None
             ) -> HostFacts | None:
    """The facts of the host ``device`` is on: its list's, in a multi-host plan (``extras["host"]``)."""
    label = device.extras.get("host") if isinstance(device.extras, dict) else None
    if hosts and isinstance(label, str) and label in hosts:
        return hosts[label]
    return host


def plan_checkpoint(manifest: Manifest, *, session: SessionSpec, devices: list[Device], host: HostFacts | None,
                    registry: Registry | None = None, devices_source: str = "probed",
                    ledger: LedgerView | None = None,
                    hosts: Mapping[str, HostFacts | None] | None = None) -> Plan:
    """Walk the gates for every candidate device and return the plan, admitted or refused.

    ``ledger`` is what other live edge sessions on this host were admitted to
    hold (:mod:`edge_core.services.host_ledger`); the capacity gate counts what of it the
    pool does not show as used yet. ``hosts`` are the facts of each host of a
    multi-host plan, by the label its devices carry in ``extras["host"]``: a
    device is planned against its own host's memory, ``host`` when it has no
    label there.
    """
    def refused(refusals: list[Refusal], **extra: Any) -> Plan:
        return Plan(admitted=False, model_path=manifest.path, session=session, refusals=tuple(refusals),
                    devices_source=devices_source, manifest=manifest, **extra)

    plugins = registry.plugins() if registry is not None else []
    if not devices and not plugins and devices_source == "probed":
        return refused([no_backend_refusal(registry, "pip install edge-cpu (or edge-cuda for NVIDIA GPUs) in this venv")])
    try:
        session = resolve_session(manifest, session)
        record = walk(devices, lambda device: _judge(device, manifest, session, _host_of(device, host, hosts),
                                                     registry, devices, ledger))
    except ArtifactError as exc:  # the config lacks what the KV arithmetic needs: no device can help
        return refused([Refusal(code=exc.code, message=str(exc), remedy=exc.remedy)])
    verdicts, fallbacks, notes = tuple(record.verdicts), tuple(record.fallbacks), tuple(record.notes)
    if record.selected is None:
        # The selected session's fields stay empty (nothing was selected); the KV
        # estimate is the request's, so the first candidate that computed one says it.
        first_kv = next((v.kv for v in verdicts if v.kv is not None), None)
        return refused(_no_device_refusals(record, devices, plugins), verdicts=verdicts, fallbacks=fallbacks,
                       notes=notes, kv=first_kv)
    device, outcome = record.selected
    assert outcome.kv is not None and outcome.peak is not None
    capacity = outcome.capacity_bytes or 0  # unknown capacity (noted): engine_kwargs_for falls back to the device
    session = with_mode(outcome.session or session, outcome.execution)
    return Plan(
        admitted=True, model_path=manifest.path, session=session, manifest=manifest, selected_device=device,
        reservations=outcome.reservations, peak=outcome.peak, capacity_bytes=capacity,
        kv=outcome.kv, engine_kwargs=engine_kwargs_for(manifest, session, device, outcome.kv, outcome.peak,
                                                       capacity),
        fallbacks=fallbacks, verdicts=verdicts, devices_source=devices_source, notes=notes,
        execution=outcome.execution,
    )


def _judge(device: Device, manifest: Manifest, session: SessionSpec, host: HostFacts | None,
           registry: Registry | None, devices: list[Device], ledger: LedgerView | None) -> Judgement:
    """One candidate through the checkpoint planner's gates: masked, runnable, placement, then :func:`plan_on_device`."""
    if device.masked:
        return Judgement(DeviceVerdict(device.device_id, False, note=device.reason or "masked by policy",
                                       gate="masked"))
    if not device.runnable:
        return Judgement(DeviceVerdict(device.device_id, False, note=f"not runnable here: {device.reason}",
                                       gate="runnable"))
    if device.kind in STAGE_ONLY_KINDS:
        refusal = Refusal(
            code="no_exported_graph", device_id=device.device_id,
            message=(f"{device.device_id} executes exported graphs one stage at a time, never a whole "
                     "autoregressive session"),
            remedy=("export a stage of this model to ONNX (scripts/export_stage.py) and plan it with "
                    "`edge plan --model STAGE.onnx`"),
        )
        return Judgement(DeviceVerdict(device.device_id, False, (refusal,), gate="placement"))
    outcome = plan_on_device(device, manifest, session, host, registry, devices, ledger)
    shorter = shorter_context_fallbacks(device, list(outcome.refusals)) if outcome.refusals else []
    return Judgement(outcome.verdict(device.device_id), outcome.notes, tuple(shorter), payload=outcome)


def _no_device_refusals(record: Walk, devices: list[Device], plugins: list[PluginRecord]) -> list[Refusal]:
    """The refusals of a walk that selected nothing, led by ``no_runnable_device`` when no gate said why."""
    refusals = list(record.refusals)
    if any(d.runnable for d in devices if not d.masked) and refusals:
        return refusals
    why = "; ".join(f"{v.device_id}: {v.note}" for v in record.verdicts if v.note) or "no device was found"
    remedy = ("install the backend for this machine's hardware in this venv (edge devices lists what "
              "is missing), or unmask a kind you masked")
    left_out = left_out_plugins(plugins)
    if left_out:
        why += f"; the installed {left_out} was not loaded (--plugins / --block, or their env)"
        remedy = (f"load {left_out}: drop --plugins / --block (or EDGE_PLUGINS / EDGE_BLOCK_PLUGINS), or "
                  "name it in --plugins; " + remedy)
    refusals.insert(0, Refusal(
        code="no_runnable_device", message=f"no device this interpreter drives can take the session ({why})",
        remedy=remedy,
    ))
    return refusals


def plan_on_device(device: Device, manifest: Manifest, session: SessionSpec, host: HostFacts | None,
                   registry: Registry | None, devices: list[Device] | None = None,
                   ledger: LedgerView | None = None, share: DeviceShare | None = None) -> DeviceOutcome:
    """The format gate, the backend's gates and the capacity gate for one runnable device.

    Past the format gate the whole budget is computed before either later gate
    decides (it is pure arithmetic), so a device refused by its backend or by
    capacity keeps the terms it was refused on. The KV pool is sized here
    (:mod:`.pool`), and ``--max-model-len auto`` fitted to it. ``share`` is
    the part of a parallel layout the device runs (:mod:`.parallel`): the
    budget is then its ranks' weights, one per-rank KV pool per rank, and the
    backend's terms for that many rank processes.
    """
    if share is not None:
        manifest = replace(manifest, weight_bytes=share.weight_bytes)  # what this device loads
    owner = Owner.of(device, registry)
    notes = owner.missing_note("without the backend's own gates and memory terms")
    refusal = format_gate(owner, manifest, owner.formats())
    if refusal is not None:
        return DeviceOutcome(refusals=(refusal,), gate="format", notes=notes)
    mode = execution_mode(device, manifest, session, owner.registry, owner.installed)
    mode = with_processes(mode, owner.rules().engine_processes(
        device, replace(session, enforce_eager=mode.enforce_eager), share.layout.world_size if share else 1, host))
    session = with_mode(session, mode)
    sizing = _PoolSizing(device, manifest, host, owner, devices or [], ledger, share)
    if session.max_model_len_auto:
        fitted, why = sizing.auto_context(session)
        if not fitted:  # not one token's blocks: refused at the model's own context, with the remedy
            kv = sizing.estimate(session)
            if session.kv_cache_memory_bytes is None:
                return sizing.outcome(session, kv.with_pool(kv.sequence_bytes + kv.block_bytes, "one_sequence",
                                                                  sizing.rules), mode, notes)
            kv = kv.with_pool(session.kv_cache_memory_bytes, "kv_cache_memory", sizing.rules)
            return sizing.outcome(session, kv, mode, notes,
                                  (pool_too_small_refusal(device, manifest, session, kv, sizing.rules),))
        session = with_context(session, fitted)
        notes += (f"{device.device_id}: --max-model-len auto: {fitted:,} tokens, {why}",)
    kv = sizing.estimate(session)
    asked = session.kv_cache_memory_bytes
    if asked is not None and asked < kv.sequence_bytes + kv.block_bytes:
        kv = kv.with_pool(asked, "kv_cache_memory", sizing.rules)
        return sizing.outcome(session, kv, mode, notes, (pool_too_small_refusal(device, manifest, session, kv, sizing.rules),))
    kv, shrunk = choose_pool(kv, session, sizing.passes(session), sizing.largest(session), sizing.rules)
    if shrunk and kv.pool is not None and kv.pool.source == "fit":
        notes += (f"{device.device_id}: a KV pool for {session.max_num_seqs} sequences at full context "
                  f"({kv.bytes_vllm / 2**30:.2f} GiB) does not fit beside everything else; the pool is the largest "
                  f"that does ({kv.pool.bytes / 2**30:.2f} GiB, {kv.pool.full_length_sequences:,} at full context)",)
    return sizing.outcome(session, kv, mode, notes)


class _PoolSizing:
    """One device's KV arithmetic and budgets, each budget made once per (context, pool): what sizing the pool asks."""

    def __init__(self, device: Device, manifest: Manifest, host: HostFacts | None, owner: Owner,
                 devices: list[Device], ledger: LedgerView | None, share: DeviceShare | None) -> None:
        self.device, self.manifest, self.host, self.owner = device, manifest, host, owner
        self.devices, self.ledger, self.share = devices, ledger, share
        self.rules = owner.rules()
        self.ranks = share.ranks_here if share is not None else 1
        self.capacity, _ = capacity_of(device, host, devices)
        self.committed = ledger.committed_bytes(pool_key(device)) if ledger is not None else 0
        self.budgets: dict[tuple[int, int, int, str], Budget] = {}

    def estimate(self, session: SessionSpec) -> KVEstimate:
        block = self.device.extras.get("kv_block_size")
        share = self.share
        return estimate_kv(self.manifest.config, max_model_len=int(session.max_model_len or 0),
                           max_num_seqs=session.max_num_seqs, max_num_batched_tokens=session.max_num_batched_tokens,
                           kv_dtype=session.kv_dtype, model_dtype=self.manifest.dtype or "bfloat16",
                           block_size=block if isinstance(block, int) else None,
                           tp_size=share.layout.tp if share else 1, layer_range=share.layers if share else None,
                           concurrent_batches=share.layout.pp if share else 1, rules=self.rules)

    def budget(self, session: SessionSpec, kv: KVEstimate) -> Budget:
        key = (int(session.max_model_len or 0), int(session.max_num_batched_tokens or 0), kv.pool_bytes,
               kv.pool.source if kv.pool is not None else "")
        if key not in self.budgets:
            self.budgets[key] = backend_budget(
                self.owner, core_reservations(self.device, self.manifest, session, kv, self.share),
                manifest=self.manifest, session=session, host=self.host, devices=self.devices, share=self.share)
        return self.budgets[key]

    def room(self) -> int | None:
        """What admission may take here: capacity less what other live sessions hold unseen (None: unknown)."""
        return None if self.capacity is None else self.capacity - self.committed

    def passes(self, session: SessionSpec) -> Callable[[KVEstimate], bool]:
        def passes(kv: KVEstimate) -> bool:
            budget = self.budget(session, kv)
            room = self.room()
            return not budget.gated and (room is None or budget.peak.admission_bytes <= room)
        return passes

    def largest(self, session: SessionSpec) -> Callable[[KVEstimate], int]:
        def largest(kv: KVEstimate) -> int:
            room = self.room()
            if room is None:
                return kv.bytes_vllm
            terms = list(self.budget(session, kv.with_pool(kv.bytes_vllm, "max_num_seqs", self.rules)).reservations)
            return largest_pool(kv, terms, self.device.memory_pool, room, ranks=self.ranks)
        return largest

    def auto_context(self, session: SessionSpec) -> tuple[int, str]:
        """``--max-model-len auto`` here: the longest context one sequence can hold in the pool, and how it was had.

        On the user's pool, vLLM's auto-fit of it. Otherwise the model's own
        context where one full-length sequence fits beside everything else,
        else vLLM's auto-fit of the largest pool that fits. 0 when not even
        one token's blocks fit.
        """
        kv = self.estimate(session)
        native = int(session.max_model_len or 0)
        asked = session.kv_cache_memory_bytes
        if asked is not None:
            fitted = fitted_context(self.manifest, session, kv, asked, self.rules)
            return fitted, (f"the longest one sequence can hold in --kv-cache-memory {asked / 2**20:,.0f} MiB "
                            f"(vLLM's auto-fit, of {native:,})")
        room = self.room()
        least = kv.with_pool(kv.sequence_bytes + kv.block_bytes, "one_sequence", self.rules)
        if room is None or self.passes(session)(least):
            return native, "the model's own context: one sequence of it fits beside everything else"
        terms = list(self.budget(session, least).reservations)
        unit = kv.block_bytes or 1
        pool = largest_pool(kv, terms, self.device.memory_pool, room, ranks=self.ranks, least_bytes=2 * unit,
                            most_bytes=least.pool_bytes, unit=unit)
        fitted = fitted_context(self.manifest, session, kv, pool, self.rules) if pool else 0
        return fitted, (f"the longest one sequence can hold in the largest KV pool that fits beside everything "
                        f"else ({pool / 2**20:,.0f} MiB; vLLM's auto-fit, of {native:,})")

    def outcome(self, session: SessionSpec, kv: KVEstimate, mode: ExecutionMode | None, notes: tuple[str, ...],
                refusals: tuple[Refusal, ...] = ()) -> DeviceOutcome:
        """The device's outcome with ``kv``'s pool: the gates' verdict on its budget, or ``refusals`` given."""
        budget = self.budget(session, kv)
        terms, total, capacity = list(budget.reservations), budget.peak, budget.capacity_bytes
        if refusals:
            gate: str | None = "capacity"
        else:
            gate, refusals = budget_gates(self.device, budget, self.ledger, lambda: capacity_refusal(
                self.device, self.manifest, session, kv, terms, total, capacity or 0, budget.how, self.rules,
                ranks=self.ranks))
        if gate is None and capacity is None:
            notes += (f"{self.device.device_id}: pool capacity unknown (a device list without host facts); capacity "
                      "not checked",)
        return DeviceOutcome(refusals=refusals, gate=gate, reservations=budget.reservations, peak=total,
                             capacity_bytes=capacity, kv=kv, notes=notes, execution=mode, session=session)


def left_out_plugins(plugins: list[PluginRecord]) -> str:
    """``plugin 'cpu'`` (``plugins 'cpu', 'cuda'``) for installed backends the allow- or block-list kept out; or ''."""
    names = [r.name for r in plugins if r.skipped]
    if not names:
        return ""
    return ("plugin " if len(names) == 1 else "plugins ") + ", ".join(repr(n) for n in names)
