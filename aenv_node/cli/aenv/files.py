"""``aenv upload`` / ``aenv download``: files and whole directories, with progress for large transfers.

Through envd's file API (the e2b SDK's ``sandbox.files.write`` / ``read(format="stream")``), streamed both ways
so a large file is never held in memory. A directory travels as one gzipped tar: packed here and unpacked in the
guest with ``tar`` (``sandbox.commands.run``), or packed in the guest and unpacked here (members that would land
outside the target are refused: ``tarfile``'s ``data`` filter). The guest needs ``tar`` and ``gzip`` for
directories (``base`` and nearly every image have them).

Progress (rich) is shown on a terminal for transfers over :data:`PROGRESS_MIN_BYTES`.
"""

from __future__ import annotations

import os
import shlex
import sys
import tarfile
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import click

from .conn import Conn, connection_options

__all__ = ["PROGRESS_MIN_BYTES", "pack_dir", "register", "unpack_tar"]

PROGRESS_MIN_BYTES = 8 << 20
CHUNK = 1 << 20


@contextmanager
def _progress(label: str, total: Optional[int]) -> Iterator[Callable[[int], None]]:
    """A callback advancing a progress bar by n bytes (a no-op when small or not on a terminal)."""
    if not sys.stderr.isatty() or (total is not None and total < PROGRESS_MIN_BYTES):
        yield lambda n: None
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), transient=True) as progress:
        task = progress.add_task(label, total=total)
        yield lambda n: progress.advance(task, n)


def _chunks(path: Path, advance: Callable[[int], None]) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            advance(len(chunk))
            yield chunk


def pack_dir(src: Path, dest: Any) -> None:
    """A gzipped tar of SRC's contents (paths relative to SRC) into the binary file DEST."""
    with tarfile.open(fileobj=dest, mode="w:gz") as tar:
        for entry in sorted(src.iterdir()):
            tar.add(entry, arcname=entry.name)


def unpack_tar(archive: Path, dest: Path) -> None:
    """Unpack a (gzipped) tar into DEST, refusing members that would escape it (absolute paths, `..`, links out)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, mode="r:*") as tar:
        try:
            tar.extractall(dest, filter="data")
        except tarfile.FilterError as exc:
            raise click.ClickException(f"refusing the archive from the sandbox: {exc}") from None


def _guest(sandbox: Any, script: str) -> None:
    from e2b import CommandExitException

    try:
        sandbox.commands.run(script, user="root", timeout=0)
    except CommandExitException as exc:
        raise click.ClickException(" ".join((exc.stderr or exc.stdout or f"exit {exc.exit_code}").split())) from None


@click.command("upload")
@click.argument("sandbox_id")
@click.argument("local", type=click.Path(exists=True, path_type=Path))
@click.argument("remote")
@click.option("--user", default=None, help="Guest user owning the files (default `user`).")
@connection_options
def upload_cmd(conn: Conn, sandbox_id: str, local: Path, remote: str, user: str | None) -> None:
    """Copy LOCAL (a file or a directory) to REMOTE in the sandbox. A directory's contents land in REMOTE
    (created if missing); a file is written at REMOTE (parents created)."""

    sandbox = conn.sandbox(sandbox_id)
    if local.is_dir():
        with tempfile.TemporaryFile() as tmp:
            pack_dir(local, tmp)
            size = tmp.tell()
            tmp.seek(0)
            staged = f"/tmp/aenv-upload-{uuid.uuid4().hex}.tar.gz"

            def chunks(advance: Callable[[int], None]) -> Iterator[bytes]:
                while chunk := tmp.read(CHUNK):
                    advance(len(chunk))
                    yield chunk

            with _progress(f"upload {local.name}/", size) as advance:
                sandbox.files.write(staged, chunks(advance), user=user)
        owner = shlex.quote(user or "user")
        _guest(sandbox, f"set -e; mkdir -p {shlex.quote(remote)}; tar -xzf {staged} -C {shlex.quote(remote)} "
                        f"--no-same-owner; chown -R {owner}: {shlex.quote(remote)}; rm -f {staged}")
        click.echo(f"{local}/ -> {sandbox_id}:{remote} ({size} bytes packed)")
        return
    size = local.stat().st_size
    with _progress(f"upload {local.name}", size) as advance:
        sandbox.files.write(remote, _chunks(local, advance), user=user)
    click.echo(f"{local} -> {sandbox_id}:{remote} ({size} bytes)")


@click.command("download")
@click.argument("sandbox_id")
@click.argument("remote")
@click.argument("local", required=False, type=click.Path(path_type=Path))
@click.option("--user", default=None, help="Guest user reading the files (default `user`).")
@connection_options
def download_cmd(conn: Conn, sandbox_id: str, remote: str, local: Path | None, user: str | None) -> None:
    """Copy REMOTE (a file or a directory) from the sandbox to LOCAL (default: its name, here). A directory's
    contents land in LOCAL (created if missing); `-` as LOCAL writes a file to stdout."""
    from e2b import FileType

    sandbox = conn.sandbox(sandbox_id)
    info = sandbox.files.get_info(remote, user=user)
    target = local if local is not None else Path(os.path.basename(remote.rstrip("/")) or "download")
    if info.type == FileType.DIR:
        if str(local) == "-":
            raise click.ClickException(f"{remote} is a directory: give a LOCAL directory, not `-`")
        staged = f"/tmp/aenv-download-{uuid.uuid4().hex}.tar.gz"
        _guest(sandbox, f"tar -czf {staged} -C {shlex.quote(remote)} .")
        try:
            packed = sandbox.files.get_info(staged, user="root").size
            with tempfile.TemporaryDirectory() as tmpdir:
                archive = Path(tmpdir) / "dir.tar.gz"
                _stream_to(sandbox, staged, "root", archive, packed, f"download {target.name}/")
                unpack_tar(archive, target)
        finally:
            _guest(sandbox, f"rm -f {staged}")
        click.echo(f"{sandbox_id}:{remote} -> {target}/")
        return
    if str(local) == "-":
        with sandbox.files.read(remote, format="stream", user=user) as stream:
            for chunk in stream:
                sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()
        return
    if target.is_dir():
        target = target / os.path.basename(remote.rstrip("/"))
    _stream_to(sandbox, remote, user, target, info.size, f"download {target.name}")
    click.echo(f"{sandbox_id}:{remote} -> {target} ({info.size} bytes)")


def _stream_to(sandbox: Any, remote: str, user: str | None, target: Path, size: int, label: str) -> None:
    partial = target.with_name(target.name + ".aenv-partial")
    try:
        with _progress(label, size) as advance, open(partial, "wb") as fh, \
                sandbox.files.read(remote, format="stream", user=user) as stream:
            for chunk in stream:
                fh.write(chunk)
                advance(len(chunk))
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def register(group: click.Group) -> None:
    group.add_command(upload_cmd)
    group.add_command(download_cmd)
