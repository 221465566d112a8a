"""Is this vLLM process one that edge started? edge-cpu's vLLM plugins act only there.

vLLM loads every ``vllm.general_plugins`` entry point of the venv in every
process it starts, a user's own ``vllm serve`` included. edge-cpu's plugins
(the heap trim, the packing levers, the eager pipeline buffers, the plain
parameters: :mod:`._heap`, :mod:`._packing`, :mod:`._pp`, :mod:`._params`) change what the engine holds and computes, so
each one first asks :func:`in_edge_engine`: the variable :data:`ENGINE_ENV`,
which edge sets to ``1`` in the environment of the engines it starts (its
stage, ``edge serve``'s server, a node's headless ranks:
``edge_core.runtime.env.ENGINE_MARK``) and removes for plain vLLM (``edge
parity``'s reference). Plain vLLM in the same venv is left as vLLM made it
unless its user sets the variable too (plugins/edge_cpu/README.md). The
per-lever switches (``EDGE_CPU_ONE_TABLE`` ...) are read only under it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

#: Set to ``1`` by edge in every engine it starts (the same name as ``edge_core.runtime.env.ENGINE_MARK``).
ENGINE_ENV = "EDGE_ENGINE"


def in_edge_engine(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process belongs to an engine edge started (or a user opted in): :data:`ENGINE_ENV` is ``1``."""
    return (os.environ if environ is None else environ).get(ENGINE_ENV, "").strip() == "1"
