from __future__ import annotations

from pathlib import Path

import pytest
from fakes import GIB, V1_UNLIMITED, write_cgroup_tree

from edge_core.artifact.demo import DEMO_MODEL
from edge_core.host import HostFacts, format_cpulist, parse_cpuinfo, parse_meminfo, read_host


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


# ---------------------------------------------------------------- the memory limit that binds this process

MIB = 1 << 20


def test_a_nested_v1_limit_binds_at_the_processs_own_cgroup(host_tree):
    # As these VMs have it: the limit is on /process_api/<id>, not at the hierarchy's root.
    root = write_cgroup_tree(host_tree(mem_total=24 * GIB, mem_available=23 * GIB), 1, "/process_api/abc", {
        "/": {"limit": V1_UNLIMITED, "usage": 2 * GIB},
        "/process_api": {"limit": V1_UNLIMITED, "usage": GIB},
        "/process_api/abc": {"limit": 3000 * MIB, "usage": 500 * MIB, "file": 400 * MIB},
    })
    host = read_host(root)
    assert host.cgroup_limit_bytes == 3000 * MIB
    assert host.cgroup_usage_bytes == 100 * MIB  # usage less its file pages, which the kernel reclaims first
    assert host.cgroup_memory_path == "v1:/process_api/abc"
    assert host.usable_bytes == 2900 * MIB


def test_a_tighter_ancestor_binds_over_the_processs_own_limit(host_tree):
    root = write_cgroup_tree(host_tree(mem_available=23 * GIB), 1, "/a/b", {
        "/": {"limit": V1_UNLIMITED},
        "/a": {"limit": 2 * GIB, "usage": 1536 * MIB},
        "/a/b": {"limit": 3 * GIB, "usage": 100 * MIB},
    })
    host = read_host(root)
    assert (host.cgroup_limit_bytes, host.cgroup_memory_path) == (2 * GIB, "v1:/a")
    assert host.usable_bytes == 512 * MIB


def test_v1s_hierarchical_limit_catches_an_ancestor_above_the_mount(host_tree):
    # A container sees its own cgroup as the mount's root; the host's limit above it shows only in memory.stat.
    root = write_cgroup_tree(host_tree(mem_available=23 * GIB), 1, "/pod/app",
                             {"/pod/app": {"limit": V1_UNLIMITED, "usage": 300 * MIB, "file": 100 * MIB}},
                             mount_root="/pod/app", hierarchical=GIB)
    host = read_host(root)
    assert host.cgroup_limit_bytes == GIB and host.usable_bytes == GIB - 200 * MIB
    assert host.cgroup_memory_path.startswith("v1:/pod/app") and "hierarchical_memory_limit" in host.cgroup_memory_path


def test_a_nested_v2_limit_on_an_ancestor_binds(host_tree):
    root = write_cgroup_tree(host_tree(mem_available=23 * GIB), 2, "/user.slice/session/app", {
        "/": {},
        "/user.slice": {"limit": 4 * GIB, "usage": 1 * GIB, "file": 512 * MIB},
        "/user.slice/session": {"limit": "max", "usage": 900 * MIB},
        "/user.slice/session/app": {"limit": "max", "usage": 800 * MIB},
    })
    host = read_host(root)
    assert (host.cgroup_limit_bytes, host.cgroup_memory_path) == (4 * GIB, "v2:/user.slice")
    assert host.cgroup_usage_bytes == 512 * MIB and host.usable_bytes == 4 * GIB - 512 * MIB


@pytest.mark.parametrize("version", [1, 2])
def test_no_limit_anywhere_is_no_limit(host_tree, version):
    none = V1_UNLIMITED if version == 1 else "max"
    root = write_cgroup_tree(host_tree(mem_available=23 * GIB), version, "/a/b",
                             {"/": {"limit": none}, "/a": {"limit": none}, "/a/b": {"limit": none, "usage": GIB}})
    host = read_host(root)
    assert host.cgroup_limit_bytes is None and host.cgroup_memory_path is None and host.usable_bytes == 23 * GIB


def test_a_v1_tree_without_a_mount_table_is_read_at_the_usual_place(host_tree):
    root = write_cgroup_tree(host_tree(mem_available=23 * GIB), 1, "/x",
                             {"/": {"limit": V1_UNLIMITED}, "/x": {"limit": GIB, "usage": 0}}, mountinfo=False)
    assert read_host(root).cgroup_limit_bytes == GIB


def test_a_refusal_under_a_cgroup_limit_names_it_and_its_path(host_tree):
    from edge_core import Device
    from edge_core.plans import SessionSpec
    from edge_core.runtime.admission import make_plan

    root = write_cgroup_tree(host_tree(mem_total=24 * GIB, mem_available=23 * GIB), 1, "/process_api/abc", {
        "/": {"limit": V1_UNLIMITED}, "/process_api": {"limit": V1_UNLIMITED},
        "/process_api/abc": {"limit": 32 * MIB, "usage": 16 * MIB}})
    cpu = Device(device_id="cpu", kind="cpu", vendor="x", name="x", backend="vllm:cpu", runnable=True,
                 memory_pool="host_ram", memory_bytes=24 * GIB, weight_formats=("dense",), evidence={"found": "D"},
                 extras={"kv_block_size": 128})
    plan = make_plan(str(DEMO_MODEL), session=SessionSpec(), devices=[cpu], host=read_host(root),
                     registry=None)
    [refusal] = plan.refusals
    # tiny-llama without a backend: 17 MiB held (KV, activations, weights) + 5%; no external reserve, the host's
    # 23 GiB available lying beyond the cgroup's 16 MiB of room.
    assert refusal.code == "budget_exceeds_device" and refusal.details["capacity_bytes"] == 16 * MIB
    assert "cgroup memory limit 32 MiB of v1:/process_api/abc" in refusal.message


@pytest.mark.parametrize(("available", "room", "reserve"), [
    (23 * GIB, 2 * GIB, 0),  # the cgroup binds, the host has far more: others grow outside its room first
    (2 * GIB + 100 * MIB, 2 * GIB, 412 * MIB),  # 100 MiB beyond the room: the rest of the 512 MiB is kept
    (2 * GIB, 3 * GIB, 512 * MIB),  # host RAM binds, not the cgroup: the whole reserve
])
def test_the_external_reserve_is_what_host_ram_beyond_a_binding_cgroup_does_not_already_leave(
        available, room, reserve):
    from edge_core.plan.terms import HOST_EXTERNAL_RESERVE_BYTES, host_reserve_bytes

    host = HostFacts(system="linux", mem_total_bytes=24 * GIB, mem_available_bytes=available,
                     cgroup_limit_bytes=room + 64 * MIB, cgroup_usage_bytes=64 * MIB, logical_cores=2,
                     physical_cores=2, cpu_model="x", machine="x86_64")
    assert HOST_EXTERNAL_RESERVE_BYTES == 512 * MIB
    assert host_reserve_bytes(host)[0] == reserve


# ---------------------------------------------------------------- the same, under a real cgroup on this host


def _child_cgroup(limit: int) -> Path:
    """A child of this process's v1 memory cgroup with ``limit``; skips where one cannot be made here."""
    import os

    if os.geteuid() != 0:
        pytest.skip("making a child memory cgroup needs root")
    own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "memory" in line.split(":")[1].split(",")), None)
    base = Path("/sys/fs/cgroup/memory") / (own or "/").lstrip("/")
    if own is None or not (base / "memory.limit_in_bytes").is_file():
        pytest.skip("no cgroup v1 memory controller for this process (this test makes a v1 child cgroup)")
    child = base / f"edge-test-{os.getpid()}"
    try:
        child.mkdir()
        (child / "memory.limit_in_bytes").write_text(str(limit))
    except OSError as exc:
        if child.is_dir():
            child.rmdir()
        pytest.skip(f"cannot make a child memory cgroup under {base}: {exc.strerror}")
    return child


@pytest.mark.parametrize("command", ["plan", "run"])
def test_under_a_real_nested_limit_edge_refuses_before_loading(command):
    import subprocess
    import sys

    pytest.importorskip("edge_cpu", reason="the CPU backend's device reads the cgroup limit; edge-cpu is not "
                                           "installed in this interpreter")

    limit = 400 * MIB  # below the runtime alone (vLLM and torch in one process: ~666 MiB), let alone tiny-llama
    child = _child_cgroup(limit)
    try:
        # The child enters the cgroup itself, then becomes edge: everything edge reads is its own cgroup's.
        proc = subprocess.run(
            ["sh", "-c", 'echo $$ > "$1/cgroup.procs" && shift && exec "$@"', "sh", str(child),
             sys.executable, "-m", "edge_core", command, "--model", str(DEMO_MODEL), "--prompt", "hi"][
                : None if command == "run" else -2],
            capture_output=True, text=True, timeout=120)
    finally:
        child.rmdir()
    assert proc.returncode == 2, proc.stdout + proc.stderr
    path = "v1:" + "/" + str(child.relative_to("/sys/fs/cgroup/memory"))
    assert f"cgroup memory limit 400 MiB of {path}" in proc.stdout, proc.stdout
    assert "nothing loaded" in proc.stdout or command == "run"
    assert "loading" not in proc.stderr  # refused before any engine start
