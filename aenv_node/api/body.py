"""Request-body parsing with E2B-shaped errors.

A body that is not JSON is a 400; JSON of the wrong shape (a missing required
field, a field of the wrong type, an unknown enum value) is a 422 naming the
field, so a user sees exactly what to fix.
"""

from __future__ import annotations

from typing import Any, Mapping

from quart import request

from .errors import ApiError

__all__ = ["json_body", "field"]


class _Field:
    def __init__(self, types: type | tuple[type, ...], required: bool = False, *, minimum: int | None = None):
        self.types = types if isinstance(types, tuple) else (types,)
        self.required = required
        self.minimum = minimum


def field(types: type | tuple[type, ...], required: bool = False, *, minimum: int | None = None) -> _Field:
    return _Field(types, required, minimum=minimum)


_NAMES = {int: "an integer", str: "a string", bool: "a boolean", dict: "an object", list: "an array",
          float: "a number"}


async def json_body(spec: Mapping[str, _Field], *, allow_empty: bool = True) -> dict[str, Any]:
    raw = await request.get_data()
    if not raw.strip():
        if allow_empty and not any(f.required for f in spec.values()):
            return {}
        raise ApiError(400, "request body must be a JSON object")
    import json

    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(422, "request body must be a JSON object")
    for name, f in spec.items():
        if name not in body or body[name] is None:
            if f.required:
                raise ApiError(422, f"field {name!r} is required")
            continue
        value = body[name]
        ok = isinstance(value, f.types) and not (
            isinstance(value, bool) and bool not in f.types
        )
        if not ok:
            wanted = " or ".join(_NAMES.get(t, t.__name__) for t in f.types)
            raise ApiError(422, f"field {name!r} must be {wanted}, got {type(value).__name__}")
        if f.minimum is not None and value < f.minimum:
            raise ApiError(422, f"field {name!r} must be >= {f.minimum}")
    return body
