"""HTTP sandbox traffic through SandboxProxy: routing, errors, streaming, large bodies, disconnects."""

from __future__ import annotations

import gzip
import hashlib
import json
import struct
from collections.abc import AsyncIterator
from functools import partial

import httpx
import pytest
import trio

from aenv_node.api.proxy import ProxyReject, Resolution, SandboxProxy, route

from ..conftest import free_port
from .conftest import (
    DOMAIN,
    TRAFFIC_TOKEN,
    ProxyEnv,
    Sandboxes,
    node_app,
    sandbox_headers,
    serve_proxy,
    serve_asgi_on,
)
from .upstream import big_payload, envelope

MiB = 1024 * 1024


def header_pairs(**headers: str) -> list[tuple[bytes, bytes]]:
    return [(k.lower().replace("_", "-").encode(), v.encode()) for k, v in headers.items()]


# ----- routing (pure) ---------------------------------------------------------------

def test_route_by_headers_and_host() -> None:
    t = route(header_pairs(e2b_sandbox_id="abc", e2b_sandbox_port="49983", host="node:8000"), "")
    assert t is not None and (t.sandbox_id, t.port) == ("abc", 49983)
    t = route(header_pairs(host=f"8080-xyz.{DOMAIN}"), DOMAIN)
    assert t is not None and (t.sandbox_id, t.port) == ("xyz", 8080)
    t = route(header_pairs(host=f"3000-xyz-client1.{DOMAIN.upper()}:443"), DOMAIN)  # old SDK hosts
    assert t is not None and (t.sandbox_id, t.port) == ("xyz", 3000)
    # not sandbox traffic
    assert route(header_pairs(host=f"8080-xyz.{DOMAIN}"), "") is None  # no domain: headers only
    assert route(header_pairs(host=f"api.{DOMAIN}"), DOMAIN) is None
    assert route(header_pairs(host="8080-xyz.other.test"), DOMAIN) is None
    assert route(header_pairs(host=f"a.8080-xyz.{DOMAIN}"), DOMAIN) is None
    assert route(header_pairs(host="127.0.0.1:8000"), DOMAIN) is None


@pytest.mark.parametrize("headers, fragment", [
    ({"e2b_sandbox_id": "abc"}, "E2b-Sandbox-Port"),
    ({"e2b_sandbox_port": "49983"}, "E2b-Sandbox-Id"),
    ({"e2b_sandbox_id": "abc", "e2b_sandbox_port": "http"}, "invalid sandbox port"),
    ({"e2b_sandbox_id": "abc", "e2b_sandbox_port": "70000"}, "invalid sandbox port"),
    ({"e2b_sandbox_id": "a/b", "e2b_sandbox_port": "1"}, "invalid sandbox id"),
])
def test_route_rejects_malformed_headers(headers: dict[str, str], fragment: str) -> None:
    with pytest.raises(ProxyReject) as info:
        route(header_pairs(**headers), DOMAIN)
    assert info.value.status == 400 and fragment in info.value.message


# ----- routing (live) ---------------------------------------------------------------

async def test_header_routing_reaches_the_sandbox(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        r = await c.post("/echo/a%2Fb?x=1&y=%20", content=b"payload",
                         headers=sandbox_headers(**{"X-Access-Token": "t0k", "Authorization": "Basic dTo=",
                                                    "Connect-Protocol-Version": "1",
                                                    "Keepalive-Ping-Interval": "50"}))
    assert r.status_code == 200, r.text
    echo = r.json()
    assert echo["method"] == "POST" and echo["raw_path"] == "/echo/a%2Fb" and echo["query"] == "x=1&y=%20"
    assert echo["length"] == 7 and echo["sha256"] == hashlib.sha256(b"payload").hexdigest()
    got = {k: v for k, v in echo["headers"]}
    for name, value in [("x-access-token", "t0k"), ("authorization", "Basic dTo="),
                        ("connect-protocol-version", "1"), ("keepalive-ping-interval", "50"),
                        ("e2b-sandbox-id", "abc"), ("e2b-sandbox-port", "49983")]:
        assert got[name] == value
    assert got["host"] == proxy_env.url.removeprefix("http://")  # the client's Host is preserved
    assert proxy_env.sandboxes.calls == [("abc", 49983)]


async def test_host_routing_reaches_the_sandbox(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        r = await c.get("/echo/x", headers={"Host": f"8080-abc.{DOMAIN}"})
    assert r.status_code == 200, r.text
    assert r.json()["path"] == "/echo/x"
    assert proxy_env.sandboxes.calls == [("abc", 8080)]


async def test_other_requests_reach_the_app(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        r = await c.get("/hello")
        assert r.status_code == 200 and r.text == "hello from the node app"
        r = await c.get("/hello", headers={"Host": f"api.{DOMAIN}"})
        assert r.status_code == 200 and r.text == "hello from the node app"
    assert proxy_env.sandboxes.calls == []


async def test_malformed_sandbox_headers_are_400_json(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        r = await c.get("/echo", headers={"E2b-Sandbox-Id": "abc"})
    assert r.status_code == 400
    assert r.json() == {"code": 400, "message": "missing header E2b-Sandbox-Port (E2b-Sandbox-Id was given)"}


# ----- errors -------------------------------------------------------------------------

async def test_not_running_is_502_exact_json(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        for headers in (sandbox_headers("gone"), sandbox_headers("unknown", 8080), {"Host": f"49983-gone.{DOMAIN}"}):
            r = await c.post("/echo", content=b"x" * 1000, headers=headers)
            assert r.status_code == 502
            assert r.headers["content-type"] == "application/json"
            sid = headers.get("E2b-Sandbox-Id", "gone")
            assert r.json() == {"code": 502, "message": f"The sandbox {sid} was not found"}


async def test_resolver_errors_are_json(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        r = await c.get("/", headers=sandbox_headers("deleted"))
        assert r.status_code == 502 and r.json() == {"code": 502, "message": "The sandbox deleted was not found"}
        r = await c.get("/", headers=sandbox_headers("draining"))
        assert r.status_code == 503 and "shutting down" in r.json()["message"]
        r = await c.get("/", headers=sandbox_headers("broken"))
        assert r.status_code == 500 and "resolver bug" not in r.json()["message"]


async def test_closed_port_is_502_port_not_open(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        r = await c.get("/", headers=sandbox_headers("abc", 9999))
    assert r.status_code == 502
    assert r.json() == {"code": 502, "message": "The sandbox is running but port is not open"}


async def test_upstream_status_and_headers_pass_through(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        r = await c.get("/echo?status=404", headers=sandbox_headers())
        assert r.status_code == 404 and r.json()["method"] == "GET"
        r = await c.get("/cookies", headers=sandbox_headers())
        assert r.status_code == 201
        assert r.headers.get_list("set-cookie") == ["a=1; Path=/", "b=2; Path=/"]
        assert r.headers["x-custom"] == "yes"
        assert len(r.headers.get_list("date")) == 1


async def test_gzip_passes_through_untouched(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        async with c.stream("GET", "/gzip", headers=sandbox_headers(**{"Accept-Encoding": "gzip"})) as r:
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
    assert r.headers["content-encoding"] == "gzip"
    assert int(r.headers["content-length"]) == len(raw)
    assert gzip.decompress(raw) == b"hello " * 1000


async def test_traffic_token_enforced_on_non_envd_ports(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        r = await c.get("/echo", headers=sandbox_headers("sec", 8080))
        assert r.status_code == 403
        assert r.json() == {"code": 403, "message": "Sandbox is secured with traffic access token. "
                                                    "Token header 'e2b-traffic-access-token' is missing"}
        r = await c.get("/echo", headers=sandbox_headers("sec", 8080, **{"E2B-Traffic-Access-Token": "nope"}))
        assert r.status_code == 403 and "is invalid" in r.json()["message"]
        r = await c.get("/echo", headers=sandbox_headers("sec", 8080, **{"E2B-Traffic-Access-Token": TRAFFIC_TOKEN}))
        assert r.status_code == 200
        r = await c.get("/echo", headers={"Host": f"8080-sec.{DOMAIN}", "e2b-traffic-access-token": TRAFFIC_TOKEN})
        assert r.status_code == 200
        # envd's port checks its own X-Access-Token: no traffic token needed
        r = await c.get("/echo", headers=sandbox_headers("sec", 49983))
        assert r.status_code == 200
        # sandboxes without a traffic token are open on every port
        r = await c.get("/echo", headers=sandbox_headers("abc", 8080))
        assert r.status_code == 200


# ----- streaming --------------------------------------------------------------------

async def test_streaming_upload_without_content_length(proxy_env: ProxyEnv) -> None:
    """Chunks reach the guest as they are sent: chunk 2 is only sent once chunk 1 arrived."""
    state = proxy_env.state
    sent = []

    async def body() -> AsyncIterator[bytes]:
        for i in range(4):
            chunk = bytes([65 + i]) * (1000 + i)
            sent.append(chunk)
            arrived = len(state.chunks)
            yield chunk
            with trio.fail_after(10):  # a buffering proxy deadlocks here
                while len(state.chunks) == arrived:
                    await trio.sleep(0.005)

    async with proxy_env.client() as c:
        r = await c.post("/sink", content=body(), headers=sandbox_headers())
    assert r.status_code == 200, r.text
    data = b"".join(sent)
    assert r.json()["length"] == len(data) and r.json()["sha256"] == hashlib.sha256(data).hexdigest()
    assert "content-length" not in dict(state.last_headers)
    assert dict(state.last_headers)["transfer-encoding"] == "chunked"


async def test_streaming_response_arrives_incrementally(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        async with c.stream("GET", "/slow?n=6&delay=0.25", headers=sandbox_headers()) as r:
            assert r.status_code == 200
            chunks = r.aiter_raw()
            first = await chunks.__anext__()
            assert first.startswith(b"chunk 0")
            assert not proxy_env.state.stream_done.is_set()  # the guest is still streaming
            rest = b"".join([chunk async for chunk in chunks])
    assert (first + rest).decode().splitlines() == [f"chunk {i}" for i in range(6)]
    assert proxy_env.state.stream_done.is_set()


async def test_large_bodies_both_ways(proxy_env: ProxyEnv) -> None:
    size = 16 * MiB
    data = big_payload(size)

    async def body() -> AsyncIterator[bytes]:
        for i in range(0, size, MiB):
            yield data[i:i + MiB]

    async with proxy_env.client() as c:
        r = await c.post("/sink", content=data, headers=sandbox_headers())  # with Content-Length
        assert r.json() == {"length": size, "sha256": hashlib.sha256(data).hexdigest(),
                            "chunks": len(proxy_env.state.chunks)}
        proxy_env.state.chunks.clear()
        r = await c.post("/sink", content=body(), headers=sandbox_headers())  # chunked
        assert r.json()["length"] == size and r.json()["sha256"] == hashlib.sha256(data).hexdigest()
        digest = hashlib.sha256()
        total = 0
        async with c.stream("GET", f"/big?size={size}", headers=sandbox_headers()) as r:
            assert int(r.headers["content-length"]) == size
            async for chunk in r.aiter_raw():
                digest.update(chunk)
                total += len(chunk)
    assert total == size and digest.hexdigest() == hashlib.sha256(data).hexdigest()


async def test_connect_envelope_stream_passes_through(proxy_env: ProxyEnv) -> None:
    """A Connect client stream (StreamInput-like, chunked) answered by a server stream."""

    async def body() -> AsyncIterator[bytes]:
        for n in range(3):
            frame = envelope({"n": n})
            yield frame[:3]  # split envelopes across chunks: the proxy must not care
            await trio.sleep(0.01)
            yield frame[3:]

    received: list[tuple[int, dict]] = []
    async with proxy_env.client() as c:
        async with c.stream("POST", "/connect", content=body(), headers=sandbox_headers(**{
            "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1",
        })) as r:
            assert r.headers["content-type"] == "application/connect+json"
            buf = b""
            async for chunk in r.aiter_raw():
                buf += chunk
                while len(buf) >= 5 and len(buf) >= 5 + struct.unpack(">I", buf[1:5])[0]:
                    size = struct.unpack(">I", buf[1:5])[0]
                    received.append((buf[0], json.loads(buf[5:5 + size])))
                    buf = buf[5 + size:]
    assert buf == b""
    echoes = [m["echo"]["n"] for f, m in received if "echo" in m]
    assert echoes == [0, 1, 2]
    assert sum(1 for _, m in received if m.get("event") == {"keepalive": {}}) == 3
    assert received[-1] == (2, {})


async def test_client_disconnect_cancels_upstream(proxy_env: ProxyEnv) -> None:
    state = proxy_env.state
    async with proxy_env.client() as c:
        async with c.stream("POST", "/forever", content=b"{}", headers=sandbox_headers()) as r:
            chunks = r.aiter_raw()
            await chunks.__anext__()
            await chunks.__anext__()
            assert state.forever_started.is_set() and not state.forever_gone.is_set()
        # leaving the block closes the half-read response, i.e. the connection
    with trio.fail_after(10):
        await state.forever_gone.wait()


async def test_client_disconnect_during_upload_cancels_upstream(proxy_env: ProxyEnv) -> None:
    state = proxy_env.state

    async def stalled_body() -> AsyncIterator[bytes]:
        yield b"first chunk"
        await trio.sleep_forever()
        yield b""  # pragma: no cover

    async with proxy_env.client() as c, trio.open_nursery() as nursery:
        async def upload() -> None:
            await c.post("/sink", content=stalled_body(), headers=sandbox_headers())

        nursery.start_soon(upload)
        with trio.fail_after(10):
            await state.chunk_arrived.wait()
        nursery.cancel_scope.cancel()  # the client gives up mid-upload: its connection closes
    with trio.fail_after(10):
        await state.sink_gone.wait()


async def test_upstream_that_dies_mid_response_truncates(proxy_env: ProxyEnv) -> None:
    """The status is already sent, so the client must see a broken body, not a complete one."""
    listener = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener[0].socket.getsockname()[1]

    async def half_answer() -> None:
        stream = await listener[0].accept()
        async with stream:
            await stream.receive_some(65536)
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
        # connection closed after 10 of 100 bytes

    proxy_env.sandboxes.table["dying"] = Resolution(host="127.0.0.1", port_map=lambda p: port)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(half_answer)
        async with proxy_env.client() as c:
            with pytest.raises(httpx.RemoteProtocolError):
                await c.get("/", headers=sandbox_headers("dying", 1234))
    await listener[0].aclose()


async def test_many_concurrent_streams(proxy_env: ProxyEnv) -> None:
    """No pool limit: 40 requests are in flight in the guest at the same time (a barrier there)."""
    statuses: list[int] = []

    async def one(c: httpx.AsyncClient) -> None:
        async with c.stream("GET", "/barrier?n=40", headers=sandbox_headers()) as r:
            await r.aread()
        statuses.append(r.status_code)

    async with proxy_env.client(limits=httpx.Limits(max_connections=None)) as c:
        async with trio.open_nursery() as nursery:
            for _ in range(40):
                nursery.start_soon(one, c)
    assert statuses == [200] * 40


async def test_head_request(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c:
        r = await c.head(f"/big?size={MiB}", headers=sandbox_headers())
    assert r.status_code == 200 and r.headers["content-length"] == str(MiB) and r.content == b""


@pytest.mark.parametrize("keepalive", [False, True])
async def test_upstream_connection_reuse_follows_keepalive(proxy_env: ProxyEnv, keepalive: bool) -> None:
    """Default: one upstream connection per request (slots get reused); keepalive=True pools them."""
    sandboxes = Sandboxes({"abc": proxy_env.sandboxes.table["abc"]})
    async with SandboxProxy(node_app(), sandboxes.resolve, DOMAIN, keepalive=keepalive) as proxy:
        async with serve_proxy(proxy) as port:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                peer_list = []
                for _ in range(5):
                    r = await c.get("/echo", headers=sandbox_headers())
                    assert r.status_code == 200
                    peer_list.append(r.json()["client_port"])
                with trio.fail_after(5):  # the proxy finishes a request just after its client
                    while proxy.active("abc"):
                        await trio.sleep(0.01)
                # without keep-alive nothing is held once requests end; with it, the sandbox's pool
                assert proxy.tracked() == (1 if keepalive else 0)
                assert await proxy.disconnect("abc") == 0  # no request in flight; pool closed
                assert proxy.tracked() == 0
                r = await c.get("/echo", headers=sandbox_headers())
                peer_list.append(r.json()["client_port"])
    assert len(set(peer_list[:5])) == (1 if keepalive else 5), peer_list
    assert peer_list[5] not in peer_list[:5]  # after disconnect: a fresh upstream connection


async def test_disconnect_cuts_streams_of_a_vanished_sandbox(proxy_env: ProxyEnv) -> None:
    """proxy.disconnect(id) (sandbox killed/paused) breaks off its streams; others are untouched."""
    state = proxy_env.state
    async with proxy_env.client() as c:
        async with c.stream("POST", "/forever", content=b"{}", headers=sandbox_headers()) as r:
            chunks = r.aiter_raw()
            await chunks.__anext__()
            assert proxy_env.proxy.active("abc") == 1
            assert await proxy_env.proxy.disconnect("abc") == 1
            with pytest.raises(httpx.RemoteProtocolError), trio.fail_after(10):
                async for _ in chunks:
                    pass
        with trio.fail_after(10):
            await state.forever_gone.wait()
        assert proxy_env.proxy.active("abc") == 0
        assert await proxy_env.proxy.disconnect("abc") == 0
        r = await c.get("/echo", headers=sandbox_headers())  # new traffic is routed again
        assert r.status_code == 200


async def test_disconnect_before_the_response_is_502_not_found(proxy_env: ProxyEnv) -> None:
    async with proxy_env.client() as c, trio.open_nursery() as nursery:
        async def cut_when_waiting() -> None:
            while proxy_env.state.waiting == 0:
                await trio.sleep(0.01)
            assert await proxy_env.proxy.disconnect("abc") == 1

        nursery.start_soon(cut_when_waiting)
        r = await c.get("/barrier?n=2", headers=sandbox_headers())  # never answers on its own
    assert r.status_code == 502
    assert r.json() == {"code": 502, "message": "The sandbox abc was not found"}


@pytest.mark.parametrize("attempts, expect", [(1, 502), (8, 200)])
async def test_connect_attempts_wait_for_a_late_guest_port(proxy_env: ProxyEnv, attempts: int,
                                                           expect: int) -> None:
    """Just after a resume the guest's port may refuse for a moment: the resolver asks for retries."""
    from .upstream import Upstream

    late_port = free_port()
    proxy_env.sandboxes.table["late"] = Resolution(host="127.0.0.1", port_map=lambda p: late_port,
                                                   connect_attempts=attempts)

    async def start_late() -> None:
        await trio.sleep(0.3)
        await nursery.start(partial(serve_asgi_on, Upstream(), late_port))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(start_late)
        async with proxy_env.client() as c:
            r = await c.post("/echo", content=b"late body", headers=sandbox_headers("late"))
        nursery.cancel_scope.cancel()
    assert r.status_code == expect, r.text
    if expect == 200:
        assert r.json()["length"] == len(b"late body")
