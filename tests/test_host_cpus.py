"""The cores this process may use — affinity mask and cgroup quota, read under a fake root — and the vLLM CPU
bind list and rank capacity the planner derives from them."""

from __future__ import annotations

from fakes import GIB, write_host_tree

from edge_core.devices import Device
from edge_core.engines.vllm_launch import cpu_bind_list
from edge_core.host import HostFacts, read_host
from edge_core.plan.parallel import rank_capacity

TWO_NODES = [{"total": 16 * GIB, "free": 8 * GIB, "cpus": 4}, {"total": 16 * GIB, "free": 8 * GIB, "cpus": 4}]


def test_the_affinity_mask_is_what_taskset_left(host_tree):
    host = read_host(host_tree(cores=8, nodes=TWO_NODES, allowed_cpus="1,5-6"))
    assert host.allowed_cpus == (1, 5, 6)
    assert host.usable_cpus == (1, 5, 6) and host.usable_cores == 3
    # Each node keeps only its allowed CPUs: vLLM binds ranks by these (get_allowed_cpu_list).
    assert [(n.node_id, n.cpus) for n in host.allowed_nodes()] == [(0, (1,)), (1, (5, 6))]


def test_without_a_mask_every_cpu_of_the_host_counts(host_tree):
    host = read_host(host_tree(cores=4, nodes=[{"total": 8 * GIB, "free": 4 * GIB, "cpus": 4}]))
    assert host.allowed_cpus == ()  # a fake root has no mask unless it writes one
    assert host.usable_cpus == (0, 1, 2, 3) and host.usable_cores == 4


def test_a_cgroup_quota_caps_the_cores(host_tree):
    host = read_host(host_tree(cores=8, allowed_cpus="0-7", cpu_max="250000 100000"))
    assert host.cpu_quota_cores == 2.5
    assert host.usable_cores == 2  # two and a half cores keep two ranks busy, not three
    assert read_host(host_tree(cores=8, cpu_max="max 100000")).cpu_quota_cores is None
    assert read_host(host_tree(cores=8, allowed_cpus="0-7", cpu_max="50000 100000")).usable_cores == 1


def test_the_cpu_facts_survive_a_device_list(host_tree):
    host = read_host(host_tree(cores=8, allowed_cpus="2-3", cpu_max="150000 100000"))
    again = HostFacts.from_dict(host.to_dict())
    assert again.allowed_cpus == (2, 3) and again.cpu_quota_cores == 1.5 and again.usable_cores == 1
    assert host.to_dict()["usable_cores"] == 1


def test_the_real_hosts_mask_is_this_processs_affinity():
    import os

    assert set(read_host().usable_cpus) == os.sched_getaffinity(0)


def test_the_bind_list_uses_only_allowed_cpus(tmp_path):
    host = read_host(write_host_tree(tmp_path / "a", cores=8, nodes=TWO_NODES, allowed_cpus="1,5-6"))
    assert cpu_bind_list(host, 2) == "1|5-6"  # a node each, as many as it allows
    assert cpu_bind_list(host, 3) == "1|5|6"  # fewer nodes than ranks: the allowed CPUs cut in runs
    assert cpu_bind_list(host, 4) is None  # more ranks than cores: no list (edge-cpu refuses the layout)
    one_node = read_host(write_host_tree(tmp_path / "b", cores=2, nodes=[{"total": 8 * GIB, "free": 4 * GIB,
                                                                           "cpus": 2}]))
    assert cpu_bind_list(one_node, 2) == "0|1" and cpu_bind_list(one_node, 1) == "0-1"


def test_a_quota_shortens_each_ranks_run(host_tree):
    host = read_host(host_tree(cores=8, allowed_cpus="0-7", cpu_max="200000 100000"))
    assert cpu_bind_list(host, 2) == "0|1"
    assert cpu_bind_list(host, 3) is None


def _cpu(host: str | None = None) -> Device:
    extras = {"parallel": "vllm", **({"host": host} if host else {})}
    return Device(device_id=f"{host}/cpu" if host else "cpu", kind="cpu", vendor="amd", name="cpu",
                  backend="vllm:cpu", runnable=True, memory_pool="host_ram", memory_bytes=8 * GIB, extras=extras)


def test_rank_capacity_is_usable_cores_on_cpu_and_devices_elsewhere(host_tree):
    host = read_host(host_tree(cores=8, allowed_cpus="0-2"))
    assert rank_capacity({"local": [_cpu()]}, {"local": host}) == 3
    assert rank_capacity({"a": [_cpu("a")], "b": [_cpu("b")]}, {"a": host, "b": host}) == 6
    assert rank_capacity({"local": [_cpu()]}, {}) is None
    gpus = [Device(device_id=f"cuda:{i}", kind="gpu_discrete", vendor="nvidia", name="H100", backend="vllm:cuda",
                   runnable=True, memory_pool="vram", memory_bytes=80 * GIB) for i in range(4)]
    assert rank_capacity({"local": gpus}, {"local": host}) == 4
