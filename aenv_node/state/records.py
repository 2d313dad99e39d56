"""Typed, versioned JSON documents stored in the database.

Most of the node's state is plain columns. What remains in JSON is either
really free-form (metadata, env vars, a network policy) or one of the records
here: a document with fixed keys that SQL never filters on, kept as one
pydantic model so that every writer and reader agrees on its shape. This
module alone turns them into JSON and back (``RecordType``, a SQLAlchemy type
decorator), the way each Firecracker device owns its ``persist`` state: code
elsewhere builds and reads the models, never a dict.

Each record carries ``version``; a reader accepts every version written so
far (older documents are upgraded in ``model_validator``s here, never in the
callers).
"""

from __future__ import annotations

from typing import Any, Generic, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import JSON
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

__all__ = ["MachineShape", "SnapshotConfig", "RecordType"]


class MachineShape(BaseModel):
    """What must not change between a capture and its restores (vcpus, memory, devices, kernel)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    vcpus: int
    mem_mib: int
    kernel: str
    initrd: str
    cmdline: str
    tools_img: str
    accel: str
    #: a virtio-balloon with free page reporting: device state differs, so boot and restores must agree
    free_page_reporting: bool = False

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "MachineShape":
        """Fields a shape stored before they existed take their defaults."""
        return cls.model_validate(data)


class SnapshotConfig(BaseModel):
    """``snapshots.config``: what a restore needs beyond the columns.

    Columns hold what SQL needs (memory image locations, format, publish state: see
    ``models.Snapshot``); this holds the machine shape and the guest's identity at the capture.
    """

    model_config = ConfigDict(frozen=True, extra="ignore")

    version: int = 1
    shape: MachineShape
    #: the envd access token the guest had at the capture (``/init`` rotates it with this one)
    access_token: Optional[str] = None
    #: the env vars the guest had (a snapshot used as a template passes them on)
    env_vars: dict[str, str] = Field(default_factory=dict)
    #: boot snapshots: what the template was built from (template freshness compares them)
    rootfs: Optional[str] = None
    kit_hash: Optional[str] = None
    envd_version: Optional[str] = None
    #: the user and working directory envd defaults to (an image's USER/WORKDIR, a build's last ones);
    #: None: envd's own default (``user``, its home)
    default_user: Optional[str] = None
    default_workdir: Optional[str] = None
    #: the guest runs envd (every template built from a root filesystem or an image); False: a VM imported
    #: without one (``aenv-node template import-vm``), which runs once its VMM does, and is never quiesced
    guest_agent: bool = True


R = TypeVar("R", bound=BaseModel)


class RecordType(TypeDecorator[R], Generic[R]):
    """A JSON column holding one record model (``None`` stays SQL NULL)."""

    impl = JSON
    cache_ok = True

    def __init__(self, model: type[R]) -> None:
        super().__init__(none_as_null=True)
        self.model = model

    def process_bind_param(self, value: Optional[R], dialect: Dialect) -> Optional[dict[str, Any]]:
        if value is None:
            return None
        if not isinstance(value, self.model):
            raise TypeError(f"a {self.model.__name__} column got a {type(value).__name__}")
        return value.model_dump(mode="json")

    def process_result_value(self, value: Optional[Any], dialect: Dialect) -> Optional[R]:
        if value is None:
            return None
        return self.model.model_validate(value)

    def coerce_compared_value(self, op: Any, value: Any) -> Any:
        return JSON()
