"""``aenv``: the client CLI of a node (sandboxes, shells, files, templates, snapshots, events).

One module per concept, each registering its commands on :data:`cli`:

- :mod:`.conn`: the stored URL and key, ``--url``/``--key``, the REST client;
- :mod:`.output`: JSON, tables, ``K=V`` flags, one-line errors (:class:`.output.AenvGroup`);
- :mod:`.sandboxes`: ``start ls pause resume timeout rm fork``;
- :mod:`.shell`: ``cn`` and the shell ``start`` attaches (PTY, raw mode, resize);
- :mod:`.execute`: ``exec``;  :mod:`.files`: ``upload download``;
- :mod:`.templates` (+ :mod:`.dockerfile`, :mod:`.build_progress`): ``pull build template ls|rm|watch``;
- :mod:`.snapshots`: ``snapshot create|ls|rm``;  :mod:`.events`: ``events logs``;
- :mod:`.completion`: ``completion bash|zsh|fish``.

The client is pure Python and portable (macOS, arm64): nothing of the node is imported, the e2b SDK only
inside the commands that need it, ``termios``/``tty`` only when a shell is attached.
Every error leaves as one line on stderr (``Error: ...``) with a non-zero exit code: 2 for a bad flag or
argument, 130 for Ctrl-C, 1 otherwise; a command's own exit code (``exec``, ``cn``) passes through.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import click

from ... import __version__
from . import completion, events, execute, files, sandboxes, shell, snapshots, templates
from .conn import Api, client_config_path, save_client_config
from .output import AenvGroup

__all__ = ["cli", "client_config_path", "main"]


@click.group(cls=AenvGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="aenv")
def cli() -> None:
    """aenv: drive an aenv node (sandboxes, templates, snapshots).

    Run `aenv auth` once; `--url`/`--key` on any command (or AENV_URL/AENV_API_KEY) override it.
    """


@cli.command()
@click.option("--url", default="http://127.0.0.1:8000", show_default=True, help="The node's API URL.")
@click.option("--key", default=None, help="API key (default: read from --key-file).")
@click.option("--key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="File holding the API key (a local node's is <state-dir>/secrets/api-key).")
def auth(url: str, key: Optional[str], key_file: Optional[Path]) -> None:
    """Store the server URL and API key for later commands (checked against the server)."""
    if key is None:
        if key_file is None:
            key_file = Path(os.environ.get("AENV_STATE_DIR", "/var/lib/aenv")) / "secrets" / "api-key"
        try:
            key = key_file.read_text().strip()
        except OSError as exc:
            raise click.ClickException(f"cannot read API key from {key_file}: {exc.strerror}") from None
    info = Api(url, key).json("GET", "/node")
    path = save_client_config(url, key)
    click.echo(f"authenticated to node {info.get('nodeID')} at {url}; saved to {path}")


for _module in (sandboxes, shell, execute, files, templates, snapshots, events, completion):
    _module.register(cli)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The ``aenv`` entry point: click's own error display (usage, blank line, error) is folded into one line."""
    try:
        rv = cli.main(args=list(argv) if argv is not None else None, prog_name="aenv", standalone_mode=False)
    except click.UsageError as exc:
        hint = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
        click.echo(f"Error: {' '.join(exc.format_message().split())}{hint}", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        click.echo(f"Error: {' '.join(exc.format_message().split())}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("Error: interrupted", err=True)
        sys.exit(130)
    sys.exit(rv if isinstance(rv, int) else 0)
