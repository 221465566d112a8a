"""Only what must be held is admitted against: vLLM CPU's file mapping shows in tree PSS, not in the admission.

Issue 36 measured a Llama-3.2-1B geometry (tied, bf16) at 4,096 tokens: the admission counted the checkpoint's
file pages (``weights_file_mapping``, as large as the weights) and made the load path dominate; plain vLLM and
edge's engine both ran under far less. The mapping is clean page cache the kernel reclaims under a limit.
"""

from __future__ import annotations

import pytest

from edge_core.host import HostFacts
from edge_core.plans import SessionSpec

GIB = 1 << 30


@pytest.fixture(scope="module")
def llama1b(tmp_path_factory):
    factories = pytest.importorskip("factories", reason="the checkout's tests/factories.py is not here")
    config = pytest.importorskip("reference_set").LLAMA_32_1B_INSTRUCT
    root = tmp_path_factory.mktemp("llama-3.2-1b")
    factories.write_checkpoint(root, dict(config), factories.llama_like_tensors(config))
    return root


def host(available: int) -> HostFacts:
    return HostFacts(system="linux", mem_total_bytes=24 * GIB, mem_available_bytes=available,
                     cgroup_limit_bytes=None, cgroup_usage_bytes=None, logical_cores=2, physical_cores=2,
                     cpu_model="x", machine="x86_64", isa_flags=("avx2", "avx512f", "avx512_bf16"), numa_nodes=())


def test_the_file_mapping_is_shown_and_not_admitted_against(cpu_registry, llama1b):
    from edge_core.runtime.admission import make_plan

    plan = make_plan(str(llama1b), session=SessionSpec(max_model_len=4096), host=host(20 * GIB),
                     devices=cpu_registry.probe(host(20 * GIB)), registry=cpu_registry)
    assert plan.admitted, [r.message for r in plan.refusals]
    terms = {t.purpose: t for t in plan.reservations}
    mapping = terms["weights_file_mapping"]
    assert mapping.reclaimable and mapping.lifetime == "load"
    # One shard: the whole file (its header too) mapped while the weights are read.
    assert terms["weights"].bytes <= mapping.bytes < terms["weights"].bytes + (1 << 20)
    held = [t for t in plan.reservations if not t.headroom and not t.reclaimable]
    steady = sum(t.bytes for t in held if t.lifetime != "load")
    headroom = sum(t.bytes for t in plan.reservations if t.headroom)
    # Steady state dominates what must be held; the admission is it plus headroom, the mapping nowhere in it.
    assert plan.peak.held_bytes == steady == plan.peak.held_steady_state_bytes
    assert plan.peak.admission_bytes == steady + headroom
    # The prediction the tree PSS is checked against still sees the mapping while the weights are read.
    assert plan.peak.load_path_bytes >= terms["weights"].bytes + mapping.bytes
    assert plan.peak.predicted_bytes >= plan.peak.held_bytes


def test_a_host_that_holds_the_held_peak_but_not_the_file_pages_admits(cpu_registry, llama1b):
    from edge_core.runtime.admission import make_plan

    first = make_plan(str(llama1b), session=SessionSpec(max_model_len=4096), host=host(20 * GIB),
                      devices=cpu_registry.probe(host(20 * GIB)), registry=cpu_registry)
    tight = first.peak.admission_bytes + (64 << 20)
    assert first.peak.predicted_bytes + first.peak.headroom_bytes > tight or first.peak.reclaimable_bytes == 0
    plan = make_plan(str(llama1b), session=SessionSpec(max_model_len=4096), host=host(tight),
                     devices=cpu_registry.probe(host(tight)), registry=cpu_registry)
    assert plan.admitted, [r.message for r in plan.refusals]


def test_the_largest_pool_is_cut_to_the_numa_node_vllm_checks_it_against(cpu_registry, tmp_path):
    # 256 sequences of 8,192 tokens would take 45 GiB; the host has 28 GiB available but vLLM CPU checks the pool
    # against node 0 (4 GiB reclaimable): the pool is the largest that passes that gate too, not a refusal.
    from edge_core.host import NumaNode
    from edge_core.runtime.admission import make_plan

    factories = pytest.importorskip("factories", reason="the checkout's tests/factories.py is not here")
    config = factories.KNOWN_CONFIGS["HuggingFaceTB/SmolLM2-135M-Instruct"]
    factories.write_checkpoint(tmp_path, dict(config), factories.llama_like_tensors(config))
    nodes = (NumaNode(0, 16 * GIB, 4 * GIB, (0, 1)), NumaNode(1, 16 * GIB, 15 * GIB, (2, 3)))
    facts = HostFacts(system="linux", mem_total_bytes=32 * GIB, mem_available_bytes=28 * GIB,
                      cgroup_limit_bytes=None, cgroup_usage_bytes=None, logical_cores=4, physical_cores=4,
                      cpu_model="x", machine="x86_64", isa_flags=("avx2", "avx512f", "avx512_bf16"), numa_nodes=nodes)
    plan = make_plan(str(tmp_path), session=SessionSpec(max_model_len=8192, max_num_seqs=256), host=facts,
                     devices=cpu_registry.probe(facts), registry=cpu_registry)
    assert plan.admitted, [r.message for r in plan.refusals]
    block = factories.vllm_block_bytes(config, 128)
    pool = plan.kv.pool
    assert pool.source == "fit" and pool.bytes <= 4 * GIB < pool.bytes + block  # one block more: over the node
    assert pool.full_length_sequences == (pool.bytes // block - 1) // 64
