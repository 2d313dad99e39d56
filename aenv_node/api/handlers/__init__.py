"""API handlers by operation id (see ``routes.ROUTES``).

A handler is ``async def handler(node, **path_params)``; it reads the request
through Quart's context and returns a Quart response value.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from . import lifecycle as _lifecycle
from . import node as _node
from . import sandboxes as _sandboxes
from . import templates as _templates

HANDLERS: dict[str, Callable[..., Awaitable[Any]]] = {
    **_node.HANDLERS,
    **_sandboxes.HANDLERS,
    **_templates.HANDLERS,
    **_lifecycle.HANDLERS,
}

__all__ = ["HANDLERS"]
