"""Two hosts that are really two: ``edge serve --nnodes 2`` in two network namespaces joined by a veth pair.

One session, started once (tests/netns.py): the head in one namespace on core 0, node 1 in the other on
core 1, each with its own loopback and its own ``/dev/shm``, :data:`LAYOUT` of :data:`MODEL` across them on
vLLM's multi-node executor, the master address the head's veth address — while the host name resolves to
loopback in both, as on Debian hosts and on this VM (where the ranks used to advertise 127.0.0.1 and never
met). Checked on it, in order: each node states the interface and address its ranks use, and its ranks
really connect over the veth with them; the head answers ``/v1/completions`` at its veth address with the
greedy tokens and text of a one-node run of the same model and prompt (the suite's one-rank acceptance run,
conftest's ``demo_accept``: greedy, ``ignore_eos``); last, node 1's veth is taken down mid-stream: the head
names the lost node and exits 1, the node names the lost head, and nothing is left running in either
namespace. The other faults (a late node, a second node 1, the master port taken, no route, 50 ms of
latency) are bench/nodes_faults.py's, with the table in docs/benchmarks.md.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from netns import Namespaces, Pair, start_pair, tcp_between, unavailable

from edge_core.artifact import DEMO_MODEL
from edge_core.runtime.accept import PROMPTS
from edge_core.runtime.nodes import LINK_TIMEOUT_S

#: The model both nodes serve and the layout across them: tiny-llama (random weights, 4 heads, 2 KV heads) splits
#: across TP 2; SmolLM2-135M's 9 heads and 3 KV heads do not (edge refuses TP 2 as parallel_layout_invalid, as
#: vLLM would): pointed at it, use ("--pipeline-parallel-size", "2") (30 layers, 15 a node).
MODEL: str | None = str(DEMO_MODEL)
LAYOUT = ("--tensor-parallel-size", "2")
PROMPT = PROMPTS[0]
TOKENS = 8
#: Seconds the nodes get to end after the link goes down: the side channel's silence, then each node's stop.
LOST_WITHIN_S = LINK_TIMEOUT_S + 45

NEEDS = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.engine(starts=2),
    pytest.mark.alone,
    pytest.mark.slow,
    pytest.mark.skipif(bool(NEEDS), reason=f"needs the real vLLM CPU build and edge-cpu; missing: {NEEDS}"),
    pytest.mark.skipif(unavailable() is not None, reason=f"two network namespaces: {unavailable()}"),
    pytest.mark.skipif(not {0, 1} <= set(os.sched_getaffinity(0)), reason="needs CPUs 0 and 1 (one per node)"),
]


@pytest.fixture(scope="module")
def session(tmp_path_factory, demo_accept) -> Iterator[Pair]:
    """The pair, serving; on leaving, whatever still runs in either namespace is killed and both are removed.

    After the suite's one-rank acceptance run (``demo_accept``, which a test here compares with): measured
    beside a serving pair, that run's tree PSS would read the libraries' pages shared three ways."""
    logs = tmp_path_factory.mktemp("netns")
    model = ("--model", MODEL) if MODEL else ()
    with Namespaces("s") as spaces:
        pair = start_pair(spaces, logs, (*model, *LAYOUT), port=8000, master_port=29501)
        try:
            yield pair
        finally:
            pair.stop()


def test_each_node_states_the_interface_its_ranks_use_and_they_connect_over_it(session):
    spaces, head, node = session.spaces, session.err("head"), session.err("node")
    print(f"pair ready in {session.ready_s:.1f} s; this host's name resolves to "
          f"{socket.gethostbyname(socket.gethostname())}")
    assert f"its ranks use {spaces.head_if} {spaces.head_ip}" in head, head
    assert f"node 1 joined from {socket.gethostname()} ({spaces.node_ip})" in head
    assert f"its ranks use {spaces.node_if} {spaces.node_ip}" in head
    assert f"reach each other's ranks' addresses ({spaces.head_ip} <-> {spaces.node_ip}" in head
    assert f"this node's ranks use {spaces.node_if} {spaces.node_ip}" in node, node
    assert f"GLOO_SOCKET_IFNAME={spaces.node_if} VLLM_HOST_IP={spaces.node_ip}" in node  # its plan's env line
    plan = session.ask("/edge/plan")  # the head's plan, as it serves it
    assert plan["parallel"]["env"]["GLOO_SOCKET_IFNAME"] == spaces.head_if
    assert plan["parallel"]["env"]["VLLM_HOST_IP"] == spaces.head_ip
    assert plan["parallel"]["node"]["address"]["interface"] == spaces.head_if
    # The ranks got it: each namespace's workers carry the variables, and hold connections across the veth.
    for ns, ifname, here, there in ((spaces.head, spaces.head_if, spaces.head_ip, spaces.node_ip),
                                    (spaces.node, spaces.node_if, spaces.node_ip, spaces.head_ip)):
        workers = [p for p in map(psutil.Process, spaces.running(ns)) if "Worker" in p.name()]
        assert workers, f"no vLLM worker in {ns}"
        for worker in workers:
            env = worker.environ()
            assert (env.get("GLOO_SOCKET_IFNAME"), env.get("VLLM_HOST_IP")) == (ifname, here), worker.name()
        across = tcp_between(workers[0].pid, here, there)
        assert len(across) >= 2, f"{ns}: {across}"  # Gloo's pair and the message queues, beside the side channel


def test_the_head_serves_the_greedy_text_of_one_node_at_its_veth_address(session, demo_accept):
    answer = session.complete({"model": Path(MODEL).name if MODEL else "tiny-llama", "prompt": PROMPT,
                               "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                               "return_token_ids": True})
    choice = answer["choices"][0]
    _, record = demo_accept
    one = record["prompts"][0]
    assert one["prompt"] == PROMPT
    assert choice["token_ids"] == one["token_ids"][:TOKENS], "two namespaces differ from one node, one rank"
    assert one["text"].startswith(choice["text"]), (choice["text"], one["text"][:80])


def test_the_link_down_mid_stream_names_the_lost_node_and_leaves_nothing(session):
    spaces = session.spaces
    client = session.post("/v1/completions", {"model": Path(MODEL).name if MODEL else "tiny-llama",
                                              "prompt": PROMPT, "max_tokens": 400, "temperature": 0,
                                              "ignore_eos": True, "stream": True}, 300)
    assert client.stdout is not None
    streamed = 0
    while streamed < 3:  # a few tokens in: mid-stream (server-sent events, a blank line between them)
        line = client.stdout.readline()
        assert line and not line.startswith(("END", "ERROR")), f"the stream ended before the fault: {line}"
        streamed += '"text"' in line
    started = time.monotonic()
    spaces.set_link(spaces.node, up=False)
    took: dict[str, float] = {}
    while time.monotonic() - started < LOST_WITHIN_S and len(took) < 2:
        for which, proc in (("head", session.head), ("node", session.node)):
            if which not in took and proc.poll() is not None:
                took[which] = time.monotonic() - started
        time.sleep(0.1)
    assert len(took) == 2, f"still running {LOST_WITHIN_S:.0f} s after the link went down: {took}\n{session.output()}"
    assert session.head.returncode == 1 and session.node.returncode == 1, session.output()
    head_end, node_end = _last_edge_line(session.err("head")), _last_edge_line(session.err("node"))
    assert head_end.startswith("edge: node_lost: node 1 of this session stopped answering"), head_end
    assert node_end.startswith("edge: head_lost: node 0 (the head) stopped answering"), node_end
    rest, _ = client.communicate(timeout=60)  # the stream ended: it does not hang on a session that is gone
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (spaces.running(spaces.head) or spaces.running(spaces.node)):
        time.sleep(0.2)
    left = {ns: [_describe(pid) for pid in spaces.running(ns)] for ns in (spaces.head, spaces.node)}
    assert not any(left.values()), left
    print(f"link down: node ended in {took['node']:.1f} s, head in {took['head']:.1f} s; the stream ended with "
          f"{rest.strip().splitlines()[-1][:80]!r}")


def _last_edge_line(err: str) -> str:
    return next((line for line in reversed(err.splitlines()) if line.startswith("edge: ")), "")


def _describe(pid: int) -> str:
    try:
        return f"{pid} {psutil.Process(pid).name()}"
    except psutil.Error:
        return str(pid)
