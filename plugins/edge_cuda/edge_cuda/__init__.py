"""edge-cuda: NVIDIA GPUs found through NVML and driven by vLLM's CUDA build.

Registered in the ``edge.backends`` entry-point group as ``cuda``. Every GPU
this process can see is reported as ``cuda:N`` with its VRAM, free bytes and
compute capability; it is runnable when the CUDA build of vLLM is installed in
this interpreter. The formats a GPU executes follow from its compute
capability (``_capability.py``), so int8 W8A8 is refused on Blackwell before
anything is loaded; a pipeline-parallel layout of a model vLLM cannot pipeline
is refused from the installed vLLM's source (``_pipeline.py``). A session runs
as vLLM CUDA runs it by default, compiled with CUDA graphs, and the graphs'
memory is budgeted (``_graphs.py``).
"""

from __future__ import annotations

from typing import Any

from edge_core import ExecutionMode, hookimpl
from edge_core.kit.vllm_hooks import (
    cancel,
    engine_rules,
    reference_token_ids,
    start_server,
    start_stage,
    stop_stage,
    stream,
)

from . import _capability, _counter, _graphs, _memory, _pipeline, _probe

EDGE_API_VERSION = 1
#: Why a vLLM CUDA session is compiled unless --enforce-eager: it is vLLM's own default on a GPU.
COMPILED_REASON = ("vLLM CUDA's default: torch.compile with CUDA graphs (FULL_AND_PIECEWISE) at its default "
                   "capture sizes, where its small-batch decode speed comes from; --enforce-eager to start faster")

#: Why the last probe found no devices (no NVML, no driver, no GPU visible), or
#: None. The registry reads it to explain an empty plugin row.
last_probe_note: str | None = None

__all__ = [
    "EDGE_API_VERSION",
    "cancel",
    "engine_rules",
    "execution_mode",
    "format_remedy",
    "gate_plan",
    "last_probe_note",
    "memory_counter",
    "probe_devices",
    "reference_token_ids",
    "reserve_memory",
    "start_server",
    "start_stage",
    "stop_stage",
    "stream",
    "weight_formats",
]


@hookimpl
def probe_devices(host: Any) -> list:
    global last_probe_note
    devices, last_probe_note = _probe.probe(host)
    return devices


@hookimpl
def weight_formats(device: Any) -> list[str] | None:
    if not _capability.owns(device):
        return None
    return list(_capability.device_formats(device))


@hookimpl
def gate_plan(device: Any, manifest: Any, session: Any, host: Any, share: Any) -> list | None:
    if not _capability.owns(device):
        return None
    return _capability.gate(device, manifest) + _pipeline.gate(device, manifest, share)


@hookimpl
def format_remedy(device: Any, weight_format: str) -> str | None:
    if not _capability.owns(device):
        return None
    return _capability.format_refusal_remedy(device, weight_format)


@hookimpl
def execution_mode(device: Any, manifest: Any, session: Any) -> ExecutionMode | None:
    if not _capability.owns(device):
        return None
    sm = _capability.sm_number(device.compute_capability)
    sizes = _graphs.capture_sizes(int(session.max_num_seqs), int(session.max_num_batched_tokens or 1), sm)
    return ExecutionMode(enforce_eager=False, source="backend", reason=COMPILED_REASON, cudagraph_capture_sizes=sizes)


@hookimpl
def reserve_memory(device: Any, manifest: Any, session: Any, host: Any, share: Any) -> list | None:
    if not _capability.owns(device):
        return None
    return _memory.reservations(session, share, manifest, _capability.sm_number(device.compute_capability))


@hookimpl
def memory_counter(device: Any) -> Any:
    if not _capability.owns(device):
        return None
    return _counter.nvml_counter(device)
