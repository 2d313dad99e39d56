"""The raw relay (the node listener's fast path for sandbox traffic): what it takes, what it leaves to
Hypercorn, and how it follows framing and keeps upstream connections.

The other proxy tests run through the same listener (``serve_proxy``) and hold for both paths; these are
about the relay's own decisions. A request the relay served keeps the guest's header-name case (it relays
bytes); one served by the ASGI path comes with lower-case names (Hypercorn's), which tells them apart.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import trio

from aenv_node.api.proxy import Resolution, SandboxProxy
from aenv_node.api.relay_http import Chunked, parse_request, parse_response

from .conftest import ProxyEnv, Sandboxes, node_app, serve_proxy

HEAD = (b"POST /x HTTP/1.1\r\nHost: h\r\nE2b-Sandbox-Id: abc\r\nE2b-Sandbox-Port: 49983\r\n"
        b"Content-Length: 3")


# ----- parsing (pure) ------------------------------------------------------------------------

@pytest.mark.parametrize("change", [
    lambda h: h.replace(b"HTTP/1.1", b"HTTP/1.0"),
    lambda h: h + b"\r\nTransfer-Encoding: chunked",
    lambda h: h + b"\r\nExpect: 100-continue",
    lambda h: h + b"\r\nUpgrade: websocket\r\nConnection: upgrade",
    lambda h: h + b"\r\nContent-Length: 4",           # a second, different length
    lambda h: h + b"\r\n folded continuation",         # obs-fold
    lambda h: h.replace(b"Host: h", b"Host : h"),      # a space before the colon
    lambda h: h.replace(b"Host: h", b"Host: h\rx"),    # a bare CR
    lambda h: h.replace(b"Host: h", b"Host: h\x00"),
    lambda h: h.replace(b"POST /x", b"POST http://elsewhere/x"),  # absolute-form
    lambda h: h.replace(b"E2b-Sandbox-Id: abc", b"X-Other: abc"),  # malformed sandbox headers: 400 by the ASGI path
    lambda h: h.replace(b"E2b-Sandbox-Id: abc\r\nE2b-Sandbox-Port: 49983\r\n", b""),  # not sandbox traffic
])
def test_heads_the_relay_leaves_to_hypercorn(change: Callable[[bytes], bytes]) -> None:
    assert parse_request(HEAD, "") is not None
    assert parse_request(change(HEAD), "") is None


def test_request_head_drops_hop_by_hop_headers() -> None:
    head = HEAD + b"\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nX-Kept: 2"
    request = parse_request(head, "")
    assert request is not None and request.length == 3 and not request.close
    assert request.head == (b"POST /x HTTP/1.1\r\nHost: h\r\nE2b-Sandbox-Id: abc\r\nE2b-Sandbox-Port: 49983\r\n"
                            b"Content-Length: 3\r\nX-Kept: 2\r\n\r\n")
    closing = parse_request(HEAD + b"\r\nConnection: close", "")
    assert closing is not None and closing.close
    bodiless = parse_request(HEAD.replace(b"\r\nContent-Length: 3", b""), "")
    assert bodiless is not None and bodiless.head.endswith(b"content-length: 0\r\n\r\n")  # as the ASGI path


def test_response_framing() -> None:
    r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive", b"GET", False)
    assert (r.length, r.chunked, r.reusable, r.close) == (5, False, True, False)
    assert r.head == b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n"
    r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 5", b"HEAD", False)
    assert r.length == 0 and r.reusable
    r = parse_response(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked", b"GET", True)
    assert r.chunked and r.length is None and r.close and r.head.endswith(b"connection: close\r\n\r\n")
    r = parse_response(b"HTTP/1.0 200 OK", b"GET", False)  # until the close
    assert r.length is None and not r.chunked and not r.reusable and r.close
    with pytest.raises(ValueError):
        parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6", b"GET", False)


def test_chunked_end_found_at_any_split() -> None:
    body = b"5;ext=1\r\nhello\r\n10\r\n" + b"x" * 16 + b"\r\n0\r\nTrailer: t\r\n\r\n"
    for split in range(len(body) + 1):
        chunked = Chunked()
        used = chunked.feed(body[:split])
        assert used == split and chunked.done == (split == len(body))
        used = chunked.feed(body[split:] + b"NEXT")
        assert chunked.done and used == len(body) - split


# ----- through the listener ----------------------------------------------------------------

async def raw_exchange(port: int, data: bytes, until: bytes, *, close: bool = False) -> bytes:
    """Send raw bytes to the proxy; read until ``until`` has come (or EOF)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        got = b""
        with trio.fail_after(10):
            while until not in got:
                more = await stream.receive_some(65536)
                if not more:
                    break
                got += more
            if close:
                while more := await stream.receive_some(65536):
                    got += more
        return got


def request(path: str, *, body: bytes = b"", sandbox: str = "abc", extra: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nE2b-Sandbox-Id: {sandbox}\r\nE2b-Sandbox-Port: 49983\r\n"
            f"Content-Length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@asynccontextmanager
async def scripted_guest(answers: list[bytes], *, close_after_each: bool) -> AsyncIterator[tuple[int, list[int]]]:
    """A guest server that answers each request (one read) with the next scripted response; it closes the
    connection after each if told (without saying so: a keep-alive connection the guest drops)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    connections: list[int] = []

    async def serve(stream: trio.SocketStream) -> None:
        connections.append(1)
        buf = b""
        async with stream:
            while answers:
                while (end := buf.find(b"\r\n\r\n")) < 0 or len(buf) < end + 4 + content_length(buf[:end]):
                    more = await stream.receive_some(65536)  # a whole request, head and body (may come apart)
                    if not more:
                        return
                    buf += more
                buf = buf[end + 4 + content_length(buf[:end]):]
                await stream.send_all(answers.pop(0))
                if close_after_each:
                    return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve, listeners)
        yield port, connections
        nursery.cancel_scope.cancel()


async def test_relayed_then_api_then_sandbox_on_one_connection(proxy_env: ProxyEnv) -> None:
    """A connection starts on the relay; an API request hands it (and what follows) to Hypercorn."""
    port = int(proxy_env.url.rsplit(":", 1)[1])
    data = request("/echo", body=b"one") + b"GET /hello HTTP/1.1\r\nHost: t\r\n\r\n" + request("/echo", body=b"two")
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        got = b""
        with trio.fail_after(10):
            while got.count(b"HTTP/1.1 200") < 3 or not got.endswith(b"}"):
                got += await stream.receive_some(65536)
    assert got.count(b"HTTP/1.1 200") == 3, got
    assert b"hello from the node app" in got


async def test_pipelined_requests_are_answered_in_order(proxy_env: ProxyEnv) -> None:
    port = int(proxy_env.url.rsplit(":", 1)[1])
    data = b"".join(request(f"/echo?i={i}", body=b"x" * i) for i in range(1, 4))
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        got = b""
        with trio.fail_after(10):
            while got.count(b"HTTP/1.1 200") < 3 or not got.rstrip().endswith(b"}"):
                got += await stream.receive_some(65536)
    lengths = [int(part.split(b'"length": ')[1].split(b",")[0].split(b"}")[0]) for part in got.split(b"HTTP/1.1 ")[1:]]
    assert lengths == [1, 2, 3]


async def test_relay_keeps_the_guest_header_case_and_pools(proxy_env: ProxyEnv) -> None:
    answer = b"HTTP/1.1 200 OK\r\nX-Case-Check: Yes\r\nContent-Length: 2\r\n\r\nok"
    async with scripted_guest([answer] * 3, close_after_each=False) as (port, connections):
        proxy_env.sandboxes.table["raw"] = Resolution(host="127.0.0.1", port_map=lambda p: port)
        async with proxy_env.client() as c:
            for _ in range(3):
                r = await c.post("/", content=b"abc", headers={"E2b-Sandbox-Id": "raw", "E2b-Sandbox-Port": "80"})
                assert r.status_code == 200 and r.content == b"ok"
                assert (b"X-Case-Check", b"Yes") in r.headers.raw  # relayed, not re-made by Hypercorn
    assert len(connections) == 1  # one kept-alive upstream connection


async def test_guest_closing_idle_connections_is_retried(proxy_env: ProxyEnv) -> None:
    """A guest that drops its keep-alive connection after each answer (without Connection: close): the
    next request finds it closed and goes again on a new one."""
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with scripted_guest([answer] * 4, close_after_each=True) as (port, connections):
        proxy_env.sandboxes.table["raw"] = Resolution(host="127.0.0.1", port_map=lambda p: port)
        async with proxy_env.client() as c:
            for _ in range(4):
                r = await c.post("/", content=b"abc", headers={"E2b-Sandbox-Id": "raw", "E2b-Sandbox-Port": "80"})
                assert r.status_code == 200 and r.content == b"ok"
    assert len(connections) == 4


async def test_response_until_close_and_chunked(proxy_env: ProxyEnv) -> None:
    port = int(proxy_env.url.rsplit(":", 1)[1])
    answers = [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
               b"HTTP/1.1 200 OK\r\n\r\nuntil the close"]
    async with scripted_guest(answers, close_after_each=True) as (guest, _):
        proxy_env.sandboxes.table["raw"] = Resolution(host="127.0.0.1", port_map=lambda p: guest)
        got = await raw_exchange(port, request("/", sandbox="raw"), b"0\r\n\r\n")
        assert got.endswith(b"3\r\nabc\r\n0\r\n\r\n") and b"Transfer-Encoding: chunked" in got
        got = await raw_exchange(port, request("/", sandbox="raw"), b"\x00", close=True)
        assert b"connection: close" in got and got.endswith(b"\r\n\r\nuntil the close")


async def test_upstream_connections_go_with_disconnect_and_expire() -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    async with scripted_guest([answer] * 3, close_after_each=False) as (guest, connections):
        sandboxes = Sandboxes({"raw": Resolution(host="127.0.0.1", port_map=lambda p: guest)})
        async with SandboxProxy(node_app(), sandboxes.resolve, keepalive_expiry=0.5) as proxy, \
                serve_proxy(proxy) as port:
            got = await raw_exchange(port, request("/", sandbox="raw"), b"ok")
            assert got.endswith(b"ok") and proxy.tracked() == 1
            assert await proxy.disconnect("raw") == 0 and proxy.tracked() == 0
            got = await raw_exchange(port, request("/", sandbox="raw"), b"ok")
            assert got.endswith(b"ok") and len(connections) == 2  # a new upstream connection
            await trio.sleep(0.6)
            proxy.prune_idle(time.monotonic())
            assert proxy.tracked() == 0  # expired: closed and forgotten


async def test_keep_alive_timeout_and_shutdown_end_idle_relayed_connections(proxy_env: ProxyEnv) -> None:
    from aenv_node.api.server import serve_api

    from ..conftest import free_port
    from .conftest import hypercorn_config

    config = hypercorn_config(free_port())
    config.keep_alive_timeout = 0.5
    config.graceful_timeout = 30
    stop = trio.Event()
    proxy = SandboxProxy(node_app(), proxy_env.sandboxes.resolve)
    async with proxy, trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: serve_api(proxy.app, proxy, config, shutdown_trigger=stop.wait,
                                                                   task_status=task_status))
        port = int(binds[0].rsplit(":", 1)[1])
        for wait, ends in ((1.2, "keep-alive timeout"), (0.0, "shutdown")):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(request("/echo", body=b"abc"))
                got = b""
                with trio.fail_after(10):
                    while not got.endswith(b"}"):
                        got += await stream.receive_some(65536)
                await trio.sleep(wait)
                if ends == "shutdown":
                    stop.set()
                with trio.fail_after(5):  # the server closes the idle connection, for either reason
                    assert await stream.receive_some(65536) == b"", ends
        with trio.fail_after(5):  # not the 30 s graceful timeout: nothing was busy
            while nursery.child_tasks:
                await trio.sleep(0.05)


@pytest.mark.parametrize("method, expect", [("POST", 502), ("GET", 200)])
async def test_only_idempotent_requests_are_sent_again(proxy_env: ProxyEnv, method: str, expect: int) -> None:
    """The guest reads the second request on a kept-alive connection and drops the connection unanswered:
    a POST may have had its effect, so it is answered 502; a GET goes again on a new connection."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    seen: list[bytes] = []
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            while data := await stream.receive_some(65536):
                seen.append(data.split(b" ", 1)[0])
                if len(seen) == 2:
                    return  # read, then gone without an answer
                await stream.send_all(ok)

    proxy_env.sandboxes.table["raw"] = Resolution(host="127.0.0.1", port_map=lambda p: port)
    headers = {"E2b-Sandbox-Id": "raw", "E2b-Sandbox-Port": "80"}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.serve_listeners, serve, listeners)
        async with proxy_env.client() as c:
            assert (await c.request(method, "/", headers=headers)).status_code == 200
            r = await c.request(method, "/", headers=headers)
        nursery.cancel_scope.cancel()
    assert r.status_code == expect, r.text
    assert len(seen) == (2 if method == "POST" else 3)


async def test_heads_over_the_limits_are_431_as_before(proxy_env: ProxyEnv) -> None:
    """Too many headers, or too large a head: the relay leaves them to the ASGI path's limits."""
    port = int(proxy_env.url.rsplit(":", 1)[1])
    many = b"".join(b"X-%d: v\r\n" % i for i in range(200))
    big = b"X-Big: " + b"v" * (40 * 1024) + b"\r\n"
    for extra in (many, big):
        got = await raw_exchange(port, request("/echo", extra=extra), b"}")
        assert got.startswith(b"HTTP/1.1 431"), got[:200]
