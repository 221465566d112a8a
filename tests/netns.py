"""Two hosts that are really two: network namespaces joined by a veth pair, made and removed by the caller.

Each "host" is a network namespace with its own loopback, one end of a veth
pair and an address from 10.231.0.0/16 (a /24 no interface of this host
holds), and a private ``/dev/shm`` for what runs in it (``unshare --mount``
and a tmpfs of its own: vLLM decides which ranks share a host, and its CPU
collectives use shared memory, by what ``/dev/shm`` they see). The host name
still resolves to loopback in both, as on Debian hosts and on this VM. Used
by tests/test_nodes_netns.py and bench/nodes_faults.py; :func:`unavailable`
names why namespaces cannot be made here (not root, no ``ip``, no netns or
veth support), and :class:`Namespaces` always removes what it made, killing
whatever still runs inside its own namespaces first.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Every namespace and veth this module makes starts with this (and the maker's pid), so leftovers of a
#: killed run are recognised and removed by the next.
PREFIX = "edgt"
#: The addresses the pairs take their /24 from.
SUBNET = "10.231"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why two namespaces joined by a veth pair cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run as root, as CI does"
    for tool in ("ip", "unshare", "mount", "taskset"):
        if shutil.which(tool) is None:
            return f"needs `{tool}` on PATH (iproute2, util-linux)"
    probe = f"{PREFIX}{os.getpid()}p"
    try:
        made = _ip("netns", "add", probe, check=False)
        if made.returncode != 0:
            return f"`ip netns add` fails here: {made.stderr.strip() or made.returncode}"
        veth = _ip("link", "add", f"{probe}x", "type", "veth", "peer", "name", f"{probe}y", check=False)
        if veth.returncode != 0:
            return f"no veth pairs here: {veth.stderr.strip() or veth.returncode}"
        _ip("link", "del", f"{probe}x", check=False)
        shm = subprocess.run(["ip", "netns", "exec", probe, "unshare", "--mount", "--propagation", "private", "sh",
                              "-c", "mount -t tmpfs tmpfs /dev/shm"], capture_output=True, text=True, timeout=30)
        if shm.returncode != 0:
            return f"a private /dev/shm cannot be mounted in a namespace: {shm.stderr.strip() or shm.returncode}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"network namespaces cannot be made here: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def remove_stale() -> None:
    """Namespaces and veths of this module whose maker is gone (a run killed before it cleaned up)."""
    listed = _ip("netns", "list", check=False).stdout.split()
    for name in listed:
        if not name.startswith(PREFIX):
            continue
        pid = "".join(ch for ch in name[len(PREFIX):] if ch.isdigit())
        if pid and not os.path.exists(f"/proc/{pid}"):
            _kill_inside(name)
            _ip("netns", "del", name, check=False)


def _kill_inside(ns: str, grace_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process in namespace ``ns`` (only ever one of ours); the live pids it found."""
    found = _alive(pids_in(ns))
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids_in(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _alive(pids_in(ns)):
            time.sleep(0.1)
        if not _alive(pids_in(ns)):
            break
    return found


def pids_in(ns: str) -> list[int]:
    """The processes whose network namespace is ``ns`` (``ip netns pids``)."""
    out = _ip("netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def _alive(pids: Sequence[int]) -> list[int]:
    """``pids`` that are still running (not zombies waiting to be reaped by their parent)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except (OSError, IndexError):
            continue
    return out


def _free_subnet() -> str:
    """``10.231.X``: a /24 no interface of this host holds now."""
    import psutil

    held = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    third = [n for n in range(1, 255) if not any(h.startswith(f"{SUBNET}.{n}.") for h in held)]
    return f"{SUBNET}.{random.choice(third)}"


#: A user-space wire between two TUN devices, one in each namespace: every packet from argv[2] (in namespace
#: argv[1]) is written to argv[4] (in argv[3]) after argv[5] ms, and back after argv[6] ms. netem's ``delay``
#: where the kernel has no netem (this VM's: "Specified qdisc kind is unknown"); order is kept (a fixed delay).
WIRE = r"""
import collections, ctypes, fcntl, os, struct, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)

def tun(ns, name):
    home, there = os.open("/proc/self/ns/net", os.O_RDONLY), os.open(f"/run/netns/{ns}", os.O_RDONLY)
    if libc.setns(there, 0x40000000) != 0:  # CLONE_NEWNET: this thread only, before any other starts
        raise OSError(ctypes.get_errno(), f"setns {ns}")
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, 0x400454CA, struct.pack("16sH", name.encode(), 0x0001 | 0x1000))  # TUNSETIFF: IFF_TUN|NO_PI
    libc.setns(home, 0x40000000)
    os.close(home), os.close(there)
    return fd

def pump(src, dst, delay_s):
    queue, ready = collections.deque(), threading.Condition()
    def write():
        while True:
            with ready:
                while not queue:
                    ready.wait()
                due, packet = queue.popleft()
            time.sleep(max(due - time.monotonic(), 0))
            os.write(dst, packet)
    threading.Thread(target=write, daemon=True).start()
    while True:
        packet = os.read(src, 65536)
        with ready:
            queue.append((time.monotonic() + delay_s, packet))
            ready.notify()

a, b = tun(sys.argv[1], sys.argv[2]), tun(sys.argv[3], sys.argv[4])
threading.Thread(target=pump, args=(a, b, float(sys.argv[5]) / 1000), daemon=True).start()
threading.Thread(target=pump, args=(b, a, float(sys.argv[6]) / 1000), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


class Namespaces:
    """Two network namespaces, ``head`` and ``node``, joined by a veth pair; removed on leaving.

    ``head_ip``/``node_ip`` are the link's addresses, ``head_if``/``node_if``
    their interface names (what each node's ranks must use). ``wire_delay_ms``
    (head to node, node to head) joins them by :data:`WIRE` instead: two TUN
    devices and a process that copies packets between them that much later.
    """

    def __init__(self, tag: str = "", wire_delay_ms: tuple[float, float] | None = None) -> None:
        remove_stale()
        stem = f"{PREFIX}{os.getpid()}{tag}"
        self.head, self.node = f"{stem}a", f"{stem}b"
        self.head_if, self.node_if = f"{stem}a"[:15], f"{stem}b"[:15]
        subnet = _free_subnet()
        self.head_ip, self.node_ip = f"{subnet}.1", f"{subnet}.2"
        self.wire_delay_ms = wire_delay_ms
        self.wire: subprocess.Popen[str] | None = None
        self.left: dict[str, list[int]] = {}

    def __enter__(self) -> Namespaces:
        try:
            for ns in (self.head, self.node):
                _ip("netns", "add", ns)
            if self.wire_delay_ms is None:
                _ip("link", "add", self.head_if, "type", "veth", "peer", "name", self.node_if)
            for ns, dev, addr in ((self.head, self.head_if, self.head_ip), (self.node, self.node_if, self.node_ip)):
                if self.wire_delay_ms is None:
                    _ip("link", "set", dev, "netns", ns)
                else:
                    _ip("-n", ns, "tuntap", "add", "dev", dev, "mode", "tun")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
            if self.wire_delay_ms is not None:
                there, back = self.wire_delay_ms
                self.wire = subprocess.Popen([sys.executable, "-c", WIRE, self.head, self.head_if, self.node,
                                              self.node_if, str(there), str(back)], stdout=subprocess.PIPE, text=True)
                assert self.wire.stdout is not None and self.wire.stdout.readline().strip() == "ready"
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        """Kill what still runs inside (recorded in ``left``), then delete both namespaces and with them the link."""
        for ns in (self.head, self.node):
            self.left[ns] = _kill_inside(ns)
        if self.wire is not None:
            self.wire.kill()
            self.wire.wait(10)
        for ns in (self.head, self.node):
            _ip("netns", "del", ns, check=False)

    def command(self, ns: str, argv: Sequence[str], cpus: str | None = None) -> list[str]:
        """``argv`` run in namespace ``ns`` with a private ``/dev/shm`` (and on ``cpus``, a taskset list)."""
        pinned = ["taskset", "-c", cpus, *argv] if cpus is not None else list(argv)
        return ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh", *pinned]

    def set_link(self, ns: str, up: bool) -> None:
        """Take the veth end in ``ns`` down (or up again)."""
        _ip("-n", ns, "link", "set", self.head_if if ns == self.head else self.node_if, "up" if up else "down")

    def running(self, ns: str) -> list[int]:
        """The live processes inside namespace ``ns``."""
        return _alive(pids_in(ns))


# ---------------------------------------------------------------- two edge nodes, one in each namespace

#: What a client inside a namespace runs: POST argv[2] (JSON; GET when empty) to argv[1]; each line of the answer
#: is printed with the monotonic time it came, then ``END <status>`` (or ``ERROR <what>``). Streams as they come.
CLIENT = r"""
import json, sys, time, urllib.request
body = sys.argv[2].encode() or None
request = urllib.request.Request(sys.argv[1], body, {"Content-Type": "application/json"} if body else {})
try:
    with urllib.request.urlopen(request, timeout=float(sys.argv[3])) as answer:
        for line in answer:
            print(f"{time.monotonic():.3f} {line.decode().rstrip()}", flush=True)
        print(f"END {answer.status}", flush=True)
except Exception as exc:
    print(f"ERROR {type(exc).__name__}: {exc}", flush=True)
"""


@dataclass
class Pair:
    """``edge serve --nnodes 2``: node 0 (the head) in one namespace, node 1 in the other."""

    spaces: Namespaces
    head: subprocess.Popen[str]
    node: subprocess.Popen[str]
    url: str
    logs: Path
    ready_s: float = 0.0
    started: float = 0.0

    def wait_ready(self, timeout_s: float) -> bool:
        """True once the head says it serves (``ready_s`` set); False if either node ends first or time runs out."""
        while time.monotonic() - self.started < timeout_s:
            if "edge: serving " in self.err("head"):
                self.ready_s = time.monotonic() - self.started
                return True
            if self.head.poll() is not None or self.node.poll() is not None:
                return False
            time.sleep(0.5)
        return False

    def err(self, which: str) -> str:
        return (self.logs / f"{which}.err").read_text()

    def output(self) -> str:
        return "\n".join(f"--- {which}\n{self.err(which)[-4000:]}" for which in ("head", "node"))

    def post(self, path: str, body: dict[str, Any] | None, timeout_s: float = 120) -> subprocess.Popen[str]:
        """A client in the head's namespace, POSTing ``body`` (None: a GET); its stdout is :data:`CLIENT`'s lines."""
        argv = [sys.executable, "-c", CLIENT, f"{self.url}{path}", json.dumps(body) if body is not None else "",
                str(timeout_s)]
        return subprocess.Popen(["ip", "netns", "exec", self.spaces.head, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)

    def complete(self, body: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
        return self.ask("/v1/completions", body, timeout_s)

    def ask(self, path: str, body: dict[str, Any] | None = None, timeout_s: float = 120) -> dict[str, Any]:
        """The head's JSON answer to ``path`` (POST ``body``, or GET), asked from inside its namespace."""
        client = self.post(path, body, timeout_s)
        out, _ = client.communicate(timeout=timeout_s + 30)
        lines = out.splitlines()
        assert lines and lines[-1] == "END 200", out
        return json.loads("".join(line.split(" ", 1)[1] for line in lines[:-1]))

    def stop(self) -> None:
        for proc in (self.head, self.node):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (self.head, self.node):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)


def start_pair(spaces: Namespaces, logs: Path, model_args: Sequence[str], *, port: int = 8000,
               master_port: int = 29501, ready_timeout_s: float = 600, node_delay_s: float = 0.0,
               head_args: Sequence[str] = (), node_args: Sequence[str] = ()) -> Pair:
    """Node 1 in ``spaces.node`` (core 1), the head in ``spaces.head`` (core 0), serving at the head's veth address.

    Returns once the head says it serves; AssertionError with both logs if either ends first (both stopped).
    ``node_delay_s`` starts the node that long after the head.
    """
    pair = launch_pair(spaces, logs, model_args, port=port, master_port=master_port, node_delay_s=node_delay_s,
                       head_args=head_args, node_args=node_args)
    if not pair.wait_ready(ready_timeout_s):
        pair.stop()
        raise AssertionError(f"the pair did not come up (head rc {pair.head.poll()}, node rc {pair.node.poll()}):\n"
                             f"{pair.output()}")
    return pair


def launch_pair(spaces: Namespaces, logs: Path, model_args: Sequence[str], *, port: int = 8000,
                master_port: int = 29501, node_delay_s: float = 0.0, head_args: Sequence[str] = (),
                node_args: Sequence[str] = ()) -> Pair:
    """:func:`start_pair` without waiting: both nodes started (the node ``node_delay_s`` after the head)."""
    logs.mkdir(parents=True, exist_ok=True)
    common = [*model_args, "--nnodes", "2", "--master-port", str(master_port), "--max-model-len", "512", "--json"]
    started = time.monotonic()
    head = launch_node(spaces, logs, "head", [*common, "--master-addr", spaces.head_ip, "--node-rank", "0",
                                              "--host", spaces.head_ip, "--port", str(port), *head_args])
    if node_delay_s:
        time.sleep(node_delay_s)
    node = launch_node(spaces, logs, "node", [*common, "--master-addr", spaces.head_ip, "--node-rank", "1",
                                              *node_args])
    return Pair(spaces, head, node, f"http://{spaces.head_ip}:{port}", logs, started=started)


def launch_node(spaces: Namespaces, logs: Path, which: str, args: Sequence[str]) -> subprocess.Popen[str]:
    """``edge serve ARGS`` in the head's namespace on core 0 (``which`` head) or the node's on core 1; stderr to
    ``logs/WHICH.err``."""
    err = open(logs / f"{which}.err", "w")  # noqa: SIM115 — the process owns it
    ns, cpus = (spaces.head, "0") if which == "head" else (spaces.node, "1")
    argv = [sys.executable, "-m", "edge_core", "serve", *args]
    return subprocess.Popen(spaces.command(ns, argv, cpus), stdout=subprocess.PIPE, stderr=err,
                            stdin=subprocess.DEVNULL, text=True)


def tcp_between(pid: int, local_ip: str, remote_ip: str) -> list[tuple[int, int]]:
    """Established TCP connections from ``local_ip`` to ``remote_ip`` in ``pid``'s network namespace: (local port,
    remote port) pairs, from ``/proc/PID/net/tcp`` (the namespace's own table)."""

    def hex_ip(ip: str) -> str:
        return "".join(f"{int(part):02X}" for part in reversed(ip.split(".")))

    out = []
    with open(f"/proc/{pid}/net/tcp") as table:
        for row in table.read().splitlines()[1:]:
            fields = row.split()
            (here, here_port), (there, there_port), state = fields[1].split(":"), fields[2].split(":"), fields[3]
            if state == "01" and here == hex_ip(local_ip) and there == hex_ip(remote_ip):
                out.append((int(here_port, 16), int(there_port, 16)))
    return out
