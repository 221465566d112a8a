"""What serving adds to a vLLM CPU plan (edge_cpu/_memory.py, ``served_reservations``), and only to a served one.

Issue 37's ten-minute soak read every sample above the plan: the plan counted
the engine and its pool, not the requests the server held open nor the
worker's matmul primitives for the many batch sizes a server runs. A served
plan reserves both; ``edge run`` and ``edge chat`` plans stay as they were.
"""

from __future__ import annotations

import pytest

from edge_core.artifact import DEMO_MODEL
from edge_core.host import HostFacts
from edge_core.plans import SessionSpec
from edge_cpu import _memory

GIB = 1 << 30
CONTEXT = 256


def plan(registry, **session):
    from edge_core.runtime.admission import make_plan

    host = HostFacts(system="linux", mem_total_bytes=24 * GIB, mem_available_bytes=20 * GIB,
                     cgroup_limit_bytes=None, cgroup_usage_bytes=None, logical_cores=2, physical_cores=2,
                     cpu_model="x", machine="x86_64", isa_flags=("avx2", "avx512f", "avx512_bf16"), numa_nodes=())
    made = make_plan(str(DEMO_MODEL), session=SessionSpec(max_model_len=CONTEXT, max_num_seqs=8, **session),
                     host=host, devices=registry.probe(host), registry=registry)
    assert made.admitted, [r.message for r in made.refusals]
    return made


def terms(made) -> dict:
    return {t.purpose: t for t in made.reservations}


def test_a_served_plan_reserves_its_open_connections_in_proportion_to_the_cap(cpu_registry):
    small, large = plan(cpu_registry, served=True, max_connections=16), plan(cpu_registry, served=True,
                                                                             max_connections=64)
    each = _memory.CONNECTION_BYTES + CONTEXT * _memory.CONNECTION_TOKEN_BYTES  # a prompt of the whole context
    a, b = terms(small)["open_connections"], terms(large)["open_connections"]
    assert (a.bytes, b.bytes) == (16 * each, 64 * each)
    assert a.evidence == "E" and a.pool == "host_ram" and not a.headroom and not a.reclaimable
    assert "--max-connections" in a.note and "measured" in a.note
    # The connections are usage the tree shows: the forecast grows by exactly the 48 more, nothing else moves.
    assert large.peak.predicted_bytes - small.peak.predicted_bytes == 48 * each
    others = {p: t.bytes for p, t in terms(small).items() if p not in ("open_connections", "safety_margin")}
    assert others == {p: t.bytes for p, t in terms(large).items() if p not in ("open_connections", "safety_margin")}
    assert small.session.max_connections == 16 and small.to_dict()["session"]["max_connections"] == 16


def test_a_served_plan_reserves_the_workers_matmul_primitives_once_per_worker(cpu_registry):
    served = terms(plan(cpu_registry, served=True, max_connections=16))
    assert served["gemm_primitives"].bytes == _memory.GEMM_PRIMITIVES_BYTES
    assert served["gemm_primitives"].lifetime == "session" and served["gemm_primitives"].evidence == "E"
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY=0" in served["gemm_primitives"].note
    two = {t.purpose: t for t in _memory.served_reservations(SessionSpec(served=True, max_connections=4), ranks=2)}
    assert two["gemm_primitives"].bytes == 2 * _memory.GEMM_PRIMITIVES_BYTES


@pytest.mark.parametrize("session", [{}, {"max_connections": 64}])
def test_a_plan_that_is_not_served_has_no_serving_terms_whatever_it_is_given(cpu_registry, session):
    run = plan(cpu_registry, **session)
    assert not {"open_connections", "gemm_primitives"} & set(terms(run))
    assert [t.to_dict() for t in run.reservations] == [t.to_dict() for t in plan(cpu_registry).reservations]


def test_serving_terms_follow_the_served_session_alone():
    assert _memory.served_reservations(SessionSpec()) == []
    assert _memory.served_reservations(SessionSpec(max_connections=8)) == []
    # Served without a cap (a headless node, or a caller that gives none): the worker's primitives, no connections.
    assert [t.purpose for t in _memory.served_reservations(SessionSpec(served=True))] == ["gemm_primitives"]
