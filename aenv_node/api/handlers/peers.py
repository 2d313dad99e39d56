"""The P2P serving route: a range of a layer this node caches, for a peer node (``GET /node/layers/{digest}``).

Why a route of its own, on the node's API: peers reach each other where the gateway and the scheduler reach
them (``cluster.advertise_url``), with the one cluster API key every route checks, so P2P needs no second
listener or secret.  The work and its bounds are the cache's (``storage/cache_peers.py``): it answers from
chunks PRESENT in the cache only, never from the repository, so a node that does not hold the range answers
404 at once; a range over ``p2p.max_range_bytes`` is a 400; past ``p2p.max_concurrent_serves`` a 503 (the
asker reads the repository instead).  The pread runs in a worker thread, as every cache read does.  With a data
plane (``node.data_plane``) the sandboxes' disks are read through the data plane's own cache: a range the
node's cache does not hold is asked of the data plane (``cache.read``), under the same rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import trio
from quart import Response

from ...dataplane import DataPlaneClient, DataPlaneError
from ...storage.cache import LayerCache
from ...storage.cache_peers import PeerServeRefused
from ..context import ApiContext, Handler
from ..errors import ApiError
from ..query import LayerRangeQuery

__all__ = ["HANDLERS", "data_plane", "layer_cache", "layer_range_handler"]

CacheFinder = Callable[[ApiContext], Optional[LayerCache]]
DataPlaneFinder = Callable[[ApiContext], Optional[DataPlaneClient]]


def layer_cache(api: ApiContext) -> Optional[LayerCache]:
    """The node's layer cache: its sandbox service's (None: no service, or its storage is not open)."""
    return None if api.service is None else api.service.parts.cache


def data_plane(api: ApiContext) -> Optional[DataPlaneClient]:
    """The node's data plane, whose cache serves the sandboxes' disks (None: the node runs none)."""
    return None if api.service is None else api.service.parts.dataplane


def layer_range_handler(find: CacheFinder, find_data_plane: DataPlaneFinder = lambda api: None) -> Handler:
    """The handler of ``get_layer_range`` over the cache ``find`` gives, then the data plane's (a node's:
    ``layer_cache``, ``data_plane``)."""

    async def get_layer_range(api: ApiContext, layerDigest: str, query: LayerRangeQuery) -> Response:  # noqa: N803
        cache = find(api)
        refused = PeerServeRefused(404, "this node has no layer cache open")
        if cache is not None:
            try:
                data = await trio.to_thread.run_sync(cache.serve_range, layerDigest, query.offset, query.length)
                return Response(data, status=200, content_type="application/octet-stream")
            except PeerServeRefused as exc:
                refused = exc
        plane = find_data_plane(api)
        if refused.status != 404 or plane is None:  # a bad range or a busy node: as the node's cache said
            raise ApiError(refused.status, str(refused))
        try:
            status, data, why = await plane.read_cached(layerDigest, query.offset, query.length)
        except DataPlaneError as exc:
            raise ApiError(404, f"the data plane did not answer: {exc}") from None
        if status != 200:
            raise ApiError(status, why)
        return Response(data, status=200, content_type="application/octet-stream")

    return get_layer_range


HANDLERS: dict[str, Handler] = {"get_layer_range": layer_range_handler(layer_cache, data_plane)}
