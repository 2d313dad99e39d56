"""One disk for one VM: choose the frontend a VMM can attach and serve a ``BlockDevice`` through it.

QEMU has an NBD client, so it gets the NBD server (no kernel involvement, nothing to clean up after a crash but
a socket). Firecracker opens only files and block devices: it gets ``/dev/ublkbN`` where the kernel has ublk_drv
(the production path, AgentENV's), else a file in a FUSE mount (slower: every I/O crosses the kernel twice, but
it needs nothing beyond ``/dev/fuse``). ``choose_frontend`` makes that choice once per node from the
``storage.block_frontend`` setting; ``export_disk`` serves one disk for the duration of its ``async with``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from ..blockdev import BlockDevice
from .errors import FrontendError
from .fuse import FuseExport, mount_fuse
from .nbd import NbdServer, serve_nbd
from .ublk import CONTROL_PATH, UblkServer, serve_ublk

__all__ = ["DiskExport", "DiskFrontend", "FrontendKind", "choose_frontend", "export_disk"]


class FrontendKind(StrEnum):
    NBD = "nbd"
    UBLK = "ublk"
    FUSE = "fuse"


def choose_frontend(setting: str, *, vmm_takes_nbd: bool, ublk_control: str = CONTROL_PATH) -> FrontendKind:
    """The frontend for ``setting`` (auto | nbd | ublk | fuse) and a VMM that can (or cannot) be an NBD client.

    auto: NBD for a VMM with an NBD client, else ublk when ``ublk_control`` exists, else FUSE.
    """
    if setting == "auto":
        if vmm_takes_nbd:
            return FrontendKind.NBD
        return FrontendKind.UBLK if os.path.exists(ublk_control) else FrontendKind.FUSE
    try:
        kind = FrontendKind(setting)
    except ValueError:
        raise FrontendError(f"storage.block_frontend must be auto, nbd, ublk or fuse, not {setting!r}") from None
    if kind is FrontendKind.NBD and not vmm_takes_nbd:
        raise FrontendError("storage.block_frontend = nbd, but this VMM has no NBD client (Firecracker): "
                            "use auto, ublk or fuse")
    if kind is FrontendKind.UBLK and not os.path.exists(ublk_control):
        raise FrontendError(f"storage.block_frontend = ublk, but {ublk_control} does not exist (load ublk_drv; "
                            "Linux >= 6.0 with CONFIG_BLK_DEV_UBLK)")
    return kind


@dataclass(frozen=True)
class DiskFrontend:
    """How every disk of this node is exported (chosen once per node, from config and the VMM)."""

    kind: FrontendKind = FrontendKind.NBD
    ublk_queues: int = 1  # asked for; the kernel may give fewer (one per CPU at most)
    #: (uid, gid) a FUSE-exported disk file belongs to: a jailed Firecracker opens it as that user (None: ours)
    owner: tuple[int, int] | None = None


@dataclass(frozen=True)
class DiskExport:
    """A served disk: ``source`` is what the VMM is given (an NBD URI, a block device or a file path)."""

    kind: FrontendKind
    source: str
    server: NbdServer | UblkServer | FuseExport


@asynccontextmanager
async def export_disk(frontend: DiskFrontend, device: BlockDevice, run_dir: Path, *,
                      name: str = "disk") -> AsyncIterator[DiskExport]:
    """Serve ``device`` as ``frontend`` says; its socket or mount point lives in ``run_dir``. On exit the
    frontend is torn down (socket closed, ublk device deleted, FUSE mount detached)."""
    kind = frontend.kind
    if kind is FrontendKind.NBD:
        async with serve_nbd(device, run_dir / f"{name}.sock") as nbd:
            yield DiskExport(kind, nbd.uri, nbd)
    elif kind is FrontendKind.UBLK:
        async with serve_ublk(device, queues=frontend.ublk_queues) as ublk:
            yield DiskExport(kind, str(ublk.block_path), ublk)
    else:
        mnt = run_dir / f"{name}.fuse"
        mnt.mkdir(parents=True, exist_ok=True)
        try:
            uid, gid = frontend.owner if frontend.owner is not None else (None, None)
            async with mount_fuse({f"{name}.raw": device}, mnt, uid=uid, gid=gid) as fs:
                yield DiskExport(kind, str(fs.path(f"{name}.raw")), fs)
        finally:
            try:
                mnt.rmdir()
            except OSError:
                pass
