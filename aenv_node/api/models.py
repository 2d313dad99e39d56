"""The API's request and response models: one source for validation, serialization and /openapi.json.

Every JSON body the node reads is a ``RequestModel`` and every JSON body it writes is a
``ResponseModel``; ``openapi.py`` generates the document's component schemas from these classes
and ``routes.py`` names them per route, so the validator, the serializer and the document cannot
disagree (they used to be three hand-written copies that did).

Wire names are E2B's (reference/e2b-protocol.md section 3): Python attributes are snake_case and
``Field(alias=...)`` gives the camelCase name the SDKs send and parse, including E2B's one odd
snake_case field, ``allow_internet_access``.

Requests are validated strictly (``"5"`` is not an integer, ``true`` is not a number: the SDKs send
proper JSON types and a loose coercion would hide client bugs), ignore fields the node does not
implement (the SDKs send ``mcp``, ``volumeMounts``, ``autoPauseMemory``...), and treat ``null`` as
absent, as E2B's generated clients do for unset optional fields.

Responses keep E2B's exact key sets: a field in ``omit_when_none`` is left out when it has no
value (``alias`` of a listed sandbox, ``network`` of a detail), any other optional field is sent
as ``null`` (the SDK's parsers expect e.g. ``envdAccessToken: null`` rather than a missing key).

E2B's models know two sandbox states, ``running`` and ``paused``; the node has more.
``e2b_state`` folds them; sandboxes in ``error`` or ``killed`` are not E2B-visible (the native
``/events`` and the CLI show them).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Optional, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

from ..state import EventSubject, SandboxState, SnapshotKind, SnapshotStatus
from ..state import Event as EventRow
from ..state import Sandbox as SandboxRow
from ..state import SandboxLog as SandboxLogRow
from ..state import Snapshot as SnapshotRow

__all__ = [
    "E2BState",
    "Timestamp",
    "rfc3339",
    "e2b_state",
    "RequestModel",
    "RequestTooLarge",
    "MAX_JSON_BODY",
    "PATTERN_WORDS",
    "worded",
    "EGRESS_ALLOW_PATTERN",
    "EGRESS_DENY_PATTERN",
    "REFRESH_MAX_S",
    "ResponseModel",
    # requests
    "SandboxAutoResumeConfig",
    "SandboxNetworkConfig",
    "NewSandbox",
    "Timeout",
    "Refresh",
    "ResumeSandbox",
    "ConnectSandbox",
    "ForkSandbox",
    "NewSnapshot",
    "PauseSandbox",
    "NetworkUpdate",
    # responses
    "Error",
    "Health",
    "NodeDrain",
    "NodeInfo",
    "Event",
    "Sandbox",
    "ListedSandbox",
    "SandboxLifecycle",
    "SandboxNetwork",
    "SandboxDetail",
    "SandboxMetric",
    "SandboxesWithMetrics",
    "ForkResult",
    "SnapshotInfo",
    "SnapshotDetail",
    "LogLevel",
    "SandboxLogEntry",
    "SandboxLogLine",
    "SandboxLogs",
    "SandboxLogsV2",
]

E2BState = Literal["running", "paused"]

_RUNNING_LIKE = frozenset({
    SandboxState.CREATING,
    SandboxState.RUNNING,
    SandboxState.SNAPSHOTTING,
    SandboxState.FORKING,
    SandboxState.RESUMING,
})
_PAUSED_LIKE = frozenset({SandboxState.PAUSING, SandboxState.PAUSED})


def rfc3339(ts: dt.datetime) -> str:
    """UTC ISO-8601 with a ``Z``: what E2B sends and the SDK's ``isoparse`` reads."""
    return ts.astimezone(dt.timezone.utc).isoformat().replace("+00:00", "Z")


def e2b_state(state: str) -> Optional[E2BState]:
    """The E2B state a node state shows as; None: the sandbox is not E2B-visible."""
    if state in _RUNNING_LIKE:
        return "running"
    if state in _PAUSED_LIKE:
        return "paused"
    return None


#: A timestamp, sent as RFC 3339 (``...Z``); documented as ``string``/``date-time``.
Timestamp = Annotated[dt.datetime, PlainSerializer(rfc3339, return_type=str)]


# ----- bases ---------------------------------------------------------------------------------


# ----- limits ----------------------------------------------------------------------------------
# What one request may carry (docs/api.md, "Limits"): a sandbox's metadata is sent back in every listing, and
# its environment reaches every process in its guest, so neither may grow without bound (a 20 MB metadata
# value was accepted and then returned by every list). Over a limit is a 400 naming the field and the limit.

#: the largest JSON request body, in bytes (a 413 beyond; template file uploads have their own)
MAX_JSON_BODY = 1 << 20
METADATA_MAX_ENTRIES = 64
METADATA_KEY_MAX = 256
METADATA_VALUE_MAX = 4096
ENV_MAX_ENTRIES = 256
ENV_NAME_MAX = 256
ENV_VALUE_MAX = 32 * 1024
#: all names and values of a sandbox's environment together, in characters
ENV_TOTAL_MAX = 256 * 1024
EGRESS_MAX_RULES = 256
EGRESS_RULE_MAX = 256

Metadata = Annotated[
    dict[Annotated[str, Field(min_length=1, max_length=METADATA_KEY_MAX)],
         Annotated[str, Field(max_length=METADATA_VALUE_MAX)]],
    Field(max_length=METADATA_MAX_ENTRIES),
]
EnvVars = Annotated[
    dict[Annotated[str, Field(min_length=1, max_length=ENV_NAME_MAX)], Annotated[str, Field(max_length=ENV_VALUE_MAX)]],
    Field(max_length=ENV_MAX_ENTRIES),
]

# What an egress entry is (net/egress.py): an IPv4 address or CIDR, or (allowOut only) a domain name, `*.` for the
# names below it; either with `:port` or `:low-high`. Checked here by its pattern, then by the net layer's parser
# (a range must go low to high, a 400).
#: what a pattern of a request field means, in words (the 400 names it instead of the regular expression)
PATTERN_WORDS: dict[str, str] = {}


def worded(pattern: str, words: str) -> str:
    """``pattern``, recorded with the words that describe it to a person."""
    PATTERN_WORDS[pattern] = words
    return pattern


_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_ADDRESS = rf"(?:{_OCTET}\.){{3}}{_OCTET}(?:/(?:3[0-2]|[12]?[0-9]))?"
_DOMAIN = r"(?:\*\.)?(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,63}\.?"
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
_PORTS = rf"(?::{_PORT}(?:-{_PORT})?)?"
EGRESS_ALLOW_PATTERN = worded(rf"^(?:{_ADDRESS}|{_DOMAIN}){_PORTS}$",
                              "an IPv4 address or CIDR, or a domain name, with an optional :port or :low-high")
EGRESS_DENY_PATTERN = worded(rf"^{_ADDRESS}{_PORTS}$", "an IPv4 address or CIDR with an optional :port or :low-high")

AllowRules = Annotated[list[Annotated[str, Field(max_length=EGRESS_RULE_MAX, pattern=EGRESS_ALLOW_PATTERN)]],
                       Field(max_length=EGRESS_MAX_RULES)]
DenyRules = Annotated[list[Annotated[str, Field(max_length=EGRESS_RULE_MAX, pattern=EGRESS_DENY_PATTERN)]],
                      Field(max_length=EGRESS_MAX_RULES)]

#: the most a refresh extends a sandbox's life by (E2B's maximum)
REFRESH_MAX_S = 3600


class RequestModel(BaseModel):
    """A JSON request body: strict types, unknown fields ignored, ``null`` means absent."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore", strict=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # E2B's clients send null for unset optionals; a required field sent as null is "required".
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class ResponseModel(BaseModel):
    """A JSON response body; ``to_json`` gives E2B's key set (see ``omit_when_none``)."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    #: Fields (by attribute name) left out of the JSON when None instead of sent as null.
    omit_when_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for name in self.omit_when_none:
                if getattr(self, name) is None:
                    field = type(self).model_fields[name]
                    data.pop(field.alias if info.by_alias and field.alias else name, None)
        return data

    def to_json(self) -> dict[str, Any]:
        """The JSON-ready dict with E2B's wire names."""
        out: dict[str, Any] = self.model_dump(mode="json", by_alias=True)
        return out


# ----- requests ------------------------------------------------------------------------------

_TIMEOUT = "seconds from now until the sandbox times out (paused or killed, see autoPause)"


class SandboxAutoResumeConfig(RequestModel):
    enabled: bool = Field(False, description="proxied traffic to the paused sandbox resumes it")


class SandboxNetworkConfig(RequestModel):
    """Egress policy: CIDRs or domains; ``allowOut`` wins over ``denyOut``."""

    allow_out: Optional[AllowRules] = Field(
        None, alias="allowOut", description="IPv4 addresses, CIDRs or domain names (*.example.com: the names below "
                                           "it), each with an optional :port or :low-high")
    deny_out: Optional[DenyRules] = Field(
        None, alias="denyOut", description="IPv4 addresses or CIDRs, each with an optional :port or :low-high")
    allow_public_traffic: Optional[bool] = Field(
        None, alias="allowPublicTraffic",
        description="false: every port but envd's needs the sandbox's trafficAccessToken "
                    "(E2B-Traffic-Access-Token header); default true")


class NewSandbox(RequestModel):
    """POST /v2/sandboxes (E2B's NewSandboxV2)."""

    template_id: Optional[str] = Field(
        None, alias="templateID",
        description="template id or alias, or a snapshot id; the node's default template when absent")
    timeout: Optional[int] = Field(None, ge=0, description=_TIMEOUT + "; the node's default when absent")
    metadata: Metadata = Field(default_factory=dict)
    env_vars: EnvVars = Field(default_factory=dict, alias="envVars")
    auto_pause: bool = Field(True, alias="autoPause", description="pause (not kill) on timeout")
    auto_resume: Optional[SandboxAutoResumeConfig] = Field(None, alias="autoResume")
    allow_internet_access: bool = True
    network: Optional[SandboxNetworkConfig] = None

    @model_validator(mode="after")
    def _environment_fits(self) -> "NewSandbox":
        total = sum(len(k) + len(v) for k, v in self.env_vars.items())
        if total > ENV_TOTAL_MAX:
            raise RequestTooLarge(f"field 'envVars' must total at most {ENV_TOTAL_MAX} characters (names and "
                                  f"values), got {total}")
        return self


class RequestTooLarge(ValueError):
    """A request over one of the limits above (a 400, not a 422: its shape is right, its size is not)."""


class Timeout(RequestModel):
    """POST /sandboxes/{id}/timeout."""

    timeout: int = Field(ge=0, description=_TIMEOUT)


class Refresh(RequestModel):
    """POST /sandboxes/{id}/refreshes (E2B): keep the sandbox alive at least ``duration`` seconds from now."""

    duration: Optional[int] = Field(
        None, ge=0, le=REFRESH_MAX_S,
        description="the sandbox ends no sooner than this many seconds from now (at least 15; default 15); a "
                    "refresh never shortens its life")


class ResumeSandbox(RequestModel):
    timeout: Optional[int] = Field(None, ge=0, description=_TIMEOUT)
    auto_pause: Optional[bool] = Field(None, alias="autoPause")


class ConnectSandbox(RequestModel):
    timeout: Optional[int] = Field(None, ge=0, description=_TIMEOUT)


class ForkSandbox(RequestModel):
    count: int = Field(1, ge=1, description="number of children (at most the node's fork_max_count)")
    timeout: Optional[int] = Field(None, ge=0, description="each child's timeout, " + _TIMEOUT)


class NewSnapshot(RequestModel):
    name: Optional[str] = None
    memory: Optional[bool] = None


class PauseSandbox(RequestModel):
    """POST /sandboxes/{id}/pause: the SDK's options are accepted; the node always keeps memory."""

    memory: Optional[bool] = None
    require_healthy_guest: Optional[bool] = Field(None, alias="requireHealthyGuest")


class NetworkUpdate(SandboxNetworkConfig):
    """PUT /sandboxes/{id}/network: replaces the egress policy (E2B's SandboxNetworkUpdateConfig)."""


# ----- responses -----------------------------------------------------------------------------


class Error(ResponseModel):
    """Every error the API answers (the SDKs crash on any other error body)."""

    omit_when_none: ClassVar[frozenset[str]] = frozenset({"error_code"})

    code: int
    message: str
    error_code: Optional[str] = Field(
        None, description="E2B's machine-readable code, where one applies (idempotency_request_mismatch)")


class Health(ResponseModel):
    status: Literal["ok", "draining"]
    version: str


class NodeDrain(ResponseModel):
    """What ``POST /node/drain`` left (the node takes no new sandbox operation from then on)."""

    paused: int = Field(description="running sandboxes this drain paused and published")
    running: int = Field(description="sandboxes still running (their pause failed; the log says why)")
    unpublished: int = Field(description="paused sandboxes whose snapshot is not yet in the repository (the node "
                                         "goes on publishing them; until then only this node can resume them)")


class NodeInfo(ResponseModel):
    node_id: str = Field(alias="nodeID")
    version: str
    listen: str
    state_dir: str = Field(alias="stateDir")
    started_at: Timestamp = Field(alias="startedAt")
    sandboxes: dict[str, int] = Field(description="sandbox count by node state")


class Event(ResponseModel):
    """One row of the append-only ``events`` table."""

    id: int
    ts: Timestamp
    sandbox_id: Optional[str] = Field(alias="sandboxID")
    subject: EventSubject
    subject_id: Optional[str] = Field(alias="subjectID")
    operation: str
    from_state: Optional[str] = Field(alias="fromState")
    to_state: Optional[str] = Field(alias="toState")
    duration_ms: Optional[float] = Field(alias="durationMs")
    error: Optional[str]
    detail: Optional[dict[str, Any]]

    @classmethod
    def from_row(cls, ev: EventRow) -> Event:
        return cls(id=ev.id, ts=ev.ts, sandbox_id=ev.sandbox_id, subject=ev.subject, subject_id=ev.subject_id,
                   operation=ev.operation, from_state=ev.from_state, to_state=ev.to_state,
                   duration_ms=ev.duration_ms, error=ev.error, detail=ev.detail)


class Sandbox(ResponseModel):
    """A created or connected sandbox (E2B's Sandbox): what the SDK needs to reach envd."""

    template_id: str = Field(alias="templateID")
    sandbox_id: str = Field(alias="sandboxID")
    alias: Optional[str] = None
    client_id: str = Field(alias="clientID")
    envd_version: str = Field(alias="envdVersion")
    envd_access_token: Optional[str] = Field(None, alias="envdAccessToken")
    traffic_access_token: Optional[str] = Field(None, alias="trafficAccessToken")
    domain: Optional[str] = None

    @classmethod
    def from_row(cls, sb: SandboxRow, *, node_id: str, domain: str) -> Sandbox:
        return cls(template_id=sb.template_id, sandbox_id=sb.id, alias=sb.alias,
                   client_id=sb.client_id or node_id, envd_version=sb.envd_version,
                   envd_access_token=sb.envd_access_token, traffic_access_token=sb.traffic_access_token,
                   domain=domain or None)


def _visible_state(sb: SandboxRow) -> E2BState:
    state = e2b_state(sb.state)
    if state is None:  # callers filter: listing skips them, get answers 404
        raise ValueError(f"sandbox {sb.id} is {sb.state}: not E2B-visible")
    return state


class ListedSandbox(ResponseModel):
    """An entry of GET /v2/sandboxes (E2B's ListedSandbox)."""

    omit_when_none: ClassVar[frozenset[str]] = frozenset({"alias"})

    template_id: str = Field(alias="templateID")
    alias: Optional[str] = None
    sandbox_id: str = Field(alias="sandboxID")
    client_id: str = Field(alias="clientID")
    started_at: Timestamp = Field(alias="startedAt")
    end_at: Timestamp = Field(alias="endAt")
    cpu_count: int = Field(alias="cpuCount")
    memory_mb: int = Field(alias="memoryMB")
    disk_size_mb: int = Field(alias="diskSizeMB")
    metadata: dict[str, str] = Field(default_factory=dict)
    state: E2BState
    envd_version: str = Field(alias="envdVersion")

    @classmethod
    def _row_fields(cls, sb: SandboxRow) -> dict[str, Any]:
        return dict(template_id=sb.template_id, alias=sb.alias or None, sandbox_id=sb.id,
                    client_id=sb.client_id or sb.node_id, started_at=sb.started_at, end_at=sb.end_at,
                    cpu_count=sb.cpu_count, memory_mb=sb.memory_mb, disk_size_mb=sb.disk_size_mb,
                    metadata=dict(sb.metadata_ or {}), state=_visible_state(sb), envd_version=sb.envd_version)

    @classmethod
    def from_row(cls, sb: SandboxRow) -> ListedSandbox:
        return cls(**cls._row_fields(sb))


class SandboxLifecycle(ResponseModel):
    auto_resume: bool = Field(alias="autoResume")
    on_timeout: Literal["pause", "kill"] = Field(alias="onTimeout")


class SandboxNetwork(ResponseModel):
    """The stored egress policy; a list that was never set is left out."""

    omit_when_none: ClassVar[frozenset[str]] = frozenset({"allow_out", "deny_out"})

    allow_out: Optional[list[str]] = Field(None, alias="allowOut")
    deny_out: Optional[list[str]] = Field(None, alias="denyOut")

    @classmethod
    def from_policy(cls, policy: Mapping[str, Any] | None) -> Optional[SandboxNetwork]:
        if not policy:
            return None
        return cls(allow_out=policy.get("allowOut"), deny_out=policy.get("denyOut"))


class SandboxDetail(ListedSandbox):
    """GET /sandboxes/{id} (E2B's SandboxDetail)."""

    omit_when_none: ClassVar[frozenset[str]] = frozenset({"alias", "network"})

    envd_access_token: Optional[str] = Field(alias="envdAccessToken")
    allow_internet_access: bool = Field(alias="allowInternetAccess")
    domain: Optional[str]
    lifecycle: SandboxLifecycle
    network: Optional[SandboxNetwork] = None

    @classmethod
    def from_row(cls, sb: SandboxRow, *, domain: str = "") -> SandboxDetail:
        return cls(**cls._row_fields(sb), envd_access_token=sb.envd_access_token,
                   allow_internet_access=sb.allow_internet_access, domain=domain or None,
                   lifecycle=SandboxLifecycle(auto_resume=sb.auto_resume,
                                              on_timeout="pause" if sb.auto_pause else "kill"),
                   network=SandboxNetwork.from_policy(sb.network_policy))


class SandboxMetric(ResponseModel):
    """One sample of GET /sandboxes/{id}/metrics, from envd's /metrics document."""

    timestamp: Timestamp
    timestamp_unix: int = Field(alias="timestampUnix")
    cpu_count: int = Field(alias="cpuCount")
    cpu_used_pct: float = Field(alias="cpuUsedPct")
    mem_used: int = Field(alias="memUsed")
    mem_total: int = Field(alias="memTotal")
    mem_cache: int = Field(alias="memCache")
    disk_used: int = Field(alias="diskUsed")
    disk_total: int = Field(alias="diskTotal")

    @classmethod
    def from_envd(cls, doc: Mapping[str, Any], *, cpu_count: int) -> SandboxMetric:
        """envd's snake_case sample (``guest/metrics.py``); a missing figure reads 0."""
        ts = doc.get("ts") or int(dt.datetime.now(dt.timezone.utc).timestamp())
        return cls.model_validate({
            "timestamp": dt.datetime.fromtimestamp(ts, dt.timezone.utc),
            "timestampUnix": ts,
            "cpuCount": doc.get("cpu_count", cpu_count),
            "cpuUsedPct": doc.get("cpu_used_pct", 0.0),
            "memUsed": doc.get("mem_used", 0),
            "memTotal": doc.get("mem_total", 0),
            "memCache": doc.get("mem_cache", 0),
            "diskUsed": doc.get("disk_used", 0),
            "diskTotal": doc.get("disk_total", 0),
        })


class SandboxesWithMetrics(ResponseModel):
    """GET /sandboxes/metrics: the current sample of each listed sandbox that runs on this node."""

    sandboxes: dict[str, SandboxMetric]


class ForkResult(ResponseModel):
    """Per child of a fork: the sandbox, or the error that stopped it (exactly one key)."""

    omit_when_none: ClassVar[frozenset[str]] = frozenset({"sandbox", "error"})

    sandbox: Optional[Sandbox] = None
    error: Optional[Error] = None


class SnapshotInfo(ResponseModel):
    """A snapshot as E2B's SDK reads it (create_snapshot, list_snapshots)."""

    snapshot_id: str = Field(alias="snapshotID")
    names: list[str]


class SnapshotDetail(SnapshotInfo):
    """A snapshot with its place in the DAG (native: list, lineage)."""

    parent_id: Optional[str] = Field(alias="parentID")
    source_sandbox_id: Optional[str] = Field(alias="sourceSandboxID")
    kind: SnapshotKind
    status: SnapshotStatus
    created_at: Timestamp = Field(alias="createdAt")

    @classmethod
    def from_row(cls, sn: SnapshotRow) -> SnapshotDetail:
        return cls(snapshot_id=sn.id, names=[sn.name] if sn.name else [], parent_id=sn.parent_id,
                   source_sandbox_id=sn.source_sandbox_id, kind=sn.kind, status=sn.status,
                   created_at=sn.created_at)


LogLevel = Literal["debug", "info", "warn", "error"]


class SandboxLogEntry(ResponseModel):
    """One line of a sandbox's logs (E2B's SandboxLogEntry); ``fields`` says where it came from: ``source``
    (kernel, init, envd, console) and, for envd's records, its ``logger``."""

    timestamp: Timestamp
    level: LogLevel
    message: str
    fields: dict[str, str]

    @classmethod
    def from_row(cls, row: SandboxLogRow) -> SandboxLogEntry:
        fields = {"source": row.source}
        if row.logger:
            fields["logger"] = row.logger
        return cls(timestamp=row.ts, level=cast(LogLevel, row.level), message=row.message, fields=fields)


class SandboxLogLine(ResponseModel):
    """A plain log line (E2B's SandboxLog, v1)."""

    timestamp: Timestamp
    line: str


class SandboxLogs(ResponseModel):
    """``GET /sandboxes/{id}/logs`` (v1): the lines plain and structured."""

    logs: list[SandboxLogLine]
    log_entries: list[SandboxLogEntry] = Field(alias="logEntries")


class SandboxLogsV2(ResponseModel):
    """``GET /v2/sandboxes/{id}/logs``."""

    logs: list[SandboxLogEntry]
