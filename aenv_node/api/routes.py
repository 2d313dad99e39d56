"""The route table: every route the node serves, declared once.

The Quart app registers its handlers from this table and the OpenAPI document
is generated from it, so the two cannot disagree (a test also checks the
document against the live server). Request and response bodies are named by
their model classes (``models.py``): the app validates and serializes with
them and the document's schemas are generated from them. Routes whose handler
has not landed yet still exist and answer 501 in the E2B error shape, so an
SDK gets a clear "not implemented on this node" rather than a 404 that looks
like a missing sandbox.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from .template_models import (
    AssignedTags,
    AssignTags,
    DeleteTags,
    Template,
    TemplateAlias,
    TemplateTag,
    TemplateWithBuilds,
    TemplateBuildInfo,
    TemplateBuildRequest,
    TemplateBuildStart,
    TemplateFileUpload,
    TemplateRequestResponse,
)
from .models import (
    ConnectSandbox,
    Event,
    ForkResult,
    ForkSandbox,
    Health,
    ListedSandbox,
    NetworkUpdate,
    NewSandbox,
    NewSnapshot,
    NodeInfo,
    PauseSandbox,
    Refresh,
    RequestModel,
    ResponseModel,
    ResumeSandbox,
    Sandbox,
    SandboxDetail,
    SandboxLogs,
    SandboxLogsV2,
    SandboxMetric,
    SnapshotDetail,
    SnapshotInfo,
    Timeout,
)

__all__ = ["Route", "ROUTES", "quart_path"]


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # OpenAPI style: /sandboxes/{sandboxID}
    operation_id: str
    summary: str
    tag: str
    success: int = 200
    auth: bool = True
    request: Optional[type[RequestModel]] = None  # the JSON body, parsed before the handler runs
    response: Optional[type[ResponseModel]] = None  # the success body (the handler returns it)
    response_is_list: bool = False
    query: tuple[str, ...] = ()
    content_type: str = "application/json"
    error_statuses: tuple[int, ...] = field(default=(400, 401, 404, 500))


def quart_path(path: str) -> str:
    return re.sub(r"\{(\w+)\}", r"<\1>", path)


_SB = "sandboxes"
_T = "templates"
_SN = "snapshots"
_N = "node"

ROUTES: tuple[Route, ...] = (
    # -- node (native) -----------------------------------------------------
    Route("GET", "/health", "health", "Liveness of the node", _N, auth=False, response=Health),
    Route("GET", "/metrics", "metrics", "Prometheus metrics", _N, auth=False,
          content_type="text/plain"),
    Route("GET", "/openapi.json", "openapi", "This document", _N, auth=False),
    Route("GET", "/node", "node_info", "Node identity, version and capacity", _N, response=NodeInfo),
    Route("GET", "/events", "list_events", "State-change events, newest first (after=ID: the ones after it, "
          "oldest first)", _N, response=Event, response_is_list=True, query=("sandboxID", "limit", "after")),
    # -- E2B sandboxes -----------------------------------------------------
    Route("POST", "/v2/sandboxes", "create_sandbox_v2", "Create a sandbox", _SB, success=201,
          request=NewSandbox, response=Sandbox, error_statuses=(400, 401, 404, 409, 429, 500)),
    Route("GET", "/v2/sandboxes", "list_sandboxes_v2", "List sandboxes", _SB,
          response=ListedSandbox, response_is_list=True,
          query=("metadata", "state", "nextToken", "limit", "order", "startedAfter", "template")),
    Route("POST", "/sandboxes", "create_sandbox", "Create a sandbox (v1)", _SB, success=201,
          request=NewSandbox, response=Sandbox, error_statuses=(400, 401, 404, 409, 429, 500)),
    Route("GET", "/sandboxes", "list_sandboxes", "List running sandboxes (v1)", _SB,
          response=ListedSandbox, response_is_list=True, query=("metadata",)),
    Route("GET", "/sandboxes/metrics", "list_sandboxes_metrics", "Latest metrics of several sandboxes",
          _SB, query=("sandbox_ids",)),
    Route("GET", "/sandboxes/{sandboxID}", "get_sandbox", "Get a sandbox", _SB,
          response=SandboxDetail),
    Route("DELETE", "/sandboxes/{sandboxID}", "kill_sandbox", "Kill a sandbox", _SB, success=204),
    Route("POST", "/sandboxes/{sandboxID}/timeout", "set_sandbox_timeout",
          "Set the sandbox's timeout from now", _SB, success=204, request=Timeout),
    Route("POST", "/sandboxes/{sandboxID}/refreshes", "refresh_sandbox",
          "Extend the sandbox's life", _SB, success=204, request=Refresh),
    Route("GET", "/sandboxes/{sandboxID}/metrics", "get_sandbox_metrics", "Sandbox metrics", _SB,
          response=SandboxMetric, response_is_list=True, query=("start", "end")),
    Route("GET", "/sandboxes/{sandboxID}/logs", "get_sandbox_logs",
          "Sandbox logs from start (unix ms), oldest first (v1)", _SB, response=SandboxLogs,
          query=("start", "limit")),
    Route("GET", "/v2/sandboxes/{sandboxID}/logs", "get_sandbox_logs_v2",
          "Sandbox logs from cursor (unix ms) forward or backward, by minimum level and search", _SB,
          response=SandboxLogsV2, query=("cursor", "limit", "direction", "level", "search")),
    Route("POST", "/sandboxes/{sandboxID}/pause", "pause_sandbox", "Pause a sandbox", _SB,
          success=204, request=PauseSandbox, error_statuses=(401, 404, 409, 500)),
    Route("POST", "/sandboxes/{sandboxID}/resume", "resume_sandbox", "Resume a paused sandbox", _SB,
          success=201, request=ResumeSandbox, response=Sandbox,
          error_statuses=(401, 404, 409, 500)),
    Route("POST", "/sandboxes/{sandboxID}/connect", "connect_sandbox",
          "Connect to a sandbox, resuming it if paused (v1)", _SB, request=ConnectSandbox,
          response=Sandbox),
    Route("POST", "/v2/sandboxes/{sandboxID}/connect", "connect_sandbox_v2",
          "Connect to a sandbox, resuming it if paused", _SB, request=ConnectSandbox,
          response=Sandbox),
    Route("POST", "/sandboxes/{sandboxID}/fork", "fork_sandbox", "Fork a sandbox into children", _SB,
          success=201, request=ForkSandbox, response=ForkResult, response_is_list=True),
    Route("POST", "/sandboxes/{sandboxID}/snapshots", "create_snapshot",
          "Snapshot a running sandbox", _SN, success=201, request=NewSnapshot,
          response=SnapshotInfo),
    Route("PUT", "/sandboxes/{sandboxID}/network", "update_sandbox_network",
          "Update the sandbox's egress policy", _SB, success=204, request=NetworkUpdate),
    Route("GET", "/snapshots", "list_snapshots", "List snapshots", _SN,
          response=SnapshotDetail, response_is_list=True,
          query=("sandboxID", "name", "limit", "nextToken")),
    Route("GET", "/snapshots/{snapshotID}/lineage", "snapshot_lineage",
          "A snapshot's parent chain, newest first", _SN, response=SnapshotDetail,
          response_is_list=True),
    # -- templates ---------------------------------------------------------
    Route("GET", "/templates", "list_templates", "List templates", _T,
          response=Template, response_is_list=True),
    Route("GET", "/v2/templates", "list_templates_v2", "List templates (paged)", _T,
          response=Template, response_is_list=True, query=("limit", "nextToken")),
    Route("GET", "/templates/{templateID}", "get_template", "Get a template and its builds", _T,
          response=TemplateWithBuilds),
    Route("GET", "/templates/{templateID}/tags", "get_template_tags", "A template's tags and their builds", _T,
          response=TemplateTag, response_is_list=True),
    Route("POST", "/templates/tags", "assign_template_tags", "Point tags at the build a name:tag names", _T,
          success=201, request=AssignTags, response=AssignedTags),
    Route("DELETE", "/templates/tags", "delete_template_tags", "Remove tags from a template", _T, success=204,
          request=DeleteTags),
    Route("DELETE", "/templates/{templateID}", "delete_template",
          "Delete a template or snapshot", _T, success=204),
    Route("GET", "/templates/aliases/{alias}", "get_template_alias", "Resolve a template alias", _T,
          response=TemplateAlias),
    Route("POST", "/v3/templates", "create_template", "Register a template build", _T, success=202,
          request=TemplateBuildRequest, response=TemplateRequestResponse),
    Route("GET", "/templates/{templateID}/files/{hash}", "get_template_files",
          "Whether a COPY step's files are here, else where to upload them", _T, success=201,
          response=TemplateFileUpload),
    Route("PUT", "/templates/{templateID}/files/{hash}", "upload_template_files",
          "Upload a COPY step's files (the address get_template_files gave, with its token)", _T,
          success=204, auth=False),
    Route("POST", "/v2/templates/{templateID}/builds/{buildID}", "start_template_build",
          "Start a registered build from its recipe", _T, success=202, request=TemplateBuildStart),
    Route("GET", "/templates/{templateID}/builds/{buildID}/status", "get_template_build_status",
          "Template build status and log entries from logsOffset", _T, response=TemplateBuildInfo,
          query=("logsOffset",)),
)
