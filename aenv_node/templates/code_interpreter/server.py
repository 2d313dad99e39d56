"""The HTTP side: the routes e2b-code-interpreter calls on port 49999, served by Tornado.

Errors are plain-text bodies, as E2B's server sends them: the SDK puts the body verbatim into the exception it raises
(404 -> ``NotFoundException``, 502 -> ``TimeoutException``, anything else -> ``SandboxException``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from typing import Any

import tornado.httpclient  # type: ignore[import-not-found, unused-ignore]
import tornado.iostream  # type: ignore[import-not-found, unused-ignore]
import tornado.web  # type: ignore[import-not-found, unused-ignore]

from .kernels import SUPPORTED_LANGUAGES, Context, KernelNotReady, UnsupportedLanguage, normalize_language

log = logging.getLogger(__name__)

END_OF_EXECUTION = json.dumps({"type": "end_of_execution"}) + "\n"


class Registry:
    """The contexts by id, and the default context of each language (created at start for Python, lazily else)."""

    def __init__(self, default_cwd: str, envd_url: str | None) -> None:
        self.default_cwd = default_cwd
        self.envd_url = envd_url.rstrip("/") if envd_url else None
        self.contexts: dict[str, Context] = {}
        self.defaults: dict[str, str] = {}
        self._default_lock = asyncio.Lock()

    async def _envd_envs(self, access_token: str | None) -> dict[str, str]:
        """The sandbox's env vars, from envd (``GET /envs``, the access token the SDK sent to ``/execute``)."""
        headers = {"X-Access-Token": access_token} if access_token else {}
        resp = await tornado.httpclient.AsyncHTTPClient().fetch(
            f"{self.envd_url}/envs", headers=headers, connect_timeout=2, request_timeout=5
        )
        data = json.loads(resp.body or b"{}")
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    async def create(self, language: str, cwd: str | None = None) -> Context:
        ctx = Context(language, cwd or self.default_cwd, env_source=self._envd_envs if self.envd_url else None)
        await ctx.start()
        self.contexts[ctx.id] = ctx
        return ctx

    async def default(self, language: str) -> Context:
        async with self._default_lock:
            ctx_id = self.defaults.get(language)
            ctx = self.contexts.get(ctx_id) if ctx_id else None
            if ctx is None:
                ctx = await self.create(language)
                self.defaults[language] = ctx.id
            return ctx

    async def delete(self, ctx_id: str) -> bool:
        ctx = self.contexts.pop(ctx_id, None)
        if ctx is None:
            return False
        await ctx.shutdown()
        return True

    async def close_all(self) -> None:
        contexts, self.contexts = list(self.contexts.values()), {}
        await asyncio.gather(*(c.shutdown() for c in contexts), return_exceptions=True)


class _Handler(tornado.web.RequestHandler):
    registry: Registry

    def initialize(self, registry: Registry) -> None:
        self.registry = registry

    def set_default_headers(self) -> None:
        # the JS SDK runs in browsers too; E2B's server allows every origin
        self.set_header("Access-Control-Allow-Origin", "*")
        self.set_header("Access-Control-Allow-Methods", "GET, POST, DELETE, OPTIONS")
        self.set_header("Access-Control-Allow-Headers", "*")

    def options(self, *args: str) -> None:
        self.set_status(204)
        self.finish()

    def fail(self, status: int, message: str) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        self.finish(message)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        self.set_header("Content-Type", "text/plain; charset=utf-8")
        exc = kwargs.get("exc_info", (None, None))[1]
        if isinstance(exc, tornado.web.HTTPError) and exc.log_message:
            self.finish(exc.log_message % exc.args if exc.args else exc.log_message)
        else:
            self.finish(self._reason)

    def body_object(self) -> dict[str, Any]:
        if not self.request.body.strip():
            return {}
        try:
            body = json.loads(self.request.body)
        except ValueError as e:
            raise tornado.web.HTTPError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise tornado.web.HTTPError(400, "the body must be a JSON object")
        return body

    def send_json(self, value: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(value))


class HealthHandler(_Handler):
    def get(self) -> None:
        self.send_json("OK")


class ContextsHandler(_Handler):
    def get(self) -> None:
        self.send_json([c.to_json() for c in self.registry.contexts.values()])

    async def post(self) -> None:
        body = self.body_object()
        language = normalize_language(_opt_str(body, "language"))
        cwd = _opt_str(body, "cwd") or self.registry.default_cwd
        if language not in SUPPORTED_LANGUAGES:
            return self.fail(400, _unsupported(language))
        if not os.path.isdir(cwd):
            return self.fail(400, f"cwd {cwd!r} is not a directory")
        try:
            ctx = await self.registry.create(language, cwd)
        except (KernelNotReady, OSError) as e:
            log.exception("creating a %s context failed", language)
            return self.fail(500, f"Failed to create context: {e}")
        self.send_json(ctx.to_json())


class ContextHandler(_Handler):
    async def delete(self, ctx_id: str) -> None:
        if not await self.registry.delete(ctx_id):
            return self.fail(404, f"Context {ctx_id} not found")
        self.set_status(204)
        self.finish()


class RestartHandler(_Handler):
    async def post(self, ctx_id: str) -> None:
        ctx = self.registry.contexts.get(ctx_id)
        if ctx is None:
            return self.fail(404, f"Context {ctx_id} not found")
        try:
            await ctx.restart()
        except KernelNotReady as e:
            return self.fail(500, f"Failed to restart context {ctx_id}: {e}")
        self.set_status(204)
        self.finish()


class ExecuteHandler(_Handler):
    """``POST /execute``: NDJSON lines as the kernel produces them, then ``end_of_execution``.

    The client going away (closed connection, or a write that fails) ends the stream; the execution is then
    interrupted in the kernel (:meth:`Context.execute`).
    """

    _stream_task: asyncio.Task[None] | None = None
    _client_gone = False

    async def post(self) -> None:
        body = self.body_object()
        code = body.get("code")
        if not isinstance(code, str):
            return self.fail(400, "'code' must be a string")
        context_id = _opt_str(body, "context_id")
        language = _opt_str(body, "language")
        env_vars = body.get("env_vars") or None
        if env_vars is not None and not (
            isinstance(env_vars, dict) and all(isinstance(v, str) for v in env_vars.values())
        ):
            return self.fail(400, "'env_vars' must be an object of strings")
        if context_id and language:
            return self.fail(400, "Only one of context_id or language can be provided")
        if context_id:
            ctx = self.registry.contexts.get(context_id)
            if ctx is None:
                return self.fail(404, f"Context {context_id} not found")
        else:
            lang = normalize_language(language)
            if lang not in SUPPORTED_LANGUAGES:
                return self.fail(400, _unsupported(lang))
            try:
                ctx = await self.registry.default(lang)
            except (KernelNotReady, UnsupportedLanguage, OSError) as e:
                return self.fail(500, f"Failed to create the default {lang} context: {e}")

        self.set_header("Content-Type", "application/x-ndjson")
        self._stream_task = asyncio.ensure_future(
            self._stream(ctx, code, env_vars, self.request.headers.get("X-Access-Token"))
        )
        try:
            await self._stream_task
        except asyncio.CancelledError:
            if not self._client_gone:
                raise
        except tornado.iostream.StreamClosedError:
            pass

    async def _stream(self, ctx: Context, code: str, env_vars: dict[str, str] | None, token: str | None) -> None:
        lines = ctx.execute(code, env_vars, token)
        async with contextlib.aclosing(lines):
            try:
                async for line in lines:
                    self.write(json.dumps(line) + "\n")
                    await self.flush()
            except (tornado.iostream.StreamClosedError, asyncio.CancelledError):
                raise
            except Exception as e:
                log.exception("execution in context %s failed", ctx.id)
                self.write(json.dumps({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": ""}))
                self.write("\n")
        self.write(END_OF_EXECUTION)
        await self.flush()

    def on_connection_close(self) -> None:
        self._client_gone = True
        if self._stream_task is not None and not self._stream_task.done():
            self._stream_task.cancel()


def _opt_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise tornado.web.HTTPError(400, f"{key!r} must be a string")
    return value


def _unsupported(language: str) -> str:
    return (
        f"language {language!r} is not supported by this code interpreter "
        f"(supported: {', '.join(SUPPORTED_LANGUAGES)})"
    )


def make_app(registry: Registry) -> tornado.web.Application:
    args = {"registry": registry}
    return tornado.web.Application(
        [
            (r"/health", HealthHandler, args),
            (r"/execute", ExecuteHandler, args),
            (r"/contexts", ContextsHandler, args),
            (r"/contexts/([^/]+)", ContextHandler, args),
            (r"/contexts/([^/]+)/restart", RestartHandler, args),
        ]
    )


async def serve(host: str, port: int, default_cwd: str, envd_url: str | None) -> None:
    """Start the default Python context, then serve until SIGTERM or SIGINT; stop every kernel on the way out."""
    registry = Registry(default_cwd, envd_url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await registry.default("python")
        server = make_app(registry).listen(port, address=host, idle_connection_timeout=3600)
        log.info("code interpreter listening on %s:%d (default cwd %s)", host, port, default_cwd)
        await stop.wait()
        log.info("stopping")
        server.stop()
    finally:
        await registry.close_all()
