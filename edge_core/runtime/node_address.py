"""Which interface and address do this node's ranks use to reach the head of a ``--nnodes`` session?

vLLM's ranks on several nodes meet through torch.distributed's Gloo groups and
vLLM's own message queues, and each side advertises an address the others
connect to: Gloo the address this host's name resolves to (unless
``GLOO_SOCKET_IFNAME`` names an interface), vLLM's queues ``VLLM_HOST_IP`` (else
the source address of a route to 8.8.8.8, else 0.0.0.0). Where the host name
resolves to loopback (Debian's 127.0.1.1, ``vm`` -> 127.0.0.1 here) or there is
no default route, those are addresses no other node can reach, and the ranks
never meet (docs/vllm-cpu-facts.md#more-than-one-machine). The one address that
matters is known: ``--master-addr``. This reads the way to it — a UDP socket
connected to it, whose local address the kernel picks by its routes (nothing
is sent) — and the interface that holds that local address; on the head, the
interface that holds the master address itself. The planner sets the engine's
environment from it and refuses ``node_unreachable`` when there is none.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..layout import NodeAddress


@dataclass(frozen=True)
class Interface:
    """One network interface of this host: its name, its addresses, and whether it is up."""

    name: str
    addresses: tuple[str, ...]
    up: bool


def host_interfaces() -> list[Interface]:
    """This host's interfaces (psutil's table: every IPv4 and IPv6 address, and the link state)."""
    import psutil

    stats = psutil.net_if_stats()
    out = []
    for name, addrs in psutil.net_if_addrs().items():
        ips = tuple(a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
        out.append(Interface(name, ips, bool(stats[name].isup) if name in stats else False))
    return out


def resolve(name: str) -> list[str]:
    """The IP addresses ``name`` resolves to here, IPv4 first (what torch's TCPStore and Gloo connect to)."""
    infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    ips = [str(info[4][0]) for info in infos]
    return sorted(dict.fromkeys(ips), key=lambda ip: ":" in ip)


def source_toward(ip: str, port: int) -> str:
    """The local address this host's routes pick to reach ``ip`` (a connected UDP socket: nothing is sent)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((ip, port))
        return str(probe.getsockname()[0])


def read_node_address(master_addr: str, master_port: int, node_rank: int, *,
                      resolver: Callable[[str], Sequence[str]] = resolve,
                      route: Callable[[str, int], str] = source_toward,
                      interfaces: Callable[[], Sequence[Interface]] = host_interfaces) -> NodeAddress:
    """Where node ``node_rank``'s ranks reach the head at ``master_addr``; the ``problem`` when nowhere.

    ``resolver``, ``route`` and ``interfaces`` are the boundary (the host's
    resolver, its routing table, its interface table), injected by tests.
    """
    try:
        ips = list(resolver(master_addr))
    except OSError as exc:
        ips, why = [], exc.strerror or str(exc)
    else:
        why = "no address"
    if not ips:
        return NodeAddress(master_addr, None, problem=f"--master-addr {master_addr} does not resolve on this host "
                                                      f"({why})")
    ip = ips[0]
    named = master_addr if master_addr == ip else f"{master_addr} ({ip})"
    try:
        source = route(ip, master_port)
    except OSError as exc:
        return NodeAddress(master_addr, ip, problem=f"this host has no route to --master-addr {named}: "
                                                    f"{exc.strerror or exc}")
    table = list(interfaces())
    loopback = ipaddress.ip_address(ip).is_loopback
    local = loopback or any(ip in i.addresses for i in table)
    owner = _holder(source, table)
    if owner is None:
        return NodeAddress(master_addr, ip, None, source, local,
                           problem=f"the route to {ip} leaves from {source}, which no interface of this host holds")
    if node_rank == 0 and not local:
        return NodeAddress(master_addr, ip, owner.name, source, local,
                           problem=f"--master-addr {named} is not an address of this host, which must hold it: the "
                                   f"ranks and edge's side channel listen there (the route to it leaves through "
                                   f"{owner.name} {source})")
    if not owner.up:
        return NodeAddress(master_addr, ip, owner.name, source, local,
                           problem=f"interface {owner.name} ({source}), the way to {ip}, is down")
    return NodeAddress(master_addr, ip, owner.name, source, local)


def _holder(address: str, table: Sequence[Interface]) -> Interface | None:
    """The interface that holds ``address`` (up ones first); any loopback address is the loopback interface's."""
    holders = sorted((i for i in table if address in i.addresses), key=lambda i: not i.up)
    if holders:
        return holders[0]
    if ipaddress.ip_address(address).is_loopback:
        return next((i for i in table if any(ipaddress.ip_address(a).is_loopback for a in i.addresses)), None)
    return None
