"""The cluster scheduler's own cost: heartbeat and placement latency, placements per second and the scheduler's
CPU per placement, with 3, 30 and 300 registered nodes, against the floor of the Redis round trips a placement
needs (measured in the same run, from this process, on the same Redis).

A real redis-server (unix socket, nothing persisted) and a real ``aenv-node scheduler`` process; this process is
the client (httpx, keep-alive). A placement reads every node and every reservation (one pipelined round trip:
TIME, two HGETALLs) and writes one reservation (TIME, HSET): the floor is those Redis calls made directly,
without parsing what they return.

    .venv/bin/python bench/scheduler.py [N]     # N placements per measurement (default 400)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stats import ms, pct, utc_now  # noqa: E402
from _results import result_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 400
KEY = "bench-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def status(i: int) -> dict[str, Any]:
    return {"node_id": f"node-{i}", "url": f"http://10.9.{i // 250}.{i % 250 + 1}:8000", "software": "bench",
            "capacity": {"vcpus": 64, "memory_mb": 262144, "disk_free_mb": 100000, "slots_free": 1000},
            "load": {"running": 10, "paused": 100, "vcpus": 20, "memory_mb": 10240},
            "templates": ["base", f"t{i % 7}"], "draining": False}


def timed(fn: Any, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def summary(samples: list[float]) -> dict[str, float]:
    return {"p50_ms": ms(pct(samples, 50)), "p99_ms": ms(pct(samples, 99))}


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-sched-"))
    sock = tmp / "redis.sock"
    rproc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket",
                              str(sock), "--save", "", "--appendonly", "no", "--dir", str(tmp)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not sock.exists():
        time.sleep(0.02)
    (tmp / "key").write_text(KEY)
    port = free_port()
    sproc = subprocess.Popen([sys.executable, "-m", "aenv_node.cli.node", "scheduler", "--listen",
                              f"127.0.0.1:{port}", "--redis", f"unix://{sock}", "--api-key-file", str(tmp / "key"),
                              "--node-ttl", "3600", "--log-level", "warning"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             env={k: v for k, v in os.environ.items() if not k.startswith("AENV_")})
    url = f"http://127.0.0.1:{port}"
    results: dict[str, Any] = {"bench": "scheduler", "at": utc_now(), "n": N, "cpus": os.cpu_count(), "runs": []}
    try:
        client = httpx.Client(base_url=url, headers={"X-API-KEY": KEY}, timeout=30)
        while True:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)
        r = redis.Redis.from_url(f"unix://{sock}", decode_responses=True)
        registered = 0
        for nodes in (3, 30, 300):
            for i in range(registered, nodes):
                assert client.put(f"/v1/nodes/node-{i}", json=status(i)).status_code == 204
            registered = nodes

            def floor() -> None:
                pipe = r.pipeline(transaction=False)
                pipe.time()
                pipe.hgetall("aenv:nodes")
                pipe.hgetall("aenv:reservations")
                pipe.execute()
                r.time()
                r.hset("aenv:bench-floor", "x", "y")

            floor_s = timed(floor, N)
            beat_s = timed(lambda: client.put("/v1/nodes/node-0", json=status(0)), N)
            cpu0 = cpu_seconds(sproc.pid)
            place_s = timed(lambda: client.post("/v1/placements", json={
                "template_id": "t3", "cpu_count": 1, "memory_mb": 1}), N)
            cpu_per = (cpu_seconds(sproc.pid) - cpu0) / N
            # placements per second with 16 clients at once
            with ThreadPoolExecutor(16) as pool:
                clients = [httpx.Client(base_url=url, headers={"X-API-KEY": KEY}, timeout=30) for _ in range(16)]
                t0 = time.perf_counter()
                list(pool.map(lambda k: [clients[k % 16].post("/v1/placements", json={
                    "template_id": "t3", "cpu_count": 1, "memory_mb": 1}) for _ in range(N // 16)], range(16)))
                per_s = (N // 16) * 16 / (time.perf_counter() - t0)
                for c in clients:
                    c.close()
            r.delete("aenv:reservations")  # the bench's reservations go: the next size starts clean
            run = {"nodes": nodes, "redis_floor": summary(floor_s), "heartbeat": summary(beat_s),
                   "placement": summary(place_s), "placement_over_floor_p50": round(pct(place_s, 50) / pct(floor_s, 50), 2),
                   "placements_per_s_16": round(per_s, 1), "scheduler_cpu_ms_per_placement": ms(cpu_per)}
            results["runs"].append(run)
            print(f"{nodes:4d} nodes: placement p50 {run['placement']['p50_ms']} ms p99 {run['placement']['p99_ms']} ms "
                  f"(redis floor p50 {run['redis_floor']['p50_ms']} ms, x{run['placement_over_floor_p50']}); "
                  f"heartbeat p50 {run['heartbeat']['p50_ms']} ms; {run['placements_per_s_16']}/s at 16; "
                  f"CPU {run['scheduler_cpu_ms_per_placement']} ms/placement")
    finally:
        sproc.terminate()
        sproc.wait(15)
        rproc.terminate()
        rproc.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    out = result_path("scheduler")
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
