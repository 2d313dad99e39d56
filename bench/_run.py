"""The one bench runner: ``bench/run [--smoke] [--list] [NAME...]``.

Runs the named benches (all when none is named) one after another, each as its own process exactly as its
docstring's command line, then draws the plots docs/benchmarks.md shows (``plot.py``). A bench writes its JSON
to ``bench/results/<name>.json`` (``_results.py``); the runner checks that each bench it ran wrote every file it
names, newly, and that the file parses, and exits 1 if any did not, or if any bench exited non-zero.

``--smoke`` runs every bench tiny (one round, a few requests, a small file) with its JSON and the plots in a
directory of their own (``--results``; a new temporary one by default), so CI can show that each bench still
runs end to end and produces its output without replacing the figures the docs quote. A smoke run asserts
no timing. The KVM-host bench is left out of the default smoke set: it brings up a nested VM (minutes before
its first figure); name it to smoke it.

Benches that start VMs (``vm=True``) hold ``/tmp/aenv-vm.lock`` while they run, the lock by which this
machine's VM-heavy jobs take turns on its two cores (not when ``AENV_VM_LOCK_HELD=1``: the caller holds it).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
VM_LOCK = Path("/tmp/aenv-vm.lock")


@dataclass(frozen=True)
class Bench:
    name: str
    #: arguments of a full run (the docs' figures) and of a smoke run
    args: tuple[str, ...] = ()
    smoke: tuple[str, ...] = ()
    #: it starts VMs (holds the VM lock)
    vm: bool = False
    #: the JSON files it writes (names under the results directory); default: ``<name>.json``
    writes: tuple[str, ...] = field(default=())
    #: left out of a smoke run unless named
    smoke_by_default: bool = True

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.writes or (f"{self.name}.json",)


BENCHES: tuple[Bench, ...] = (
    # storage, caches, network: no VM
    Bench("storage_image", smoke=("--size-mib", "16", "--seconds", "0.2")),
    Bench("image_nbd", smoke=("--size-mib", "16", "--runtime", "0.5")),
    Bench("block_io", smoke=("--size-mib", "16", "--runtime", "0.5", "--rounds", "1", "--jobs", "randread-4k-qd1")),
    Bench("cache_fetch", smoke=("--size-mib", "8", "--random-reads", "20", "--moto-random-reads", "5")),
    Bench("p2p", smoke=("8",)),
    Bench("net_slots", smoke=("2",)),
    Bench("scheduler", smoke=("20",)),
    Bench("proxy_overhead", smoke=("--smoke",)),
    # a node on 10,000 paused sandboxes' rows (no VM boots)
    Bench("fleet_state", smoke=("--smoke",)),
    # VMMs with the tiny guest (KVM) and Linux guests (QEMU TCG here)
    Bench("vmm_floor", smoke=("--runs", "1"), vm=True),
    Bench("guest_boot", smoke=("--runs", "1"), vm=True),
    Bench("free_page_reporting", smoke=("--spawns", "2"), vm=True),
    Bench("templates", smoke=("--rounds", "1", "--no-build"), vm=True),
    Bench("sandbox_create", smoke=("-n", "1", "-c", "1", "--tp-count", "1", "--floor-runs", "1"), vm=True),
    Bench("control_plane", args=("--profile",), smoke=("--concurrency", "1", "--seconds", "2", "--floor-seconds", "1"),
          vm=True),
    Bench("lifecycle", smoke=("--runs", "1", "--heavy-runs", "1", "--settle", "0.5", "--heavy-settle", "1",
                              "--forks", "2", "--density-settle", "1", "--floor-runs", "1", "--fork-floor", "2"),
          vm=True),
    Bench("density", smoke=("--smoke",), vm=True),
    Bench("gc_disk", smoke=("--cycles", "2"), vm=True),
    Bench("dataplane", smoke=("--sandboxes", "1", "--rounds", "1", "--write-mib", "1"), vm=True),
    Bench("soak", smoke=("--duration", "20", "--clients", "1", "--max-live", "1"), vm=True),
    Bench("cluster", smoke=("--smoke",), vm=True),
    Bench("p2p_template", smoke=("--nodes", "2", "--file-mib", "4"), vm=True),
    Bench("kvmhost", smoke=("--rounds", "1", "--vmm", "firecracker"), vm=True, smoke_by_default=False),
)
BY_NAME = {b.name: b for b in BENCHES}


@contextmanager
def vm_turn(needed: bool) -> Iterator[None]:
    """Hold the machine's VM lock while a VM-heavy bench runs (unless ``AENV_VM_LOCK_HELD=1`` says that whoever
    started this run holds it for the whole of it: ``AENV_VM_LOCK_HELD=1 flock /tmp/aenv-vm.lock .ci/run``)."""
    if not needed or os.environ.get("AENV_VM_LOCK_HELD") == "1":
        yield
        return
    with open(VM_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_one(bench: Bench, results: Path, smoke: bool) -> tuple[bool, float, str]:
    """(ok, seconds, why not) of one bench run."""
    argv = [sys.executable, str(HERE / f"{bench.name}.py"), *(bench.smoke if smoke else bench.args)]
    env = dict(os.environ, AENV_BENCH_RESULTS=str(results))
    started = time.time()
    print(f"=== {bench.name}: {' '.join(argv[1:])}", flush=True)
    with vm_turn(bench.vm):
        rc = subprocess.run(argv, cwd=ROOT, env=env).returncode
    took = time.time() - started
    if rc != 0:
        return False, took, f"exit code {rc}"
    for name in bench.outputs:
        path = results / name
        if not path.exists() or path.stat().st_mtime < started:
            return False, took, f"it wrote no {path}"
        try:
            json.loads(path.read_text())
        except ValueError as exc:
            return False, took, f"{path} is not JSON: {exc}"
    return True, took, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/run", description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help="benches to run (default: all)")
    ap.add_argument("--smoke", action="store_true", help="each bench tiny; JSON and plots to --results")
    ap.add_argument("--results", type=Path, default=None,
                    help="where the JSON goes (default: bench/results; with --smoke a new temporary directory)")
    ap.add_argument("--img", type=Path, default=None,
                    help="where the plots go (default: docs/img; with --smoke beside the results)")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--list", action="store_true", help="the benches and their arguments")
    args = ap.parse_args(argv)
    if args.list:
        for b in BENCHES:
            print(f"{b.name:20} {'VM ' if b.vm else '   '} full: {' '.join(b.args) or '(defaults)'}; "
                  f"smoke: {' '.join(b.smoke)}{'' if b.smoke_by_default else ' (only when named)'}")
        return 0
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown:
        print(f"bench/run: no bench named {', '.join(unknown)} (bench/run --list)", file=sys.stderr)
        return 2
    chosen = [BY_NAME[n] for n in args.names] if args.names else [
        b for b in BENCHES if b.smoke_by_default or not args.smoke]
    results = args.results or (Path(tempfile.mkdtemp(prefix="aenv-bench-smoke-")) if args.smoke
                               else HERE / "results")
    img = args.img or (results / "img" if args.smoke else ROOT / "docs" / "img")
    results.mkdir(parents=True, exist_ok=True)
    outcome = [(b.name, *run_one(b, results, args.smoke)) for b in chosen]
    failed = [(n, why) for n, ok, _, why in outcome if not ok]
    if not args.no_plots:
        plot = subprocess.run([sys.executable, str(HERE / "plot.py"), "--results", str(results), "--img", str(img)],
                              cwd=ROOT)
        if plot.returncode != 0:
            failed.append(("plots", f"plot.py exit code {plot.returncode}"))
    print(f"\n{'bench':20} {'s':>7}  result")
    for name, ok, took, why in outcome:
        print(f"{name:20} {took:7.1f}  {'ok' if ok else 'FAILED: ' + why}")
    print(f"results in {results}, plots in {img}")
    if failed:
        print(f"bench/run: {len(failed)} failed: {', '.join(n for n, _ in failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
