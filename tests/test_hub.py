"""Models named by Hub id (issue 12): resolution, header-only plans over HTTP ranges, named refusals, downloads.

Every test talks to :class:`fake_hub.FakeHub` on 127.0.0.1 through the real
huggingface_hub client (``HF_ENDPOINT`` points at it; ``HF_HOME`` and edge's
cache are empty temporary directories), so what is checked is what edge does
with what the library gets from a server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from factories import KNOWN_CONFIGS, llama_like_tensors, write_checkpoint, write_safetensors_header_only
from fake_hub import FakeHub, FakeRepo

from edge_core.artifact import DEMO_MODEL, DEMO_MODEL_HD16
from edge_core.artifact.hub import looks_like_hub_id, resolve_model
from edge_core.devices import load_device_list
from edge_core.host import HostFacts
from edge_core.plans import SessionSpec
from edge_core.runtime.admission import make_plan
from edge_core.services.registry import Registry, discover

DATA = Path(__file__).parent / "data"
LLAMA_70B = "meta-llama/Llama-3.1-70B"


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> dict[str, Path]:
    """The directories the fake Hub serves: the demos, a 30-shard 70B-class checkpoint, hostile variants."""
    root = tmp_path_factory.mktemp("repos")
    config = dict(KNOWN_CONFIGS[LLAMA_70B])
    write_checkpoint(root / "llama-70b", config, llama_like_tensors(config), shards=30)
    pickle = root / "pickle-only"
    pickle.mkdir()
    (pickle / "config.json").write_text(json.dumps(config))
    (pickle / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    for name, length in (("huge-header", 200_000_000), ("short-file", 4096)):
        bad = root / name
        bad.mkdir()
        (bad / "config.json").write_text((DEMO_MODEL / "config.json").read_text())
        with open(bad / "model.safetensors", "wb") as f:
            f.write(length.to_bytes(8, "little") + b"{}")
            f.truncate(1024)
    lying = root / "lying-offsets"
    lying.mkdir()
    (lying / "config.json").write_text((DEMO_MODEL / "config.json").read_text())
    write_safetensors_header_only(lying / "model.safetensors", {"model.embed_tokens.weight": ("BF16", [1 << 20, 1024])})
    with open(lying / "model.safetensors", "r+b") as f:
        f.truncate(4096)  # the header's offsets point far past the end of the file
    return {"demo/tiny-llama": DEMO_MODEL, "demo/tiny-llama-hd16": DEMO_MODEL_HD16, "big/llama-70b": root / "llama-70b",
            "bad/pickle-only": pickle, "bad/huge-header": root / "huge-header", "bad/short-file": root / "short-file",
            "bad/lying-offsets": lying}


@pytest.fixture
def hub(repos, tmp_path, monkeypatch):
    served = {name: FakeRepo(path) for name, path in repos.items()}
    served["big/no-range"] = FakeRepo(repos["big/llama-70b"], ignore_range=True)
    served["demo/gated"] = FakeRepo(DEMO_MODEL, gated=True)
    served["demo/private"] = FakeRepo(DEMO_MODEL, private=True)
    served["demo/branches"] = FakeRepo(DEMO_MODEL, revisions={"main": "a" * 40, "v1": "b" * 40})
    with FakeHub(served) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        monkeypatch.setenv("EDGE_HUB_TIMEOUT", "5")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
            monkeypatch.delenv(name, raising=False)
        yield server


def plan(model: str, devices: str = "devices-h100.json", **kwargs):
    listed, host = load_device_list(str(DATA / devices))
    return make_plan(model, session=SessionSpec(), devices=listed, host=HostFacts.from_dict(host),
                     devices_source=f"file:{devices}", **kwargs)


def budget(doc: dict) -> dict:
    """A plan document without where its files were (what must be identical between Hub and disk)."""
    doc = json.loads(json.dumps(doc))
    for key in ("model_path", "source"):
        doc.pop(key)
    doc["engine_kwargs"].pop("model", None)
    doc["manifest"].pop("path", None)
    return doc


def codes(p) -> list[str]:
    return [r.code for r in p.refusals]


def test_what_is_a_hub_id():
    assert looks_like_hub_id("Qwen/Qwen2.5-7B-Instruct") and looks_like_hub_id("meta-llama/Llama-3.1-8B")
    for path in ("./Qwen/Qwen2.5", "/models/x", "~/m/x", "x", "a/b/c", "../a", "a/b.onnx", "org/"):
        assert not looks_like_hub_id(path), path


@pytest.mark.parametrize("repo, local", [("demo/tiny-llama", DEMO_MODEL), ("demo/tiny-llama-hd16", DEMO_MODEL_HD16),
                                         ("big/llama-70b", None)])
def test_a_hub_plan_is_the_plan_of_the_same_files_on_disk(hub, repos, repo, local):
    remote = plan(repo)
    on_disk = plan(str(local or repos[repo]))
    assert remote.source.kind == "hub" and remote.source.commit == hub.repos[repo].commit
    assert budget(remote.to_dict()) == budget(on_disk.to_dict())
    assert remote.manifest.artifact_id == on_disk.manifest.artifact_id


def test_the_70b_plan_fetches_headers_only(hub, repos):
    hub.reset_counters()
    remote = plan("big/llama-70b")
    total = sum(p.stat().st_size for p in repos["big/llama-70b"].iterdir())
    assert remote.source.remote_bytes == total
    assert 0 < hub.bytes_sent < total * 1e-4, (hub.bytes_sent, total)
    assert remote.source.fetched_bytes <= hub.bytes_sent
    # Every shard was read by range only.
    ranged = [h.get("Range") for method, path, h in hub.requests if path.endswith(".safetensors") and method == "GET"]
    assert ranged and all(r and r.startswith("bytes=") for r in ranged)


def test_the_second_plan_needs_no_server(hub):
    first = plan("big/llama-70b")
    hub.stop()
    again = plan("big/llama-70b")
    assert again.source.kind == "hub" and again.source.fetched_bytes == 0
    assert budget(again.to_dict()) == budget(first.to_dict())


def test_offline_uses_the_metadata_cache_and_refuses_what_it_lacks(hub, monkeypatch):
    plan("demo/tiny-llama")
    hub.reset_counters()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert plan("demo/tiny-llama").admitted
    missing = plan("big/llama-70b")
    assert codes(missing) == ["model_not_cached"]
    assert "hf download big/llama-70b" in missing.refusals[0].remedy
    assert hub.requests == []


@pytest.mark.parametrize("repo, code", [
    ("nobody/nothing", "model_not_found"), ("demo/gated", "model_gated"), ("demo/private", "model_not_found"),
    ("bad/pickle-only", "artifact_invalid"), ("bad/huge-header", "artifact_invalid"),
    ("bad/short-file", "artifact_invalid"), ("bad/lying-offsets", "artifact_invalid"),
    ("big/no-range", "artifact_invalid"),
])
def test_named_refusals(hub, repo, code):
    refused = plan(repo)
    assert codes(refused) == [code], refused.refusals
    assert refused.refusals[0].remedy


def test_gated_without_a_token_names_the_token_and_works_with_it(hub, monkeypatch):
    refused = plan("demo/gated")
    assert "HF_TOKEN" in refused.refusals[0].remedy and "hf auth login" in refused.refusals[0].remedy
    monkeypatch.setenv("HF_TOKEN", hub.token)
    assert plan("demo/gated").admitted


def test_an_endpoint_ignoring_ranges_is_cut_off(hub, repos):
    hub.reset_counters()
    refused = plan("big/no-range")
    assert "ignores HTTP ranges" in refused.refusals[0].message
    shard = max(p.stat().st_size for p in repos["big/llama-70b"].iterdir())
    assert hub.bytes_sent < shard / 100, hub.bytes_sent  # not buffered: the server was hung up on


def test_revisions_by_branch_commit_and_unknown(hub):
    assert plan("demo/branches", revision="v1").source.commit == "b" * 40
    assert plan("demo/branches").source.commit == "a" * 40
    assert plan("demo/branches", revision="b" * 40).source.commit == "b" * 40
    assert codes(plan("demo/branches", revision="nope")) == ["revision_not_found"]


def test_unreachable_hub_is_refused_within_the_timeout(hub, monkeypatch):
    hub.stop()
    refused = plan("demo/tiny-llama")
    assert codes(refused) == ["hub_unreachable"]
    slow = FakeHub({"demo/tiny-llama": FakeRepo(DEMO_MODEL)}, delay_s=3.0)
    with slow:
        monkeypatch.setenv("HF_ENDPOINT", slow.endpoint)
        monkeypatch.setenv("EDGE_HUB_TIMEOUT", "0.5")
        assert codes(plan("demo/tiny-llama")) == ["hub_unreachable"]


def test_a_missing_local_path_is_a_missing_path_not_a_repo_id(hub):
    for path in ("./demo/tiny-llama", "/no/such/model/dir"):
        refused = plan(path)
        assert codes(refused) == ["artifact_invalid"] and "does not exist" in refused.refusals[0].message
    assert hub.requests == []


def test_an_existing_local_path_wins_over_a_hub_id(hub, tmp_path, monkeypatch):
    local = tmp_path / "demo" / "tiny-llama"
    write_checkpoint(local, dict(KNOWN_CONFIGS[LLAMA_70B]), llama_like_tensors(KNOWN_CONFIGS[LLAMA_70B]))
    monkeypatch.chdir(tmp_path)
    assert resolve_model("demo/tiny-llama").kind == "local"
    assert hub.requests == []


def test_a_complete_hf_cache_snapshot_is_planned_in_place(hub, tmp_path):
    from huggingface_hub import snapshot_download

    path = snapshot_download("demo/tiny-llama", cache_dir=str(tmp_path / "hf" / "hub"), endpoint=hub.endpoint)
    hub.reset_counters()
    cached = plan("demo/tiny-llama")
    assert cached.source.kind == "cache" and cached.source.path == path
    assert hub.requests == []


def test_plan_json_says_where_the_model_came_from(hub):
    proc = subprocess.run([sys.executable, "-m", "edge_core", "plan", "--model", "demo/tiny-llama", "--devices",
                           str(DATA / "devices-h100.json"), "--json"], capture_output=True, text=True,
                          env={**os.environ})
    assert proc.returncode == 0, proc.stderr
    source = json.loads(proc.stdout)["source"]
    assert source["kind"] == "hub" and source["repo"] == "demo/tiny-llama"
    assert source["commit"] == hub.repos["demo/tiny-llama"].commit and source["weights_present"] is False
    text = subprocess.run([sys.executable, "-m", "edge_core", "plan", "--model", "demo/tiny-llama", "--devices",
                           str(DATA / "devices-h100.json")], capture_output=True, text=True).stdout
    assert "headers from edge's metadata cache" in text


def test_revision_on_a_local_path_is_a_usage_error(hub):
    proc = subprocess.run([sys.executable, "-m", "edge_core", "plan", "--model", str(DEMO_MODEL), "--revision", "v1"],
                          capture_output=True, text=True)
    assert proc.returncode == 64 and "--revision applies to Hub ids" in proc.stderr


def test_download_checks_the_disk_first(hub, monkeypatch):
    from edge_core.artifact import hub as hub_module

    source = plan("demo/tiny-llama").source
    monkeypatch.setattr(hub_module, "free_bytes", lambda path: 1024)
    with pytest.raises(hub_module.ArtifactError) as exc:
        hub_module.download(source)
    assert exc.value.code == "disk_space_insufficient"
    assert _weights_fetched(hub) == []


def test_download_fetches_the_weights_and_leaves_a_cache_offline_plans_use(hub, monkeypatch):
    from edge_core.artifact.hub import download

    source = plan("demo/tiny-llama").source
    got = download(source)
    assert got.kind == "cache" and Path(got.path, "model.safetensors").stat().st_size == \
        (DEMO_MODEL / "model.safetensors").stat().st_size
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    again = plan("demo/tiny-llama")
    assert again.source.kind == "cache" and again.source.path == got.path


def test_edge_models_lists_the_cache_with_verdicts(hub, tmp_path):
    from huggingface_hub import snapshot_download

    for repo in ("demo/tiny-llama", "demo/tiny-llama-hd16"):
        snapshot_download(repo, cache_dir=str(tmp_path / "hf" / "hub"), endpoint=hub.endpoint)
    proc = subprocess.run([sys.executable, "-m", "edge_core", "models", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["schema"] == "edge.models"
    rows = {r["repo"]: r for r in doc["models"]}
    assert set(rows) == {"demo/tiny-llama", "demo/tiny-llama-hd16"}
    registry = Registry()
    host, devices = discover(registry, frozenset())
    for repo, row in rows.items():
        assert row["commit"] == hub.repos[repo].commit and row["size_on_disk_bytes"] > 0
        expected = make_plan(row["path"], session=SessionSpec(), devices=devices, host=host, registry=registry)
        assert (row["admitted"], row["device_id"], [r["code"] for r in row["refusals"]]) == (
            expected.admitted, expected.selected_device.device_id if expected.selected_device else None,
            codes(expected))
    assert not rows["demo/tiny-llama-hd16"]["admitted"]


NEEDS_ENGINE = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]


def _edge(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_core", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _weights_fetched(hub: FakeHub) -> list[str]:
    """Whole-file GETs from the fake's LFS store, where weights are served from (a header read carries a Range)."""
    return [path for method, path, h in hub.requests if method == "GET" and path.startswith("/lfs/")
            and not h.get("Range")]


def test_a_refused_hub_model_downloads_nothing(hub, tmp_path):
    proc = _edge("run", "--model", "demo/tiny-llama-hd16", "--max-tokens", "2", "--json")
    assert proc.returncode == 2, proc.stderr
    assert json.loads(proc.stdout)["outcome"] == "refused"
    assert _weights_fetched(hub) == []
    assert not (tmp_path / "hf" / "hub" / "models--demo--tiny-llama-hd16" / "blobs").exists()


@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(bool(NEEDS_ENGINE), reason=f"needs vLLM CPU and edge-cpu; missing: {NEEDS_ENGINE}")
def test_edge_run_downloads_runs_and_then_plans_offline_from_the_cache(hub, tmp_path):
    first = _edge("run", "--model", "demo/tiny-llama", "--max-tokens", "4", "--ignore-eos", "--json")
    assert first.returncode == 0, first.stderr[-3000:]
    record = json.loads(first.stdout)
    assert record["outcome"] == "completed" and record["plan"]["source"]["kind"] == "cache"
    assert len(record["token_ids"]) == 4
    assert len(_weights_fetched(hub)) == 1  # the one shard, once
    snapshot = Path(record["plan"]["source"]["path"])
    assert (snapshot / "model.safetensors").stat().st_size == (DEMO_MODEL / "model.safetensors").stat().st_size
    # Offline, the same id resolves to the same snapshot with nothing fetched: the path the engine just loaded.
    # (A second engine start would load that same directory again; the run above is the engine's half.)
    hub.stop()
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        again = _edge("plan", "--model", "demo/tiny-llama", "--json")
    finally:
        del os.environ["HF_HUB_OFFLINE"]
    assert again.returncode == 0, again.stderr[-3000:]
    offline = json.loads(again.stdout)
    assert offline["admitted"] and offline["source"] == {**record["plan"]["source"], "fetched_bytes": 0}


@pytest.mark.skipif(importlib.util.find_spec("edge_cpu") is None, reason="needs a backend that admits the demo")
def test_ctrl_c_during_the_download_exits_130_and_leaves_the_cache_consistent(repos, tmp_path, monkeypatch):
    import signal

    slow = FakeHub({"demo/tiny-llama": FakeRepo(DEMO_MODEL)}, delay_s=0.4)
    with slow:
        env = {**os.environ, "HF_ENDPOINT": slow.endpoint, "HF_HOME": str(tmp_path / "hf"),
               "XDG_CACHE_HOME": str(tmp_path / "xdg"), "EDGE_HUB_TIMEOUT": "5"}
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
            env.pop(name, None)
        proc = subprocess.Popen([sys.executable, "-m", "edge_core", "run", "--model", "demo/tiny-llama",
                                 "--max-tokens", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env=env, stdin=subprocess.DEVNULL)
        for line in proc.stderr:
            if "downloading the weights" in line:
                proc.send_signal(signal.SIGINT)
                break
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 130, rest
        blobs = tmp_path / "hf" / "hub" / "models--demo--tiny-llama" / "blobs"
        size = (DEMO_MODEL / "model.safetensors").stat().st_size
        complete = [p for p in blobs.glob("*") if not p.name.endswith(".incomplete") and p.stat().st_size == size]
        snapshot_weights = list((tmp_path / "hf" / "hub" / "models--demo--tiny-llama").glob("snapshots/*/*.safetensors"))
        # Either the weights never arrived, or they arrived whole and are linked: never a partial file in place.
        assert all(p.resolve().stat().st_size == size for p in snapshot_weights)
        assert len(complete) <= 1
