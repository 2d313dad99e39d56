"""The scheduler (``aenv-node scheduler``, :9090): nodes register and beat, gateways ask where to put sandboxes
and where existing ones live. It keeps nothing itself (``store.py``: Redis holds it all), so replicas behind
one Service answer alike and a restart loses nothing.

Routes (all but ``/health`` need the cluster's API key in ``X-API-KEY``; errors are ``{"code", "message"}``):

- ``PUT /v1/nodes/{nodeID}``: a heartbeat (``NodeStatus``) -> 204;
- ``GET /v1/nodes``: every known node (``NodeView``: alive or not, reservations) -> 200;
- ``DELETE /v1/nodes/{nodeID}``: the node left -> 204;
- ``POST /v1/placements``: ``PlacementRequest`` -> 201 ``Placement``, or 503 when no node has room;
- ``DELETE /v1/placements/{nodeID}/{placementID}``: the create failed, give its share back -> 204;
- ``PUT /v1/bindings/{sandboxID}``: ``BindingRequest`` -> 204; ``GET`` -> ``{binding, node}``; ``DELETE`` -> 204;
- ``PUT /v1/nodes/{nodeID}/layers``: the layers the node caches (``LayerAnnouncement``, P2P) -> 204;
- ``GET /v1/layers/{digest}/holders``: the live nodes that announced the layer -> 200 ``LayerHolders``.
"""

from __future__ import annotations

import hmac
import logging
import random
import re
from collections.abc import Awaitable, Callable
from typing import Any, Optional, TypeVar, cast

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve
from pydantic import BaseModel, ValidationError
from quart import Response, jsonify, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..api.errors import error_response
from ..api.request_head import limit_request_head
from ..api.server import shield_last_send
from ..api.traffic import ASGIApp
from ..storage.repository.manifest import DIGEST_PATTERN
from .models import (NODE_ID_PATTERN, BindingRequest, LayerAnnouncement, LayerHolders, NodeStatus, Placement,
                     PlacementRequest)
from .placement import NoCapacity, PlacementPolicy, choose_node
from .store import ClusterStore, StoreUnavailable

__all__ = ["create_scheduler_app", "run_scheduler"]

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
_NODE_ID_RX = re.compile(NODE_ID_PATTERN)
_DIGEST_RX = re.compile(DIGEST_PATTERN)


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def _body(model: type[M]) -> M:
    raw = await request.get_data()
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise _Refused(400, f"{where}: {first['msg']}") from None


def create_scheduler_app(store: ClusterStore, policy: PlacementPolicy, api_key: str,
                         rng: Optional[random.Random] = None) -> QuartTrio:
    app = QuartTrio(__name__)
    app.config["MAX_CONTENT_LENGTH"] = 4 * 1024 * 1024  # a heartbeat lists up to 10,000 templates
    rng = rng or random.Random()

    @app.before_request
    async def _auth() -> Optional[Response]:
        if request.path == "/health":
            return None
        given = request.headers.get("X-API-KEY", "")
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            return error_response(401, "missing or wrong X-API-KEY")
        return None

    @app.errorhandler(_Refused)
    async def _refused(exc: _Refused) -> Response:
        return error_response(exc.status, str(exc))

    @app.errorhandler(StoreUnavailable)
    async def _store(exc: StoreUnavailable) -> Response:
        log.warning("%s", exc)
        return error_response(503, f"the scheduler's store is unavailable: {exc}")

    @app.errorhandler(HTTPException)
    async def _http(exc: HTTPException) -> Response:
        return error_response(exc.code or 500, exc.description or exc.name)

    @app.errorhandler(Exception)
    async def _any(exc: Exception) -> Response:
        log.exception("error in scheduler handler")
        return error_response(500, "internal error")

    def _check_node_id(node_id: str) -> None:
        if not _NODE_ID_RX.match(node_id):
            raise _Refused(400, f"node id {node_id!r} must match {NODE_ID_PATTERN}")

    @app.get("/health")
    async def health() -> Response:
        await store.ping()
        return jsonify({"status": "ok"})

    @app.put("/v1/nodes/<node_id>")
    async def heartbeat(node_id: str) -> Response:
        _check_node_id(node_id)
        status = await _body(NodeStatus)
        if status.node_id != node_id:
            raise _Refused(400, f"heartbeat of {status.node_id!r} sent for {node_id!r}")
        await store.heartbeat(status)
        return Response("", status=204)

    @app.get("/v1/nodes")
    async def nodes() -> Response:
        return jsonify([v.model_dump(mode="json") for v in await store.nodes()])

    @app.delete("/v1/nodes/<node_id>")
    async def forget(node_id: str) -> Response:
        _check_node_id(node_id)
        if not await store.forget_node(node_id):
            raise _Refused(404, f"node {node_id} is not registered")
        return Response("", status=204)

    @app.put("/v1/nodes/<node_id>/layers")
    async def announce_layers(node_id: str) -> Response:
        _check_node_id(node_id)
        announcement = await _body(LayerAnnouncement)
        if announcement.node_id != node_id:
            raise _Refused(400, f"layers of {announcement.node_id!r} announced for {node_id!r}")
        await store.announce_layers(announcement)
        return Response("", status=204)

    @app.get("/v1/layers/<digest>/holders")
    async def layer_holders(digest: str) -> Response:
        if not _DIGEST_RX.match(digest):
            raise _Refused(400, f"{digest!r} is not a layer digest (sha256:<64 hex digits>)")
        holders = await store.layer_holders(digest)
        return jsonify(LayerHolders(digest=digest, holders=holders).model_dump(mode="json"))

    @app.post("/v1/placements")
    async def place() -> Response:
        req = await _body(PlacementRequest)
        try:
            chosen = choose_node(await store.nodes(), req, policy, rng)
        except NoCapacity as exc:
            raise _Refused(503, str(exc)) from None
        node_id = chosen.status.node_id
        placement_id = await store.reserve(node_id, req.cpu_count, req.memory_mb)
        resp = jsonify(Placement(placement_id=placement_id, node_id=node_id, url=chosen.status.url)
                       .model_dump(mode="json"))
        resp.status_code = 201
        return resp

    @app.delete("/v1/placements/<node_id>/<placement_id>")
    async def release(node_id: str, placement_id: str) -> Response:
        _check_node_id(node_id)
        await store.release(node_id, placement_id)
        return Response("", status=204)

    @app.put("/v1/bindings/<sandbox_id>")
    async def bind(sandbox_id: str) -> Response:
        req = await _body(BindingRequest)
        await store.bind(sandbox_id, req.node_id, req.placement_id)
        return Response("", status=204)

    @app.get("/v1/bindings/<sandbox_id>")
    async def binding(sandbox_id: str) -> Response:
        found = await store.binding(sandbox_id)
        if found is None:
            raise _Refused(404, f"sandbox {sandbox_id} is bound to no node")
        view = await store.node(found.node_id)
        return jsonify({"binding": found.model_dump(mode="json"),
                        "node": None if view is None else view.model_dump(mode="json")})

    @app.delete("/v1/bindings/<sandbox_id>")
    async def unbind(sandbox_id: str) -> Response:
        await store.unbind(sandbox_id)
        return Response("", status=204)

    return app


async def run_scheduler(listen: str, store: ClusterStore, policy: PlacementPolicy, api_key: str, *,
                        shutdown: Callable[[], Awaitable[Any]],
                        task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the scheduler on ``listen`` until ``shutdown`` returns; ``task_status`` gets the bound addresses."""
    hc = HypercornConfig()
    hc.bind = [listen]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.include_server_header = False
    # as on a node: a response sent before its body was read (a 400 on the path, a 401) must not leave the
    # keep-alive connection answering nothing (found under load: a client's next request hung)
    app: Any = limit_request_head(shield_last_send(cast(ASGIApp, create_scheduler_app(store, policy, api_key))))
    await serve(app, hc, shutdown_trigger=shutdown, task_status=task_status)
