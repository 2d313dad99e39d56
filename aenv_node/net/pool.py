"""A warm pool of network slots, so that starting a sandbox never waits for its network.

Creating a slot takes five process spawns and an nftables commit (~22 ms median here); taking
one from the pool is a list pop (~1 us), or ~7 ms with a non-default egress policy to add.
``SlotPool.run`` (the refiller, a task in a nursery the caller owns) keeps at least ``size`` slots
prepared; ``acquire`` takes one (or builds one on the spot when the pool is empty); ``release`` resets a
slot (connection tracking flushed; the default egress policy put back if the sandbox had another) and
keeps it while fewer than ``2 * size`` are idle, else destroys it. The slack between the two bounds is
what keeps a steady create -> kill churn from destroying a slot at every kill while the refiller builds
another for the next create (seven process spawns and two ``network_slots`` writes per sandbox, for
nothing). Leaving the pool's ``async with`` destroys every slot the pool made, idle or leased.

Slot indexes are not chosen here: an ``IndexAllocator`` (the node's is backed by the
``network_slots`` table in SQLite) hands them out and takes them back, so a crash never leaves the
node unsure which addresses are in use. ``MemoryIndexAllocator`` serves tests and tools.

Usage (the nursery must close before the pool, so the refiller is gone when the pool cleans up)::

    async with SlotPool(config, allocator, size=8) as pool:
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)   # returns once the pool is first filled
            slot = await pool.acquire()
            ...
            await pool.release(slot)
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import trio

from .egress import EgressPolicy
from .errors import NetError, PoolExhausted, SlotError
from .slot import NetworkConfig, Slot, create_slot, destroy_slot

__all__ = ["IndexAllocator", "MemoryIndexAllocator", "SlotPool"]

log = logging.getLogger(__name__)

SlotFactory = Callable[[NetworkConfig, int], Awaitable[Slot]]


class IndexAllocator(Protocol):
    """Hands out slot indexes (0 .. config.capacity-1) and takes them back. Persisting which
    indexes are taken is the allocator's business (the node's writes ``network_slots``)."""

    async def allocate(self) -> int:
        """A free index, now taken. Raises PoolExhausted when none is left."""
        ...

    async def free(self, index: int) -> None:
        """Give an index back (its slot has been destroyed)."""
        ...


class MemoryIndexAllocator:
    """Lowest free index first, kept in memory. ``in_use``: indexes already taken elsewhere."""

    def __init__(self, capacity: int, in_use: Iterable[int] = ()) -> None:
        self.capacity = capacity
        self.taken: set[int] = set(in_use)

    async def allocate(self) -> int:
        for i in range(self.capacity):
            if i not in self.taken:
                self.taken.add(i)
                return i
        raise PoolExhausted(
            f"all {self.capacity} network slots are in use: enlarge the pool CIDR or lower the sandbox count"
        )

    async def free(self, index: int) -> None:
        self.taken.discard(index)


class SlotPool:
    """Keeps ``size`` prepared slots ready. See the module docstring for the lifecycle."""

    def __init__(
        self,
        config: NetworkConfig,
        allocator: IndexAllocator,
        *,
        size: int = 4,
        factory: SlotFactory | None = None,
        retry_delay: float = 1.0,
    ) -> None:
        if size < 0:
            raise ValueError("size must be >= 0")
        self.config = config
        self.allocator = allocator
        self.size = size
        self._factory: SlotFactory = factory or (lambda cfg, i: create_slot(cfg, i))
        self._retry_delay = retry_delay
        self._idle: list[Slot] = []
        self._leased: dict[int, Slot] = {}
        #: leased slots whose egress policy may not be the default (given one at acquire, changed by
        #: ``set_egress``, or adopted): a release must put the default back
        self._custom_egress: set[int] = set()
        #: slots the refiller is making for the idle list
        self._refilling = 0
        self._closed = False
        self._wake = trio.Event()  # set when the refiller should look again
        self._changed = trio.Event()  # set (and replaced) whenever the idle list changes

    # --- public face ---

    @property
    def ready(self) -> int:
        """How many prepared slots are waiting."""
        return len(self._idle)

    @property
    def leased(self) -> list[Slot]:
        return list(self._leased.values())

    async def __aenter__(self) -> SlotPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Destroy every slot this pool made (idle and leased) and give their indexes back."""
        self._closed = True
        self._wake.set()
        with trio.CancelScope(shield=True):
            slots = self._idle + list(self._leased.values())
            self._idle.clear()
            self._leased.clear()
            for slot in slots:
                await self._destroy(slot)
            self._notify()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The refiller: keep ``size`` slots ready until cancelled or the pool closes.
        ``task_status.started()`` fires once the pool is first full (or on the first failure, which
        is retried every ``retry_delay`` seconds and logged)."""
        started = False
        while not self._closed:
            if len(self._idle) + self._refilling < self.size:
                self._refilling += 1
                try:
                    slot = await self._make()
                except (NetError, OSError) as e:
                    log.error("network slot pool refill failed (retrying in %.1fs): %s", self._retry_delay, e)
                    if not started:
                        task_status.started()
                        started = True
                    await trio.sleep(self._retry_delay)
                    continue
                finally:
                    self._refilling -= 1
                if self._closed:
                    await self._destroy(slot)
                    break
                self._idle.append(slot)
                self._notify()
                continue
            if not started:
                task_status.started()
                started = True
            self._wake = trio.Event()
            await self._wake.wait()

    async def acquire(self, policy: EgressPolicy | None = None) -> Slot:
        """A slot for a new sandbox, from the pool when one is ready, else made now. ``policy``:
        its egress policy (default: allow all but the always-blocked ranges)."""
        if self._closed:
            raise SlotError("the slot pool is closed")
        if self._idle:
            slot = self._idle.pop()
            self._wake.set()
            self._notify()
            try:
                if policy is not None:  # an idle slot has the default (empty) policy: add only
                    await slot.apply_egress(policy, replace=False)
            except BaseException:
                with trio.CancelScope(shield=True):
                    await self._destroy(slot)
                raise
        else:
            self._wake.set()
            slot = await self._make(policy)
        self._leased[slot.index] = slot
        if policy is not None and policy != EgressPolicy():
            self._custom_egress.add(slot.index)
        return slot

    async def set_egress(self, slot: Slot, policy: EgressPolicy) -> None:
        """Replace the egress policy of a leased slot (E2B's PUT /sandboxes/{id}/network)."""
        if slot.index not in self._leased:
            raise SlotError(f"slot {slot.index} was not acquired from this pool")
        self._custom_egress.add(slot.index)  # (before: a failed apply may have changed it half-way)
        await slot.apply_egress(policy)

    def adopt(self, slot: Slot) -> None:
        """Count an existing slot (e.g. of a sandbox still running after a node restart, found by
        the reconciler) as leased from this pool: it is released or destroyed like the others."""
        if slot.index in self._leased or any(s.index == slot.index for s in self._idle):
            raise SlotError(f"slot {slot.index} already belongs to this pool")
        self._leased[slot.index] = slot
        self._custom_egress.add(slot.index)  # (its policy is whatever the previous run left)

    def disown(self, slot: Slot) -> None:
        """Stop counting a leased slot as this pool's, leaving it as it is (a sandbox that runs on after the
        node stops, for the node's next run to ``adopt``): closing the pool then does not destroy it."""
        if self._leased.pop(slot.index, None) is None:
            raise SlotError(f"slot {slot.index} was not acquired from this pool")
        self._custom_egress.discard(slot.index)

    async def release(self, slot: Slot, *, reuse: bool = True) -> None:
        """Give back a slot whose sandbox is gone (its VMM has exited). It is reset and kept while fewer
        than ``2 * size`` slots are idle and ``reuse`` is true, else destroyed."""
        if self._leased.pop(slot.index, None) is None:
            raise SlotError(f"slot {slot.index} was not acquired from this pool")
        custom = slot.index in self._custom_egress
        self._custom_egress.discard(slot.index)
        with trio.CancelScope(shield=True):
            if reuse and not self._closed and len(self._idle) < 2 * self.size:
                try:
                    await slot.reset(keep_default_egress=not custom)
                except NetError as e:
                    log.warning("resetting slot %d failed, destroying it: %s", slot.index, e)
                else:
                    self._idle.append(slot)
                    self._notify()
                    return
            await self._destroy(slot)
            self._wake.set()

    async def wait_ready(self, count: int | None = None) -> None:
        """Wait until at least ``count`` (default: ``size``) slots are ready."""
        want = self.size if count is None else count
        while len(self._idle) < want:
            if self._closed:
                raise SlotError("the slot pool is closed")
            await self._changed.wait()

    # --- internals ---

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _make(self, policy: EgressPolicy | None = None) -> Slot:
        index = await self.allocator.allocate()
        try:
            slot = await self._factory(self.config, index)
            if policy is not None:
                await slot.apply_egress(policy, replace=False)
        except BaseException:
            with trio.CancelScope(shield=True):
                try:
                    await destroy_slot(self.config, index)
                    await self.allocator.free(index)
                except NetError as e:  # keep the index taken: the reconciler deals with it
                    log.error("cleanup of slot %d failed: %s", index, e)
            raise
        return slot

    async def _destroy(self, slot: Slot) -> None:
        try:
            await destroy_slot(self.config, slot.index)
        except NetError as e:  # keep the index taken: the reconciler removes the leftover
            log.error("destroying slot %d failed: %s", slot.index, e)
            return
        await self.allocator.free(slot.index)
