"""Eager or compiled, in edge's process or apart: how a session executes on a device, and why.

The user's ``--enforce-eager`` / ``--compile`` wins; otherwise the device's
backend answers through its optional ``execution_mode`` hook, the way vLLM's
``Platform`` carries per-platform defaults (edge-cuda plans vLLM CUDA's own
default, torch.compile with CUDA graphs; edge-cpu plans eager, with its
measurement). A backend without the hook gets the safe default: eager, which
every runtime supports and which captures nothing. How many processes the
engine runs in is the engine's rules' answer for the layout
(:meth:`~edge_core.engine.EngineRules.engine_processes`, :func:`with_processes`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from ..plans import ExecutionMode, SessionSpec

if TYPE_CHECKING:
    from ..devices import Device
    from ..engine import ProcessLayout
    from ..manifest import Manifest
    from ..services.registry import Registry

#: Why a session runs eagerly when its backend names no mode of its own.
DEFAULT_REASON = "the backend names no execution mode of its own; eager needs no compiler and captures nothing"


def execution_mode(device: Device, manifest: Manifest, session: SessionSpec,
                   registry: Registry | None, owned: bool) -> ExecutionMode:
    """The mode ``session`` runs in on ``device``: the user's flag, else the owning backend's answer, else eager."""
    if session.enforce_eager is not None:
        flag = "--enforce-eager" if session.enforce_eager else "--compile"
        return ExecutionMode(enforce_eager=session.enforce_eager, source=flag,
                             reason=f"{flag} on the command line overrides the backend's default")
    answer = registry.call_owner(device, "execution_mode", manifest=manifest, session=session) \
        if registry is not None and owned else None
    if isinstance(answer, ExecutionMode):
        return replace(answer, source="backend")
    return ExecutionMode(enforce_eager=True, source="default", reason=DEFAULT_REASON)


def with_processes(mode: ExecutionMode, layout: ProcessLayout) -> ExecutionMode:
    """``mode`` with the engine's process layout (in edge's process or apart), its reason and its environment."""
    return replace(mode, in_process=layout.in_process, processes_reason=layout.reason, env=dict(layout.env))


def with_mode(session: SessionSpec, mode: ExecutionMode | None) -> SessionSpec:
    """``session`` with ``enforce_eager`` and ``in_process`` set from ``mode`` (unchanged when there is none)."""
    return session if mode is None else replace(session, enforce_eager=mode.enforce_eager, in_process=mode.in_process)
