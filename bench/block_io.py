#!/usr/bin/env python3
"""Block I/O through the frontends versus the raw file, measured with fio in one run.

Jobs: 4 KiB random read at QD1 and QD32, 4 KiB random write at QD32, 1 MiB sequential read at QD8.
Targets (same fio, same file, same run; every server is up for the whole run and the targets are interleaved
job by job, ``--rounds`` times, reporting medians, so load from other processes hits them alike):
- raw:        fio ioengine=io_uring on the backing file (buffered, page-cached: the floor any frontend adds to)
- raw-direct: the same with O_DIRECT (what the host disk itself costs; context only)
- nbd:        fio ioengine=nbd (libnbd) against ``serve_nbd`` over the device (thread engine, the default)
- nbd-trio:   the same with the all-Trio engine
- qemu-nbd:   the same fio nbd engine against Debian's qemu-nbd serving the file (a C NBD server, for context)
- fuse:       fio ioengine=io_uring, O_DIRECT, on the file exported by ``mount_fuse`` (how QEMU cache=none or
              an O_DIRECT VMM reads it; the export is FOPEN_DIRECT_IO, so there is no FUSE page cache either way)
- fuse-buffered: the same without O_DIRECT (io_uring then serialises buffered writes to one inode in io-wq)
The device is a FlatFileDevice on the file, or with ``--device image`` an Image (the file imported as a base
layer + a fresh upper).

Ratios are IOPS of each target / IOPS of ``raw`` for the same job. We also report CPU time per I/O: the
client's (fio, including libnbd for nbd; no server can remove it) and the server's (this process for
nbd/fuse, /proc/PID/stat for qemu-nbd). Unlike IOPS these barely depend on what else the 2-core machine runs.

Usage: .venv/bin/python bench/block_io.py [--size-mib 256] [--runtime 4] [--rounds 3] [--targets raw,nbd,...]
       [--device flat|image] [--profile]
Writes bench/results/block_io.json; the last line printed is a one-line summary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from aenv_node.storage import FlatFileDevice  # noqa: E402
from aenv_node.storage.frontends import mount_fuse, serve_nbd  # noqa: E402
from _results import result_path  # noqa: E402

JOBS = {
    "randread-4k-qd1": dict(rw="randread", bs="4k", iodepth=1),
    "randread-4k-qd32": dict(rw="randread", bs="4k", iodepth=32),
    "randwrite-4k-qd32": dict(rw="randwrite", bs="4k", iodepth=32),
    "seqread-1m-qd8": dict(rw="read", bs="1m", iodepth=8),
}
ALL_TARGETS = ["raw", "raw-direct", "nbd", "nbd-trio", "qemu-nbd", "fuse", "fuse-buffered"]


async def fio(target_args: list[str], job: dict, runtime: float, size: int) -> dict:
    argv = [
        "fio", "--name=bench", "--output-format=json", "--time_based", f"--runtime={runtime}",
        "--ramp_time=0.5", f"--size={size}", "--randrepeat=0", "--norandommap",
        f"--rw={job['rw']}", f"--bs={job['bs']}", f"--iodepth={job['iodepth']}",
        *target_args,
    ]
    proc = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"fio failed: {' '.join(argv)}\n{proc.stderr.decode()}\n{proc.stdout.decode()[-2000:]}")
    out = proc.stdout.decode()
    data = json.loads(out[out.index("{"):])  # the nbd engine prints a line before the JSON
    j = data["jobs"][0]
    side = j["read"] if job["rw"] in ("read", "randread") else j["write"]
    iops = side["iops"]
    return {
        "iops": iops,
        "MiB_s": side["bw_bytes"] / 2**20,
        "lat_us_mean": side["lat_ns"]["mean"] / 1000,
        "client_cpu_us_per_io": (j["usr_cpu"] + j["sys_cpu"]) / 100 / iops * 1e6 if iops else None,
    }


def self_cpu() -> float:
    """CPU seconds used by this process (all threads): the in-process servers' cost."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def pid_cpu(pid: int) -> Callable[[], float]:
    def probe() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    return probe


class Target:
    def __init__(self, name: str, args: list[str], cpu: Callable[[], float] | None = None) -> None:
        self.name, self.args, self.cpu = name, args, cpu


async def measure(t: Target, job: dict, runtime: float, size: int) -> dict:
    before = t.cpu() if t.cpu else 0.0
    start = time.monotonic()
    r = await fio(t.args, job, runtime, size)
    if t.cpu:
        ios = r["iops"] * (time.monotonic() - start)  # fio's whole life, ramp and setup included: an upper bound
        r["server_cpu_us_per_io"] = (t.cpu() - before) / ios * 1e6 if ios else None
    return r


def file_args(path: str, direct: bool = False) -> list[str]:
    return ["--ioengine=io_uring", f"--filename={path}", "--invalidate=0", f"--direct={1 if direct else 0}"]


def nbd_args(uri: str) -> list[str]:
    return ["--ioengine=nbd", f"--uri={uri}"]


async def profile_nbd(uri: str, runtime: float, size: int) -> Path:
    """py-spy record this process (all threads) during one NBD randread QD32 run."""
    spy = shutil.which("py-spy") or str(ROOT / ".venv/bin/py-spy")
    out = result_path("block_io_nbd_profile", ".speedscope.json")
    proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--duration", str(int(runtime)),
                             "--format", "speedscope", "-o", str(out), "--nonblocking", "--threads"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await fio(nbd_args(uri), JOBS["randread-4k-qd32"], runtime, size)
    finally:
        await trio.to_thread.run_sync(proc.wait)
    return out


def summarize(samples: list[dict]) -> dict:
    out: dict = {}
    for key in samples[0]:
        vals = [s[key] for s in samples if s.get(key) is not None]
        out[key] = round(statistics.median(vals), 2) if vals else None
    out["iops_all_rounds"] = [round(s["iops"]) for s in samples]
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--runtime", type=float, default=4.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--targets", default=",".join(ALL_TARGETS))
    ap.add_argument("--jobs", default=",".join(JOBS))
    ap.add_argument("--dir", default=None, help="work directory (default: a new one under /var/tmp)")
    ap.add_argument("--fuse-threads", type=int, default=2)
    ap.add_argument("--device", choices=["flat", "image"], default="flat",
                    help="what the frontends serve: FlatFileDevice on the file, or an Image (base layer + upper)")
    ap.add_argument("--profile", action="store_true", help="py-spy record the NBD randread QD32 job")
    ap.add_argument("--out", default=str(result_path("block_io")))
    a = ap.parse_args()
    wanted = a.targets.split(",")
    jobs = {k: v for k, v in JOBS.items() if k in a.jobs.split(",")}
    size = a.size_mib * 2**20
    work = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="aenv-blockio-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    sockdir = Path(tempfile.mkdtemp(prefix="aenv-bio-", dir="/tmp"))
    img = work / "disk.img"
    samples: dict[str, dict[str, list[dict]]] = {}
    load_before = os.getloadavg()
    try:
        with open(img, "wb") as f:  # incompressible contents, fully allocated, then in page cache
            for _ in range(a.size_mib):
                f.write(os.urandom(2**20))
        fio_version = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
        print(f"file {img} ({a.size_mib} MiB), {fio_version}, {a.runtime}s per job, {a.rounds} rounds, "
              f"device {a.device}, load {load_before[0]:.1f}", flush=True)
        async with AsyncExitStack() as stack:
            if a.device == "image":
                from aenv_node.storage import Image, import_raw

                (work / "layers").mkdir(exist_ok=True)
                info = import_raw(img, work / "layers")
                dev = stack.enter_context(Image.open([info.path], work / "upper"))
            else:
                dev = stack.enter_context(FlatFileDevice(img))
            targets: list[Target] = []
            if "raw" in wanted:
                targets.append(Target("raw", file_args(str(img))))
            if "raw-direct" in wanted:
                targets.append(Target("raw-direct", file_args(str(img), direct=True)))
            for engine, name in (("thread", "nbd"), ("trio", "nbd-trio")):
                if name in wanted:
                    server = await stack.enter_async_context(serve_nbd(dev, sockdir / f"{name}.sock", engine=engine))
                    targets.append(Target(name, nbd_args(server.uri), self_cpu))
            if "qemu-nbd" in wanted:
                sock = sockdir / "qemu-nbd.sock"
                qproc = subprocess.Popen(["qemu-nbd", "-f", "raw", "-t", "-e", "8", "--cache=writeback", "-k",
                                          str(sock), str(img)])

                def stop_qemu_nbd() -> None:
                    qproc.terminate()
                    qproc.wait()

                stack.callback(stop_qemu_nbd)
                for _ in range(100):
                    if sock.exists():
                        break
                    await trio.sleep(0.05)
                targets.append(Target("qemu-nbd", nbd_args(f"nbd+unix:///?socket={sock}"), pid_cpu(qproc.pid)))
            fuse_names = [t for t in ("fuse", "fuse-buffered") if t in wanted]
            if fuse_names:
                mnt = work / "mnt"
                mnt.mkdir(exist_ok=True)
                fs = await stack.enter_async_context(mount_fuse({"disk.img": dev}, mnt, threads=a.fuse_threads))
                for t in fuse_names:
                    targets.append(Target(t, file_args(str(fs.path("disk.img")), direct=t == "fuse"), self_cpu))

            for rnd in range(a.rounds):
                for job_name, job in jobs.items():
                    for t in targets:
                        r = await measure(t, job, a.runtime, size)
                        samples.setdefault(job_name, {}).setdefault(t.name, []).append(r)
                        cpu = f"client {r['client_cpu_us_per_io']:.1f}" if r.get("client_cpu_us_per_io") else ""
                        if r.get("server_cpu_us_per_io"):
                            cpu += f" server {r['server_cpu_us_per_io']:.1f}"
                        print(f"  r{rnd} {job_name:18s} {t.name:13s} {r['iops']:>9.0f} IOPS {r['MiB_s']:>7.0f} MiB/s "
                              f"lat {r['lat_us_mean']:>7.1f} us  CPU/IO us: {cpu}", flush=True)
            if a.profile and "nbd" in wanted:
                uri = next(t for t in targets if t.name == "nbd").args[1].split("=", 1)[1]
                print(f"  profile written to {await profile_nbd(uri, a.runtime, size)}")
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)

    results: dict = {}
    for job_name, per in samples.items():
        results[job_name] = {name: summarize(s) for name, s in per.items()}
        base = results[job_name].get("raw", {}).get("iops")
        for r in results[job_name].values():
            if base:
                r["ratio_to_raw"] = round(r["iops"] / base, 3)
    doc = {
        "bench": "block_io",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "size_mib": a.size_mib,
        "runtime_s": a.runtime,
        "rounds": a.rounds,
        "device": "Image(base layer + upper)" if a.device == "image" else "FlatFileDevice",
        "fio": fio_version,
        "cpus": os.cpu_count(),
        "loadavg_before_after": [load_before, os.getloadavg()],
        "note": "medians over rounds; *_cpu_us_per_io = CPU time per I/O of the client (fio) and of the server",
        "results": results,
    }
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print()
    print(f"{'job':18s} {'target':13s} {'IOPS':>9s} {'x raw':>6s} {'client us':>9s} {'server us':>9s}")
    for job_name, per in results.items():
        for name, r in per.items():
            ratio = f"{r['ratio_to_raw']:.2f}" if "ratio_to_raw" in r else "-"
            cl = f"{r['client_cpu_us_per_io']:.1f}" if r.get("client_cpu_us_per_io") else "-"
            sv = f"{r['server_cpu_us_per_io']:.1f}" if r.get("server_cpu_us_per_io") else "-"
            print(f"{job_name:18s} {name:13s} {r['iops']:>9.0f} {ratio:>6s} {cl:>9s} {sv:>9s}")
    parts = []
    for job_name, per in results.items():
        for name in ("nbd", "fuse"):
            if name in per and "ratio_to_raw" in per[name]:
                parts.append(f"{name} {job_name} {per[name]['iops']:.0f} IOPS ({per[name]['ratio_to_raw']:.2f}x raw)")
    print("block_io: " + "; ".join(parts))


if __name__ == "__main__":
    trio.run(main)
