"""Local disk use of a sandbox paused and resumed N times, with the garbage collector (snapshot/gc.py).

A real node (bench/_node.py, fresh state directory, the `base` template: 512 MiB guest under QEMU TCG) runs
one sandbox with a background writer (a 16 MiB file rewritten from /dev/urandom each cycle, and a counter).
Then N x (`sandbox.pause()` -> `Sandbox.connect(id)`), through the unmodified E2B SDK. After each cycle
(once the collection the pause asked for has run) it records what the state directory holds on disk
(allocated bytes, `du`-like: sparse files count what they hold) in `snapshots/` and `layers/`.

Without a collector nothing is ever deleted, so what the node would hold without one is exactly what it
holds now plus everything the collector removed (`events` rows with operation 'gc', detail.bytes_freed).
The floor is what one paused sandbox must keep: the template's files plus the newest pause snapshot's
directory and the layers it stacks (measured in the same run, at the end).

Writes bench/results/gc_disk.json; the last line printed is a one-line summary.

Run: .venv/bin/python bench/gc_disk.py [--cycles 20]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._node import run_node, sigterm_as_interrupt
from bench._stats import utc_now
from _results import result_path  # noqa: E402

WRITER = ("nohup bash -c 'i=0; while true; do i=$((i+1)); echo $i > /home/user/counter; sleep 0.5; done'"
          " >/dev/null 2>&1 &")


def allocated(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for n in files:
            try:
                total += os.lstat(os.path.join(root, n)).st_blocks * 512
            except OSError:
                pass
    return total


def mib(n: int) -> float:
    return round(n / 2**20, 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=20)
    args = ap.parse_args()
    with sigterm_as_interrupt(), run_node() as node:
        for k, v in node.sdk_env().items():
            os.environ[k] = v
        from e2b import Sandbox

        sb = Sandbox.create(timeout=3600)
        sb.commands.run(WRITER)
        state = node.state_dir
        rows = []
        baseline = allocated(state / "snapshots") + allocated(state / "layers")
        for i in range(args.cycles):
            sb.commands.run("head -c 16777216 /dev/urandom > /home/user/blob")
            before = len(node.sql("SELECT id FROM events WHERE operation = 'gc'"))
            sb.pause()
            if i > 0:  # from the second pause on, the previous pause snapshot is garbage
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and \
                        len(node.sql("SELECT id FROM events WHERE operation = 'gc'")) <= before:
                    time.sleep(0.2)
            held = allocated(state / "snapshots") + allocated(state / "layers")
            freed = sum(json.loads(d)["bytes_freed"] for (d,) in
                        node.sql("SELECT detail FROM events WHERE operation = 'gc'"))
            rows.append({"cycle": i + 1, "held_bytes": held, "freed_bytes": freed,
                         "without_gc_bytes": held + freed,
                         "snapshot_dirs": len(list((state / "snapshots").iterdir())),
                         "layer_files": len(list((state / "layers").glob("*.layer")))})
            print(f"cycle {i + 1:3d}: held {mib(held):8.1f} MiB, without gc {mib(held + freed):8.1f} MiB, "
                  f"{rows[-1]['snapshot_dirs']} snapshot dirs, {rows[-1]['layer_files']} layer files", flush=True)
            sb = Sandbox.connect(sb.sandbox_id)
        sb.pause()
        snap = node.sql(f"SELECT snapshot_id FROM sandboxes WHERE id = '{sb.sandbox_id}'")[0][0]
        time.sleep(2)
        keep = {Path(loc) for (loc,) in node.sql(
            "SELECT l.local_path FROM snapshot_layers sl JOIN layers l ON l.digest = sl.layer_digest "
            f"WHERE sl.snapshot_id = '{snap}' OR sl.snapshot_id IN (SELECT boot_snapshot_id FROM templates)")}
        tmpl = [s for (s,) in node.sql("SELECT boot_snapshot_id FROM templates")]
        floor = sum(os.lstat(p).st_blocks * 512 for p in keep if p.exists()) + \
            sum(allocated(state / "snapshots" / s) for s in [snap, *tmpl])
        held = allocated(state / "snapshots") + allocated(state / "layers")
        freed = sum(json.loads(d)["bytes_freed"] for (d,) in
                    node.sql("SELECT detail FROM events WHERE operation = 'gc'"))
        Sandbox.kill(sb.sandbox_id)
        out = {"at": utc_now(), "cycles": args.cycles, "baseline_bytes": baseline, "per_cycle": rows,
               "final": {"held_bytes": held, "without_gc_bytes": held + freed, "floor_bytes": floor}}
        dest = result_path("gc_disk")
        dest.write_text(json.dumps(out, indent=2) + "\n")
        print(f"gc_disk: after {args.cycles} pause/resume cycles the node holds {mib(held)} MiB "
              f"(without gc {mib(held + freed)} MiB, {(held + freed) / max(held, 1):.1f}x); floor (template + "
              f"newest pause snapshot) {mib(floor)} MiB, held/floor {held / max(floor, 1):.2f}x")


if __name__ == "__main__":
    main()
