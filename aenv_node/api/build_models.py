"""Bodies of E2B's template build API (v3 templates, v2 builds, file uploads, build status), with the wire names
the SDKs' ``Template`` builder sends and parses (e2b 2.x: ``TemplateBuildRequestV3``, ``TemplateBuildStartV2``,
``TemplateBuildFileUpload``, ``TemplateBuildInfo``)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from ..state import BuildStatus
from ..templates import LogEntry, Recipe, Step
from .models import RequestModel, ResponseModel, Timestamp

__all__ = [
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
