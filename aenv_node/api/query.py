"""Query parameters: one model per route, the source of both their validation and their OpenAPI parameters.

A route names its ``QueryModel`` in the route table (``routes.py``); the app parses the request's query string
with it before the handler runs (the handler gets ``query=<model>``), and ``openapi.py`` documents each field as
a parameter with the JSON Schema pydantic generates for it, so the document says exactly what the node takes.
A value the model refuses is a 400 naming the parameter (``query parameter 'limit' must be <= 1000``).

Values are parsed strictly: an integer is ASCII digits with an optional ``-`` (no ``+``, spaces, ``_`` or
``5.0``), an enum is one of its words, a timestamp is RFC 3339, an array (E2B's ``state=running,paused``,
``sandbox_ids=a,b``) is its items joined by commas (``style: form, explode: false``). Parameters a model does
not name are ignored, as unknown body fields are.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from typing import Annotated, Any, Literal, Optional, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from werkzeug.datastructures import MultiDict

from .body import describe_error
from .errors import ApiError
from .models import LogLevel

__all__ = [
    "QueryModel",
    "parse_query",
    "array_parameters",
    "rfc3339_timestamp",
    "EventsQuery",
    "SandboxListQuery",
    "SandboxListV1Query",
    "SandboxesMetricsQuery",
    "SandboxMetricsQuery",
    "LogsQuery",
    "LogsV2Query",
    "SnapshotsQuery",
    "TemplatesPageQuery",
    "BuildStatusQuery",
    "UploadQuery",
    "ImportVmQuery",
    "LayerRangeQuery",
    "NEXT_TOKEN_PATTERN",
    "MAX_LIMIT",
]

Q = TypeVar("Q", bound="QueryModel")

_INT = re.compile(r"-?[0-9]{1,30}")


def _int(value: Any) -> Any:
    if isinstance(value, str):
        if not _INT.fullmatch(value):
            raise ValueError("must be an integer")
        return int(value)
    return value


def _items(value: Any) -> Any:
    if isinstance(value, str):
        return value.split(",") if value else []
    return value


_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt ]([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]+))?"
    r"(?:([Zz])|([+-])([0-9]{2}):([0-9]{2}))")


def rfc3339_timestamp(text: str) -> dt.datetime:
    """An RFC 3339 date-time (``2026-01-02T03:04:05.678Z``, any offset, a leap second read as :59), aware UTC."""
    m = _RFC3339.fullmatch(text)
    if m is None:
        raise ValueError("must be an RFC 3339 timestamp such as 2026-01-02T03:04:05Z")
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    micro = int((m.group(7) or "0")[:6].ljust(6, "0"))
    if m.group(8):
        tz = dt.timezone.utc
    else:
        oh, om = int(m.group(10)), int(m.group(11))
        if oh > 23 or om > 59:
            raise ValueError("has an offset out of range")
        sign = -1 if m.group(9) == "-" else 1
        tz = dt.timezone(sign * dt.timedelta(hours=oh, minutes=om))
    try:
        when = dt.datetime(year, month, day, hour, minute, min(second, 59), micro, tzinfo=tz)
        return when.astimezone(dt.timezone.utc)
    except (ValueError, OverflowError):
        raise ValueError("is not a valid date and time") from None


def _timestamp(value: Any) -> Any:
    return rfc3339_timestamp(value) if isinstance(value, str) else value


#: an RFC 3339 timestamp in the query string, documented as ``format: date-time``
QTimestamp = Annotated[dt.datetime, BeforeValidator(_timestamp)]
#: a comma-separated array in the query string
QStates = Annotated[list[Literal["running", "paused"]], BeforeValidator(_items)]
QIds = Annotated[list[Annotated[str, Field(pattern=r"^[^,]+$")]], BeforeValidator(_items)]

#: a page of the listings: 1..MAX_LIMIT
MAX_LIMIT = 1000
_MAX_MS = 253402300799999  # unix milliseconds: the last of year 9999, the last a timestamp can name
_MAX_S = _MAX_MS // 1000

# Integers in the query string (ASCII digits, optional ``-``). The bounds come before the parser in each
# Annotated: pydantic writes them into the JSON Schema only there (after it, they validate but are documented
# as unknown keywords).
Limit = Annotated[int, Field(ge=1, le=MAX_LIMIT), BeforeValidator(_int)]
UnixMs = Annotated[int, Field(ge=0, le=_MAX_MS), BeforeValidator(_int)]
UnixS = Annotated[int, Field(ge=0, le=_MAX_S), BeforeValidator(_int)]
EventId = Annotated[int, Field(ge=0, le=2**62), BeforeValidator(_int)]
Offset = Annotated[int, Field(ge=0, le=10**9), BeforeValidator(_int)]

#: ``x-next-token`` of ``GET /v2/sandboxes``: ``<startedAt in unix microseconds>.<sandbox id>`` of the last one
#: listed (17 digits reach past year 5000)
NEXT_TOKEN_PATTERN = r"^[0-9]{1,17}\.[A-Za-z0-9._-]{1,128}$"


class QueryModel(BaseModel):
    """A route's query parameters: strict types (the ``Q*`` parsers above), unknown parameters ignored."""

    model_config = ConfigDict(populate_by_name=True, extra="ignore", strict=True, frozen=True)


@functools.cache
def array_parameters(model: type[QueryModel]) -> frozenset[str]:
    """The (wire) names of ``model``'s array parameters: comma-separated in the query string."""
    props = model.model_json_schema(by_alias=True).get("properties", {})
    return frozenset(name for name, schema in props.items()
                     if schema.get("type") == "array" or any(s.get("type") == "array" for s in schema.get("anyOf", ())))


def parse_query(model: type[Q], args: MultiDict[str, str]) -> Q:
    """``args`` (the request's query string) as ``model``; a 400 naming the first bad parameter."""
    raw: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        values = args.getlist(key)
        if values:
            raw[key] = ",".join(values) if key in array_parameters(model) else values[0]
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        raise ApiError(400, describe_error(err, noun="query parameter")) from None


# ----- the routes' queries ---------------------------------------------------------------------------------------

class EventsQuery(QueryModel):
    sandbox_id: Optional[str] = Field(None, alias="sandboxID", description="only this sandbox's events")
    limit: Limit = 100
    after: Optional[EventId] = Field(
        None, description="an event id: the events after it, oldest first")


class SandboxListV1Query(QueryModel):
    metadata: Optional[str] = Field(
        None, description="key=value pairs joined by & (URL-encoded once more, as the E2B SDK sends them): only "
                          "sandboxes whose metadata has each pair")


class SandboxListQuery(SandboxListV1Query):
    state: Optional[QStates] = Field(
        None, description="comma-separated states (default: both)")
    next_token: Optional[str] = Field(None, alias="nextToken", pattern=NEXT_TOKEN_PATTERN,
                                      description="the x-next-token header of the previous page")
    limit: Limit = 100
    order: Literal["asc", "desc"] = Field("asc", description="by start time")
    started_after: Optional[QTimestamp] = Field(None, alias="startedAfter")
    template: Optional[str] = Field(None, description="a template id or alias")


class SandboxesMetricsQuery(QueryModel):
    sandbox_ids: QIds = Field(alias="sandbox_ids", min_length=1, max_length=100,
                                   description="comma-separated sandbox ids")


class SandboxMetricsQuery(QueryModel):
    start: Optional[UnixS] = Field(
        None, description="unix seconds (accepted; the node has the current sample only)")
    end: Optional[UnixS] = Field(
        None, description="unix seconds (accepted; the node has the current sample only)")


class LogsQuery(QueryModel):
    start: Optional[UnixMs] = Field(None, description="unix milliseconds: the first wanted")
    limit: Limit = MAX_LIMIT


class LogsV2Query(QueryModel):
    cursor: Optional[UnixMs] = Field(None, description="unix milliseconds: where to start reading")
    limit: Limit = MAX_LIMIT
    direction: Literal["forward", "backward"] = "forward"
    level: Optional[LogLevel] = Field(None, description="this level and worse")
    search: Optional[str] = Field(None, max_length=256, description="a substring of the message, any case")


class SnapshotsQuery(QueryModel):
    sandbox_id: Optional[str] = Field(None, alias="sandboxID")
    name: Optional[str] = None
    limit: Limit = 100
    next_token: Optional[str] = Field(None, alias="nextToken",
                                      description="accepted; the node answers in one page of at most limit")


class TemplatesPageQuery(QueryModel):
    limit: Limit = 100
    next_token: Optional[str] = Field(None, alias="nextToken", description="the last template id seen")


class BuildStatusQuery(QueryModel):
    logs_offset: Offset = Field(0, alias="logsOffset")


class LayerRangeQuery(QueryModel):
    """A range of a layer a peer asks for (P2P): at most ``p2p.max_range_bytes`` long."""

    offset: Annotated[int, Field(ge=0, le=1 << 50, description="the range's first byte in the layer"),
                      BeforeValidator(_int)]
    length: Annotated[int, Field(ge=1, le=1 << 30, description="the range's length in bytes"),
                      BeforeValidator(_int)]


class UploadQuery(QueryModel):
    token: str = Field(description="the token of the upload address get_template_files gave")


class ImportVmQuery(QueryModel):
    """POST /node/vm-templates (the kernel is the request body)."""

    alias: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$", description="the template's name")
    cpu_count: Annotated[int, Field(alias="cpuCount", ge=1, le=64), BeforeValidator(_int)] = 1
    memory_mb: Annotated[int, Field(alias="memoryMB", ge=16, le=1 << 20), BeforeValidator(_int)] = 128
    ready_console: str = Field(alias="readyConsole", min_length=1, max_length=256,
                               description="a line the guest prints on its console once it is up")
    timeout_s: Annotated[int, Field(alias="timeoutS", ge=1, le=600, description="how long the guest may take to "
                                    "print it"), BeforeValidator(_int)] = 30
