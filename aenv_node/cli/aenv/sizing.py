"""``aenv start TEMPLATE --cpu N --mem MB``: a sandbox of another size than its template's.

A sandbox starts by restoring its template's snapshot, and a snapshot fixes the VM's vCPUs and memory: a
sandbox of another size needs a template of that size. So ``--cpu``/``--mem`` name a derived template,
``NAME-<cpu>cpu-<mem>mb``, tagged with the build of TEMPLATE it derives from. The first start of a size builds
it FROM TEMPLATE with the e2b SDK's ``Template`` builder (one cold boot; its progress goes to stderr); later
starts find it and restore at once. When TEMPLATE is rebuilt its build id changes, so the next start of that
size builds the derived template again instead of serving a stale one.
"""

from __future__ import annotations

from typing import Any, Optional

import click

from .conn import Conn, NodeRefused
from .output import err

__all__ = ["sized_template"]


def _build_of(conn: Conn, info: dict[str, Any], tag: str) -> str:
    """The build a template's NAME (its current build) or NAME:TAG names."""
    if not tag:
        return str(info.get("buildID") or "")
    for t in conn.api.json("GET", f"/templates/{info['templateID']}/tags"):
        if t.get("tag") == tag:
            return str(t["buildID"])
    raise click.ClickException(f"template {info['templateID']} has no tag {tag!r}")


def _has_tag(conn: Conn, name: str, tag: str) -> bool:
    try:
        tags = conn.api.json("GET", f"/templates/{name}/tags")
    except NodeRefused as exc:
        if exc.status == 404:
            return False
        raise
    return any(t.get("tag") == tag for t in tags)


def sized_template(conn: Conn, template: str, cpu: Optional[int], mem: Optional[int]) -> str:
    """The template to create a sandbox of TEMPLATE with ``cpu`` vCPUs and ``mem`` MiB from: TEMPLATE itself
    when it has that size, else its derived template of that size, built first if need be."""
    name, _, tag = template.partition(":")
    info = conn.api.json("GET", f"/templates/{name}")
    if info.get("kind") == "snapshot":
        raise click.UsageError("--cpu/--mem: a sandbox of a snapshot has the snapshot's size")
    has = (int(info["cpuCount"]), int(info["memoryMB"]))
    want = (cpu or has[0], mem or has[1])
    if want == has:
        return template
    derived = f"{(info.get('aliases') or [name])[0]}-{want[0]}cpu-{want[1]}mb"[:128]
    derived_tag = "b" + _build_of(conn, info, tag).replace("-", "")[:12]
    target = f"{derived}:{derived_tag}"
    if _has_tag(conn, derived, derived_tag):
        return target
    err(f"{template} has {has[0]} vCPUs and {has[1]} MiB: building {target} ({want[0]} vCPUs, {want[1]} MiB) "
        "from it, once")
    from e2b import Template

    from .build_progress import follow_build

    built = Template.build_in_background(Template().from_template(template), target, cpu_count=want[0],
                                         memory_mb=want[1], **conn.sdk_opts())
    follow_build(conn, built.template_id, built.build_id)
    return target
