#!/usr/bin/env python3
"""In-process throughput of the layered image versus os.pread/os.pwrite on a plain file, plus seal and
compaction times.

Measured in one run, same machine, files in the page cache (what the frontends see on a warm node).  Each
comparison alternates rounds of os.pread/os.pwrite on a plain file (the floor) and of the Image, and reports the
median per-round ratio (the machine is shared; separate measurements drift by 2x):
- base:      Image.pread served by one imported base layer (checksum-verified reads);
- upper:     Image.pread / pwrite served by the writable upper;
- 10layers:  Image.pread over a 10-layer stack + upper (fragmented index);
- zstd:      Image.pread over a zstd-compressed compacted layer.
Jobs: 4 KiB random (1 and 4 threads) and 1 MiB sequential.  Then: seal of a 64 MiB upper, compaction of a
10-layer chain, materialize of the stack into a flat file.

Usage: .venv/bin/python bench/storage_image.py [--size-mib 256] [--seconds 1.5] [--profile]
Writes bench/results/storage_image.json; the last line printed is a one-line summary with ratios to raw.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_node.storage import FlatFileDevice, Image, import_raw, materialize  # noqa: E402
from _results import result_path  # noqa: E402

BLOCK = 4096
MiB = 1 << 20


def timed_loop(fn, offsets, seconds: float) -> float:
    """Ops per second of fn(off) over offsets, repeated for about ``seconds``."""
    n = 0
    t0 = time.perf_counter()
    deadline = t0 + seconds
    while True:
        for off in offsets:
            fn(off)
        n += len(offsets)
        t = time.perf_counter()
        if t >= deadline:
            return n / (t - t0)


def threaded(fn, offsets, seconds: float, threads: int) -> float:
    """Aggregate ops/s of ``threads`` OS threads each running fn over its share of offsets (a QD-n client)."""
    import threading

    rates = [0.0] * threads

    def worker(i: int) -> None:
        rates[i] = timed_loop(fn, offsets[i::threads], seconds)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(rates)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=1.5)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir under /var/tmp)")
    args = ap.parse_args()
    size = args.size_mib * MiB
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-storage-", dir=args.dir or "/var/tmp"))
    res: dict[str, float] = {}
    try:
        layers_dir = work / "layers"
        layers_dir.mkdir()
        raw = work / "disk.raw"
        with open(raw, "wb") as f:
            for _ in range(size // (16 * MiB)):
                f.write(os.urandom(16 * MiB))
        fd = os.open(raw, os.O_RDWR)
        rnd = random.Random(1)
        offs4k = [rnd.randrange(size // BLOCK) * BLOCK for _ in range(20000)]
        offs1m = list(range(0, size, MiB))
        buf4k, buf1m = os.urandom(BLOCK), os.urandom(MiB)
        S = args.seconds

        ratios: dict[str, float] = {}

        def pair(name: str, raw_fn, img_fn, offs, nbytes: int, threads: int = 1, rounds: int = 5) -> None:
            """Alternate raw and image rounds; the median of per-round ratios resists the shared machine's
            drift far better than two separate measurements."""
            per, raws, imgs = [], [], []
            for _ in range(rounds):
                if threads > 1:
                    r, i = threaded(raw_fn, offs, S / rounds, threads), threaded(img_fn, offs, S / rounds, threads)
                else:
                    r, i = timed_loop(raw_fn, offs, S / rounds), timed_loop(img_fn, offs, S / rounds)
                raws.append(r)
                imgs.append(i)
                per.append(i / r)
            per.sort()
            ratios[name] = per[len(per) // 2]
            res[name + "_ratio"] = ratios[name]
            res[name + "_raw_iops"] = max(raws)
            res[name + "_image_iops"] = max(imgs)
            print(f"{name:28s} raw {max(raws):9.0f} op/s  image {max(imgs):9.0f} op/s  "
                  f"({max(imgs) * nbytes / 1e6:7.1f} MB/s)  median ratio {ratios[name]:.2f}", flush=True)

        def rate(name: str, fn, offs, nbytes: int, threads: int = 1) -> None:
            # best of 3 short rounds: the machine is shared, the best round is the least disturbed one
            ops = max(threaded(fn, offs, S / 3, threads) if threads > 1 else timed_loop(fn, offs, S / 3)
                      for _ in range(3))
            res[name + "_iops"] = ops
            res[name + "_MBps"] = ops * nbytes / 1e6
            print(f"{name:28s} {ops:10.0f} op/s {ops * nbytes / 1e6:9.1f} MB/s", flush=True)

        rate("raw_read_4k", lambda o: os.pread(fd, BLOCK, o), offs4k, BLOCK)
        rate("raw_read_1m", lambda o: os.pread(fd, MiB, o), offs1m, MiB)
        rate("raw_write_4k", lambda o: os.pwrite(fd, buf4k, o), offs4k, BLOCK)
        rate("raw_write_1m", lambda o: os.pwrite(fd, buf1m, o), offs1m, MiB)
        flat = FlatFileDevice(raw)
        rate("flat_read_4k", lambda o: flat.pread(o, BLOCK), offs4k, BLOCK)
        flat.close()

        t = time.perf_counter()
        base = import_raw(raw, layers_dir)
        res["import_s"] = time.perf_counter() - t
        print(f"import {args.size_mib} MiB raw: {res['import_s'] * 1000:.0f} ms", flush=True)
        img = Image.open([base.path], work / "up1", fsync=False)
        raw_r4 = lambda o: os.pread(fd, BLOCK, o)  # noqa: E731
        raw_r1m = lambda o: os.pread(fd, MiB, o)  # noqa: E731
        pair("read_4k_base", raw_r4, lambda o: img.pread(o, BLOCK), offs4k, BLOCK)
        pair("read_4k_base_4threads", raw_r4, lambda o: img.pread(o, BLOCK), offs4k, BLOCK, threads=4)
        pair("read_1m_base", raw_r1m, lambda o: img.pread(o, MiB), offs1m, MiB)
        pair("write_4k_upper", lambda o: os.pwrite(fd, buf4k, o), lambda o: img.pwrite(o, buf4k), offs4k, BLOCK)
        pair("read_4k_upper", raw_r4, lambda o: img.pread(o, BLOCK), offs4k, BLOCK)
        pair("write_1m_upper", lambda o: os.pwrite(fd, buf1m, o), lambda o: img.pwrite(o, buf1m), offs1m, MiB)
        pair("read_1m_upper", raw_r1m, lambda o: img.pread(o, MiB), offs1m, MiB)
        img.close()

        # seal of a 64 MiB upper (fresh image, 64 MiB of 64 KiB random writes)
        img = Image.open([base.path], work / "up2", fsync=True)
        chunk = os.urandom(64 * 1024)
        for o in rnd.sample(range(0, size, 64 * 1024), min(size, 64 * MiB) // (64 * 1024)):
            img.pwrite(o, chunk)
        img.flush()
        t = time.perf_counter()
        img.seal(layers_dir)
        res["seal_64mib_ms"] = (time.perf_counter() - t) * 1000
        print(f"seal of a 64 MiB upper: {res['seal_64mib_ms']:.0f} ms", flush=True)
        # build a 10-layer chain: 9 more layers of 8 MiB random 4-64 KiB writes each
        for _ in range(9):
            for _ in range(256):
                n = rnd.randrange(1, 17) * BLOCK
                img.pwrite(rnd.randrange(0, size - n) // BLOCK * BLOCK, os.urandom(n))
            img.seal(layers_dir)
        for _ in range(200):
            img.pwrite(rnd.randrange(0, size - BLOCK) // BLOCK * BLOCK, buf4k)
        res["chain_layers"] = len(img.layers)
        res["chain_runs"] = len(img._gen.starts)
        pair("read_4k_10layers", raw_r4, lambda o: img.pread(o, BLOCK), offs4k, BLOCK)
        pair("read_1m_10layers", raw_r1m, lambda o: img.pread(o, MiB), offs1m, MiB)
        if args.profile:
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            for o in offs4k:
                img.pread(o, BLOCK)
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(12)
        t = time.perf_counter()
        flat_mem = work / "flat.mem"
        st = materialize(img.layers, flat_mem)
        res["materialize_ms"] = (time.perf_counter() - t) * 1000
        print(f"materialize {len(img.layers)} layers ({args.size_mib} MiB): {res['materialize_ms']:.0f} ms "
              f"({sorted(st.methods)})", flush=True)
        t = time.perf_counter()
        img.compact(1, 11, layers_dir)
        res["compact_10_ms"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        img.compact(0, 2, layers_dir, compression="zstd")
        res["compact_base_zstd_ms"] = (time.perf_counter() - t) * 1000
        print(f"compaction of the 10 upper layers: {res['compact_10_ms']:.0f} ms; base+that, zstd: "
              f"{res['compact_base_zstd_ms']:.0f} ms", flush=True)
        pair("read_4k_zstd_layer", raw_r4, lambda o: img.pread(o, BLOCK), offs4k, BLOCK)
        img.close()
        os.close(fd)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    out = result_path("storage_image")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    r = res
    print(
        f"storage_image (Image/os ratio, median of alternating rounds): 4k read base {r['read_4k_base_ratio']:.2f} "
        f"(4 threads {r['read_4k_base_4threads_ratio']:.2f}), upper {r['read_4k_upper_ratio']:.2f}, "
        f"10 layers {r['read_4k_10layers_ratio']:.2f}, zstd {r['read_4k_zstd_layer_ratio']:.2f}; "
        f"1m read base {r['read_1m_base_ratio']:.2f}, upper {r['read_1m_upper_ratio']:.2f}; "
        f"4k write {r['write_4k_upper_ratio']:.2f}, 1m write {r['write_1m_upper_ratio']:.2f}; "
        f"seal 64MiB {r['seal_64mib_ms']:.0f} ms; compact 10 layers {r['compact_10_ms']:.0f} ms; "
        f"materialize {r['materialize_ms']:.0f} ms"
    )


if __name__ == "__main__":
    main()
