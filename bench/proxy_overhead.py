"""The sandbox traffic proxy against nginx: the same upstream served directly, through nginx, through ours.

Three targets, one upstream server (a Hypercorn ASGI app, the weight of a Python server in a guest such as
envd), each in its own process as in production, the client being this process:

- ``direct``: the upstream itself (the floor);
- ``nginx``: Debian's nginx as a plain reverse proxy (a config generated in a temp dir: one worker, upstream
  keep-alive as nginx's docs recommend for a reverse proxy, no access log, buffering at its defaults), run as
  the current user with ``daemon off`` and stopped by its PID at the end;
- ``proxy``: the node's own listener (``aenv_node.api.server.serve_api``: the sandbox proxy in front of a
  Quart-trio app, as ``aenv-node server`` runs it), routed by E2b-Sandbox-Id/Port headers.

Measured per target, in rounds that alternate the targets so that load changes on a shared machine hit
every target alike: 1 KiB unary POST latency p50/p99 (sequential, one keep-alive connection), 1 MiB
download and 1 MiB upload throughput (sequential), 1 KiB unary req/s with 64 requests in flight (64
keep-alive connections), and the CPU time each server process spends per request (user + system from
/proc/PID/stat; all of nginx's processes). The client is a minimal HTTP/1.1 client over plain sockets, so
that its own cost (common to all targets) hides as little of the servers' as possible.

    .venv/bin/python bench/proxy_overhead.py [--smoke] [N]   (N: 1 KiB requests per target, 3000)

``--smoke`` runs a few requests of each kind (`bench/run --smoke`: the bench and all three paths work); its
JSON goes where bench/run points it, or to a temporary directory, a real run's to bench/results/proxy_overhead.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from _results import result_path

ROOT = Path(__file__).resolve().parents[1]
KiB, MiB = 1024, 1024 * 1024
ROUTED = {"E2b-Sandbox-Id": "bench", "E2b-Sandbox-Port": "49983"}
STREAMS = 64


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# ----- server roles (run in child processes) ---------------------------------------------

def upstream_app() -> Any:
    """``/download``: 1 MiB; ``/upload``: reads the body, answers its size; anything else echoes the body."""
    blob = os.urandom(MiB)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        data = blob if scope["path"] == "/download" else str(len(body)).encode() if scope["path"] == "/upload" \
            else body
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def serve_upstream(port: int) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    config.keep_alive_timeout = 75  # as the node's (and nginx's): idle client connections wait for their round
    config.keep_alive_max_requests = 10**9  # (Hypercorn closes a connection after 1000 by default)
    trio.run(serve, upstream_app(), config)


def serve_proxy(port: int, upstream_port: int) -> None:
    """The node's API listener with its sandbox proxy; every sandbox resolves to the upstream."""
    from quart_trio import QuartTrio

    from aenv_node.api.proxy import Resolution, SandboxProxy
    from aenv_node.api.server import api_hypercorn_config, serve_api, shield_last_send
    from aenv_node.api.traffic import ASGIApp

    resolution = Resolution(host="127.0.0.1", port_map=lambda p: upstream_port)

    async def resolver(sandbox_id: str, port: int) -> Resolution:
        return resolution

    async def main() -> None:
        asgi: ASGIApp = shield_last_send(QuartTrio("bench-node"))  # type: ignore[arg-type]
        async with SandboxProxy(asgi, resolver, "") as proxy:
            await serve_api(asgi, proxy, api_hypercorn_config(f"127.0.0.1:{port}", 5.0),
                            shutdown_trigger=trio.sleep_forever)

    trio.run(main)


NGINX_CONF = """\
{user}worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    client_max_body_size 64m;
    keepalive_requests 100000;
    upstream sandbox {{
        server 127.0.0.1:{upstream};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://sandbox;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
        }}
    }}
}}
"""


def start_nginx(tmp: Path, port: int, upstream_port: int) -> subprocess.Popen[bytes]:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    # as root, nginx would hand its worker to "nobody": keep it the current user, as the other servers
    user = f"user {_user_name()} {_group_name()};\n" if os.geteuid() == 0 else ""
    (tmp / "nginx.conf").write_text(NGINX_CONF.format(user=user, tmp=tmp, port=port, upstream=upstream_port))
    return subprocess.Popen([nginx, "-p", str(tmp), "-c", str(tmp / "nginx.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _user_name() -> str:
    import pwd
    return pwd.getpwuid(os.geteuid()).pw_name


def _group_name() -> str:
    import grp
    return grp.getgrgid(os.getegid()).gr_name


# ----- process accounting ---------------------------------------------------------------

def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (robust on a loaded machine, unlike wall time)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_children(pid: int) -> list[int]:
    """A process and its children (nginx's master and its workers)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *map(int, children)]


# ----- client ---------------------------------------------------------------------------

def request_bytes(method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: bench", *(f"{k}: {v}" for k, v in headers.items())]
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class Response:
    """Parses one Content-Length response from bytes as they come; ``feed`` returns the bytes after it."""

    def __init__(self) -> None:
        self.buf = b""
        self.length = -1
        self.head_end = -1
        self.status = 0
        self.close = False

    def feed(self, data: bytes) -> bytes | None:
        self.buf += data
        if self.head_end < 0:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return None
            self.head_end = end + 4
            head = self.buf[:end].decode("latin-1").split("\r\n")
            self.status = int(head[0].split()[1])
            for line in head[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    self.length = int(value)
                elif name.strip().lower() == "connection" and "close" in value.lower():
                    self.close = True
                elif name.strip().lower() == "transfer-encoding":
                    raise RuntimeError(f"the bench's client reads Content-Length responses only: {line}")
            if self.length < 0:
                raise RuntimeError("response without Content-Length")
        if len(self.buf) - self.head_end < self.length:
            return None
        rest = self.buf[self.head_end + self.length:]
        self.buf = self.buf[self.head_end:self.head_end + self.length]
        return rest

    @property
    def body(self) -> bytes:
        return self.buf


def _eof(port: int) -> bytes:
    raise RuntimeError(f"the server on port {port} closed the connection")


class Client:
    """One keep-alive connection, blocking (sequential measurements)."""

    def __init__(self, port: int, headers: dict[str, str]) -> None:
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.headers = headers

    def request(self, method: str, path: str, body: bytes = b"") -> bytes:
        self.sock.sendall(request_bytes(method, path, self.headers, body))
        response = Response()
        while (rest := response.feed(self.sock.recv(256 * KiB) or _eof(self.port))) is None:
            pass
        if rest or response.status != 200:
            raise RuntimeError(f"status {response.status}, {len(rest)} bytes after the response")
        if response.close:
            self.sock.close()
            self.sock = socket.create_connection(("127.0.0.1", self.port))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return response.body

    def close(self) -> None:
        self.sock.close()


async def concurrent(port: int, headers: dict[str, str], payload: bytes, total: int) -> float:
    """``total`` 1 KiB requests over STREAMS keep-alive connections, STREAMS in flight; returns seconds."""
    raw = request_bytes("POST", "/unary", headers, payload)
    left = total

    async def worker() -> None:
        nonlocal left
        while left > 0:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                while left > 0:
                    left -= 1
                    await stream.send_all(raw)
                    response = Response()
                    while (rest := response.feed(bytes(await stream.receive_some(64 * KiB)) or _eof(port))) is None:
                        pass
                    assert not rest and response.body == payload, response.status
                    if response.close:
                        break

    t = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(STREAMS):
            nursery.start_soon(worker)
    return time.perf_counter() - t


# ----- the measurement --------------------------------------------------------------------

KINDS = ("unary", "download", "upload", "concurrent")


def measure(targets: dict[str, tuple[int, dict[str, str], list[int]]], n: int, smoke: bool) -> dict[str, Any]:
    payload, big = os.urandom(KiB), os.urandom(MiB)
    rounds = 2 if smoke else 8
    per_round = {"unary": max(5, n // rounds), "download": 2 if smoke else max(4, n // 80),
                 "upload": 2 if smoke else max(4, n // 80), "concurrent": STREAMS * (1 if smoke else max(2, n // 250))}
    clients = {name: Client(port, headers) for name, (port, headers, _) in targets.items()}
    lat: dict[str, list[float]] = {name: [] for name in targets}
    wall = {name: dict.fromkeys(KINDS, 0.0) for name in targets}
    count = {name: dict.fromkeys(KINDS, 0) for name in targets}
    cpu: dict[str, dict[str, dict[str, float]]] = {name: {kind: {} for kind in KINDS} for name in targets}

    def timed(name: str, kind: str, run: Callable[[], float], requests: int) -> None:
        pids = targets[name][2]
        before = {pid: cpu_s(pid) for pid in pids}
        wall[name][kind] += run()
        count[name][kind] += requests
        acc: dict[str, float] = cpu[name][kind]
        for pid in pids:
            role = "upstream" if pid == pids[0] else name
            acc[role] = acc.get(role, 0.0) + cpu_s(pid) - before[pid]

    def unary(c: Client, k: int, name: str) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            t = time.perf_counter()
            assert c.request("POST", "/unary", payload) == payload
            lat[name].append(time.perf_counter() - t)
        return time.perf_counter() - t0

    def download(c: Client, k: int) -> float:
        t = time.perf_counter()
        for _ in range(k):
            assert len(c.request("GET", "/download")) == MiB
        return time.perf_counter() - t

    def upload(c: Client, k: int) -> float:
        t = time.perf_counter()
        for _ in range(k):
            assert c.request("POST", "/upload", big) == str(MiB).encode()
        return time.perf_counter() - t

    try:
        for name, c in clients.items():  # warm-up: connections, pools, code paths
            for _ in range(20):
                c.request("POST", "/unary", payload)
            c.request("GET", "/download")
            c.request("POST", "/upload", big)
            trio.run(concurrent, targets[name][0], targets[name][1], payload, STREAMS)
        for _ in range(rounds):
            for name, c in clients.items():
                k = per_round["unary"]
                timed(name, "unary", lambda: unary(c, k, name), k)
                k = per_round["download"]
                timed(name, "download", lambda: download(c, k), k)
                k = per_round["upload"]
                timed(name, "upload", lambda: upload(c, k), k)
                k = per_round["concurrent"]
                timed(name, "concurrent", lambda: trio.run(concurrent, targets[name][0], targets[name][1],
                                                           payload, k), k)
    finally:
        for c in clients.values():
            c.close()

    out: dict[str, Any] = {}
    for name in targets:
        xs = sorted(lat[name])
        out[name] = {
            "unary_1k_p50_ms": round(xs[len(xs) // 2] * 1e3, 3),
            "unary_1k_p99_ms": round(xs[min(len(xs) - 1, int(0.99 * len(xs)))] * 1e3, 3),
            "download_1m_mib_per_s": round(count[name]["download"] / wall[name]["download"], 1),
            "upload_1m_mib_per_s": round(count[name]["upload"] / wall[name]["upload"], 1),
            f"unary_1k_{STREAMS}_in_flight_req_per_s": round(count[name]["concurrent"] / wall[name]["concurrent"]),
            "cpu_ms_per_request": {kind: {role: round(s / count[name][kind] * 1e3, 3)
                                          for role, s in cpu[name][kind].items()} for kind in KINDS},
            "requests": count[name],
        }
    return out


def ratios(res: dict[str, Any]) -> dict[str, Any]:
    conc = f"unary_1k_{STREAMS}_in_flight_req_per_s"
    out: dict[str, Any] = {}
    for base in ("nginx", "direct"):
        for name in ("proxy", "nginx"):
            if name == base:
                continue
            a, b = res[name], res[base]
            r: dict[str, float | None] = {
                "unary_p50": a["unary_1k_p50_ms"] / b["unary_1k_p50_ms"],
                "unary_p99": a["unary_1k_p99_ms"] / b["unary_1k_p99_ms"],
                "download": a["download_1m_mib_per_s"] / b["download_1m_mib_per_s"],
                "upload": a["upload_1m_mib_per_s"] / b["upload_1m_mib_per_s"],
                "concurrent": a[conc] / b[conc],
            }
            if base == "nginx":
                for kind in KINDS:  # None: nginx's CPU was below the clock tick (a smoke run)
                    theirs = b["cpu_ms_per_request"][kind]["nginx"]
                    r[f"cpu_{kind}"] = a["cpu_ms_per_request"][kind]["proxy"] / theirs if theirs else None
            out[f"{name}_over_{base}"] = {k: None if v is None else round(v, 2) for k, v in r.items()}
    return out


def main() -> None:
    smoke = "--smoke" in sys.argv
    numbers = [a for a in sys.argv[1:] if a.isdigit()]
    n = int(numbers[0]) if numbers else (20 if smoke else 3000)
    up_port, proxy_port, nginx_port = free_port(), free_port(), free_port()
    me = [sys.executable, str(Path(__file__).resolve())]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="bench-nginx-") as tmp:
        try:
            procs.append(subprocess.Popen([*me, "--serve", "upstream", str(up_port)], env=env))
            procs.append(subprocess.Popen([*me, "--serve", "proxy", str(proxy_port), str(up_port)], env=env))
            procs.append(start_nginx(Path(tmp), nginx_port, up_port))
            for port in (up_port, proxy_port, nginx_port):
                wait_port(port, procs)
            up, px, ngx = (p.pid for p in procs)
            res = measure({
                "direct": (up_port, {}, [up]),
                "nginx": (nginx_port, {}, [up, *with_children(ngx)]),
                "proxy": (proxy_port, ROUTED, [up, px]),
            }, n, smoke)
        finally:
            for p in procs:  # by PID: nginx stops on SIGTERM (fast shutdown), our servers too
                p.send_signal(signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    res["ratios"] = ratios(res)
    res["n"] = n
    res["smoke"] = smoke
    res["nginx_config"] = NGINX_CONF
    # a smoke run's figures mean nothing: they go beside, not over, the real ones (bench/_results.py)
    out = result_path("proxy_overhead", smoke=smoke)
    out.write_text(json.dumps(res, indent=2) + "\n")
    conc = f"unary_1k_{STREAMS}_in_flight_req_per_s"
    for name in ("direct", "nginx", "proxy"):
        v = res[name]
        server_cpu = {kind: v["cpu_ms_per_request"][kind].get(name) for kind in KINDS}
        print(f"{name:7s} 1KiB unary p50 {v['unary_1k_p50_ms']:6.3f} ms p99 {v['unary_1k_p99_ms']:6.3f} ms | "
              f"1MiB down {v['download_1m_mib_per_s']:6.1f} up {v['upload_1m_mib_per_s']:6.1f} MiB/s | "
              f"{STREAMS} in flight {v[conc]:6d} req/s | proxy CPU ms/request {server_cpu} | "
              f"upstream CPU ms/unary {v['cpu_ms_per_request']['unary']['upstream']}")
    for key, r in res["ratios"].items():
        print(f"{key:18s} " + ", ".join(f"{k} {v}x" for k, v in r.items()))
    print(f"written to {out}")


def wait_port(port: int, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port)).close()
            return
        except OSError:
            for p in procs:
                if p.poll() is not None:
                    err = p.stderr.read().decode() if p.stderr else ""
                    raise RuntimeError(f"{p.args!r} exited with {p.returncode}: {err}") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        if sys.argv[2] == "upstream":
            serve_upstream(int(sys.argv[3]))
        else:
            serve_proxy(int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
