"""Memory density of idle forked sandboxes: N children of one 512 MiB sandbox, their total PSS and the
overcommit ratio N x 512 MiB / PSS, with where each MiB goes and what each VMM knob buys.

A real node (`aenv-node serve`, fresh state directory, bench/_node.py) builds the `base` template (a Linux
guest under QEMU TCG here). One sandbox is created with the unmodified E2B SDK and runs a command; then its
children are forked in steps so that N = --counts children are alive at once (1, then +3, +12, +48 for
1,4,16,64). The SDK forks at most 20 per call (E2B's limit), so a step of 48 is three forks (20+20+8): every
fork call is one capture of the parent, i.e. one memory image its children share (64 children map 6 images,
each 512 MiB on disk; only the pages the children touch count). After each step every child runs `echo ok`,
then the guests stay idle --settle seconds and the bench reads, for every child's QEMU process (pids from the
node's SQLite, `sandboxes.vmm_pid`), /proc/PID/smaps mapping by mapping (bench/lifecycle.py's pss_breakdown
gives the totals) and splits its PSS into:

  guest RAM, shared   the memory image mapping's file pages (page cache of the image, PSS divides each page by
                      the number of children that map it)
  guest RAM, private  the same mapping's anonymous pages: the child's copy-on-write copies (pages its guest
                      wrote since the restore). With KSM, merged copies are shared again but still counted here
                      in full (per-mapping smaps has no Pss_Anon): compare guest RAM totals there
  QEMU own            everything else, grouped by mapping: the TCG translation cache (the anonymous rwx
                      mapping of tb-size MiB), [heap], other anonymous memory (glibc arenas of the vCPU and
                      I/O threads, thread stacks, device buffers), QEMU's binary and the shared libraries.

Per step: total PSS, per-child MiB, the overcommit ratio N x memory / total PSS, the memory images' page cache
(fincore: resident pages, mapped or not; the mapped ones are already in the PSS), the node's own processes
(control plane and data plane PSS), load average, and the latency of `echo ok` and of a small Python command
in a few children after the idle settle (what a smaller translation cache costs shows there).

Variants (--variants, each its own node run, at --variant-counts children):
  default   the node's defaults (vmm.tcg_tb_size_restore_mb = 16, free page reporting on, KSM off)
  tbN       vmm.tcg_tb_size_restore_mb = N (restored sandboxes' TCG translation cache, MiB)
  ksm       vmm.ksm = true: guest RAM marked mergeable (`merge=on`), the node sets /sys/kernel/mm/ksm/run = 1;
            the bench makes ksmd scan faster (pages_to_scan) while it measures, waits for two full scans
            after the settle, and restores run = 0 and pages_to_scan when it ends (whatever happens)
  nofpr     vmm.free_page_reporting = false (no virtio-balloon device at all)
  onecap    each step forks all its children from one capture of the parent (one memory image), through the
            node's own API with `sandbox.fork_max_count` raised: the SDK's cap of 20 per call does not apply
  A '+' joins variants (e.g. tb4+ksm). The node has no balloon inflation API: the balloon device exists only
  to carry free page reporting (aenv_node/snapshot/machine.py), so there is no "balloon" variant beyond nofpr.

Capacity knobs the node needs for 64 children on this 2-CPU host: none limits memory or CPU overcommit on a
lone node (the scheduler's overcommit ratio is a cluster placement filter); `sandbox.fork_max_count` (20) and
the SDK's own 20 cap one fork call, and `net.warm_slots` is set above the largest count so children take
prepared network slots.

Writes bench/results/density.json (merged per variant, so variants run separately land in one file), prints a
table. --smoke: counts 1,2, no variants, 3 s settle, stored as variant "smoke".

Run: flock /tmp/aenv-vm.lock .venv/bin/python bench/density.py [--counts 1,4,16,64] [--variants default]
     flock /tmp/aenv-vm.lock .venv/bin/python bench/density.py --variants tb4,ksm --variant-counts 16
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._node import BenchNode, run_node, sigterm_as_interrupt  # noqa: E402
from bench._results import result_path  # noqa: E402
from bench._stats import ms, pct, utc_now  # noqa: E402
from bench.lifecycle import (  # noqa: E402
    GUEST_PYTHON,
    SANDBOX_TIMEOUT_S,
    SDK_REQUEST_TIMEOUT_S,
    create_sandbox,
    kill_all,
    loadavg,
    mib,
    node_sid,
    pss_breakdown,
    run_ok,
)

SDK_FORK_MAX = 20  # the E2B SDK refuses a larger count (validate_fork_count)
KSM = Path("/sys/kernel/mm/ksm")
PY_CMD = f"{GUEST_PYTHON} -c 'import json, re; print(len(json.dumps(list(range(20000)))))'"

VARIANT_ENV: dict[str, dict[str, str]] = {
    "default": {},
    "ksm": {"AENV_VMM_KSM": "true"},
    "nofpr": {"AENV_VMM_FREE_PAGE_REPORTING": "false"},
}


def variant_env(name: str) -> dict[str, str]:
    env: dict[str, str] = {}
    for part in name.split("+"):
        if part.startswith("tb") and part[2:].isdigit():
            env["AENV_VMM_TCG_TB_SIZE_RESTORE_MB"] = part[2:]
        elif part in VARIANT_ENV:
            env.update(VARIANT_ENV[part])
        elif part not in ("smoke", "onecap"):
            raise SystemExit(f"unknown variant {part!r} (default, tbN, ksm, nofpr, onecap; joined with '+')")
    return env


# ---- where each MiB goes -----------------------------------------------------------------------------------


def smaps_mappings(pid: int) -> list[dict[str, Any]]:
    """/proc/PID/smaps, one dict per mapping: range, perms, path, and its kB fields (as bytes)."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if not head:
                continue
            if not head[0].endswith(":"):  # "start-end perms offset dev inode [path]"
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = {"size": hi - lo, "perms": head[1], "path": " ".join(head[5:]) if len(head) > 5 else ""}
                out.append(cur)
            elif cur is not None and len(head) >= 3 and head[2] == "kB":
                cur[head[0][:-1]] = int(head[1]) * 1024
    return out


CATEGORIES = ("guest_ram_shared", "guest_ram_private", "tcg_tb_cache", "heap", "anon_other", "qemu_binary",
              "libs", "other")


def category(m: dict[str, Any], image: str) -> str:
    path = m["path"]
    if path == image:
        return "guest_ram"
    if not path:
        return "tcg_tb_cache" if "x" in m["perms"] else "anon_other"
    if path == "[heap]":
        return "heap"
    if os.path.basename(path).startswith("qemu-system"):
        return "qemu_binary"
    if ".so" in os.path.basename(path):
        return "libs"
    if path == "[stack]":
        return "anon_other"
    return "other"


def breakdown(pid: int, image: str) -> dict[str, int]:
    """PSS of one VMM by category (bytes); guest RAM split into its file (shared image) and anon (COW) part."""
    cats = dict.fromkeys(CATEGORIES, 0)
    for m in smaps_mappings(pid):
        c = category(m, image)
        if c == "guest_ram":
            # per-mapping smaps has no Pss_Anon: the anonymous pages of this private file mapping are the
            # COW copies, each mapped by this process alone (PSS = size), unless KSM merged them
            private = min(m.get("Anonymous", 0), m.get("Pss", 0))
            cats["guest_ram_private"] += private
            cats["guest_ram_shared"] += m.get("Pss", 0) - private
        else:
            cats[c] += m.get("Pss", 0)
    return cats


def top_mappings(pid: int, image: str, n: int = 15) -> list[dict[str, Any]]:
    """The mappings of one VMM with the most PSS (for the deep dive)."""
    ms_ = sorted(smaps_mappings(pid), key=lambda m: -m.get("Pss", 0))[:n]
    return [{"category": category(m, image), "path": m["path"] or "(anonymous)", "perms": m["perms"],
             "size_mib": mib(m["size"]), "rss_mib": mib(m.get("Rss", 0)), "pss_mib": mib(m.get("Pss", 0)),
             "anon_mib": mib(m.get("Anonymous", 0))} for m in ms_]  # fmt: skip


def anon_other_detail(pid: int, image: str) -> dict[str, Any]:
    """QEMU's other anonymous memory by mapping size: glibc arenas reserve 64 MiB regions, thread stacks 8 MiB."""
    groups: dict[str, list[int]] = {}
    for m in smaps_mappings(pid):
        if category(m, image) != "anon_other" or not m.get("Pss"):
            continue
        size = m["size"]
        key = ("arena-sized (<= 64 MiB, > 8 MiB)" if 8 << 20 < size <= 64 << 20 else
               "stack-sized (8 MiB)" if size in (8 << 20, (8 << 20) + 4096) else
               "larger than 64 MiB" if size > 64 << 20 else "smaller than 8 MiB")  # fmt: skip
        groups.setdefault(key, []).append(m["Pss"])
    return {k: {"mappings": len(v), "pss_mib": mib(sum(v))} for k, v in groups.items()}


def proc_pss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def resident_bytes(path: str) -> int | None:
    """Page cache the file holds (fincore), mapped or not."""
    try:
        out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", path], capture_output=True, text=True, timeout=30)
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def ksm_stats() -> dict[str, int]:
    keys = ("pages_shared", "pages_sharing", "pages_unshared", "full_scans", "general_profit", "ksm_zero_pages")
    out = {}
    for k in keys:
        with contextlib.suppress(OSError, ValueError):
            out[k] = int((KSM / k).read_text())
    return out


@contextlib.contextmanager
def ksm_scan_fast(enabled: bool, pages_to_scan: int = 4000) -> Iterator[None]:
    """While inside: ksmd scans `pages_to_scan` pages per wake-up. Afterwards run = 0 and the old rate, always."""
    if not enabled:
        yield
        return
    old = (KSM / "pages_to_scan").read_text().strip()
    try:
        (KSM / "pages_to_scan").write_text(str(pages_to_scan))
        yield
    finally:
        (KSM / "run").write_text("0")
        (KSM / "pages_to_scan").write_text(old)


def wait_ksm_scans(scans: int, timeout_s: float) -> dict[str, Any]:
    start = ksm_stats().get("full_scans", 0)
    t = time.monotonic()
    while time.monotonic() - t < timeout_s and ksm_stats().get("full_scans", 0) < start + scans:
        time.sleep(1)
    return {"waited_s": round(time.monotonic() - t, 1), "full_scans": ksm_stats().get("full_scans", 0) - start}


# ---- one measurement ---------------------------------------------------------------------------------------


def measure(node: BenchNode, children: list[Any], parent_id: str, mem_mib: int, deep: bool) -> dict[str, Any]:
    ids = [node_sid(c.sandbox_id) for c in children]
    rows = node.sql("SELECT s.id, s.vmm_pid, sn.memory_location FROM sandboxes s JOIN snapshots sn"
                    " ON sn.id = s.snapshot_id WHERE s.id IN (%s)" % ",".join("?" * len(ids)), tuple(ids))
    per, errors = [], []
    for sid, pid, image in rows:
        if not pid:
            errors.append(f"{sid}: no vmm_pid")
            continue
        try:
            per.append({"sandbox_id": sid, "pid": pid, "image": image, **breakdown(pid, image),
                        "_totals": pss_breakdown(pid, image)})
        except OSError as e:
            errors.append(f"{sid}: {e}")
    n = len(per)
    total = sum(p["_totals"]["pss"] for p in per)
    cats = {c: sum(p[c] for p in per) for c in CATEGORIES}
    qemu_own = sum(cats[c] for c in CATEGORIES if not c.startswith("guest_ram"))
    images = sorted({p["image"] for p in per})
    image_resident = {img: resident_bytes(img) for img in images}
    # the node's own processes: control plane (the bench's child) and the data plane (the VMMs' parent)
    dataplane = {ppid(p["pid"]) for p in per} - {None}
    parent_rows = node.sql("SELECT vmm_pid FROM sandboxes WHERE id = ?", (node_sid(parent_id),))
    parent_pid = parent_rows[0][0] if parent_rows else None
    one = mem_mib << 20
    out: dict[str, Any] = {
        "children": n, "errors": errors,
        "total_pss_mib": mib(total), "per_child_pss_mib": mib(total / n) if n else None,
        "overcommit_ratio": round(n * one / total, 2) if total else None,
        "by_category_mib": {c: mib(v) for c, v in cats.items()},
        "per_child_by_category_mib": {c: mib(v / n) for c, v in cats.items()} if n else {},
        "qemu_own_mib": mib(qemu_own), "per_child_qemu_own_mib": mib(qemu_own / n) if n else None,
        "pss_check_mib": mib(sum(cats.values())),  # per-mapping sum (== total_pss_mib up to rounding)
        "memory_images": len(images),
        "memory_images_resident_mib": mib(sum(v for v in image_resident.values() if v)),
        "per_child_pss_min_max_mib": [mib(min(p["_totals"]["pss"] for p in per)),
                                      mib(max(p["_totals"]["pss"] for p in per))] if per else None,
        "node_control_plane_pss_mib": mib(proc_pss(node.proc.pid) or 0),
        "node_data_plane_pss_mib": mib(sum(proc_pss(d) or 0 for d in dataplane)),
        "parent_vmm_pss_mib": mib(proc_pss(parent_pid) or 0) if parent_pid else None,
        "loadavg": loadavg(),
    }  # fmt: skip
    if total:
        with_node = total + (proc_pss(node.proc.pid) or 0) + sum(proc_pss(d) or 0 for d in dataplane)
        out["overcommit_ratio_with_node_processes"] = round(n * one / with_node, 2)
    if deep and per:
        p = per[0]
        out["one_child"] = {"pid": p["pid"], "by_category_mib": {c: mib(p[c]) for c in CATEGORIES},
                            "rss_mib": mib(p["_totals"]["rss"]), "pss_mib": mib(p["_totals"]["pss"]),
                            "anon_other_by_size": anon_other_detail(p["pid"], p["image"]),
                            "top_mappings": top_mappings(p["pid"], p["image"])}  # fmt: skip
    return out


def latency(children: list[Any], k: int) -> dict[str, Any]:
    """`echo ok` then a small Python command in k children (sequentially), after the idle settle."""
    echo, py, errs = [], [], []
    for c in children[:k]:
        try:
            echo.append(run_ok(c))
            t = time.perf_counter()
            r = c.commands.run(PY_CMD, request_timeout=120)
            if r.exit_code != 0:
                raise RuntimeError(f"exit {r.exit_code}: {r.stderr[:200]}")
            py.append(time.perf_counter() - t)
        except Exception as e:
            errs.append(f"{c.sandbox_id}: {type(e).__name__}: {e}"[:300])
    d = lambda v: {"p50_ms": ms(pct(v, 50)), "max_ms": ms(max(v)), "n": len(v)} if v else {}  # noqa: E731
    return {"echo": d(echo), "python": d(py), "errors": errs}


# ---- one node run ------------------------------------------------------------------------------------------


def api_fork(node: BenchNode, Sandbox: Any, parent: Any, k: int) -> list[Any]:
    """POST /sandboxes/{id}/fork on the node itself (no SDK cap of 20): k children of one capture."""
    with node.api() as c:
        r = c.post(f"/sandboxes/{node_sid(parent.sandbox_id)}/fork", json={"count": k, "timeout": SANDBOX_TIMEOUT_S},
                   timeout=SDK_REQUEST_TIMEOUT_S)
    r.raise_for_status()
    out: list[Any] = []
    for item in r.json():
        if "sandbox" in item:
            out.append(Sandbox.connect(item["sandbox"]["sandboxID"], timeout=SANDBOX_TIMEOUT_S))
        else:
            out.append(RuntimeError(json.dumps(item.get("error"))))
    return out


def fork_batch(node: BenchNode, Sandbox: Any, parent: Any, n: int, per_call: int
               ) -> tuple[list[Any], list[str], list[float]]:
    """Fork n children, at most per_call per call (each call is one capture of the parent): through the SDK
    (which takes at most 20), or the node's API for more."""
    kids, errors, call_ms = [], [], []
    while n > 0:
        k = min(n, per_call)
        t = time.perf_counter()
        if k > SDK_FORK_MAX:
            res = api_fork(node, Sandbox, parent, k)
        else:
            res = parent.fork(count=k, timeout=SANDBOX_TIMEOUT_S, request_timeout=SDK_REQUEST_TIMEOUT_S)
        call_ms.append(ms(time.perf_counter() - t))
        kids += [c for c in res if not isinstance(c, Exception)]
        errors += [f"{type(c).__name__}: {c}"[:300] for c in res if isinstance(c, Exception)]
        n -= k
    return kids, errors, call_ms


def run_variant(name: str, counts: list[int], args: argparse.Namespace) -> dict[str, Any]:
    env = {"AENV_NET_WARM_SLOTS": str(max(counts) + 4),
           "AENV_SANDBOX_DEFAULT_MEMORY_MB": str(args.mem_mib), **variant_env(name)}
    ksm = env.get("AENV_VMM_KSM") == "true"
    per_call = SDK_FORK_MAX
    if "onecap" in name.split("+"):  # each step one capture: the node's fork_max_count raised, its API called
        per_call = max(counts)
        env["AENV_SANDBOX_FORK_MAX_COUNT"] = str(per_call)
    out: dict[str, Any] = {"started_at": utc_now(), "counts": counts, "env": env, "settle_s": args.settle,
                           "loadavg_at_start": loadavg(), "steps": []}
    print(f"== variant {name}: {env}", flush=True)
    with ksm_scan_fast(ksm), run_node(extra_env=env) as node:
        print(f"node up: template base ready {node.template_ready_s:.1f} s", flush=True)
        out["template_ready_s"] = round(node.template_ready_s, 1)
        os.environ.update(node.sdk_env())
        from e2b import Sandbox

        parent = create_sandbox(Sandbox)
        children: list[Any] = []
        try:
            run_ok(parent)
            for n in counts:
                add = n - len(children)
                if add <= 0:
                    continue
                t = time.perf_counter()
                kids, errors, call_ms = fork_batch(node, Sandbox, parent, add, per_call)
                fork_s = time.perf_counter() - t
                children += kids
                ran = 0
                for c in kids:
                    try:
                        run_ok(c)
                        ran += 1
                    except Exception as e:
                        errors.append(f"command in {c.sandbox_id}: {type(e).__name__}: {e}"[:300])
                print(f"  +{add} children in {fork_s:.1f} s ({len(kids)} running, {ran} ran a command); "
                      f"settling {args.settle:.0f} s", flush=True)  # fmt: skip
                time.sleep(args.settle)
                step: dict[str, Any] = {"n": len(children), "forked": add, "fork_s": round(fork_s, 2),
                                        "fork_calls_ms": call_ms, "ran_command": ran, "errors": errors}
                if ksm:
                    step["ksm_wait"] = wait_ksm_scans(2, args.ksm_timeout)
                    step["ksm"] = ksm_stats()
                step["pss"] = measure(node, children, parent.sandbox_id, args.mem_mib, deep=True)
                step["latency_after_settle"] = latency(children, args.latency_children)
                if ksm:
                    step["ksm_after_latency"] = ksm_stats()
                out["steps"].append(step)
                p = step["pss"]
                print(f"  N={p['children']:3}: total PSS {p['total_pss_mib']} MiB, {p['per_child_pss_mib']} MiB/child"
                      f" (image shared {p['per_child_by_category_mib'].get('guest_ram_shared')}, private "
                      f"{p['per_child_by_category_mib'].get('guest_ram_private')}, QEMU own "
                      f"{p['per_child_qemu_own_mib']}), overcommit {p['overcommit_ratio']}x; echo p50 "
                      f"{step['latency_after_settle']['echo'].get('p50_ms')} ms, python p50 "
                      f"{step['latency_after_settle']['python'].get('p50_ms')} ms", flush=True)  # fmt: skip
        finally:
            try:
                kill_all(Sandbox, children)
            except Exception as e:
                print(f"  killing children failed: {e}", flush=True)
            with contextlib.suppress(Exception):
                parent.kill()
    out["finished_at"] = utc_now()
    return out


# ---- report ------------------------------------------------------------------------------------------------


def table(results: dict[str, Any]) -> str:
    # with KSM the shared/private split of guest RAM is not exact (merged pages count as private): read the total
    rows = ["| variant | N | total PSS MiB | MiB/child | guest RAM | image shared | private COW | QEMU own | TB cache "
            "| heap | anon other | libs+bin | overcommit | echo p50 ms | python p50 ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in results.get("variants", {}).items():
        for s in v.get("steps", []):
            p, c = s["pss"], s["pss"].get("per_child_by_category_mib", {})
            lat = s.get("latency_after_settle", {})
            rows.append(
                f"| {name} | {p['children']} | {p['total_pss_mib']} | {p['per_child_pss_mib']} | "
                f"{round((c.get('guest_ram_shared') or 0) + (c.get('guest_ram_private') or 0), 1)} | "
                f"{c.get('guest_ram_shared')} | {c.get('guest_ram_private')} | {p['per_child_qemu_own_mib']} | "
                f"{c.get('tcg_tb_cache')} | {c.get('heap')} | {c.get('anon_other')} | "
                f"{round((c.get('libs') or 0) + (c.get('qemu_binary') or 0) + (c.get('other') or 0), 1)} | "
                f"{p['overcommit_ratio']}x | {lat.get('echo', {}).get('p50_ms')} | "
                f"{lat.get('python', {}).get('p50_ms')} |")  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="1,4,16,64", help="children alive at each step (default variant)")
    ap.add_argument("--variants", default="default", help="comma list: default, tbN, ksm, nofpr, a+b; '' none")
    ap.add_argument("--variant-counts", default="16", help="counts for variants other than 'default'")
    ap.add_argument("--settle", type=float, default=20.0, help="idle seconds after a step before measuring")
    ap.add_argument("--ksm-timeout", type=float, default=180.0, help="longest wait for KSM's two full scans")
    ap.add_argument("--latency-children", type=int, default=3, help="children timed after the settle")
    ap.add_argument("--mem-mib", type=int, default=512)
    ap.add_argument("--smoke", action="store_true", help="counts 1,2, no variants, 3 s settle (variant 'smoke')")
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/density.json (bench/_results.py)")
    args = ap.parse_args()
    if args.out is None:  # a smoke run's figures go beside, not into, the real ones
        args.out = result_path("density", smoke=args.smoke)
    counts = [int(x) for x in args.counts.split(",") if x.strip()]
    vcounts = [int(x) for x in args.variant_counts.split(",") if x.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.smoke:
        counts, variants, args.settle = [1, 2], ["smoke"], 3.0
    results: dict[str, Any] = {}
    if args.out.exists():
        with contextlib.suppress(ValueError):
            results = json.loads(args.out.read_text())
    results.setdefault("variants", {})
    results["host"] = {"cpus": os.cpu_count(), "note": "2 shared cores; QEMU TCG guests (no usable KVM)"}
    with sigterm_as_interrupt():
        for name in variants:
            cs = counts if name in ("default", "smoke") else vcounts
            try:
                results["variants"][name] = run_variant(name, cs, args)
            except Exception as e:
                results["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:1000], "at": utc_now()}
                print(f"variant {name} FAILED: {e}", flush=True)
            results["updated_at"] = utc_now()
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(table(results))
    best = [(s["pss"]["overcommit_ratio"], n, s["pss"]["children"]) for n, v in results["variants"].items()
            for s in v.get("steps", []) if s["pss"].get("overcommit_ratio")]
    if best:
        r, n, k = max(best, key=lambda x: (x[2], x[0]))
        print(f"density: {k} children, best overcommit {r}x ({n}); goal > 10x at 64: "
              f"{'met' if k >= 64 and r > 10 else 'not met' if k >= 64 else 'not measured at 64'}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted: node stopped", file=sys.stderr)
        sys.exit(130)
