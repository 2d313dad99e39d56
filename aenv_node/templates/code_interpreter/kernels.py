"""Code contexts: one IPython kernel each, and the translation of its Jupyter messages into E2B output lines.

A :class:`Context` owns an :class:`~jupyter_client.ioloop.AsyncIOLoopKernelManager` (it starts the kernel, restarts
it when it dies, interrupts and stops it) and an async kernel client whose shell and iopub channels are each read by
one task that routes every message to the request that caused it (``parent_header.msg_id``).  Executions in a context
run one at a time (the kernel runs them one at a time anyway; serialising here keeps ``stop_on_error`` from aborting
a request queued behind a failed one, and keeps per-execution environment variables from leaking into another).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.ioloop import AsyncIOLoopKernelManager  # type: ignore[import-not-found, unused-ignore]

log = logging.getLogger(__name__)

#: The languages a context can run.  E2B's template also runs JavaScript, R, Java and Bash kernels; this one ships
#: only IPython, and says so instead of failing obscurely.
SUPPORTED_LANGUAGES = ("python",)

#: Seconds between ``{"type": "keepalive"}`` lines while an execution prints nothing: a write is how a vanished
#: client (no FIN) is noticed, and it keeps idle-timeout proxies from cutting a long, quiet execution.
KEEPALIVE_S = 5.0
#: How long an execution abandoned by its client may go on after the interrupt before the next one is let in.
ABANDON_GRACE_S = 10.0
#: How long a kernel gets to answer ``kernel_info`` after a start or restart: about a second on a KVM host, but
#: a minute or more in a guest under emulation (QEMU TCG) on a busy host. ``AENV_CI_KERNEL_READY_TIMEOUT_S``.
READY_TIMEOUT_S = float(os.environ.get("AENV_CI_KERNEL_READY_TIMEOUT_S", "300"))

# MIME types of a display_data / execute_result bundle -> the field of the E2B ``result`` line.  What is left over
# goes to ``extra``.  ``e2b/data`` and ``e2b/chart`` are what E2B's own formatters emit (its template registers them
# for pandas and matplotlib); kept so a template that installs such formatters gets them through.
_MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


class UnsupportedLanguage(ValueError):
    pass


class KernelNotReady(RuntimeError):
    pass


def normalize_language(language: str | None) -> str:
    """E2B's spelling rules: none means Python, case and blanks do not count, ``js``/``ts`` are short names."""
    if not language:
        return "python"
    lang = language.strip().lower()
    return {"js": "javascript", "ts": "typescript"}.get(lang, lang)


def result_line(data: dict[str, Any], *, is_main_result: bool) -> dict[str, Any]:
    """An E2B ``result`` line from a MIME bundle.

    ``text`` loses one pair of surrounding quotes, as in E2B's server: ``'hello'`` (the repr of a str) reads as
    ``hello``, which is what ``execution.text`` gives on E2B.
    """
    out: dict[str, Any] = {"type": "result"}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        name = _MIME_FIELDS.get(mime)
        if name is None:
            extra[mime] = value
        else:
            out[name] = value
    text = out.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        out["text"] = text[1:-1]
    if extra:
        out["extra"] = extra
    out["is_main_result"] = is_main_result
    return out


def error_line(name: str, value: str, traceback: str = "") -> dict[str, Any]:
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


def _timestamp(msg: dict[str, Any]) -> str:
    date = msg.get("header", {}).get("date")
    return date.isoformat() if hasattr(date, "isoformat") else str(date or "")


def _traceback(content: dict[str, Any]) -> str:
    """IPython's structured traceback (a list of blocks: header, frames, exception line; with ANSI colours, as on
    E2B) as one text, a block per line: some blocks end with a newline, some do not."""
    blocks = [str(b) for b in content.get("traceback") or []]
    return "".join(b if b.endswith("\n") or i == len(blocks) - 1 else b + "\n" for i, b in enumerate(blocks))


@dataclass
class _Request:
    """What the channel readers have routed to one shell request so far."""

    queue: asyncio.Queue[tuple[str, dict[str, Any]]] = field(default_factory=asyncio.Queue)
    idle: bool = False
    reply: dict[str, Any] | None = None
    aborted: bool = False

    @property
    def done(self) -> bool:
        return self.aborted or (self.idle and self.reply is not None)


# Python run in the kernel (silently: no execution count, no history, no output) to set and restore env vars.
# The saved values live on the ``os`` module, not in the user's globals.  The JSON is embedded as a string literal.
_SET_ENV = (
    "(lambda o, e: (o.__dict__.setdefault('_aenv_saved_env', []).append({{k: o.environ.get(k) for k in e}}),"
    " o.environ.update(e)))(__import__('os'), __import__('json').loads({payload!r}))"
)
_RESTORE_ENV = (
    "(lambda o: [o.environ.pop(k, None) if v is None else o.environ.__setitem__(k, v)"
    " for k, v in (o.__dict__.get('_aenv_saved_env') or [{}]).pop().items()])(__import__('os'))"
)
_SET_GLOBAL_ENV = "__import__('os').environ.update(__import__('json').loads({payload!r}))"


class Context:
    """One code context: an IPython kernel with its own globals, cwd and execution counter."""

    def __init__(self, language: str, cwd: str, *, env_source: Callable[[str | None], Any] | None = None) -> None:
        if language not in SUPPORTED_LANGUAGES:
            raise UnsupportedLanguage(
                f"language {language!r} is not supported by this code interpreter (supported: "
                f"{', '.join(SUPPORTED_LANGUAGES)})"
            )
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        #: ``await env_source(access_token)`` -> the sandbox's env vars (envd's ``GET /envs``), applied once per
        #: kernel before its first execution: the server may start (and the template be snapshotted) before a
        #: sandbox exists, so its env vars cannot be in the kernel's environment from the start.
        self._env_source = env_source
        self._global_env_applied = False
        self._km: Any = None
        self._kc: Any = None
        self._requests: dict[str, _Request] = {}
        self._readers: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()
        self._closed = False
        #: Bumped whenever the kernel is replaced (restart, death) or stopped: what an execution set up in the old
        #: kernel (its env vars) is not to be undone in the new one.
        self._generation = 0
        #: The kernel restarted on its own (it died): wait for it before sending it the next request.
        self._needs_ready = False

    def to_json(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    # ---- life cycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        km = AsyncIOLoopKernelManager(kernel_name="python3")
        km.shutdown_wait_time = 3.0
        self._km = km
        try:
            await km.start_kernel(cwd=self.cwd, env=dict(os.environ))
            km.add_restart_callback(self._on_kernel_restarting, "restart")
            km.add_restart_callback(self._on_kernel_dead, "dead")
            kc = km.client()
            kc.start_channels()
            self._kc = kc
            self._readers = [
                asyncio.create_task(self._read(kc.get_shell_msg, "shell"), name=f"shell-{self.id}"),
                asyncio.create_task(self._read(kc.get_iopub_msg, "iopub"), name=f"iopub-{self.id}"),
            ]
            await self._wait_ready()
        except BaseException:
            await self.shutdown()
            raise
        log.info("context %s (%s, cwd %s) ready, kernel pid %s", self.id, self.language, self.cwd, self.kernel_pid)

    @property
    def kernel_pid(self) -> int | None:
        provisioner = getattr(self._km, "provisioner", None)
        return getattr(provisioner, "pid", None)

    async def restart(self) -> None:
        """A fresh kernel (same cwd, same connection): all state is gone; a running execution ends with an error."""
        self._fail_pending(error_line("ContextRestarting", "Context was restarted"))
        async with self._lock:  # the running execution, if any, has just been told to end
            self._global_env_applied = False
            await self._km.restart_kernel(now=True)
            await self._wait_ready()
            self._needs_ready = False

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_pending(error_line("ContextDeleted", "Context was deleted"))
        for task in self._readers:
            task.cancel()
        if self._kc is not None:
            self._kc.stop_channels()
        if self._km is not None:
            with contextlib.suppress(Exception):
                await self._km.shutdown_kernel(now=False)

    def _on_kernel_restarting(self) -> None:  # the restarter found the kernel dead and is about to restart it
        log.warning("context %s: the kernel died; it is restarted with empty state", self.id)
        self._global_env_applied = False
        self._needs_ready = True
        self._fail_pending(
            error_line("KernelDied", "The kernel died during the execution and was restarted; its state is lost")
        )

    def _on_kernel_dead(self) -> None:  # ... and could not restart it
        log.error("context %s: the kernel died and could not be restarted", self.id)
        self._needs_ready = True
        self._fail_pending(error_line("KernelDied", "The kernel died and could not be restarted"))

    def _fail_pending(self, error: dict[str, Any]) -> None:
        self._generation += 1
        for req in self._requests.values():
            req.queue.put_nowait(("abort", error))

    # ---- message routing ----------------------------------------------------------------------------------------

    async def _read(self, get: Callable[..., Any], channel: str) -> None:
        while True:
            try:
                msg = await get()
            except asyncio.CancelledError:
                raise
            except Exception:
                if self._closed:
                    return
                log.exception("context %s: reading the %s channel failed", self.id, channel)
                await asyncio.sleep(0.1)
                continue
            parent = (msg.get("parent_header") or {}).get("msg_id")
            req = self._requests.get(parent) if parent else None
            if req is not None:
                req.queue.put_nowait((channel, msg))

    def _send(self, send: Callable[[], str]) -> tuple[str, _Request]:
        """Send one shell request (``send`` returns its msg_id) and register it for routing.  The caller
        unregisters it (``self._requests.pop(msg_id)``) when done with it."""
        req = _Request()
        msg_id = send()
        self._requests[msg_id] = req  # no await between send and here: the readers cannot have routed anything yet
        return msg_id, req

    async def _messages(self, req: _Request, timeout: float | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """A request's iopub messages, then its reply (``msg_type`` ``*_reply``).

        Ends when both the reply and the kernel's ``idle`` status for it have come; yields ``{"msg_type":
        "aenv_abort", "content": <error line>}`` and ends if the context is restarted or deleted, or the kernel dies,
        first.  ``timeout`` bounds each wait; on expiry yields ``{"msg_type": "aenv_tick"}`` and goes on waiting.
        Cancelling a consumer loses nothing: what was not consumed stays in ``req`` for the next iteration.
        """
        while not req.done:
            try:
                channel, msg = await asyncio.wait_for(req.queue.get(), timeout)
            except TimeoutError:
                yield {"msg_type": "aenv_tick"}
                continue
            if channel == "abort":
                req.aborted = True
                yield {"msg_type": "aenv_abort", "content": msg}
                return
            if channel == "shell":
                req.reply = msg
                continue
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                req.idle = True
                continue
            yield msg
        if req.reply is not None and not req.aborted:
            yield req.reply

    async def _wait_ready(self) -> None:
        """Until a ``kernel_info`` request gets both its reply and its ``idle`` status: the shell channel answers and
        the iopub subscription is live (a SUB socket that connects late misses what was published before)."""
        deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_S
        dead_checks = 0
        while True:
            if asyncio.get_running_loop().time() > deadline:
                raise KernelNotReady(f"the {self.language} kernel did not answer in {READY_TIMEOUT_S:.0f} s")
            if not await self._km.is_alive():  # may be between a death and the restarter's restart
                dead_checks += 1
                if dead_checks > 10:
                    raise KernelNotReady(f"the {self.language} kernel exited during start-up")
                await asyncio.sleep(0.5)
                continue
            dead_checks = 0
            msg_id, req = self._send(self._kc.kernel_info)
            try:
                async with asyncio.timeout(1.0):
                    async for _ in self._messages(req):
                        pass
                return
            except TimeoutError:
                continue
            finally:
                self._requests.pop(msg_id, None)

    async def _run_silent(self, code: str) -> dict[str, Any] | None:
        """Run helper code without history, counter or output; return an error line if it failed."""
        msg_id, req = self._send(
            lambda: self._kc.execute(code, silent=True, store_history=False, stop_on_error=False)
        )
        try:
            async for msg in self._messages(req):
                if msg["msg_type"] == "aenv_abort":
                    return msg["content"]
                if msg["msg_type"] == "execute_reply" and msg["content"].get("status") != "ok":
                    c = msg["content"]
                    return error_line(c.get("ename", "Error"), c.get("evalue", c.get("status", "")), _traceback(c))
            return None
        finally:
            self._requests.pop(msg_id, None)

    # ---- execution ----------------------------------------------------------------------------------------------

    async def execute(
        self, code: str, env_vars: dict[str, str] | None = None, access_token: str | None = None
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Run ``code``; yield the E2B output lines (without the final ``end_of_execution``).

        If the consumer stops early (client gone: the task is cancelled or the generator closed), the kernel is
        interrupted and the next execution waits (up to :data:`ABANDON_GRACE_S`) until this one has ended.
        """
        async with self._lock:
            if self._closed:
                yield error_line("ContextDeleted", "Context was deleted")
                return
            if self._needs_ready:
                try:
                    await self._wait_ready()
                except KernelNotReady as e:
                    yield error_line("KernelNotReady", str(e))
                    return
                self._needs_ready = False
            generation = self._generation
            if not self._global_env_applied and self._env_source is not None:
                await self._apply_global_env(access_token)
            try:
                if env_vars:
                    err = await self._run_silent(_SET_ENV.format(payload=json.dumps(env_vars)))
                    if err is not None:
                        yield err
                        return
                async for line in self._execute_user_code(code):
                    yield line
            finally:  # also after a failed or interrupted set: restoring what was not saved is a no-op
                if env_vars and self._generation == generation:
                    # bounded: after an abandoned execution that ignores the interrupt, the restore waits behind it
                    restore = asyncio.wait_for(self._run_silent(_RESTORE_ENV), ABANDON_GRACE_S)
                    try:
                        err = await asyncio.shield(restore)
                    except TimeoutError:
                        err = error_line("TimeoutError", "the kernel is still busy")
                    if err is not None:
                        log.warning("context %s: restoring env vars failed: %s", self.id, err)

    async def _apply_global_env(self, access_token: str | None) -> None:
        assert self._env_source is not None
        try:
            envs = await self._env_source(access_token)
        except Exception as e:  # envd unreachable: run without them, try again next time
            log.warning("context %s: could not read the sandbox's env vars: %s", self.id, e)
            return
        if envs:
            err = await self._run_silent(_SET_GLOBAL_ENV.format(payload=json.dumps(envs)))
            if err is not None:
                log.warning("context %s: setting the sandbox's env vars failed: %s", self.id, err)
                return
        self._global_env_applied = True

    async def _execute_user_code(self, code: str) -> AsyncGenerator[dict[str, Any], None]:
        msg_id, req = self._send(lambda: self._kc.execute(code, silent=False, store_history=True, allow_stdin=False))
        errored = False
        try:
            async for msg in self._messages(req, timeout=KEEPALIVE_S):
                kind = msg["msg_type"]
                content = msg.get("content", {})
                if kind == "aenv_tick":
                    yield {"type": "keepalive"}
                elif kind == "aenv_abort":
                    yield content
                elif kind == "stream":
                    name = content.get("name")
                    if name in ("stdout", "stderr"):
                        yield {"type": name, "text": content.get("text", ""), "timestamp": _timestamp(msg)}
                elif kind == "execute_input":
                    yield {"type": "number_of_executions", "execution_count": content.get("execution_count")}
                elif kind == "display_data":
                    yield result_line(content.get("data") or {}, is_main_result=False)
                elif kind == "execute_result":
                    yield result_line(content.get("data") or {}, is_main_result=True)
                elif kind in ("error", "execute_reply"):
                    status = content.get("status", "error")
                    if status == "error" and not errored:
                        errored = True
                        yield error_line(content.get("ename", ""), content.get("evalue", ""), _traceback(content))
                    elif status in ("abort", "aborted"):
                        yield error_line("ExecutionAborted", "Execution was aborted")
        finally:
            if not req.done:  # the consumer left early (client gone)
                await asyncio.shield(self._abandon(req))
            self._requests.pop(msg_id, None)

    async def _abandon(self, req: _Request) -> None:
        """The client went away mid-execution: interrupt the kernel and let the execution end before the next."""
        log.info("context %s: client gone during an execution; interrupting the kernel", self.id)
        try:
            await self._km.interrupt_kernel()
            async with asyncio.timeout(ABANDON_GRACE_S):
                async for msg in self._messages(req):
                    if msg["msg_type"] == "aenv_abort":
                        return
        except Exception as e:
            log.warning("context %s: the abandoned execution did not end in time: %s", self.id, e)
