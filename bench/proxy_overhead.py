"""Overhead of the sandbox traffic proxy (aenv_node.api.proxy.SandboxProxy).

Same run, same client, same upstream, interleaved request by request: requests go either straight to the
upstream server (the floor) or through a node-like server (Hypercorn serving
SandboxProxy around a Quart-trio app) routed by E2b-Sandbox-Id/Port headers.
Upstream and proxies run as separate processes, as in production (the client
is this process). Measured:

- latency of a 1 KiB unary POST (sequential, keep-alive client connection), and the
  CPU time the proxy and upstream processes spend per request (robust on a busy machine);
- throughput of 1 MiB downloads (sequential) and of 1 KiB requests with 16 in flight;
- the proxy with upstream keep-alive off (the default) and on.

    .venv/bin/python bench/proxy_overhead.py [N]
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parents[1]
N = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 300
MiB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----- server roles (run in child processes) ---------------------------------------

def upstream_app() -> Any:
    blob = os.urandom(MiB)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        data = blob if scope["path"] == "/download" else body
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream"),
                                (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    return app


def proxy_app(upstream_port: int, keepalive: bool) -> Any:
    from quart_trio import QuartTrio

    from aenv_node.api.proxy import Resolution, SandboxProxy

    node = QuartTrio("bench-node")
    resolution = Resolution(host="127.0.0.1", port_map=lambda p: upstream_port)

    async def resolver(sandbox_id: str, port: int) -> Resolution:
        return resolution

    return SandboxProxy(node, resolver, "", keepalive=keepalive)


def serve_role(role: str, port: int, *args: str) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.errorlog = None
    app = upstream_app() if role == "upstream" else proxy_app(int(args[0]), args[1] == "1")
    trio.run(serve, app, config)


# ----- client ---------------------------------------------------------------------------

async def wait_port(port: int) -> None:
    with trio.fail_after(20):
        while True:
            try:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                await stream.aclose()
                return
            except OSError:
                await trio.sleep(0.05)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (robust on a loaded machine, unlike wall time)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(targets: dict[str, tuple[str, dict[str, str], dict[str, int]]]) -> dict[str, Any]:
    """Interleaved rounds (one request per target in turn) so that load changes on a shared
    machine hit every target alike; CPU is counted per target phase from /proc."""
    payload = os.urandom(1024)
    clients = {name: httpx.AsyncClient(base_url=url, headers=headers, timeout=60,
                                       limits=httpx.Limits(max_connections=32))
               for name, (url, headers, _) in targets.items()}
    lat: dict[str, list[float]] = {name: [] for name in targets}
    dl: dict[str, float] = dict.fromkeys(targets, 0.0)
    par: dict[str, float] = dict.fromkeys(targets, 0.0)
    cpu_unary: dict[str, dict[str, float]] = {name: {} for name in targets}
    cpu_dl: dict[str, dict[str, float]] = {name: {} for name in targets}
    downloads = max(10, N // 6)
    bursts = max(3, N // 100)

    def cpu_add(acc: dict[str, float], pids: dict[str, int], before: dict[str, float]) -> None:
        for k, pid in pids.items():
            acc[k] = acc.get(k, 0.0) + cpu_s(pid) - before[k]

    try:
        for c in clients.values():
            for _ in range(20):  # warm-up
                (await c.post("/unary", content=payload)).raise_for_status()
        for _ in range(N):
            for name, c in clients.items():
                pids = targets[name][2]
                before = {k: cpu_s(pid) for k, pid in pids.items()}
                t = time.perf_counter()
                r = await c.post("/unary", content=payload)
                lat[name].append(time.perf_counter() - t)
                cpu_add(cpu_unary[name], pids, before)
                assert r.content == payload
        for _ in range(downloads):
            for name, c in clients.items():
                pids = targets[name][2]
                before = {k: cpu_s(pid) for k, pid in pids.items()}
                t = time.perf_counter()
                r = await c.get("/download")
                dl[name] += time.perf_counter() - t
                cpu_add(cpu_dl[name], pids, before)
                assert len(r.content) == MiB
        for _ in range(bursts):
            for name, c in clients.items():
                left = 64

                async def worker(c: httpx.AsyncClient = c) -> None:
                    nonlocal left
                    while left > 0:
                        left -= 1
                        (await c.post("/unary", content=payload)).raise_for_status()

                t = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for _ in range(16):
                        nursery.start_soon(worker)
                par[name] += time.perf_counter() - t
    finally:
        for c in clients.values():
            await c.aclose()
    out: dict[str, Any] = {}
    for name in targets:
        xs = sorted(lat[name])
        out[name] = {
            "unary_1k_median_ms": round(statistics.median(xs) * 1e3, 3),
            "unary_1k_p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 3),
            "download_1m_mib_per_s": round(downloads / dl[name], 1),
            "unary_1k_16_in_flight_req_per_s": round(bursts * 64 / par[name], 1),
            "cpu_ms_per_unary": {k: round(v / N * 1e3, 3) for k, v in cpu_unary[name].items()},
            "cpu_ms_per_1m_download": {k: round(v / downloads * 1e3, 3) for k, v in cpu_dl[name].items()},
            "n": N,
        }
    return out


async def main() -> None:
    procs: list[subprocess.Popen[bytes]] = []
    up_port, proxy_port, proxy_ka_port = free_port(), free_port(), free_port()
    me = [sys.executable, str(Path(__file__).resolve())]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        procs.append(subprocess.Popen([*me, "--serve", "upstream", str(up_port)], env=env))
        procs.append(subprocess.Popen([*me, "--serve", "proxy", str(proxy_port), str(up_port), "0"], env=env))
        procs.append(subprocess.Popen([*me, "--serve", "proxy", str(proxy_ka_port), str(up_port), "1"], env=env))
        for port in (up_port, proxy_port, proxy_ka_port):
            await wait_port(port)
        routed = {"E2b-Sandbox-Id": "bench", "E2b-Sandbox-Port": "49983"}
        up, px, ka = (p.pid for p in procs)
        res = await measure({
            "direct": (f"http://127.0.0.1:{up_port}", {}, {"upstream": up}),
            "proxy": (f"http://127.0.0.1:{proxy_port}", routed, {"upstream": up, "proxy": px}),
            "proxy_upstream_keepalive": (f"http://127.0.0.1:{proxy_ka_port}", routed,
                                         {"upstream": up, "proxy": ka}),
        })
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    d, p, k = res["direct"], res["proxy"], res["proxy_upstream_keepalive"]
    res["ratios"] = {
        "unary_latency_proxy_over_direct": round(p["unary_1k_median_ms"] / d["unary_1k_median_ms"], 2),
        "unary_latency_keepalive_proxy_over_direct": round(k["unary_1k_median_ms"] / d["unary_1k_median_ms"], 2),
        "download_throughput_proxy_over_direct": round(p["download_1m_mib_per_s"] / d["download_1m_mib_per_s"], 2),
        "parallel_req_per_s_proxy_over_direct": round(
            p["unary_1k_16_in_flight_req_per_s"] / d["unary_1k_16_in_flight_req_per_s"], 2),
        # the proxy's CPU per request over the upstream server's (a Hypercorn app of similar weight)
        "unary_cpu_proxy_over_upstream": round(
            p["cpu_ms_per_unary"]["proxy"] / max(d["cpu_ms_per_unary"]["upstream"], 1e-6), 2),
        "unary_cpu_keepalive_proxy_over_upstream": round(
            k["cpu_ms_per_unary"]["proxy"] / max(d["cpu_ms_per_unary"]["upstream"], 1e-6), 2),
        "download_cpu_proxy_over_upstream": round(
            p["cpu_ms_per_1m_download"]["proxy"] / max(d["cpu_ms_per_1m_download"]["upstream"], 1e-6), 2),
    }
    out = Path(__file__).with_name("results") / "proxy_overhead.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    for name in ("direct", "proxy", "proxy_upstream_keepalive"):
        v = res[name]
        print(f"{name:26s} 1KiB unary median {v['unary_1k_median_ms']:7.3f} ms p90 {v['unary_1k_p90_ms']:7.3f} ms | "
              f"1MiB downloads {v['download_1m_mib_per_s']:7.1f} MiB/s | "
              f"16 in flight {v['unary_1k_16_in_flight_req_per_s']:7.1f} req/s | CPU ms/unary "
              f"{v['cpu_ms_per_unary']} ms/MiB {v['cpu_ms_per_1m_download']}")
    r = res["ratios"]
    print(
        f"proxy_overhead: 1KiB unary {p['unary_1k_median_ms']:.2f} ms vs {d['unary_1k_median_ms']:.2f} ms direct "
        f"({r['unary_latency_proxy_over_direct']}x; {r['unary_latency_keepalive_proxy_over_direct']}x with upstream "
        f"keep-alive), 1MiB downloads {p['download_1m_mib_per_s']:.0f} vs {d['download_1m_mib_per_s']:.0f} MiB/s "
        f"({r['download_throughput_proxy_over_direct']}x), 16 in flight "
        f"{r['parallel_req_per_s_proxy_over_direct']}x direct req/s; proxy CPU per unary "
        f"{p['cpu_ms_per_unary']['proxy']:.2f} ms ({r['unary_cpu_proxy_over_upstream']}x the upstream server's, "
        f"{r['unary_cpu_keepalive_proxy_over_upstream']}x with keep-alive), per MiB "
        f"{p['cpu_ms_per_1m_download']['proxy']:.2f} ms ({r['download_cpu_proxy_over_upstream']}x)"
    )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--serve":
        serve_role(sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
    else:
        trio.run(main)
