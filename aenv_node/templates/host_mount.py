"""A layered disk's ext4 filesystem mounted on the host, changed there, and sealed as exactly one new layer.

Converting an OCI layer and provisioning a template both change a root filesystem that lives in our layer
stack. The change has to become a block layer of its own (only the blocks it wrote), so it is made on the real
filesystem through the real kernel: the stack plus a fresh upper is exported as a regular file through our
FUSE frontend, that file is attached to a loop device and the ext4 on it is mounted. Whatever the caller then
does under ``root`` (untar, useradd's files) lands in the upper; on success the filesystem is unmounted and the
upper sealed into one layer.

Why this way: this host has no kernel NBD, ublk or device-mapper; FUSE and loop devices it has. A builder VM
would work everywhere but costs a boot per layer under TCG; fuse2fs would avoid the kernel but is a second,
slower ext4 implementation whose output the guest kernel then has to trust. The kernel's own ext4 writes what
the guest's ext4 will read.

Nothing outlives the ``async with``: on any exit the filesystem is unmounted (lazily if busy), the loop device
detached, the FUSE export torn down, and an unsealed upper removed; no half-written layer is ever visible.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import trio

from ..storage import Image, LayerInfo
from ..storage.frontends import DiskFrontend, FrontendKind, export_disk
from .errors import TemplateBuildError

__all__ = ["MountedFilesystem", "mount_for_change", "make_empty_ext4"]

log = logging.getLogger(__name__)

#: Mount options: no atime updates (every read would dirty an inode block of the new layer), and no lazy
#: inode-table zeroing thread (its writes would land in whichever layer happened to be mounted).
_MOUNT_OPTIONS = "noatime,noinit_itable"


async def _run(argv: Sequence[str], what: str) -> str:
    proc = await trio.run_process(list(argv), capture_stdout=True, capture_stderr=True, check=False)
    if proc.returncode != 0:
        err = (proc.stderr or proc.stdout).decode(errors="replace").strip()
        raise TemplateBuildError(f"{what} failed ({proc.returncode}): {err[-500:]}")
    return proc.stdout.decode(errors="replace")


def make_empty_ext4(path: Path, size: int, *, label: str = "aenv-root") -> None:
    """An empty ext4 filesystem in a sparse file: the bottom of every converted image's stack.

    Inode tables are zeroed here (``lazy_itable_init=0``: zero blocks cost nothing in a layer) so no kernel
    thread zeroes them later into some other layer; the UUID and hash seed are fixed so the bottom layer's
    bytes, and so its digest, depend only on the size and the e2fsprogs version. Blocking."""
    import subprocess

    with path.open("wb") as f:
        f.truncate(size)
    fixed = "6d6b6c61-7965-7200-6165-6e762d726f6f"
    proc = subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-L", label, "-b", "4096", "-U", fixed,
         "-E", f"lazy_itable_init=0,lazy_journal_init=0,hash_seed={fixed}", str(path)],
        capture_output=True, text=True, check=False, env={**os.environ, "E2FSPROGS_FAKE_TIME": "1"},
    )  # fmt: skip
    if proc.returncode != 0:
        raise TemplateBuildError(f"mkfs.ext4 failed: {proc.stderr.strip()[-500:]}")


@dataclass
class MountedFilesystem:
    """The mounted filesystem (``root``) and, after a successful exit, the layer its changes became."""

    root: Path
    device: str
    image: Image
    sealed: LayerInfo | None = None
    _commit: bool = field(default=False, repr=False)

    def commit(self) -> None:
        """Seal the changes into a layer when the ``async with`` ends (without this they are discarded)."""
        self._commit = True



@asynccontextmanager
async def mount_for_change(layers: Sequence[Path], *, size: int, upper_dir: Path, run_dir: Path,
                           layers_dir: Path, name: str = "rootfs", min_free: int = 0,
                           ) -> AsyncIterator[MountedFilesystem]:
    """Mount the ext4 filesystem of ``layers`` (bottom first) on a fresh upper in ``upper_dir`` for changes,
    the device being ``size`` bytes (at least the top layer's). With fewer than ``min_free`` bytes free, the
    filesystem is first grown to the whole device. On a committed, clean exit the changes are sealed into
    ``layers_dir`` (``MountedFilesystem.sealed``); otherwise they are discarded."""
    if upper_dir.exists():
        shutil.rmtree(upper_dir)
    image = await trio.to_thread.run_sync(lambda: Image.open([str(p) for p in layers], upper_dir, size=size))
    mnt = run_dir / f"{name}.mnt"
    sealed: LayerInfo | None = None
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        async with export_disk(DiskFrontend(FrontendKind.FUSE), image, run_dir, name=name) as disk:
            device = (await _run(["losetup", "--find", "--show", disk.source], "losetup")).strip()
            try:
                if min_free and await _free_bytes(device) < min_free:
                    await _grow(device)
                mnt.mkdir(exist_ok=True)
                await _run(["mount", "-t", "ext4", "-o", _MOUNT_OPTIONS, device, str(mnt)],
                           f"mounting the image's ext4 ({device})")
                mounted = MountedFilesystem(mnt, device, image)
                try:
                    yield mounted
                finally:
                    with trio.CancelScope(shield=True):
                        try:
                            await _run(["umount", str(mnt)], "umount")
                        except TemplateBuildError:
                            await _run(["umount", "-l", str(mnt)], "umount -l")
                            mounted._commit = False  # something still held it: the state is not trustworthy
            finally:
                with trio.CancelScope(shield=True):
                    await _run(["losetup", "-d", device], f"losetup -d {device}")
                    await _wait_loop_released(device)
        if mounted._commit:
            sealed = await trio.to_thread.run_sync(image.seal, layers_dir)
            mounted.sealed = sealed
    finally:
        with trio.CancelScope(shield=True):
            for made in (mnt, run_dir):  # (run_dir only if nothing else is in it)
                try:
                    made.rmdir()
                except OSError:
                    pass
            await trio.to_thread.run_sync(image.close)
            shutil.rmtree(upper_dir, ignore_errors=True)


async def _free_bytes(device: str) -> int:
    """Free bytes of the (unmounted) ext4 on ``device``, from its superblock."""
    fields: dict[str, str] = {}
    for line in (await _run(["dumpe2fs", "-h", device], f"dumpe2fs -h {device}")).splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    try:
        return int(fields["Free blocks"]) * int(fields["Block size"])
    except (KeyError, ValueError):
        raise TemplateBuildError(f"{device} has no readable ext4 superblock") from None


async def _grow(device: str) -> None:
    """Grow the ext4 on ``device`` to the whole device, offline: an online resize needs CAP_SYS_RESOURCE,
    which a node in a container often lacks. ``-f``: the filesystem was unmounted cleanly by us, skip the
    full check resize2fs would otherwise ask for first."""
    await _run(["resize2fs", "-f", device], f"growing the filesystem on {device}")
    log.info("grew the filesystem on %s to %d MiB free", device, await _free_bytes(device) >> 20)


async def _wait_loop_released(device: str, timeout: float = 10.0) -> None:
    """``losetup -d`` returns before the kernel lets go of the backing file (autoclear on last close): wait for
    it, so the FUSE export is not torn down under a loop device still flushing into it."""
    backing = Path("/sys/block") / Path(device).name / "loop" / "backing_file"
    with trio.move_on_after(timeout):
        while backing.exists():
            await trio.sleep(0.02)
