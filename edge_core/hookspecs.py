"""The contract between edge-core and its backends.

Six hooks are fixed by the product (``probe_devices``, ``weight_formats``,
``reserve_memory``, ``start_stage``, ``stream``, ``cancel``); more earn their
place: ``format_remedy``, ``gate_plan``, ``stop_stage``, ``verify_device``, and
optional ones a backend implements only when it has something to say
(``execution_mode``, ``engine_rules``, ``prepare_stage``, ``memory_counter``,
``reference_token_ids``, ``start_server``) — a backend without them gets the
safe default (eager, vLLM's KV and launch rules, nothing to prepare, no device
counter, no parity run, ``edge serve`` refused with ``serve_unsupported``).

Dispatch comes in two shapes:

* **every plugin** — ``probe_devices`` is called on every loaded backend and the
  lists are merged by the registry;
* **owning backend** — every other hook is called on the one plugin that
  reported the device (``Device.plugin``), through a pluggy subset caller; the
  answer is that plugin's return value (``firstresult``). A plugin never sees a
  device it did not report.

Argument names are the names implementations receive. Adding an argument later
is safe; renaming one breaks every plugin, so the names below are frozen for
``API_VERSION`` 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # imported for annotations only: the core stays cheap to import
    from .budget import Reservation
    from .devices import Device, DeviceCounter
    from .engine import EngineRules
    from .host import HostFacts
    from .layout import DeviceShare
    from .manifest import Manifest
    from .plans import ExecutionMode, Plan, Refusal, SessionSpec
    from .server import ServerHandle, ServerOptions
    from .stream import DeltaEvent, StageRequest

PROJECT = "edge"

#: The hook API version this core implements. A plugin declares the version it
#: was written for as a module attribute ``EDGE_API_VERSION``; a mismatch is a
#: plugin status, not a crash.
API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def probe_devices(host: HostFacts) -> list[Device]:
    """Return every device this backend can see, runnable here or not.

    Called on every loaded plugin; the registry merges the lists and reports a
    device id claimed by two plugins instead of merging it. Must not raise for
    absent hardware or a missing vendor runtime: return the device with
    ``runnable=False`` and a ``reason`` that says what to install, or an empty
    list when there is nothing to see. Must be cheap: no import of torch, vllm,
    transformers or onnxruntime (``edge devices`` answers in well under a second).

    ``host`` carries RAM, cgroup limit, NUMA nodes and ISA flags read once by
    the core. Memory figures on the returned devices are bytes.
    """


@hookspec(firstresult=True)
def weight_formats(device: Device) -> list[str] | None:
    """Return the artifact formats ``device`` can *execute* (not merely load).

    Names follow a checkpoint's ``quantization_config`` (``dense``,
    ``compressed-tensors:int8``, ``gptq``, ...) or an exported graph's format
    (``onnx:a16w8``, ``pt:fp16``, ...). Owning backend only. The registry falls
    back to ``device.weight_formats`` from the probe when a plugin does not
    implement this hook.
    """


@hookspec(firstresult=True)
def format_remedy(device: Device, weight_format: str) -> str | None:
    """Return what to do when ``device`` cannot execute ``weight_format``.

    Name the builds of the model that would run on this device (the closest
    formats it executes), a device that would run this one, or another venv.
    Called only after the format gate refused; never applied by edge. Return
    None to let the core compose a generic remedy. Owning backend only.
    """


@hookspec(firstresult=True)
def gate_plan(
    device: Device,
    manifest: Manifest,
    session: SessionSpec,
    host: HostFacts,
    reservations: list[Reservation],
    share: DeviceShare | None,
) -> list[Refusal] | None:
    """Return the backend's own reasons to refuse this session, or an empty list.

    Kernel limits (supported attention head sizes, bf16 below SM 8.0) and
    capacity checks the runtime will make itself (vLLM CPU's per-NUMA-node KV
    check). ``reservations`` is the session's full budget (core terms and this
    backend's ``reserve_memory`` terms), in bytes. ``share`` is None for a
    session on this one device, else the part of a tensor/pipeline-parallel
    layout the device runs (its ranks, their layers; ``share.layout`` has the
    sizes): refuse what the runtime cannot split (a model without pipeline
    support). Each refusal carries a code, a message and a remedy. Owning
    backend only; called after the format gate and before the core's capacity
    gate.
    """


@hookspec(firstresult=True)
def execution_mode(device: Device, manifest: Manifest, session: SessionSpec) -> ExecutionMode | None:
    """Return how the runtime executes a session on ``device`` by default: eager or compiled, and why.

    Asked only when the user gave neither ``--enforce-eager`` nor
    ``--compile`` (``session.enforce_eager`` is None; the other limits are
    resolved). Return the runtime's own default as a
    :class:`~edge_core.plan.ExecutionMode` with a reason people can read, and
    the batch sizes graphs are captured for if any (vLLM CUDA:
    torch.compile with CUDA graphs at its default capture sizes). The
    answer sets ``session.enforce_eager`` for ``reserve_memory`` and
    ``gate_plan``. Optional; owning backend only (no answer: eager).
    """


@hookspec(firstresult=True)
def engine_rules(device: Device) -> EngineRules | None:
    """Return the rules of the engine that runs checkpoints on ``device``, as the planner asks them.

    An :class:`~edge_core.engine.EngineRules`: the bytes its KV allocator
    reserves for a layout and session (the ``vllm`` figure of the plan's
    ``kv``, and the block it uses), and the environment and per-host commands
    that start an admitted parallel layout. Pure arithmetic, no engine
    import. Optional; owning backend only (no answer: vLLM's rules,
    :data:`edge_core.engines.vllm.VLLM_RULES`). The graph-stage planner does
    not ask it.
    """


@hookspec(firstresult=True)
def reserve_memory(
    device: Device, manifest: Manifest, session: SessionSpec, host: HostFacts, share: DeviceShare | None
) -> list[Reservation] | None:
    """Return the backend's own memory terms for a planned session, in bytes.

    The core already reserves weights, KV cache, activations, the load
    transient and headroom; a backend adds what only it knows: runtime baseline
    (vLLM CPU runs several processes that each import torch), CUDA context,
    graph-capture pool, workspace. With ``share`` (ranks of a parallel layout
    on this device; ``manifest.weight_bytes`` is then their slice) add the
    terms of every rank process it runs and the collective-communication
    buffers. Each term names its pool, lifetime and evidence class. Owning
    backend only.
    """


@hookspec(firstresult=True)
def start_stage(device: Device, plan: Plan) -> Any:
    """Start one stage on ``device`` from an admitted ``plan``; return a handle.

    The handle is opaque to the core and passed back to ``stream``, ``cancel``
    and ``stop_stage``. It must expose ``state``, a :class:`edge_core.stream.StateHandle`
    naming the backend, device and artifact id, and ``executed_on``, the device
    id that actually runs the stage. Blocks until the stage can take requests.
    Owning backend only.
    """


@hookspec(firstresult=True)
def stream(stage: Any, request: StageRequest) -> Iterator[DeltaEvent] | None:
    """Run ``request`` on ``stage``; return an iterator of delta events.

    Each event carries only what is new since the previous one (token ids and
    text), the request's epoch, and a sequence number starting at 0. The last
    event has a ``finish_reason``. The core pumps the iterator into a bounded
    stream and owns sequence checking and epoch fencing. Owning backend only.
    """


@hookspec(firstresult=True)
def cancel(stage: Any, request_id: str) -> bool | None:
    """Abort ``request_id`` in the backend; return True if it was in flight.

    Idempotent: cancelling a finished or unknown request returns False. Called
    after the core has retired the request's epoch and before it closes the
    stream, so it must not block on the producer. Owning backend only.
    """


@hookspec(firstresult=True)
def stop_stage(stage: Any) -> bool | None:
    """Shut the stage down, leaving no worker process, thread or queue behind.

    Owning backend only. Returns True once everything the stage started is gone.
    """


@hookspec(firstresult=True)
def verify_device(device: Device) -> Device | None:
    """Run something tiny on ``device`` and return it with evidence upgraded to ``B``.

    Used by ``edge devices --verify``; may import the vendor runtime. Return
    None when the backend has no verification. Owning backend only.
    """


@hookspec(firstresult=True)
def prepare_stage(device: Device, plan: Plan, progress: Callable[[str], None] | None) -> Any:
    """Get the machine ready for ``plan``'s stage before the memory baseline is taken; return a record.

    Called by the runtime before it samples the pre-load baseline and before
    ``start_stage``, so memory touched here is not charged to the session.
    vLLM CPU uses it to grow the NUMA node it binds to until the node can
    hold the KV pool (vLLM checks the node's figure of the moment). The
    record (anything with ``to_dict()``) goes into the run's JSON;
    ``progress``, when given, takes one-line status messages. Raise
    :class:`~edge_core.errors.StageError` when the stage cannot start.
    Optional; owning backend only (no answer: nothing to prepare).
    """


@hookspec(firstresult=True)
def memory_counter(device: Device) -> DeviceCounter | None:
    """Return the device's own memory counter for the sampler (NVML used bytes for a CUDA card).

    The counter is read every sampling period beside the process-tree
    counters and never summed with them. Optional; owning backend only (no
    answer: the run has no device counter, and says so).
    """


@hookspec(firstresult=True)
def reference_token_ids(device: Device, plan: Plan, prompts: list[str], max_tokens: int) -> Any:
    """Run ``prompts`` greedily (``ignore_eos``) through the runtime alone, without edge's stage.

    Returns ``(token_ids_per_prompt, info_dict)`` after every process the
    runtime started is gone, with the plan's engine arguments and the same
    runtime environment edge's stage uses: the other half of ``edge parity``.
    Optional; owning backend only (no answer: parity is not available there).
    """


@hookspec(firstresult=True)
def start_server(device: Device, plan: Plan, options: ServerOptions) -> ServerHandle | None:
    """Put ``plan`` behind the runtime's own OpenAI-compatible server; return a handle without serving yet.

    The handle's ``run()`` starts the engine with the plan's engine arguments
    and nothing else, serves on ``options.sock`` (already bound) with
    ``options.routes`` added as GET endpoints, calls ``options.on_ready(url)``
    once ``/health`` answers, and returns a
    :class:`~edge_core.server.ServerReport` after SIGTERM or SIGINT: stop
    accepting, let in-flight requests finish for ``options.drain_timeout_s``,
    abort the rest, reap every engine process. A second signal forces the
    stop. Optional; owning backend only (no answer: ``serve_unsupported``).
    """


#: Hooks answered by every plugin; all others go to the owning backend alone.
BROADCAST_HOOKS = ("probe_devices",)
OWNER_HOOKS = (
    "weight_formats", "format_remedy", "gate_plan", "execution_mode", "engine_rules", "reserve_memory",
    "start_stage", "stream", "cancel", "stop_stage", "verify_device", "prepare_stage", "memory_counter",
    "reference_token_ids", "start_server",
)
