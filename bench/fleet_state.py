"""Ten thousand paused sandboxes on one node: listing, get_info, restart, idle CPU, garbage collection.

The issue's goals ("Performance at fleet scale", item 5): with 10,000 paused sandboxes in the state, a page of
``GET /v2/sandboxes`` under 50 ms, a node restart under 10 s, idle CPU under 2%.

A state directory is made first (bench/_fleet.py: every row through the node's own models and repository
functions, each sandbox created, paused, resumed and paused again ``--pauses`` times, then the node's garbage
collector run once as the node would: the superseded pause snapshots collected). No VM is booted, now or later:
the node runs with ``templates.build_default = false``, and every sandbox is paused. Then the real node
(``aenv-node serve``, bench/_node.py) is started on it ``--restarts`` times, each timed from the process start
to ``/health`` answering (migrations, reconcile and every service's start, the local GC's start-up pass among
them; the node logs each phase, read back from its log). During the first run:

* every page of ``GET /v2/sandboxes`` (default page size, following ``x-next-token``), over plain HTTP and
  through the unmodified E2B SDK's paginator (``Sandbox.list()``), p50/p99 per page;
* ``GET /sandboxes/{id}`` for random ids (HTTP, and ``Sandbox.get_info``), p50/p99;
* the node's CPU while idle (utime+stime from /proc over ``--idle-s`` seconds; also with its data plane's) with no sandbox running, so no TTL timer is due.

After the node stops, the node's collector in process on the state: a collection with nothing to collect, the
start-up sweep, and the collection after one more pause of a sandbox (its previous pause snapshot superseded:
what every pause of a resumed sandbox asks for).

Floors, measured in the same run: the same pages and rows read straight from the database with ``sqlite3``
(the best keyset query a page can be: NOT IN for the hidden states, a row-value seek, LIMIT), ``GET /health``
(an HTTP request to the same server that reads nothing), and everything above on a node whose state holds
nothing (its restart, idle CPU, GC pass).

Writes bench/results/fleet_state.json (``--smoke``: 50 sandboxes, short, still writes it); the last line
printed is a one-line summary.

Run: .venv/bin/python bench/fleet_state.py [--sandboxes 10000] [--smoke] [--keep] [--state DIR/fleet]
(making 10,000 sandboxes' rows takes minutes: ``--keep`` keeps the state, ``--state`` runs on a kept one)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._fleet import collect_once, count_rows, make_fleet_state, pause_again, sweep_once  # noqa: E402
from bench._node import BenchNode, run_node, sigterm_as_interrupt  # noqa: E402
from bench._results import result_path  # noqa: E402
from bench._stats import ms, pct, utc_now  # noqa: E402

from aenv_node.state import Database  # noqa: E402

NODE_ENV = {"AENV_TEMPLATES_BUILD_DEFAULT": "false", "AENV_TEMPLATES_CODE_INTERPRETER": "false"}
STARTED = re.compile(r"node started in ([\d.]+) s: migrations ([\d.]+) s, reconcile ([\d.]+) s, services ([\d.]+) s "
                     r"\(slowest: ([^)]*)\)")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def summary(values: list[float]) -> dict[str, float]:
    """p50/p99/max in milliseconds of durations in seconds."""
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50_ms": ms(pct(values, 50)), "p99_ms": ms(pct(values, 99)), "max_ms": ms(max(values))}


def phases(node: BenchNode) -> dict[str, Any]:
    """The node's own account of its start (runtime/supervisor.py logs it once every service runs)."""
    m = STARTED.search(node.log_tail(10**7))
    if m is None:
        return {}
    return {"started_s": float(m[1]), "migrations_s": float(m[2]), "reconcile_s": float(m[3]),
            "services_s": float(m[4]), "slowest_services": m[5]}


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total


def state_pids(state: Path) -> list[int]:
    """Every process started for the node on ``state``: the node and its data plane (which runs in a session of
    its own, to outlive the node), found by the ``AENV_STATE_DIR`` they were started with."""
    needles = [f"\0{k}={state}\0".encode() for k in ("AENV_STATE_DIR", "AENV_NODE_STATE_DIR")]
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                env = b"\0" + (p / "environ").read_bytes() + b"\0"
                if any(n in env for n in needles):
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def idle_cpu(node: BenchNode, seconds: float) -> dict[str, float]:
    """CPU use of the idle node (percent of one core) over ``seconds``, after a short settle."""
    time.sleep(min(5.0, seconds))
    pid = node.proc.pid
    pids = state_pids(node.state_dir)
    n0, s0, t0 = cpu_ticks([pid]), cpu_ticks(pids), time.monotonic()
    time.sleep(seconds)
    n1, s1, elapsed = cpu_ticks([pid]), cpu_ticks(pids), time.monotonic() - t0
    return {"seconds": round(elapsed, 1), "node_pct": round((n1 - n0) / CLK_TCK / elapsed * 100, 2),
            "with_data_plane_pct": round((s1 - s0) / CLK_TCK / elapsed * 100, 2), "processes": len(pids)}


def walk_http(node: BenchNode, params: dict[str, Any]) -> tuple[list[float], int]:
    """Every page of ``GET /v2/sandboxes`` (following ``x-next-token``): per-page seconds, items listed."""
    times: list[float] = []
    items = 0
    with node.api() as c:
        q = dict(params)
        while True:
            t = time.perf_counter()
            r = c.get("/v2/sandboxes", params=q)
            times.append(time.perf_counter() - t)
            r.raise_for_status()
            items += len(r.json())
            token = r.headers.get("x-next-token")
            if not token:
                return times, items
            q = {**params, "nextToken": token}


def walk_sdk() -> tuple[list[float], int]:
    """Every page through the E2B SDK's paginator (its default page size)."""
    from e2b import Sandbox

    paginator = Sandbox.list()
    times: list[float] = []
    items = 0
    while paginator.has_next:
        t = time.perf_counter()
        items += len(paginator.next_items())
        times.append(time.perf_counter() - t)
    return times, items


def api_figures(node: BenchNode, ids: list[str], *, walks: int, samples: int) -> dict[str, Any]:
    for k, v in node.sdk_env().items():
        os.environ[k] = v
    from e2b import Sandbox

    out: dict[str, Any] = {}
    with node.api() as c:
        c.get("/health")
        health = []
        for _ in range(200):
            t = time.perf_counter()
            c.get("/health").raise_for_status()
            health.append(time.perf_counter() - t)
        out["health"] = summary(health)
        pages: list[float] = []
        for _ in range(walks):
            times, items = walk_http(node, {})
            pages += times
        out["list_default_pages"] = {**summary(pages), "pages_per_walk": len(pages) // walks, "items": items,
                                     "first_page_ms": ms(pages[0]), "last_page_ms": ms(pages[-1])}
        times, items = walk_http(node, {"limit": 1000})
        out["list_limit_1000_pages"] = {**summary(times), "items": items}
        sdk: list[float] = []
        for _ in range(walks):
            times, items = walk_sdk()
            sdk += times
        out["list_sdk_pages"] = {**summary(sdk), "items": items}
        rnd = random.Random(2)
        gets = []
        for sid in rnd.choices(ids, k=samples):
            t = time.perf_counter()
            c.get(f"/sandboxes/{sid}").raise_for_status()
            gets.append(time.perf_counter() - t)
        out["get_info"] = summary(gets)
        sdk_gets = []
        for sid in rnd.choices(ids, k=max(10, samples // 5)):
            t = time.perf_counter()
            Sandbox.get_info(sid)
            sdk_gets.append(time.perf_counter() - t)
        out["get_info_sdk"] = summary(sdk_gets)
    return out


def db_floors(db_path: Path, ids: list[str], *, walks: int, page: int, samples: int) -> dict[str, Any]:
    """The same pages and rows read straight from SQLite: the keyset query a page needs, ``SELECT *``."""
    con = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    # the best plan there is for a page: the states not listed excluded with NOT IN (no index use), the token a
    # row value (an index seek), LIMIT; on a database without ix_sandboxes_started_at_id SQLite sorts instead
    hidden = "state NOT IN ('killing', 'killed', 'error')"
    first = f"SELECT * FROM sandboxes WHERE {hidden} ORDER BY started_at, id LIMIT ?"
    after = f"SELECT * FROM sandboxes WHERE {hidden} AND (started_at, id) > (?, ?) ORDER BY started_at, id LIMIT ?"
    plan = " | ".join(r[3] for r in con.execute("EXPLAIN QUERY PLAN " + after, ("", "", 1)))
    times: list[float] = []
    for _ in range(walks):
        last = None
        while True:
            t = time.perf_counter()
            if last is None:
                rows = con.execute(first, (page + 1,)).fetchall()
            else:
                rows = con.execute(after, (last[0], last[1], page + 1)).fetchall()
            times.append(time.perf_counter() - t)
            if len(rows) <= page:
                break
            cols = [d[0] for d in con.execute(first, (1,)).description]
            r = rows[page - 1]
            last = (r[cols.index("started_at")], r[cols.index("id")])
    rnd = random.Random(2)
    gets = []
    for sid in rnd.choices(ids, k=samples):
        t = time.perf_counter()
        con.execute("SELECT * FROM sandboxes WHERE id = ?", (sid,)).fetchone()
        gets.append(time.perf_counter() - t)
    con.close()
    return {"list_page": summary(times), "list_page_plan": plan, "get_row": summary(gets)}


def gc_figures(state: Path, runs: int, sandboxes: tuple[str, ...] = ()) -> dict[str, Any]:
    """The node's collector on ``state``, in process: a collection with nothing to collect, the start-up
    sweep, and (given paused sandboxes) the collection after one more pause of one of them, which finds that
    sandbox's previous pause snapshot superseded: what every pause of a resumed sandbox asks for."""
    db = Database(state / "aenv.db")
    try:
        collections = [collect_once(db, state, reason="bench")[1] for _ in range(runs)]
        sweeps = [sweep_once(db, state)[1] for _ in range(runs)]
        after_pause = []
        for sid in random.Random(3).sample(sandboxes, min(runs, len(sandboxes))):
            pause_again(db, state, sid)
            out, seconds = collect_once(db, state, reason="pause")
            assert len(out.snapshots) == 1, out
            after_pause.append(seconds)
    finally:
        db.close()
    return {"collection": summary(collections), "startup_sweep": summary(sweeps),
            "collection_after_a_pause": summary(after_pause)}


def restarts(state: Path, n: int, *, measure: Any = None) -> dict[str, Any]:
    """``n`` starts of the node on ``state``: Popen -> /health seconds, and the node's own phases."""
    runs: list[dict[str, Any]] = []
    measured: Any = None
    for i in range(n):
        with run_node(state_dir=state, template=None, extra_env=NODE_ENV) as node:
            runs.append({"health_s": round(node.health_s, 3), **phases(node)})
            if i == 0 and measure is not None:
                measured = measure(node)
        print(f"  start {i + 1}: /health after {node.health_s:.2f} s; node's phases: {runs[-1]}", flush=True)
    health = [r["health_s"] for r in runs]
    return {"runs": runs, "health_p50_s": round(pct(health, 50), 3), "measured": measured}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sandboxes", type=int, default=10_000)
    ap.add_argument("--pauses", type=int, default=3, help="pauses in each sandbox's life (a resume between two)")
    ap.add_argument("--killed", type=int, default=0, help="killed sandboxes in the history beside them")
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=60.0)
    ap.add_argument("--walks", type=int, default=3, help="full list walks per client")
    ap.add_argument("--samples", type=int, default=1000, help="get_info requests")
    ap.add_argument("--smoke", action="store_true", help="50 sandboxes, short runs (CI)")
    ap.add_argument("--keep", action="store_true", help="keep the state directories (their path is printed)")
    ap.add_argument("--state", type=Path, default=None,
                    help="use this fleet state (the fleet/ directory an earlier --keep run kept) instead of making one")
    args = ap.parse_args()
    if args.smoke:
        args.sandboxes, args.restarts, args.idle_s, args.walks, args.samples = 50, 1, 3.0, 1, 50
    work = Path(tempfile.mkdtemp(prefix="aenv-fleet-", dir="/var/tmp"))
    empty, fleet = work / "empty", work / "fleet"
    empty.mkdir()
    out: dict[str, Any] = {"at": utc_now(), "sandboxes": args.sandboxes, "pauses": args.pauses,
                           "killed": args.killed, "load_at_start": os.getloadavg()[0], "smoke": args.smoke}
    try:
        with sigterm_as_interrupt():
            print(f"floor: a node on an empty state ({args.restarts} restarts after its first start)", flush=True)
            with run_node(state_dir=empty, template=None, extra_env=NODE_ENV) as node:
                first_empty = node.health_s
            floor = restarts(empty, args.restarts, measure=lambda n: {"idle_cpu": idle_cpu(n, args.idle_s)})
            floor["first_start_s"] = round(first_empty, 3)
            floor["gc"] = gc_figures(empty, max(3, args.restarts))
            out["empty_state"] = floor

            print(f"making the state: {args.sandboxes} paused sandboxes, {args.pauses} pauses each, "
                  f"{args.killed} killed", flush=True)
            if args.state is not None:
                fleet = args.state
                ids = existing_sandboxes(fleet)
                out["sandboxes"] = len(ids)
                out["state"] = {"reused": str(fleet), "counts": count_rows_at(fleet),
                                "db_bytes": (fleet / "aenv.db").stat().st_size}
            else:
                fs = make_fleet_state(fleet, sandboxes=args.sandboxes, pauses=args.pauses, killed=args.killed)
                ids = fs.sandboxes
                out["state"] = {"rows_s": round(fs.rows_s, 1), "files_s": round(fs.files_s, 1), "counts": fs.counts,
                                "db_bytes": (fleet / "aenv.db").stat().st_size,
                                "first_gc": {"seconds": round(fs.first_gc_s, 3),
                                             "snapshots": len(fs.first_gc.snapshots),
                                             "layers": len(fs.first_gc.layers), "files": len(fs.first_gc.files)}}
                print(f"  rows {fs.rows_s:.1f} s, files {fs.files_s:.1f} s, {fs.counts}; the first collection "
                      f"({len(fs.first_gc.snapshots)} superseded pause snapshots) took {fs.first_gc_s:.2f} s",
                      flush=True)

            def measure(node: BenchNode) -> dict[str, Any]:
                api = api_figures(node, ids, walks=args.walks, samples=args.samples)
                api["idle_cpu"] = idle_cpu(node, args.idle_s)
                api["running_sandboxes"] = node.sql("SELECT count(*) FROM sandboxes WHERE state = 'running'")[0][0]
                return api

            print(f"the node on it: {args.restarts} starts", flush=True)
            out["fleet"] = restarts(fleet, args.restarts, measure=measure)
            out["fleet"]["counts_after"] = count_rows_at(fleet)
            out["fleet"]["gc"] = gc_figures(fleet, max(3, args.restarts), tuple(ids))
            out["floors"] = db_floors(fleet / "aenv.db", ids, walks=args.walks, page=100,
                                      samples=args.samples)
    finally:
        if args.keep:
            print(f"states kept in {work}", flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    report(out)


def existing_sandboxes(state: Path) -> list[str]:
    con = sqlite3.connect(f"file:{state / 'aenv.db'}?mode=ro", uri=True)
    try:
        return [sid for (sid,) in con.execute("SELECT id FROM sandboxes WHERE state = 'paused'")]
    finally:
        con.close()


def count_rows_at(state: Path) -> dict[str, int]:
    db = Database(state / "aenv.db")
    try:
        return count_rows(db)
    finally:
        db.close()


def report(out: dict[str, Any]) -> None:
    f, e, fl = out["fleet"], out["empty_state"], out["floors"]
    api = f["measured"]
    page, page_floor = api["list_default_pages"], fl["list_page"]
    restart, restart_floor = f["health_p50_s"], e["health_p50_s"]
    idle = api["idle_cpu"]
    goals = {
        "list_page_p99_under_50ms": {"value_ms": page["p99_ms"], "goal_ms": 50, "met": page["p99_ms"] < 50},
        "restart_under_10s": {"value_s": restart, "goal_s": 10, "met": restart < 10},
        "idle_cpu_under_2pct": {"value_pct": idle["with_data_plane_pct"], "goal_pct": 2, "met": idle["with_data_plane_pct"] < 2},
    }
    out["goals"] = goals
    out["ratios"] = {
        "list_page_p50_over_db_floor": round(page["p50_ms"] / max(page_floor["p50_ms"], 0.01), 1),
        "list_page_p50_over_health": round(page["p50_ms"] / max(api["health"]["p50_ms"], 0.01), 1),
        "get_info_p50_over_health": round(api["get_info"]["p50_ms"] / max(api["health"]["p50_ms"], 0.01), 1),
        "restart_over_empty": round(restart / max(restart_floor, 0.001), 2),
        "gc_over_empty": round(f["gc"]["collection"]["p50_ms"] / max(e["gc"]["collection"]["p50_ms"], 0.01), 1),
    }
    dest = result_path("fleet_state", smoke=bool(out["smoke"]))
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("state", "floors", "ratios", "goals")}, indent=1))
    print(f"fleet_state: {out['sandboxes']} paused sandboxes: list page p50 {page['p50_ms']} p99 {page['p99_ms']} ms "
          f"({page['pages_per_walk']} pages; sqlite floor p50 {page_floor['p50_ms']} ms, /health "
          f"{api['health']['p50_ms']} ms), SDK page p50 {api['list_sdk_pages']['p50_ms']} ms; get_info p50 "
          f"{api['get_info']['p50_ms']} p99 {api['get_info']['p99_ms']} ms (row floor {fl['get_row']['p50_ms']} ms); "
          f"restart {restart:.2f} s (empty state {restart_floor:.2f} s, reconcile {f['runs'][0].get('reconcile_s')} s); "
          f"idle CPU {idle['with_data_plane_pct']}% (node {idle['node_pct']}%, empty {e['measured']['idle_cpu']['with_data_plane_pct']}%); "
          f"GC pass p50 {f['gc']['collection']['p50_ms']} ms (empty {e['gc']['collection']['p50_ms']} ms), first "
          f"collection {out['state'].get('first_gc', {}).get('seconds')} s, after a pause "
          f"{f['gc']['collection_after_a_pause'].get('p50_ms')} ms; goals: "
          + ", ".join(f"{k} {'met' if v['met'] else 'MISSED'}" for k, v in goals.items()))


if __name__ == "__main__":
    main()
