#!/usr/bin/env python3
"""The layered Image behind the NBD frontend versus the same frontend over a flat file, measured with fio.

Targets (same run, same contents):
- raw:   fio io_uring on the plain file (page-cached): the floor;
- flat:  fio nbd engine against serve_nbd(FlatFileDevice(file));
- image: fio nbd engine against serve_nbd(Image([imported base layer], upper)); reads are served by the
         verified base layer (randread) or the upper (randwrite, then reads of written blocks are upper hits).
Jobs: 4 KiB randread QD32, 4 KiB randwrite QD32, 1 MiB sequential read QD8.

Usage: .venv/bin/python bench/image_nbd.py [--size-mib 256] [--runtime 4]
Writes bench/results/image_nbd.json; the last line is a one-line summary (image IOPS / flat and / raw).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_node.storage import FlatFileDevice, Image, import_raw  # noqa: E402
from aenv_node.storage.frontends import serve_nbd  # noqa: E402
from _results import result_path  # noqa: E402

JOBS = {
    "randread-4k-qd32": dict(rw="randread", bs="4k", iodepth=32),
    "randwrite-4k-qd32": dict(rw="randwrite", bs="4k", iodepth=32),
    "seqread-1m-qd8": dict(rw="read", bs="1m", iodepth=8),
}


async def fio(args: list[str], job: dict, runtime: float, size: int) -> float:
    argv = ["fio", "--name=b", "--output-format=json", "--time_based", f"--runtime={runtime}", "--ramp_time=0.5",
            f"--size={size}", "--randrepeat=0", "--norandommap", f"--rw={job['rw']}", f"--bs={job['bs']}",
            f"--iodepth={job['iodepth']}", *args]
    p = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    if p.returncode:
        raise RuntimeError(p.stderr.decode()[-2000:])
    out = p.stdout.decode()
    j = json.loads(out[out.index("{"):])["jobs"][0]
    return (j["read"] if "read" in job["rw"] else j["write"])["iops"]


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--runtime", type=float, default=4.0)
    a = ap.parse_args()
    size = a.size_mib << 20
    work = Path(tempfile.mkdtemp(prefix="aenv-imgnbd-", dir="/var/tmp"))
    sockdir = Path(tempfile.mkdtemp(prefix="aenv-imgnbd-", dir="/tmp"))
    res: dict[str, dict[str, float]] = {}
    try:
        raw = work / "disk.raw"
        with open(raw, "wb") as f:
            for _ in range(a.size_mib):
                f.write(os.urandom(1 << 20))
        (work / "layers").mkdir()
        base = import_raw(raw, work / "layers")
        for job_name, job in JOBS.items():
            res[job_name] = {}
            res[job_name]["raw"] = await fio(["--ioengine=io_uring", f"--filename={raw}", "--invalidate=0"], job,
                                             a.runtime, size)
            flat = FlatFileDevice(raw)
            try:
                async with serve_nbd(flat, sockdir / "flat.sock") as srv:
                    res[job_name]["flat"] = await fio(["--ioengine=nbd", f"--uri={srv.uri}"], job, a.runtime, size)
            finally:
                flat.close()
            img = Image.open([base.path], work / f"upper-{job_name}", fsync=True)
            try:
                async with serve_nbd(img, sockdir / "img.sock") as srv:
                    res[job_name]["image"] = await fio(["--ioengine=nbd", f"--uri={srv.uri}"], job, a.runtime,
                                                       size)
            finally:
                img.close()
            r = res[job_name]
            print(f"{job_name:20s} raw {r['raw']:9.0f}  flat/nbd {r['flat']:9.0f}  image/nbd {r['image']:9.0f} IOPS"
                  f"  image/flat {r['image'] / r['flat']:.2f}  image/raw {r['image'] / r['raw']:.2f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sockdir, ignore_errors=True)
    out = result_path("image_nbd")
    out.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": res},
                              indent=2) + "\n")
    print("image_nbd: " + "; ".join(
        f"{j} image {r['image']:.0f} IOPS = {r['image'] / r['flat']:.2f}x flat-over-nbd, {r['image'] / r['raw']:.2f}x raw"
        for j, r in res.items()))


if __name__ == "__main__":
    trio.run(main)
