"""The warm pool, index allocation, and orphan cleanup after a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import trio

from aenv_node.net import (
    EgressPolicy,
    MemoryIndexAllocator,
    NetworkConfig,
    PoolExhausted,
    Slot,
    SlotError,
    SlotPool,
    create_slot,
    list_slots,
    remove_orphans,
)

from .conftest import Lab


def _indexes(found) -> list[int]:
    return [f.index for f in found if f.netns and f.host_veth]


def _egress_rules(slot: Slot) -> str:
    return subprocess.run([*slot.nsenter_argv(), "nft", "list", "chain", "inet", "aenv", "egress_user"],
                          capture_output=True, text=True, check=True).stdout


async def test_pool_fills_acquire_release_and_cleans_up(lab: Lab) -> None:
    cfg = lab.config()
    alloc = MemoryIndexAllocator(cfg.capacity, in_use={0})  # 0 is taken by someone else
    async with SlotPool(cfg, alloc, size=2) as pool:
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            await pool.wait_ready()
            assert pool.ready == 2
            assert _indexes(await list_slots(cfg)) == [1, 2]

            a = await pool.acquire()
            assert a.index in (1, 2)
            await pool.wait_ready()  # the refiller replaced it
            assert pool.ready == 2 and alloc.taken == {0, 1, 2, 3}

            # with a policy: applied before the slot is handed out
            b = await pool.acquire(EgressPolicy.from_e2b(allow_internet_access=False))
            assert "drop" in _egress_rules(b)
            await pool.wait_ready()
            assert {s.index for s in pool.leased} == {a.index, b.index}

            # release while fewer than 2 * size are idle: reset and kept, the default policy put back on the
            # slot acquired with another and on one whose policy was replaced while leased
            c = await pool.acquire()
            await pool.wait_ready()
            await pool.set_egress(c, EgressPolicy.from_e2b(allow_internet_access=False))
            assert "drop" in _egress_rules(c)
            for slot in (c, b):
                await pool.release(slot)
                assert slot.index in _indexes(await list_slots(cfg)) and slot.index in alloc.taken
                assert "drop" not in _egress_rules(slot)
            assert pool.ready == 4

            # release into a pool with 2 * size idle: destroyed and its index freed
            await pool.release(a)
            assert a.index not in _indexes(await list_slots(cfg)) and a.index not in alloc.taken
            assert pool.ready == 4
            with pytest.raises(SlotError):
                await pool.release(a)  # not leased any more
            with pytest.raises(SlotError):
                await pool.set_egress(a, EgressPolicy())
            leased = await pool.acquire()
            nursery.cancel_scope.cancel()
        made = _indexes(await list_slots(cfg))
        assert leased.index in made and len(made) >= 3
    # leaving the pool destroyed every slot it made, leased ones included, and freed the indexes
    assert await list_slots(cfg) == []
    assert alloc.taken == {0}


async def test_acquire_from_empty_pool_builds_a_slot(lab: Lab) -> None:
    cfg = lab.config()
    async with SlotPool(cfg, MemoryIndexAllocator(cfg.capacity), size=0) as pool:
        slot = await pool.acquire()
        assert _indexes(await list_slots(cfg)) == [slot.index]
        await pool.release(slot)  # size 0: destroyed
        assert await list_slots(cfg) == []


async def test_pool_exhaustion_is_reported_and_refiller_survives(lab: Lab) -> None:
    cfg = lab.config()
    alloc = MemoryIndexAllocator(2)
    async with SlotPool(cfg, alloc, size=3, retry_delay=0.05) as pool:
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            await pool.wait_ready(2)
            await trio.sleep(0.2)  # the refiller keeps failing on the third, without dying
            assert pool.ready == 2
            await pool.acquire()
            await pool.acquire()
            with pytest.raises(PoolExhausted):
                await pool.acquire()
            nursery.cancel_scope.cancel()
    assert await list_slots(cfg) == []


async def test_pool_with_simulated_guests_reaches_guest(lab: Lab) -> None:
    cfg = lab.config()
    guests: dict[int, str] = {}

    async def factory(c: NetworkConfig, index: int) -> Slot:
        guests[index] = lab.guest_netns()
        return await create_slot(c, index, test_guest_netns=guests[index])

    async with SlotPool(cfg, MemoryIndexAllocator(cfg.capacity), size=1, factory=factory) as pool:
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            slot = await pool.acquire()
            (port,) = await lab.serve(guests[slot.index], "g")
            assert await lab.connect(None, slot.address, port) == f"g {slot.host_ip}"
            nursery.cancel_scope.cancel()


async def test_orphans_of_a_killed_process_are_removed(lab: Lab) -> None:
    cfg = lab.config()
    # a "node" that builds three slots and is then killed with SIGKILL: no cleanup ran
    script = textwrap.dedent(
        f"""
        import sys, time, trio
        from aenv_node.net import NetworkConfig, create_slot
        cfg = NetworkConfig(node_tag={cfg.node_tag!r}, pool_cidr={cfg.pool_cidr!r})
        async def main():
            for i in (3, 4, 9):
                await create_slot(cfg, i)
            print("ready", flush=True)
            time.sleep(60)
        trio.run(main)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert (await trio.to_thread.run_sync(proc.stdout.readline)).strip() == "ready"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert _indexes(await list_slots(cfg)) == [3, 4, 9]
    # a half-made slot too (a namespace without its veth)
    subprocess.run(["ip", "netns", "add", cfg.netns_name(11)], check=True)
    found = await list_slots(cfg)
    assert [(f.index, f.netns, f.host_veth) for f in found][-1] == (11, True, False)

    # the reconciler keeps what the database says is in use and removes the rest
    removed = await remove_orphans(cfg, keep={4})
    assert removed == [3, 9, 11]
    assert _indexes(await list_slots(cfg)) == [4]
    # the kept slot can be adopted by a pool and is then destroyed with it
    async with SlotPool(cfg, MemoryIndexAllocator(cfg.capacity, in_use={4}), size=0) as pool:
        pool.adopt(cfg.slot(4))
        with pytest.raises(SlotError):
            pool.adopt(cfg.slot(4))
    assert await list_slots(cfg) == []
    await create_slot(cfg, 4)
    # another node's slots (other tag) are never touched
    other = NetworkConfig(node_tag="u" + cfg.node_tag[1:], pool_cidr=cfg.pool_cidr)
    assert await remove_orphans(other) == []
    assert _indexes(await list_slots(cfg)) == [4]
    assert await remove_orphans(cfg) == [4]
    assert await list_slots(cfg) == []
