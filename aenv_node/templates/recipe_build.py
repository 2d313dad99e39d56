"""Building a template from a recipe: FROM an image (pulled and converted on the host) or another template,
then the recipe's steps in a build VM, then the boot snapshot with the start command running.

The pieces: ``images.oci.pull`` (registry to local blobs), ``convert.ImageConverter`` (blobs to block layers,
shared by chain, and the provisioning layer), ``build.build_template`` (the VM, its capture, the rows), and
``steps.run_recipe`` (what runs in the VM before the capture). This module decides what the build starts
from and what each sandbox of the template inherits: the image's ``Env``; its ``User`` as the default user
unless it is root (a sandbox's commands run as ``user`` by default, as E2B's do); its ``WorkingDir``; then
whatever the steps' ENV, USER and WORKDIR say.

``e2bdev/base`` (what the SDK's ``Template()`` starts from unless told otherwise) is the node's own ``base``
template: the node reaches no registry on the internet, and that is what E2B's base image is to a sandbox.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import trio
from sqlalchemy import select
from sqlalchemy.orm import Session

from ..images import ensure_kit, kernel_cmdline
from ..images.kit import host_tsc_khz
from ..images.oci import pull
from ..net import SlotPool
from ..snapshot.layers import stack_of
from ..state import BuildStatus, Database, LayerKind, Snapshot, Template
from ..storage import LayerInfo
from ..storage.frontends import DiskFrontend
from ..vmm import Accel, VmmDriver
from .base import kernel_of
from .build import BuildResult, GuestDefaults, TemplateSource, build_template
from .convert import ImageConverter
from .errors import TemplateBuildError
from .recipe import BuildLog, Recipe, Step
from .guest_exec import run_in_guest
from .steps import StepState, run_recipe, step_key

__all__ = ["RecipeInputs", "build_recipe", "E2B_BASE_IMAGES"]

log = logging.getLogger(__name__)

#: Image names that mean "the node's base template" (see the module docstring).
E2B_BASE_IMAGES = ("e2bdev/base", "e2bdev/base:latest", "docker.io/e2bdev/base", "docker.io/e2bdev/base:latest")


@dataclass(frozen=True)
class RecipeInputs:
    """The node's parts and settings a recipe build uses."""

    driver: VmmDriver
    accel: Accel
    frontend: DiskFrontend
    free_page_reporting: bool
    images_cache_dir: Path
    layers_dir: Path
    snapshots_dir: Path
    work_root: Path
    run_root: Path
    files_dir: Path  # COPY archives uploaded by clients, by files hash
    envd_version: str
    boot_timeout_s: float
    ready_timeout_s: float
    registries: tuple[str, ...]
    insecure_registries: tuple[str, ...]
    pull_concurrency: int
    base_template: str


def _env_pairs(env: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in env:
        k, sep, v = item.partition("=")
        if k:
            out[k] = v if sep else ""
    return out


def _key(text: str) -> str:
    """A chain id (hex sha256) for what the first step builds on."""
    return hashlib.sha256(text.encode()).hexdigest()


def _is_root(user: str) -> bool:
    name = user.split(":", 1)[0]
    return name in ("", "root", "0")


@dataclass(frozen=True)
class _Start:
    layers: tuple[Path, ...]
    description: str
    digest: str | None
    defaults: GuestDefaults
    step_user: str  # who RUN steps run as until a USER step
    key: str  # what the first step's cache key builds on: the source's disk


def _template_start(s: Session, name: str) -> _Start | None:
    t = s.get(Template, name)
    if t is None:
        t = s.scalars(select(Template).where(Template.alias == name)).first()
    if t is None or t.status != BuildStatus.READY or t.boot_snapshot_id is None:
        return None
    sn = s.get(Snapshot, t.boot_snapshot_id)
    if sn is None or sn.config is None:
        return None
    rows = stack_of(s, sn.id, LayerKind.DISK)
    if any(r.local_path is None for r in rows):
        return None
    cfg = sn.config
    return _Start(tuple(Path(str(r.local_path)) for r in rows), f"template {name}", None,
                  GuestDefaults(dict(cfg.env_vars), cfg.default_user, cfg.default_workdir),
                  cfg.default_user or "user", _key(f"template-snapshot:{sn.id}"))


async def build_recipe(db: Database, pool: SlotPool, converter: ImageConverter, inputs: RecipeInputs, *,
                       template_id: str, alias: str | None, build_id: str, recipe: Recipe, vcpus: int,
                       mem_mib: int, disk_size_mb: int, build_log: BuildLog,
                       wait_template: Callable[[str], Awaitable[None]] | None = None,
                       description: str | None = None) -> BuildResult:
    """Build ``template_id`` from ``recipe`` (see the module docstring), logging to ``build_log``."""
    say = build_log.info
    from_template = recipe.from_template
    if recipe.from_image in E2B_BASE_IMAGES:
        from_template = inputs.base_template
        say(f"{recipe.from_image} is this node's {inputs.base_template!r} template")
    if from_template:
        if wait_template is not None:
            await wait_template(from_template)
        start = await db.run(_template_start, from_template)
        if start is None:
            raise TemplateBuildError(f"template {from_template!r} does not exist or is not ready on this node")
        say(f"FROM template {from_template} ({len(start.layers)} layers)")
    elif recipe.from_image:
        say(f"pulling {recipe.from_image}")
        image = await pull(recipe.from_image, store_dir=inputs.images_cache_dir / "oci",
                           registries=inputs.registries, insecure_registries=inputs.insecure_registries,
                           concurrency=inputs.pull_concurrency, credentials=recipe.credentials,
                           progress=lambda line: build_log.add(line))
        say(f"pulled {image.canonical} ({len(image.layers)} layers)")
        converted = await converter.convert(image, progress=say)
        cfg = image.config
        user = cfg.user or "root"
        start = _Start(converted.layers, recipe.from_image, image.digest,
                       GuestDefaults(_env_pairs(cfg.env), None if _is_root(user) else user.split(":", 1)[0],
                                     cfg.working_dir or None),
                       user.split(":", 1)[0] or "root", _key(f"image-chain:{converted.chain[-1]}"))
    else:
        raise TemplateBuildError("a build needs fromImage or fromTemplate")

    # The steps' cache: the longest prefix of steps whose layers exist (unless forced from some step on)
    keys: list[str] = []
    parent = start.key
    for step in recipe.steps:
        parent = step_key(parent, step)
        keys.append(parent)
    forced = next((i for i, st in enumerate(recipe.steps) if st.force), len(recipe.steps))
    if recipe.force:
        forced = 0
    cached_layers: list[Path] = []
    for key in keys[:forced]:
        hit = await converter.cached(key)
        if hit is None:
            break
        cached_layers.append(hit[0])
    first = len(cached_layers) + 1
    if recipe.steps:
        say(f"{len(cached_layers)} of {len(recipe.steps)} steps cached" + (" (forced rebuild)" if recipe.force else ""))

    kit = await trio.to_thread.run_sync(ensure_kit, inputs.images_cache_dir)
    tsc = host_tsc_khz() if inputs.accel is Accel.TCG else None
    source = TemplateSource(kernel=kernel_of(kit, inputs.driver), initrd=kit.initramfs, tools_img=kit.tools_img,
                            cmdline=kernel_cmdline(tsc_khz=tsc), kit_hash=kit.hash,
                            free_page_reporting=inputs.free_page_reporting,
                            layers=(*start.layers, *cached_layers),
                            description=description or start.description, source_digest=start.digest,
                            env_vars=tuple(start.defaults.env_vars.items()),
                            default_user=start.defaults.default_user,
                            default_workdir=start.defaults.default_workdir)

    async def prepare(host: str, seal: Callable[[], Awaitable[LayerInfo]]) -> GuestDefaults:
        say("build VM up: running the steps" if first <= len(recipe.steps) else "build VM up")
        state = StepState(user=start.step_user, workdir=start.defaults.default_workdir,
                          env=dict(start.defaults.env_vars))

        async def after_step(i: int, step: Step) -> None:
            t0 = time.monotonic()
            await run_in_guest(host, "sync", user="root", timeout_s=120)
            info = await seal()
            await converter.record(keys[i - 1], keys[i - 2] if i > 1 else start.key, f"aenv:step:{step.kind}",
                                   info, start.description, (time.monotonic() - t0) * 1000,
                                   {"step": i, "args": list(step.args)[:4]})

        state = await run_recipe(host, recipe, state, build_log, files_dir=inputs.files_dir,
                                 ready_timeout_s=inputs.ready_timeout_s, first=first, after_step=after_step)
        say("snapshotting the build VM")
        return GuestDefaults(state.env, state.user if state.user_set else start.defaults.default_user,
                             state.workdir)

    result = await build_template(
        db=db, driver=inputs.driver, accel=inputs.accel.value, pool=pool, frontend=inputs.frontend, source=source,
        layers_dir=inputs.layers_dir, snapshots_dir=inputs.snapshots_dir, work_root=inputs.work_root,
        run_root=inputs.run_root, template_id=template_id, alias=alias, vcpus=vcpus, mem_mib=mem_mib,
        disk_size_mb=disk_size_mb, envd_version=inputs.envd_version, boot_timeout_s=inputs.boot_timeout_s,
        build_id=build_id, prepare=prepare)
    say(f"template {alias or template_id} ready in {result.duration_s:.1f}s (boot {result.boot_s:.1f}s, "
        f"snapshot {result.capture_s * 1000:.0f} ms)")
    return result
