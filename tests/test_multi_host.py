"""Devices renamed for a plan across hosts, and the commands that bring such a plan up on each node."""

from __future__ import annotations

from edge_core.devices import Device
from edge_core.engines.vllm_launch import node_commands
from edge_core.layout import Layout


def _device(device_id: str, host: str | None = None) -> Device:
    return Device(device_id=device_id, kind="cpu", vendor="amd", name="cpu", backend="vllm:cpu", runnable=True,
                  memory_pool="host_ram", memory_bytes=1 << 30, extras={"host": host} if host else {})


def test_local_id_is_the_id_before_the_host_prefix():
    assert _device("node-a/cpu", "node-a").local_id == "cpu"
    assert _device("cpu").local_id == "cpu"
    # Only the prefix its own host label put there comes off.
    assert _device("other/cpu", "node-a").local_id == "other/cpu"
    assert _device("node-a/cuda:1", "node-a").replace(device_id="node-a/cuda:1").local_id == "cuda:1"


def test_each_node_gets_its_vllm_command_and_its_ranks():
    kwargs = {"max_model_len": 2048, "enforce_eager": True, "kv_cache_memory_bytes": 1024}
    env = {"a": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, "b": {"VLLM_CPU_OMP_THREADS_BIND": "4|5"}}
    commands = node_commands(["a", "b"], "/m", Layout(tp=2, pp=2, hosts=2), [], kwargs, env)
    assert [(c["host"], c["node_rank"], c["ranks"]) for c in commands] == [("a", 0, [0, 1]), ("b", 1, [2, 3])]
    assert commands[0]["command"] == (
        "VLLM_CPU_OMP_THREADS_BIND=0|1 vllm serve /m --max-model-len 2048 --enforce-eager "
        "--kv-cache-memory-bytes 1024 --tensor-parallel-size 2 --pipeline-parallel-size 2 "
        "--distributed-executor-backend mp --nnodes 2 --node-rank 0 --master-addr a --master-port 29501")
    # Past node 0 a node runs its ranks headless, bound by its own cores.
    assert commands[1]["command"].startswith("VLLM_CPU_OMP_THREADS_BIND=4|5 vllm serve /m ")
    assert commands[1]["command"].endswith("--nnodes 2 --node-rank 1 --master-addr a --master-port 29501 --headless")


def test_ray_brings_its_cluster_up_first_and_serves_from_the_head():
    commands = node_commands(["a", "b"], "/m", Layout(tp=8, pp=2, hosts=2, executor="ray"), ["A.json", "B.json"])
    assert [c["command"] for c in commands[:2]] == ["ray start --head --port=6379", "ray start --address=a:6379"]
    assert commands[2] == {"host": "a", "command": "edge serve --model /m --devices A.json --devices B.json "
                                                   "--tensor-parallel-size 8 --pipeline-parallel-size 2 "
                                                   "--distributed-executor-backend ray"}
