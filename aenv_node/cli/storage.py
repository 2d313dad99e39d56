"""``aenv-node layer|image|cache``: administer the layered block storage by hand.

These commands drive the same storage core the node uses (``aenv_node.storage``), against the repository the
node's ``[storage]`` config names, and record what they create in the node's SQLite database, so what an operator
does here is what the node sees:

* ``layer import FILE``: a raw disk image (an ext4 file, a device) becomes a base layer in the repository;
* ``image serve``: a stack of repository layers plus a writable upper, served over NBD until SIGTERM/SIGINT
  (for debugging a sandbox disk, or feeding a VMM started by hand);
* ``image seal``: an upper becomes a new layer in the repository and continues, empty, on top of it;
* ``cache stats``: what the local layer cache holds and how it has been used (``cache_entries``).

An upper records the digests of the layers it sits on (``Upper.peek``), so ``seal`` needs only the upper
directory, and ``serve`` can reopen an upper without ``--layers``.  ``serve`` and ``seal`` take an exclusive
``flock`` on the upper directory: sealing an upper that a server is writing would lose writes.

This module builds its ``Config`` through ``_common.build_config`` (the same code ``node.pass_config`` runs)
rather than importing ``node``: ``node`` imports this module while it is itself being imported, and importing it
back would leave the plug-in groups unregistered whenever this module happens to be imported first.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..config import Config
from ..storage.repository import repository_from_config
from ._common import build_config, one_line_errors, state_dir_option

if TYPE_CHECKING:
    from ..state import Database
    from ..storage.layer import LayerInfo
    from ..storage.repository import Repository

__all__ = ["cache", "image", "layer"]

_DIGEST_PREFIX = "sha256:"
_IMPORT_CHUNK = 4 << 20  # the read size of ``storage.importer.import_raw`` (same layer bytes either way)


# -- plumbing -------------------------------------------------------------------------------------------------
def pass_config(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add ``--state-dir`` and call ``fn(cfg, **options)`` with the effective Config; errors become one line."""

    @state_dir_option
    @click.pass_context
    @one_line_errors
    def wrapper(ctx: click.Context, state_dir: Path | None, **kwargs: Any) -> Any:
        obj = ctx.find_root().obj or {}
        cfg = build_config(obj.get("config_path"), state_dir or obj.get("state_dir"))
        return ctx.invoke(fn, cfg, **kwargs)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


def _fail(message: str) -> click.ClickException:
    return click.ClickException(message)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


def _parse_size(text: str) -> int:
    m = _SIZE_RE.match(text)
    if m is None:
        raise _fail(f"not a size: {text!r} (bytes, or a number with K, M, G or T: 10G)")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


class _Status:
    """A status line on stderr for a step that reports no progress of its own: on a terminal it ticks the
    elapsed seconds (a thread started and joined here); otherwise one line when it starts and one when it ends."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            click.echo(f"\r{self.what} ... {time.monotonic() - self._t0:.0f} s", err=True, nl=False)

    def __enter__(self) -> _Status:
        self._t0 = time.monotonic()
        click.echo(f"{self.what} ...", err=True, nl=not self._tty)
        if self._tty:
            self._thread = threading.Thread(target=self._tick, name="aenv-status", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        outcome = "failed" if exc_type is not None else "done"
        lead = "\r" if self._tty else ""
        click.echo(f"{lead}{self.what}: {outcome} in {time.monotonic() - self._t0:.1f} s", err=True)


def _database(cfg: Config) -> Database:
    from ..state import Database

    db = Database(cfg.database_path)
    db.upgrade()
    return db


def _staging_dir(cfg: Config, prefix: str) -> Path:
    """A private directory for a layer file before it is committed to the repository (removed by the caller)."""
    base = cfg.state_dir / "tmp"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def _full_digest(d: str) -> str:
    """Uppers written by the node's runtime record bare hex digests; the repository wants ``sha256:<hex>``."""
    return d if d.startswith(_DIGEST_PREFIX) else _DIGEST_PREFIX + d


def _check_in_repository(repo: Repository, digests: Sequence[str]) -> None:
    from ..storage.repository import LayerNotFound
    from ..storage.repository.base import check_digest

    for d in digests:
        check_digest(d)
    missing = [d for d in digests if not repo.has_layer(d)]
    if missing:
        raise LayerNotFound(missing[0], f"{repo!r}" + (f"; {len(missing) - 1} more missing" if len(missing) > 1
                                                       else ""))


def _record_layer(cfg: Config, digest: str, info: LayerInfo, location: str) -> None:
    """Add the layer's row to ``layers`` as a layer of the repository, under the key ``location`` (no local
    file: the staging copy goes); kept as is if the layer was already known (content-addressed)."""
    from ..state import Layer, LayerKind

    db = _database(cfg)
    try:
        with db.session() as s:
            if s.get(Layer, digest) is None:
                s.add(Layer(digest=digest, kind=LayerKind.DISK, size_bytes=info.file_size,
                            virtual_size_bytes=info.virtual_size, local_path=None, repository_key=location,
                            refcount=0))
    finally:
        db.close()


@contextlib.contextmanager
def _locked_upper(upper_dir: Path) -> Iterator[None]:
    """Exclusive use of an upper directory by this process (``flock``: released if the process dies)."""
    fd = os.open(upper_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _fail(f"upper {upper_dir} is in use by another process (an 'image serve'?); stop it first") \
                from None
        yield
    finally:
        os.close(fd)


# -- layer ----------------------------------------------------------------------------------------------------
@click.group()
def layer() -> None:
    """Layers in the repository."""


def _build_base_layer(path: Path, dest_dir: Path, virtual_size: int | None, compression: str | None) -> LayerInfo:
    """What ``storage.importer.import_raw`` does, with a progress bar (the same layer bytes: a test checks it)."""
    from ..storage import layer_format as F
    from ..storage.importer import data_segments
    from ..storage.layer import LayerWriter

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)  # st_size is 0 for a block device
        if size == 0:
            raise _fail(f"{path} is empty: nothing to import")
        vsize = virtual_size if virtual_size is not None else F.round_up(size)
        if vsize % F.BLOCK:
            raise _fail(f"--virtual-size {vsize} is not a multiple of {F.BLOCK}")
        if vsize < size:
            raise _fail(f"--virtual-size {vsize} is smaller than {path} ({size} bytes)")
        segments = list(data_segments(fd, size))
        total = sum(b - a for a, b in segments)
        with LayerWriter(dest_dir, vsize, compression=compression, zero_blocks="omit") as w:
            with click.progressbar(length=max(total, 1), label=f"importing {path.name} ({_human(total)} of data)",
                                   file=sys.stderr, show_pos=False) as bar:
                for a, b in segments:
                    for pos in range(a, b, _IMPORT_CHUNK):
                        n = min(_IMPORT_CHUNK, b - pos)
                        data = os.pread(fd, n, pos)
                        if len(data) < n:  # the last partial block of a file not 4 KiB-aligned
                            data += bytes(n - len(data))
                        w.add_data(pos, data)
                        bar.update(n)
            return w.finish()
    finally:
        os.close(fd)


@layer.command("import")
@click.argument("file", type=click.Path(path_type=Path))
@click.option("--virtual-size", "virtual_size", default=None, metavar="SIZE",
              help="Disk size of the layer (e.g. 10G; default: FILE's size rounded up to 4 KiB).")
@click.option("--compress", is_flag=True, help="Store the data zstd-compressed (smaller, slower to read).")
@pass_config
def layer_import(cfg: Config, file: Path, virtual_size: str | None, compress: bool) -> None:
    """Import the raw disk image FILE (e.g. an ext4 filesystem image) as a base layer; print its digest."""
    if not file.exists():
        raise _fail(f"{file}: no such file")
    if file.is_dir():
        raise _fail(f"{file} is a directory, not a disk image")
    vsize = _parse_size(virtual_size) if virtual_size is not None else None
    repo = repository_from_config(cfg)
    staging = _staging_dir(cfg, "import-")
    try:
        info = _build_base_layer(file, staging, vsize, "zstd" if compress else None)
        digest = _DIGEST_PREFIX + info.digest
        with _Status(f"storing {digest[:19]}... ({_human(info.file_size)}) in {repo!r}"):
            location = repo.put_layer(digest, info.path)
        _record_layer(cfg, digest, info, location)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        repo.close()
    click.echo(digest)


# -- image ----------------------------------------------------------------------------------------------------
@click.group()
def image() -> None:
    """Images: a stack of layers plus a writable upper."""


def _split_digests(text: str) -> list[str]:
    from ..storage.repository.base import check_digest

    out = [d.strip() for d in text.split(",") if d.strip()]
    if not out:
        raise _fail("--layers names no layer")
    for d in out:
        check_digest(d)
    return out


def _upper_state(upper_dir: Path) -> tuple[int, list[str] | None] | None:
    """(size, recorded stack) of the upper in ``upper_dir``; None for a new or empty directory.  A directory
    that holds other things is refused rather than turned into an upper."""
    from ..storage.upper import Upper

    if upper_dir.exists() and not upper_dir.is_dir():
        raise _fail(f"--upper {upper_dir} is not a directory")
    peek = Upper.peek(upper_dir)
    if peek is None and upper_dir.is_dir() and any(upper_dir.iterdir()):
        raise _fail(f"--upper {upper_dir} holds no writable upper and is not empty; give an empty or new directory")
    return peek


@image.command("serve")
@click.option("--layers", "layers_opt", default=None, metavar="DIGEST[,DIGEST...]",
              help="The layers, bottom first (default: the stack the upper records).")
@click.option("--upper", "upper_dir", type=click.Path(path_type=Path), default=None,
              help="Directory of the writable upper (created if new). Without it the image is read-only.")
@click.option("--nbd", "socket_path", type=click.Path(path_type=Path), required=True,
              help="Unix socket to serve NBD on.")
@click.option("--cache/--no-cache", "use_cache", default=None,
              help="Read layers through the local cache (default: only when the repository is remote).")
@pass_config
def image_serve(cfg: Config, layers_opt: str | None, upper_dir: Path | None, socket_path: Path,
                use_cache: bool | None) -> None:
    """Serve a layer stack (and upper) over NBD until SIGTERM or SIGINT; print the NBD URI when ready."""
    digests = _split_digests(layers_opt) if layers_opt is not None else None
    if upper_dir is None and digests is None:
        raise _fail("give --layers, --upper, or both")
    peek = _upper_state(upper_dir) if upper_dir is not None else None
    if peek is not None and peek[1] is not None:
        recorded = [_full_digest(d) for d in peek[1]]
        if digests is None:
            digests = recorded
        elif digests != recorded:
            raise _fail(f"upper {upper_dir} was written over layers {','.join(recorded)}; serve it with those "
                        f"(or omit --layers), or use a new --upper directory")
    if digests is None:
        raise _fail(f"upper {upper_dir} records no layer stack; give --layers")
    if upper_dir is not None:
        created = not upper_dir.exists()
        upper_dir.mkdir(parents=True, exist_ok=True)
        try:
            with _locked_upper(upper_dir):
                _trio_run(_serve, cfg, digests, upper_dir, peek, socket_path, use_cache)
        except BaseException:
            if created:
                with contextlib.suppress(OSError):
                    upper_dir.rmdir()  # only if still empty: nothing was written into it
            raise
    else:
        _trio_run(_serve, cfg, digests, None, None, socket_path, use_cache)


def _trio_run(fn: Callable[..., Any], *args: Any) -> Any:
    """``trio.run``, raising a lone error out of nurseries as itself (so it is reported as one line)."""
    import trio

    try:
        return trio.run(fn, *args)
    except BaseExceptionGroup as group:
        leaves: list[BaseException] = []

        def walk(g: BaseExceptionGroup) -> None:
            for e in g.exceptions:
                walk(e) if isinstance(e, BaseExceptionGroup) else leaves.append(e)

        walk(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise


async def _serve(cfg: Config, digests: list[str], upper_dir: Path | None, peek: tuple[int, Any] | None,
                 socket_path: Path, use_cache: bool | None) -> None:
    import trio

    from ..storage.cache import LayerCache, run_janitor
    from ..storage.cache_store import CacheStore
    from ..storage.frontends import serve_nbd
    from ..storage.image import Image
    from ..storage.layer_pool import LayerPool
    from ..storage.source import FileSource, RandomAccessSource
    from ..storage.upper import Upper

    # Open the receiver first: a signal that arrives while the image is being opened still ends the run cleanly.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        repo = await trio.to_thread.run_sync(repository_from_config, cfg)
        db = None
        cache: LayerCache | None = None
        img: Image | None = None
        readers: list[Any] = []
        try:
            await trio.to_thread.run_sync(_check_in_repository, repo, digests)
            local = repo.local_path(digests[0]) is not None
            via_cache = (not local) if use_cache is None else use_cache
            if via_cache:
                st = cfg.storage

                def open_cache() -> tuple[Any, LayerCache]:
                    database = _database(cfg)
                    return database, LayerCache(cfg.cache_dir, repo, capacity_bytes=st.cache_capacity_bytes,
                                                high_watermark=st.cache_high_watermark,
                                                low_watermark=st.cache_low_watermark, store=CacheStore(database))

                db, c = await trio.to_thread.run_sync(open_cache)
                cache = c

                def opener(d: str) -> RandomAccessSource:
                    return c.source(d)
            else:

                def opener(d: str) -> RandomAccessSource:
                    path = repo.local_path(d)
                    if path is None:
                        raise ValueError(f"layer {d} is not a file on this node ({repo.kind} repository): "
                                         "read it through the cache")
                    return FileSource(path)

            pool = LayerPool(opener=opener)
            readers = [await trio.to_thread.run_sync(pool.get, d) for d in digests]
            size = max(r.virtual_size for r in readers)
            if peek is not None and peek[0] != size:
                raise _fail(f"upper {upper_dir} is for a {peek[0]}-byte disk; these layers make {size} bytes")

            def open_image() -> Image:
                upper = Upper(upper_dir, size) if upper_dir is not None else None
                try:
                    return Image(readers, upper, size=size)
                except BaseException:
                    if upper is not None:
                        upper.close()
                    raise

            img = await trio.to_thread.run_sync(open_image)
            async with trio.open_nursery() as nursery:
                if cache is not None:
                    await nursery.start(run_janitor, cache)
                async with serve_nbd(img, socket_path, read_only=img.read_only) as server:
                    mode = "read-only" if img.read_only else f"upper {upper_dir}"
                    click.echo(f"serving {len(digests)} layer(s), {_human(size)}, {mode}"
                               f"{' via the cache' if cache is not None else ''}; SIGTERM or Ctrl-C stops",
                               err=True)
                    click.echo(server.uri)
                    sys.stdout.flush()
                    async for signum in signals:
                        click.echo(f"{signal.Signals(signum).name}: flushing and stopping", err=True)
                        break
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                if img is not None:
                    await trio.to_thread.run_sync(img.close)  # flushes the upper
                for r in readers:
                    r.close()
                if cache is not None:
                    await trio.to_thread.run_sync(cache.close)
                if db is not None:
                    db.close()
                repo.close()


@image.command("seal")
@click.option("--upper", "upper_dir", type=click.Path(path_type=Path), required=True,
              help="Directory of the writable upper to seal.")
@pass_config
def image_seal(cfg: Config, upper_dir: Path) -> None:
    """Seal an upper into a new layer in the repository; the upper continues, empty, on top of it.
    Prints the new layer's digest."""
    from ..storage.seal import seal_upper
    from ..storage.upper import Upper

    if not upper_dir.is_dir():
        raise _fail(f"--upper {upper_dir} is not a directory")
    with _locked_upper(upper_dir):
        peek = Upper.peek(upper_dir)
        if peek is None:
            raise _fail(f"{upper_dir} holds no writable upper (no committed log.N and data.N)")
        size, stack = peek
        if stack is None:
            raise _fail(f"upper {upper_dir} records no layer stack, so the sealed layer could not be stacked again")
        repo = repository_from_config(cfg)
        staging: Path | None = None
        try:
            _check_in_repository(repo, [_full_digest(d) for d in stack])
            staging = _staging_dir(cfg, "seal-")
            up = Upper(upper_dir, size)
            try:
                written = sum(n for _, n, st in up.all_runs() if st >= 0) * 4096
                with _Status(f"sealing {upper_dir} ({_human(written)} written)"):
                    info = seal_upper(up, staging)
                digest = _DIGEST_PREFIX + info.digest
                with _Status(f"storing {digest[:19]}... ({_human(info.file_size)}) in {repo!r}"):
                    location = repo.put_layer(digest, info.path)
                _record_layer(cfg, digest, info, location)
                # The commit point: the upper now sits on the new layer (same digest style as its stack).
                bare = bool(stack) and not any(d.startswith(_DIGEST_PREFIX) for d in stack)
                up.reset(list(stack) + [info.digest if bare else digest]).close()
            finally:
                up.abandon()  # nothing pending: seal_upper flushed it, and this process wrote nothing
        finally:
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
            repo.close()
    click.echo(digest)


# -- cache ----------------------------------------------------------------------------------------------------
@click.group()
def cache() -> None:
    """The local layer cache."""


def _iso(t: dt.datetime | None) -> str | None:
    if t is None:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.isoformat(timespec="seconds")


@cache.command("stats")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@pass_config
def cache_stats(cfg: Config, as_json: bool) -> None:
    """Cache usage per layer (from the database's cache_entries) and totals."""
    from sqlalchemy import select

    from ..state import CacheEntry

    db = _database(cfg)
    try:
        with db.session() as s:
            rows = s.scalars(select(CacheEntry).order_by(CacheEntry.last_access_at.desc())).all()
    finally:
        db.close()
    fields = ("size_bytes", "cached_bytes", "hits", "misses", "fetched_bytes", "evicted_bytes")
    layers = [
        {"digest": r.layer_digest, **{f: getattr(r, f) for f in fields}, "path": r.path,
         "created_at": _iso(r.created_at), "last_access_at": _iso(r.last_access_at)}
        for r in rows
    ]
    totals = {"layers": len(layers), **{f: sum(x[f] for x in layers) for f in fields}}
    st = cfg.storage
    capacity = {"capacity_bytes": st.cache_capacity_bytes, "high_watermark": st.cache_high_watermark,
                "low_watermark": st.cache_low_watermark, "cache_dir": str(cfg.cache_dir)}
    if as_json:
        click.echo(json.dumps({"cache": capacity, "layers": layers, "totals": totals}, indent=2))
        return
    head = ("LAYER", "SIZE", "CACHED", "HITS", "MISSES", "FETCHED", "EVICTED", "LAST ACCESS")
    table = [head]
    for x in layers:
        last = (x["last_access_at"] or "-").replace("T", " ").replace("+00:00", "Z")
        table.append((x["digest"][:19], _human(x["size_bytes"]), _human(x["cached_bytes"]), str(x["hits"]),
                      str(x["misses"]), _human(x["fetched_bytes"]), _human(x["evicted_bytes"]), last))
    table.append(("TOTAL", _human(totals["size_bytes"]), _human(totals["cached_bytes"]), str(totals["hits"]),
                  str(totals["misses"]), _human(totals["fetched_bytes"]), _human(totals["evicted_bytes"]), ""))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        click.echo("  ".join(c.ljust(w) if i in (0, 7) else c.rjust(w)
                             for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    used = totals["cached_bytes"] / st.cache_capacity_bytes if st.cache_capacity_bytes else 0.0
    click.echo(f"{cfg.cache_dir}: {_human(totals['cached_bytes'])} of {_human(st.cache_capacity_bytes)} "
               f"({used:.1%}; evicts above {st.cache_high_watermark:.0%} down to {st.cache_low_watermark:.0%})")
