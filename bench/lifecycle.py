"""API-level latency of pause, resume, snapshot and fork through the unmodified E2B SDK, against the raw VMM
operation floors measured in the same run, and the memory density of forked sandboxes.

A real node (`aenv-node serve`, fresh state directory, see bench/_node.py) builds the `base` template (a Linux
guest under QEMU TCG here, 512 MiB). Measured through the SDK, each call timed on the client:

  idle        one sandbox, guest idle: R x (`sandbox.pause()` -> `Sandbox.connect(id)` -> first command), then
              R x `sandbox.create_snapshot()` (the sandbox keeps running).
  heavy       the same sandbox with two background writers in the guest (a shell loop rewriting a 64 MiB file
              from /dev/urandom, a Python loop touching every page of a 200 MiB bytearray): H x pause/resume,
              H x snapshot, each after --heavy-settle seconds of writing.
  per capture the node's own record: `events` rows 'snapshot_commit' (detail: dirty_bytes, paused_ms = how long
              the guest's vCPUs were stopped) and `snapshots.dirty_bytes`. A capture saves the pages
              written since the VM's last *restore* (create/resume), so successive snapshots of one running
              sandbox grow.
  fork        a fresh idle parent, `sandbox.fork(count=N)` for each N in --forks: total latency, per child
              (total / N), the node's per-child restore, and whether every child runs a command.
  density     the largest fork's children left idle --density-settle seconds, then the PSS of their QEMU
              processes (/proc/PID/smaps_rollup; pids from `sandboxes.vmm_pid`), split into the mapping of the
              shared memory image (guest RAM: page cache shared between the children + their copy-on-write
              pages) and everything else (QEMU's own overhead: TCG translation cache, heap, libraries); compared
              with N x the configured memory and with 2 full copies.

Raw floors in the same run (the node stopped first, its state kept):

  QEMU TCG    the template's boot snapshot (files and shape from the node's SQLite) restored directly with
              `QemuDriver.restore`, disks as plain files (the snapshot's disk layers materialized once into a
              flat file, copied per restore, untimed), inside a network namespace this bench creates with a tap
              `tap0` like a node slot's: restore -> running, QMP stop / cont, `Vm.capture(kind=DIFF)`, and the
              minimal memory-image materialization (`memfile.materialize`) the node also does per capture.
              Heavy: the node's last heavy snapshot restored the same way (its writers resume in the guest),
              same operations after --heavy-settle s. Fork: --fork-floor concurrent restores (one namespace each).
  Firecracker the tiny PVH guest under KVM (bench/vmm_floor.py's `bench_driver`): restore, pause, resume,
              diff capture, 3 forks; the production VMM's floor for comparison.

Ratios: node op / floor, and "the node adds X ms" (node p50 - floor p50). The machine is shared (2 cores, other
workers): load averages are recorded with the numbers. Writes bench/results/lifecycle.json; the last line
printed is a one-line summary.

Run: .venv/bin/python bench/lifecycle.py [--runs 5] [--heavy-runs 3] [--forks 1,4,16] [--floor-runs 5]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_node.vmm import (  # noqa: E402
    CaptureKind,
    FirecrackerDriver,
    QemuDriver,
    SnapshotFiles,
    VmConfig,
    memfile,
)
from aenv_node.vmm.capture_buffer import CaptureBuffer  # noqa: E402
from bench._floor import (  # noqa: E402
    BenchNetns,
    flat_disk,
    floor_files,
    run_cmd,
    snapshot_files,
    template_snapshot_id,
    vm_config,
)
from bench._node import BenchNode, process_cpu_s, run_node, sigterm_as_interrupt  # noqa: E402
from bench._stats import ms, pct, utc_now  # noqa: E402
from _results import result_path  # noqa: E402

GUEST_PYTHON = "/opt/aenv/bin/python"  # the tools drive's Python (the base rootfs has no python3)
MEM_WRITER = (
    "b = bytearray(200 << 20)\n"
    "while True:\n"
    "    for i in range(0, len(b), 4096):\n"
    "        b[i] = (b[i] + 1) % 256\n"
)
START_WRITERS = (
    "nohup bash -c 'while true; do head -c 64M /dev/urandom > /home/user/blob; done' >/dev/null 2>&1 & "
    f"nohup {GUEST_PYTHON} /home/user/memwriter.py >/dev/null 2>&1 &"
)
COUNT_WRITERS = (
    "n=0; for p in /proc/[0-9]*; do c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); "
    "case \"$c\" in *memwriter.py*|*'head -c 64M'*) n=$((n+1));; esac; done; echo $n"
)
SDK_REQUEST_TIMEOUT_S = 900.0
SANDBOX_TIMEOUT_S = 3600




def dist_ms(values_ms: list[float]) -> dict[str, float]:
    """p50/p95/min/max of samples already in ms."""
    v = [x for x in values_ms if x is not None]
    if not v:
        return {}
    return {"p50_ms": round(pct(v, 50), 1), "p95_ms": round(pct(v, 95), 1), "min_ms": round(min(v), 1),
            "max_ms": round(max(v), 1), "n": len(v)}  # fmt: skip


def dist_s(values_s: list[float]) -> dict[str, float]:
    return dist_ms([x * 1000 for x in values_s])


def mib(n: float | None) -> float | None:
    return None if n is None else round(n / 2**20, 1)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def p50(d: dict[str, Any], key: str = "p50_ms") -> float | None:
    return d.get(key) if isinstance(d, dict) else None


# ---- the node's records ------------------------------------------------------------------------------------


def node_sid(sdk_id: str) -> str:
    """The SDK's id may carry a client suffix (`<id>-<client>`); node ids have no '-'."""
    return sdk_id.split("-")[0]


def _json(v: Any) -> Any:
    return json.loads(v) if isinstance(v, str) else (v or {})


def _ts(v: Any) -> dt.datetime:
    return v if isinstance(v, dt.datetime) else dt.datetime.fromisoformat(str(v))


def last_commit(node: BenchNode, sid: str, kind: str) -> dict[str, Any]:
    """The node's last 'snapshot_commit' of this sandbox: dirty bytes, guest-visible pause, node duration."""
    rows = node.sql(
        "SELECT subject_id, duration_ms, detail FROM events WHERE operation = 'snapshot_commit' AND sandbox_id = ?"
        " ORDER BY id DESC", (node_sid(sid),))
    for snap_id, duration, detail in rows:
        d = _json(detail)
        if d.get("kind") == kind:
            return {"snapshot_id": snap_id, "dirty_bytes": d.get("dirty_bytes"), "paused_ms": d.get("paused_ms"),
                    "quiesce_ms": d.get("quiesce_ms"),
                    "commit_ms": round(duration, 1) if duration is not None else None}  # fmt: skip
    return {}


def snapshot_dirty(node: BenchNode, snapshot_id: str) -> int | None:
    rows = node.sql("SELECT dirty_bytes FROM snapshots WHERE id = ?", (snapshot_id,))
    return rows[0][0] if rows else None


def last_transition(node: BenchNode, sid: str, operation: str, to_state: str) -> dict[str, Any]:
    rows = node.sql(
        "SELECT duration_ms, detail, ts FROM events WHERE sandbox_id = ? AND operation = ? AND to_state = ?"
        " ORDER BY id DESC LIMIT 1", (node_sid(sid), operation, to_state))
    if not rows:
        return {}
    duration, detail, ts = rows[0]
    return {"duration_ms": duration, "detail": _json(detail), "ts": ts}


def node_pause_ms(node: BenchNode, sid: str) -> float | None:
    """Node side of the last pause: the 'pausing' transition -> the 'paused' one (capture + VMM stop)."""
    a = last_transition(node, sid, "pause", "pausing")
    b = last_transition(node, sid, "pause", "paused")
    if not a or not b:
        return None
    return round((_ts(b["ts"]) - _ts(a["ts"])).total_seconds() * 1000, 1)


# ---- through the SDK ---------------------------------------------------------------------------------------


NODE_ERRORS: list[str] = []  # API failures that a retry got past: reported, not hidden


def create_sandbox(Sandbox: Any, tries: int = 3) -> Any:
    """`Sandbox.create()`, retried on a node-side 500 (recorded in NODE_ERRORS)."""
    for attempt in range(tries):
        try:
            return Sandbox.create(timeout=SANDBOX_TIMEOUT_S, request_timeout=SDK_REQUEST_TIMEOUT_S)
        except Exception as e:
            if attempt == tries - 1 or "500" not in str(e):
                raise
            NODE_ERRORS.append(f"{utc_now()} create: {type(e).__name__}: {e}"[:300])
            print(f"  create failed ({e}); retrying", flush=True)
            time.sleep(2)
    raise AssertionError("unreachable")


def run_ok(sb: Any) -> float:
    """`echo ok` in the sandbox; its duration in s (raises if the sandbox does not answer right)."""
    t = time.perf_counter()
    r = sb.commands.run("echo ok", request_timeout=120)
    if r.stdout != "ok\n" or r.exit_code != 0:
        raise RuntimeError(f"command in {sb.sandbox_id}: exit {r.exit_code}, stdout {r.stdout!r}")
    return time.perf_counter() - t


def writers_running(sb: Any) -> int:
    return int(sb.commands.run(COUNT_WRITERS, request_timeout=120).stdout.strip() or 0)


def pause_resume_cycles(Sandbox: Any, node: BenchNode, sb: Any, runs: int, settle_s: float,
                        label: str) -> tuple[Any, dict[str, Any]]:
    samples = []
    for i in range(runs):
        time.sleep(settle_s)
        t = time.perf_counter()
        ok = sb.pause(request_timeout=SDK_REQUEST_TIMEOUT_S)
        pause_s = time.perf_counter() - t
        if ok is not True:
            raise RuntimeError(f"pause of {sb.sandbox_id} returned {ok!r}")
        t = time.perf_counter()
        sb = Sandbox.connect(sb.sandbox_id, timeout=SANDBOX_TIMEOUT_S, request_timeout=SDK_REQUEST_TIMEOUT_S)
        resume_s = time.perf_counter() - t
        # (read after the connect: a pause answers once the guest is captured, and commits behind the answer;
        # the connect waits for that, so the resume includes the rest of the pause's persist)
        commit = last_commit(node, sb.sandbox_id, "pause")
        node_pause = node_pause_ms(node, sb.sandbox_id)
        if commit.get("paused_ms") is not None:
            # what the guest sees of a pause: its filesystem frozen (the quiesce: writes block), then its vCPUs
            # stopped until the capture is held
            commit["guest_visible_ms"] = round(commit["paused_ms"] + (commit.get("quiesce_ms") or 0), 1)
        first_s = run_ok(sb)
        res = last_transition(node, sb.sandbox_id, "resume", "running")
        s = {"pause_ms": ms(pause_s), "resume_ms": ms(resume_s), "first_command_ms": ms(first_s),
             "node_pause_ms": node_pause, "node_resume_ms": res.get("duration_ms"),
             "node_resume_restore_ms": res.get("detail", {}).get("restore_ms"), **commit}  # fmt: skip
        samples.append(s)
        print(f"  {label} {i + 1}/{runs}: pause {s['pause_ms']:7.1f} ms (guest paused {s.get('paused_ms')} ms after a "
              f"quiesce of {s.get('quiesce_ms')} ms, dirty "
              f"{mib(s.get('dirty_bytes'))} MiB)  resume {s['resume_ms']:7.1f} ms  first command "
              f"{s['first_command_ms']:6.1f} ms", flush=True)  # fmt: skip
    return sb, summarize_cycles(samples)


def summarize_cycles(samples: list[dict[str, Any]]) -> dict[str, Any]:
    def col(k: str) -> list[float]:
        return [s[k] for s in samples if s.get(k) is not None]

    return {
        "pause": dist_ms(col("pause_ms")), "resume": dist_ms(col("resume_ms")),
        "first_command_after_resume": dist_ms(col("first_command_ms")),
        "node_pause": dist_ms(col("node_pause_ms")), "node_resume": dist_ms(col("node_resume_ms")),
        "node_resume_restore": dist_ms(col("node_resume_restore_ms")),
        "guest_paused": dist_ms(col("paused_ms")), "quiesce": dist_ms(col("quiesce_ms")),
        "guest_visible": dist_ms(col("guest_visible_ms")),
        "dirty_mib": {"p50": mib(pct(col("dirty_bytes"), 50)), "max": mib(max(col("dirty_bytes")))}
        if col("dirty_bytes") else {},
        "samples": samples,
    }  # fmt: skip


def snapshot_runs(node: BenchNode, sb: Any, runs: int, settle_s: float, label: str,
                  keep_last: bool = False) -> dict[str, Any]:
    samples = []
    for i in range(runs):
        time.sleep(settle_s)
        t = time.perf_counter()
        info = sb.create_snapshot(request_timeout=SDK_REQUEST_TIMEOUT_S)
        snap_s = time.perf_counter() - t
        after_s = run_ok(sb)  # it keeps running
        commit = last_commit(node, sb.sandbox_id, "user")
        s = {"snapshot_ms": ms(snap_s), "snapshot_id": info.snapshot_id, "command_after_ms": ms(after_s),
             "config_dirty_bytes": snapshot_dirty(node, info.snapshot_id),
             **{k: v for k, v in commit.items() if k != "snapshot_id"}}  # fmt: skip
        if commit.get("snapshot_id") not in (None, info.snapshot_id):
            s["note"] = f"last commit event is {commit['snapshot_id']}"
        samples.append(s)
        print(f"  {label} {i + 1}/{runs}: snapshot {s['snapshot_ms']:7.1f} ms (guest paused {s.get('paused_ms')} ms, "
              f"dirty {mib(s.get('dirty_bytes'))} MiB)", flush=True)  # fmt: skip
    col = lambda k: [s[k] for s in samples if s.get(k) is not None]  # noqa: E731
    return {
        "snapshot": dist_ms(col("snapshot_ms")), "guest_paused": dist_ms(col("paused_ms")),
        "node_commit": dist_ms(col("commit_ms")),
        "dirty_mib": [mib(x) for x in col("dirty_bytes")],
        "samples": samples,
    }  # fmt: skip


def pss_breakdown(pid: int, image: str) -> dict[str, Any]:
    """PSS of one VMM process: total (smaps_rollup), the guest RAM mapping of `image`, the rest."""
    tot: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[0].endswith(":") and parts[2] == "kB":
                tot[parts[0][:-1]] = int(parts[1]) * 1024
    ram = {"Pss": 0, "Rss": 0, "Anonymous": 0, "Private_Dirty": 0}
    in_ram = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if not head:
                continue
            if not head[0].endswith(":"):  # a mapping header: "start-end perms offset dev inode [path]"
                in_ram = len(head) >= 6 and head[5] == image
                continue
            if in_ram and head[0][:-1] in ram:
                ram[head[0][:-1]] += int(head[1]) * 1024
    return {
        "pss": tot.get("Pss", 0), "rss": tot.get("Rss", 0), "pss_anon": tot.get("Pss_Anon"),
        "pss_file": tot.get("Pss_File"), "guest_ram_pss": ram["Pss"], "guest_ram_rss": ram["Rss"],
        "guest_ram_cow": ram["Anonymous"], "qemu_own_pss": tot.get("Pss", 0) - ram["Pss"],
    }  # fmt: skip


def meminfo_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def density(node: BenchNode, children: list[Any], mem_mib: int, settle_s: float,
            avail_before: int) -> dict[str, Any]:
    time.sleep(settle_s)
    ids = [node_sid(c.sandbox_id) for c in children]
    rows = node.sql("SELECT s.id, s.vmm_pid, sn.memory_location FROM sandboxes s JOIN snapshots sn ON sn.id = s.snapshot_id"
                    " WHERE s.id IN (%s)" % ",".join("?" * len(ids)), tuple(ids))
    per = []
    for sid, pid, memory in rows:
        if not pid:
            continue
        try:
            per.append({"sandbox_id": sid, "pid": pid, **pss_breakdown(pid, memory)})
        except OSError as e:
            per.append({"sandbox_id": sid, "pid": pid, "error": str(e)})
    ok = [p for p in per if "error" not in p]
    n = len(ok)
    total = sum(p["pss"] for p in ok)
    ram = sum(p["guest_ram_pss"] for p in ok)
    own = sum(p["qemu_own_pss"] for p in ok)
    one_guest = mem_mib << 20
    return {
        "children": n, "settle_s": settle_s, "configured_memory_mib": mem_mib,
        "sum_pss_mib": mib(total), "sum_guest_ram_pss_mib": mib(ram), "sum_qemu_own_pss_mib": mib(own),
        "sum_guest_ram_cow_mib": mib(sum(p["guest_ram_cow"] for p in ok)),
        "per_child_pss_mib": mib(total / n) if n else None,
        "per_child_qemu_own_pss_mib": mib(own / n) if n else None,
        "vs_n_full_guests": round(total / (n * one_guest), 3) if n else None,
        "in_units_of_one_guest": round(total / one_guest, 2),
        "vs_two_full_copies": round(total / (2 * one_guest), 2),
        "guest_ram_only_in_units_of_one_guest": round(ram / one_guest, 2),
        "host_memavailable_drop_mib_noisy": mib(avail_before - meminfo_available()),
        "per_child": [{k: (mib(v) if isinstance(v, int) and k not in ("pid",) else v) for k, v in p.items()}
                      for p in per],
    }  # fmt: skip


def kill_all(Sandbox: Any, children: list[Any]) -> None:
    ids = [c.sandbox_id for c in children if not isinstance(c, Exception)]
    if not ids:
        return
    with ThreadPoolExecutor(max_workers=min(8, len(ids))) as ex:
        list(ex.map(lambda i: Sandbox.kill(i, request_timeout=SDK_REQUEST_TIMEOUT_S), ids))


def children_vmm_cpu_s(node: BenchNode, children: list[Any]) -> float:
    """CPU seconds the children's VMMs (their ``sandboxes.vmm_pid``) have used since they started."""
    ids = [node_sid(c.sandbox_id) for c in children]
    if not ids:
        return 0.0
    total = 0.0
    for (pid,) in node.sql("SELECT vmm_pid FROM sandboxes WHERE id IN (%s)" % ",".join("?" * len(ids)), tuple(ids)):
        with contextlib.suppress(OSError, TypeError):
            total += process_cpu_s(int(pid))
    return total


def fork_phase(Sandbox: Any, node: BenchNode, counts: list[int], density_settle_s: float,
               mem_mib: int) -> dict[str, Any]:
    parent = create_sandbox(Sandbox)
    out: dict[str, Any] = {"runs": []}
    try:
        run_ok(parent)
        for n in counts:
            time.sleep(2)
            avail_before = meminfo_available()
            cpu_before = node.cpu_s()
            t = time.perf_counter()
            try:
                res = parent.fork(count=n, timeout=SANDBOX_TIMEOUT_S, request_timeout=SDK_REQUEST_TIMEOUT_S)
            except Exception as e:  # recorded; the rest of the run (floors) still happens
                out["runs"].append({"count": n, "error": f"{type(e).__name__}: {e}"[:500],
                                    "node_alive": node.proc.poll() is None})
                print(f"  fork {n:2}: FAILED {type(e).__name__}: {e}"[:300], flush=True)
                if node.proc.poll() is not None:
                    break
                continue
            total_s = time.perf_counter() - t
            children = [c for c in res if not isinstance(c, Exception)]
            # where the fork's CPU went: the node (control and data plane) against the children's VMMs (the
            # restore, then the restored guest's first work: envd's /init, under TCG the retranslation of all
            # the code it runs)
            cpu_after = node.cpu_s()
            fork_cpu = {"node_ms": ms(sum(cpu_after.values()) - sum(cpu_before.values())),
                        "children_vmm_ms": ms(children_vmm_cpu_s(node, children))}
            errors = [f"{type(c).__name__}: {c}"[:300] for c in res if isinstance(c, Exception)]
            try:
                cmd_ok: list[bool] = []
                for c in children:
                    try:
                        run_ok(c)
                        cmd_ok.append(True)
                    except Exception as e:
                        cmd_ok.append(False)
                        errors.append(f"command in {c.sandbox_id}: {type(e).__name__}: {e}"[:300])
                commit = last_commit(node, parent.sandbox_id, "fork")
                ids = [node_sid(c.sandbox_id) for c in children]
                ev = node.sql(
                    "SELECT sandbox_id, duration_ms, detail FROM events WHERE operation = 'fork' AND"
                    " to_state = 'running' AND sandbox_id IN (%s)" % ",".join("?" * len(ids)), tuple(ids)
                ) if ids else []
                r = {
                    "count": n, "total_ms": ms(total_s), "per_child_ms": ms(total_s / n),
                    "children_running": len(children), "children_ran_command": sum(cmd_ok),
                    "all_children_ran_command": len(children) == n and all(cmd_ok),
                    "parent_capture": commit,
                    "node_child_ready": dist_ms([d for _, d, _ in ev]),
                    "node_child_restore": dist_ms([_json(x).get("restore_ms") for _, _, x in ev]),
                    "cpu": fork_cpu,
                    "errors": errors,
                }  # fmt: skip
                print(f"  fork {n:2}: {r['total_ms']:8.1f} ms total, {r['per_child_ms']:7.1f} ms/child, "
                      f"{r['children_ran_command']}/{n} children ran a command; parent paused "
                      f"{commit.get('paused_ms')} ms; CPU: node {fork_cpu['node_ms']:.0f} ms, children's VMMs "
                      f"{fork_cpu['children_vmm_ms']:.0f} ms", flush=True)  # fmt: skip
                if n == max(counts) and children:
                    r["density"] = density(node, children, mem_mib, density_settle_s, avail_before)
                    d = r["density"]
                    print(f"  density: {d['children']} children PSS {d['sum_pss_mib']} MiB = "
                          f"{d['in_units_of_one_guest']} x one {mem_mib} MiB guest (guest RAM "
                          f"{d['sum_guest_ram_pss_mib']} MiB, QEMU own {d['sum_qemu_own_pss_mib']} MiB)", flush=True)
                out["runs"].append(r)
            finally:
                try:
                    kill_all(Sandbox, children)
                except Exception as e:
                    print(f"  killing fork children failed: {e}", flush=True)
    finally:
        try:
            parent.kill()
        except Exception as e:
            print(f"  killing the fork parent failed: {e}", flush=True)
    return out


def sdk_phases(node: BenchNode, args: argparse.Namespace) -> dict[str, Any]:
    os.environ.update(node.sdk_env())
    from e2b import Sandbox

    out: dict[str, Any] = {}
    t = time.perf_counter()
    sb = create_sandbox(Sandbox)
    create_s = time.perf_counter() - t
    try:
        out["warmup"] = {"create_ms": ms(create_s), "first_command_ms": ms(run_ok(sb))}
        print(f"sandbox {sb.sandbox_id}: create {out['warmup']['create_ms']} ms", flush=True)
        print("idle guest:", flush=True)
        sb, out["idle_pause_resume"] = pause_resume_cycles(Sandbox, node, sb, args.runs, args.settle, "idle")
        out["idle_snapshot"] = snapshot_runs(node, sb, args.runs, args.settle, "idle")
        for s in out["idle_snapshot"]["samples"]:
            Sandbox.delete_snapshot(s["snapshot_id"])

        print("heavy guest (writers on memory and disk):", flush=True)
        sb.files.write("/home/user/memwriter.py", MEM_WRITER)
        sb.commands.run(START_WRITERS, request_timeout=120)
        time.sleep(2)
        out["heavy_writers_started"] = writers_running(sb)
        sb, out["heavy_pause_resume"] = pause_resume_cycles(Sandbox, node, sb, args.heavy_runs,
                                                            args.heavy_settle, "heavy")
        out["heavy_writers_after_resumes"] = writers_running(sb)
        out["heavy_snapshot"] = snapshot_runs(node, sb, args.heavy_runs, args.heavy_settle, "heavy")
        out["heavy_writers_after_snapshots"] = writers_running(sb)
        out["heavy_floor_snapshot_id"] = out["heavy_snapshot"]["samples"][-1]["snapshot_id"]
        for s in out["heavy_snapshot"]["samples"][:-1]:
            Sandbox.delete_snapshot(s["snapshot_id"])
    finally:
        sb.kill()
    print("fork (idle parent):", flush=True)
    out["fork"] = fork_phase(Sandbox, node, args.forks, args.density_settle, args.mem_mib)
    return out


# ---- raw floors --------------------------------------------------------------------------------------------


async def qemu_ops_floor(driver: QemuDriver, snap: dict[str, Any], work: Path, ns: BenchNetns, runs: int,
                         settle_s: float, label: str) -> dict[str, Any]:
    """Restore -> running, stop/cont, diff capture (+ the memory-image materialization) of one snapshot."""
    flat = work / f"{label}.flat"
    mat_s = await trio.to_thread.run_sync(flat_disk, snap, flat)
    r: dict[str, list[float]] = {k: [] for k in ("restore", "pause", "resume", "capture_diff", "materialize_image",
                                                 "capture_diff_plus_resume")}
    dirty: list[int] = []
    warmup: dict[str, float] = {}
    buf = await trio.to_thread.run_sync(CaptureBuffer, snap["shape"]["mem_mib"] << 20)  # untimed, like the node's
    for i in range(-1, runs):  # i == -1: an untimed warm-up (page cache, first QEMU start), reported apart
        wd = work / f"{label}{i + 1}"
        wd.mkdir()
        disk = wd / "disk.raw"
        await trio.to_thread.run_sync(run_cmd, "cp", "--sparse=always", str(flat), str(disk))  # untimed
        files = await trio.to_thread.run_sync(floor_files, snap, wd)  # untimed
        await trio.to_thread.run_sync(os.sync)  # its writeback must not compete with the timed restore
        config = vm_config(snap, wd, disk, ns.path, "aenv-bench-lifecycle")
        t0 = time.perf_counter()
        async with driver.restore(config, files) as vm:
            r["restore"].append(time.perf_counter() - t0)
            await trio.sleep(settle_s)
            for _ in range(3):
                t = time.perf_counter()
                await vm.pause()
                r["pause"].append(time.perf_counter() - t)
                t = time.perf_counter()
                await vm.resume()
                r["resume"].append(time.perf_counter() - t)
            await trio.sleep(0.5)
            t = time.perf_counter()
            # the same fastest raw method the node uses: dirty pages into pre-faulted memory
            cap = await vm.capture(wd / "diff.vmstate", wd / "diff.memory", kind=CaptureKind.DIFF, buffer=buf)
            cap_s = time.perf_counter() - t
            await vm.resume()
            r["capture_diff_plus_resume"].append(time.perf_counter() - t)
            r["capture_diff"].append(cap_s)
            dirty.append(cap.dirty_bytes)
            alive = (await vm.stats()).state.value == "running"
        t = time.perf_counter()
        if cap.buffer is not None:
            await trio.to_thread.run_sync(lambda: memfile.materialize_packed(
                Path(snap["memory"]), cap.dirty_ranges, buf.view[: cap.dirty_bytes], wd / "memory"))
        else:
            await trio.to_thread.run_sync(
                lambda: memfile.materialize(Path(snap["memory"]), [(wd / "diff.memory", cap.dirty_ranges)],
                                            wd / "memory"))
        r["materialize_image"].append(time.perf_counter() - t)
        print(f"  QEMU {label} {'warm-up' if i == -1 else f'{i + 1}/{runs}'}: restore {ms(r['restore'][-1])} ms, stop {ms(r['pause'][-1])} ms, "
              f"cont {ms(r['resume'][-1])} ms, diff capture {ms(cap_s)} ms ({mib(cap.dirty_bytes)} MiB dirty), "
              f"materialize {ms(r['materialize_image'][-1])} ms, running after: {alive}", flush=True)
        shutil.rmtree(wd, ignore_errors=True)
        if i == -1:
            warmup = {k: ms(statistics.median(v)) for k, v in r.items() if v}
            warmup["dirty_mib"] = mib(dirty[0]) or 0.0
            for v in r.values():
                v.clear()
            dirty.clear()
    flat.unlink(missing_ok=True)
    buf.close()
    out: dict[str, Any] = {k: dist_s(v) for k, v in r.items()}
    out.update({"dirty_mib": [mib(x) for x in dirty], "snapshot_id": snap["id"], "format": snap["format"],
                "disk_materialize_ms": ms(mat_s), "settle_s": settle_s, "warmup_run_ms": warmup})
    return out


async def qemu_fork_floor(driver: QemuDriver, snap: dict[str, Any], work: Path, n: int) -> dict[str, Any]:
    """n concurrent restores of one snapshot (own namespace and disk copy each) -> all running."""
    flat = work / "fork.flat"
    await trio.to_thread.run_sync(flat_disk, snap, flat)
    nss = [BenchNetns(100 + i, "aenvlc") for i in range(n)]
    entered: list[BenchNetns] = []
    up: list[float] = []
    try:
        for ns in nss:
            ns.__enter__()
            entered.append(ns)
        configs = []
        for i, ns in enumerate(nss):
            wd = work / f"fork{i}"
            wd.mkdir()
            await trio.to_thread.run_sync(run_cmd, "cp", "--sparse=always", str(flat), str(wd / "disk.raw"))
            files = await trio.to_thread.run_sync(floor_files, snap, wd)
            await trio.to_thread.run_sync(os.sync)
            configs.append((vm_config(snap, wd, wd / "disk.raw", ns.path, "aenv-bench-lifecycle"), files))
        all_up = trio.Event()
        t0 = time.perf_counter()

        async def child(c: VmConfig, files: SnapshotFiles) -> None:
            async with driver.restore(c, files):
                up.append(time.perf_counter() - t0)
                if len(up) == n:
                    all_up.set()
                await all_up.wait()

        async with trio.open_nursery() as nursery:
            for c, f in configs:
                nursery.start_soon(child, c, f)
    finally:
        for ns in entered:
            ns.__exit__()
        flat.unlink(missing_ok=True)
    return {"count": n, "all_running_ms": ms(max(up)), "each_ms": sorted(ms(x) for x in up),
            "per_child_ms": ms(max(up) / n)}


async def floors(boot: dict[str, Any], heavy: dict[str, Any] | None, work: Path, args: argparse.Namespace
                 ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    driver = QemuDriver(tcg_tb_size_mib=args.tcg_tb_size_mb, restore_tb_size_mib=args.tcg_tb_size_restore_mb)
    with BenchNetns(0, "aenvlc") as ns:
        out["qemu_tcg_idle"] = await qemu_ops_floor(driver, boot, work, ns, args.floor_runs, args.settle, "idle")
        if heavy is not None:
            out["qemu_tcg_heavy"] = await qemu_ops_floor(driver, heavy, work, ns, args.heavy_runs,
                                                         args.heavy_settle, "heavy")
    if args.fork_floor > 0:
        out["qemu_tcg_fork"] = await qemu_fork_floor(driver, boot, work, args.fork_floor)
        print(f"  QEMU fork floor: {out['qemu_tcg_fork']}", flush=True)
    fc = FirecrackerDriver()
    if fc.binary.is_file():
        from bench.vmm_floor import MEM_MIB, bench_driver, summarize
        from tests.vmm.tinyguest import build_tiny_guest

        base = work / "fc"
        base.mkdir()
        kernel = build_tiny_guest(base / "guest")
        s = summarize(await bench_driver(fc, kernel, base, args.floor_runs))
        out["firecracker_tiny"] = {"mem_mib": MEM_MIB, **{k: v for k, v in s.items()}}
        print("  Firecracker tiny: " + ", ".join(f"{k} {v['median_ms']} ms" for k, v in s.items()), flush=True)
    else:
        out["firecracker_tiny"] = {"skipped": f"firecracker not installed at {fc.binary}"}
    return out


# ---- ratios and summary --------------------------------------------------------------------------------------


def compare(node_ms: float | None, floor_ms: float | None) -> dict[str, Any]:
    if node_ms is None or floor_ms is None or floor_ms <= 0:
        return {}
    return {"node_p50_ms": node_ms, "floor_p50_ms": floor_ms, "ratio": round(node_ms / floor_ms, 1),
            "node_adds_ms": round(node_ms - floor_ms, 1)}


def ratios(sdk: dict[str, Any], fl: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for load in ("idle", "heavy"):
        q = fl.get(f"qemu_tcg_{load}")
        pr, sn = sdk.get(f"{load}_pause_resume"), sdk.get(f"{load}_snapshot")
        if not q or not pr:
            continue
        out[f"{load}_pause_vs_diff_capture"] = compare(p50(pr["pause"]), p50(q["capture_diff"]))
        # the least work a pause must do: the diff capture plus one flat memory image for later restores
        cm = (p50(q["capture_diff"]) or 0) + (p50(q["materialize_image"]) or 0)
        out[f"{load}_pause_vs_diff_capture_plus_image"] = compare(p50(pr["pause"]), round(cm, 1))
        if sn:
            out[f"{load}_snapshot_vs_diff_capture_plus_image"] = compare(p50(sn["snapshot"]), round(cm, 1))
        out[f"{load}_resume_vs_restore"] = compare(p50(pr["resume"]), p50(q["restore"]))
        out[f"{load}_node_side_resume_restore_vs_restore"] = compare(p50(pr["node_resume_restore"]),
                                                                     p50(q["restore"]))
        out[f"{load}_guest_paused_vs_diff_capture_plus_cont"] = compare(p50(pr["guest_paused"]),
                                                                        p50(q["capture_diff_plus_resume"]))
        # the goal's ratio: the call against what the guest sees of it (quiesce + vCPUs stopped), same run
        out[f"{load}_pause_vs_guest_visible"] = compare(p50(pr["pause"]), p50(pr.get("guest_visible", {})))
        if sn:
            out[f"{load}_snapshot_vs_diff_capture_plus_cont"] = compare(p50(sn["snapshot"]),
                                                                        p50(q["capture_diff_plus_resume"]))
            out[f"{load}_snapshot_guest_paused_vs_diff_capture_plus_cont"] = compare(
                p50(sn["guest_paused"]), p50(q["capture_diff_plus_resume"]))
    q = fl.get("qemu_tcg_idle")
    for r in [r for r in sdk.get("fork", {}).get("runs", []) if "total_ms" in r]:
        if q:
            out[f"fork{r['count']}_total_vs_restore"] = compare(r["total_ms"], p50(q["restore"]))
    ff = fl.get("qemu_tcg_fork")
    if ff:
        for r in sdk.get("fork", {}).get("runs", []):
            if r["count"] == ff["count"] and "total_ms" in r:
                out[f"fork{r['count']}_total_vs_concurrent_restores"] = compare(r["total_ms"], ff["all_running_ms"])
    return out


def summary_line(res: dict[str, Any]) -> str:
    sdk, fl = res.get("sdk", {}), res.get("floors", {})

    def g(d: Any, *path: str) -> Any:
        for k in path:
            if not isinstance(d, dict) or k not in d:
                return None
            d = d[k]
        return d

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.0f}"

    parts = [
        f"pause p50 {f(g(sdk, 'idle_pause_resume', 'pause', 'p50_ms'))} ms idle / "
        f"{f(g(sdk, 'heavy_pause_resume', 'pause', 'p50_ms'))} ms heavy (QEMU diff-capture floor "
        f"{f(g(fl, 'qemu_tcg_idle', 'capture_diff', 'p50_ms'))} / {f(g(fl, 'qemu_tcg_heavy', 'capture_diff', 'p50_ms'))}"
        f"; guest paused {f(g(sdk, 'idle_pause_resume', 'guest_paused', 'p50_ms'))} / "
        f"{f(g(sdk, 'heavy_pause_resume', 'guest_paused', 'p50_ms'))} ms, guest-visible with the quiesce "
        f"{f(g(sdk, 'idle_pause_resume', 'guest_visible', 'p50_ms'))} / "
        f"{f(g(sdk, 'heavy_pause_resume', 'guest_visible', 'p50_ms'))} ms, dirty "
        f"{g(sdk, 'idle_pause_resume', 'dirty_mib', 'p50')} / {g(sdk, 'heavy_pause_resume', 'dirty_mib', 'p50')} MiB)",
        f"resume p50 {f(g(sdk, 'idle_pause_resume', 'resume', 'p50_ms'))} / "
        f"{f(g(sdk, 'heavy_pause_resume', 'resume', 'p50_ms'))} ms (restore floor "
        f"{f(g(fl, 'qemu_tcg_idle', 'restore', 'p50_ms'))} / {f(g(fl, 'qemu_tcg_heavy', 'restore', 'p50_ms'))})",
        f"snapshot idle/heavy p50 {f(g(sdk, 'idle_snapshot', 'snapshot', 'p50_ms'))} / "
        f"{f(g(sdk, 'heavy_snapshot', 'snapshot', 'p50_ms'))} ms (guest paused "
        f"{f(g(sdk, 'idle_snapshot', 'guest_paused', 'p50_ms'))} / {f(g(sdk, 'heavy_snapshot', 'guest_paused', 'p50_ms'))}"
        f" ms; floor capture+cont {f(g(fl, 'qemu_tcg_idle', 'capture_diff_plus_resume', 'p50_ms'))} / "
        f"{f(g(fl, 'qemu_tcg_heavy', 'capture_diff_plus_resume', 'p50_ms'))})",
    ]
    failed = [str(r["count"]) for r in (g(sdk, "fork", "runs") or []) if "total_ms" not in r]
    forks = [r for r in (g(sdk, "fork", "runs") or []) if "total_ms" in r]
    parts.append("fork " + "/".join(str(r["count"]) for r in forks) + " " +
                 "/".join(f(r["total_ms"]) for r in forks) + " ms (" +
                 "/".join(f(r["per_child_ms"]) for r in forks) + " ms/child, all ran a command: " +
                 "/".join("yes" if r["all_children_ran_command"] else "NO" for r in forks) + ")" +
                 (f" [fork {'/'.join(failed)} FAILED]" if failed else ""))
    dens = next((r["density"] for r in forks if "density" in r), None)
    if dens:
        parts.append(f"{dens['children']} children PSS {dens['sum_pss_mib']:.0f} MiB = "
                     f"{dens['in_units_of_one_guest']} x one guest (QEMU own {dens['per_child_qemu_own_pss_mib']} "
                     f"MiB/child)")
    fc = fl.get("firecracker_tiny", {})
    if "restore" in fc:
        parts.append(f"Firecracker tiny floors: restore {fc['restore']['median_ms']}, pause {fc['pause']['median_ms']}, "
                     f"diff {fc['capture_diff']['median_ms']} ms")
    parts.append(f"load {res['host']['loadavg_at_start'][0]} at start (shared 2-core host)")
    return "lifecycle: " + "; ".join(parts)


# ---- main --------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="idle pause/resume cycles and idle snapshots")
    ap.add_argument("--heavy-runs", type=int, default=3, help="heavy pause/resume cycles and snapshots")
    ap.add_argument("--settle", type=float, default=2.0, help="idle seconds before each idle operation")
    ap.add_argument("--heavy-settle", type=float, default=6.0, help="seconds of writing before each heavy op")
    ap.add_argument("--forks", default="1,4,16", help="fork counts; the largest is used for density")
    ap.add_argument("--density-settle", type=float, default=10.0, help="idle seconds before reading PSS")
    ap.add_argument("--floor-runs", type=int, default=5)
    ap.add_argument("--fork-floor", type=int, default=4, help="concurrent raw restores (0: skip)")
    ap.add_argument("--warm-slots", type=int, default=20,
                    help="AENV_NET_WARM_SLOTS: more than the largest fork, so fork children take prepared slots"
                         " (the node's slot allocation races when the pool runs dry: see the report)")
    ap.add_argument("--mem-mib", type=int, default=512, help="the node's sandbox.default_memory_mb")
    ap.add_argument("--tcg-tb-size-mb", type=int, default=64, help="as the node's vmm.tcg_tb_size_mb")
    ap.add_argument("--tcg-tb-size-restore-mb", type=int, default=16,
                    help="as the node's vmm.tcg_tb_size_restore_mb (restored VMs)")
    ap.add_argument("--out", type=Path, default=result_path("lifecycle"))
    args = ap.parse_args()
    args.forks = [int(x) for x in args.forks.split(",") if x.strip()]

    results: dict[str, Any] = {
        "started_at": utc_now(),
        "host": {"loadavg_at_start": loadavg(), "cpus": os.cpu_count(),
                 "note": "2 shared cores; other workers run on this machine at the same time"},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "guest_writers": {"disk": "head -c 64M /dev/urandom > /home/user/blob, in a loop",
                          "memory": "python: +1 on every 4 KiB page of a 200 MiB bytearray, in a loop"},
    }  # fmt: skip
    print(f"loadavg at start {results['host']['loadavg_at_start']}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="aenv-lifecycle-", dir="/var/tmp"))
    stop_hooks: list[Callable[[], None]] = []
    try:
        with sigterm_as_interrupt(), run_node(stop_hook=stop_hooks,
                                              extra_env={"AENV_NET_WARM_SLOTS": str(args.warm_slots)}) as node:
            print(f"node up: /health {node.health_s:.1f} s, template base ready {node.template_ready_s:.1f} s",
                  flush=True)  # fmt: skip
            results["node"] = {"health_s": round(node.health_s, 2),
                               "template_ready_s": round(node.template_ready_s, 2), "env": node.env}
            try:
                results["sdk"] = sdk_phases(node, args)
            finally:
                results["loadavg_after_sdk"] = loadavg()
                results["node_errors_retried"] = NODE_ERRORS
            boot = snapshot_files(node.state_dir, template_snapshot_id(node.state_dir))
            heavy_id = results["sdk"].get("heavy_floor_snapshot_id")
            heavy = snapshot_files(node.state_dir, heavy_id) if heavy_id else None
            for hook in stop_hooks:  # the node's work is done: stop it, keep its snapshot files for the floors
                hook()
            print("raw floors (node stopped):", flush=True)
            results["loadavg_before_floors"] = loadavg()
            results["floors"] = trio.run(floors, boot, heavy, work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results["ratios"] = ratios(results["sdk"], results["floors"])
    results["host"]["loadavg_at_end"] = loadavg()
    results["finished_at"] = utc_now()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    for k, v in results["ratios"].items():
        if v:
            print(f"  {k}: node {v['node_p50_ms']} ms vs floor {v['floor_p50_ms']} ms = {v['ratio']}x "
                  f"(+{v['node_adds_ms']} ms)")
    print(summary_line(results))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted: node stopped, namespaces and temp dirs removed", file=sys.stderr)
        sys.exit(130)
