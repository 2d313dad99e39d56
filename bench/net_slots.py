"""Network slot timings: create, destroy, warm-pool acquire, release (reset / destroy), policy update.

Raw floor measured in the same run: a bare `ip netns add` + `ip netns del` (the least any slot
costs: one namespace, two process spawns). Needs root. Touches only namespaces, links and tables
named with its own tag (`aenv-bnch-*`, `aebnch-*`... see NetworkConfig), removed at the end.

    .venv/bin/python bench/net_slots.py [N]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import trio

from aenv_node.net import (
    EgressPolicy,
    MemoryIndexAllocator,
    NetworkConfig,
    SlotPool,
    create_slot,
    destroy_slot,
    remove_orphans,
)
from aenv_node.net._cmd import run
from _results import result_path  # noqa: E402

N = int(sys.argv[1]) if len(sys.argv) > 1 else 20


def ms(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "median_ms": round(statistics.median(xs) * 1e3, 3),
        "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 3),
        "min_ms": round(xs[0] * 1e3, 3),
        "n": len(xs),
    }


async def timed(fn, *a, **kw) -> float:
    t = time.perf_counter()
    await fn(*a, **kw)
    return time.perf_counter() - t


async def main() -> None:
    cfg = NetworkConfig(node_tag="bnch", pool_cidr="10.254.0.0/22", egress=False)
    res: dict[str, dict[str, float]] = {}
    try:
        floor = []
        for _ in range(N):
            t = time.perf_counter()
            await run(["ip", "netns", "add", "aenv-bnch-floor"])
            await run(["ip", "netns", "del", "aenv-bnch-floor"])
            floor.append(time.perf_counter() - t)
        res["floor_netns_add_del"] = ms(floor)

        create, destroy = [], []
        for i in range(N):
            create.append(await timed(create_slot, cfg, i))
        policy = EgressPolicy.from_e2b(deny_out=["0.0.0.0/0"], allow_out=["198.18.0.1", "1.1.1.0/24:443"])
        upd = []
        slot = cfg.slot(0)
        for _ in range(N):
            upd.append(await timed(slot.apply_egress, policy))
        for i in range(N):
            destroy.append(await timed(destroy_slot, cfg, i))
        res["create_slot"] = ms(create)
        res["destroy_slot"] = ms(destroy)
        res["apply_egress_replace"] = ms(upd)
        res["create_plus_destroy"] = ms([c + d for c, d in zip(create, destroy)])

        acq, acq_pol, rel_keep, rel_destroy = [], [], [], []
        async with SlotPool(cfg, MemoryIndexAllocator(cfg.capacity), size=N) as pool:
            async with trio.open_nursery() as nursery:
                await nursery.start(pool.run)
                await pool.wait_ready()
                slots = []
                for _ in range(N // 2):  # acquire with the pool kept warm
                    t = time.perf_counter()
                    slots.append(await pool.acquire())
                    acq.append(time.perf_counter() - t)
                for s in slots:  # reset and kept (the pool is short)
                    rel_keep.append(await timed(pool.release, s))
                await pool.wait_ready()
                slots = []
                for _ in range(N // 2):  # acquire with a policy: rules added to a fresh slot
                    t = time.perf_counter()
                    slots.append(await pool.acquire(policy))
                    acq_pol.append(time.perf_counter() - t)
                for s in slots:
                    await pool.release(s)
                await pool.wait_ready()
                pool.size = 0
                slots = [await pool.acquire() for _ in range(N // 2)]
                for s in slots:  # destroyed (the pool is full)
                    rel_destroy.append(await timed(pool.release, s))
                nursery.cancel_scope.cancel()
        res["pool_acquire_warm"] = ms(acq)
        res["pool_acquire_warm_with_policy"] = ms(acq_pol)
        res["pool_release_reset_keep"] = ms(rel_keep)
        res["pool_release_destroy"] = ms(rel_destroy)
    finally:
        with trio.CancelScope(shield=True):
            await remove_orphans(cfg)
            await run(["ip", "netns", "del", "aenv-bnch-floor"], ok_if=("No such file",))

    out = result_path("net_slots")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    for k, v in res.items():
        print(f"{k:26s} median {v['median_ms']:8.3f} ms   p90 {v['p90_ms']:8.3f} ms   (n={v['n']})")
    f = res["floor_netns_add_del"]["median_ms"]
    print(
        f"net_slots: create {res['create_slot']['median_ms']:.1f} ms ({res['create_slot']['median_ms'] / f:.1f}x floor), "
        f"destroy {res['destroy_slot']['median_ms']:.1f} ms, create+destroy {res['create_plus_destroy']['median_ms'] / f:.1f}x "
        f"floor {f:.1f} ms (netns add+del); warm acquire {res['pool_acquire_warm']['median_ms'] * 1e3:.0f} us, "
        f"release (reset) {res['pool_release_reset_keep']['median_ms']:.1f} ms, "
        f"with a policy {res['pool_acquire_warm_with_policy']['median_ms']:.1f} ms, "
        f"policy update {res['apply_egress_replace']['median_ms']:.1f} ms"
    )


if __name__ == "__main__":
    trio.run(main)
