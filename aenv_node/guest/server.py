"""envd's server: configuration, routing, the access-token gate, and the task tree.

One Trio nursery owns everything that outlives a request: the listener, the
processes (:class:`.process.ProcessManager`) and the polled directory
watchers. Leaving :func:`serve` (cancellation, SIGTERM) kills the processes
and closes the watchers.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from dataclasses import dataclass, field

import trio

from .version import __envd_version__
from .connect import Method, serve_call
from .control import ControlApi
from .errors import ConnectError
from .files import FilesApi
from .filesystem_service import FilesystemService
from .http import Request, serve_connection
from .metrics import Metrics
from .process import ProcessManager
from .process_service import ProcessService
from .quiesce import Quiescer
from .state import EnvdState

log = logging.getLogger("envd")

# Routes reachable without X-Access-Token once a token is set (files use signing).
_OPEN_ROUTES = {("GET", "/health"), ("GET", "/files"), ("POST", "/files"), ("POST", "/init")}
_UNAUTHORIZED = json.dumps({
    "code": 401,
    "message": "unauthorized access, please provide a valid access token or method signing if supported",
}).encode()


@dataclass
class EnvdConfig:
    """How to run envd. ``default_user`` applies until ``/init`` names another."""

    host: str = "0.0.0.0"
    port: int = 49983
    default_user: str = "user"
    default_workdir: str | None = None
    # Set the guest clock from /init timestamps (E2B does); off for host-side tests.
    set_clock: bool = True
    # Env vars every process gets before /init adds its own.
    env_vars: dict[str, str] = field(default_factory=dict)
    access_token: str | None = None
    # The filesystem /quiesce freezes for a capture (the guest's root; the kit's init passes "/"). None: sync
    # only, never freeze (envd run on a host for tests must not freeze the host's root).
    quiesce_path: str | None = None


class Envd:
    def __init__(self, config: EnvdConfig, nursery: trio.Nursery) -> None:
        self.config = config
        self.state = EnvdState(
            default_user=config.default_user,
            default_workdir=config.default_workdir,
            env_vars=dict(config.env_vars),
            access_token=config.access_token,
        )
        self.processes = ProcessManager(nursery)
        self.filesystem = FilesystemService(self.state, nursery)
        self.files = FilesApi(self.state)
        self.control = ControlApi(self.state, set_clock=config.set_clock, metrics=Metrics(),
                                  quiescer=Quiescer(nursery, config.quiesce_path))
        self.rpc: dict[str, Method] = {}
        self.rpc.update(ProcessService(self.processes, self.state).methods())
        self.rpc.update(self.filesystem.methods())
        self.routes = {
            ("GET", "/health"): self.control.health,
            ("POST", "/init"): self.control.init,
            ("GET", "/envs"): self.control.envs,
            ("GET", "/metrics"): self.control.get_metrics,
            ("POST", "/quiesce"): self.control.quiesce,
            ("POST", "/thaw"): self.control.thaw,
            ("GET", "/files"): self.files.get,
            ("POST", "/files"): self.files.post,
        }
        self._paths = {path for _method, path in self.routes}

    async def __call__(self, request: Request) -> None:
        method, path = request.method, request.path
        if "origin" in request.headers:  # browsers may talk to envd directly, as to E2B's
            request.extra_headers = list(_CORS_HEADERS)
            if method == "OPTIONS":
                await request.respond(204, _cors_preflight(request))
                return
        if (method, path) not in _OPEN_ROUTES and not self.state.token_ok(request.headers.get("x-access-token")):
            log.warning("rejected %s %s: bad or missing access token", method, path)
            await request.respond(401, [("content-type", "application/json")], _UNAUTHORIZED)
            return
        rpc = self.rpc.get(path)
        if rpc is not None:
            await serve_call(request, rpc)
            return
        handler = self.routes.get((method, path))
        if handler is not None:
            await handler(request)
            return
        if path in self._paths:
            await request.respond(405, [("content-type", "application/json")],
                                  json.dumps({"code": 405, "message": f"method {method} not allowed"}).encode())
            return
        if path.startswith(("/process.Process/", "/filesystem.Filesystem/")):
            error = ConnectError("unimplemented", f"{path.lstrip('/')} is not implemented")
            await request.respond(404, [("content-type", "application/json")], json.dumps(error.to_json()).encode())
            return
        await request.respond(404, [("content-type", "application/json")],
                              json.dumps({"code": 404, "message": f"route {path} not found"}).encode())

    def close(self) -> None:
        self.filesystem.close()


_CORS_HEADERS = (
    ("access-control-allow-origin", "*"),
    ("access-control-expose-headers", "Content-Encoding, Content-Length, Content-Range, Content-Type, "
     "Grpc-Status, Grpc-Message, Grpc-Status-Details-Bin, X-Envd-Version"),
)


def _cors_preflight(request: Request) -> list[tuple[str, str]]:
    return [
        ("access-control-allow-methods", "GET, POST, OPTIONS"),
        ("access-control-allow-headers", request.headers.get("access-control-request-headers", "*")),
        ("access-control-max-age", "7200"),
    ]


async def serve(config: EnvdConfig, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Run envd until cancelled; ``task_status.started`` gets the bound port."""
    async with trio.open_nursery() as nursery:
        envd = Envd(config, nursery)
        try:
            listeners = await trio.open_tcp_listeners(config.port, host=config.host)
            port = listeners[0].socket.getsockname()[1]
            log.info("envd %s listening on %s:%d (pid %d)", __envd_version__, config.host, port, os.getpid())

            async def handle(stream: trio.SocketStream) -> None:
                await serve_connection(stream, envd)

            await nursery.start(trio.serve_listeners, handle, listeners)
            task_status.started(port)
            await trio.sleep_forever()
        finally:
            envd.close()
            nursery.cancel_scope.cancel()


async def serve_until_signalled(config: EnvdConfig) -> None:
    """:func:`serve`, stopping cleanly on SIGTERM or SIGINT."""
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            nursery.start_soon(serve, config)
            async for signum in signals:
                log.info("received %s: stopping", signal.Signals(signum).name)
                nursery.cancel_scope.cancel()
                break
