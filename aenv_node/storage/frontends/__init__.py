"""Block-device frontends: present one ``BlockDevice`` to a VMM as a disk.

- ``serve_nbd``: an NBD server on a unix socket (QEMU's built-in NBD client: ``nbd+unix:///?socket=PATH``).
- ``mount_fuse``: a FUSE filesystem with one regular file per device (any VMM that opens a raw file).
- ``serve_ublk``: a ublk server, ``/dev/ublkbN`` (hosts whose kernel has ublk_drv; Firecracker's best path).
- ``choose_frontend`` / ``export_disk``: which of the three a VMM gets, and one disk served through it.
"""

from .errors import FrontendError, FuseMountError, NbdProtocolError, SocketPathInUse, UblkError, UblkUnavailable
from .export import DiskExport, DiskFrontend, FrontendKind, choose_frontend, export_disk
from .fuse import FuseExport, mount_fuse
from .nbd import NbdServer, serve_nbd
from .ublk import UblkServer, serve_ublk

__all__ = [
    "choose_frontend",
    "export_disk",
    "DiskFrontend",
    "DiskExport",
    "FrontendKind",
    "serve_nbd",
    "NbdServer",
    "mount_fuse",
    "FuseExport",
    "serve_ublk",
    "UblkServer",
    "FrontendError",
    "NbdProtocolError",
    "SocketPathInUse",
    "FuseMountError",
    "UblkError",
    "UblkUnavailable",
]
