"""Request bodies: read the JSON, validate it with its model, answer in E2B's error shape.

A body that is not JSON is a 400; JSON of the wrong shape (a missing required
field, a field of the wrong type, a value out of range) is a 422 naming the
field, so a user sees exactly what to fix (``field 'timeout' must be an
integer, got str``). The rules themselves live in the models (``models.py``);
this module only turns pydantic's error list into one sentence.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_core import ErrorDetails
from quart import request

from .errors import ApiError
from .models import MAX_JSON_BODY, PATTERN_WORDS, RequestModel, RequestTooLarge

__all__ = ["parse_body", "validate_body", "describe_error", "needs_body"]

M = TypeVar("M", bound=RequestModel)

_TYPE_NAMES = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "string_type": "a string",
    "bool_type": "a boolean",
    "float_type": "a number",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "list_type": "an array",
}
_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
               type(None): "null"}


def _location(loc: Sequence[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


_TOO_LARGE = frozenset({"too_long", "string_too_long"})


def _too_large(err: ErrorDetails) -> bool:
    ctx = err.get("ctx") or {}
    return err["type"] in _TOO_LARGE or isinstance(ctx.get("error"), RequestTooLarge)


def describe_error(err: ErrorDetails, *, noun: str = "field") -> str:
    """One user-facing sentence for one pydantic error, naming the field (``noun``: "field" for a body, "query
    parameter" for a query) by its wire name."""
    loc = tuple(err["loc"])
    kind = err["type"]
    ctx: dict[str, Any] = dict(err.get("ctx") or {})
    if loc and loc[-1] == "[key]":  # a dict's key: named by the dict it is in
        field = _location(loc[:-2])
        if kind == "string_too_long":
            return f"a key of {noun} {field!r} must be at most {ctx['max_length']} characters"
        if kind == "string_too_short":
            return f"a key of {noun} {field!r} must not be empty"
    name = f"{noun} {_location(loc)!r}"
    if isinstance(ctx.get("error"), RequestTooLarge):
        return str(ctx["error"])
    if kind == "too_long":
        got = err["input"]
        return f"{name} must have at most {ctx['max_length']} entries, got {len(got)}" \
            if isinstance(got, (dict, list)) else f"{name} must have at most {ctx['max_length']} entries"
    if kind == "too_short":
        return f"{name} must have at least {ctx['min_length']} entries"
    if kind == "string_too_long":
        return f"{name} must be at most {ctx['max_length']} characters"
    if kind == "string_too_short":
        return f"{name} must be at least {ctx['min_length']} characters"
    if kind == "string_pattern_mismatch":
        words = PATTERN_WORDS.get(ctx["pattern"])
        return f"{name} must be {words}, got {err['input']!r}" if words else f"{name} must match {ctx['pattern']}"
    if kind == "missing":
        return f"{name} is required"
    if kind in _TYPE_NAMES:
        got = _JSON_TYPES.get(type(err["input"]), type(err["input"]).__name__)
        return f"{name} must be {_TYPE_NAMES[kind]}, got {got}"
    if kind == "greater_than_equal":
        return f"{name} must be >= {ctx['ge']}"
    if kind == "less_than_equal":
        return f"{name} must be <= {ctx['le']}"
    if kind in ("literal_error", "enum"):
        return f"{name} must be {ctx.get('expected', 'one of the documented values')}, got {err['input']!r}"
    if kind == "value_error" and ctx.get("error") is not None:
        if not loc:
            return str(ctx["error"])
        return f"{name} {ctx['error']}, got {err['input']!r}" if noun != "field" else f"{name} {ctx['error']}"
    return f"{name}: {err['msg']}" if loc else err["msg"]


#: errors of a value of the right type that the node cannot take (a name that breaks its pattern, an ENV step's
#: odd arguments): a 400, as they were when the layers below found them; a wrong type or range is a 422
_BAD_VALUE = frozenset({"string_pattern_mismatch", "value_error"})


def validate_body(model: type[M], body: Any) -> M:
    """Validate decoded JSON with ``model``; a wrong shape is a 422 naming the first bad field; a field over a
    size limit (``models.py``, limits) is a 400 naming it and the limit, and so is a value that breaks its
    pattern or a rule of its model."""
    if not isinstance(body, dict):
        raise ApiError(422, "request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if not errors:
            raise ApiError(422, str(exc)) from None
        big = [e for e in errors if _too_large(e)]
        first = (big or errors)[0]
        raise ApiError(400 if big or first["type"] in _BAD_VALUE else 422, describe_error(first)) from None


def _number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: one whose value is whole is an integer (JSON Schema's integer:
    ``30.0`` is 30), any other a float. No request field is a float, so only integers meet this."""
    value = float(text)
    return int(value) if value.is_integer() else value


def needs_body(model: type[RequestModel]) -> bool:
    """Whether a request must carry a body: ``{}`` is not a valid one (a required field, a rule of the model)."""
    try:
        model.model_validate({})
    except ValidationError:
        return True
    return False


async def parse_body(model: type[M]) -> M:
    """The request's JSON body as ``model``. An empty body is ``{}`` when no field is required; one over
    ``MAX_JSON_BODY`` bytes is a 413, refused by its Content-Length or as soon as that much has arrived."""
    too_large = ApiError(413, f"request body too large: at most {MAX_JSON_BODY} bytes")
    if (request.content_length or 0) > MAX_JSON_BODY:
        raise too_large
    chunks = bytearray()
    async for chunk in request.body:
        chunks += chunk
        if len(chunks) > MAX_JSON_BODY:
            raise too_large
    raw = bytes(chunks)
    if not raw.strip():
        if needs_body(model):
            raise ApiError(400, "request body must be a JSON object")
        return model.model_validate({})
    try:
        body = json.loads(raw, parse_float=_number)
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    return validate_body(model, body)
