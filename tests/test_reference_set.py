"""edge's plans of the reference set against what vLLM CPU itself did with the same checkpoints (issue 10).

``tests/data/vllm_cpu_reference.json`` was written by
``scripts/reference_vllm_cpu.py``: vLLM CPU started on each cut copy with
dummy weights, 16 greedy tokens, its allocator's minimum KV pool read while
it started. Here edge plans the same cut copies with the same limits, on the
device list that host reported, and must agree:

- vLLM ran it: edge admits it, and hands vLLM a ``kv_cache_memory_bytes`` at
  least vLLM's minimum and within 1% of it;
- vLLM failed: edge refuses, for a reason other than memory;
- the published checkpoint (full size, its own context): admitted, or refused
  only for memory this host lacks, when vLLM ran the cut copy; refused for the
  same reason as the cut copy when it did not.

One exception, decided and documented in edge-cpu (``_schemes.py``): a scheme
vLLM runs only on a fallback kernel is refused as too slow. The reference must
show it: the entry's 16 tokens took at least :data:`SLOW_FACTOR` times as long as
those of the fastest entry of the same geometry.

The comparison needs edge-cpu and the vLLM build the file was recorded with;
it is skipped elsewhere. Plan times are a benchmark (bench/reference_plans.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from reference_set import BY_NAME, CLASSES, ENTRIES, cut_config, session_for, write_cut, write_published

pytest.importorskip("edge_cpu")

from edge_core import builds  # noqa: E402
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import load_devices, make_plan
from edge_core.services.registry import Registry  # noqa: E402

REFERENCE_FILE = Path(__file__).resolve().parent / "data" / "vllm_cpu_reference.json"
REFERENCE: dict[str, Any] = json.loads(REFERENCE_FILE.read_text())
RECORDED = REFERENCE["provenance"]

#: Refusals that mean "this host lacks the memory", the only ones allowed where vLLM ran the model.
MEMORY_CODES = frozenset({"budget_exceeds_device"})
#: The KV pool edge hands vLLM may exceed vLLM's minimum by at most this share.
KV_TOLERANCE = 0.01
#: How much slower than its fastest same-geometry sibling a run must be for a speed refusal to agree.
SLOW_FACTOR = 10.0

pytestmark = pytest.mark.skipif(
    builds.installed_version("vllm-cpu") != RECORDED["vllm"],
    reason=f"the reference was recorded with vllm-cpu {RECORDED['vllm']}")


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    """edge's planner as this interpreter has it, on the devices the recording host reported."""
    path = tmp_path_factory.mktemp("devices") / "devices.json"
    path.write_text(json.dumps(RECORDED["host_devices"]))
    registry = Registry()
    host, devices = load_devices(str(path), registry)

    def plan(model: Path, **session: Any):
        return make_plan(str(model), session=SessionSpec(**session), devices=devices, host=host, registry=registry,
                         devices_source=f"file:{path}")

    plan.devices_path = path  # type: ignore[attr-defined]
    return plan


def _geometry(name: str) -> str:
    config = cut_config(BY_NAME[name])
    config.pop("quantization_config", None)
    return json.dumps(config, sort_keys=True)


def _slow_for_its_geometry(name: str) -> bool:
    """True when this run took SLOW_FACTOR x as long as the fastest run of the same geometry."""
    siblings = [n for n in BY_NAME if _geometry(n) == _geometry(name) and REFERENCE["entries"][n]["ran"]]
    fastest = min(REFERENCE["entries"][n]["generate_s"] for n in siblings)
    return REFERENCE["entries"][name]["generate_s"] >= SLOW_FACTOR * fastest


def _codes(plan) -> set[str]:
    return {r.code for r in plan.refusals}


def test_the_set_is_complete_and_every_class_has_entries():
    assert len(ENTRIES) >= 20
    assert set(REFERENCE["entries"]) == set(BY_NAME), "re-run scripts/reference_vllm_cpu.py for new entries"
    for cls in CLASSES:
        assert any(cls in e.classes for e in ENTRIES), cls
    assert {c for e in ENTRIES for c in e.classes} <= set(CLASSES)
    # Each run is vLLM's: it generated its tokens, or says why not.
    for name, ref in REFERENCE["entries"].items():
        assert (ref["ran"] and ref["tokens"] == 16 and ref["minimum_kv_bytes"] > 0) or (
            not ref["ran"] and ref["error"]), name


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_cut_copy_verdict_and_kv_pool_match_vllm(name, tmp_path, planner):
    entry, ref = BY_NAME[name], REFERENCE["entries"][name]
    plan = planner(write_cut(entry, tmp_path / "cut"), **session_for(entry))
    if not ref["ran"]:
        assert not plan.admitted, f"vLLM failed ({ref['error'][:200]}) but edge admits it"
        assert _codes(plan) and not _codes(plan) & MEMORY_CODES, plan.refusals
        return
    if not plan.admitted and _codes(plan) == {"kernel_unsupported"} and any(
            "measured_seconds" in r.details for r in plan.refusals):
        assert _slow_for_its_geometry(name), "edge refuses as too slow a scheme that ran at normal speed"
        return
    assert plan.admitted, [r.to_dict() for r in plan.refusals]
    minimum, pool = ref["minimum_kv_bytes"], plan.engine_kwargs["kv_cache_memory_bytes"]
    assert minimum <= pool <= minimum * (1 + KV_TOLERANCE), (pool, minimum, pool / minimum)


@pytest.mark.parametrize("name", sorted(BY_NAME))
def test_published_checkpoint_verdict_agrees(name, tmp_path, planner):
    entry, ref = BY_NAME[name], REFERENCE["entries"][name]
    cut = planner(write_cut(entry, tmp_path / "cut"), **session_for(entry))
    published = write_published(entry, tmp_path / "published")
    # The published checkpoint at its own context, as a user asks for it: through the CLI.
    proc = subprocess.run([sys.executable, "-m", "edge_core", "plan", "--model", str(published), "--devices",
                           str(planner.devices_path), "--json"], capture_output=True, text=True)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 2), proc.stderr
    doc = json.loads(proc.stdout)
    codes = {r["code"] for r in doc["refusals"]}
    if ref["ran"] and cut.admitted:
        assert doc["admitted"] or codes <= MEMORY_CODES, doc["refusals"]
    else:
        assert not doc["admitted"]
        assert codes - MEMORY_CODES == _codes(cut), (codes, _codes(cut))
