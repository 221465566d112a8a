"""Two nodes joined on vLLM's multi-node executor, on this one machine: serve, answer, stop, lose a node.

Where two network namespaces can be made (root, as CI), tests/test_nodes_netns.py serves the same tokens
from two namespaces and takes both nodes through their stop paths (a link down), so the loopback pair that
serves and is stopped here is skipped there, and the engine tests cost one pair each way; ``kill -9`` of a
node runs everywhere.

Two edge processes, each limited to one core (``taskset -c 0`` / ``-c 1``), loopback master address,
TP 2 across them: ``edge serve --nnodes 2 --node-rank 0`` answers ``/v1/completions`` with the greedy
token ids of a one-node run of the same layout (and of one rank): the suite's TP 2 and one-rank acceptance
runs (conftest's ``tp2_accept``, ``demo_accept``) give those for the same prompt, greedy and ``ignore_eos``,
so a prefix of theirs is what eight tokens must be. ``edge stop`` of the head (a SIGTERM to the pid its ledger
record names) ends both nodes; ``kill -9`` of node 1's edge process ends the head with ``node_lost``. SIGINT takes
the same path on the side channel (tests/test_nodes.py stops a head each way, without an engine). Each pair is one engine start shared by its checks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from edge_core.artifact import DEMO_MODEL
from edge_core.runtime.accept import PROMPTS

NEEDS = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.engine,
    pytest.mark.alone,
    pytest.mark.slow,
    pytest.mark.skipif(bool(NEEDS), reason=f"needs the real vLLM CPU build and edge-cpu; missing: {NEEDS}"),
    pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset to give each node its own core"),
    pytest.mark.skipif(not {0, 1} <= set(os.sched_getaffinity(0)), reason="needs CPUs 0 and 1 (one per node)"),
]

#: The acceptance runs' first prompt, so their records hold the one-node tokens to compare with.
PROMPT = PROMPTS[0]
TOKENS = 8
#: Seconds a pair may take to serve (two engine starts on a shared 2-core machine).
READY_TIMEOUT_S = 600


def free_port(span: int = 1) -> int:
    """A port P with P..P+span-1 free now (vLLM's master port, and edge's side channel above it)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port + span < 65535 and all(_free(port + i) for i in range(1, span)):
            return port
    raise RuntimeError("no free port run")


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Pair:
    head: subprocess.Popen[str]
    node: subprocess.Popen[str]
    url: str
    ready_s: float
    logs: Path

    def tree(self) -> list[int]:
        """Every live process of either node: the edge processes and all they started (reapers too)."""
        out = []
        for proc in (self.head, self.node):
            try:
                root = psutil.Process(proc.pid)
                out += [root.pid, *(c.pid for c in root.children(recursive=True))]
            except psutil.NoSuchProcess:
                continue
        return out

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logs.glob("*.err")))


def _marked(session_env: str) -> list[int]:
    """Live processes whose environment carries this test's marker (engine processes outlive their parents)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("EDGE_TEST_PAIR") == session_env:
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def start_pair(tmp: Path, name: str) -> Pair:
    port, master = free_port(), free_port(2)
    env = {**os.environ, "EDGE_LEDGER_DIR": str(tmp / "ledger"), "EDGE_TEST_PAIR": name}
    common = ["--model", str(DEMO_MODEL), "--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(master), "--max-model-len", "512"]

    def launch(core: int, rank: int, extra: list[str]) -> subprocess.Popen[str]:
        err = open(tmp / f"{name}-node{rank}.err", "w")  # noqa: SIM115 — the process owns it
        return subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-m", "edge_core", "serve", *common,
                                 "--node-rank", str(rank), "--json", *extra],
                                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, text=True, env=env)

    started = time.monotonic()
    node = launch(1, 1, [])
    head = launch(0, 0, ["--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    pair = Pair(head, node, url, 0.0, tmp)
    while time.monotonic() - started < READY_TIMEOUT_S:
        if head.poll() is not None or node.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    pair.ready_s = time.monotonic() - started
                    return pair
        except OSError:
            time.sleep(1)
    for proc in (head, node):
        proc.kill()
    raise AssertionError(f"the pair did not come up (head rc {head.poll()}, node rc {node.poll()}):\n{pair.output()}")


def complete(url: str) -> dict[str, Any]:
    body = json.dumps({"model": "tiny-llama", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def first_tokens(accept: tuple[Any, dict[str, Any]]) -> list[int]:
    """The first TOKENS ids an acceptance run generated for PROMPT (greedy: a longer run's prefix)."""
    _, record = accept
    assert record["prompts"][0]["prompt"] == PROMPT, record["prompts"][0]
    return list(record["prompts"][0]["token_ids"][:TOKENS])


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[Pair, dict[str, Any]]]:
    """One pair serving, its answer to the prompt, then stopped by ``edge stop`` of the head."""
    from netns import unavailable

    if unavailable() is None:
        pytest.skip("tests/test_nodes_netns.py serves these tokens from two network namespaces, which this host "
                    "can make, and stops both nodes there")
    tmp = tmp_path_factory.mktemp("pair")
    pair = start_pair(tmp, "served")
    try:
        answer = complete(pair.url)
        yield pair, answer
    finally:
        for proc in (pair.head, pair.node):
            if proc.poll() is None:
                proc.kill()


def test_two_nodes_serve_the_greedy_tokens_of_one_node(served, tp2_accept, demo_accept):
    pair, answer = served
    ids = answer["choices"][0].get("token_ids")
    assert ids is not None and len(ids) == TOKENS, answer
    assert ids == first_tokens(tp2_accept), "two joined nodes differ from one node at TP 2"
    assert ids == first_tokens(demo_accept), "two joined nodes differ from one rank"
    print(f"pair ready in {pair.ready_s:.1f} s")


def test_edge_stop_of_the_head_ends_both_nodes(served):
    pair, _ = served
    before = pair.tree()
    assert len(before) >= 6  # two edge processes, their reapers, and at least a worker each
    started = time.monotonic()
    stop = subprocess.run([sys.executable, "-m", "edge_core", "stop", str(pair.head.pid), "--json"],
                          env={**os.environ, "EDGE_LEDGER_DIR": str(pair.logs / "ledger")}, capture_output=True,
                          text=True, timeout=60)  # SIGTERM to the pid the head's ledger record names
    assert stop.returncode == 0, stop.stdout + stop.stderr
    deadline = started + 15
    while time.monotonic() < deadline and (_marked("served") or pair.head.poll() is None
                                           or pair.node.poll() is None):
        time.sleep(0.2)
    took = time.monotonic() - started
    left = [pid for pid in before if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not left and not _marked("served"), f"left after {took:.1f} s: {left}\n{pair.output()}"
    assert pair.head.returncode == 0, pair.output()
    assert pair.node.returncode == 0, pair.output()
    head = json.loads(pair.head.stdout.read())  # type: ignore[union-attr]
    node = json.loads(pair.node.stdout.read())  # type: ignore[union-attr]
    assert head["plan"]["parallel"]["node"]["node_rank"] == 0 and head["stopped_by"] == "SIGTERM"
    assert node["stopped_by"] == "the head" and node["node"]["ranks"] == [1] and node["processes_left"] == []
    print(f"both nodes gone {took:.1f} s after `edge stop` of the head")


def test_kill_9_of_a_node_ends_the_head_with_node_lost_and_leaves_nothing(tmp_path):
    pair = start_pair(tmp_path, "killed")
    try:
        started = time.monotonic()
        pair.node.send_signal(signal.SIGKILL)
        pair.head.wait(60)
        took = time.monotonic() - started
        deadline = time.monotonic() + 15  # the node's reaper ends its engine processes
        while time.monotonic() < deadline and _marked("killed"):
            time.sleep(0.2)
        assert pair.head.returncode == 1, pair.output()
        assert "node_lost: node 1" in (tmp_path / "killed-node0.err").read_text()
        assert not _marked("killed"), pair.output()
        print(f"head ended {took:.1f} s after kill -9 of node 1")
    finally:
        for proc in (pair.head, pair.node):
            if proc.poll() is None:
                proc.kill()
