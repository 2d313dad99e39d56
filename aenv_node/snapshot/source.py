"""What a sandbox is restored from, and the base of its next capture.

A ``SnapshotSource`` is a committed snapshot as the restore and the next
capture need it: the device state and how to replay it, the flat memory image
the VMM maps copy-on-write, the memory chain that image is made of (digests
over ``memory_base``, the template RAM file at its bottom), the disk stack as
layer references, and the guest identity the snapshot carries (the envd token
it was taken with, its env vars). It is read from the database in one
transaction (``load_source``), never assembled by callers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

from sqlalchemy.orm import Session

from ..state import LayerKind, MachineShape, Snapshot, SnapshotKind, SnapshotStatus
from ..storage import LayerRef
from ..vmm import SnapshotFiles, SnapshotFormat
from .layers import ref_of, stack_of

__all__ = ["SnapshotSource", "load_source", "memory_base_of"]


@dataclass
class SnapshotSource:
    """A committed snapshot, ready to restore (see the module docstring)."""

    snapshot_id: str
    vmstate: Path
    format: SnapshotFormat
    memory: Path  # the flat memory image the VM maps copy-on-write
    memory_layers: list[str]  # digests, bottom first, over memory_base
    memory_base: str  # the flat image at the bottom of the memory chain (a template's RAM file), or ""
    shape: MachineShape
    template_id: str
    disk_layers: list[LayerRef] = field(default_factory=list)
    #: the envd token the guest had at the capture (``/init`` rotates it with this one)
    access_token: Optional[str] = None
    env_vars: dict[str, str] = field(default_factory=dict)
    #: the user and directory envd defaults to (a template's, from its image or build); None: envd's own
    default_user: Optional[str] = None
    default_workdir: Optional[str] = None
    #: ``memory`` must be materialized from ``memory_refs`` (over ``memory_base``) before a restore: an
    #: imported snapshot, or a user or periodic one whose capture left its flat image for later
    memory_from_layers: bool = False
    #: the memory layers as references (local file, or the repository's), bottom first
    memory_refs: list[LayerRef] = field(default_factory=list)
    #: the guest runs envd (``SnapshotConfig.guest_agent``): its restore waits for ``/init``, its pause quiesces
    guest_agent: bool = True

    @property
    def files(self) -> SnapshotFiles:
        return SnapshotFiles(self.vmstate, self.memory, self.format)

    def copy(self) -> "SnapshotSource":
        """An independent copy (a live sandbox's source changes with each capture it takes)."""
        return replace(self, memory_layers=list(self.memory_layers), disk_layers=list(self.disk_layers),
                       env_vars=dict(self.env_vars), memory_refs=list(self.memory_refs))


def memory_base_of(sn: Snapshot) -> str:
    """The flat image at the bottom of the snapshot's memory chain: a boot snapshot's own RAM image, else
    what the capture recorded ("" for a chain whose layers stand alone, as an imported one)."""
    if sn.memory_base_location:
        return sn.memory_base_location
    return sn.memory_location or "" if sn.kind == SnapshotKind.BOOT else ""


def load_source(s: Session, snapshot_id: str) -> Optional[SnapshotSource]:
    """The committed snapshot ``snapshot_id`` as a source; None if it is unknown or not committed."""
    sn = s.get(Snapshot, snapshot_id)
    if sn is None or sn.status != SnapshotStatus.COMMITTED or sn.config is None or not sn.memory_location:
        return None
    disk = [ref_of(row) for row in stack_of(s, snapshot_id, LayerKind.DISK)]
    memory_rows = stack_of(s, snapshot_id, LayerKind.MEMORY)
    memory = [row.digest for row in memory_rows]
    return SnapshotSource(
        snapshot_id=sn.id, vmstate=Path(sn.vmstate_location or ""), format=SnapshotFormat(sn.vmstate_format),
        memory=Path(sn.memory_location), memory_layers=memory, memory_base=memory_base_of(sn),
        shape=sn.config.shape, template_id=sn.template_id or "", disk_layers=disk,
        access_token=sn.config.access_token, env_vars=dict(sn.config.env_vars),
        default_user=sn.config.default_user, default_workdir=sn.config.default_workdir,
        memory_from_layers=sn.memory_from_layers, guest_agent=sn.config.guest_agent,
        memory_refs=[ref_of(row) for row in memory_rows])
