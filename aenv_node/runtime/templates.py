"""Templates as the sandbox service sees them: the default template kept built, and names resolved.

At start the service makes sure the default template (``sandbox.default_template``) is built for the
current guest kit (``templates/base.py``; the first start builds it, under TCG in tens of seconds). A
create that names a template being built waits for that build; a template whose build failed answers
``TemplateNotReady`` with the build's error.
"""

from __future__ import annotations

import logging
from typing import Optional

import trio
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..guest import __envd_version__
from ..state import BuildStatus, Snapshot, SnapshotStatus, Template
from ..templates import BaseTemplateInputs, ensure_base_template
from .errors import TemplateNotFound, TemplateNotReady
from .parts import NodeParts

__all__ = ["TemplateService", "envd_version"]

log = logging.getLogger(__name__)

#: how long a create waits for a build of its template in progress
_BUILD_WAIT_S = 600


def envd_version() -> str:
    """The version of the envd the guest kit ships."""
    return __envd_version__


class TemplateService:
    name = "templates"

    def __init__(self, parts: NodeParts, *, build_default: bool = True) -> None:
        self.parts = parts
        self.build_default = build_default
        self._builds: dict[str, trio.Event] = {}
        self._errors: dict[str, str] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if self.build_default:
            tid = self.parts.cfg.sandbox.default_template
            try:
                await self.ensure_base(tid)
            except Exception as exc:
                log.error("building the default template %r failed: %s", tid, exc)

    def _inputs(self) -> BaseTemplateInputs:
        p = self.parts
        cfg = p.cfg
        return BaseTemplateInputs(
            driver=p.driver, accel=p.accel, frontend=p.frontend, free_page_reporting=p.free_page_reporting,
            images_cache_dir=cfg.images_cache_dir, layers_dir=cfg.layers_dir, snapshots_dir=cfg.templates_dir,
            work_root=cfg.state_dir / "builds", run_root=cfg.run_dir, vcpus=cfg.sandbox.default_cpu_count,
            mem_mib=cfg.sandbox.default_memory_mb, disk_size_mb=cfg.sandbox.default_disk_size_mb,
            envd_version=envd_version(), boot_timeout_s=cfg.templates.boot_timeout_s)

    async def ensure_base(self, template_id: str = "base") -> str:
        """Build the template from the base rootfs and current kit, unless one is ready for this kit."""
        ev = self._builds.setdefault(template_id, trio.Event())
        try:
            result = await ensure_base_template(self.parts.db, self.parts.running_pool(), template_id,
                                                self._inputs())
            if result is not None:
                self.parts.gc.request("template_build")  # a rebuild supersedes the previous boot snapshot
            self._errors.pop(template_id, None)
            return template_id
        except Exception as exc:
            self._errors[template_id] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            ev.set()

    async def resolve(self, name: str) -> tuple[Template, Snapshot]:
        """The ready template ``name`` (an id or an alias) and its boot snapshot."""
        ev = self._builds.get(name)
        if ev is not None and not ev.is_set():
            with trio.move_on_after(_BUILD_WAIT_S):
                await ev.wait()

        def work(s: Session) -> Optional[tuple[Template, Optional[Snapshot]]]:
            t = s.get(Template, name) or s.scalars(select(Template).where(Template.alias == name)).first()
            if t is None:
                return None
            return t, s.get(Snapshot, t.boot_snapshot_id) if t.boot_snapshot_id else None

        found = await self.parts.db.run(work)
        if found is None:
            raise TemplateNotFound(f"template {name!r} not found")
        t, sn = found
        if sn is None or t.status != BuildStatus.READY or sn.status != SnapshotStatus.COMMITTED:
            err = self._errors.get(name)
            raise TemplateNotReady(f"template {name!r} is not ready ({err or t.status}); retry shortly")
        return t, sn
