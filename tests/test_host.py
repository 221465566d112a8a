from __future__ import annotations

import pytest
from fakes import GIB

from edge_core.host import format_cpulist, parse_cpuinfo, parse_meminfo, read_host


def test_reads_memory_cores_and_flags_from_the_tree(host_tree):
    host = read_host(host_tree(mem_total=64 * GIB, mem_available=50 * GIB, cores=8,
                               flags="fpu avx2 avx512f amx_tile amx_bf16"))
    assert host.mem_total_bytes == 64 * GIB
    assert host.mem_available_bytes == 50 * GIB
    assert host.logical_cores == 8 and host.physical_cores == 8
    assert host.isa_flags == ("avx2", "avx512f", "amx_tile", "amx_bf16")
    assert host.cgroup_limit_bytes is None
    assert host.usable_bytes == 50 * GIB


def test_cgroup_v2_limit_clamps_capacity_and_available(host_tree):
    host = read_host(host_tree(mem_total=64 * GIB, mem_available=50 * GIB,
                               cgroup_v2_limit=16 * GIB, cgroup_v2_usage=4 * GIB))
    assert host.cgroup_limit_bytes == 16 * GIB
    assert host.capacity_bytes == 16 * GIB
    assert host.usable_bytes == 12 * GIB


def test_cgroup_max_means_no_limit(host_tree):
    host = read_host(host_tree(cgroup_v2_limit="max"))
    assert host.cgroup_limit_bytes is None


def test_numa_nodes_use_vllms_reclaimable_sum(host_tree):
    root = host_tree(nodes=[
        {"total": 16 * GIB, "free": 10 * GIB, "active_file": 1 * GIB, "inactive_file": 2 * GIB,
         "sreclaimable": GIB // 2, "cpus": 2},
        {"total": 16 * GIB, "free": 3 * GIB, "cpus": 2},
    ])
    host = read_host(root)
    assert [n.node_id for n in host.numa_nodes] == [0, 1]
    assert host.numa_nodes[0].reclaimable_bytes == 10 * GIB + 3 * GIB + GIB // 2
    assert host.numa_nodes[1].reclaimable_bytes == 3 * GIB
    assert host.numa_nodes[0].cpus == (0, 1) and host.numa_nodes[1].cpus == (2, 3)


def test_wsl_is_recognised_from_osrelease(host_tree):
    assert read_host(host_tree(osrelease="5.15.153.1-microsoft-standard-WSL2")).is_wsl
    assert not read_host(host_tree()).is_wsl


def test_parsers_tolerate_garbage():
    assert parse_meminfo("nonsense\n\x00\nMemTotal: x kB") == {}
    model, flags, logical, physical = parse_cpuinfo("garbage without colons\n")
    assert (model, flags, logical) == ("", (), 0)


def test_host_facts_round_trip_through_json(host_tree):
    from edge_core.host import HostFacts

    host = read_host(host_tree(nodes=[{"total": 8 * GIB, "free": 4 * GIB, "cpus": 4}]))
    again = HostFacts.from_dict(host.to_dict())
    assert again.numa_nodes == host.numa_nodes
    assert again.usable_bytes == host.usable_bytes



@pytest.mark.parametrize(("cpus", "text"), [
    ((0,), "0"), ((0, 1), "0-1"), ((3, 0, 1, 2, 8), "0-3,8"), ((1, 3, 5), "1,3,5"),
])
def test_a_cpu_set_is_written_in_the_kernels_list_form_and_read_back(cpus, text, host_tree):
    # The form taskset -c and VLLM_CPU_OMP_THREADS_BIND take; read_host reads the same form back.
    assert format_cpulist(cpus) == text
    assert read_host(host_tree(cores=16, allowed_cpus=text)).allowed_cpus == tuple(sorted(cpus))
