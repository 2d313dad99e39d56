"""Bodies of E2B's template API: templates and their builds as listed, tags, and the build API (v3 templates,
v2 builds, file uploads, build status), with the wire names the SDKs send and parse (e2b 2.x: ``Template``,
``TemplateWithBuilds``, ``TemplateTag``, ``TemplateBuildRequestV3``, ``TemplateBuildStartV2``,
``TemplateBuildFileUpload``, ``TemplateBuildInfo``)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Literal, Optional

from pydantic import Field

from ..state import BuildStatus, TemplateKind
from ..state import Template as TemplateRow
from ..state import TemplateBuild as TemplateBuildRow
from ..templates import LogEntry, Recipe, Step
from .models import RequestModel, ResponseModel, Timestamp

__all__ = [
    "AssignTags",
    "AssignedTags",
    "DeleteTags",
    "Template",
    "TemplateAlias",
    "TemplateBuildSummary",
    "TemplateTag",
    "TemplateUsage",
    "TemplateWithBuilds",
    "BuildLogEntry",
    "BuildStatusReason",
    "TemplateBuildInfo",
    "TemplateBuildRequest",
    "TemplateBuildStart",
    "TemplateBuildStep",
    "TemplateFileUpload",
    "TemplateRegistryAuth",
    "TemplateRequestResponse",
]


class TemplateBuildRequest(RequestModel):
    """POST /v3/templates."""

    name: str = Field(min_length=1, description="the template's name, optionally with a tag: name:tag")
    tags: list[str] = Field(default_factory=list)
    cpu_count: Optional[int] = Field(None, alias="cpuCount", ge=1, le=64)
    memory_mb: Optional[int] = Field(None, alias="memoryMB", ge=128)
    min_free_disk_mb: Optional[int] = Field(None, alias="minFreeDiskMB", ge=0)


class TemplateBuildStep(RequestModel):
    type: Literal["RUN", "COPY", "ENV", "WORKDIR", "USER"]
    args: list[str] = Field(default_factory=list)
    files_hash: Optional[str] = Field(None, alias="filesHash", pattern=r"^[0-9a-f]{64}$")
    force: bool = False
    force_upload: Optional[bool] = Field(None, alias="forceUpload")

    def to_step(self) -> Step:
        return Step(self.type, tuple(self.args), self.files_hash, self.force)


class TemplateRegistryAuth(RequestModel):
    """``fromImageRegistry``: credentials for this pull only (never stored)."""

    type: Literal["registry"]
    username: str
    password: str = Field(repr=False)


class TemplateBuildStart(RequestModel):
    """POST /v2/templates/{templateID}/builds/{buildID}."""

    from_image: Optional[str] = Field(None, alias="fromImage")
    from_template: Optional[str] = Field(None, alias="fromTemplate")
    from_image_registry: Optional[TemplateRegistryAuth] = Field(None, alias="fromImageRegistry")
    force: bool = False
    steps: list[TemplateBuildStep] = Field(default_factory=list)
    start_cmd: Optional[str] = Field(None, alias="startCmd")
    ready_cmd: Optional[str] = Field(None, alias="readyCmd")

    def to_recipe(self) -> Recipe:
        auth = self.from_image_registry
        return Recipe(from_image=self.from_image, from_template=self.from_template,
                      credentials=(auth.username, auth.password) if auth is not None else None,
                      steps=tuple(s.to_step() for s in self.steps), start_cmd=self.start_cmd,
                      ready_cmd=self.ready_cmd, force=self.force)


class TemplateRequestResponse(ResponseModel):
    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    public: bool = False
    names: list[str]
    tags: list[str]
    aliases: list[str]


class TemplateFileUpload(ResponseModel):
    omit_when_none = frozenset({"url", "headers"})

    present: bool
    url: Optional[str] = None
    headers: Optional[dict[str, str]] = None


class BuildLogEntry(ResponseModel):
    omit_when_none = frozenset({"step"})

    timestamp: Timestamp
    level: str
    message: str
    step: Optional[str] = None

    @classmethod
    def of(cls, e: LogEntry) -> BuildLogEntry:
        return cls(timestamp=e.timestamp, level=e.level, message=e.message, step=e.step)


class BuildStatusReason(ResponseModel):
    omit_when_none = frozenset({"step"})

    message: str
    step: Optional[str] = None
    log_entries: list[BuildLogEntry] = Field(default_factory=list, alias="logEntries")


class TemplateBuildInfo(ResponseModel):
    omit_when_none = frozenset({"reason"})

    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    status: BuildStatus
    logs: list[str]
    log_entries: list[BuildLogEntry] = Field(alias="logEntries")
    reason: Optional[BuildStatusReason] = None


# ----- templates as listed -------------------------------------------------------------------

@dataclass(frozen=True)
class TemplateUsage:
    """What the listing says beside a template row: its latest ready build, builds made, sandboxes started."""

    build_id: str = ""
    build_count: int = 0
    spawn_count: int = 0
    last_spawned_at: dt.datetime | None = None


class Template(ResponseModel):
    """A template as ``GET /templates``, ``GET /v2/templates`` list it (E2B's ``Template``, plus ``kind``:
    ``template`` for a built one, ``snapshot`` for a user snapshot)."""

    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID", description="the latest ready build")
    aliases: list[str]
    names: list[str]
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    envd_version: str = Field(alias="envdVersion")
    created_at: Timestamp = Field(alias="createdAt")
    updated_at: Timestamp = Field(alias="updatedAt")
    created_by: None = Field(None, alias="createdBy", description="always null: a node has no users")
    last_spawned_at: Optional[Timestamp] = Field(None, alias="lastSpawnedAt")
    spawn_count: int = Field(0, alias="spawnCount")
    build_count: int = Field(0, alias="buildCount")
    public: bool = False
    build_status: BuildStatus = Field(alias="buildStatus")
    kind: TemplateKind

    @classmethod
    def fields_of(cls, t: TemplateRow, u: TemplateUsage) -> dict[str, object]:
        aliases = [t.alias] if t.alias else []
        return dict(template_id=t.id, build_id=u.build_id, aliases=aliases, names=aliases, cpu_count=t.cpu_count,
                    memory_mb=t.memory_mb, disk_size_mb=t.disk_size_mb, envd_version=t.envd_version,
                    created_at=t.created_at, updated_at=t.updated_at, last_spawned_at=u.last_spawned_at,
                    spawn_count=u.spawn_count, build_count=u.build_count, build_status=t.status, kind=t.kind)

    @classmethod
    def from_row(cls, t: TemplateRow, u: TemplateUsage) -> Template:
        return cls.model_validate(cls.fields_of(t, u))


class TemplateBuildSummary(ResponseModel):
    """One build in ``GET /templates/{templateID}`` (E2B's ``TemplateBuild``)."""

    omit_when_none = frozenset({"finished_at"})

    build_id: str = Field(alias="buildID")
    status: BuildStatus
    created_at: Timestamp = Field(alias="createdAt")
    updated_at: Timestamp = Field(alias="updatedAt")
    finished_at: Optional[Timestamp] = Field(None, alias="finishedAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    envd_version: str = Field(alias="envdVersion")

    @classmethod
    def from_row(cls, b: TemplateBuildRow, t: TemplateRow) -> TemplateBuildSummary:
        return cls(build_id=b.id, status=b.status, created_at=b.started_at,
                   updated_at=b.finished_at or b.started_at, finished_at=b.finished_at, cpu_count=t.cpu_count,
                   memory_mb=t.memory_mb, disk_size_mb=t.disk_size_mb, envd_version=t.envd_version)


class TemplateWithBuilds(Template):
    """``GET /templates/{templateID}``: the template and its builds, newest first."""

    builds: list[TemplateBuildSummary]


class TemplateAlias(ResponseModel):
    template_id: str = Field(alias="templateID")
    public: bool = False


# ----- tags ----------------------------------------------------------------------------------

class AssignTags(RequestModel):
    """POST /templates/tags: point ``tags`` at the build ``target`` names."""

    target: str = Field(min_length=1, description="name:tag (a bare name: its default build)")
    tags: list[str] = Field(min_length=1)


class AssignedTags(ResponseModel):
    tags: list[str]
    build_id: str = Field(alias="buildID")


class DeleteTags(RequestModel):
    """DELETE /templates/tags."""

    name: str = Field(min_length=1)
    tags: list[str] = Field(min_length=1)


class TemplateTag(ResponseModel):
    tag: str
    build_id: str = Field(alias="buildID")
    created_at: Timestamp = Field(alias="createdAt")
