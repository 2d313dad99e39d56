"""The snapshot manifest: what a published snapshot is, in the shared repository.

One JSON document per snapshot (``manifests/<snapshot-id>.json``), written after
every layer it names (``Repository.commit_snapshot``). This module alone builds
and reads it: the device state, the machine shape, the disk stack and the
memory chain (the template's RAM image as its bottom layer), and the sandbox's
settings so another node can import the sandbox and resume it. The fields the
repository's own garbage collector follows (the layer lists) are the storage
layer's ``LayerManifest``; this model extends it.

Version 1 is the format every node has written so far.
"""

from __future__ import annotations

import base64
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field

from ..state import MachineShape, Sandbox
from ..storage.repository.manifest import DiskLayerRef, LayerManifest

__all__ = ["SandboxRecord", "SnapshotManifest", "DiskLayerRef"]


class SandboxRecord(BaseModel):
    """The sandbox's settings as the publishing node had them."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    id: str
    template_id: str
    alias: Optional[str] = None
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    envd_version: str
    envd_access_token: Optional[str] = None
    traffic_access_token: Optional[str] = None
    metadata: dict[str, str] = Field(default_factory=dict)
    env_vars: dict[str, str] = Field(default_factory=dict)
    auto_pause: bool = True
    auto_resume: bool = False
    allow_internet_access: bool = True
    network_policy: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def of(cls, sb: Sandbox) -> "SandboxRecord":
        return cls(id=sb.id, template_id=sb.template_id, alias=sb.alias, cpu_count=sb.cpu_count,
                   memory_mb=sb.memory_mb, disk_size_mb=sb.disk_size_mb, envd_version=sb.envd_version,
                   envd_access_token=sb.envd_access_token, traffic_access_token=sb.traffic_access_token,
                   metadata=dict(sb.metadata_ or {}),
                   env_vars=dict(sb.env_vars or {}), auto_pause=sb.auto_pause, auto_resume=sb.auto_resume,
                   allow_internet_access=sb.allow_internet_access,
                   network_policy=dict(sb.network_policy or {}))


class SnapshotManifest(LayerManifest):
    """A published snapshot (see the module docstring)."""

    snapshot_id: str
    kind: str
    parent_id: Optional[str] = None
    source_sandbox_id: Optional[str] = None
    template_id: Optional[str] = None
    vmm: str
    shape: MachineShape
    format: str
    vmstate_b64: str
    memory_mb: int
    access_token: Optional[str] = None
    env_vars: dict[str, str] = Field(default_factory=dict)
    default_user: Optional[str] = None
    default_workdir: Optional[str] = None
    #: the guest runs envd (``SnapshotConfig.guest_agent``)
    guest_agent: bool = True
    #: the sandbox the snapshot is of (None: a template's boot snapshot, which no sandbox ran)
    sandbox: Optional[SandboxRecord] = None

    @property
    def vmstate(self) -> bytes:
        return base64.b64decode(self.vmstate_b64)

    @staticmethod
    def encode_vmstate(data: bytes) -> str:
        return base64.b64encode(data).decode()
