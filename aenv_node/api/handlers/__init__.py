"""API handlers by operation id (see ``routes.ROUTES``).

A handler is ``async def handler(api: ApiContext, **path_params, body=<request model>)``: the app
parses the route's request model before calling it (``body`` only for routes that declare one) and
serializes the model it returns (``context.HandlerResult``) with the route's success status.
"""

from __future__ import annotations

from ..context import Handler
from . import builds as _builds
from . import lifecycle as _lifecycle
from . import logs as _logs
from . import node as _node
from . import peers as _peers
from . import sandboxes as _sandboxes
from . import templates as _templates

HANDLERS: dict[str, Handler] = {
    **_node.HANDLERS,
    **_sandboxes.HANDLERS,
    **_templates.HANDLERS,
    **_builds.HANDLERS,
    **_lifecycle.HANDLERS,
    **_logs.HANDLERS,
    **_peers.HANDLERS,
}

__all__ = ["HANDLERS"]
