"""How the nodes of one ``--nnodes`` session meet, agree, and stay joined.

vLLM's multi-node executor joins nodes through ``torch.distributed`` at
``master_addr:master_port`` once their workers start, and it checks nothing
else: nodes started with another layout or another model hang there or fail
deep inside a worker, and a headless node outlives its head
(docs/vllm-cpu-facts.md#more-than-one-machine). So before any worker starts,
edge's own nodes meet on a side channel, one TCP port above vLLM's
(:func:`link_port`): each node > 0 connects to the head and sends a small JSON
descriptor (:func:`descriptor`: layout, model artifact id, builds); the head
waits for every node, compares, and answers each ``ok`` or a named
``node_mismatch``. The connection then stays open as the session's lifeline:
the head says ``stop`` when it stops, and either side that sees the other's
end of it close (a crash, ``kill -9``) ends its own session with ``node_lost``
or ``head_lost`` (:class:`Lifeline`). A session that ends before the nodes agreed
says so too (:func:`tell_early_end`): a head whose plan is refused, or that
fails or is stopped before its workers start, answers every node that comes
with a named code (``head_refused``, ``head_failed``, ``head_stopped``), and a
node whose own plan is refused tells the head, which fails with ``node_refused``
naming it; no node waits out :data:`JOIN_TIMEOUT_S` for a head that is gone.

Agreeing is not enough: vLLM's ranks connect to the addresses each node
advertises (:mod:`.node_address`), on ports of their own. So once the nodes
agree, each side connects to a port the other opens on its advertised address
(:data:`PROBE_TIMEOUT_S`), and a failure ends every node with
``node_unreachable`` before any rank starts. Before that the head checks that
vLLM's master port is free (``master_port_in_use``, naming the holder); a second
node with a rank already joined is turned away alone (``node_rank_taken``), then
and for the session's life. The connections carry TCP keepalives, so a link
that goes down (no end of stream ever comes) is a lost node or head within
:data:`LINK_TIMEOUT_S`.

One JSON object per line, UTF-8, on a plain TCP connection: the nodes of a
session trust each other as vLLM's do (the workers' own channels are plain too).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._version import __version__
from ..errors import EXIT_REFUSED, NodeError, UsageError

if TYPE_CHECKING:
    from ..plans import Plan

#: Seconds the head waits for every other node to join, and a node for the head to answer.
JOIN_TIMEOUT_S = 300.0
#: Seconds a node whose session ended before the nodes agreed (its plan refused, its start failed) stays to
#: tell the others: the nodes of one session are started within moments of each other, by hand or by a script.
NOTICE_S = 60.0
#: Seconds between a node's attempts to reach a head that is not listening yet.
RETRY_S = 0.5
#: Longest descriptor or message line accepted (bytes).
MAX_LINE = 65536
#: The descriptor fields every node must share with the head (compared in this order).
AGREED = ("protocol", "nnodes", "tensor_parallel_size", "pipeline_parallel_size", "master_port", "artifact_id",
          "backend", "builds", "engine")
#: Engine arguments that may differ between nodes: their own rank, and bytes each node sizes for itself.
NODE_OWN_KWARGS = ("node_rank", "model", "gpu_memory_utilization", "master_addr")
#: The descriptor's format; a node of another edge with another format is named as a mismatch.
PROTOCOL = 2
#: Seconds each side gives a connection to the other's advertised address once the nodes agree (a firewall that
#: drops it is a timeout, one that rejects it is at once).
PROBE_TIMEOUT_S = 5.0
#: Seconds a side-channel connection may go unanswered (TCP keepalives every second after 2 s idle, and
#: TCP_USER_TIMEOUT) before the other side is lost: a link taken down closes nothing.
LINK_TIMEOUT_S = 8.0


def link_port(master_port: int) -> int:
    """The side channel's port: the one above vLLM's ``master_port``."""
    return master_port + 1


def node_of(plan: Plan) -> dict[str, Any] | None:
    """The plan's ``parallel.node`` (None for a one-node plan)."""
    return (plan.parallel or {}).get("node")


def descriptor(plan: Plan, builds: dict[str, str], node: dict[str, Any] | None = None) -> dict[str, Any]:
    """What this node tells the others: what it runs, and with which build (and why not, when refused).

    ``node`` is the session's node (default: the plan's ``parallel.node``; a plan refused before its
    layout was built has none, and the command line gives it).
    """
    node = node or node_of(plan)
    assert node is not None
    kwargs = plan.engine_kwargs or {}
    return {
        "protocol": PROTOCOL, "edge": __version__, "node_rank": node["node_rank"], "nnodes": node["nnodes"],
        "host": socket.gethostname(), "pid": os.getpid(),
        "tensor_parallel_size": kwargs.get("tensor_parallel_size"),
        "pipeline_parallel_size": kwargs.get("pipeline_parallel_size"), "master_port": node["master_port"],
        "artifact_id": plan.manifest.artifact_id if plan.manifest is not None else None, "backend": plan.backend,
        "builds": builds, "engine": {k: v for k, v in sorted(kwargs.items()) if k not in NODE_OWN_KWARGS},
        "refused": [] if plan.admitted else [f"[{r.code}] {r.message}" for r in plan.refusals],
        "address": node.get("address"),
    }


def refused_notice(plan: Plan) -> NodeError:
    """``head_refused``: what the head answers its nodes when its own plan is refused."""
    reasons = "; ".join(f"[{r.code}] {r.message}" for r in plan.refusals) or "refused"
    return NodeError("head_refused", f"node 0 (the head, {socket.gethostname()}) refused its own plan: {reasons}; "
                     "nothing was started; fix it there, then start every node again", EXIT_REFUSED)


def disagreement(head: dict[str, Any], other: dict[str, Any]) -> str | None:
    """What ``other`` disagrees with the head about, in words; None when they agree."""
    for key in AGREED:
        if head.get(key) != other.get(key):
            if isinstance(head.get(key), dict) and isinstance(other.get(key), dict):
                names = sorted(k for k in set(head[key]) | set(other[key]) if head[key].get(k) != other[key].get(k))
                rows = "; ".join(f"{k}: head {head[key].get(k)!r}, node {other[key].get(k)!r}" for k in names)
                return f"{key} differs ({rows})"
            return f"{key} differs (head {head.get(key)!r}, node {other.get(key)!r})"
    return None


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(json.dumps(message, default=str).encode() + b"\n")


def _read_line(sock: socket.socket, deadline: float) -> dict[str, Any] | None:
    """One JSON line, None at end of stream; NodeError on garbage or past ``deadline``."""
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(min(left, 1.0))
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            continue
        if not chunk:
            return None
        data += chunk
        if len(data) > MAX_LINE:
            raise ValueError("line too long")
    message = json.loads(data)
    if not isinstance(message, dict):
        raise ValueError("not an object")
    return message


class Lifeline:
    """The open connections of a joined session; :meth:`watch` ends this process's session when one closes.

    ``ended`` says why (``node_lost: ...`` / ``head_lost: ...``, or a stop the
    head announced); ending means SIGTERM to this process, which every
    command already takes as its stop (a server drains, a run cancels, a
    headless node shuts its workers down). On the head, ``door`` is the side
    channel's listener, kept open for the session's life: a node that comes
    after the session started is told ``node_rank_taken`` (its rank is here).
    """

    def __init__(self, peers: dict[int, socket.socket], head: bool, on_end: Callable[[], None] | None = None,
                 door: socket.socket | None = None, joined_from: dict[int, dict[str, Any]] | None = None,
                 say: Any = None):
        self.peers = peers
        self.head = head
        self.on_end = on_end or terminate_self
        self.door = door
        self.joined_from = joined_from or {}
        self.say = say
        self.ended: str | None = None
        self.lost: NodeError | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    def watch(self) -> Lifeline:
        import selectors

        selector = selectors.DefaultSelector()
        for rank, sock in self.peers.items():
            sock.settimeout(None)
            keep_alive(sock)
            selector.register(sock, selectors.EVENT_READ, rank)
        if self.door is not None:
            selector.register(self.door, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, args=(selector,), name="edge-node-lifeline", daemon=True)
        self._thread.start()
        return self

    def _loop(self, selector: Any) -> None:
        with contextlib.suppress(OSError, ValueError):  # a socket closed under the selector: this side is closing
            self._watch(selector)

    def _watch(self, selector: Any) -> None:
        while not self._closing:
            for key, _ in selector.select(timeout=0.5):
                rank = key.data
                if rank is None:
                    self._turn_away()
                    continue
                failed: OSError | None = None
                try:
                    chunk = key.fileobj.recv(4096)
                except OSError as exc:
                    chunk, failed = b"", exc
                if self._closing:
                    return
                stop = _stop_of(chunk) if chunk and not self.head else None
                if stop is not None:
                    why = str(stop.get("reason") or "stopped")
                    failed_head = NodeError(str(stop["code"]), str(stop.get("message") or why)) \
                        if stop.get("code") else None
                    self._end(f"the head stopped ({why})", failed_head)
                    return
                if not chunk:
                    self._end(*_lost(rank, self.head, failed))
                    return

    def _turn_away(self) -> None:
        """A node that comes while the session runs: answered ``node_rank_taken`` (or a mismatch) in a thread."""
        assert self.door is not None
        try:
            sock, where = self.door.accept()
        except OSError:
            return
        threading.Thread(target=self._answer_late, args=(sock, str(where[0])), name="edge-node-door",
                         daemon=True).start()

    def _answer_late(self, sock: socket.socket, where: str) -> None:
        with contextlib.closing(sock):
            try:
                theirs = _read_line(sock, time.monotonic() + 10)
            except (TimeoutError, ValueError, OSError):
                return
            if theirs is None:
                return
            error = _taken(theirs, where, self.joined_from) or NodeError(
                "node_mismatch", f"node {theirs.get('node_rank')} ({theirs.get('host')}, {where}) came after the "
                                 "session started with every node; start it with the session's other nodes",
                EXIT_REFUSED)
            if self.say is not None:
                self.say(f"turned away node {theirs.get('node_rank')} from {theirs.get('host')} ({where}): {error.code}")
            _answer(sock, error)

    def _end(self, why: str, lost: NodeError | None) -> None:
        self.ended, self.lost = why, lost
        self.on_end()

    def close(self, reason: str = "stopped", failure: NodeError | None = None) -> None:
        """Tell the other nodes this session is over (the head's ``stop``, with ``failure``'s code when it
        failed), then close every connection."""
        self._closing = True
        for sock in self.peers.values():
            with contextlib.suppress(OSError):
                if self.head:
                    extra = {"code": failure.code, "message": failure.message} if failure is not None else {}
                    _send(sock, {"event": "stop", "reason": reason, **extra})
                sock.close()
        if self.door is not None:
            with contextlib.suppress(OSError):
                self.door.close()
        if self._thread is not None:
            self._thread.join(2)


#: A connection the other side did not answer (a link down, a host gone) rather than one it closed.
_SILENT = (errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ECONNRESET)


def _lost(rank: int, head: bool, failed: OSError | None) -> tuple[str, NodeError]:
    """Why the other side is gone, in words: it closed its connection, or it stopped answering."""
    silent = failed is not None and failed.errno in _SILENT
    if head:
        how = (f"stopped answering on the side channel ({failed.strerror or failed} after {LINK_TIMEOUT_S:.0f} s "
               "without a reply: the link to it is down or its host is gone)" if silent and failed is not None else
               "closed its connection to the head (its edge process ended: stopped, crashed or killed)")
        return f"node {rank} went away", NodeError(
            "node_lost", f"node {rank} of this session {how}; the session cannot go on without its ranks; start "
                         "that node again, then this one")
    how = (f"stopped answering on the side channel ({failed.strerror or failed} after {LINK_TIMEOUT_S:.0f} s "
           "without a reply: the link to it is down or its host is gone)" if silent and failed is not None else
           "closed its connection without a stop (its edge process ended: crashed or killed)")
    return "the head went away", NodeError("head_lost", f"node 0 (the head) {how}; this node's ranks are stopped")


def keep_alive(sock: socket.socket, timeout_s: float = LINK_TIMEOUT_S) -> None:
    """TCP keepalives on ``sock`` (after 2 s idle, every second), and unanswered data or probes end it after
    ``timeout_s``: a side whose link is down is then seen as gone, not waited on forever."""
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(int(timeout_s) - 2, 1))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(timeout_s * 1000))


def _taken(theirs: dict[str, Any], where: str, joined_from: dict[int, dict[str, Any]]) -> NodeError | None:
    """``node_rank_taken`` when a node of ``theirs``'s rank already joined this session, else None."""
    rank = theirs.get("node_rank")
    first = joined_from.get(rank) if isinstance(rank, int) else None
    if first is None:
        return None
    return NodeError("node_rank_taken", f"node {rank} of this session already joined from {first.get('host')} "
                     f"({first.get('where')}, pid {first.get('pid')}); this one ({theirs.get('host')}, {where}, pid "
                     f"{theirs.get('pid')}) was not started: stop the other first (that ends the session), or give "
                     "this one the --node-rank it was meant to have", EXIT_REFUSED)


def terminate_self() -> None:
    """SIGTERM to this process: the stop path every command already has (drain, cancel, shut the workers down)."""
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_of(chunk: bytes) -> dict[str, Any] | None:
    """The head's ``stop`` message in what a node received, None if there is none."""
    for line in chunk.splitlines():
        with contextlib.suppress(ValueError):
            message = json.loads(line)
            if isinstance(message, dict) and message.get("event") == "stop":
                return message
    return None


def head_failure(exc: BaseException) -> NodeError | None:
    """How the head's early end is named to the other nodes: None for a stop (a signal), ``head_failed`` else."""
    if isinstance(exc, KeyboardInterrupt):
        return None
    what = f"{exc.code}: {exc.message}" if isinstance(exc, NodeError) else f"{type(exc).__name__}: {exc}"
    return NodeError("head_failed", f"node 0 (the head) failed, so this session ends: {what}")


@contextlib.contextmanager
def joined(plan: Plan, builds: dict[str, str], say: Any = None,
           on_end: Callable[[], None] | None = None) -> Iterator[Lifeline | None]:
    """Inside: this node has met the others, they agree and reach each other; the lifeline watches them.

    None for one node. The head (node 0) checks that vLLM's master port is
    free, listens on :func:`link_port`, waits up to :data:`JOIN_TIMEOUT_S` for
    every other node and checks each descriptor, then each side connects to a
    port the other opens on its advertised address; another node connects to
    the head (retrying while it is not up yet) and waits for its answer.
    Raises :class:`NodeError` (exit 2) for a port in use, a mismatch, a node
    that refused its own plan, a node that never came, or nodes that cannot
    reach each other's addresses, before any worker starts. Leaving tells the
    other nodes to stop (the head; with ``head_failed`` when the body raised)
    and closes the connections. ``on_end`` is what the lifeline does when the
    session ends from the other side (default: :func:`terminate_self`).
    """
    node = node_of(plan)
    if node is None:
        yield None
        return
    mine = descriptor(plan, builds)
    address = (node["master_addr"], link_port(node["master_port"]))
    if node["node_rank"] == 0:
        peers, door, joined_from = _gather(mine, address, node["nnodes"], node["master_port"], say)
        line = Lifeline(peers, head=True, on_end=on_end, door=door, joined_from=joined_from, say=say).watch()
    else:
        line = Lifeline(_join(mine, address, say), head=False, on_end=on_end).watch()
    try:
        yield line
    except BaseException as exc:
        line.close(f"interrupted ({exc})" if isinstance(exc, KeyboardInterrupt) else "it failed", head_failure(exc))
        raise
    line.close("the head stopped" if line.head else "stopped")


def _gather(mine: dict[str, Any], address: tuple[str, int], nnodes: int, master_port: int, say: Any
            ) -> tuple[dict[int, socket.socket], socket.socket, dict[int, dict[str, Any]]]:
    """Every other node, joined and checked: their connections, the listener (the door), and where each came from."""
    listener = _listen(address)
    peers: dict[int, socket.socket] = {}
    joined_from: dict[int, dict[str, Any]] = {}
    try:
        busy = master_port_holder(master_port)
        if busy is not None:
            in_use = NodeError("master_port_in_use", f"port {master_port} (vLLM's --master-port, where the ranks of "
                              f"every node meet) is already in use on the head's host ({socket.gethostname()}, "
                              f"{address[0]}){busy}; nothing was started: stop that process, or start every node "
                              "with another --master-port", EXIT_REFUSED)
            _tell_rest(listener, {}, in_use, nnodes, say)
            raise in_use
        if say is not None:
            say(f"node 0 of {nnodes}: waiting for {nnodes - 1} other node{'s' if nnodes > 2 else ''} at "
                f"{address[0]}:{address[1]} (up to {JOIN_TIMEOUT_S:.0f} s){_uses(mine, 'its')}")
        for sock, theirs, where in _arrivals(listener, time.monotonic() + JOIN_TIMEOUT_S):
            rank = theirs.get("node_rank")
            taken = _taken(theirs, where, joined_from)
            if taken is not None:  # a second node of a rank already here: turned away alone
                if say is not None:
                    say(f"turned away a second node {rank} from {theirs.get('host')} ({where}): {taken.code}")
                _answer(sock, taken)
                continue
            error = _refusal_of(theirs, where) or _mismatch(mine, theirs, where, nnodes, peers)
            if error is not None:
                _tell_rest(listener, {**peers, rank if isinstance(rank, int) and rank not in peers else -1: sock},
                           error, nnodes, say)
                raise error
            assert isinstance(rank, int)  # in range and free: checked by _mismatch
            peers[rank] = sock
            joined_from[rank] = {"host": theirs.get("host"), "where": where, "pid": theirs.get("pid"),
                                 "address": theirs.get("address"), "probe_port": theirs.get("probe_port")}
            if say is not None:
                say(f"node {rank} joined from {theirs.get('host')} ({where}): layout, model and build agree"
                    f"{_uses(theirs, 'its')}")
            if len(peers) == nnodes - 1:
                break
        else:
            missing = sorted(set(range(1, nnodes)) - set(peers))
            raise NodeError("node_join_timeout", f"node{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(map(str, missing))} did not join within {JOIN_TIMEOUT_S:.0f} s at "
                            f"{address[0]}:{address[1]}; start `edge ... --node-rank R` on each", EXIT_REFUSED)
        _check_reach(mine, peers, joined_from, say)
        for sock in peers.values():
            _send(sock, {"ok": True, "head_address": mine.get("address")})
    except BaseException as exc:
        stopped = NodeError("head_stopped", f"node 0 (the head) was stopped ({str(exc) or 'SIGINT'}) before "
                            "every node joined; nothing was started", EXIT_REFUSED)
        for sock in peers.values():
            _answer(sock, stopped if isinstance(exc, KeyboardInterrupt) else exc)
        listener.close()
        raise
    return peers, listener, joined_from


def _uses(descriptor: dict[str, Any], whose: str) -> str:
    """``; its ranks use eth0 10.0.0.2`` when the descriptor carries its node's address, else nothing."""
    here = descriptor.get("address") or {}
    return f"; {whose} ranks use {here['interface']} {here['address']}" if here.get("address") else ""


def master_port_holder(port: int) -> str | None:
    """None when vLLM's TCPStore could listen on ``port`` (every address, as it does); else `` by pid N (cmd)``
    or ``""`` when the holder cannot be seen."""
    from .serve import port_holder

    family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            probe.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", port))
            probe.listen(1)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise UsageError(f"the head cannot listen on --master-port {port} ({exc.strerror or exc})") from None
            return port_holder(port)
    return None


def _check_reach(mine: dict[str, Any], peers: dict[int, socket.socket], joined_from: dict[int, dict[str, Any]],
                 say: Any) -> None:
    """The head connects to each node's advertised address and each node to the head's, or ``node_unreachable``.

    vLLM's ranks connect both ways on ports of their own (Gloo's pairs, the
    message queues' ZMQ sockets), so one connection each way to a fresh port on
    the advertised address is what the handshake's own connection (one port,
    one way) does not prove. Skipped for a node whose address was not read (a
    plan made from a saved device list).
    """
    here = mine.get("address") or {}
    if not here.get("address"):
        return
    with contextlib.closing(_probe_listener(here["address"])) as listener:
        port = listener.getsockname()[1]
        for rank, sock in peers.items():
            came = joined_from[rank]
            there = came.get("address") or {}
            if not there.get("address") or not came.get("probe_port"):
                continue
            try:
                out_ms = _reach((there["address"], int(came["probe_port"])))
            except OSError as exc:
                raise NodeError("node_unreachable", f"the head ({here['interface']} {here['address']}) cannot connect "
                                f"to node {rank}'s ranks' address {there['address']} ({there['interface']} on "
                                f"{came['host']}, whose side channel came from {came['where']}): {_why(exc)}; "
                                f"{_UNREACHABLE_REMEDY}", EXIT_REFUSED) from None
            _send(sock, {"event": "probe", "address": here["address"], "port": port})
            reply = _read_line(sock, time.monotonic() + PROBE_TIMEOUT_S + 5) or {"error": "it closed the connection"}
            if not reply.get("ok"):
                raise NodeError("node_unreachable", f"node {rank} ({there['interface']} {there['address']} on "
                                f"{came['host']}) cannot connect to the head's ranks' address {here['address']} "
                                f"({here['interface']}): {reply.get('error')}; {_UNREACHABLE_REMEDY}", EXIT_REFUSED)
            if say is not None:
                say(f"node {rank} and the head reach each other's ranks' addresses ({here['address']} <-> "
                    f"{there['address']}: {out_ms:.1f} ms / {float(reply.get('ms') or 0):.1f} ms to connect)")


#: What to do when the nodes cannot reach each other's ranks: the end of every ``node_unreachable`` message.
_UNREACHABLE_REMEDY = ("vLLM's ranks would not meet, so nothing was started: let the nodes reach each other on those "
                       "addresses (routes, and a firewall open to every TCP port between them), or give "
                       "--master-addr on a network they share")


def _probe_listener(address: str) -> socket.socket:
    """A listener on a fresh port of ``address``, as each rank's own are; ``node_unreachable`` if it cannot be."""
    try:
        return socket.create_server((address, 0), family=socket.AF_INET6 if ":" in address else socket.AF_INET)
    except OSError as exc:
        raise NodeError("node_unreachable", f"this node cannot listen on its own ranks' address {address} "
                        f"({exc.strerror or exc}); {_UNREACHABLE_REMEDY}", EXIT_REFUSED) from None


def _reach(target: tuple[str, int]) -> float:
    """Milliseconds a TCP connection to ``target`` took (closed at once); OSError when none came."""
    started = time.monotonic()
    with socket.create_connection(target, timeout=PROBE_TIMEOUT_S):
        return (time.monotonic() - started) * 1000


def _why(exc: OSError) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {PROBE_TIMEOUT_S:.0f} s"
    return exc.strerror or str(exc)


def _listen(address: tuple[str, int]) -> socket.socket:
    try:
        return socket.create_server(address, reuse_port=False)
    except OSError as exc:
        raise UsageError(f"the head cannot listen on {address[0]}:{address[1]} for its nodes ({exc.strerror or exc}); "
                         "--master-addr must be an address of this host, and --master-port P needs P+1 free too") from None


def _arrivals(listener: socket.socket, deadline: float) -> Iterator[tuple[socket.socket, dict[str, Any], str]]:
    """Each node that connects before ``deadline`` and sends a descriptor: its socket, descriptor and address."""
    while time.monotonic() < deadline:
        listener.settimeout(max(min(deadline - time.monotonic(), 1.0), 0.01))
        try:
            sock, where = listener.accept()
        except TimeoutError:
            continue
        try:
            theirs = _read_line(sock, time.monotonic() + 10)
        except (TimeoutError, ValueError, OSError):
            theirs = None  # not one of ours: a port scan, a stray client
        if theirs is None:
            sock.close()
            continue
        yield sock, theirs, str(where[0])


def _refusal_of(theirs: dict[str, Any], where: str) -> NodeError | None:
    """``node_refused`` when a node's own plan was refused (its descriptor says why), else None."""
    if not theirs.get("refused"):
        return None
    return NodeError("node_refused", f"node {theirs.get('node_rank')} ({theirs.get('host')}, {where}) refused its "
                     f"own plan: {'; '.join(map(str, theirs['refused']))}; fix it there (its own devices and "
                     "ledger), then start every node again", EXIT_REFUSED)


def _mismatch(mine: dict[str, Any], theirs: dict[str, Any], where: str, nnodes: int,
              peers: dict[int, socket.socket]) -> NodeError | None:
    rank = theirs.get("node_rank")
    problem = disagreement(mine, theirs)
    if problem is None and (not isinstance(rank, int) or not 0 < rank < nnodes or rank in peers):
        problem = f"node rank {rank!r} is not free (taken, or not 1 to {nnodes - 1})"
    if problem is None:
        return None
    return NodeError("node_mismatch", f"node {rank} ({theirs.get('host')}, {where}) does not run what the head "
                     f"runs: {problem}; start every node with the same model, layout and edge backend build",
                     EXIT_REFUSED)


def _answer(sock: socket.socket, error: BaseException) -> None:
    """A node's answer that the session will not start, and the end of its connection."""
    with contextlib.suppress(OSError):
        if isinstance(error, NodeError):
            _send(sock, {"ok": False, "code": error.code, "message": error.message})
        else:
            _send(sock, {"ok": False, "code": "head_failed", "message": f"{type(error).__name__}: {error}"})
    with contextlib.suppress(OSError):
        sock.close()


def _tell_rest(listener: socket.socket, told: dict[int, socket.socket], error: NodeError, nnodes: int,
               say: Any) -> None:
    """Answer ``error`` to the nodes already here and to those that come within :data:`NOTICE_S`; Ctrl-C leaves."""
    for sock in told.values():
        _answer(sock, error)
    others = set(range(1, nnodes))
    ranks = set(told) & others
    if ranks == others:
        return
    if say is not None:
        say(f"telling the other node{'s' if nnodes > 2 else ''} ({error.code}) for up to {NOTICE_S:.0f} s "
            "as they come; Ctrl-C leaves now")
    with contextlib.suppress(KeyboardInterrupt):
        for sock, theirs, where in _arrivals(listener, time.monotonic() + NOTICE_S):
            _answer(sock, error)
            if theirs.get("node_rank") in others:
                ranks.add(int(theirs["node_rank"]))
            refusal = _refusal_of(theirs, where)
            if say is not None:
                say(f"told node {theirs.get('node_rank')} ({where})"
                    + (f"; it refused too: {refusal.message}" if refusal is not None else ""))
            if ranks == others:
                return


def tell_early_end(plan: Plan, builds: dict[str, str], node: dict[str, Any] | None = None, say: Any = None,
                   error: NodeError | None = None) -> NodeError | None:
    """This node's session ends before the nodes agreed (its plan refused): tell the others, so none waits.

    The head answers ``error`` (default: its refusal, :func:`refused_notice`) to every node that comes
    within :data:`NOTICE_S`; a node > 0 sends its descriptor, which carries its refusal, to the head and
    returns the head's own early end when it had one (it refused too). ``node`` as for :func:`descriptor`;
    a no-op for one node. Ctrl-C leaves at once.
    """
    node = node or node_of(plan)
    if node is None:
        return None
    mine = descriptor(plan, builds, node)
    address = (node["master_addr"], link_port(node["master_port"]))
    if node["node_rank"] == 0:
        try:
            listener = _listen(address)
        except UsageError:
            return None  # nothing can reach this head anyway
        try:
            _tell_rest(listener, {}, error or refused_notice(plan), node["nnodes"], say)
        finally:
            listener.close()
        return None
    if say is not None:
        say(f"telling the head at {address[0]}:{address[1]} (up to {NOTICE_S:.0f} s; Ctrl-C leaves now)")
    with contextlib.suppress(KeyboardInterrupt, TimeoutError, ValueError, OSError):
        sock = _connect(address, time.monotonic() + NOTICE_S, routed=True)
        if sock is None:
            return None
        with contextlib.closing(sock):
            _send(sock, mine)
            answer = _read_line(sock, time.monotonic() + 10)
        if answer is not None and not answer.get("ok") and answer.get("code") != "node_refused":
            return NodeError(str(answer.get("code")), str(answer.get("message")), EXIT_REFUSED)
    return None


def _connect(address: tuple[str, int], deadline: float, routed: bool = False) -> socket.socket | None:
    """A connection to the head, retried while it is not listening yet; None past ``deadline``.

    ``routed``: None at once when this host has no route to the head (nothing to wait for).
    """
    while True:
        try:
            return socket.create_connection(address, timeout=5)
        except OSError as exc:
            if time.monotonic() >= deadline or (routed and exc.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH)):
                return None
            time.sleep(RETRY_S)


def _join(mine: dict[str, Any], address: tuple[str, int], say: Any) -> dict[int, socket.socket]:
    if say is not None:
        whose = "this node's"
        say(f"node {mine['node_rank']} of {mine['nnodes']}: joining the head at {address[0]}:{address[1]}"
            f"{_uses(mine, whose)}")
    here = (mine.get("address") or {}).get("address")
    probe = _probe_listener(here) if here else None  # the head connects here once the nodes agree
    try:
        return _join_through(mine, address, probe)
    finally:
        if probe is not None:
            probe.close()


def _join_through(mine: dict[str, Any], address: tuple[str, int], probe: socket.socket | None
                  ) -> dict[int, socket.socket]:
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    sock = _connect(address, deadline)
    if sock is None:
        raise NodeError("node_join_timeout", f"no head answered at {address[0]}:{address[1]} within "
                        f"{JOIN_TIMEOUT_S:.0f} s; start node 0 with the same --master-addr and --master-port",
                        EXIT_REFUSED)
    try:
        _send(sock, {**mine, "probe_port": probe.getsockname()[1] if probe is not None else None})
        answer = _read_line(sock, deadline)
        while answer is not None and answer.get("event") == "probe":  # the head's address, to connect to
            _send(sock, _reach_back(answer))
            answer = _read_line(sock, deadline)
    except (TimeoutError, ValueError, OSError):
        sock.close()
        raise NodeError("node_join_timeout", f"the head at {address[0]}:{address[1]} did not answer", EXIT_REFUSED) \
            from None
    if answer is None:
        sock.close()
        raise NodeError("head_lost", f"the head at {address[0]}:{address[1]} closed the connection before the "
                        "nodes agreed (crashed or killed); nothing was started here", EXIT_REFUSED)
    if not answer.get("ok"):
        sock.close()
        raise NodeError(str(answer.get("code") or "node_mismatch"), str(answer.get("message")), EXIT_REFUSED)
    return {0: sock}


def _reach_back(asked: dict[str, Any]) -> dict[str, Any]:
    """This node's answer to the head's ``probe``: whether a connection to the head's address came, and how fast."""
    try:
        return {"event": "probed", "ok": True, "ms": round(_reach((str(asked["address"]), int(asked["port"]))), 3)}
    except (OSError, KeyError, ValueError, TypeError) as exc:
        return {"event": "probed", "ok": False,
                "error": f"{_why(exc) if isinstance(exc, OSError) else exc} (to {asked.get('address')}:"
                         f"{asked.get('port')})"}
