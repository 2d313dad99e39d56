"""The node's DNS for its guests: a forwarder every slot's DNS goes to, and the resolver the egress proxy uses.

Every guest DNS packet (UDP or TCP port 53, whatever server the guest's ``resolv.conf`` names) is sent by
its slot to its host end and redirected by the host table to ``DnsForwarder`` (``host_table.py``). So the
node manages name resolution for its guests without touching their images: a guest resolves names exactly
when its sandbox may use the network (not with ``allow_internet_access=false`` and no domain entries: then
the answer is REFUSED, and DNS is no tunnel out of an isolated sandbox), through the upstream servers the
node is configured with (``net.dns_upstreams``; default: the host's own ``/etc/resolv.conf``).

Why hand-written: the forwarder only relays messages (dnspython parses and builds them; there is no Trio
DNS server library), and the proxy needs the same upstreams and one address lookup.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import dns.exception
import dns.message
import dns.rcode
import dns.rdatatype
import trio

from .slot import NetworkConfig

__all__ = ["DnsForwarder", "Resolver", "host_nameservers"]

log = logging.getLogger(__name__)

#: queries of all guests in flight at once (more are dropped: the guest's resolver retries)
MAX_IN_FLIGHT = 1024
#: the longest a resolved address is kept for the proxy (a shorter TTL wins)
MAX_CACHE_S = 60.0


def host_nameservers(path: Path = Path("/etc/resolv.conf")) -> list[str]:
    """The IPv4 ``nameserver`` lines of the host's resolver configuration."""
    try:
        text = path.read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            try:
                found.append(str(ipaddress.IPv4Address(words[1])))
            except ValueError:
                continue
    return found


def _endpoint(text: str) -> tuple[str, int]:
    host, _, port = text.partition(":")
    return str(ipaddress.IPv4Address(host)), int(port or 53)


class Resolver:
    """Asks the upstream servers, in order, until one answers. ``upstreams``: ``"ip"`` or ``"ip:port"``."""

    def __init__(self, upstreams: Sequence[str], *, timeout_s: float = 2.0) -> None:
        self.upstreams = [_endpoint(u) for u in upstreams]
        self.timeout_s = timeout_s
        self._cache: dict[str, tuple[float, list[ipaddress.IPv4Address]]] = {}

    async def exchange(self, query: bytes, *, tcp: bool = False) -> bytes | None:
        """The first upstream answer to ``query`` (a DNS message) with its id, or None when none answers."""
        for server in self.upstreams:
            with trio.move_on_after(self.timeout_s):
                try:
                    answer = await (self._tcp(server, query) if tcp else self._udp(server, query))
                except OSError as e:
                    log.debug("DNS upstream %s:%d: %s", *server, e)
                    continue
                if answer is not None and answer[:2] == query[:2]:
                    return answer
        return None

    @staticmethod
    async def _udp(server: tuple[str, int], query: bytes) -> bytes | None:
        with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            await s.connect(server)  # a fresh socket (random source port) per query
            await s.send(query)
            while True:
                data = await s.recv(65535)
                if data[:2] == query[:2]:
                    return data

    @staticmethod
    async def _tcp(server: tuple[str, int], query: bytes) -> bytes | None:
        stream = await trio.open_tcp_stream(*server)
        async with stream:
            await stream.send_all(struct.pack("!H", len(query)) + query)
            return await _read_framed(stream)

    async def resolve(self, name: str) -> list[ipaddress.IPv4Address]:
        """The IPv4 addresses of ``name`` (empty when it has none or nobody answers), cached for their TTL."""
        name = name.lower().rstrip(".")
        hit = self._cache.get(name)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        query = dns.message.make_query(name, dns.rdatatype.A)
        wire = await self.exchange(query.to_wire())
        if wire is None:
            return []
        try:
            answer = dns.message.from_wire(wire)
        except dns.exception.DNSException:
            return []
        found: list[ipaddress.IPv4Address] = []
        ttl = MAX_CACHE_S
        for rrset in answer.answer:
            if rrset.rdtype == dns.rdatatype.A:
                ttl = min(ttl, rrset.ttl)
                found.extend(ipaddress.IPv4Address(r.address) for r in rrset)
        if len(self._cache) > 4096:
            self._cache.clear()
        self._cache[name] = (time.monotonic() + ttl, found)
        return found


async def _read_framed(stream: trio.abc.ReceiveStream) -> bytes | None:
    """One length-prefixed DNS message of a TCP stream (None at its end)."""
    buf = b""
    while len(buf) < 2 or len(buf) < 2 + struct.unpack("!H", buf[:2])[0]:
        chunk = await stream.receive_some(65537)
        if not chunk:
            return None
        buf += chunk
    size = struct.unpack("!H", buf[:2])[0]
    return buf[2 : 2 + size]


class DnsForwarder:
    """Answers the guests' DNS on UDP and TCP ``port`` of the host (all addresses; only queries from a slot
    of ``config`` are read). ``serves(slot_index)``: whether that slot's sandbox may resolve names."""

    def __init__(self, config: NetworkConfig, resolver: Resolver, serves: Callable[[int], bool],
                 *, port: int) -> None:
        self.config = config
        self.resolver = resolver
        self.serves = serves
        self.port = port
        self._in_flight = 0

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; ``task_status.started(port)`` once both sockets listen."""
        udp = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with udp:
            await udp.bind(("0.0.0.0", self.port))
            port = udp.getsockname()[1]
            listeners = await trio.open_tcp_listeners(port, host="0.0.0.0")
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, self._serve_tcp, listeners)
                task_status.started(port)
                while True:
                    data, peer = await udp.recvfrom(65535)
                    if self._in_flight >= MAX_IN_FLIGHT:
                        continue
                    self._in_flight += 1
                    nursery.start_soon(self._answer_udp, udp, data, peer)

    async def _answer(self, peer: str, query: bytes, *, tcp: bool) -> bytes | None:
        index = self.config.slot_of_address(peer)
        if index is None:
            return None
        try:
            msg = dns.message.from_wire(query)
        except dns.exception.DNSException:
            return None  # not DNS: no answer at all
        if not self.serves(index):
            log.debug("DNS of slot %d refused (its sandbox has no network)", index)
            return _reply(msg, dns.rcode.REFUSED)
        answer = await self.resolver.exchange(query, tcp=tcp)
        return answer if answer is not None else _reply(msg, dns.rcode.SERVFAIL)

    async def _answer_udp(self, udp: trio.socket.SocketType, data: bytes, peer: tuple[str, int]) -> None:
        try:
            answer = await self._answer(peer[0], data, tcp=False)
            if answer is not None:
                await udp.sendto(answer, peer)
        except OSError as e:
            log.debug("DNS answer to %s failed: %s", peer, e)
        finally:
            self._in_flight -= 1

    async def _serve_tcp(self, stream: trio.SocketStream) -> None:
        peer = stream.socket.getpeername()[0]
        async with stream:
            try:
                for _ in range(100):  # queries on one connection
                    query = None
                    with trio.move_on_after(10):
                        query = await _read_framed(stream)
                    if query is None:
                        return
                    answer = await self._answer(peer, query, tcp=True)
                    if answer is None:
                        return
                    await stream.send_all(struct.pack("!H", len(answer)) + answer)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                return


def _reply(query: dns.message.Message, rcode: dns.rcode.Rcode) -> bytes:
    r = dns.message.make_response(query)
    r.set_rcode(rcode)
    return r.to_wire()
