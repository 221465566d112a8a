"""Which process environment does an engine start need, so that every path that starts one is configured alike?

Every entry point that starts a vLLM engine — edge's stage, the plain-vLLM side
of ``edge parity``, the benchmarks — calls :func:`apply_runtime_env` before it
imports vLLM (vLLM reads most of these when its modules load, and its worker
processes inherit them). Two paths being compared are then never configured
differently, and the run record says what was set and what it replaced. The
one variable that tells them apart is :data:`ENGINE_MARK`: ``1`` in an engine
edge starts (``edge_engine=True``), where its backends' vLLM plugins act, and
removed for plain vLLM. How many processes the engine runs in (vLLM's
``VLLM_ENABLE_V1_MULTIPROCESSING``) is the plan's choice, not a rule here: its
``execution.env`` (:func:`edge_core.engines.vllm_launch.engine_processes`).

Each rule below says why in a line; what it rests on, read in vLLM's source
(``vllm/envs.py``, ``vllm/platforms/cpu.py``) or seen in runs, is in
docs/vllm-cpu-facts.md, 'Environment'. A rule is either *forced* (edge's budget or output contract
depends on it; a user value is replaced and the record says so) or a
*default* (set only when the user has not set the variable).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

#: Actions recorded per variable.
SET = "set"            # edge set it (it was unset, or forced over another value)
UNSET = "unset"        # edge removed it
KEPT = "kept"          # a default rule met a value the user chose; left alone
ALREADY = "already"    # the variable already had edge's value (or was already unset)


@dataclass(frozen=True)
class EnvRule:
    """One variable: the value edge wants (None = must be unset), whether it overrides the user, and why."""

    name: str
    value: str | None
    forced: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "value": self.value, "forced": self.forced, "why": self.why}


RULES: tuple[EnvRule, ...] = (
    EnvRule(
        "VLLM_CPU_KVCACHE_SPACE", None, True,
        "legacy integer-GiB KV size: vllm/platforms/cpu.py replaces kv_cache_memory_bytes with it whenever it "
        "is set and non-empty, so a stray value would silently override the plan's KV pool",
    ),
    EnvRule(
        "VLLM_WORKER_MULTIPROC_METHOD", "spawn", True,
        "vLLM's CPU platform switches to spawn itself, but only once its config is built; setting it before "
        "the import makes both compared paths identical and never forks a process that already runs "
        "threads (the memory sampler, the stage's event loop)",
    ),
    EnvRule(
        "VLLM_CPU_OMP_THREADS_BIND", "auto", False,
        "vLLM binds the worker to the first NUMA node's cores and checks the KV pool against that node; "
        "edge-cpu's planner reads the same variable to pick the node, so planner and engine agree",
    ),
    EnvRule(
        "VLLM_NO_USAGE_STATS", "1", True,
        "usage reporting starts a background thread that posts to stats.vllm.ai: network traffic on a box "
        "that may have none, and a thread stop() could not join",
    ),
    EnvRule(
        "VLLM_DO_NOT_TRACK", "1", True,
        "same switch as VLLM_NO_USAGE_STATS under the name vLLM also honours; both are set so neither "
        "spelling left in the user's environment turns reporting back on",
    ),
    EnvRule(
        "HF_HUB_OFFLINE", "1", False,
        "edge runs local checkpoint directories; offline mode keeps transformers and huggingface_hub from "
        "trying the network (on an offline gateway box that costs a connection timeout per lookup)",
    ),
    EnvRule(
        "VLLM_LOGGING_STREAM", "ext://sys.stderr", True,
        "vLLM logs to stdout by default, from three processes; stdout carries edge's tokens and --json "
        "documents, so the logs go to stderr",
    ),
    EnvRule(
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "0", True,
        "vLLM CPU keeps its own 32 oneDNN matmul primitives per weight shape, one per batch size; oneDNN's "
        "global cache (1,024) kept every other one, and a server whose batches came in many sizes grew its "
        "worker by 2 GiB: with 0 vLLM's own cache is the bound, which the plan reserves",
    ),
    EnvRule(
        "VLLM_LOGGING_LEVEL", "WARNING", False,
        "an engine start logs dozens of INFO lines that bury edge's progress on stderr; set "
        "VLLM_LOGGING_LEVEL=INFO to see them (vLLM's failures are logged at ERROR and still show)",
    ),
)


#: ``1`` in the environment of every engine edge starts (its stage, ``edge serve``'s server, a node's headless
#: ranks), removed for plain vLLM: the vLLM general plugins edge's backends register act only where it is set
#: (edge-cpu's levers: plugins/edge_cpu/README.md), so plain vLLM in the same venv stays plain.
ENGINE_MARK = "EDGE_ENGINE"
EDGE_ENGINE_RULE = EnvRule(
    ENGINE_MARK, "1", True,
    "this engine is edge's: the vLLM plugins edge's backends register (edge-cpu's heap trim and packing levers) "
    "act only in processes where it is 1, never in a user's own vLLM in the same venv",
)
PLAIN_ENGINE_RULE = EnvRule(
    ENGINE_MARK, None, True,
    "plain vLLM, the reference edge is compared with: none of the plugins edge's backends register may act in it",
)


def runtime_rules(*, edge_engine: bool, layout_env: Mapping[str, str] | None = None,
                  layout_why: str = "") -> tuple[EnvRule, ...]:
    """:data:`RULES`, the engine's mark (set for an engine edge starts, removed for plain vLLM), and the plan's
    process layout (``execution.env``: forced, since the budget was made for it; ``layout_why`` says why)."""
    layout = tuple(EnvRule(name, value, True, f"the plan's process layout: {layout_why or 'its execution'}")
                   for name, value in (layout_env or {}).items())
    return (*RULES, EDGE_ENGINE_RULE if edge_engine else PLAIN_ENGINE_RULE, *layout)


@dataclass(frozen=True)
class EnvChange:
    """What :func:`apply_runtime_env` did to one variable."""

    name: str
    action: str
    value: str | None
    previous: str | None
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "action": self.action, "value": self.value, "previous": self.previous,
                "why": self.why}


@dataclass(frozen=True)
class RuntimeEnv:
    """The runtime environment as applied: one :class:`EnvChange` per rule, in rule order."""

    changes: tuple[EnvChange, ...]

    @property
    def values(self) -> dict[str, str | None]:
        """Each variable's value after applying (None = unset)."""
        return {c.name: c.value for c in self.changes}

    @property
    def overridden(self) -> tuple[EnvChange, ...]:
        """Variables the user had set to something else and edge replaced or removed."""
        return tuple(c for c in self.changes if c.action in (SET, UNSET) and c.previous is not None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "values": self.values,
            "changes": [c.to_dict() for c in self.changes],
            "overridden": [c.name for c in self.overridden],
        }


def apply_runtime_env(environ: MutableMapping[str, str] | None = None, rules: tuple[EnvRule, ...] | None = None,
                      *, edge_engine: bool = False, layout_env: Mapping[str, str] | None = None,
                      layout_why: str = "") -> RuntimeEnv:
    """Apply ``rules`` (default :func:`runtime_rules`) to ``environ`` (default ``os.environ``); say what was done.

    ``edge_engine`` is True for an engine edge starts, False for plain vLLM
    (the default, so a caller that forgets measures plain vLLM, never edge's
    levers by accident); ``layout_env`` is the plan's process layout
    (``execution.env``), the same for both. Idempotent: applying twice changes
    nothing the second time (every action is then ``already`` or ``kept``).
    Call it before ``import vllm``.
    """
    env = os.environ if environ is None else environ
    if rules is None:
        rules = runtime_rules(edge_engine=edge_engine, layout_env=layout_env, layout_why=layout_why)
    changes = []
    for rule in rules:
        previous = env.get(rule.name)
        if rule.value is None:
            if previous is None:
                action, value = ALREADY, None
            else:
                del env[rule.name]
                action, value = UNSET, None
        elif previous == rule.value:
            action, value = ALREADY, previous
        elif previous is not None and not rule.forced:
            action, value = KEPT, previous
        else:
            env[rule.name] = rule.value
            action, value = SET, rule.value
        changes.append(EnvChange(rule.name, action, value, previous, rule.why))
    return RuntimeEnv(tuple(changes))


#: Distributions whose versions every run record carries.
VERSIONED_DISTRIBUTIONS = ("edge-core", "edge-cpu", "edge-cuda", "vllm", "vllm-cpu", "torch")


def versions() -> dict[str, str]:
    """Versions of the runtime stack installed here (Python and each of :data:`VERSIONED_DISTRIBUTIONS`)."""
    import importlib.metadata as metadata
    import platform

    out = {"python": platform.python_version()}
    for dist in VERSIONED_DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return out
