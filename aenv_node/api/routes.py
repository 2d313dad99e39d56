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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from werkzeug.routing import BaseConverter

from .query import (
    QueryModel,
    BuildStatusQuery,
    EventsQuery,
    LogsQuery,
    LogsV2Query,
    SandboxesMetricsQuery,
    SandboxListQuery,
    SandboxListV1Query,
    SandboxMetricsQuery,
    SnapshotsQuery,
    TemplatesPageQuery,
    UploadQuery,
    LayerRangeQuery,
    ImportVmQuery,
)
from ..storage.repository.manifest import DIGEST_PATTERN
from .template_models import (
    FILES_HASH_PATTERN,
    AssignedTags,
    AssignTags,
    DeleteTags,
    ImportedVm,
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
    NodeDrain,
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
    SandboxesWithMetrics,
    SnapshotDetail,
    SnapshotInfo,
    Timeout,
)

__all__ = ["HeaderParam", "Route", "ROUTES", "PATH_PATTERNS", "PATH_CONVERTERS", "RESERVED_IDS",
           "IDEMPOTENCY_KEY", "anchored", "quart_path"]


@dataclass(frozen=True)
class HeaderParam:
    """A request header a route reads: the app refuses a value that breaks ``pattern`` (400) before the handler."""

    name: str
    pattern: str
    description: str


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # OpenAPI style: /sandboxes/{sandboxID}
    operation_id: str
    summary: str
    tag: str
    success: int = 200
    #: another success status with the same body (connect: 200 when it ran, 201 when it was resumed)
    also_success: Optional[int] = None
    auth: bool = True
    request: Optional[type[RequestModel]] = None  # the JSON body, parsed before the handler runs
    response: Optional[type[ResponseModel]] = None  # the success body (the handler returns it)
    response_is_list: bool = False
    query: Optional[type[QueryModel]] = None  # the query string, parsed before the handler runs (``query=``)
    upload: Optional[str] = None  # a raw request body of this media type, which the handler reads itself
    headers: tuple[HeaderParam, ...] = ()
    #: response headers of the success answer: name -> what it says
    response_headers: Mapping[str, str] = field(default_factory=dict)
    content_type: str = "application/json"
    #: the statuses of this route's own conditions; the ones every route of its kind can answer (401 with auth,
    #: 400/413/422 with a body, 400 with a query, 500, 503 when it reads the node's state) are added by openapi.py
    error_statuses: tuple[int, ...] = ()
    #: what a creating route's answer gives other routes: path parameter -> JSON pointer in the success body (the
    #: document's links; a fuzzer follows them from a create to the routes of what it made)
    provides: Mapping[str, str] = field(default_factory=dict)
    #: False: the route needs nothing of the node's state (no 503 while the node drains or its database is busy)
    stateful: bool = True


#: path parameters with a format of their own (the app refuses another value with a 400 before the handler); any
#: other is a non-empty string
PATH_PATTERNS: Mapping[str, str] = {"hash": FILES_HASH_PATTERN, "layerDigest": DIGEST_PATTERN}

#: Paths that are also an instance of a parameterized path: ``/sandboxes/metrics`` of ``/sandboxes/{sandboxID}``,
#: ``/templates/tags`` of ``/templates/{templateID}``. That word is never the parameter when it ends the path (the
#: node never names a sandbox so, nor lets a template be named so), so ``DELETE /sandboxes/metrics`` is a 405 and
#: not a kill of a sandbox called ``metrics``, and each path's methods are exactly the documented ones.
RESERVED_IDS: Mapping[str, tuple[str, ...]] = {"sandboxID": ("metrics",), "templateID": ("tags",)}


def _reserved_converter(words: tuple[str, ...]) -> type[BaseConverter]:
    class Converter(BaseConverter):
        regex = r"(?!(?:" + "|".join(map(re.escape, words)) + r")$)[^/]+"

    return Converter


#: path parameter -> the router's converter for it where it ends a path (``create_app`` registers them)
PATH_CONVERTERS: Mapping[str, tuple[str, type[BaseConverter]]] = {
    name: (f"not_{name.lower()}", _reserved_converter(words)) for name, words in RESERVED_IDS.items()}


def anchored(pattern: str) -> re.Pattern[str]:
    """A document's ``^...$`` pattern compiled to match whole values only, as JSON Schema means it (Python's
    ``$`` also matches before a final newline)."""
    return re.compile(pattern.removesuffix("$") + r"\Z")


IDEMPOTENCY_KEY = HeaderParam("Idempotency-Key", r"^[A-Za-z0-9_-]{1,255}$",
                              "creates at most one sandbox for this key (docs/api.md, Idempotent create)")


def quart_path(path: str) -> str:
    def rule(m: re.Match[str]) -> str:
        name = m.group(1)
        if name in PATH_CONVERTERS and m.end() == len(path):
            return f"<{PATH_CONVERTERS[name][0]}:{name}>"
        return f"<{name}>"

    return re.sub(r"\{(\w+)\}", rule, path)


_SB = "sandboxes"
_T = "templates"
_SN = "snapshots"
_N = "node"

_CREATED_SANDBOX = {"sandboxID": "/sandboxID"}
_RESTORES = (404, 409, 501, 502, 503)  # resume, connect: a claim in the repository, a restore

ROUTES: tuple[Route, ...] = (
    # -- node (native) -----------------------------------------------------
    Route("GET", "/health", "health", "Liveness of the node", _N, auth=False, response=Health, stateful=False),
    Route("GET", "/metrics", "metrics", "Prometheus metrics", _N, auth=False,
          content_type="text/plain", stateful=False),
    Route("GET", "/openapi.json", "openapi", "This document", _N, auth=False, stateful=False),
    Route("GET", "/node", "node_info", "Node identity, version and capacity", _N, response=NodeInfo),
    Route("POST", "/node/drain", "drain_node", "Drain the node: no new sandbox operations (503), every running "
          "sandbox paused and published to the repository, for another node to resume; not undone until the node "
          "restarts (aenv-node drain)", _N, response=NodeDrain, error_statuses=(501,)),
    Route("POST", "/node/vm-templates", "import_vm_template", "Import a VM without envd as a template: the request "
          "body is its kernel (an x86-64 ELF with a PVH note, at most 32 MiB); it is booted until its console prints "
          "readyConsole, and its boot snapshot kept. Its sandboxes run once their VMM does (no envd, no /init)",
          _T, success=201, query=ImportVmQuery, upload="application/octet-stream", response=ImportedVm,
          error_statuses=(403, 409, 413, 502)),
    Route("GET", "/node/layers/{layerDigest}", "get_layer_range", "A range of a layer this node caches, for a "
          "peer node (P2P, p2p.enabled): only chunks cached here are served (404 otherwise, never fetched); at "
          "most p2p.max_range_bytes, at most p2p.max_concurrent_serves at once (503)", _N, query=LayerRangeQuery,
          content_type="application/octet-stream", error_statuses=(404, 503), stateful=False),
    Route("GET", "/events", "list_events", "State-change events, newest first (after=ID: the ones after it, "
          "oldest first)", _N, response=Event, response_is_list=True, query=EventsQuery),
    # -- E2B sandboxes -----------------------------------------------------
    Route("POST", "/v2/sandboxes", "create_sandbox_v2", "Create a sandbox", _SB, success=201,
          request=NewSandbox, response=Sandbox, headers=(IDEMPOTENCY_KEY,), error_statuses=(404, 409, 502),
          provides=_CREATED_SANDBOX),
    Route("GET", "/v2/sandboxes", "list_sandboxes_v2", "List sandboxes", _SB,
          response=ListedSandbox, response_is_list=True, query=SandboxListQuery,
          response_headers={"x-next-token": "there are more: send it as nextToken for the next page"}),
    Route("POST", "/sandboxes", "create_sandbox", "Create a sandbox (v1)", _SB, success=201,
          request=NewSandbox, response=Sandbox, headers=(IDEMPOTENCY_KEY,), error_statuses=(404, 409, 502),
          provides=_CREATED_SANDBOX),
    Route("GET", "/sandboxes", "list_sandboxes", "List running sandboxes (v1)", _SB,
          response=ListedSandbox, response_is_list=True, query=SandboxListV1Query),
    Route("GET", "/sandboxes/metrics", "list_sandboxes_metrics", "Latest metrics of several sandboxes",
          _SB, response=SandboxesWithMetrics, query=SandboxesMetricsQuery),
    # the reserved ids (RESERVED_IDS) are the other routes of their paths: GET /sandboxes/metrics without its
    # sandbox_ids is a 400, DELETE /sandboxes/metrics a 405
    Route("GET", "/sandboxes/{sandboxID}", "get_sandbox", "Get a sandbox", _SB,
          response=SandboxDetail, error_statuses=(400, 404)),
    Route("DELETE", "/sandboxes/{sandboxID}", "kill_sandbox", "Kill a sandbox", _SB, success=204,
          error_statuses=(404, 405, 409)),
    Route("POST", "/sandboxes/{sandboxID}/timeout", "set_sandbox_timeout",
          "Set the sandbox's timeout from now", _SB, success=204, request=Timeout, error_statuses=(404, 409)),
    Route("POST", "/sandboxes/{sandboxID}/refreshes", "refresh_sandbox",
          "Keep a running sandbox alive at least duration seconds more", _SB, success=204, request=Refresh,
          error_statuses=(404, 409)),
    Route("GET", "/sandboxes/{sandboxID}/metrics", "get_sandbox_metrics", "Sandbox metrics", _SB,
          response=SandboxMetric, response_is_list=True, query=SandboxMetricsQuery, error_statuses=(404,)),
    Route("GET", "/sandboxes/{sandboxID}/logs", "get_sandbox_logs",
          "Sandbox logs from start (unix ms), oldest first (v1)", _SB, response=SandboxLogs,
          query=LogsQuery, error_statuses=(404,)),
    Route("GET", "/v2/sandboxes/{sandboxID}/logs", "get_sandbox_logs_v2",
          "Sandbox logs from cursor (unix ms) forward or backward, by minimum level and search", _SB,
          response=SandboxLogsV2, query=LogsV2Query, error_statuses=(404,)),
    Route("POST", "/sandboxes/{sandboxID}/pause", "pause_sandbox", "Pause a sandbox", _SB,
          success=204, request=PauseSandbox, error_statuses=(404, 409, 502, 507)),
    Route("POST", "/sandboxes/{sandboxID}/resume", "resume_sandbox", "Resume a paused sandbox", _SB,
          success=201, request=ResumeSandbox, response=Sandbox, error_statuses=_RESTORES),
    Route("POST", "/sandboxes/{sandboxID}/connect", "connect_sandbox",
          "Connect to a sandbox, resuming it if paused (v1)", _SB, request=ConnectSandbox,
          response=Sandbox, also_success=201, error_statuses=_RESTORES),
    Route("POST", "/v2/sandboxes/{sandboxID}/connect", "connect_sandbox_v2",
          "Connect to a sandbox, resuming it if paused", _SB, request=ConnectSandbox,
          response=Sandbox, also_success=201, error_statuses=_RESTORES),
    Route("POST", "/sandboxes/{sandboxID}/fork", "fork_sandbox", "Fork a sandbox into children", _SB,
          success=201, request=ForkSandbox, response=ForkResult, response_is_list=True,
          error_statuses=(404, 409, 502, 507)),
    Route("POST", "/sandboxes/{sandboxID}/snapshots", "create_snapshot",
          "Snapshot a running sandbox", _SN, success=201, request=NewSnapshot,
          response=SnapshotInfo, error_statuses=(404, 409, 502, 507),
          # a snapshot is a template: its id is a templateID too (create from it, delete it)
          provides={"snapshotID": "/snapshotID", "templateID": "/snapshotID"}),
    Route("PUT", "/sandboxes/{sandboxID}/network", "update_sandbox_network",
          "Update the sandbox's egress policy", _SB, success=204, request=NetworkUpdate,
          error_statuses=(404, 409)),
    Route("GET", "/snapshots", "list_snapshots", "List snapshots", _SN,
          response=SnapshotDetail, response_is_list=True, query=SnapshotsQuery),
    Route("GET", "/snapshots/{snapshotID}/lineage", "snapshot_lineage",
          "A snapshot's parent chain, newest first", _SN, response=SnapshotDetail,
          response_is_list=True, error_statuses=(404,)),
    # -- templates ---------------------------------------------------------
    Route("GET", "/templates", "list_templates", "List templates", _T,
          response=Template, response_is_list=True),
    Route("GET", "/v2/templates", "list_templates_v2", "List templates (paged)", _T,
          response=Template, response_is_list=True, query=TemplatesPageQuery),
    # GET /templates/tags is a 405; DELETE /templates/tags without its body a 400 (RESERVED_IDS)
    Route("GET", "/templates/{templateID}", "get_template", "Get a template and its builds", _T,
          response=TemplateWithBuilds, error_statuses=(404, 405)),
    Route("GET", "/templates/{templateID}/tags", "get_template_tags", "A template's tags and their builds", _T,
          response=TemplateTag, response_is_list=True, error_statuses=(404,)),
    Route("POST", "/templates/tags", "assign_template_tags", "Point tags at the build a name:tag names", _T,
          success=201, request=AssignTags, response=AssignedTags, error_statuses=(403, 404)),
    Route("DELETE", "/templates/tags", "delete_template_tags", "Remove tags from a template", _T, success=204,
          request=DeleteTags, error_statuses=(403, 404)),
    Route("DELETE", "/templates/{templateID}", "delete_template",
          "Delete a template or snapshot", _T, success=204, error_statuses=(400, 403, 404, 409)),
    Route("GET", "/templates/aliases/{alias}", "get_template_alias", "Resolve a template alias", _T,
          response=TemplateAlias, error_statuses=(404,)),
    Route("POST", "/v3/templates", "create_template", "Register a template build", _T, success=202,
          request=TemplateBuildRequest, response=TemplateRequestResponse, error_statuses=(403,),
          provides={"templateID": "/templateID", "buildID": "/buildID"}),
    Route("GET", "/templates/{templateID}/files/{hash}", "get_template_files",
          "Whether a COPY step's files are here, else where to upload them", _T, success=201,
          response=TemplateFileUpload),
    Route("PUT", "/templates/{templateID}/files/{hash}", "upload_template_files",
          "Upload a COPY step's files (the address get_template_files gave, with its token)", _T,
          success=204, auth=False, query=UploadQuery, upload="application/octet-stream",
          error_statuses=(401, 413)),
    Route("POST", "/v2/templates/{templateID}/builds/{buildID}", "start_template_build",
          "Start a registered build from its recipe", _T, success=202, request=TemplateBuildStart,
          error_statuses=(404, 409)),
    Route("GET", "/templates/{templateID}/builds/{buildID}/status", "get_template_build_status",
          "Template build status and log entries from logsOffset", _T, response=TemplateBuildInfo,
          query=BuildStatusQuery, error_statuses=(404,)),
)
