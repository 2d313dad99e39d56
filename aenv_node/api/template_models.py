"""Bodies of E2B's template API: templates and their builds as listed, tags, and the build API (v3 templates,
v2 builds, file uploads, build status), with the wire names the SDKs send and parse (e2b 2.x: ``Template``,
``TemplateWithBuilds``, ``TemplateTag``, ``TemplateBuildRequestV3``, ``TemplateBuildStartV2``,
``TemplateBuildFileUpload``, ``TemplateBuildInfo``)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import ConfigDict, Field, model_validator

from ..state import BuildStatus, TemplateKind
from ..state import Template as TemplateRow
from ..state import TemplateBuild as TemplateBuildRow
from ..templates import LogEntry, Recipe, Step
from .models import RequestModel, ResponseModel, Timestamp, worded

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
    "RunStep",
    "CopyStep",
    "EnvStep",
    "WorkdirStep",
    "UserStep",
    "NAME_PATTERN",
    "NAME_TAG_PATTERN",
    "FILES_HASH_PATTERN",
    "TemplateFileUpload",
    "TemplateRegistryAuth",
    "TemplateRequestResponse",
]


#: an alias or a tag (``templates/names.py``, NAME_PART): lowercase letters, digits, '-', '_' and '.'
NAME_PATTERN = worded(r"^[a-z0-9][a-z0-9._-]{0,127}$", "lowercase letters, digits, '-', '_' and '.'")
#: ``name`` or ``name:tag``
NAME_TAG_PATTERN = worded(r"^[a-z0-9][a-z0-9._-]{0,127}(:[a-z0-9][a-z0-9._-]{0,127})?$",
                          "a name of lowercase letters, digits, '-', '_' and '.', optionally with ':tag'")
#: a COPY step's archive: the sha256 the SDK computes over its files
FILES_HASH_PATTERN = worded(r"^[0-9a-f]{64}$", "64 lowercase hex characters")

Tag = Annotated[str, Field(pattern=NAME_PATTERN)]


class TemplateBuildRequest(RequestModel):
    """POST /v3/templates."""

    name: str = Field(pattern=NAME_TAG_PATTERN, description="the template's name, optionally with a tag: name:tag")
    tags: list[Tag] = Field(default_factory=list)
    cpu_count: Optional[int] = Field(None, alias="cpuCount", ge=1, le=64)
    memory_mb: Optional[int] = Field(None, alias="memoryMB", ge=128, le=1 << 20)
    min_free_disk_mb: Optional[int] = Field(None, alias="minFreeDiskMB", ge=0, le=1 << 24)


class _Step(RequestModel):
    """A recipe step (E2B's TemplateStep); ``type`` says which, and how many ``args`` it needs."""

    type: str  # each kind's Literal
    args: list[str]
    files_hash: Optional[str] = Field(None, alias="filesHash", pattern=FILES_HASH_PATTERN)
    force: bool = False
    force_upload: Optional[bool] = Field(None, alias="forceUpload")

    def to_step(self) -> Step:
        return Step(self.type, tuple(self.args), self.files_hash, self.force)


class RunStep(_Step):
    type: Literal["RUN"]
    args: list[str] = Field(min_length=1, description="the command, then the user to run it as (optional)")


class CopyStep(_Step):
    type: Literal["COPY"]
    args: list[str] = Field(min_length=2, description="source, destination, then user and octal mode (optional)")
    files_hash: str = Field(alias="filesHash", pattern=FILES_HASH_PATTERN,
                            description="the uploaded archive (GET /templates/{templateID}/files/{hash})")


class EnvStep(_Step):
    type: Literal["ENV"]
    args: list[str] = Field(min_length=2, description="name, value, name, value...: an even count")

    @model_validator(mode="after")
    def _pairs(self) -> "EnvStep":
        if len(self.args) % 2:
            raise ValueError("must have name, value pairs in args (an even count)")
        return self


class WorkdirStep(_Step):
    type: Literal["WORKDIR"]
    args: list[str] = Field(min_length=1, description="the directory")


class UserStep(_Step):
    type: Literal["USER"]
    args: list[str] = Field(min_length=1, description="the user")


TemplateBuildStep = Annotated[Union[RunStep, CopyStep, EnvStep, WorkdirStep, UserStep], Field(discriminator="type")]


class TemplateRegistryAuth(RequestModel):
    """``fromImageRegistry``: credentials for this pull only (never stored)."""

    type: Literal["registry"]
    username: str
    password: str = Field(repr=False)


def _exactly_one_source(schema: dict[str, Any]) -> None:
    # fromImage or fromTemplate, exactly one (null counts as absent, as everywhere in a request)
    def only(given: str, absent: str) -> dict[str, Any]:
        return {"required": [given], "properties": {given: {"type": "string"}, absent: {"type": "null"}}}

    schema["anyOf"] = [only("fromImage", "fromTemplate"), only("fromTemplate", "fromImage")]


class TemplateBuildStart(RequestModel):
    """POST /v2/templates/{templateID}/builds/{buildID}: exactly one of ``fromImage`` and ``fromTemplate``."""

    model_config = ConfigDict(json_schema_extra=_exactly_one_source)

    from_image: Optional[str] = Field(None, alias="fromImage", min_length=1)
    from_template: Optional[str] = Field(None, alias="fromTemplate", min_length=1)
    from_image_registry: Optional[TemplateRegistryAuth] = Field(None, alias="fromImageRegistry")
    force: bool = False
    steps: list[TemplateBuildStep] = Field(default_factory=list)
    start_cmd: Optional[str] = Field(None, alias="startCmd")
    ready_cmd: Optional[str] = Field(None, alias="readyCmd")

    @model_validator(mode="after")
    def _one_source(self) -> "TemplateBuildStart":
        if (self.from_image is None) == (self.from_template is None):
            raise ValueError("give exactly one of fromImage and fromTemplate")
        return self

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


class ImportedVm(ResponseModel):
    """POST /node/vm-templates: the template a VM without envd became."""

    template_id: str = Field(alias="templateID")
    build_id: str = Field(alias="buildID")
    snapshot_id: str = Field(alias="snapshotID", description="its boot snapshot")
    boot_ms: float = Field(alias="bootMs", description="from the VMM's start until the console said it was up")
    capture_ms: float = Field(alias="captureMs")


class TemplateAlias(ResponseModel):
    template_id: str = Field(alias="templateID")
    public: bool = False


# ----- tags ----------------------------------------------------------------------------------

class AssignTags(RequestModel):
    """POST /templates/tags: point ``tags`` at the build ``target`` names."""

    target: str = Field(pattern=NAME_TAG_PATTERN, description="name:tag (a bare name: its default build)")
    tags: list[Tag] = Field(min_length=1)


class AssignedTags(ResponseModel):
    tags: list[str]
    build_id: str = Field(alias="buildID")


class DeleteTags(RequestModel):
    """DELETE /templates/tags."""

    name: str = Field(pattern=NAME_TAG_PATTERN, description="the template (an id or alias)")
    tags: list[Tag] = Field(min_length=1)


class TemplateTag(ResponseModel):
    tag: str
    build_id: str = Field(alias="buildID")
    created_at: Timestamp = Field(alias="createdAt")
