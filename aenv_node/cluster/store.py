"""The cluster's shared state in Redis: nodes' heartbeats, placements' reservations, sandbox-to-node bindings.

Redis is the one place the scheduler replicas share: a restarted scheduler, or a second one, reads everything it
needs from here and keeps nothing of its own. Each key holds typed records (``models.py``) as JSON:

- ``<prefix>nodes`` (hash): node id -> ``{"status": NodeStatus, "seen_at": t}``, the last heartbeat and when it
  arrived by Redis's own clock (``TIME``), so that replicas on hosts whose clocks disagree agree on who is alive;
- ``<prefix>reservations`` (hash): ``<node id>/<placement id>`` -> ``Reservation``, what placements took from a
  node that its heartbeats do not count yet (one hash for all nodes: a placement reads every node's, and the
  ones in flight are few);
- ``<prefix>bindings`` (hash): sandbox id -> ``Binding``;
- ``<prefix>layers`` (hash): node id -> ``LayerAnnouncement``, the layers the node last said it caches (P2P);
- ``<prefix>holders:<digest>`` (set of node ids): the same, inverted, so "who holds D" is one ``SMEMBERS``. It is
  derived from the announcements and changed with them in one ``MULTI``; a node's announcements come one after
  the other, so nothing else writes its part of it. A dead node's entries stay until it announces again or is
  forgotten, and are left out of answers by the heartbeat TTL (the rule placement uses).

A reservation lives until a heartbeat is sure to count its sandbox: once the sandbox is bound, the first heartbeat
*received* after the one following the binding (the node computed it after the binding landed), or after
``reservation_ttl_s`` when its create never bound (it failed, its gateway died). Between binding and release
the sandbox is counted twice, never zero times: placement errs towards leaving room.

redis-py's client is synchronous; every call goes through ``trio.to_thread`` (one thread per call in flight,
bounded), which its connection pool is made for.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Optional, TypeVar, cast

import redis
import trio
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from .models import Binding, LayerAnnouncement, LayerHolder, NodeStatus, NodeView, Reservation

__all__ = ["ClusterStore", "StoreUnavailable"]

T = TypeVar("T")


class StoreUnavailable(Exception):
    """Redis did not answer (down, unreachable, refused): the scheduler answers 503 and callers retry."""


class ClusterStore:
    def __init__(self, url: str, *, prefix: str = "aenv:", node_ttl_s: float = 10.0,
                 reservation_ttl_s: float = 120.0, max_threads: int = 16) -> None:
        self.url = url
        self.prefix = prefix
        self.node_ttl_s = node_ttl_s
        self.reservation_ttl_s = reservation_ttl_s
        # a call that fails is retried twice within ~0.3 s, then answered 503: a placement must not hang on a
        # Redis that is gone (redis-py's default retries back off for seconds)
        self._client: redis.Redis = redis.Redis.from_url(
            url, socket_timeout=5, socket_connect_timeout=5, max_connections=max_threads, decode_responses=True,
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 2))
        self._limiter = trio.CapacityLimiter(max_threads)
        self._parsed: dict[str, tuple[NodeStatus, float]] = {}

    def close(self) -> None:
        self._client.close()

    # -- plumbing ----------------------------------------------------------------------------------------------

    async def _run(self, fn: Callable[[redis.Redis], T]) -> T:
        def call() -> T:
            try:
                return fn(self._client)
            except redis.RedisError as exc:
                raise StoreUnavailable(f"redis at {self.url}: {exc}") from exc
        return await trio.to_thread.run_sync(call, limiter=self._limiter)

    def _key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    @staticmethod
    def _now(r: redis.Redis) -> float:
        seconds, micros = r.time()
        return float(seconds) + micros / 1e6

    async def ping(self) -> None:
        await self._run(lambda r: r.ping())

    # -- nodes -------------------------------------------------------------------------------------------------

    def _status(self, raw: str) -> tuple[NodeStatus, float]:
        """A node's record, parsed once per heartbeat: placements between two beats reuse the parse."""
        got = self._parsed.get(raw)
        if got is None:
            doc = json.loads(raw)
            got = (NodeStatus.model_validate(doc["status"]), float(doc["seen_at"]))
            if len(self._parsed) > 4096:
                self._parsed.clear()
            self._parsed[raw] = got
        return got

    async def heartbeat(self, status: NodeStatus) -> None:
        """Record ``status`` as the node's last heartbeat; release the reservations it now surely counts."""
        nodes, res_key = self._key("nodes"), self._key("reservations")
        mine = status.node_id + "/"

        def work(r: redis.Redis) -> None:
            now = self._now(r)
            previous = r.hget(nodes, status.node_id)
            prev_seen = json.loads(previous)["seen_at"] if previous else None
            r.hset(nodes, status.node_id, json.dumps({"status": status.model_dump(mode="json"), "seen_at": now}))
            stale = []
            for field, raw in cast(dict[str, str], r.hgetall(res_key)).items():
                if not field.startswith(mine):
                    continue
                res = Reservation.model_validate_json(raw)
                counted = res.bound_at is not None and prev_seen is not None and res.bound_at < prev_seen
                if counted or res.at < now - self.reservation_ttl_s:
                    stale.append(field)
            if stale:
                r.hdel(res_key, *stale)

        await self._run(work)

    async def forget_node(self, node_id: str) -> bool:
        """Remove a node (it left the cluster); its bindings stay: its published sandboxes resume elsewhere."""
        def work(r: redis.Redis) -> bool:
            res_key = self._key("reservations")
            held = [f for f in cast(dict[str, str], r.hgetall(res_key)) if f.startswith(node_id + "/")]
            if held:
                r.hdel(res_key, *held)
            self._replace_layers(r, node_id, None)
            return bool(r.hdel(self._key("nodes"), node_id))
        return await self._run(work)

    async def nodes(self) -> list[NodeView]:
        """Every known node, alive or not, with what is reserved on it: one round trip to Redis."""
        def work(r: redis.Redis) -> list[NodeView]:
            pipe = r.pipeline(transaction=False)
            pipe.time()
            pipe.hgetall(self._key("nodes"))
            pipe.hgetall(self._key("reservations"))
            (seconds, micros), entries, held = pipe.execute()
            now = float(seconds) + micros / 1e6
            reserved: dict[str, tuple[int, int]] = {}
            for field, raw in cast(dict[str, str], held).items():
                res = Reservation.model_validate_json(raw)
                if res.at >= now - self.reservation_ttl_s:
                    node_id = field.partition("/")[0]
                    vcpus, memory = reserved.get(node_id, (0, 0))
                    reserved[node_id] = (vcpus + res.vcpus, memory + res.memory_mb)
            views = []
            for node_id, raw in sorted(cast(dict[str, str], entries).items()):
                status, seen_at = self._status(raw)
                vcpus, memory = reserved.get(node_id, (0, 0))
                views.append(NodeView(status=status, seen_at=seen_at, alive=now - seen_at <= self.node_ttl_s,
                                      reserved_vcpus=vcpus, reserved_memory_mb=memory))
            return views
        return await self._run(work)

    async def node(self, node_id: str) -> Optional[NodeView]:
        for view in await self.nodes():
            if view.status.node_id == node_id:
                return view
        return None

    # -- layer holders (P2P) ------------------------------------------------------------------------------------

    def _replace_layers(self, r: redis.Redis, node_id: str, new: Optional[LayerAnnouncement]) -> None:
        """Make ``new`` the node's announcement (None: it has none), the inverted index with it, in one MULTI."""
        raw = r.hget(self._key("layers"), node_id)
        old = set(LayerAnnouncement.model_validate_json(raw).layers) if raw else set()
        now = set(new.layers) if new is not None else set()
        pipe = r.pipeline(transaction=True)
        for digest in old - now:
            pipe.srem(self._key("holders", digest), node_id)
        for digest in now - old:
            pipe.sadd(self._key("holders", digest), node_id)
        if new is None:
            pipe.hdel(self._key("layers"), node_id)
        else:
            pipe.hset(self._key("layers"), node_id, new.model_dump_json())
        pipe.execute()

    async def announce_layers(self, announcement: LayerAnnouncement) -> None:
        """Record the layers a node caches now (replacing what it announced before)."""
        await self._run(lambda r: self._replace_layers(r, announcement.node_id, announcement))

    async def layer_holders(self, digest: str) -> list[LayerHolder]:
        """The live nodes that announced ``digest``, with their API's URL (sorted by node id)."""
        def work(r: redis.Redis) -> list[LayerHolder]:
            ids = sorted(cast(set[str], r.smembers(self._key("holders", digest))))
            if not ids:
                return []
            pipe = r.pipeline(transaction=False)
            pipe.time()
            pipe.hmget(self._key("nodes"), ids)
            (seconds, micros), raws = pipe.execute()
            now = float(seconds) + micros / 1e6
            out = []
            for node_id, raw in zip(ids, raws):
                if raw is None:
                    continue
                status, seen_at = self._status(raw)
                if now - seen_at <= self.node_ttl_s:
                    out.append(LayerHolder(node_id=node_id, url=status.url))
            return out
        return await self._run(work)

    # -- placements --------------------------------------------------------------------------------------------

    async def reserve(self, node_id: str, vcpus: int, memory_mb: int) -> str:
        """Hold ``vcpus`` and ``memory_mb`` on the node for a placement; its id."""
        placement_id = uuid.uuid4().hex

        def work(r: redis.Redis) -> None:
            res = Reservation(vcpus=vcpus, memory_mb=memory_mb, at=self._now(r))
            r.hset(self._key("reservations"), f"{node_id}/{placement_id}", res.model_dump_json())

        await self._run(work)
        return placement_id

    async def release(self, node_id: str, placement_id: str) -> None:
        """Give a placement's share back (its create failed)."""
        await self._run(lambda r: r.hdel(self._key("reservations"), f"{node_id}/{placement_id}"))

    # -- bindings ----------------------------------------------------------------------------------------------

    async def bind(self, sandbox_id: str, node_id: str, placement_id: Optional[str] = None) -> None:
        """The sandbox lives on the node (created, resumed or moved there); the placement that made it is bound."""
        binding = Binding(sandbox_id=sandbox_id, node_id=node_id)
        res_key, field = self._key("reservations"), f"{node_id}/{placement_id}"

        def work(r: redis.Redis) -> None:
            r.hset(self._key("bindings"), sandbox_id, binding.model_dump_json())
            if placement_id is None:
                return
            raw = r.hget(res_key, field)
            if raw is not None:
                res = Reservation.model_validate_json(raw)
                r.hset(res_key, field, res.model_copy(update={"bound_at": self._now(r)}).model_dump_json())

        await self._run(work)

    async def binding(self, sandbox_id: str) -> Optional[Binding]:
        raw = await self._run(lambda r: r.hget(self._key("bindings"), sandbox_id))
        return None if raw is None else Binding.model_validate_json(raw)

    async def unbind(self, sandbox_id: str) -> bool:
        return bool(await self._run(lambda r: r.hdel(self._key("bindings"), sandbox_id)))

    async def bindings_count(self) -> dict[str, int]:
        """Sandboxes bound per node."""
        def work(r: redis.Redis) -> dict[str, int]:
            counts: dict[str, int] = {}
            for _, raw in r.hscan_iter(self._key("bindings"), count=1000):
                node = Binding.model_validate_json(raw).node_id
                counts[node] = counts.get(node, 0) + 1
            return counts
        return await self._run(work)

