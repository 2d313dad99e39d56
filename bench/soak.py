"""Soak: many concurrent E2B SDK clients drive one real node for a bounded time; then nothing may be left.

A node (bench/_node.py: `aenv-node serve`, fresh state directory, sandboxes with no route off the machine) and
--clients threads, each an SDK user on loopback that until --duration runs out picks, at random (seeded),
one of: create (while the node has fewer than --max-live sandboxes running), run a command, write a file
and read it back, pause, resume (`Sandbox.connect`), snapshot, fork one child, kill. Every call is timed on
the client and its outcome counted; an error is *expected* only when it is the answer the E2B API gives for
the situation (a 409 for a pause that raced another client's kill of the same sandbox never happens: each
client owns its sandboxes), so every error counts against the run. Loops are bounded in time and count
(--max-ops per client).

The node's RSS (/proc/PID/status VmRSS of the node process alone; its VMMs are separate processes) is sampled
every 5 s. At the end every sandbox is killed through the API and, once the node has settled, the bench
checks that nothing is left: no VMM naming the state directory, no network namespace beyond the warm pool
(twice `net.warm_slots`: slots given back are kept for reuse up to that),
no mount or loop device under the state directory, no run directory or writable upper, no temporary file,
no sandbox row outside `killed`, no network slot row beyond the warm pool. Writes bench/results/soak.json;
the last line printed is a one-line summary (latency percentiles per operation, errors, leaks, RSS drift:
the median of the last quarter of the samples over the median of the second quarter).

Run: .venv/bin/python bench/soak.py [--duration 600] [--clients 4] [--max-live 6] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _node import BenchNode, run_node, sigterm_as_interrupt  # noqa: E402
from _stats import ms, pct, utc_now  # noqa: E402
from _results import result_path  # noqa: E402

WARM_SLOTS = 2
MARK = "/home/user/soak.txt"


class Client(threading.Thread):
    """One SDK user: owns the sandboxes it made (running or paused) and acts on them until the deadline."""

    def __init__(self, n: int, node: BenchNode, args: argparse.Namespace, deadline: float,
                 live: Callable[[], int]) -> None:
        super().__init__(daemon=True, name=f"client-{n}")
        self.node, self.args, self.deadline, self.live = node, args, deadline, live
        self.rng = random.Random(args.seed * 1000 + n)
        self.running: dict[str, Any] = {}  # id -> Sandbox
        self.paused: list[str] = []
        self.written: dict[str, str] = {}  # id -> what MARK holds
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: list[str] = []
        self.ops = 0

    def timed(self, op: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """(True, what ``fn`` returned), or (False, None) with the error recorded against the run."""
        t0 = time.monotonic()
        try:
            out = fn()
        except Exception as exc:
            self.errors.append(f"{op}: {type(exc).__name__}: {str(exc)[:300]}")
            return False, None
        self.latency[op].append(time.monotonic() - t0)
        return True, out

    def run(self) -> None:
        from e2b import Sandbox

        while time.monotonic() < self.deadline and self.ops < self.args.max_ops:
            self.ops += 1
            choices = ["create"] if self.live() < self.args.max_live else []
            if self.running:
                choices += ["command", "file", "file", "pause", "snapshot", "kill"]
                if self.live() < self.args.max_live:
                    choices.append("fork")
            if self.paused:
                choices += ["resume", "resume"]
            if not choices:
                time.sleep(0.5)
                continue
            op = self.rng.choice(choices)
            if op == "create":
                ok, sb = self.timed(op, lambda: Sandbox.create(timeout=900))
                if ok:
                    self.running[sb.sandbox_id] = sb
                continue
            if op == "resume":
                sid = self.paused.pop(self.rng.randrange(len(self.paused)))
                ok, sb = self.timed(op, lambda: Sandbox.connect(sid, timeout=900))  # noqa: B023
                if not ok:
                    self.paused.append(sid)  # still paused (the error says why): tried again later
                else:
                    self.running[sid] = sb
                    want = self.written.get(sid)
                    if want is not None and sb.files.read(MARK) != want:
                        self.errors.append(f"resume: {sid} lost its file across the pause")
                continue
            sid = self.rng.choice(list(self.running))
            sb = self.running[sid]
            if op == "command":
                ok, r = self.timed(op, lambda: sb.commands.run("echo $((6*7))"))  # noqa: B023
                if ok and r.stdout != "42\n":
                    self.errors.append(f"command: {sid} printed {r.stdout!r}")
            elif op == "file":
                text = f"{sid} {self.ops}"

                def write_read() -> str:
                    sb.files.write(MARK, text)  # noqa: B023
                    return sb.files.read(MARK)  # noqa: B023

                ok, got = self.timed(op, write_read)
                if ok and got == text:
                    self.written[sid] = text
                elif ok:
                    self.errors.append(f"file: {sid} read back {got!r}, not {text!r}")
            elif op == "pause":
                if self.timed(op, sb.pause)[0]:
                    self.running.pop(sid)
                    self.paused.append(sid)
            elif op == "snapshot":
                self.timed(op, lambda: self.node.api().post(f"/sandboxes/{sid}/snapshots", json={})  # noqa: B023
                           .raise_for_status())
            elif op == "fork":
                _, children = self.timed(op, lambda: sb.fork(count=1))  # noqa: B023
                for child in children or []:
                    if isinstance(child, Exception):
                        self.errors.append(f"fork child: {type(child).__name__}: {str(child)[:300]}")
                        continue
                    self.running[child.sandbox_id] = child
                    if sid in self.written:
                        self.written[child.sandbox_id] = self.written[sid]
            elif op == "kill":
                if self.timed(op, sb.kill)[0]:
                    self.running.pop(sid)
                    self.written.pop(sid, None)

    def owned(self) -> list[str]:
        return [*self.running, *self.paused]


def node_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def leaks(node: BenchNode) -> dict[str, Any]:
    """What the node left that it should not have, once every sandbox is killed (empty lists: nothing)."""
    state = str(node.state_dir)
    vmms = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if state.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and int(pid) != node.proc.pid:
                vmms.append(int(pid))
        except OSError:
            pass
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    slots = [n for n in netns if n.startswith(f"aenv-{_slot_tag(node)}-")]
    mounts = [ln for ln in Path("/proc/self/mounts").read_text().splitlines() if state in ln]
    loops = [ln for ln in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout.splitlines()
             if state in ln]
    run_dir = node.state_dir / "run"
    runs = sorted(p.name for p in run_dir.iterdir() if p.is_dir()) if run_dir.exists() else []
    uppers = sorted(str(p) for p in (node.state_dir / "sandboxes").glob("*/upper"))
    temps = sorted(str(p) for p in node.state_dir.rglob("*")
                   if p.name.endswith((".tmp", ".part")) or p.name.startswith(".tmp-"))
    rows = node.sql("SELECT id, state FROM sandboxes WHERE state != 'killed'")
    slot_rows = node.sql("SELECT count(*) FROM network_slots")[0][0]
    return {
        "vmm_processes": vmms,
        # (the pool keeps up to twice its size of slots given back, for reuse: net/pool.py)
        "network_namespaces_beyond_the_warm_pool": slots[2 * WARM_SLOTS:],
        "mounts": mounts, "loop_devices": loops, "run_directories": runs, "uppers": uppers,
        "temporary_files": temps, "sandbox_rows_not_killed": rows,
        "network_slot_rows_beyond_the_warm_pool": max(0, slot_rows - 2 * WARM_SLOTS),
    }


def _slot_tag(node: BenchNode) -> str:
    """The tag in the names of this node's network namespaces (the node's own rule, from its config)."""
    from aenv_node.cli._common import build_config
    from aenv_node.runtime.parts import node_tag

    return node_tag(build_config(None, node.state_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-live", type=int, default=6, help="running sandboxes at most (2 cores: TCG guests)")
    ap.add_argument("--max-ops", type=int, default=5000, help="operations per client at most")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=result_path("soak"))
    args = ap.parse_args()

    with sigterm_as_interrupt(), run_node(extra_env={"AENV_NET_WARM_SLOTS": str(WARM_SLOTS),
                                                     "AENV_SANDBOX_FORK_MAX_COUNT": "4"}) as node:
        for k, v in node.sdk_env().items():
            os.environ[k] = v
        live = lambda: node.sql("SELECT count(*) FROM sandboxes WHERE state IN "  # noqa: E731
                                "('creating','running','resuming','forking','snapshotting','pausing')")[0][0]
        rss: list[tuple[float, int]] = [(0.0, node_rss_kib(node.proc.pid))]
        t0 = time.monotonic()
        deadline = t0 + args.duration
        clients = [Client(i, node, args, deadline, live) for i in range(args.clients)]
        for c in clients:
            c.start()
        while any(c.is_alive() for c in clients):
            time.sleep(5)
            node.check_alive()
            rss.append((time.monotonic() - t0, node_rss_kib(node.proc.pid)))
            done = sum(c.ops for c in clients)
            print(f"[{time.monotonic() - t0:5.0f}s] {done} ops, {live()} live, {sum(len(c.errors) for c in clients)} "
                  f"errors, node RSS {rss[-1][1] // 1024} MiB", flush=True)
        for c in clients:
            c.join(timeout=300)
        elapsed = time.monotonic() - t0

        # the end: every sandbox killed through the API, then the node must hold nothing of them
        with node.api() as api:
            for c in clients:
                for sid in c.owned():
                    r = api.delete(f"/sandboxes/{sid}")
                    if r.status_code not in (204, 404):
                        c.errors.append(f"final kill: {sid}: {r.status_code} {r.text[:200]}")
        settle = time.monotonic() + 60
        left = leaks(node)
        while any(left.values()) and time.monotonic() < settle:
            time.sleep(2)
            left = leaks(node)
        rss.append((time.monotonic() - t0, node_rss_kib(node.proc.pid)))

    latency = {op: {"n": len(v), "p50_ms": ms(pct(v, 50)), "p90_ms": ms(pct(v, 90)), "p99_ms": ms(pct(v, 99)),
                    "max_ms": ms(max(v))}
               for op in sorted({op for c in clients for op in c.latency})
               for v in [[x for c in clients for x in c.latency[op]]]}
    errors = [e for c in clients for e in c.errors]
    samples = [kib for _, kib in rss]
    q = max(1, len(samples) // 4)
    drift = statistics.median(samples[-q:]) / statistics.median(samples[q:2 * q] or samples[:q])
    result = {
        "when": utc_now(), "duration_s": round(elapsed, 1), "clients": args.clients, "max_live": args.max_live,
        "seed": args.seed, "operations": sum(c.ops for c in clients), "latency": latency,
        "errors": errors, "leaks": left, "node_rss_kib": rss, "rss_drift": round(drift, 3),
        "load_avg": os.getloadavg(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for op, s in latency.items():
        print(f"{op:9s} n={s['n']:4d} p50 {s['p50_ms']:8.1f} ms  p90 {s['p90_ms']:8.1f} ms  "
              f"p99 {s['p99_ms']:8.1f} ms  max {s['max_ms']:8.1f} ms")
    for e in errors[:20]:
        print("error:", e)
    leaked = {k: v for k, v in left.items() if v}
    print(f"soak: {result['operations']} ops by {args.clients} clients in {elapsed:.0f} s; {len(errors)} errors; "
          f"leaks: {leaked or 'none'}; node RSS {samples[1] // 1024} -> {samples[-1] // 1024} MiB "
          f"(drift {drift:.2f}x)")
    sys.exit(1 if errors or leaked else 0)


if __name__ == "__main__":
    main()
