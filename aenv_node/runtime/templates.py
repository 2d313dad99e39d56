"""Templates as the sandbox service sees them: the default template kept built, and names resolved.

At start the service makes sure the default template (``sandbox.default_template``) is built for the
current guest kit (``templates/base.py``; the first start builds it, under TCG in tens of seconds). A
create that names a template being built waits for that build; a template whose build failed answers
``TemplateNotReady`` with the build's error.
"""

from __future__ import annotations

import datetime as dt
import logging
import shutil
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import trio
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from ..guest import __envd_version__
from ..images import ImageError
from ..state import (
    BuildStatus,
    EventSubject,
    Sandbox,
    SandboxState,
    Snapshot,
    SnapshotKind,
    SnapshotStatus,
    Template,
    TemplateBuild,
    TemplateKind,
    new_id,
    utcnow,
)
from ..snapshot.share import forget_template, import_template, publish_template, unshared_templates
from ..snapshot.source import SnapshotSource, load_source
from ..state.repository import record_event
from ..templates import (
    CODE_INTERPRETER,
    DEFAULT_TAG,
    NAME_PART,
    RESERVED_NAMES,
    BuildMachine,
    BuildLog,
    BuildResult,
    ImageConverter,
    LogEntry,
    NamedBuild,
    Recipe,
    RecipeInputs,
    TemplateBuildError,
    build_recipe,
    code_interpreter_recipe,
    assign_tags,
    ensure_base_template,
    expire_converted_layers,
    expired_files,
    find_template,
    import_vm,
    lookup,
    parent_template,
    remove_tags,
    prepare_code_interpreter_files,
    split_name,
    tags_of,
    touch,
)
from ..vmm import FirecrackerDriver, kill_recorded
from .build_records import fail_build, fail_interrupted_builds, last_build_error, mark_building
from .builds_in_progress import BuildsInProgress
from .errors import (
    NodeNotReady,
    TemplateBuildFailed,
    TemplateBusy,
    TemplateNotFound,
    TemplateNotReady,
    TemplateProtected,
    TemplateRequestError,
)
from .parts import NodeParts

__all__ = ["BuildRequest", "BuildStatusView", "TagView", "TemplateService", "envd_version"]

log = logging.getLogger(__name__)

#: how long a create waits for a build of its template in progress
_BUILD_WAIT_S = 600


@dataclass(frozen=True)
class BuildStatusView:
    template_id: str
    build_id: str
    status: BuildStatus
    entries: list[LogEntry]
    error: str | None
    error_step: str | None


@dataclass(frozen=True)
class TagView:
    tag: str
    build_id: str
    created_at: dt.datetime


def envd_version() -> str:
    """The version of the envd the guest kit ships."""
    return __envd_version__


@dataclass(frozen=True)
class BuildRequest:
    """A build registered by ``POST /v3/templates`` (its template row exists; the recipe comes later)."""

    template_id: str
    build_id: str
    alias: str
    tags: list[str]
    vcpus: int
    mem_mib: int
    disk_size_mb: int


class TemplateService:
    name = "templates"

    def __init__(self, parts: NodeParts, *, build_default: bool = True) -> None:
        self.parts = parts
        self.build_default = build_default
        self._in_progress = BuildsInProgress()
        self._started: set[str] = set()  # build ids started since this node started
        self._errors: dict[str, str] = {}
        self._logs: dict[str, BuildLog] = {}
        self._nursery: trio.Nursery | None = None
        cfg = parts.cfg
        self._limiter = trio.CapacityLimiter(max(1, cfg.templates.max_concurrent_builds))
        self.converter = ImageConverter(parts.db, layers_dir=cfg.layers_dir, work_root=cfg.state_dir / "builds",
                                        run_root=cfg.run_dir)

    @property
    def files_dir(self) -> Path:
        """COPY archives clients upload, by files hash (``GET /templates/{id}/files/{hash}``)."""
        return self.parts.cfg.state_dir / "template-files"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        cut = await self.parts.db.run(fail_interrupted_builds)
        if cut:
            run_dir = self.parts.cfg.run_dir
            # a build VMM outlives a node killed hard, as sandboxes' VMMs do: killed by the pid it recorded
            killed = [pid for b in cut if (pid := kill_recorded(run_dir / b / "vmm.pid", b)) is not None]
            log.warning("%d template builds were cut by the last stop (%s); their VMMs killed: %s", len(cut),
                        ", ".join(cut), killed or "none left")
            for b in cut:  # its sockets and its disk's upper; its logs stay for the post-mortem
                shutil.rmtree(self.parts.cfg.run_dir / b, ignore_errors=True)
                shutil.rmtree(self.parts.cfg.state_dir / "builds" / b / "upper", ignore_errors=True)
            if killed and isinstance(self.parts.driver, FirecrackerDriver):  # a jailed build VMM's chroot
                await self.parts.driver.sweep_jails(wait_for=killed)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            tid = self.parts.cfg.sandbox.default_template
            # creates naming the node's own templates wait for their builds from the first request on
            own = self._in_progress.enter([tid, *self._builtin_names()] if self.build_default else [])
            nursery.start_soon(self._expire_caches_forever)
            task_status.started()
            # templates a stop or a repository fault left unpublished go up now (snapshot/share.py)
            for unshared in await self.parts.db.run(unshared_templates, self._not_shared()):
                self.share(unshared)
            try:
                if self.build_default:
                    await self._build_own(tid)
            finally:
                self._in_progress.leave(own)
            await trio.sleep_forever()

    def _not_shared(self) -> tuple[str, ...]:
        """The node's own templates: every node builds its own from its own kit, so none is published."""
        return (self.parts.cfg.sandbox.default_template, *self._builtin_names())

    def share(self, template_id: str) -> None:
        """Publish a template built (or a user snapshot taken) here for the cluster's other nodes, in the
        background: the caller does not wait for the upload (snapshot/share.py)."""
        if self._nursery is not None:
            self._nursery.start_soon(self._share_quietly, template_id)

    async def _share_quietly(self, template_id: str) -> None:
        try:
            await publish_template(self.parts.db, self.parts.repository, self.parts.cfg.layers_dir, template_id,
                                   publisher=self.parts.owner, exclude=self._not_shared())
        except Exception as exc:  # the repository may be down: the next start publishes it
            log.warning("publishing template %s to the repository failed: %s", template_id, exc)

    async def _import(self, name: str) -> bool:
        """A template another node published, imported here (False: none is)."""
        try:
            return await import_template(self.parts.db, self.parts.repository, self.parts.store.snapshots_dir, name)
        except Exception as exc:
            log.warning("looking for template %r in the repository failed: %s", name, exc)
            return False

    async def _expire_caches_forever(self) -> None:
        while True:
            try:
                await self.expire_caches()
            except Exception:
                log.exception("expiring the template caches failed; retrying later")
            await trio.sleep(self.parts.cfg.snapshot.gc_interval_s)

    async def expire_caches(self) -> tuple[int, int]:
        """Let go of converted layers, uploads and blobs no build used for ``templates.cache_ttl_s``
        (``templates/cache_expiry.py``). Returns (layer chains dropped, files removed)."""
        ttl = self.parts.cfg.templates.cache_ttl_s
        gone = await self.parts.db.run(expire_converted_layers, utcnow() - dt.timedelta(seconds=ttl),
                                       self.converter.in_use())
        if gone:
            self.parts.gc.request("layer_cache_expiry")  # their layer files go with the next collection
        files: list[Path] = []
        if not self._in_progress.any():
            files = await trio.to_thread.run_sync(expired_files, self._cached_file_dirs(), ttl)
            for p in files:
                if self._in_progress.any():
                    break
                p.unlink(missing_ok=True)
        if gone or files:
            log.info("template caches: %d converted layer chains and %d files unused for %.0f s let go",
                     len(gone), len(files), ttl)
        return len(gone), len(files)

    def _cached_file_dirs(self) -> list[Path]:
        return [self.files_dir, self.parts.cfg.images_cache_dir / "oci" / "blobs"]

    async def _build_own(self, tid: str) -> None:
        try:
            await self.ensure_base(tid)
        except Exception as exc:
            log.error("building the default template %r failed: %s", tid, exc)
            return
        if self.parts.cfg.templates.code_interpreter:
            try:
                await self.ensure_code_interpreter()
            except Exception as exc:
                log.error("building %r failed: %s", CODE_INTERPRETER, exc)

    # -- builds from recipes (the E2B template build API) -------------------------------------------------------
    async def register_build(self, name: str, *, tags: list[str], cpu_count: int | None, memory_mb: int | None,
                             min_free_disk_mb: int | None) -> BuildRequest:
        """A new build of the template named ``name`` (``alias`` or ``alias:tag``), waiting for its recipe; when
        it succeeds it takes the name's tag (``default`` for a bare name) and ``tags``."""
        alias, sep, tag = name.partition(":")
        if not NAME_PART.fullmatch(alias) or (sep and not NAME_PART.fullmatch(tag)):
            raise TemplateRequestError(f"template name {name!r}: use lowercase letters, digits, '-', '_' and '.' "
                                       "(optionally ':tag')")
        self._check_nameable(alias)
        all_tags = list(dict.fromkeys([tag or DEFAULT_TAG, *tags]))
        _check_tags(all_tags)
        return await self._register(alias, all_tags, name, cpu_count=cpu_count, memory_mb=memory_mb,
                                    min_free_disk_mb=min_free_disk_mb)

    async def import_vm(self, alias: str, kernel: bytes, *, vcpus: int, mem_mib: int, ready_console: str,
                        timeout_s: float) -> BuildResult:
        """A VM without envd, from its kernel alone, as the template ``alias`` (``templates/import_vm.py``);
        importing an alias again gives it a new boot snapshot (sandboxes made from the old one keep it)."""
        if not NAME_PART.fullmatch(alias):
            raise TemplateRequestError(f"template name {alias!r}: use lowercase letters, digits, '-', '_' and '.'")
        self._check_nameable(alias)
        found = await self.parts.db.run(lambda s: s.scalars(select(Template.id).where(Template.alias == alias)).first())
        template_id = found or new_id("tpl_")
        keys = self._in_progress.enter([template_id, alias])
        try:
            result = await import_vm(replace(self._machine(), boot_timeout_s=timeout_s), kernel,
                                     template_id=template_id, alias=alias, vcpus=vcpus, mem_mib=mem_mib,
                                     ready_console=ready_console)
        finally:
            self._in_progress.leave(keys)
        self.parts.gc.request("template_build")  # an import again supersedes the previous boot snapshot
        return result

    def _check_nameable(self, alias: str) -> None:
        """A new build or import may take ``alias``: not one of the node's own templates, not a word of the paths."""
        self._check_own(alias)
        if alias in RESERVED_NAMES:
            raise TemplateProtected(f"{alias!r} cannot name a template: it is a word of the API's paths")

    def _check_own(self, alias: str) -> None:
        if alias in (self.parts.cfg.sandbox.default_template, *self._builtin_names()):
            raise TemplateProtected(f"template {alias!r} is one of this node's own templates")

    def _builtin_names(self) -> tuple[str, ...]:
        return (CODE_INTERPRETER,) if self.parts.cfg.templates.code_interpreter else ()

    async def _register(self, alias: str, tags: list[str], name: str, *, cpu_count: int | None,
                        memory_mb: int | None, min_free_disk_mb: int | None) -> BuildRequest:
        sb = self.parts.cfg.sandbox
        vcpus, mem = cpu_count or sb.default_cpu_count, memory_mb or sb.default_memory_mb
        disk = sb.default_disk_size_mb + (min_free_disk_mb or 0)
        build_id = str(uuid.uuid4())

        def work(s: Session) -> str:
            t = s.scalars(select(Template).where(Template.alias == alias)).first()
            if t is None:
                t = Template(id=new_id("tpl_"), alias=alias, status=BuildStatus.WAITING, cpu_count=vcpus,
                             memory_mb=mem, disk_size_mb=disk, envd_version=envd_version())
                s.add(t)
                s.flush()
            s.add(TemplateBuild(id=build_id, template_id=t.id, status=BuildStatus.WAITING, source=name, tags=tags,
                                log_path=str(self._build_dir(build_id) / "build.log.jsonl")))
            record_event(s, "template_build", subject=EventSubject.TEMPLATE, subject_id=t.id,
                         to_state=BuildStatus.WAITING, detail={"build_id": build_id, "name": name, "tags": tags})
            return t.id

        tid = await self.parts.db.run(work)
        self._logs[build_id] = BuildLog(self._build_dir(build_id) / "build.log.jsonl")
        return BuildRequest(tid, build_id, alias, tags, vcpus, mem, disk)

    def _build_dir(self, build_id: str) -> Path:
        return self.parts.cfg.state_dir / "builds" / build_id

    async def start_build(self, template_id: str, build_id: str, recipe: Recipe) -> None:
        """Run the registered build ``build_id`` of ``template_id`` from ``recipe``, in the background."""

        def find(s: Session) -> tuple[Template, TemplateBuild] | None:
            b = s.get(TemplateBuild, build_id)
            t = s.get(Template, template_id)
            if b is None or t is None or b.template_id != t.id:
                return None
            return t, b

        found = await self.parts.db.run(find)
        if found is None:
            raise TemplateNotFound(f"build {build_id} of template {template_id} not found")
        t, b = found
        if b.status != BuildStatus.WAITING or build_id in self._started:
            raise TemplateBusy(f"build {build_id} was already started (status {b.status})")
        if self._nursery is None:
            raise NodeNotReady("the template service is not running")
        self._started.add(build_id)
        touch(self.files_dir / f"{st.files_hash}.tar" for st in recipe.steps if st.files_hash)
        self._nursery.start_soon(self._run_build, t, build_id, recipe, self._in_progress.enter([t.id, t.alias]))

    async def ensure_code_interpreter(self) -> None:
        """Build ``code-interpreter-v1`` from its definition in the repository unless its last ready build was
        made from this definition over the current ``base`` (``templates/builtin.py``)."""
        cfg = self.parts.cfg
        own = self._in_progress.enter([CODE_INTERPRETER])
        try:
            files_hash = await trio.to_thread.run_sync(prepare_code_interpreter_files,
                                                       cfg.images_cache_dir / "wheels", self.files_dir)
            base = cfg.sandbox.default_template

            def current(s: Session) -> tuple[str, bool]:
                b = s.get(Template, base)
                marker = f"builtin {CODE_INTERPRETER} files={files_hash[:16]} base={b.boot_snapshot_id if b else None}"
                t = s.scalars(select(Template).where(Template.alias == CODE_INTERPRETER)).first()
                if t is None or t.status != BuildStatus.READY:
                    return marker, False
                last = s.scalars(select(TemplateBuild).where(TemplateBuild.template_id == t.id,
                                                             TemplateBuild.status == BuildStatus.READY)
                                 .order_by(TemplateBuild.started_at.desc())).first()
                return marker, last is not None and last.source == marker

            marker, ok = await self.parts.db.run(current)
            if ok:
                return
            req = await self._register(CODE_INTERPRETER, [DEFAULT_TAG], CODE_INTERPRETER, cpu_count=None,
                                       memory_mb=None, min_free_disk_mb=None)
            t = await self.parts.db.run(lambda s: s.get(Template, req.template_id))
            assert t is not None
            await self._run_build(t, req.build_id, code_interpreter_recipe(files_hash, base),
                                  self._in_progress.enter([t.id, t.alias]), description=marker)
        finally:
            self._in_progress.leave(own)

    async def _run_build(self, t: Template, build_id: str, recipe: Recipe, keys: tuple[str, ...], *,
                         description: str | None = None) -> None:
        """One build, from its recipe; ``keys``: what ``BuildsInProgress.enter`` gave for it (left at the end)."""
        blog = self._logs.setdefault(build_id, BuildLog(self._build_dir(build_id) / "build.log.jsonl"))
        try:
            parent = parent_template(recipe, self.parts.cfg.sandbox.default_template)
            if parent is not None and self._in_progress.busy(split_name(parent)[0]):
                blog.info(f"waiting for the build of {parent} in progress")
                await self._wait_build_of(parent)  # before taking a slot: its parent may need one
            if self._limiter.borrowed_tokens >= self._limiter.total_tokens:
                blog.info("waiting for a build slot (templates.max_concurrent_builds)")
            async with self._limiter, self.converter.session():
                await self.parts.db.run(mark_building, build_id)
                blog.info(f"building {t.alias or t.id} from {recipe.source}")
                await build_recipe(self._machine(), self.converter, self._recipe_inputs(),
                                   template_id=t.id, alias=t.alias, build_id=build_id, recipe=recipe,
                                   vcpus=t.cpu_count, mem_mib=t.memory_mb, disk_size_mb=t.disk_size_mb,
                                   build_log=blog, description=description)
            self.parts.gc.request("template_build")
            self.share(t.id)
        except trio.Cancelled:
            with trio.CancelScope(shield=True):
                await self.parts.db.run(fail_build, build_id, "interrupted: the node shut down during the build")
            raise
        except Exception as exc:
            message = str(exc) if isinstance(exc, (TemplateBuildError, ImageError)) else f"{type(exc).__name__}: {exc}"
            blog.add(f"build failed: {message}", level="error")
            log.warning("template %s build %s failed at %s: %s", t.alias or t.id, build_id, blog.stage, message)
            await self.parts.db.run(fail_build, build_id, message, blog.stage)
        finally:
            self._in_progress.leave(keys)

    async def delete(self, name: str) -> bool:
        """Delete the built template ``name`` (an id or alias); False if there is none. Its alias is free at once
        and no new sandbox starts from it; sandboxes already made from it run, pause and resume as before (the
        garbage collector keeps a snapshot while a sandbox not killed stands on it) and its files go after the
        last one. The node's own templates cannot be deleted, nor one with a build in progress."""

        def work(s: Session) -> Optional[bool]:
            t = find_template(s, name)
            if t is None or t.kind != TemplateKind.TEMPLATE:
                return None
            if t.alias in (self.parts.cfg.sandbox.default_template, *self._builtin_names()) or t.id == \
                    self.parts.cfg.sandbox.default_template:
                return False
            busy = s.scalars(select(TemplateBuild.id).where(
                TemplateBuild.template_id == t.id, TemplateBuild.status == BuildStatus.BUILDING)).first()
            if busy is not None or self._in_progress.busy(t.id):
                raise TemplateBusy(f"template {name!r} has a build in progress; delete it after")
            users = s.scalar(select(func.count()).select_from(Sandbox).where(
                Sandbox.template_id == t.id, Sandbox.state != SandboxState.KILLED)) or 0
            snapshots = s.scalars(select(Snapshot).where(
                Snapshot.template_id == t.id, Snapshot.kind == SnapshotKind.BOOT,
                Snapshot.status == SnapshotStatus.COMMITTED)).all()
            for sn in snapshots:  # every build's, tagged or not: the collector keeps those sandboxes stand on
                sn.status = SnapshotStatus.DELETED
            record_event(s, "template_delete", subject=EventSubject.TEMPLATE, subject_id=t.id,
                         from_state=t.status, to_state="deleted",
                         detail={"alias": t.alias, "snapshot_id": t.boot_snapshot_id,
                                 "snapshots": [sn.id for sn in snapshots], "sandboxes_not_killed": users})
            gone.append((t.id, t.alias))
            s.delete(t)
            return True

        gone: list[tuple[str, Optional[str]]] = []
        done = await self.parts.db.run(work)
        if done is None:
            return False
        if done is False:
            raise TemplateProtected(f"template {name!r} is one of this node's own templates")
        self.parts.gc.request("template_delete")
        for template_id, alias in gone:  # no node of the cluster imports it any more
            try:
                await forget_template(self.parts.repository, template_id, alias)
            except Exception as exc:
                log.warning("removing the repository record of template %s failed: %s", template_id, exc)
        return True

    async def _wait_build_of(self, name: str) -> None:
        """Wait (at most ``_BUILD_WAIT_S``) for the build in progress of the template ``name`` (``alias:tag``
        too) when nothing it names is ready yet; a template with a ready build serves that one meanwhile."""
        async def ready() -> bool:
            found = await self.parts.db.run(lookup, name)
            return found is not None and found.snapshot is not None

        await self._in_progress.wait(split_name(name)[0], ready, _BUILD_WAIT_S)

    # -- tags -------------------------------------------------------------------------------------------------
    async def assign_tags(self, target: str, tags: list[str]) -> tuple[str, list[str]]:
        """Point ``tags`` at the build ``target`` names (``name:tag``; a bare name: its default build). Returns
        the build id and the tags."""
        _check_tags(tags)

        def work(s: Session) -> str:
            found = lookup(s, target)
            if found is None or found.build_id is None or found.snapshot is None:
                raise TemplateNotFound(f"template {target!r} not found or has no ready build")
            self._check_own(found.template.alias or found.template.id)
            assign_tags(s, found.template.id, found.build_id, tags)
            return found.build_id

        build_id = await self.parts.db.run(work)
        self.parts.gc.request("template_tags")  # a tag that moved may leave a build's snapshot unreachable
        return build_id, list(dict.fromkeys(tags))

    async def remove_tags(self, name: str, tags: list[str]) -> None:
        """Remove ``tags`` from the template ``name``; a build no tag names any more keeps its snapshot only
        while it is the template's latest or a sandbox stands on it."""

        def work(s: Session) -> None:
            t = find_template(s, split_name(name)[0])
            if t is None:
                raise TemplateNotFound(f"template {name!r} not found")
            self._check_own(t.alias or t.id)
            missing = remove_tags(s, t.id, tags)
            if missing:
                raise TemplateNotFound(f"template {name!r} has no tag {', '.join(missing)}")

        await self.parts.db.run(work)
        self.parts.gc.request("template_tags")

    async def tags(self, name: str) -> list[TagView]:
        """The tags of the template ``name`` and the builds they name, oldest first."""

        def work(s: Session) -> list[TagView] | None:
            t = find_template(s, split_name(name)[0])
            if t is None:
                return None
            return [TagView(r.tag, r.build_id, r.created_at) for r in tags_of(s, t.id)]

        out = await self.parts.db.run(work)
        if out is None:
            raise TemplateNotFound(f"template {name!r} not found")
        return out

    def _machine(self) -> BuildMachine:
        """The build machine every build of this node boots (its own ``base`` and recipes alike)."""
        p = self.parts
        cfg = p.cfg
        return BuildMachine(
            db=p.db, pool=p.running_pool(), driver=p.driver, accel=p.accel, frontend=p.frontend,
            free_page_reporting=p.free_page_reporting, images_cache_dir=cfg.images_cache_dir,
            layers_dir=cfg.layers_dir, snapshots_dir=cfg.templates_dir, work_root=cfg.state_dir / "builds",
            run_root=cfg.run_dir, envd_version=envd_version(), boot_timeout_s=cfg.templates.boot_timeout_s)

    def _recipe_inputs(self) -> RecipeInputs:
        cfg = self.parts.cfg
        return RecipeInputs(
            files_dir=self.files_dir, ready_timeout_s=cfg.templates.ready_timeout_s, registries=cfg.images.registries,
            insecure_registries=cfg.images.insecure_registries, pull_concurrency=cfg.images.pull_concurrency,
            ca_bundle=Path(cfg.images.ca_bundle) if cfg.images.ca_bundle else None,
            base_template=cfg.sandbox.default_template)

    async def build_status(self, template_id: str, build_id: str, offset: int) -> BuildStatusView:
        """A build's status and its log from ``offset`` (at most 100 entries), as the status route shows it."""

        def work(s: Session) -> TemplateBuild | None:
            b = s.get(TemplateBuild, build_id)
            return b if b is not None and b.template_id == template_id else None

        b = await self.parts.db.run(work)
        if b is None:
            raise TemplateNotFound(f"build {build_id} of template {template_id} not found")
        blog = self._logs.get(build_id)
        if blog is None:
            blog = BuildLog.load(self._build_dir(build_id) / "build.log.jsonl")
        return BuildStatusView(b.template_id, b.id, b.status, blog.entries(offset), b.error, b.error_step)

    async def ensure_base(self, template_id: str = "base") -> str:
        """Build the template from the base rootfs and current kit, unless one is ready for this kit."""
        keys = self._in_progress.enter([template_id])
        try:
            sb = self.parts.cfg.sandbox
            result = await ensure_base_template(self._machine(), template_id, vcpus=sb.default_cpu_count,
                                                mem_mib=sb.default_memory_mb, disk_size_mb=sb.default_disk_size_mb)
            if result is not None:
                self.parts.gc.request("template_build")  # a rebuild supersedes the previous boot snapshot
            self._errors.pop(template_id, None)
            return template_id
        except Exception as exc:
            self._errors[template_id] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            self._in_progress.leave(keys)

    async def resolve(self, name: str) -> tuple[Template, Snapshot]:
        """The template ``name`` (an id or an alias, with ``:tag`` or not) and the boot snapshot it names."""
        t, sn, _ = await self._resolve(name, with_source=False)
        return t, sn

    async def resolve_source(self, name: str) -> tuple[Template, Snapshot, SnapshotSource]:
        """``resolve``, and the snapshot as a source to restore from (its memory image present), read in the
        same transaction: a create's one read of the state before its insert."""
        t, sn, source = await self._resolve(name, with_source=True)
        return t, sn, await self.parts.store.prepared(source, sn.id)

    async def _resolve(self, name: str, *, with_source: bool
                       ) -> tuple[Template, Snapshot, Optional[SnapshotSource]]:
        def read(s: Session) -> tuple[Optional[NamedBuild], Optional[SnapshotSource]]:
            found = lookup(s, name)
            sn = found.snapshot if found is not None else None
            return found, (load_source(s, sn.id) if with_source and sn is not None else None)

        await self._wait_build_of(name)
        found, source = await self.parts.db.run(read)
        if found is None and split_name(name)[1] is None and await self._import(name):
            found, source = await self.parts.db.run(read)  # another node of the cluster built it
        if found is None:
            raise TemplateNotFound(f"template {name!r} not found")
        if found.missing_tag:
            raise TemplateNotFound(f"template {split_name(name)[0]!r} has no tag {found.tag!r}")
        t, sn = found.template, found.snapshot
        if sn is None and t.status == BuildStatus.ERROR and name not in self._errors:
            last = await self.parts.db.run(last_build_error, t.id)
            raise TemplateBuildFailed(f"template {name!r} has no successful build (the last one failed: {last})")
        if sn is None:
            err = self._errors.get(name)
            raise TemplateNotReady(f"template {name!r} is not ready ({err or t.status}); retry shortly")
        return t, sn, source


def _check_tags(tags: list[str]) -> None:
    bad = [t for t in tags if not NAME_PART.fullmatch(t)]
    if bad or not tags:
        raise TemplateRequestError(f"tags {bad or tags!r}: each is lowercase letters, digits, '-', '_' and '.'")
