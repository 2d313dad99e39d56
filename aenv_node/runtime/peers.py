"""The node's side of peer-to-peer layer ranges: how its layer cache finds and reads other nodes' caches, and
how it tells the scheduler which layers it caches.

Why here: the cache (``storage/cache_peers.py``) only knows a :class:`~..storage.cache_peers.PeerSource`; the
answer to "who holds layer D" lives in the scheduler's holder index (Redis, ``cluster/store.py``) and a range
is read from a peer's API (``GET /node/layers/{layerDigest}``, ``api/handlers/peers.py``).  This module is that
source over HTTP (:class:`PeerClient`, blocking httpx: the cache calls it from its reader threads) and the
service that keeps the index up to date (:class:`LayerAnnouncer`, a node service in the supervisor's nursery).

Both speak the cluster's wire format (``peer_models.py``) with the cluster's API key.  The client keeps the
scheduler's answer for ``p2p.holders_ttl_s`` (a node that became a holder meanwhile shows up at the next
lookup), tries holders in random order (the load of a popular layer spreads over every node that holds it) and
skips, for the same TTL, a peer that timed out or could not be reached (a node that died is not waited for at
every range until its heartbeat expires).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import httpx
import trio

from ..dataplane import DataPlaneError
from ..storage.cache_peers import PeerFetchError, PeerOptions
from .peer_models import LayerAnnouncement, LayerHolders

if TYPE_CHECKING:
    from ..config import Config
    from ..dataplane import DataPlaneClient
    from ..storage.cache import LayerCache
    from .node import Node
    from .parts import NodeParts

__all__ = ["PeerClient", "LayerAnnouncer", "held_layers", "install_peers", "peer_options"]

log = logging.getLogger(__name__)

#: an unchanged announcement is sent again after this many intervals (a Redis that lost it learns it again)
_REFRESH_EVERY = 15


class PeerClient:
    """A :class:`~..storage.cache_peers.PeerSource` over HTTP: the scheduler's holder index, peers' APIs."""

    def __init__(self, scheduler_url: str, node_id: str, api_key: Callable[[], str], *, timeout_s: float = 2.0,
                 holders_ttl_s: float = 2.0, max_connections: int = 64) -> None:
        self.scheduler_url = scheduler_url.rstrip("/")
        self.node_id = node_id
        self.api_key = api_key
        self.holders_ttl_s = holders_ttl_s
        self._http = httpx.Client(timeout=timeout_s, limits=httpx.Limits(max_connections=max_connections,
                                                                         max_keepalive_connections=16))
        self._lock = threading.Lock()
        self._holders: dict[str, tuple[float, list[str]]] = {}
        self._urls: dict[str, str] = {}
        self._down: dict[str, float] = {}
        self._rng = random.Random()

    def close(self) -> None:
        self._http.close()

    def _headers(self) -> dict[str, str]:
        return {"X-API-KEY": self.api_key()}

    def holders(self, digest: str) -> list[str]:
        now = time.monotonic()
        with self._lock:
            cached = self._holders.get(digest)
        if cached is None or now - cached[0] >= self.holders_ttl_s:
            try:
                r = self._http.get(f"{self.scheduler_url}/v1/layers/{digest}/holders", headers=self._headers())
            except httpx.HTTPError as exc:
                raise PeerFetchError("lookup", f"the scheduler did not answer: {type(exc).__name__}: {exc}") from exc
            if r.status_code != 200:
                raise PeerFetchError("lookup", f"the scheduler answered {r.status_code}: {r.text[:200]}")
            try:
                answer = LayerHolders.model_validate_json(r.content)
            except ValueError as exc:
                raise PeerFetchError("lookup", f"the scheduler's answer is not a holder list: {exc}") from exc
            ids = [h.node_id for h in answer.holders if h.node_id != self.node_id]
            with self._lock:
                for h in answer.holders:
                    self._urls[h.node_id] = h.url.rstrip("/")
                if len(self._holders) > 10_000:
                    self._holders.clear()
                self._holders[digest] = (now, ids)
        else:
            ids = cached[1]
        with self._lock:
            live = [p for p in ids if self._down.get(p, 0.0) <= now]
        self._rng.shuffle(live)
        return live

    def _mark_down(self, peer: str) -> None:
        with self._lock:
            self._down[peer] = time.monotonic() + max(self.holders_ttl_s, 1.0)

    def read_range(self, peer: str, digest: str, offset: int, length: int) -> bytes:
        with self._lock:
            url = self._urls.get(peer)
        if url is None:
            raise PeerFetchError("error", f"no address known for peer {peer}")
        try:
            r = self._http.get(f"{url}/node/layers/{digest}", params={"offset": offset, "length": length},
                               headers=self._headers())
        except httpx.TimeoutException as exc:
            self._mark_down(peer)
            raise PeerFetchError("timeout", f"{peer} did not answer in time: {exc}") from exc
        except httpx.TransportError as exc:
            self._mark_down(peer)
            raise PeerFetchError("unreachable", f"{peer} cannot be reached: {type(exc).__name__}: {exc}") from exc
        except (httpx.HTTPError, RuntimeError) as exc:  # RuntimeError: the client was closed (the node stops)
            raise PeerFetchError("error", f"reading from {peer}: {type(exc).__name__}: {exc}") from exc
        if r.status_code == 404:
            raise PeerFetchError("absent", f"{peer} does not cache {digest} [{offset}, +{length})")
        if r.status_code != 200:
            raise PeerFetchError("status", f"{peer} answered {r.status_code}: {r.text[:200]}")
        return r.content


class LayerAnnouncer:
    """A node service: every ``cluster.heartbeat_interval_s``, when the set changed (or every
    ``_REFRESH_EVERY`` beats anyway), tell the scheduler which layers this node caches (at most
    ``p2p.announce_max_layers``, most recently used first)."""

    name = "p2p-announce"

    def __init__(self, node: Node, layers: Callable[[int], list[str] | None]) -> None:
        self.node = node
        cfg = node.cfg
        self.url = cfg.cluster.scheduler_url.rstrip("/") + f"/v1/nodes/{node.node_id}/layers"
        self.interval = cfg.cluster.heartbeat_interval_s
        self.limit = cfg.p2p.announce_max_layers
        #: ``layers(limit)``: the digests to announce (None: the cache is not open yet)
        self.layers = layers
        #: announcements the scheduler took, and the last error (logs and tests)
        self.sent = 0
        self.last_error: str | None = None
        self._last: list[str] | None = None

    async def announce(self, client: httpx.AsyncClient, *, force: bool = False) -> bool:
        """Send the announcement if it changed (or ``force``); whether the scheduler has the current one."""
        layers = await trio.to_thread.run_sync(self.layers, self.limit)
        if layers is None or (layers == self._last and not force):
            return layers is not None
        body = LayerAnnouncement(node_id=self.node.node_id, layers=layers).model_dump_json()
        try:
            r = await client.put(self.url, content=body, headers={"X-API-KEY": self.node.api_key,
                                                                  "Content-Type": "application/json"})
        except (httpx.HTTPError, OSError) as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            return False
        if r.status_code != 204:
            self._failed(f"{r.status_code} {r.text[:200]}")
            return False
        self._last = layers
        self.sent += 1
        self.last_error = None
        return True

    def _failed(self, error: str) -> None:
        if error != self.last_error:
            log.warning("layer announcement to %s failed: %s", self.url, error)
        self.last_error = error

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            task_status.started()
            beats = 0
            while not self.node.shutdown.is_set():
                await self.announce(client, force=beats % _REFRESH_EVERY == 0)
                beats += 1
                with trio.move_on_after(self.interval):
                    await self.node.shutdown.wait()


def peer_options(cfg: Config, node_id: str, api_key: Callable[[], str]) -> PeerOptions | None:
    """The layer cache's P2P settings from ``[p2p]`` (None: P2P is off)."""
    p = cfg.p2p
    if not p.enabled:
        return None
    client = PeerClient(cfg.cluster.scheduler_url, node_id, api_key, timeout_s=p.timeout_s,
                        holders_ttl_s=p.holders_ttl_s)
    return PeerOptions(source=client, max_range_bytes=p.max_range_bytes, max_attempts=p.max_attempts,
                       max_serves=p.max_concurrent_serves)


def held_layers(cache: Callable[[], LayerCache | None],
                dataplane: Callable[[], DataPlaneClient | None]) -> Callable[[int], list[str] | None]:
    """What a node announces (blocking: the announcer calls it in a thread): the layers its own cache holds and,
    with a data plane, those of the data plane's cache (the sandboxes' disks), most recently used first, at most
    ``limit``; None until the node's cache is open."""

    def layers(limit: int) -> list[str] | None:
        own, plane = cache(), dataplane()
        if own is None:
            return None
        held = own.cached_layers(limit)
        if plane is not None:
            try:
                held += [d for d in plane.cached_layers_blocking(limit) if d not in held]
            except DataPlaneError as exc:  # not started yet, or restarting: the next announcement has them
                log.debug("the data plane's cached layers are not known: %s", exc)
        return held[:limit]

    return layers


def install_peers(node: Node, parts: NodeParts) -> None:
    """Wire P2P into a node being assembled: the cache's peer source, and the announcer service."""
    parts.peers = peer_options(node.cfg, node.node_id, lambda: node.api_key)
    if parts.peers is not None:
        node.services.append(LayerAnnouncer(node, held_layers(lambda: parts.cache, lambda: parts.dataplane)))
