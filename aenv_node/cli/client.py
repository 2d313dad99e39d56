"""``aenv``: the client CLI for a node's API.

``aenv auth`` stores the server URL and API key in the user's config dir
(``$XDG_CONFIG_HOME/aenv/config.json``, mode 0600); other commands read them
(``AENV_URL`` / ``AENV_API_KEY`` override). Errors are one line on stderr and a
non-zero exit code; the server's E2B error message is shown as is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click
import httpx

from .. import __version__

__all__ = ["main", "client_config_path"]


def client_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "aenv" / "config.json"


def _load_client_config() -> dict[str, str]:
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
    if not cfg.get("url") or not cfg.get("api_key"):
        raise click.ClickException("not authenticated: run `aenv auth --url URL --key KEY` first")
    return cfg


class Api:
    def __init__(self, url: str, key: str) -> None:
        self.url = url.rstrip("/")
        self.client = httpx.Client(
            base_url=self.url, headers={"X-API-KEY": key, "User-Agent": f"aenv/{__version__}"},
            timeout=30.0,
        )

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = self.client.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise click.ClickException(f"cannot reach {self.url}: {exc}") from None
        if resp.status_code >= 400:
            try:
                message = resp.json()["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text.strip()[:200] or resp.reason_phrase
            raise click.ClickException(f"{resp.status_code}: {message}")
        return resp


def _api() -> Api:
    cfg = _load_client_config()
    return Api(cfg["url"], cfg["api_key"])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="aenv")
def main() -> None:
    """aenv: drive an aenv node (sandboxes, templates, snapshots)."""


@main.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The node's API URL.")
@click.option("--key", default=None, help="API key (default: read from --key-file).")
@click.option(
    "--key-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="File holding the API key (a local node's is <state-dir>/secrets/api-key).",
)
def auth(url: str, key: str | None, key_file: Path | None) -> None:
    """Store the server URL and API key for later commands (checked against the server)."""
    if key is None:
        if key_file is None:
            key_file = Path(os.environ.get("AENV_STATE_DIR", "/var/lib/aenv")) / "secrets" / "api-key"
        try:
            key = key_file.read_text().strip()
        except OSError as exc:
            raise click.ClickException(f"cannot read API key from {key_file}: {exc.strerror}") from None
    info = Api(url, key).request("GET", "/node").json()
    path = client_config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"url": url, "api_key": key}, fh)
    os.chmod(path, 0o600)
    click.echo(f"authenticated to node {info.get('nodeID')} at {url}; saved to {path}")


@main.command("ls")
@click.option("--state", "states", default="running,paused", show_default=True,
              help="Comma-separated states to list.")
@click.option("--metadata", "metadata", multiple=True, help="KEY=VALUE filter (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON.")
def ls(states: str, metadata: tuple[str, ...], as_json: bool) -> None:
    """List sandboxes."""
    from urllib.parse import quote, urlencode

    api = _api()
    params: dict[str, str] = {"state": states}
    if metadata:
        pairs = {}
        for item in metadata:
            if "=" not in item:
                raise click.ClickException(f"--metadata {item!r}: expected KEY=VALUE")
            k, v = item.split("=", 1)
            pairs[quote(k)] = quote(v)
        params["metadata"] = urlencode(pairs)
    rows: list[dict[str, Any]] = []
    token = None
    while True:
        if token:
            params["nextToken"] = token
        resp = api.request("GET", "/v2/sandboxes", params=params)
        rows.extend(resp.json())
        token = resp.headers.get("x-next-token")
        if not token:
            break
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no sandboxes")
        return
    header = ("SANDBOX ID", "TEMPLATE", "STATE", "STARTED", "ENDS", "METADATA")
    table = [header] + [
        (r["sandboxID"], r.get("alias") or r["templateID"], r["state"], r["startedAt"][:19],
         r["endAt"][:19], ",".join(f"{k}={v}" for k, v in (r.get("metadata") or {}).items()))
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    for row in table:
        click.echo("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
