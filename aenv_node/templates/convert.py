"""OCI image -> block layers: each OCI layer applied on its parent's filesystem and sealed, keyed by its chain.

A template built from an image boots a disk whose stack is:

    empty ext4  |  one block layer per OCI layer, base first  |  provisioning  |  (build steps, boot upper)

Every block layer is keyed by its **chain id**: the bottom one by the empty filesystem's format, each next one
by ``sha256(parent chain id + " " + diff id)`` (OCI's ChainID, salted with our bottom), the provisioning layer
by the image's top chain and :data:`~.provision.PROVISION_VERSION`. The keys live in ``image_layers``
(``state.ImageLayer``), so two images sharing base layers share those block layers, and a second pull of a
shared base converts nothing. A chain is converted by one build at a time (a lock per chain id); a layer
becomes visible (its row written, its file named by digest) only once sealed, so an interrupted conversion
leaves nothing another build could pick up.

The untar itself runs in a subprocess (``python -m aenv_node.images.oci.unpack``): a multi-GiB layer must
neither hold the node's interpreter against its own FUSE server, which serves the very filesystem being
written, nor make the node's memory depend on a layer's size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import trio
from sqlalchemy.orm import Session

from ..images.oci import OciLayer, PulledImage
from ..state import Database, EventSubject, ImageLayer, Layer, LayerKind, PulledImage as PulledImageRow, utcnow
from ..state.repository import record_event
from ..storage import LayerInfo, import_raw
from .errors import TemplateBuildError
from .host_mount import make_empty_ext4, mount_for_change
from .provision import PROVISION_VERSION, Provisioned, provision_root

__all__ = ["ConvertedImage", "ImageConverter", "chain_id"]

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

#: The bottom filesystem: small (a layer that needs more grows it), with room reserved to grow 1024-fold.
EMPTY_FS_BYTES = 1 << 30
EMPTY_FS_KEY = f"aenv:empty-ext4:v1:{EMPTY_FS_BYTES}"
_ALIGN = 64 << 20


def chain_id(parent: str | None, diff_id: str) -> str:
    """The chain id of a layer ``diff_id`` over ``parent`` (None: the bottom)."""
    text = diff_id if parent is None else f"{parent} {diff_id}"
    return hashlib.sha256(text.encode()).hexdigest()


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class ConvertedImage:
    """An image ready to boot: its block layers (bottom first), the disk size they need, the chain ids, and what
    provisioning found."""

    digest: str
    layers: tuple[Path, ...]
    chain: tuple[str, ...]
    size: int
    provisioned: Provisioned | None  # None when the provisioning layer came from the cache
    converted: int  # layers converted by this call (0: everything was cached)


class ImageConverter:
    """Converts pulled images into block layers in ``layers_dir``, sharing them by chain id."""

    def __init__(self, db: Database, *, layers_dir: Path, work_root: Path, run_root: Path) -> None:
        self.db = db
        self.layers_dir = layers_dir
        self.work_root = work_root
        self.run_root = run_root
        self._locks: dict[str, trio.Lock] = {}
        self._sessions = 0  # builds in progress (``session``)
        self._touched: set[str] = set()  # layer digests they found or made

    # -- what builds in progress use ----------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        """Hold for a build: while any build is in progress, every converted layer a build found or made counts
        as in use (``in_use``), so the cache's expiry (``cache_expiry``) leaves it however short its TTL."""
        self._sessions += 1
        try:
            yield
        finally:
            self._sessions -= 1
            if self._sessions == 0:
                self._touched.clear()

    def in_use(self) -> frozenset[str]:
        """Layer digests builds in progress found or made."""
        return frozenset(self._touched)

    # -- the cache --------------------------------------------------------------------------------------------
    async def cached(self, chain: str) -> tuple[Path, int] | None:
        """The layer file and virtual size of ``chain`` when converted and still on disk."""

        def q(s: Session) -> tuple[str, str | None, int] | None:
            row = s.get(ImageLayer, chain)
            if row is None:
                return None
            row.last_used_at = utcnow()  # its time to expire starts again (in this transaction: see cache_expiry)
            layer = s.get(Layer, row.layer_digest)
            return (layer.digest, layer.local_path, layer.virtual_size_bytes) if layer is not None else None

        found = await self.db.run(q)
        if found is None or found[1] is None or not Path(found[1]).is_file():
            return None
        if self._sessions:
            self._touched.add(found[0])
        return Path(found[1]), found[2]

    async def record(self, chain: str, parent: str | None, diff_id: str, info: LayerInfo, source: str,
                      convert_ms: float, detail: dict[str, object]) -> None:
        digest = f"sha256:{info.digest}"

        def write(s: Session) -> None:
            if s.get(Layer, digest) is None:
                s.add(Layer(digest=digest, kind=LayerKind.DISK, size_bytes=info.file_size,
                            virtual_size_bytes=info.virtual_size, local_path=str(info.path), refcount=0))
                s.flush()
            now = utcnow()
            s.merge(ImageLayer(chain_id=chain, parent_chain_id=parent, diff_id=diff_id, layer_digest=digest,
                               first_source=source, convert_ms=convert_ms, created_at=now, last_used_at=now))
            record_event(s, "image_layer", subject=EventSubject.IMAGE, subject_id=chain, duration_ms=convert_ms,
                         detail={"diff_id": diff_id, "layer": digest, "bytes": info.file_size, **detail})

        if self._sessions:
            self._touched.add(digest)
        await self.db.run(write)

    # -- steps ------------------------------------------------------------------------------------------------
    async def _empty_fs(self, say: Progress) -> tuple[str, Path, int]:
        chain = chain_id(None, EMPTY_FS_KEY)
        async with self._lock(chain):
            hit = await self.cached(chain)
            if hit is not None:
                return chain, hit[0], hit[1]
            t0 = time.monotonic()
            work = self.work_root / f"empty-{chain[:12]}"
            work.mkdir(parents=True, exist_ok=True)
            try:
                raw = work / "empty.ext4"
                await trio.to_thread.run_sync(make_empty_ext4, raw, EMPTY_FS_BYTES)
                self.layers_dir.mkdir(parents=True, exist_ok=True)
                info = await trio.to_thread.run_sync(import_raw, raw, self.layers_dir)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            ms = (time.monotonic() - t0) * 1000
            await self.record(chain, None, EMPTY_FS_KEY, info, "", ms, {})
            say(f"empty ext4 ({_mib(EMPTY_FS_BYTES)}) made in {ms / 1000:.1f}s")
            return chain, Path(info.path), info.virtual_size

    def _lock(self, chain: str) -> trio.Lock:
        return self._locks.setdefault(chain, trio.Lock())

    async def _convert_layer(self, layer: OciLayer, parent: str, stack: list[Path], size: int, source: str,
                             index: str, say: Progress) -> tuple[str, Path, int, bool]:
        chain = chain_id(parent, layer.diff_id)
        async with self._lock(chain):
            hit = await self.cached(chain)
            if hit is not None:
                say(f"layer {index} {layer.digest[:19]}… ({_mib(layer.size)}): already converted")
                return chain, hit[0], hit[1], False
            t0 = time.monotonic()
            room = max(64 << 20, 4 * layer.size)  # the uncompressed size is only known once read
            device = _round_up(size + room)
            async with mount_for_change(stack, size=device, upper_dir=self.work_root / f"cv-{chain[:12]}",
                                        run_dir=self.run_root / f"cv-{chain[:8]}", layers_dir=self.layers_dir,
                                        min_free=room) as fs:
                stats = await _unpack(layer, fs.root)
                fs.commit()
            assert fs.sealed is not None
            ms = (time.monotonic() - t0) * 1000
            await self.record(chain, parent, layer.diff_id, fs.sealed, source, ms,
                               {"oci_layer": layer.digest, "media_type": layer.media_type, "tar": stats})
            say(f"layer {index} {layer.digest[:19]}… ({_mib(layer.size)}): {stats.get('entries', '?')} entries "
                f"applied in {ms / 1000:.1f}s -> block layer {_mib(fs.sealed.file_size)}")
            return chain, Path(fs.sealed.path), fs.sealed.virtual_size, True

    async def _provision(self, parent: str, stack: list[Path], size: int, source: str,
                         say: Progress) -> tuple[str, Path, int, Provisioned | None]:
        key = f"aenv:provision:v{PROVISION_VERSION}"
        chain = chain_id(parent, key)
        async with self._lock(chain):
            hit = await self.cached(chain)
            if hit is not None:
                say("provisioning: already done for this image")
                return chain, hit[0], hit[1], None
            t0 = time.monotonic()
            async with mount_for_change(stack, size=size, upper_dir=self.work_root / f"pv-{chain[:12]}",
                                        run_dir=self.run_root / f"pv-{chain[:8]}", layers_dir=self.layers_dir,
                                        min_free=16 << 20) as fs:
                done = await trio.to_thread.run_sync(provision_root, fs.root)
                fs.commit()
            assert fs.sealed is not None
            ms = (time.monotonic() - t0) * 1000
            await self.record(chain, parent, key, fs.sealed, source, ms,
                               {"user": done.user, "uid": done.uid, "created_user": done.created_user,
                                "sudo": done.sudo})
            say(f"provisioning: user {done.user} (uid {done.uid}{', created' if done.created_user else ''}"
                f"{', sudo' if done.sudo else ''}), hosts, resolv.conf in {ms / 1000:.1f}s")
            return chain, Path(fs.sealed.path), fs.sealed.virtual_size, done

    # -- the whole image --------------------------------------------------------------------------------------
    async def convert(self, image: PulledImage, *, progress: Progress | None = None) -> ConvertedImage:
        """The block layers of ``image`` (converting what no earlier image converted), provisioned."""
        say = progress or (lambda _line: None)
        chain, path, size = await self._empty_fs(say)
        stack, chains = [path], [chain]
        converted = 0
        n = len(image.layers)
        for i, layer in enumerate(image.layers, 1):
            chain, path, vsize, done_now = await self._convert_layer(layer, chain, stack, size, image.reference,
                                                                     f"{i}/{n}", say)
            converted += done_now
            stack.append(path)
            chains.append(chain)
            size = max(size, vsize)
        top = chain
        chain, path, vsize, done = await self._provision(top, stack, size, image.reference, say)
        stack.append(path)
        chains.append(chain)
        size = max(size, vsize)
        await self._record_image(image, top)
        return ConvertedImage(image.digest, tuple(stack), tuple(chains), size, done, converted)

    async def _record_image(self, image: PulledImage, top: str) -> None:
        cfg = image.config
        config = {"env": list(cfg.env), "working_dir": cfg.working_dir, "user": cfg.user, "cmd": list(cfg.cmd),
                  "entrypoint": list(cfg.entrypoint)}

        def write(s: Session) -> None:
            s.merge(PulledImageRow(digest=image.digest, canonical=image.canonical, reference=image.reference,
                                   config=config, layer_count=len(image.layers),
                                   compressed_bytes=sum(layer.size for layer in image.layers), top_chain_id=top,
                                   pulled_at=utcnow()))
            record_event(s, "image_pull", subject=EventSubject.IMAGE, subject_id=image.digest.removeprefix("sha256:"),
                         detail={"reference": image.reference, "canonical": image.canonical, "top_chain": top})

        # two builds of one image finish together: the second merge must see the first's row (SQLite merges
        # by a read, then an insert: without the lock both inserted and one failed on images.digest)
        async with self._lock(f"image:{image.digest}"):
            await self.db.run(write)


async def _unpack(layer: OciLayer, root: Path) -> dict[str, object]:
    """Apply ``layer`` onto the mounted ``root`` in a subprocess (see the module docstring)."""
    argv = [sys.executable, "-m", "aenv_node.images.oci.unpack", "--blob", str(layer.path),
            "--media-type", layer.media_type, "--diff-id", layer.diff_id, str(root)]  # fmt: skip
    proc = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines() or [f"exit status {proc.returncode}"]
        raise TemplateBuildError(f"layer {layer.digest}: {lines[-1]}")
    try:
        stats = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise TemplateBuildError(f"layer {layer.digest}: the unpacker printed no statistics") from None
    return stats if isinstance(stats, dict) else {}
