"""The cluster's gateway against one node: what the gateway (and the scheduler it asks) adds to creates and to
sandbox traffic, each figure beside the same work sent to a node directly in the same run.

A real cluster on 127.0.0.1: redis-server (unix socket, nothing persisted), ``aenv-node scheduler``,
``aenv-node gateway`` and 1, then 2, then 3 real nodes (``aenv-node serve``, bench/_node.py: fresh state, own
slot pool, the cluster's key, heartbeats to the scheduler). This process is the client (httpx, keep-alive).

  creates     per cell (nodes behind the gateway N = 1, 2, 3; C = 1 and 4 concurrent clients): closed-loop
              create -> kill cycles (`POST /sandboxes {templateID: base}`, then `DELETE /sandboxes/{id}` at
              once), half of them to node n1 directly (the floor), half through the gateway, in the order
              direct, gateway, gateway, direct (a drifting load hits both alike). Creates per minute = cycles
              / wall time; create and kill latency p50/p99. The node's own duration of each create (its
              `events` row) says whether the node did the same work either way; which node each gateway
              create landed on is read from the nodes' databases.
  placement   the scheduler calls the gateway makes per create (`POST /v1/placements` with the nodes as
              registered, `PUT /v1/bindings/{id}`) and per kill (`GET` and `DELETE /v1/bindings/{id}`),
              timed directly against the scheduler, beside its `/health` (HTTP + one Redis PING: the floor).
              The gateway logs no timing of its own.
  proxy       one sandbox, bound to n1: envd `GET /health`, a 1 KiB file read and a 1 MiB file download
              (`GET /files`, identity encoding) through the `E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers, to
              the gateway (gateway -> node -> guest) and to the node (node -> guest: the floor), interleaved
              request by request; p50/p99, MiB/s, 1 KiB reads with 8 in flight (req/s), and the CPU the
              gateway and the node processes spend per request (/proc/<pid>/stat, around each request).

Sandboxes are Linux guests under QEMU TCG on this 2-core machine: a create (a snapshot restore plus envd's
/init) costs the node ~0.4 s or more of emulation, which dominates; the gateway's own cost is the difference.
Adding nodes adds no cores here (they share the same 2), so the N = 2, 3 cells show the gateway's spreading
and fan-out, not capacity. The scheduler runs with `--cpu-overcommit 64`: with the default 4.0 a 2-CPU node
takes 4 sandboxes of 2 vCPUs, and a reservation is counted until the heartbeat after its binding, so C = 4 on
one node would be refused for capacity rather than measured.

Everything listens on 127.0.0.1. Every process this bench starts is stopped by its PID (SIGTERM, wait, SIGKILL)
and every state directory removed, also on ^C or SIGTERM. Writes bench/results/cluster.json.

    flock /tmp/aenv-vm.lock .venv/bin/python bench/cluster.py [--smoke] [--creates 16] [--clients 1,4]
        [--nodes 3] [--proxy-n 200] [--download-n 30] [--placements 200]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._node import BenchNode, free_port, run_node, sigterm_as_interrupt, stop_node  # noqa: E402
from bench._node import process_cpu_s as cpu_s  # noqa: E402
from bench._stats import ms, pct, utc_now  # noqa: E402
from _results import result_path  # noqa: E402

KEY = "aenv_bench_cluster_key_0123456789abcdef"
ENVD_PORT = 49983
KiB, MiB = 1024, 1024 * 1024
SANDBOX_TIMEOUT_S = 300


# ----- processes ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def started(args: list[str], log_path: Path, ready: Callable[[], bool], what: str,
            env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own session (a terminal ^C reaches the bench only), ready when ``ready()``; stopped
    by its PID on exit."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=str(ROOT), env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not ready():
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited {proc.returncode}: {log_path.read_text(errors='replace')[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready in 30 s: {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)
        yield proc
    finally:
        stop_node(proc, timeout=15)  # any process of ours: SIGTERM by PID, wait, SIGKILL


def redis_and_scheduler(stack: contextlib.ExitStack, tmp: Path, *flags: str
                        ) -> tuple[str, subprocess.Popen[bytes]]:
    """A redis-server on a unix socket in ``tmp`` and an ``aenv-node scheduler`` on it (the key in
    ``tmp/key``), both stopped by ``stack``; the scheduler's URL and process."""
    (tmp / "key").write_text(KEY)
    sock = tmp / "redis.sock"
    stack.enter_context(started(
        [shutil.which("redis-server") or "redis-server", "--port", "0", "--unixsocket", str(sock),
         "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", str(tmp)],
        tmp / "redis.log", sock.exists, "redis-server"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = stack.enter_context(started(
        [sys.executable, "-m", "aenv_node.cli.node", "scheduler", "--listen", f"127.0.0.1:{port}", "--redis",
         f"unix://{sock}", "--api-key-file", str(tmp / "key"), "--cpu-overcommit", "64", *flags],
        tmp / "scheduler.log", answers(url), "scheduler", plain_env()))
    return url, proc


def answers(url: str) -> Callable[[], bool]:
    def ready() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    return ready


def plain_env() -> dict[str, str]:
    """The scheduler and the gateway get no AENV_* of this shell (their flags say it all)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AENV_")}


def wait_registered(sched: httpx.Client, node_ids: list[str], timeout: float = 60) -> None:
    """Until the scheduler has every node alive, not draining, with ``base`` ready."""
    deadline = time.monotonic() + timeout
    while True:
        views = {v["status"]["node_id"]: v for v in sched.get("/v1/nodes").json()}
        if all(n in views and views[n]["alive"] and not views[n]["status"]["draining"]
               and "base" in views[n]["status"]["templates"] for n in node_ids):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"nodes {node_ids} not registered: {views}")
        time.sleep(0.2)


# ----- statistics -------------------------------------------------------------------------------------------


def dist(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {}
    return {"p50_ms": ms(pct(values_s, 50)), "p99_ms": ms(pct(values_s, 99)), "min_ms": ms(min(values_s)),
            "max_ms": ms(max(values_s)), "mean_ms": ms(statistics.fmean(values_s)), "n": len(values_s)}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


# ----- creates ------------------------------------------------------------------------------------------------


def create_cycle(client: httpx.Client) -> dict[str, Any]:
    """One create, then its kill at once."""
    t0 = time.perf_counter()
    r = client.post("/sandboxes", json={"templateID": "base", "timeout": SANDBOX_TIMEOUT_S})
    t1 = time.perf_counter()
    if r.status_code != 201:
        raise RuntimeError(f"create: {r.status_code} {r.text[:300]}")
    sid = r.json()["sandboxID"]
    k = client.delete(f"/sandboxes/{sid}")
    t2 = time.perf_counter()
    if k.status_code != 204:
        raise RuntimeError(f"kill {sid}: {k.status_code} {k.text[:300]}")
    return {"sandbox_id": sid, "create_s": t1 - t0, "kill_s": t2 - t1}


def closed_loop(url: str, clients: int, total: int, stop: threading.Event) -> dict[str, Any]:
    """``clients`` threads loop create -> kill until ``total`` cycles started; wall time until the last ends."""
    lock = threading.Lock()
    started_n = 0
    done: list[dict[str, Any]] = []
    errors: list[str] = []

    def worker() -> None:
        nonlocal started_n
        with httpx.Client(base_url=url, headers={"X-API-KEY": KEY}, timeout=300) as c:
            while not stop.is_set():
                with lock:
                    if started_n >= total:
                        return
                    started_n += 1
                try:
                    cyc = create_cycle(c)
                    with lock:
                        done.append(cyc)
                except Exception as e:  # counted and reported, not fatal
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}"[:400])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.5)
    except BaseException:
        stop.set()  # ^C: no new cycle; those in flight end with the nodes
        raise
    return {"cycles": done, "errors": errors, "wall_s": time.perf_counter() - t0}


def node_creates(nodes: dict[str, BenchNode]) -> dict[str, tuple[str, float]]:
    """sandbox id -> (node id, the node's own create duration in seconds), from every node's events."""
    out: dict[str, tuple[str, float]] = {}
    for node_id, node in nodes.items():
        for sid, duration in node.sql("SELECT sandbox_id, duration_ms FROM events "
                                      "WHERE operation = 'create' AND to_state = 'running'"):
            if duration is not None:
                out[sid] = (node_id, duration / 1000)
    return out


def create_cell(targets: dict[str, str], n_nodes: int, clients: int, per_target: int,
                nodes: dict[str, BenchNode], pids: dict[str, int], stop: threading.Event) -> dict[str, Any]:
    half = per_target // 2
    order = [("direct", half), ("gateway", half), ("gateway", per_target - half), ("direct", per_target - half)]
    runs: dict[str, list[dict[str, Any]]] = {"direct": [], "gateway": []}
    cpu: dict[str, dict[str, float]] = {t: dict.fromkeys(pids, 0.0) for t in runs}
    for name, count in order:
        if count:
            before = {k: cpu_s(pid) for k, pid in pids.items()}
            runs[name].append(closed_loop(targets[name], clients, count, stop))
            for k, pid in pids.items():
                cpu[name][k] += cpu_s(pid) - before[k]
    events = node_creates(nodes)
    cell: dict[str, Any] = {"nodes": n_nodes, "clients": clients}
    for name, parts in runs.items():
        cycles = [c for p in parts for c in p["cycles"]]
        wall = sum(p["wall_s"] for p in parts)
        node_side = [events[c["sandbox_id"]][1] for c in cycles if c["sandbox_id"] in events]
        # what the client waited beyond the node's own create (its event's duration): HTTP, the node's API
        # around the create, and for the gateway its listing, placement, binding and hop
        outside = [c["create_s"] - events[c["sandbox_id"]][1] for c in cycles if c["sandbox_id"] in events]
        placed: dict[str, int] = {}
        for c in cycles:
            where = events.get(c["sandbox_id"], ("?", 0.0))[0]
            placed[where] = placed.get(where, 0) + 1
        cell[name] = {
            "completed": len(cycles), "errors": [e for p in parts for e in p["errors"]][:10],
            "wall_s": round(wall, 2), "creates_per_min": round(len(cycles) / wall * 60, 2) if cycles else 0.0,
            "create": dist([c["create_s"] for c in cycles]), "kill": dist([c["kill_s"] for c in cycles]),
            "node_create": dist(node_side), "outside_node_create": dist(outside),
            "placed_on": dict(sorted(placed.items())),
            "cpu_ms_per_cycle": {k: round(v / len(cycles) * 1e3, 2) for k, v in cpu[name].items()} if cycles else {},
            "samples": [{"create_ms": ms(c["create_s"]), "kill_ms": ms(c["kill_s"]),
                         "node_create_ms": ms(events[c["sandbox_id"]][1]) if c["sandbox_id"] in events else None,
                         "node": events.get(c["sandbox_id"], ("?", 0.0))[0]} for c in cycles],
        }
    d, g = cell["direct"], cell["gateway"]
    cell["ratios"] = {
        "creates_per_min_gateway_over_direct": ratio(g["creates_per_min"], d["creates_per_min"]),
        "create_p50_gateway_over_direct": ratio(g["create"].get("p50_ms"), d["create"].get("p50_ms")),
        "create_p99_gateway_over_direct": ratio(g["create"].get("p99_ms"), d["create"].get("p99_ms")),
        "kill_p50_gateway_over_direct": ratio(g["kill"].get("p50_ms"), d["kill"].get("p50_ms")),
    }
    cell["gateway_added_ms"] = {
        "create_p50": round(g["create"].get("p50_ms", 0) - d["create"].get("p50_ms", 0), 1),
        "kill_p50": round(g["kill"].get("p50_ms", 0) - d["kill"].get("p50_ms", 0), 1),
        "node_create_p50": round(g["node_create"].get("p50_ms", 0) - d["node_create"].get("p50_ms", 0), 1),
        "outside_node_create_p50": round(g["outside_node_create"].get("p50_ms", 0)
                                         - d["outside_node_create"].get("p50_ms", 0), 1),
    }
    return cell


def print_cell(c: dict[str, Any]) -> None:
    d, g, r = c["direct"], c["gateway"], c["ratios"]
    print(f"  N={c['nodes']} C={c['clients']}: creates/min direct {d['creates_per_min']:6.1f} gateway "
          f"{g['creates_per_min']:6.1f} (x{r['creates_per_min_gateway_over_direct']}); create p50/p99 direct "
          f"{d['create'].get('p50_ms')}/{d['create'].get('p99_ms')} ms gateway {g['create'].get('p50_ms')}/"
          f"{g['create'].get('p99_ms')} ms (p50 x{r['create_p50_gateway_over_direct']}, "
          f"+{c['gateway_added_ms']['create_p50']} ms); kill p50 {d['kill'].get('p50_ms')} / "
          f"{g['kill'].get('p50_ms')} ms; node-side create p50 {d['node_create'].get('p50_ms')} / "
          f"{g['node_create'].get('p50_ms')} ms; beyond the node's create p50 {d['outside_node_create'].get('p50_ms')}"
          f" / {g['outside_node_create'].get('p50_ms')} ms; gateway CPU/cycle "
          f"{g['cpu_ms_per_cycle'].get('gateway')} ms, scheduler {g['cpu_ms_per_cycle'].get('scheduler')} ms; "
          f"placed {g['placed_on']}; errors "
          f"{len(d['errors'])}/{len(g['errors'])}", flush=True)


# ----- placement ----------------------------------------------------------------------------------------------


def placement_calls(sched: httpx.Client, n_nodes: int, n: int) -> dict[str, Any]:
    """The scheduler calls of a gateway's create (place, bind) and kill (lookup, unbind), and a release,
    interleaved round by round with the /health floor."""
    samples: dict[str, list[float]] = {k: [] for k in ("health", "place", "release", "bind", "lookup", "unbind")}
    chosen: dict[str, int] = {}
    req = {"template_id": "base", "cpu_count": 2, "memory_mb": 512}

    def timed(name: str, method: str, path: str, expect: int, body: Any = None) -> httpx.Response:
        t0 = time.perf_counter()
        r = sched.request(method, path, json=body)
        samples[name].append(time.perf_counter() - t0)
        if r.status_code != expect:
            raise RuntimeError(f"{method} {path}: {r.status_code} {r.text[:300]}")
        return r

    for _ in range(10):  # warm-up
        sched.get("/health")
    for i in range(n):
        timed("health", "GET", "/health", 200)
        p = timed("place", "POST", "/v1/placements", 201, req).json()
        chosen[p["node_id"]] = chosen.get(p["node_id"], 0) + 1
        sid = f"benchplace{i:06d}"
        timed("bind", "PUT", f"/v1/bindings/{sid}", 204, {"node_id": p["node_id"], "placement_id": p["placement_id"]})
        timed("lookup", "GET", f"/v1/bindings/{sid}", 200)
        timed("unbind", "DELETE", f"/v1/bindings/{sid}", 204)
        # a bound placement waits for a heartbeat to go; an explicit release keeps n placements from filling
        # the nodes
        timed("release", "DELETE", f"/v1/placements/{p['node_id']}/{p['placement_id']}", 204)
    out: dict[str, Any] = {"nodes": n_nodes, "n": n, "chosen": dict(sorted(chosen.items()))}
    out.update({k: dist(v) for k, v in samples.items()})
    per_create = [a + b for a, b in zip(samples["place"], samples["bind"])]
    per_kill = [a + b for a, b in zip(samples["lookup"], samples["unbind"])]
    out["gateway_create_calls"] = dist(per_create)  # place + bind
    out["gateway_kill_calls"] = dist(per_kill)  # lookup + unbind
    out["place_p50_over_health_p50"] = ratio(out["place"]["p50_ms"], out["health"]["p50_ms"])
    return out


def template_listing(gw_url: str, node_url: str, n: int) -> dict[str, Any]:
    """``GET /templates`` through the gateway (it asks every live node and merges; a create reuses that
    listing for 10 s to read its template's vCPUs and memory) against one node's own, interleaved."""
    out: dict[str, list[float]] = {"direct": [], "gateway": []}
    with httpx.Client(headers={"X-API-KEY": KEY}, timeout=60) as c:
        for _ in range(3):
            c.get(gw_url + "/templates")
            c.get(node_url + "/templates")
        for _ in range(n):
            for t, url in (("direct", node_url), ("gateway", gw_url)):
                t0 = time.perf_counter()
                r = c.get(url + "/templates")
                out[t].append(time.perf_counter() - t0)
                r.raise_for_status()
    res: dict[str, Any] = {t: dist(v) for t, v in out.items()}
    res["p50_gateway_over_direct"] = ratio(res["gateway"]["p50_ms"], res["direct"]["p50_ms"])
    return res


# ----- proxy ----------------------------------------------------------------------------------------------------


def proxy_phase(gw_url: str, node: BenchNode, gw_pid: int, n: int, downloads: int) -> dict[str, Any]:
    api = httpx.Client(base_url=gw_url, headers={"X-API-KEY": KEY}, timeout=300)
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": SANDBOX_TIMEOUT_S})
    if r.status_code != 201:
        raise RuntimeError(f"create: {r.status_code} {r.text[:300]}")
    sid, token = r.json()["sandboxID"], r.json().get("envdAccessToken")
    try:
        headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD_PORT), "Accept-Encoding": "identity"}
        if token:
            headers["X-Access-Token"] = token
        targets = {"direct": node.url, "gateway": gw_url}
        pids = {"gateway": gw_pid, "node": node.proc.pid}
        clients = {k: httpx.Client(base_url=u, headers=headers, timeout=120) for k, u in targets.items()}
        small, big = os.urandom(KiB), os.urandom(MiB)
        for path, data in (("/tmp/bench-1k", small), ("/tmp/bench-1m", big)):
            w = clients["direct"].post("/files", params={"path": path, "username": "root"}, content=data,
                                       headers={"Content-Type": "application/octet-stream"})
            if w.status_code != 200:
                raise RuntimeError(f"write {path}: {w.status_code} {w.text[:300]}")
        kinds = {
            "health": ("/health", None, 204),
            "read_1k": ("/files", {"path": "/tmp/bench-1k", "username": "root"}, 200),
            "download_1m": ("/files", {"path": "/tmp/bench-1m", "username": "root"}, 200),
        }
        lat: dict[str, dict[str, list[float]]] = {t: {k: [] for k in kinds} for t in targets}
        cpu: dict[str, dict[str, dict[str, float]]] = {t: {k: dict.fromkeys(pids, 0.0) for k in kinds}
                                                       for t in targets}

        def one(target: str, kind: str) -> None:
            path, params, expect = kinds[kind]
            before = {p: cpu_s(pid) for p, pid in pids.items()}
            t0 = time.perf_counter()
            resp = clients[target].get(path, params=params)
            lat[target][kind].append(time.perf_counter() - t0)
            for p, pid in pids.items():
                cpu[target][kind][p] += cpu_s(pid) - before[p]
            if resp.status_code != expect:
                raise RuntimeError(f"{target} {kind}: {resp.status_code} {resp.text[:300]}")
            if kind == "read_1k" and resp.content != small or kind == "download_1m" and resp.content != big:
                raise RuntimeError(f"{target} {kind}: wrong content ({len(resp.content)} bytes)")

        for _ in range(10):  # warm-up, not counted
            for t in targets:
                clients[t].get("/health")
                clients[t].get("/files", params=kinds["read_1k"][1])
        for k in lat.values():
            for v in k.values():
                v.clear()
        for t in cpu.values():
            for v in t.values():
                v.update(dict.fromkeys(v, 0.0))
        for _ in range(n):
            for t in targets:
                one(t, "health")
                one(t, "read_1k")
        for _ in range(downloads):
            for t in targets:
                one(t, "download_1m")

        # 1 KiB reads with 8 in flight (8 threads, each its own keep-alive connection), bursts alternating
        burst, flight = max(32, n // 4), 8
        par: dict[str, list[float]] = {t: [] for t in targets}
        par_cpu: dict[str, dict[str, float]] = {t: dict.fromkeys(pids, 0.0) for t in targets}
        per_thread = {t: [httpx.Client(base_url=u, headers=headers, timeout=120) for _ in range(flight)]
                      for t, u in targets.items()}
        with ThreadPoolExecutor(flight) as pool:
            for _ in range(3):
                for t in targets:
                    before = {p: cpu_s(pid) for p, pid in pids.items()}
                    t0 = time.perf_counter()
                    list(pool.map(lambda i, t=t: [per_thread[t][i].get("/files", params=kinds["read_1k"][1])
                                                  .raise_for_status() for _ in range(burst // flight)],
                                  range(flight)))
                    par[t].append(time.perf_counter() - t0)
                    for p, pid in pids.items():
                        par_cpu[t][p] += cpu_s(pid) - before[p]
        for cs in (*clients.values(), *(c for cl in per_thread.values() for c in cl)):
            cs.close()
    finally:
        api.delete(f"/sandboxes/{sid}")
        api.close()

    out: dict[str, Any] = {"sandbox_id": sid, "n": n, "downloads": downloads}
    for t in targets:
        v: dict[str, Any] = {}
        for kind in kinds:
            count = len(lat[t][kind])
            v[kind] = dist(lat[t][kind])
            v[kind]["cpu_ms_per_request"] = {p: round(c / count * 1e3, 3) for p, c in cpu[t][kind].items()}
        v["download_1m"]["mib_per_s"] = round(len(lat[t]["download_1m"]) / sum(lat[t]["download_1m"]), 1)
        total = 3 * (burst // flight) * flight
        v["read_1k_8_in_flight"] = {
            "req_per_s": round(total / sum(par[t]), 1),
            "cpu_ms_per_request": {p: round(c / total * 1e3, 3) for p, c in par_cpu[t].items()},
        }
        out[t] = v
    d, g = out["direct"], out["gateway"]
    out["ratios"] = {
        "health_p50_gateway_over_direct": ratio(g["health"]["p50_ms"], d["health"]["p50_ms"]),
        "read_1k_p50_gateway_over_direct": ratio(g["read_1k"]["p50_ms"], d["read_1k"]["p50_ms"]),
        "read_1k_p99_gateway_over_direct": ratio(g["read_1k"]["p99_ms"], d["read_1k"]["p99_ms"]),
        "download_1m_mib_per_s_gateway_over_direct": ratio(g["download_1m"]["mib_per_s"],
                                                           d["download_1m"]["mib_per_s"]),
        "read_1k_8_in_flight_req_per_s_gateway_over_direct": ratio(g["read_1k_8_in_flight"]["req_per_s"],
                                                                    d["read_1k_8_in_flight"]["req_per_s"]),
        # the gateway's CPU per 1 KiB read over the node's own (proxy + API process) per direct read
        "read_1k_gateway_cpu_over_node_cpu_direct": ratio(g["read_1k"]["cpu_ms_per_request"]["gateway"],
                                                          d["read_1k"]["cpu_ms_per_request"]["node"]),
    }
    return out


def print_proxy(p: dict[str, Any]) -> None:
    for t in ("direct", "gateway"):
        v = p[t]
        print(f"  {t:8s} health p50 {v['health']['p50_ms']} p99 {v['health']['p99_ms']} ms | 1 KiB read p50 "
              f"{v['read_1k']['p50_ms']} p99 {v['read_1k']['p99_ms']} ms, CPU ms/req {v['read_1k']['cpu_ms_per_request']}"
              f" | 1 MiB p50 {v['download_1m']['p50_ms']} ms {v['download_1m']['mib_per_s']} MiB/s, CPU ms/MiB "
              f"{v['download_1m']['cpu_ms_per_request']} | 8 in flight {v['read_1k_8_in_flight']['req_per_s']} req/s",
              flush=True)


# ----- main -------------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny: 2 nodes, 2 creates per target, few requests")
    ap.add_argument("--creates", type=int, default=16, help="create cycles per target per cell (half each way)")
    ap.add_argument("--clients", default="1,4", help="concurrent clients per cell")
    ap.add_argument("--nodes", type=int, default=3, help="up to this many nodes behind the gateway")
    ap.add_argument("--proxy-n", type=int, default=200, help="health and 1 KiB reads per target")
    ap.add_argument("--download-n", type=int, default=30, help="1 MiB downloads per target")
    ap.add_argument("--placements", type=int, default=200, help="scheduler call rounds per node count")
    ap.add_argument("--out", type=Path, default=result_path("cluster"))
    args = ap.parse_args()
    if args.smoke:
        args.creates, args.nodes, args.proxy_n, args.download_n, args.placements = 2, 2, 10, 3, 10
        if args.out == result_path("cluster"):
            args.out = result_path("cluster", smoke=True)
    levels = [int(x) for x in args.clients.split(",") if x.strip()]
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started as a background job of a non-interactive shell, which ignores SIGINT for it: without this,
        # sigterm_as_interrupt's re-raised SIGINT would be ignored too, and a SIGTERM would clean up nothing
        signal.signal(signal.SIGINT, signal.default_int_handler)

    results: dict[str, Any] = {
        "bench": "cluster", "started_at": utc_now(),
        "host": {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]},
        "config": {"creates_per_target": args.creates, "clients": levels, "max_nodes": args.nodes,
                   "proxy_n": args.proxy_n, "download_n": args.download_n, "placements": args.placements,
                   "scheduler_flags": ["--cpu-overcommit", "64"], "template": "base", "smoke": args.smoke},
        "nodes": [], "creates": [], "placement": [],
    }
    print(f"loadavg at start {results['host']['loadavg_at_start']}", flush=True)
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="aenv-bench-cluster-", dir="/var/tmp"))
    stop = threading.Event()
    try:
        with sigterm_as_interrupt(), contextlib.ExitStack() as stack:
            sched_url, sched_proc = redis_and_scheduler(stack, tmp, "--log-level", "warning")
            gw_port = free_port()
            gw_url = f"http://127.0.0.1:{gw_port}"
            cli = [sys.executable, "-m", "aenv_node.cli.node"]
            gw = stack.enter_context(started(
                [*cli, "gateway", "--listen", f"127.0.0.1:{gw_port}", "--scheduler", sched_url,
                 "--api-key-file", str(tmp / "key")],
                tmp / "gateway.log", answers(gw_url), "gateway", plain_env()))
            sched = stack.enter_context(httpx.Client(base_url=sched_url, headers={"X-API-KEY": KEY}, timeout=30))
            nodes: dict[str, BenchNode] = {}
            for n in range(1, args.nodes + 1):
                node_id, port = f"n{n}", free_port()
                t0 = time.monotonic()
                node = stack.enter_context(run_node(port=port, api_key=KEY, extra_env={
                    "AENV_NODE_NODE_ID": node_id, "AENV_CLUSTER_SCHEDULER_URL": sched_url,
                    "AENV_CLUSTER_ADVERTISE_URL": f"http://127.0.0.1:{port}"}))
                nodes[node_id] = node
                wait_registered(sched, list(nodes))
                info = {"node_id": node_id, "health_s": round(node.health_s, 2),
                        "template_ready_s": round(node.template_ready_s, 2),
                        "registered_s": round(time.monotonic() - t0, 2)}
                results["nodes"].append(info)
                print(f"node {node_id} up: /health {info['health_s']} s, base ready {info['template_ready_s']} s, "
                      f"registered {info['registered_s']} s", flush=True)
                targets = {"direct": nodes["n1"].url, "gateway": gw_url}
                # warm-up cycles, not counted: the first create on a fresh node is slower (~+200 ms), and the
                # gateway's first one lists the templates
                for url in (node.url, *([gw_url] if n == 1 else [])):
                    with httpx.Client(base_url=url, headers={"X-API-KEY": KEY}, timeout=300) as c:
                        create_cycle(c)
                if n == 1:
                    print("proxy (1 node):", flush=True)
                    results["proxy"] = proxy_phase(gw_url, nodes["n1"], gw.pid, args.proxy_n, args.download_n)
                    print_proxy(results["proxy"])
                pl = placement_calls(sched, n, args.placements)
                results["placement"].append(pl)
                print(f"  N={n} scheduler: place p50 {pl['place']['p50_ms']} p99 {pl['place']['p99_ms']} ms, bind p50 "
                      f"{pl['bind']['p50_ms']}, lookup p50 {pl['lookup']['p50_ms']}, unbind p50 {pl['unbind']['p50_ms']}"
                      f" ms; /health floor p50 {pl['health']['p50_ms']} ms (place x{pl['place_p50_over_health_p50']});"
                      f" chosen {pl['chosen']}", flush=True)
                tl = template_listing(gw_url, nodes["n1"].url, max(10, args.placements // 10))
                pl["template_listing"] = tl
                print(f"  N={n} GET /templates p50 gateway {tl['gateway']['p50_ms']} ms vs node "
                      f"{tl['direct']['p50_ms']} ms (x{tl['p50_gateway_over_direct']})", flush=True)
                for c in levels:
                    cell = create_cell(targets, n, c, args.creates, nodes,
                                       {"gateway": gw.pid, "scheduler": sched_proc.pid}, stop)
                    results["creates"].append(cell)
                    print_cell(cell)
            gw_log = (tmp / "gateway.log").read_text(errors="replace").splitlines()
            results["gateway_log_warnings"] = [ln[:300] for ln in gw_log if "WARNING" in ln or "ERROR" in ln][:20]
            results["node_log_warnings"] = {
                nid: [ln[:300] for ln in nd.log_path.read_text(errors="replace").splitlines()
                      if " WARNING " in ln or " ERROR " in ln][:10] for nid, nd in nodes.items()}
            results["gateway_cpu_s_total"] = round(cpu_s(gw.pid), 2)
    finally:
        stop.set()
        shutil.rmtree(tmp, ignore_errors=True)

    results["host"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["finished_at"] = utc_now()
    results["elapsed_s"] = round(time.monotonic() - t_start, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")

    print("\n nodes  C | creates/min direct gateway  ratio | create p50 direct gateway (+ms) | p99 direct gateway "
          "| beyond node p50 direct gateway | kill p50 direct gateway | placed")
    for c in results["creates"]:
        d, g, r = c["direct"], c["gateway"], c["ratios"]
        print(f" {c['nodes']:5d} {c['clients']:2d} | {d['creates_per_min']:18.1f} {g['creates_per_min']:7.1f} "
              f"{r['creates_per_min_gateway_over_direct'] or 0:6.2f} | {d['create'].get('p50_ms', 0):17.0f} "
              f"{g['create'].get('p50_ms', 0):7.0f} ({c['gateway_added_ms']['create_p50']:+.0f}) | "
              f"{d['create'].get('p99_ms', 0):10.0f} {g['create'].get('p99_ms', 0):7.0f} | "
              f"{d['outside_node_create'].get('p50_ms', 0):22.1f} {g['outside_node_create'].get('p50_ms', 0):7.1f} | "
              f"{d['kill'].get('p50_ms', 0):15.0f} {g['kill'].get('p50_ms', 0):7.0f} | {g['placed_on']}")
    p = results["proxy"]
    pr = p["ratios"]
    c1 = [c for c in results["creates"] if c["clients"] == 1]
    pl = results["placement"][-1]
    print(f"wrote {args.out}")
    print(
        f"cluster: create through the gateway C=1 p50 "
        f"{'/'.join(str(c['gateway']['create'].get('p50_ms')) for c in c1)} ms vs "
        f"{'/'.join(str(c['direct']['create'].get('p50_ms')) for c in c1)} ms direct at N="
        f"{'/'.join(str(c['nodes']) for c in c1)} (x"
        f"{'/'.join(str(c['ratios']['create_p50_gateway_over_direct']) for c in c1)}), time beyond the node's own "
        f"create +{'/+'.join(str(c['gateway_added_ms']['outside_node_create_p50']) for c in c1)} ms; "
        f"creates/min gateway/direct "
        + ", ".join(f"N={c['nodes']} C={c['clients']} x{c['ratios']['creates_per_min_gateway_over_direct']}"
                    for c in results["creates"])
        + f"; placement p50 {pl['place']['p50_ms']} ms (x{pl['place_p50_over_health_p50']} the scheduler's /health); "
        f"1 KiB envd read {p['gateway']['read_1k']['p50_ms']} vs {p['direct']['read_1k']['p50_ms']} ms "
        f"(x{pr['read_1k_p50_gateway_over_direct']}), 1 MiB {p['gateway']['download_1m']['mib_per_s']} vs "
        f"{p['direct']['download_1m']['mib_per_s']} MiB/s (x{pr['download_1m_mib_per_s_gateway_over_direct']}), "
        f"8 in flight x{pr['read_1k_8_in_flight_req_per_s_gateway_over_direct']}; gateway CPU "
        f"{p['gateway']['read_1k']['cpu_ms_per_request']['gateway']} ms per 1 KiB read (node's own "
        f"{p['direct']['read_1k']['cpu_ms_per_request']['node']} ms); load avg "
        f"{results['host']['loadavg_at_start'][0]:.1f} at start; {results['elapsed_s']:.0f} s"
    )


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted: every process stopped, state directories removed", file=sys.stderr)
        sys.exit(130)
