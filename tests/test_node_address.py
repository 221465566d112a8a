"""Which interface and address a node's ranks use (edge_core.runtime.node_address), and what the plan does with it.

The host's resolver, routing table and interface table are the boundary: each test hands
``read_node_address`` a fake of the three (a name -> IPs map, a destination -> source map, a list of
interfaces), as a host with that network would answer, except the last ones, which ask this host.
"""

from __future__ import annotations

import errno
import json
import socket

import pytest

from edge_core.artifact import DEMO_MODEL
from edge_core.engines.vllm_launch import node_address_env
from edge_core.layout import NodeAddress
from edge_core.runtime.node_address import Interface, read_node_address

ETH = Interface("eth0", ("10.0.0.2", "fe80::1"), True)
LO = Interface("lo", ("127.0.0.1", "::1"), True)


def fake_host(names: dict[str, list[str]], routes: dict[str, str | OSError], interfaces: list[Interface]):
    """The three boundary functions of a host whose resolver, routes and interfaces are these."""

    def resolver(name: str) -> list[str]:
        if name not in names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return names[name]

    def route(ip: str, port: int) -> str:
        source = routes[ip]
        if isinstance(source, OSError):
            raise source
        return source

    return {"resolver": resolver, "route": route, "interfaces": lambda: interfaces}


def test_a_node_uses_the_interface_of_its_route_to_the_head_not_what_its_host_name_resolves_to():
    # The host: its name resolves to loopback, and Gloo advertised that; the route to the head is eth0.
    host = fake_host({"node-a": ["10.0.0.1"], "vm": ["127.0.0.1"]}, {"10.0.0.1": "10.0.0.2"}, [LO, ETH])
    address = read_node_address("node-a", 29501, 1, **host)
    assert (address.interface, address.address, address.master_ip) == ("eth0", "10.0.0.2", "10.0.0.1")
    assert not address.local and not address.loopback and address.problem is None
    assert node_address_env(address) == {"GLOO_SOCKET_IFNAME": "eth0", "VLLM_HOST_IP": "10.0.0.2"}


def test_the_head_uses_the_interface_that_holds_the_master_address():
    eth = Interface("eth0", ("10.0.0.1",), True)
    host = fake_host({"10.0.0.1": ["10.0.0.1"]}, {"10.0.0.1": "10.0.0.1"}, [LO, eth])
    address = read_node_address("10.0.0.1", 29501, 0, **host)
    assert (address.interface, address.address, address.local) == ("eth0", "10.0.0.1", True)


def test_a_head_that_does_not_hold_the_master_address_is_named():
    host = fake_host({"10.0.0.9": ["10.0.0.9"]}, {"10.0.0.9": "10.0.0.2"}, [LO, ETH])
    address = read_node_address("10.0.0.9", 29501, 0, **host)
    assert address.problem is not None and "not an address of this host" in address.problem
    assert "eth0 10.0.0.2" in address.problem  # where the route to it leaves instead
    assert node_address_env(address) == {}


@pytest.mark.parametrize("master, source", [("127.0.0.1", "127.0.0.1"), ("127.0.1.1", "127.0.1.1")])
def test_a_loopback_master_address_is_the_loopback_interface_every_node_on_one_host(master, source):
    # Debian maps the host name to 127.0.1.1, which no interface lists: it is still the loopback interface's.
    host = fake_host({master: [master]}, {master: source}, [LO, ETH])
    address = read_node_address(master, 29501, 1, **host)
    assert (address.interface, address.address, address.local, address.loopback) == ("lo", source, True, True)


def test_ipv4_comes_before_ipv6_when_a_name_has_both(monkeypatch):
    from edge_core.runtime.node_address import resolve

    answers = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", 0, 0, 0)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.1", 0))]
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: answers)  # the host's resolver
    assert resolve("node-a") == ["10.0.0.1", "fd00::1"]


@pytest.mark.parametrize("names, routes, interfaces, says", [
    ({}, {}, [LO, ETH], "does not resolve on this host"),
    ({"node-a": ["10.9.0.1"]}, {"10.9.0.1": OSError(errno.ENETUNREACH, "Network is unreachable")}, [LO, ETH],
     "no route to --master-addr node-a (10.9.0.1): Network is unreachable"),
    ({"node-a": ["10.0.0.1"]}, {"10.0.0.1": "10.0.0.2"}, [LO, Interface("eth0", ("10.0.0.2",), False)],
     "interface eth0 (10.0.0.2), the way to 10.0.0.1, is down"),
    ({"node-a": ["10.0.0.1"]}, {"10.0.0.1": "10.0.0.7"}, [LO, ETH], "which no interface of this host holds"),
])
def test_a_node_without_a_usable_address_says_why(names, routes, interfaces, says):
    address = read_node_address("node-a", 29501, 1, **fake_host(names, routes, interfaces))
    assert address.problem is not None and says in address.problem, address.problem
    assert node_address_env(address) == {}


def test_this_host_reaches_its_own_loopback_on_the_loopback_interface():
    address = read_node_address("127.0.0.1", 29501, 1)  # this host's resolver, routes and interfaces
    assert address.address == "127.0.0.1" and address.loopback and address.problem is None
    assert address.interface in {name for _, name in socket.if_nameindex()}


# ------------------------------------------------ the plan: the address stated, set, or refused by name


def _plan(capsys, *args: str) -> tuple[int, dict]:
    from edge_core.cli import main

    code = main(["plan", "--json", "--model", str(DEMO_MODEL), "--tensor-parallel-size", "2", "--max-model-len", "512", "--nnodes", "2", *args])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def edge_cpu():
    pytest.importorskip("edge_cpu", reason="plans this host's CPU: needs edge-cpu installed")


def test_a_node_plan_states_its_address_and_sets_the_ranks_environment(capsys, edge_cpu):
    code, doc = _plan(capsys, "--node-rank", "1", "--master-addr", "127.0.0.1")
    assert code == 0, doc["refusals"]
    node = doc["parallel"]["node"]
    assert node["address"]["address"] == "127.0.0.1" and node["address"]["loopback"]
    env = doc["parallel"]["env"]
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["GLOO_SOCKET_IFNAME"] == node["address"]["interface"]
    from edge_core.cli import main

    assert main(["plan", "--model", str(DEMO_MODEL), "--tensor-parallel-size", "2", "--max-model-len", "512", "--nnodes",
                 "2", "--node-rank", "1", "--master-addr", "127.0.0.1"]) == 0
    said = capsys.readouterr().out
    assert (f"address   its ranks bind and advertise 127.0.0.1 on {node['address']['interface']} (this host holds "
            "127.0.0.1; loopback: every node on this host)") in said


def test_a_head_that_does_not_hold_the_master_address_is_refused_node_unreachable(capsys, edge_cpu):
    code, doc = _plan(capsys, "--node-rank", "0", "--master-addr", "192.0.2.1")  # TEST-NET-1: nobody's
    assert code == 2
    [refusal] = [r for r in doc["refusals"] if r["code"] == "node_unreachable"]
    assert refusal["message"].startswith("node 0 (the head): ") and refusal["remedy"]
    assert refusal["details"]["master_ip"] == "192.0.2.1" and refusal["details"]["problem"]


def test_a_plan_from_a_saved_device_list_reads_no_address_here():
    from edge_core.plan.parallel import ParallelRequest
    from edge_core.runtime.admission import FoundDevices, with_node_address

    request = ParallelRequest(tp=2, nnodes=2, node_rank=1, master_addr="127.0.0.1")
    assert with_node_address(request, FoundDevices(None, [], "file:node-b.json")).address is None
    assert with_node_address(request, FoundDevices(None, [], "probed")).address is not None


def test_node_unreachable_is_a_refusal_code_with_its_details():
    from edge_core.plan.parallel import ParallelRequest
    from edge_core.plan.parallel.search import _address_refusals
    from edge_core.plans import REFUSAL_CODES

    assert "node_unreachable" in REFUSAL_CODES
    gone = NodeAddress("node-a", "10.9.0.1", problem="this host has no route to --master-addr node-a (10.9.0.1)")
    [refusal] = _address_refusals(ParallelRequest(tp=2, nnodes=2, node_rank=1, master_addr="node-a", address=gone))
    assert refusal.code == "node_unreachable" and "ip route get 10.9.0.1" in refusal.remedy
    fine = NodeAddress("node-a", "10.0.0.1", "eth0", "10.0.0.2")
    assert _address_refusals(ParallelRequest(tp=2, nnodes=2, node_rank=1, master_addr="node-a", address=fine)) == []
