"""What a handler is given (``ApiContext``) and what it may return (``HandlerResult``).

The sandbox service is handed to the app explicitly (``create_app(node,
sandboxes=...)``) instead of being found among the node's services: a node can
serve the API without one (state-only routes, tests), and then every route
that needs it answers the same 501 through ``ApiContext.sandboxes``, the one
accessor handlers use.

Handlers return models, not Quart responses: the app serializes them with the
route's declared success status, so what a handler returns is what the route
table (and so the OpenAPI document) says.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

from quart import Response

from ..config import Config
from ..runtime import Node
# The one line naming the sandbox service's module (the runtime is being split; it moves here only).
from ..runtime.sandboxes import CreateRequest, SandboxService
from .errors import ApiError
from .models import ResponseModel

__all__ = ["ApiContext", "Reply", "HandlerResult", "Handler", "NO_SANDBOX_SERVICE", "SandboxService",
           "CreateRequest"]

NO_SANDBOX_SERVICE = "sandbox lifecycle is not implemented on this node: it runs no sandbox service"


@dataclass(frozen=True)
class ApiContext:
    """The node and its sandbox service (None: this node runs none) as the handlers see them."""

    node: Node
    service: Optional[SandboxService] = None

    @property
    def cfg(self) -> Config:
        return self.node.cfg

    @property
    def sandboxes(self) -> SandboxService:
        """The sandbox service; a 501 for the client when this node runs none."""
        if self.service is None:
            raise ApiError(501, NO_SANDBOX_SERVICE)
        return self.service


@dataclass(frozen=True)
class Reply:
    """A body with a status other than the route's success status, or extra headers."""

    body: Union[ResponseModel, Sequence[ResponseModel], None]
    status: Optional[int] = None
    headers: Mapping[str, str] = field(default_factory=dict)


#: A model, a list of models, None (an empty body: 204 routes), a Reply, or a ready Response
#: (non-JSON bodies: /metrics, /openapi.json).
HandlerResult = Union[ResponseModel, Sequence[ResponseModel], Reply, Response, None]

#: ``handler(api, **path_params[, body=<the route's request model>])``
Handler = Callable[..., Awaitable[HandlerResult]]
