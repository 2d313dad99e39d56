"""Plots for docs/benchmarks.md from the JSON the bench scripts wrote (bench/results/), with matplotlib.

  lifecycle.png  bench/lifecycle.py: each node operation beside its raw floor from the same run (log scale)
  kvmhost.png    bench/kvmhost.py: node / raw VMM per operation, Firecracker and QEMU with KVM, nested
  soak.png       bench/soak.py: the node's RSS over the run, and p50/p90/p99 per operation
  create.png     bench/sandbox_create.py: the distribution of create and first-command latencies, and creates
                 per minute against the number of concurrent clients
  density.png    bench/density.py: memory per forked child against the number of children, part by part

A plot is skipped (and said so) when its JSON is missing. Needs the ``bench`` extra:
``.venv/bin/pip install -e '.[bench]'``.

Run: .venv/bin/python bench/plot.py [--results DIR] [--img DIR]   (default: bench/results, docs/img; bench/run
calls it after its benches)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
OUT = ROOT / "docs" / "img"


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"  # (set by main)
    if not path.exists():
        print(f"skipped {name}.png: no {path}")
        return None
    return dict(json.loads(path.read_text()))


def _bars(ax: Any, labels: list[str], node: list[float], floor: list[float], floor_name: str) -> None:
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], node, width=0.4, label="node (E2B SDK)")
    ax.bar([x + 0.2 for x in xs], floor, width=0.4, label=floor_name)
    for x, n, f in zip(xs, node, floor):
        ax.annotate(f"{n / f:.1f}x", (x - 0.2, n), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), labels, rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.legend(fontsize=8)


def lifecycle() -> None:
    data = _load("lifecycle")
    if data is None:
        return
    keep = ["idle_pause_vs_diff_capture_plus_image", "heavy_pause_vs_diff_capture_plus_image",
            "idle_resume_vs_restore", "heavy_resume_vs_restore", "idle_snapshot_guest_paused_vs_diff_capture_plus_cont",
            "heavy_snapshot_guest_paused_vs_diff_capture_plus_cont", "fork4_total_vs_concurrent_restores"]
    rows = [(k, data["ratios"][k]) for k in keep if k in data.get("ratios", {})]
    fig, ax = plt.subplots(figsize=(9, 4))
    _bars(ax, [k.replace("_vs_", "\nvs ").replace("_", " ") for k, _ in rows],
          [r["node_p50_ms"] for _, r in rows], [r["floor_p50_ms"] for _, r in rows], "raw QEMU floor")
    ax.set_ylabel("ms (p50, log)")
    ax.set_title(f"Lifecycle under QEMU TCG, node vs floor ({data.get('started_at', '')[:16]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "lifecycle.png", dpi=110)
    print(f"wrote {OUT / 'lifecycle.png'}")


def kvmhost() -> None:
    data = _load("kvmhost")
    if data is None:
        return
    vmms = [v for v in ("firecracker", "qemu") if v in data]
    fig, axes = plt.subplots(1, len(vmms), figsize=(5 * len(vmms), 4), squeeze=False)
    for ax, vmm in zip(axes[0], vmms):
        res, pairs = data[vmm], data["pairs"]
        ops = list(pairs)
        _bars(ax, [f"{op}\nvs raw {pairs[op]}" for op in ops], [res["node_s"][op] * 1000 for op in ops],
              [res["raw_s"][pairs[op]] * 1000 for op in ops], f"raw {vmm}")
        ax.set_ylabel("ms (median, log)")
        ax.set_title(f"{vmm} with KVM in the KVM host VM", fontsize=10)
    fig.suptitle(f"Nested (KVM inside QEMU TCG), {data.get('when', '')[:16]}: compare ratios", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "kvmhost.png", dpi=110)
    print(f"wrote {OUT / 'kvmhost.png'}")


def soak() -> None:
    data = _load("soak")
    if data is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    t = [s for s, _ in data["node_rss_kib"]]
    left.plot(t, [kib / 1024 for _, kib in data["node_rss_kib"]])
    left.set_xlabel("s")
    left.set_ylabel("node RSS (MiB)")
    left.set_ylim(bottom=0)
    left.set_title(f"node RSS, drift {data['rss_drift']}x", fontsize=10)
    ops = list(data["latency"])
    xs = range(len(ops))
    for i, (q, name) in enumerate((("p50_ms", "p50"), ("p90_ms", "p90"), ("p99_ms", "p99"))):
        right.bar([x + (i - 1) * 0.27 for x in xs], [data["latency"][op][q] for op in ops], width=0.27, label=name)
    right.set_xticks(list(xs), [f"{op}\nn={data['latency'][op]['n']}" for op in ops], fontsize=8)
    right.set_ylabel("ms (client side)")
    right.legend(fontsize=8)
    right.set_title(f"{data['operations']} ops, {len(data['errors'])} errors", fontsize=10)
    fig.suptitle(f"Soak: {data['clients']} SDK clients, {data['duration_s']:.0f} s, QEMU TCG ({data['when'][:16]})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "soak.png", dpi=110)
    print(f"wrote {OUT / 'soak.png'}")


def main() -> None:
    global RESULTS, OUT
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--img", type=Path, default=OUT)
    args = ap.parse_args()
    RESULTS, OUT = args.results, args.img
    OUT.mkdir(parents=True, exist_ok=True)
    for draw in PLOTS:
        draw()


def create() -> None:
    data = _load("sandbox_create")
    if data is None:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    samples = data["latency"]["samples"]
    for key, name in (("create_s", "create()"), ("first_cmd_s", "first command"), ("total_s", "both")):
        values = sorted(s[key] for s in samples)  # (the bench names them _s; they are milliseconds)
        left.plot(values, [(i + 1) / len(values) for i in range(len(values))], marker=".", label=name)
    left.set_xlabel("ms")
    left.set_ylabel("fraction of sandboxes")
    left.legend(fontsize=8)
    left.set_title(f"create latency, n={len(samples)} (cumulative)", fontsize=10)
    tp = data["throughput"]
    right.plot([t["clients"] for t in tp], [t["creates_per_min"] for t in tp], marker="o")
    right.set_xlabel("concurrent clients")
    right.set_ylabel("creates per minute")
    right.set_ylim(bottom=0)
    right.set_title("create -> run -> kill cycles", fontsize=10)
    fig.suptitle(f"Sandbox create through the E2B SDK, QEMU TCG ({data['started_at'][:16]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "create.png", dpi=110)
    print(f"wrote {OUT / 'create.png'}")


def density() -> None:
    data = _load("density")
    if data is None:
        return
    variants = data.get("variants", {})
    name = "default" if "default" in variants else "smoke" if "smoke" in variants else None
    steps = [st for st in (variants[name]["steps"] if name else []) if st.get("pss", {}).get("children")]
    if not steps:
        print("skipped density.png: no step with a PSS reading in density.json")
        return
    parts = (("guest_ram_shared", "snapshot image (shared)"), ("guest_ram_private", "guest pages written (private)"),
             ("tcg_tb_cache", "QEMU: TCG translation cache"), ("heap", "QEMU: heap"),
             ("anon_other", "QEMU: other anonymous"), ("qemu_binary", "QEMU: binary"), ("libs", "QEMU: libraries"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = range(len(steps))
    bottom = [0.0] * len(steps)
    for key, label in parts:
        values = [st["pss"]["per_child_by_category_mib"].get(key, 0.0) for st in steps]
        ax.bar(xs, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    for x, st, top in zip(xs, steps, bottom):
        ax.annotate(f"{st['pss']['overcommit_ratio']}x", (x, top), ha="center", va="bottom", fontsize=8)
    ax.axhline(51.2, color="black", linestyle="--", linewidth=0.8, label="10x overcommit of 512 MiB")
    ax.set_xticks(list(xs), [str(st["pss"]["children"]) for st in steps])
    ax.set_xlabel("idle children forked from one 512 MiB sandbox (label: overcommit)")
    ax.set_ylabel("PSS MiB per child")
    ax.legend(fontsize=7)
    ax.set_title(f"Memory per child, variant {name} ({variants[name].get('started_at', '')[:16]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "density.png", dpi=110)
    print(f"wrote {OUT / 'density.png'}")


def control_plane() -> None:
    data = _load("control_plane")
    if data is None:
        return
    node, floor = data["node"], data["floor"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    cs = [p["concurrency"] for p in node]
    left.plot(cs, [p["creates_per_min"] for p in node], marker="o", label="node: create + kill cycles")
    left.plot([f["concurrency"] for f in floor], [f["restores_per_min"] for f in floor], marker="s",
              label="raw Firecracker restores (floor)")
    left.axhline(3300, color="grey", linestyle=":", label="goal: 3,300/min")
    left.set_xlabel("concurrent clients")
    left.set_ylabel("per minute")
    left.set_ylim(bottom=0)
    left.legend(fontsize=8)
    left.set_title("throughput against concurrency", fontsize=10)
    parts = sorted({k for p in node for k in p["node_cpu_ms_per_cycle"]})
    bottom = [0.0] * len(node)
    for part in parts:
        vals = [p["node_cpu_ms_per_cycle"].get(part) or 0.0 for p in node]
        right.bar([str(c) for c in cs], vals, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    right.axhline(15, color="grey", linestyle=":", label="goal: 15 ms per create")
    right.set_xlabel("concurrent clients")
    right.set_ylabel("node CPU ms per create + kill")
    right.legend(fontsize=8)
    right.set_title("the node's CPU per cycle", fontsize=10)
    fig.suptitle(f"Control-plane throughput, Firecracker tiny guest ({data['started'][:16]})", fontsize=10)
    fig.tight_layout()
    fig.savefig(OUT / "control_plane.png", dpi=110)
    print(f"wrote {OUT / 'control_plane.png'}")


PLOTS = (lifecycle, kvmhost, soak, create, density, control_plane)

if __name__ == "__main__":
    main()
