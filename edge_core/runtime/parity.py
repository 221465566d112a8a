"""Does edge's stage produce exactly the runtime's own tokens? The same prompts both ways, token ids compared.

The acceptance prompts run greedily (``ignore_eos``) through the runtime alone
(the owning backend's ``reference_token_ids``: plain ``vllm.LLM`` for the vLLM
backends) and then through edge's stage, with the plan's engine arguments and
the same runtime environment; the first engine's processes are gone before
the second starts. Token ids are compared, not text, and the first divergent
position of each prompt is recorded.

The reference may run another layout of the same model (``reference_plan``,
``edge parity --reference-tensor-parallel-size 1``): a TP 2 stage against one
device's tokens shows what splitting the layers changes. Its environment
(thread binding, visible cards) is undone before edge's stage starts.

Across nodes (``edge parity --nnodes N``) the head runs edge's stage first,
joined with the other nodes (``nodes``: their headless ranks serve that one
engine's life, and leave when it stops), then the reference on this node
alone, its environment back to what it was before the stage.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ..errors import StageError, UsageError
from ..stream import StageRequest
from .accept import PROMPTS
from .deaths import sampled_watch
from .logs import EngineLog
from .reaper import SessionReaper
from .session import Observer, SilentObserver, StageSession, prepare_stage

if TYPE_CHECKING:
    from ..plans import Plan
    from ..services.registry import Registry


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token id, the shorter length if one is a prefix, None if equal."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def layout_label(plan: Plan) -> str:
    """``TP 2``, ``TP 2 x PP 2``, or ``one device``: how a plan splits the model."""
    return str(plan.parallel.get("label")) if plan.parallel else "one device"


def run_parity(plan: Plan, registry: Registry, *, max_tokens: int, observer: Observer | None = None,
               engine_log: EngineLog | None = None, reference_plan: Plan | None = None,
               keep_log: bool = False, nodes: AbstractContextManager[Any] | None = None) -> dict[str, Any]:
    """Both runs of an admitted ``plan``; the record's ``outcome`` is ``identical`` or ``diverged``.

    The runtime alone runs ``reference_plan`` (another layout of the same
    model) when given, else ``plan`` itself. ``nodes`` (a plan across nodes:
    the other nodes, joined while edge's stage runs) puts the stage first.
    """
    said: Observer = observer or SilentObserver()
    device = plan.selected_device
    reference = reference_plan or plan
    ref_device = reference.selected_device
    assert device is not None and ref_device is not None and plan.manifest is not None
    owner = registry.owner(ref_device)
    if owner is None or "reference_token_ids" not in owner.hooks:
        raise UsageError(f"parity compares the runtime alone with edge's stage; the backend that runs "
                         f"{ref_device.device_id} ({reference.backend}) has no reference run (reference_token_ids)")
    (engine_log or EngineLog(None)).export()  # the reference run logs where edge's stage will
    node_prep = prepare_stage(registry, plan, said)
    session = StageSession(plan, registry, said, node_prep=node_prep, prepared=True, engine_log=engine_log,
                           keep_log=keep_log)
    if nodes is None:
        plain_ids, plain_info = _reference_run(registry, plan, reference, max_tokens, said)
        edge_ids = _stage_run(session, max_tokens, said)
    else:
        environ = dict(os.environ)
        with nodes:
            edge_ids = _stage_run(session, max_tokens, said)
        os.environ.clear()  # the stage's device pin and thread binding are not the reference's
        os.environ.update(environ)
        plain_ids, plain_info = _reference_run(registry, plan, reference, max_tokens, said)
    rows = []
    for prompt, ours, theirs in zip(PROMPTS, edge_ids, plain_ids):
        position = first_divergence(ours, theirs)
        rows.append({"prompt": prompt, "identical": position is None, "first_divergent_position": position,
                     "edge_tokens": len(ours), "vllm_tokens": len(theirs),
                     "edge_token_ids": ours, "vllm_token_ids": theirs})
    diverged = [row for row in rows if not row["identical"]]
    info = session.info()
    return {
        "outcome": "identical" if not diverged else "diverged",
        "model": plan.model_path,
        "artifact_id": plan.manifest.artifact_id,
        "device": device.device_id,
        "max_tokens": max_tokens,
        "engine_kwargs": dict(plan.engine_kwargs),
        "layout": layout_label(plan),
        "reference": {"layout": layout_label(reference), "device": ref_device.device_id,
                      "engine_kwargs": dict(reference.engine_kwargs)},
        "runtime_env": plain_info.get("runtime_env"),
        "node_prep": node_prep.to_dict() if node_prep is not None else None,
        "plain_vllm": plain_info,
        "edge": {"engine_start_s": round(session.start_s, 3), "stop_s": round(session.stop_s, 3),
                 "stopped": session.stop_answer, "stage": info},
        "versions": session.versions(),
        "prompts": rows,
    }


def _reference_run(registry: Registry, plan: Plan, reference: Plan, max_tokens: int,
                   said: Observer) -> tuple[list[list[int]], dict[str, Any]]:
    """The runtime alone (the owning backend's ``reference_token_ids``): each prompt's token ids, and its info."""
    ref_device = reference.selected_device
    assert ref_device is not None
    environ = dict(os.environ)
    with said.step(f"the runtime alone ({layout_label(reference)}): {len(PROMPTS)} prompts x {max_tokens} "
                   "greedy tokens"), SessionReaper() as reaper, sampled_watch(reference, reaper):  # names a death
        try:
            plain_ids, plain_info = registry.call_owner(ref_device, "reference_token_ids", plan=reference,
                                                        prompts=list(PROMPTS), max_tokens=max_tokens)
        finally:
            if reference is not plan:  # its device pin and thread binding are not the stage's
                os.environ.clear()
                os.environ.update(environ)
    if plain_info.get("leftover_pids"):
        raise StageError(f"the reference run left processes {plain_info['leftover_pids']} running; the second "
                         "engine must not start beside them")
    return plain_ids, plain_info


def _stage_run(session: StageSession, max_tokens: int, said: Observer) -> list[list[int]]:
    """Each prompt through edge's stage, greedy and ``ignore_eos``: its token ids."""
    edge_ids: list[list[int]] = []
    with session:
        for index, prompt in enumerate(PROMPTS):
            request = StageRequest(prompt=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            edge_ids.append(list(session.request(request).drain().token_ids))
            said.progress(index + 1, len(PROMPTS), "prompts through edge's stage")
    return edge_ids
