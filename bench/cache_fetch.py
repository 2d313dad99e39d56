"""Benchmark: reads of a repository layer through the local cache (cold and warm) against raw floors.

For each backend (posix_fs; S3 on a moto server; S3 on s3rver when installed by scripts/setup.d/55-s3rver.sh)
it measures, on the same layer bytes:

* floor_local: a plain ``pread`` of the same bytes from a local file (the layer before upload);
* floor_repo: the repository's own ``read_range`` of the same ranges, no cache;
* cold: reads through an empty cache (each miss fetches 256 KiB chunks, contiguous misses coalesced);
* warm: the same reads again (all hits; sequential: best of 3, as is the local floor);
* small: random reads with a cache of 1/8 of the layer (eviction running), hit ratio.

Sequential reads are 1 MiB; random reads are 4 KiB.  Ratios are cache / floor (lower is better).  moto copies the
whole object on each ranged GET, so its absolute numbers mostly measure moto; s3rver is closer to a real store.
Results go to bench/results/cache_fetch.json; the last line printed is a one-line summary.

    .venv/bin/python bench/cache_fetch.py [--size-mib 128] [--random-reads 1000]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aenv_node.storage.cache import CHUNK_SIZE, LayerCache  # noqa: E402
from aenv_node.storage.repository import PosixFsRepository, Repository  # noqa: E402
from aenv_node.storage.repository.s3 import S3Repository  # noqa: E402
from _results import result_path  # noqa: E402

MiB = 1024 * 1024
SEQ = 1 * MiB
RND = 4096
S3RVER = Path(sys.prefix) / "s3rver" / "node_modules" / ".bin" / "s3rver"


class Server:
    """An S3-compatible server subprocess on a free loopback port, owned (and killed by PID) by this script."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.data_dir = tempfile.mkdtemp(prefix=f"bench-{kind}-") if kind == "s3rver" else None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        if kind == "moto":
            exe = Path(sys.executable).with_name("moto_server")
            cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
            cmd += ["-H", "127.0.0.1", "-p", str(self.port)]
            self.key = "testing"
        else:
            cmd = [str(S3RVER), "-d", str(self.data_dir), "-a", "127.0.0.1", "-p", str(self.port), "-s",
                   "--no-vhost-buckets"]
            self.key = "S3RVER"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"{kind} server did not start") from None
                time.sleep(0.1)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.data_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def lat_reads(read: Callable[[int, int], bytes], offsets: list[int], n: int) -> dict[str, float]:
    lat = []
    for off in offsets:
        t = time.perf_counter()
        read(off, n)
        lat.append(time.perf_counter() - t)
    lat.sort()
    return {
        "p50_us": round(statistics.median(lat) * 1e6, 1),
        "p99_us": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6, 1),
        "mean_us": round(statistics.fmean(lat) * 1e6, 1),
    }


def seq_read(read: Callable[[int, int], bytes], size: int) -> None:
    for off in range(0, size, SEQ):
        read(off, SEQ)


def bench_backend(name: str, repo: Repository, digest: str, local: Path, size: int, tmp: Path,
                  n_random: int, check: bytes) -> dict[str, Any]:
    rnd = random.Random(7)
    # one read per distinct 256 KiB chunk, so every cold random read is a miss
    chunks = rnd.sample(range(size // CHUNK_SIZE), min(n_random, size // CHUNK_SIZE))
    offsets = [c * CHUNK_SIZE + rnd.randrange(0, CHUNK_SIZE // RND) * RND for c in chunks]
    n_random = len(offsets)
    res: dict[str, Any] = {"backend": name, "random_reads": n_random}
    fd = os.open(local, os.O_RDONLY)
    try:
        local_read = lambda o, n: os.pread(fd, n, o)  # noqa: E731
        seq_read(local_read, size)  # page cache warm: the floor is memory speed, the strictest comparison
        res["floor_local_seq_s"] = min(timed(lambda: seq_read(local_read, size)) for _ in range(3))
        res["floor_local_rnd"] = lat_reads(local_read, offsets, RND)
    finally:
        os.close(fd)
    res["floor_repo_seq_s"] = timed(lambda: seq_read(lambda o, n: repo.read_range(digest, o, n), size))
    res["floor_repo_rnd"] = lat_reads(lambda o, n: repo.read_range(digest, o, n), offsets, RND)

    cdir = tmp / f"cache-{name}"
    with LayerCache(cdir, repo, capacity_bytes=2 * size, max_fetch_bytes=4 * MiB) as cache:
        src = cache.source(digest, size)
        res["cold_seq_s"] = timed(lambda: seq_read(src.pread, size))
        res["warm_seq_s"] = min(timed(lambda: seq_read(src.pread, size)) for _ in range(3))  # best of 3: shared CPU
        assert hashlib.sha256(b"".join(src.pread(o, SEQ) for o in range(0, size, SEQ))).digest() == check
        res["seq_fetches"] = cache.stats().fetches
    shutil.rmtree(cdir)
    with LayerCache(cdir, repo, capacity_bytes=2 * size) as cache:
        src = cache.source(digest, size)
        res["cold_rnd"] = lat_reads(src.pread, offsets, RND)
        res["warm_rnd"] = lat_reads(src.pread, offsets, RND)
    shutil.rmtree(cdir)
    with LayerCache(cdir, repo, capacity_bytes=size // 8) as cache:
        src = cache.source(digest, size)
        # a skewed workload (80% of reads on 10% of the layer), as a guest's hot set would be
        mix = [
            rnd.randrange(0, (size // 10 if rnd.random() < 0.8 else size) - RND) & ~(RND - 1) for _ in range(2 * n_random)
        ]
        t = timed(lambda: [src.pread(o, RND) for o in mix])
        s = cache.stats()
        res["small_cache"] = {
            "capacity_bytes": size // 8,
            "reads": len(mix),
            "mean_us": round(t / len(mix) * 1e6, 1),
            "hit_ratio": round(s.hits / max(1, s.hits + s.misses), 3),
            "fetched_mib": round(s.fetched_bytes / MiB, 1),
            "evicted_mib": round(s.evicted_bytes / MiB, 1),
        }
    shutil.rmtree(cdir)
    mb = size / MiB
    res["throughput_mib_s"] = {
        k: round(mb / res[f"{k}_seq_s"], 1) for k in ("floor_local", "floor_repo", "cold", "warm")
    }
    res["ratios"] = {
        "cold_seq_vs_repo": round(res["cold_seq_s"] / res["floor_repo_seq_s"], 2),
        "warm_seq_vs_local": round(res["warm_seq_s"] / res["floor_local_seq_s"], 2),
        "cold_rnd_vs_repo_p50": round(res["cold_rnd"]["p50_us"] / res["floor_repo_rnd"]["p50_us"], 2),
        "warm_rnd_vs_local_p50": round(res["warm_rnd"]["p50_us"] / res["floor_local_rnd"]["p50_us"], 2),
    }
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mib", type=int, default=128)
    ap.add_argument("--random-reads", type=int, default=1000)
    ap.add_argument("--moto-random-reads", type=int, default=100, help="moto is slow per GET; fewer reads there")
    ap.add_argument("--backends", default="posix_fs,s3-moto,s3-s3rver")
    args = ap.parse_args()
    size = args.size_mib * MiB
    tmp = Path(tempfile.mkdtemp(prefix="bench-cache-", dir=os.environ.get("TMPDIR")))
    results: list[dict[str, Any]] = []
    servers: list[Server] = []
    try:
        data = random.Random(1).randbytes(size)
        check = hashlib.sha256(data).digest()
        digest = "sha256:" + check.hex()
        local = tmp / "layer"
        local.write_bytes(data)
        del data
        for backend in args.backends.split(","):
            if backend == "s3-s3rver" and not S3RVER.exists():
                print(f"{backend}: skipped (s3rver not installed: scripts/setup.d/55-s3rver.sh)")
                continue
            if backend == "posix_fs":
                repo: Repository = PosixFsRepository(tmp / "repo")
                n = args.random_reads
            else:
                srv = Server(backend.split("-", 1)[1])
                servers.append(srv)
                repo = S3Repository(bucket=f"bench-{uuid.uuid4().hex[:8]}", region="us-east-1",
                                    endpoint_url=srv.endpoint, access_key_id=srv.key, secret_access_key=srv.key)
                repo.ensure_bucket()
                n = args.moto_random_reads if srv.kind == "moto" else args.random_reads
            t_put = timed(lambda r=repo: r.put_layer(digest, local))
            r = bench_backend(backend, repo, digest, local, size, tmp, n, check)
            r["put_s"] = round(t_put, 3)
            results.append(r)
            tp, ra = r["throughput_mib_s"], r["ratios"]
            print(
                f"{backend:10s} put {t_put:6.2f}s | seq MiB/s local {tp['floor_local']:8.1f} repo {tp['floor_repo']:7.1f}"
                f" cold {tp['cold']:7.1f} warm {tp['warm']:8.1f} | 4K p50 us: local {r['floor_local_rnd']['p50_us']}"
                f" repo {r['floor_repo_rnd']['p50_us']} cold {r['cold_rnd']['p50_us']} warm {r['warm_rnd']['p50_us']}"
                f" | small cache hit {r['small_cache']['hit_ratio']} | ratios {ra}"
            )
            repo.close()
    finally:
        for s in servers:
            s.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"layer_mib": args.size_mib, "chunk_kib": 256, "seq_read_kib": SEQ // 1024, "rnd_read_b": RND,
           "backends": results, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result_path("cache_fetch").write_text(json.dumps(out, indent=2))
    summary = "; ".join(
        f"{r['backend']}: cold seq {r['throughput_mib_s']['cold']} MiB/s ({r['ratios']['cold_seq_vs_repo']}x repo),"
        f" warm seq {r['throughput_mib_s']['warm']} MiB/s ({r['ratios']['warm_seq_vs_local']}x local file),"
        f" warm 4K p50 {r['warm_rnd']['p50_us']}us ({r['ratios']['warm_rnd_vs_local_p50']}x local)"
        for r in results
    )
    print(f"cache_fetch {args.size_mib} MiB layer: {summary}")


if __name__ == "__main__":
    main()
