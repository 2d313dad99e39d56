"""``aenv-node kit build`` and ``aenv-node rootfs build-base``: build the guest kit and the base template rootfs.

Two click groups (``kit``, ``rootfs``) that ``aenv-node`` registers; also runnable on their own with
``python -m aenv_node.cli.kit kit build``. They build into the node's images cache directory (``[images]
cache_dir`` in the config, default the state directory), where the node looks for them. Progress goes to
stderr with elapsed times; the resulting paths go to stdout as JSON so scripts can consume them.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from aenv_node.images import ensure_base_rootfs, ensure_kit
from aenv_node.images.errors import ImageError

from ._common import build_config, config_option, one_line_errors, state_dir_option


def _cache_dir(config_path: Path | None, state_dir: Path | None) -> Path:
    """Where the node looks for kits and root filesystems (``[images] cache_dir``, default the state dir)."""
    return build_config(config_path, state_dir).images_cache_dir


def _progress() -> tuple[float, Callable[[str], None]]:
    t0 = time.monotonic()

    def say(msg: str) -> None:
        click.echo(f"[{time.monotonic() - t0:6.1f}s] {msg}", err=True)

    return t0, say


@click.group("kit")
def kit() -> None:
    """The guest kit: kernel, initramfs and tools drive shared by all sandboxes."""


@kit.command("build")
@state_dir_option
@config_option
@one_line_errors
def kit_build(state_dir: Path | None, config_path: Path | None) -> None:
    """Build the guest kit if its inputs changed (otherwise print the cached one)."""
    t0, say = _progress()
    try:
        kit = ensure_kit(_cache_dir(config_path, state_dir), progress=say)
    except ImageError as e:
        raise click.ClickException(str(e)) from e
    click.echo(
        json.dumps(
            {
                "hash": kit.hash,
                "kernel_version": kit.kernel_version,
                "vmlinuz": str(kit.vmlinuz),
                "vmlinux": str(kit.vmlinux),
                "initramfs": str(kit.initramfs),
                "tools_img": str(kit.tools_img),
                "seconds": round(time.monotonic() - t0, 2),
            },
            indent=2,
        )
    )


@click.group("rootfs")
def rootfs() -> None:
    """Template root filesystems."""


@rootfs.command("build-base")
@state_dir_option
@config_option
@one_line_errors
def rootfs_build_base(state_dir: Path | None, config_path: Path | None) -> None:
    """Build the `base` template rootfs (Debian bookworm minbase) if its inputs changed."""
    t0, say = _progress()
    try:
        path = ensure_base_rootfs(_cache_dir(config_path, state_dir), progress=say)
    except ImageError as e:
        raise click.ClickException(str(e)) from e
    click.echo(json.dumps({"rootfs": str(path), "seconds": round(time.monotonic() - t0, 2)}, indent=2))


@click.group()
def main() -> None:
    """Guest kit and template rootfs builders (standalone entry; normally under `aenv-node`)."""


main.add_command(kit)
main.add_command(rootfs)

if __name__ == "__main__":
    sys.exit(main())
