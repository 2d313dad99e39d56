"""The fast path of sandbox traffic: a raw HTTP/1.1 relay in front of Hypercorn.

The node's listener (``listener.py``) hands each client connection here first. For the common request,
an HTTP/1.1 request routed to a sandbox (``E2b-Sandbox-Id``/``-Port`` headers or a sandbox Host) with no
body or a Content-Length body, the relay parses the request head only (``relay_http.py``), resolves the
sandbox (resuming it if paused), checks the traffic token, and writes the head (hop-by-hop headers dropped)
and the body's bytes to a kept-alive upstream connection of that sandbox; the response is relayed the same
way, bytes as they come, its own framing (Content-Length, chunked, or until close) followed only to know
where it ends. Everything else (API requests, WebSocket upgrades, chunked uploads, ``Expect``, HTTP/1.0, a
head that looks odd in any way) goes to Hypercorn and the ASGI proxy (``proxy.py``) with the rest of the
connection: ``relay_connection`` returns the bytes it read, and the listener replays them to Hypercorn.
Same answers either way: the same routing, resolver, token check and E2B error bodies (``traffic.py``), the
same ``disconnect`` (in-flight exchanges are cut; a request cut before its response started is answered 502
"... was not found").

The sockets are driven directly (non-blocking ``recv``/``send``, ``trio.lowlevel.wait_readable``/``-writable``
when they would block) rather than through ``trio.SocketStream``, whose checks and context managers cost
more than the relaying itself; a connection that is never blocked still yields to the others every few
operations. Timers are not per request either: ``Connections.tend`` checks every connection four times a
second for the keep-alive timeout, and for a guest slow to answer, while which the client is watched for a
disconnect (which cancels the exchange, as the ASGI path does).

Upstream connections are kept alive per sandbox (``SandboxProxy`` holds them with that sandbox's other
traffic state, so ``disconnect`` closes them on pause, kill or slot release); one that the guest closed while
idle is noticed before reuse, and a request that fails on a reused connection before any answer is sent
again once on a new one when its body is still at hand and the guest cannot have acted on it twice.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from .request_head import MAX_HEADER_BYTES
from .relay_http import Chunked, Request, error_response, parse_request, parse_response
from .traffic import (
    PORT_NOT_OPEN_MESSAGE,
    ProxyReject,
    check_traffic_token,
    connect_backoff,
    error_body,
    not_found_message,
    resolve,
)

if TYPE_CHECKING:
    from .proxy import SandboxProxy, _SandboxTraffic

__all__ = ["Connections", "IdleUpstream", "relay_connection"]

log = logging.getLogger(__name__)

RECV = 256 * 1024
#: a request head larger than this goes to Hypercorn (which applies the real limits)
MAX_HEAD = MAX_HEADER_BYTES + 8 * 1024
MAX_RESPONSE_HEAD = 64 * 1024
#: how often ``Connections.tend`` looks; a guest slower than this to answer has its client watched
TEND_S = 0.25
#: operations that did not block before a connection yields to the others
SPINS = 16
#: a response body up to this size that came apart from its head is sent with it if it is there
COALESCE = 64 * 1024
#: idle upstream connections kept per sandbox
MAX_IDLE = 64
#: an idle upstream connection newer than this is reused without checking for a close first by an
#: idempotent request (one that finds it closed anyway is sent again on a new connection)
FRESH_S = 1.0
_IDEMPOTENT = frozenset({b"GET", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"TRACE"})


@dataclass(eq=False, slots=True)
class IdleUpstream:
    """A kept-alive connection to one port of a sandbox, idle since ``since`` (monotonic)."""

    host: str
    port: int
    sock: socket.socket
    since: float


class _Gone(Exception):
    """A socket failed (reset, broken pipe) or a peer sent what the relay cannot follow."""


class _UpstreamGone(_Gone):
    pass


class _ClientGone(_Gone):
    pass


class _ConnectFailed(Exception):
    pass


def _closed_or_stray(sock: socket.socket) -> bool:
    """Whether an idle connection has something to read: EOF or stray bytes, so it is not reusable."""
    try:
        sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False  # nothing to read: still open
    except OSError:
        return True  # reset
    return True


class _Sock:
    """A non-blocking socket driven with trio's lowlevel waits."""

    __slots__ = ("sock", "spins", "gone")

    def __init__(self, sock: socket.socket, gone: type[_Gone]) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.spins = 0
        self.gone = gone

    async def recv(self, blocked: Connection | None = None, *, wait: bool = False, spin: bool = True) -> bytes:
        """The next bytes (b"" at EOF); ``blocked`` has ``upstream_since`` set while it waits. ``wait``:
        wait for the socket first (the caller knows nothing can have come yet: saves a futile recv).
        ``spin=False``: no checkpoint after bytes came (for a caller that must not lose them to a cancel)."""
        while True:
            try:
                if wait:
                    raise BlockingIOError
                data = self.sock.recv(RECV)
            except BlockingIOError:
                wait = False
                self.spins = 0
                if blocked is None:
                    await trio.lowlevel.wait_readable(self.sock)
                else:
                    blocked.upstream_since = time.monotonic()
                    try:
                        await trio.lowlevel.wait_readable(self.sock)
                    finally:
                        blocked.upstream_since = 0.0
                continue
            except OSError as exc:
                raise self.gone(repr(exc)) from exc
            self.spins += 1
            if spin and self.spins >= SPINS:
                self.spins = 0
                await trio.lowlevel.checkpoint()
            return data

    async def send_all(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        try:
            while view:
                try:
                    sent = self.sock.send(view)
                except BlockingIOError:
                    self.spins = 0
                    await trio.lowlevel.wait_writable(self.sock)
                    continue
                view = view[sent:]
        except OSError as exc:
            raise self.gone(repr(exc)) from exc
        self.spins += 1
        if self.spins >= SPINS:
            self.spins = 0
            await trio.lowlevel.checkpoint()


async def _connect(host: str, port: int, timeout: float) -> socket.socket:
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        address: tuple[str, int] = (host, port)
    except ValueError:  # a name (slots have addresses; a resolver might not)
        info = (await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
        family, address = info[0], (str(info[4][0]), int(info[4][1]))
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = sock.connect_ex(address)
        if err == errno.EINPROGRESS:
            with trio.fail_after(timeout):
                await trio.lowlevel.wait_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise OSError(err, f"connect to {host}:{port}: {errno.errorcode.get(err, err)}")
    except BaseException:
        sock.close()
        raise
    return sock


class Connections:
    """The relay's client connections: shutdown (``close``) and the timers (``tend``)."""

    def __init__(self, keep_alive_timeout: float) -> None:
        self.keep_alive_timeout = keep_alive_timeout
        self.closing = False
        self.live: set[Connection] = set()

    def close(self) -> None:
        """Shutdown: connections waiting for a request end now, busy ones after their exchange."""
        self.closing = True
        for connection in self.live:
            if connection.idle_since:
                connection.nursery.cancel_scope.cancel()

    async def tend(self) -> None:
        """Run the timers: idle connections past the keep-alive timeout end, and a client whose guest is slow
        to answer is watched for a disconnect."""
        while True:
            await trio.sleep(TEND_S)
            now = time.monotonic()
            for connection in self.live:
                if connection.idle_since and now - connection.idle_since > self.keep_alive_timeout:
                    connection.nursery.cancel_scope.cancel()
                elif connection.upstream_since and now - connection.upstream_since > TEND_S \
                        and connection.watch is None:
                    connection.start_watch()


class Connection:
    """One client connection while the relay serves it."""

    def __init__(self, proxy: SandboxProxy, sock: socket.socket, nursery: trio.Nursery,
                 connections: Connections) -> None:
        self.proxy = proxy
        self.client = _Sock(sock, _ClientGone)
        self.nursery = nursery
        self.connections = connections
        self.buf = bytearray()
        self.idle_since = 0.0
        self.upstream_since = 0.0
        self.session: trio.CancelScope | None = None
        self.started = False
        self.client_gone = False
        self.watch: trio.CancelScope | None = None
        self.watch_done: trio.Event | None = None

    async def run(self) -> bytes | None:
        """Serve requests until one is not the relay's (returns the bytes read: Hypercorn's to serve) or the
        connection ends (returns None)."""
        buf = self.buf
        while True:
            if self.connections.closing and not buf:
                return None
            self.idle_since = time.monotonic()
            try:
                while (end := buf.find(b"\r\n\r\n")) < 0:
                    if len(buf) > MAX_HEAD:
                        return bytes(buf)
                    data = await self.client.recv()
                    if not data:
                        return None
                    buf += data  # (a head that trickles in gets the keep-alive timeout too, as in Hypercorn)
            except _Gone:
                return None
            finally:
                self.idle_since = 0.0
            request = parse_request(bytes(buf[:end]), self.proxy.domain)
            if request is None:
                return bytes(buf)
            del buf[:end + 4]
            if not await self._exchange(request):
                return None

    async def _exchange(self, request: Request) -> bool:
        """Relay one request and its response; True if the client connection stays open for the next."""
        target = request.target
        try:
            resolution = await resolve(self.proxy.resolver, target)
            check_traffic_token(resolution, target, request.headers)
        except ProxyReject as exc:
            return await self._reject(request, exc.status, exc.message)
        host, port = resolution.host, resolution.upstream_port(target.port)
        sandbox_id = target.sandbox_id
        self.started = False
        keep = False
        traffic, session = self.proxy._enter(sandbox_id)
        self.session = session
        try:
            with session:
                keep = await self._forward(request, sandbox_id, traffic, host, port, resolution.connect_attempts)
        except _ConnectFailed:
            return await self._reject(request, 502, PORT_NOT_OPEN_MESSAGE)
        except _UpstreamGone as exc:
            if self.started:
                log.info("sandbox %s port %d broke off its response: %s", sandbox_id, target.port, exc)
                return False
            log.info("sandbox %s port %d failed before answering: %s", sandbox_id, target.port, exc)
            return await self._reject(request, 502, f"The sandbox {sandbox_id} closed the "
                                                    f"connection on port {target.port} before answering")
        except _ClientGone:
            return False
        finally:
            self.session = None
            if self.watch is not None or self.proxy._leave_needs_close(sandbox_id, traffic, session):
                with trio.CancelScope(shield=True):
                    await self._stop_watch()
                    await self.proxy._leave(sandbox_id, traffic, session)
        if self.client_gone:
            return False
        if session.cancelled_caught:  # proxy.disconnect(): the sandbox went away
            if self.started:
                return False
            return await self._reject(request, 502, not_found_message(sandbox_id))
        return keep

    async def _reject(self, request: Request, status: int, message: str) -> bool:
        # a body not read yet would be taken for the next request: drop it if it is here, else close
        pending = request.length > len(self.buf)
        if not pending:
            del self.buf[:request.length]
        close = pending or request.close
        try:
            await self.client.send_all(error_response(status, error_body(status, message), close))
        except _Gone:
            return False
        return not close

    async def _checkout(self, traffic: _SandboxTraffic, host: str, port: int, attempts: int,
                        replayable: bool) -> tuple[_Sock, bool]:
        """A kept-alive connection to host:port of the sandbox, or a new one; and whether it was reused.
        One idle for a while is checked for a close first; a fresh one only if the request could not be
        sent again (``replayable``)."""
        idle = traffic.idle
        now = time.monotonic()
        for i in range(len(idle) - 1, -1, -1):
            upstream = idle[i]
            if upstream.host == host and upstream.port == port:
                del idle[i]
                age = now - upstream.since
                if age < self.proxy.keepalive_expiry and \
                        ((replayable and age < FRESH_S) or not _closed_or_stray(upstream.sock)):
                    return _Sock(upstream.sock, _UpstreamGone), True
                upstream.sock.close()
        attempt = 1
        while True:
            try:
                return _Sock(await _connect(host, port, self.proxy.connect_timeout), _UpstreamGone), False
            except trio.TooSlowError:
                raise _ConnectFailed from None
            except OSError as exc:
                if attempt >= attempts:
                    log.debug("%s:%d: %r", host, port, exc)
                    raise _ConnectFailed from exc
                await connect_backoff(attempt)
                attempt += 1

    def _checkin(self, sandbox_id: str, traffic: _SandboxTraffic, host: str, port: int, sock: socket.socket) -> None:
        now = time.monotonic()
        if len(traffic.idle) >= MAX_IDLE or self.proxy._sandboxes.get(sandbox_id) is not traffic:
            sock.close()  # the sandbox was disconnected meanwhile: its connections go with it
        else:
            traffic.idle.append(IdleUpstream(host, port, sock, now))
        self.proxy.maybe_prune(now)

    async def _forward(self, request: Request, sandbox_id: str, traffic: _SandboxTraffic, host: str, port: int,
                       attempts: int) -> bool:
        """Send the request upstream and relay the response; True if the client connection stays open."""
        # A request that fails on a reused connection is sent again on a new one if its body is all here
        # and either it never reached the guest (the send failed: the guest had closed the connection) or
        # it is idempotent (RFC 9110 9.2.2: the guest may have seen it before the connection died).
        whole = len(self.buf) >= request.length
        idempotent = whole and request.method in _IDEMPOTENT
        taken = min(len(self.buf), request.length)
        first = request.head + self.buf[:taken]
        del self.buf[:taken]
        for retry in (True, False):
            upstream, reused = await self._checkout(traffic, host, port, attempts, idempotent)
            try:
                try:
                    try:
                        await upstream.send_all(first)
                    except _UpstreamGone:
                        if reused and whole and retry:
                            upstream.sock.close()
                            continue
                        raise
                    sent = taken
                    while sent < request.length:
                        data = await self.client.recv()
                        if not data:
                            raise _ClientGone("the client went away during its upload")
                        chunk = data[:request.length - sent]
                        if len(chunk) < len(data):
                            self.buf += data[len(chunk):]
                        await upstream.send_all(chunk)
                        sent += len(chunk)
                    head, rest = await self._response_head(upstream)
                except _UpstreamGone:
                    if reused and idempotent and retry:
                        upstream.sock.close()
                        continue
                    raise
                reusable, keep = await self._relay_response(request, upstream, head, rest)
            except BaseException:
                upstream.sock.close()
                raise
            if reusable and self.proxy.keepalive:
                self._checkin(sandbox_id, traffic, host, port, upstream.sock)
            else:
                upstream.sock.close()
            return keep
        raise AssertionError("unreachable")

    def start_watch(self) -> None:
        """Watch the client while the guest is slow to answer: a client that goes away cancels the exchange
        (``Connections.tend`` calls this)."""
        self.watch = trio.CancelScope()
        self.watch_done = trio.Event()
        self.nursery.start_soon(self._watch_client, self.watch, self.watch_done, self.session)

    async def _watch_client(self, scope: trio.CancelScope, done: trio.Event,
                            session: trio.CancelScope | None) -> None:
        try:
            with scope:
                try:
                    data = await self.client.recv(spin=False)  # cancelled only while waiting: no bytes lost
                except _Gone:
                    data = b""
                if data:
                    self.buf += data  # a pipelined request: the next exchange reads it
                else:
                    self.client_gone = True
                    if session is not None:
                        session.cancel()
        finally:
            done.set()

    async def _stop_watch(self) -> None:
        if self.watch is not None and self.watch_done is not None:
            self.watch.cancel()
            await self.watch_done.wait()
        self.watch = self.watch_done = None

    async def _response_head(self, upstream: _Sock) -> tuple[bytes, bytes]:
        data = b""
        while (end := data.find(b"\r\n\r\n")) < 0:
            if len(data) > MAX_RESPONSE_HEAD:
                raise _UpstreamGone("response head too large")
            more = await upstream.recv(self, wait=not data)  # the request was sent just now
            if not more:
                raise _UpstreamGone("connection closed")
            data += more
        return data[:end], data[end + 4:]

    async def _relay_response(self, request: Request, upstream: _Sock, head: bytes,
                              rest: bytes) -> tuple[bool, bool]:
        """Relay one response; returns (upstream reusable, client connection stays open)."""
        try:
            response = parse_response(head, request.method, request.close)
            while 100 <= response.status < 200 and response.status != 101:  # 103 Early Hints...: on to the final
                await self.client.send_all(response.head)
                self.started = True
                while (end := rest.find(b"\r\n\r\n")) < 0:
                    more = await upstream.recv(self)
                    if not more:
                        raise _UpstreamGone("connection closed")
                    rest += more
                response = parse_response(rest[:end], request.method, request.close)
                rest = rest[end + 4:]
            chunked = Chunked() if response.chunked else None
            length = response.length
            if length is not None and len(rest) < length <= COALESCE:
                # servers write the head and the body apart (Hypercorn, for one): if the body is here too,
                # send both to the client at once (one wake-up of the client instead of two)
                try:
                    rest += upstream.sock.recv(RECV)
                except OSError:  # nothing yet (the loop waits), or a failure (the loop reports it)
                    pass
            data = rest
            extra = b""
            self.started = True
            while True:
                if chunked is not None:
                    used = chunked.feed(data)
                    extra, data = data[used:], data[:used]
                    done = chunked.done
                elif length is not None:
                    extra, data = data[length:], data[:length]
                    length -= len(data)
                    done = length == 0
                else:
                    done = False
                if response.head:
                    await self.client.send_all(response.head + data)
                    response.head = b""
                elif data:
                    await self.client.send_all(data)
                if done:
                    return response.reusable and not extra, not response.close
                data = await upstream.recv(self)
                if not data:
                    if length is None and chunked is None:  # delimited by the close
                        return False, False
                    raise _UpstreamGone("connection closed mid-response")
        except ValueError as exc:
            raise _UpstreamGone(f"unreadable response: {exc}") from exc


async def relay_connection(proxy: SandboxProxy, client: trio.SocketStream,
                           connections: Connections) -> bytes | None:
    """Serve a client connection's sandbox requests; returns the bytes read past them if the connection
    goes on with a request the relay leaves to Hypercorn, None if it ended here."""
    # the same socket (file descriptor) as a plain socket object, let go of (not closed) at the end
    sock = socket.socket(fileno=client.socket.fileno())
    try:
        async with trio.open_nursery() as nursery:
            connection = Connection(proxy, sock, nursery, connections)
            connections.live.add(connection)
            try:
                return await connection.run()
            finally:
                connections.live.discard(connection)
        return None  # cancelled by ``Connections`` (shutdown, keep-alive timeout)
    finally:
        sock.detach()
