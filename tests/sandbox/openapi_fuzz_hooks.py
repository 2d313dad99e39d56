"""Schemathesis hooks for fuzzing a node's API (``schemathesis.toml`` loads them; docs/operations.md, Security).

They tell the generator two rules of valid requests that JSON Schema cannot state, so that a request it
generates as valid is valid: a port range in an egress entry goes from low to high (``1.2.3.4:80-90``, not
``:90-80``), and an ENV step's arguments are name/value pairs (an even count). Each hook rewrites only what
breaks its rule; schemathesis validates a case again after a hook, so a rewritten case is judged as what it
is. Every other rule is in the document itself.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import schemathesis

_RANGE = re.compile(r":([0-9]+)-([0-9]+)$")


def _ordered(entry: Any) -> Any:
    if isinstance(entry, str):
        m = _RANGE.search(entry)
        if m and int(m.group(1)) > int(m.group(2)):
            return f"{entry[:m.start()]}:{m.group(2)}-{m.group(1)}"
    return entry


def _egress(policy: Any) -> None:
    if isinstance(policy, dict):
        for key in ("allowOut", "denyOut"):
            if isinstance(policy.get(key), list):
                policy[key] = [_ordered(e) for e in policy[key]]


def _env_pairs(steps: Any) -> None:
    for step in steps if isinstance(steps, list) else ():
        if isinstance(step, dict) and step.get("type") == "ENV" and isinstance(step.get("args"), list) \
                and len(step["args"]) % 2:
            step["args"] = [*step["args"], ""]


@schemathesis.hook
def map_case(context: Any, case: Any) -> Any:
    """Every phase's cases (the coverage phase applies case hooks only)."""
    body = case.body
    if isinstance(body, dict):
        body = copy.deepcopy(body)
        _egress(body)  # PUT /sandboxes/{id}/network
        _egress(body.get("network"))  # POST /v2/sandboxes, /sandboxes
        _env_pairs(body.get("steps"))  # POST /v2/templates/{id}/builds/{buildID}
        if body != case.body:
            case.body = body  # schemathesis validates the case again
    return case
