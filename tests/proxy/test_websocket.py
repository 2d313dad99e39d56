"""WebSocket sandbox traffic: echo, subprotocols, close codes both ways, rejections, errors."""

from __future__ import annotations

import json
from functools import partial

import pytest
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketRequest,
    open_websocket,
    serve_websocket,
    wrap_client_stream,
)

from aenv_node.api.proxy import Resolution

from .conftest import DOMAIN, TRAFFIC_TOKEN, ProxyEnv, sandbox_headers


def ws_headers(sandbox_id: str = "abc", port: int = 8080, **extra: str) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode()) for k, v in sandbox_headers(sandbox_id, port, **extra).items()]


def proxy_port(env: ProxyEnv) -> int:
    return int(env.url.rsplit(":", 1)[1])


async def test_websocket_echo_and_subprotocol(proxy_env: ProxyEnv) -> None:
    async with open_websocket("127.0.0.1", proxy_port(proxy_env), "/ws?x=1", use_ssl=False,
                              subprotocols=["chat"], extra_headers=ws_headers(),
                              max_message_size=8 * 1024 * 1024) as ws:
        assert ws.subprotocol == "chat"
        await ws.send_message("hello")
        assert await ws.get_message() == "hello"
        blob = bytes(range(256)) * 4096  # 1 MiB binary message
        await ws.send_message(blob)
        assert await ws.get_message() == blob
    with trio.fail_after(5):
        await proxy_env.state.ws_gone.wait()
    assert proxy_env.state.ws_disconnect_code is not None


async def test_websocket_by_host(proxy_env: ProxyEnv) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", proxy_port(proxy_env))
    async with trio.open_nursery() as nursery:
        # wrap_client_stream sends `host` as the Host header
        ws = await wrap_client_stream(nursery, stream, f"8080-abc.{DOMAIN}", "/ws")
        assert ws.subprotocol is None
        await ws.send_message("via host")
        assert await ws.get_message() == "via host"
        await ws.aclose()
    assert proxy_env.sandboxes.calls == [("abc", 8080)]


async def test_websocket_guest_close_code_reaches_client(proxy_env: ProxyEnv) -> None:
    async with open_websocket("127.0.0.1", proxy_port(proxy_env), "/ws", use_ssl=False,
                              extra_headers=ws_headers()) as ws:
        await ws.send_message("close:4001:bye now")
        with pytest.raises(ConnectionClosed) as info:
            with trio.fail_after(5):
                await ws.get_message()
    assert info.value.reason.code == 4001
    assert info.value.reason.reason == "bye now"


async def test_websocket_client_close_reaches_guest(proxy_env: ProxyEnv) -> None:
    async with open_websocket("127.0.0.1", proxy_port(proxy_env), "/ws", use_ssl=False,
                              extra_headers=ws_headers()) as ws:
        await ws.send_message("ping")
        assert await ws.get_message() == "ping"
        await ws.aclose(code=4002, reason="done")
    with trio.fail_after(5):
        await proxy_env.state.ws_gone.wait()
    assert proxy_env.state.ws_disconnect_code is not None


async def test_websocket_client_close_is_a_clean_close_upstream(proxy_env: ProxyEnv) -> None:
    """A guest server that reports close codes exactly (trio-websocket) sees a clean close.

    Hypercorn reports a client's close to the ASGI app as 1006 without its code,
    so the proxy closes the guest side with 1000 (normal closure).
    """
    seen: list[int] = []
    gone = trio.Event()

    async def handler(request: WebSocketRequest) -> None:
        ws = await request.accept()
        try:
            while True:
                await ws.send_message(await ws.get_message())
        except ConnectionClosed as closed:
            seen.append(closed.reason.code)
            gone.set()

    async with trio.open_nursery() as nursery:
        server = await nursery.start(partial(serve_websocket, handler, "127.0.0.1", 0, ssl_context=None))
        proxy_env.sandboxes.table["wsx"] = Resolution(host="127.0.0.1", port_map=lambda p: server.port)
        async with open_websocket("127.0.0.1", proxy_port(proxy_env), "/", use_ssl=False,
                                  extra_headers=ws_headers("wsx", 7000)) as ws:
            await ws.send_message(b"\x00bin")
            assert await ws.get_message() == b"\x00bin"
            await ws.aclose(code=4002, reason="done")
        with trio.fail_after(5):
            await gone.wait()
        nursery.cancel_scope.cancel()
    assert seen == [1000]


async def _rejection(env: ProxyEnv, headers: list[tuple[bytes, bytes]], path: str = "/ws") -> ConnectionRejected:
    with pytest.raises(ConnectionRejected) as info:
        async with open_websocket("127.0.0.1", proxy_port(env), path, use_ssl=False, extra_headers=headers):
            pass
    return info.value


async def test_websocket_not_running_closed_port_and_token(proxy_env: ProxyEnv) -> None:
    rejected = await _rejection(proxy_env, ws_headers("gone"))
    assert rejected.status_code == 502
    assert json.loads(rejected.body) == {"code": 502, "message": "The sandbox gone was not found"}
    rejected = await _rejection(proxy_env, ws_headers("abc", 9999))
    assert rejected.status_code == 502
    assert json.loads(rejected.body) == {"code": 502, "message": "The sandbox is running but port is not open"}
    rejected = await _rejection(proxy_env, ws_headers("sec", 8080))
    assert rejected.status_code == 403 and b"is missing" in rejected.body
    async with open_websocket("127.0.0.1", proxy_port(proxy_env), "/ws", use_ssl=False,
                              extra_headers=ws_headers("sec", 8080, **{"E2B-Traffic-Access-Token": TRAFFIC_TOKEN})) as ws:
        await ws.send_message("secured")
        assert await ws.get_message() == "secured"


async def test_websocket_guest_rejection_is_relayed(proxy_env: ProxyEnv) -> None:
    rejected = await _rejection(proxy_env, ws_headers(), path="/reject")
    assert rejected.status_code == 418 and rejected.body == b"teapot"


async def test_disconnect_closes_websockets_with_going_away(proxy_env: ProxyEnv) -> None:
    async with open_websocket("127.0.0.1", proxy_port(proxy_env), "/ws", use_ssl=False,
                              extra_headers=ws_headers()) as ws:
        await ws.send_message("hi")
        assert await ws.get_message() == "hi"
        assert await proxy_env.proxy.disconnect("abc") == 1
        with pytest.raises(ConnectionClosed) as info, trio.fail_after(5):
            await ws.get_message()
    assert info.value.reason.code == 1001
    with trio.fail_after(5):
        await proxy_env.state.ws_gone.wait()


async def test_websocket_connect_attempts_wait_for_a_late_guest_port(proxy_env: ProxyEnv) -> None:
    from ..conftest import free_port
    from .conftest import serve_asgi_on
    from .upstream import Upstream

    late_port = free_port()
    proxy_env.sandboxes.table["late"] = Resolution(host="127.0.0.1", port_map=lambda p: late_port,
                                                   connect_attempts=8)
    async with trio.open_nursery() as nursery:
        async def start_late() -> None:
            await trio.sleep(0.3)
            await nursery.start(partial(serve_asgi_on, Upstream(), late_port))

        nursery.start_soon(start_late)
        async with open_websocket("127.0.0.1", proxy_port(proxy_env), "/ws", use_ssl=False,
                                  extra_headers=ws_headers("late")) as ws:
            await ws.send_message("late hello")
            assert await ws.get_message() == "late hello"
        nursery.cancel_scope.cancel()
