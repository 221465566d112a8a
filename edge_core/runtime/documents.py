"""What every JSON document edge writes starts with: its ``schema`` name and ``schema_version`` (docs/json.md).

A ``--json`` output and an ``/edge/*`` answer of ``edge serve`` are the same
kind of document, so both take their envelope from here.
"""

from __future__ import annotations

from typing import Any

#: Bumped when a JSON document changes incompatibly; each document carries it.
#: 2: the plan's admission total is ``admission_bytes`` (was ``peak_bytes``).
#: 3: the KV cache is one pool (``kv.pool``, ``session.kv_cache_memory_bytes``, ``max_model_len_auto``), and the
#: admission is the held peak + headroom (``peak.held_*``; file pages are ``reclaimable``).
SCHEMA_VERSION = 3


def enveloped(kind: str, document: dict[str, Any]) -> dict[str, Any]:
    """``document`` as the ``edge.<kind>`` document: ``schema`` and ``schema_version`` first."""
    return {"schema": f"edge.{kind}", "schema_version": SCHEMA_VERSION, **document}
