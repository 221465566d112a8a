"""Exceptions edge raises, and the exit codes the CLI turns them into.

A refusal is not an exception: a plan that says no is a value
(:class:`edge_core.plan.Plan` with ``refusals``). Exceptions here are for input
the user must fix (usage, unreadable artifacts) and for edge's own bugs.
"""

from __future__ import annotations

#: Exit codes (README.md, 'Exit codes').
EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_REFUSED = 2
EXIT_DIVERGED = 3
EXIT_INTERRUPTED = 130
EXIT_USAGE = 64


class EdgeError(Exception):
    """Base class: the message is for a person and names what to do."""

    exit_code = EXIT_INTERNAL


class UsageError(EdgeError):
    """The command line or an input file the user named is wrong."""

    exit_code = EXIT_USAGE


class ArtifactError(EdgeError):
    """A checkpoint or graph could not be read safely.

    ``code`` is the refusal code the planner reports (``config_unreadable`` or
    ``artifact_invalid``); ``remedy`` says what to do.
    """

    exit_code = EXIT_REFUSED

    def __init__(self, code: str, message: str, remedy: str, path: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.remedy = remedy
        self.path = path


class PluginError(EdgeError):
    """A backend misbehaved while serving a hook (not while probing: that is a status)."""


class StageError(EdgeError):
    """A running stage failed; the message names the backend and device."""


class EngineDied(StageError):
    """An engine process died (the OOM killer, a signal, an exit code); the message names it and what to do.

    ``account`` is the record behind the message (``edge_core.runtime.deaths.EngineDeaths.to_dict()``);
    ``traceback_helps`` is False when the death itself is the cause (a signal, the OOM killer), so the
    CLI does not offer the Python traceback of vLLM noticing it.
    """

    def __init__(self, message: str, account: dict[str, object] | None = None, *, traceback_helps: bool = True):
        super().__init__(message)
        self.account = dict(account or {})
        self.traceback_helps = traceback_helps


class NodeError(EdgeError):
    """The nodes of one multi-node session could not agree or stay joined; ``code`` names what happened.

    ``node_mismatch`` and ``node_join_timeout`` come before any worker starts (exit 2, like a refusal);
    ``node_lost`` and ``head_lost`` end a running session (exit 1; a head gone before the nodes agreed: 2).
    """

    def __init__(self, code: str, message: str, exit_code: int = EXIT_INTERNAL):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.exit_code = exit_code
