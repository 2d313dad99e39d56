"""``aenv completion bash|zsh|fish``: print the shell's completion script (click's shell completion).

Install with e.g. ``aenv completion bash > ~/.local/share/bash-completion/completions/aenv`` or
``eval "$(aenv completion zsh)"`` in ``~/.zshrc``. The script calls ``aenv`` with ``_AENV_COMPLETE`` set, which
click answers before running any command.
"""

from __future__ import annotations

import click
from click.shell_completion import get_completion_class

__all__ = ["COMPLETE_VAR", "register"]

COMPLETE_VAR = "_AENV_COMPLETE"


@click.command("completion")
@click.argument("shell", type=click.Choice(["bash", "zsh", "fish"]))
@click.pass_context
def completion_cmd(ctx: click.Context, shell: str) -> None:
    """Print the completion script for SHELL (bash, zsh or fish)."""
    cls = get_completion_class(shell)
    if cls is None:  # pragma: no cover - click ships all three
        raise click.ClickException(f"no completion for {shell}")
    root = ctx.find_root().command
    click.echo(cls(root, {}, "aenv", COMPLETE_VAR).source())


def register(group: click.Group) -> None:
    group.add_command(completion_cmd)
