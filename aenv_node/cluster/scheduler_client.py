"""The gateway's client of the scheduler: placements, bindings and the node list, over the scheduler's HTTP API
(``scheduler.py``), with the short caches that keep a proxied request from costing a scheduler round trip.

Caches, and why they are safe:

- bindings (``binding_ttl_s``, 1 s): a sandbox moves only when it is created, resumed elsewhere, or killed,
  and this gateway updates its own cache when it does any of those; another gateway's move shows here within
  the TTL, and a request sent meanwhile to the old node is answered there (404: not found);
- nodes (``nodes_ttl_s``, 1 s): used to merge listings and to reach a node by id; a node that died within the
  TTL fails its part of a listing, which the listing reports by leaving that node out.
"""

from __future__ import annotations

import logging
import time
from typing import Optional, Self

import httpx

from .models import Binding, BindingRequest, NodeView, Placement, PlacementRequest

__all__ = ["SchedulerClient", "SchedulerUnavailable", "NoPlacement", "BoundNode"]

log = logging.getLogger(__name__)


class SchedulerUnavailable(Exception):
    """The scheduler did not answer, or answered an error it should not have (its message says which)."""

    def __init__(self, text: str, message: str = "") -> None:
        super().__init__(text)
        #: the scheduler's own message, when it answered one
        self.message = message


class NoPlacement(Exception):
    """The scheduler found no node with room (or none alive) for a sandbox."""


class BoundNode:
    """Where a sandbox lives: its binding, and its node as the scheduler last heard of it (None: unknown)."""

    __slots__ = ("binding", "node")

    def __init__(self, binding: Binding, node: Optional[NodeView]) -> None:
        self.binding = binding
        self.node = node


class SchedulerClient:
    def __init__(self, url: str, api_key: str, *, timeout_s: float = 5.0, binding_ttl_s: float = 1.0,
                 nodes_ttl_s: float = 1.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, headers={"X-API-KEY": api_key})
        self.binding_ttl_s = binding_ttl_s
        self.nodes_ttl_s = nodes_ttl_s
        self._bindings: dict[str, tuple[float, Optional[BoundNode]]] = {}
        self._nodes: tuple[float, list[NodeView]] | None = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, *, body: Optional[str] = None) -> httpx.Response:
        try:
            return await self._http.request(method, path, content=body,
                                            headers={"Content-Type": "application/json"} if body else None)
        except httpx.HTTPError as exc:
            raise SchedulerUnavailable(f"the scheduler at {self.url} did not answer: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def _failed(r: httpx.Response, what: str) -> SchedulerUnavailable:
        try:
            message = str(r.json().get("message", r.text))
        except ValueError:
            message = r.text[:200]
        return SchedulerUnavailable(f"the scheduler refused {what}: {r.status_code} {message}", message)

    # ----- placements ---------------------------------------------------------------------------

    async def place(self, req: PlacementRequest) -> Placement:
        r = await self._call("POST", "/v1/placements", body=req.model_dump_json())
        if r.status_code == 201:
            return Placement.model_validate_json(r.content)
        failure = self._failed(r, "a placement")
        if r.status_code == 503 and failure.message.startswith("no "):  # placement.NoCapacity's wording
            raise NoPlacement(failure.message)
        raise failure

    async def release(self, placement: Placement) -> None:
        """Give a failed create's share back; a lost release only keeps the share until its reservation expires."""
        try:
            r = await self._call("DELETE", f"/v1/placements/{placement.node_id}/{placement.placement_id}")
        except SchedulerUnavailable as exc:
            log.warning("releasing placement %s: %s", placement.placement_id, exc)
            return
        if r.status_code != 204:
            log.warning("releasing placement %s: %s", placement.placement_id, self._failed(r, "the release"))

    # ----- bindings -----------------------------------------------------------------------------

    async def bind(self, sandbox_id: str, node: NodeView | str, placement_id: Optional[str] = None) -> None:
        node_id = node if isinstance(node, str) else node.status.node_id
        body = BindingRequest(node_id=node_id, placement_id=placement_id).model_dump_json()
        r = await self._call("PUT", f"/v1/bindings/{sandbox_id}", body=body)
        if r.status_code != 204:
            raise self._failed(r, f"binding {sandbox_id}")
        self._bindings.pop(sandbox_id, None)

    async def unbind(self, sandbox_id: str) -> None:
        r = await self._call("DELETE", f"/v1/bindings/{sandbox_id}")
        if r.status_code != 204:
            raise self._failed(r, f"unbinding {sandbox_id}")
        self._bindings[sandbox_id] = (time.monotonic(), None)

    async def lookup(self, sandbox_id: str) -> Optional[BoundNode]:
        """The node a sandbox is bound to (None: bound nowhere), cached for ``binding_ttl_s``."""
        now = time.monotonic()
        cached = self._bindings.get(sandbox_id)
        if cached is not None and now - cached[0] < self.binding_ttl_s:
            return cached[1]
        r = await self._call("GET", f"/v1/bindings/{sandbox_id}")
        if r.status_code == 404:
            found = None
        elif r.status_code == 200:
            raw = r.json()
            found = BoundNode(Binding.model_validate(raw["binding"]),
                              None if raw.get("node") is None else NodeView.model_validate(raw["node"]))
        elif r.status_code == 400:  # not a sandbox id at all: bound nowhere
            found = None
        else:
            raise self._failed(r, f"the binding of {sandbox_id}")
        if len(self._bindings) > 100_000:
            self._bindings.clear()
        self._bindings[sandbox_id] = (now, found)
        return found

    # ----- nodes --------------------------------------------------------------------------------

    async def nodes(self) -> list[NodeView]:
        """Every node the scheduler knows, alive or not, cached for ``nodes_ttl_s``."""
        now = time.monotonic()
        if self._nodes is not None and now - self._nodes[0] < self.nodes_ttl_s:
            return self._nodes[1]
        r = await self._call("GET", "/v1/nodes")
        if r.status_code != 200:
            raise self._failed(r, "the node list")
        views = [NodeView.model_validate(v) for v in r.json()]
        self._nodes = (now, views)
        return views

    async def alive_nodes(self) -> list[NodeView]:
        return [v for v in await self.nodes() if v.alive]

    async def node(self, node_id: str) -> Optional[NodeView]:
        return next((v for v in await self.nodes() if v.status.node_id == node_id), None)
