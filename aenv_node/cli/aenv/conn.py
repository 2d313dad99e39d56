"""Where the node is and how to talk to it: the stored config, ``--url``/``--key`` overrides, one REST client.

``aenv auth`` stores the URL and API key in ``$XDG_CONFIG_HOME/aenv/config.json`` (0600); ``AENV_URL`` and
``AENV_API_KEY`` override the stored values, and a command's ``--url``/``--key`` override both. Control-plane
calls go through :class:`Api` (plain httpx: the node's own routes, one clear line per error); envd work
(PTY, commands, files) and template builds go through the e2b SDK, configured by :meth:`Conn.sdk_opts`.

Nothing here imports the e2b SDK or anything of the node: ``aenv --help`` stays fast and portable.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeVar, cast

import click
import httpx

from ... import __version__

__all__ = ["Api", "Conn", "NodeRefused", "NodeUnreachable", "client_config_path", "connection_options", "load_client_config", "save_client_config"]

F = TypeVar("F", bound=Callable[..., Any])


def client_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "aenv" / "config.json"


def load_client_config(url: str | None = None, key: str | None = None) -> dict[str, str]:
    """The stored config, then the environment, then the flags; both URL and key must end up set."""
    cfg: dict[str, str] = {}
    path = client_config_path()
    if path.exists():
        try:
            cfg = json.loads(path.read_text())
        except ValueError:
            raise click.ClickException(f"{path} is not valid JSON: run `aenv auth` again") from None
    if os.environ.get("AENV_URL"):
        cfg["url"] = os.environ["AENV_URL"]
    if os.environ.get("AENV_API_KEY"):
        cfg["api_key"] = os.environ["AENV_API_KEY"]
    if url:
        cfg["url"] = url
    if key:
        cfg["api_key"] = key
    if not cfg.get("url") or not cfg.get("api_key"):
        raise click.ClickException("not authenticated: run `aenv auth --url URL --key KEY` first")
    return cfg


def save_client_config(url: str, key: str) -> Path:
    path = client_config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"url": url, "api_key": key}, fh)
    os.chmod(path, 0o600)
    return path


class NodeUnreachable(click.ClickException):
    """The node did not answer at all (a command working through several ids stops at once)."""


class NodeRefused(click.ClickException):
    """The node answered with an error status (``status``); its message is the one line a user sees."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


class Api:
    """The node's REST API: errors become one line (the node's E2B ``message``, or why it cannot be reached)."""

    def __init__(self, url: str, key: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.client = httpx.Client(
            base_url=self.url, headers={"X-API-KEY": key, "User-Agent": f"aenv/{__version__}"}, timeout=timeout,
        )

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self.client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise NodeUnreachable(f"cannot reach {self.url}: {exc}") from None
        if resp.status_code >= 400:
            try:
                message = resp.json()["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text.strip()[:200] or resp.reason_phrase
            raise NodeRefused(resp.status_code, " ".join(str(message).split()))
        return resp

    def pages(self, path: str, params: dict[str, str]) -> list[Any]:
        """Every item of a listing the node pages with ``x-next-token`` (the SDK's pagination)."""
        params = dict(params)
        rows: list[Any] = []
        while True:
            resp = self.request("GET", path, params=params)
            rows.extend(resp.json())
            token = resp.headers.get("x-next-token")
            if not token:
                return rows
            params["nextToken"] = token

    def delete_each(self, paths: dict[str, str]) -> None:
        """DELETE each path (by its label); every one is tried and echoed, a failure named on stderr, and the exit
        code is 1 if any failed. An unreachable node stops at once."""
        failed = 0
        for label, path in paths.items():
            try:
                self.request("DELETE", path)
            except NodeUnreachable:
                raise
            except click.ClickException as exc:
                failed += 1
                click.echo(f"{label}: {exc.message}", err=True)
            else:
                click.echo(label)
        if failed:
            raise click.exceptions.Exit(1)

    def json(self, method: str, path: str, **kw: Any) -> Any:
        resp = self.request(method, path, **kw)
        return resp.json() if resp.content else None


@dataclass(frozen=True)
class Conn:
    url: str
    key: str

    @functools.cached_property
    def api(self) -> Api:
        return Api(self.url, self.key)

    def sdk_opts(self, request_timeout: float | None = None) -> dict[str, Any]:
        """Keyword arguments for the e2b SDK's ``Sandbox``/``Template`` calls: API and sandbox traffic both go
        to the node (its proxy routes envd requests by the ``E2b-Sandbox-Id`` header)."""
        opts: dict[str, Any] = {"api_key": self.key, "api_url": self.url, "sandbox_url": self.url}
        if request_timeout is not None:
            opts["request_timeout"] = request_timeout
        return opts


    def sandbox(self, sandbox_id: str) -> Any:
        """The e2b SDK's ``Sandbox`` for SANDBOX_ID (a paused one is resumed). The node is asked first over REST,
        so an unknown id or an unreachable node is the same one line as for every other command."""
        self.api.request("GET", f"/sandboxes/{sandbox_id}")
        from e2b import Sandbox

        return Sandbox.connect(sandbox_id, **self.sdk_opts())

    def check(self) -> None:
        """Fail with one line now if the node cannot be reached or refuses the key (before an SDK call)."""
        self.api.request("GET", "/node")


def connection_options(fn: F) -> F:
    """Add ``--url`` and ``--key`` to a command and hand it a :class:`Conn` as ``conn`` (resolved lazily, so
    ``--help`` and argument errors never need a config)."""

    @click.option("--url", "url_", default=None, metavar="URL", help="The node's API URL (overrides `aenv auth`).")
    @click.option("--key", "key_", default=None, metavar="KEY", help="API key (overrides `aenv auth`).")
    @functools.wraps(fn)
    def wrapper(*args: Any, url_: str | None, key_: str | None, **kwargs: Any) -> Any:
        cfg = load_client_config(url_, key_)
        return fn(*args, conn=Conn(cfg["url"], cfg["api_key"]), **kwargs)

    return cast(F, wrapper)
