"""Where is the Hub and how long may it take? The environment a Hub id is resolved under."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..errors import UsageError

__all__ = ["DEFAULT_TIMEOUT_S", "REF_TTL_S", "HubSettings"]

#: Seconds the Hub may take to answer all one decision asks (info, small files, every header) before edge gives up:
#: a total (huggingface_hub retries a timed-out request), from the first request, ``EDGE_HUB_TIMEOUT`` overrides it.
#: vLLM takes over a minute to fail on an unreachable Hub (docs/benchmarks.md#models-by-hub-id-issue-12).
DEFAULT_TIMEOUT_S = 10.0
#: Seconds a branch's commit, once resolved, is used without asking the Hub again (``EDGE_HUB_REF_TTL``):
#: the next plan of the same revision is then offline and as fast as a local one. A commit id never expires.
REF_TTL_S = 3600.0


@dataclass(frozen=True)
class HubSettings:
    """The Hub environment, read when a Hub id is resolved (huggingface_hub reads it once, at import)."""

    endpoint: str
    cache_dir: Path
    edge_cache: Path
    offline: bool
    timeout_s: float
    ref_ttl_s: float = REF_TTL_S

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HubSettings:
        env = os.environ if environ is None else environ
        home = Path(env.get("HOME") or Path.home())
        xdg = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else home / ".cache"
        hf_home = Path(env["HF_HOME"]) if env.get("HF_HOME") else xdg / "huggingface"
        cache = Path(env["HF_HUB_CACHE"]) if env.get("HF_HUB_CACHE") else hf_home / "hub"
        offline = (env.get("HF_HUB_OFFLINE") or env.get("TRANSFORMERS_OFFLINE") or "").strip().lower()
        seconds = {}
        for name, default in (("EDGE_HUB_TIMEOUT", DEFAULT_TIMEOUT_S), ("EDGE_HUB_REF_TTL", REF_TTL_S)):
            try:
                seconds[name] = float(env.get(name) or default)
            except ValueError:
                raise UsageError(f"{name}={env.get(name)!r} is not a number of seconds") from None
        return cls(endpoint=(env.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/"), cache_dir=cache,
                   edge_cache=xdg / "edge" / "hub", offline=offline in ("1", "on", "yes", "true"),
                   timeout_s=max(seconds["EDGE_HUB_TIMEOUT"], 0.1), ref_ttl_s=seconds["EDGE_HUB_REF_TTL"])
