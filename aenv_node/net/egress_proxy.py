"""The egress proxy: the domain entries of ``allowOut``, enforced by the name a guest connects to.

A slot redirects to its host end a new TCP connection that its address rules would drop, when its port
is one a domain entry names (``egress.redirect_chain_rules``); the host table redirects it here
(``host_table.py``), keeping what the guest asked for readable: its slot (the peer address, the slot's
namespace end after its source NAT) and its destination port (``SO_ORIGINAL_DST``). The proxy then

1. reads the start of the stream: a TLS ClientHello gives the name in its SNI extension, an HTTP/1
   request its ``Host`` header (any other protocol, or none within ``handshake_timeout_s``: closed);
2. asks the sandbox's policy whether a domain entry allows that name on that port (else: closed);
3. resolves the name itself (``dns.Resolver``, the node's upstreams) and connects to the first address
   that is not always blocked (private ranges, link-local, the slot pool): a guest claiming an allowed
   name reaches that name's servers, never the address it connected to, and never the node's LAN;
4. relays both ways, the bytes already read first, until both sides are done.

A denied connection is accepted and then closed: from inside the guest it looks like a connection reset
after connecting, as E2B's firewall does. Each sandbox may hold ``per_slot_limit`` proxied connections
at once (more are closed at once), so one guest cannot take the node's file descriptors.

Why hand-written: the ClientHello parser reads exactly one extension (no maintained pure-Python TLS
library parses a ClientHello without terminating TLS); HTTP heads are parsed by h11.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import socket
import struct
from collections.abc import Callable

import h11
import trio

from .dns import Resolver
from .egress import EgressPolicy
from .slot import NetworkConfig

__all__ = ["EgressProxy", "requested_name", "sni_of_client_hello"]

log = logging.getLogger(__name__)

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
MAX_HEAD = 16384  # bytes read at most before the name must be known


def sni_of_client_hello(data: bytes) -> str | None | bool:
    """The server name of a TLS ClientHello at the start of ``data``: the name; None when the hello is
    complete and names no server (or is not a ClientHello); False when more bytes are needed."""
    hello = b""
    pos = 0
    # the handshake message may span several records
    while True:
        if len(data) < pos + 5:
            return False
        ctype, _version, length = struct.unpack("!BHH", data[pos : pos + 5])
        if ctype != 22:
            return None
        if len(data) < pos + 5 + length:
            return False
        hello += data[pos + 5 : pos + 5 + length]
        pos += 5 + length
        if len(hello) >= 4:
            if hello[0] != 1:  # not a ClientHello
                return None
            size = int.from_bytes(hello[1:4], "big")
            if len(hello) >= 4 + size:
                return _sni(hello[4 : 4 + size])
        if pos >= MAX_HEAD:
            return None


def _sni(body: bytes) -> str | None:
    try:
        p = 2 + 32  # client version, random
        p += 1 + body[p]  # session id
        p += 2 + int.from_bytes(body[p : p + 2], "big")  # cipher suites
        p += 1 + body[p]  # compression methods
        end = p + 2 + int.from_bytes(body[p : p + 2], "big")
        p += 2
        while p + 4 <= min(end, len(body)):
            etype, elen = struct.unpack("!HH", body[p : p + 4])
            p += 4
            if etype == 0:  # server_name: list length, then (type, length, name) entries
                q, stop = p + 2, p + elen
                while q + 3 <= stop:
                    ntype, nlen = body[q], int.from_bytes(body[q + 1 : q + 3], "big")
                    if ntype == 0:
                        return body[q + 3 : q + 3 + nlen].decode("ascii").lower()
                    q += 3 + nlen
                return None
            p += elen
    except (IndexError, UnicodeDecodeError):
        return None
    return None


def _host_of_http(data: bytes) -> str | None | bool:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    conn.receive_data(data)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError:
        return None
    if event is h11.NEED_DATA:
        return False
    if not isinstance(event, h11.Request):
        return None
    for key, value in event.headers:
        if key == b"host":
            host = value.decode("ascii", "replace").strip()
            if host.startswith("["):
                return None  # an IPv6 literal is no domain
            return host.rsplit(":", 1)[0].lower() if ":" in host else host.lower()
    return None


def requested_name(head: bytes) -> str | None | bool:
    """The name a connection's first bytes ask for (TLS SNI or HTTP Host); None: none can be read;
    False: more bytes are needed."""
    if not head:
        return False
    if head[0] == 22:
        return sni_of_client_hello(head)
    return _host_of_http(head)


def _original_port(sock: trio.socket.SocketType) -> int:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    return int(struct.unpack("!H", raw[2:4])[0])


class EgressProxy:
    """Listens on TCP ``port`` of the host (all addresses; connections from anything but a slot of
    ``config`` are closed unread). ``policy_of(slot_index)``: the policy of the sandbox in that slot,
    None when none runs there."""

    def __init__(self, config: NetworkConfig, resolver: Resolver,
                 policy_of: Callable[[int], EgressPolicy | None], *, port: int,
                 handshake_timeout_s: float = 10.0, connect_timeout_s: float = 10.0,
                 per_slot_limit: int = 256) -> None:
        self.config = config
        self.resolver = resolver
        self.policy_of = policy_of
        self.port = port
        self.handshake_timeout_s = handshake_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.per_slot_limit = per_slot_limit
        self._open: collections.Counter[int] = collections.Counter()
        #: connections let through / closed, by reason (read by tests and the node's metrics)
        self.counts: collections.Counter[str] = collections.Counter()

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started(port)`` once it listens."""
        listeners = await trio.open_tcp_listeners(self.port, host="0.0.0.0")
        port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._serve, listeners)
            task_status.started(port)

    async def _serve(self, stream: trio.SocketStream) -> None:
        async with stream:
            index = self.config.slot_of_address(stream.socket.getpeername()[0])
            if index is None:
                self.counts["not a slot"] += 1
                return
            if self._open[index] >= self.per_slot_limit:
                self.counts["too many"] += 1
                return
            self._open[index] += 1
            try:
                await self._proxy(stream, index)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as e:
                log.debug("proxied connection of slot %d ended: %s", index, e)
            finally:
                self._open[index] -= 1
                if not self._open[index]:
                    del self._open[index]

    async def _proxy(self, stream: trio.SocketStream, index: int) -> None:
        port = _original_port(stream.socket)
        head = b""
        name: str | None | bool = False
        with trio.move_on_after(self.handshake_timeout_s):
            while name is False and len(head) < MAX_HEAD:
                chunk = await stream.receive_some(MAX_HEAD - len(head))
                if not chunk:
                    break
                head += chunk
                name = requested_name(head)
        policy = self.policy_of(index)
        if not isinstance(name, str) or not name:
            self.counts["no name"] += 1
            return
        if policy is None or not policy.allows_name(name, port):
            self.counts["denied"] += 1
            log.info("egress of slot %d to %s:%d denied (no allowOut entry names it)", index, name, port)
            return
        target = await self._address(name)
        if target is None:
            self.counts["unresolved"] += 1
            log.info("egress of slot %d to %s:%d: the name resolves to no public address", index, name, port)
            return
        upstream: trio.SocketStream | None = None
        with trio.move_on_after(self.connect_timeout_s):
            upstream = await trio.open_tcp_stream(str(target), port)
        if upstream is None:
            self.counts["connect failed"] += 1
            return
        self.counts["allowed"] += 1
        async with upstream:
            await upstream.send_all(head)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, stream, upstream, nursery.cancel_scope)
                nursery.start_soon(_pump, upstream, stream, nursery.cancel_scope)

    async def _address(self, name: str) -> ipaddress.IPv4Address | None:
        blocked = [*self.config.blocked, self.config.pool]
        for addr in await self.resolver.resolve(name):
            if not any(addr in net for net in blocked):
                return addr
        return None


async def _pump(source: trio.SocketStream, sink: trio.SocketStream, both: trio.CancelScope) -> None:
    """Copy ``source`` to ``sink`` until its end, then half-close ``sink``; on an error end both ways."""
    try:
        while chunk := await source.receive_some(65536):
            await sink.send_all(chunk)
        await sink.send_eof()
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        both.cancel()
