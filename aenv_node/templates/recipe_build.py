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

from sqlalchemy.orm import Session

from ..images.oci import pull
from ..snapshot.layers import stack_of
from ..state import LayerKind
from ..storage import LayerInfo
from .build import BuildResult, GuestDefaults
from .convert import ImageConverter
from .errors import TemplateBuildError
from .machine import BuildMachine
from .cache_expiry import touch
from .names import lookup
from .recipe import BuildLog, Recipe, Step
from .guest_exec import run_in_guest
from .steps import StepState, run_recipe, step_key

__all__ = ["RecipeInputs", "build_recipe", "E2B_BASE_IMAGES", "parent_template"]

log = logging.getLogger(__name__)

#: Image names that mean "the node's base template" (see the module docstring).
E2B_BASE_IMAGES = ("e2bdev/base", "e2bdev/base:latest", "docker.io/e2bdev/base", "docker.io/e2bdev/base:latest")


def parent_template(recipe: Recipe, base_template: str) -> str | None:
    """The template ``recipe`` builds FROM (``e2bdev/base`` is the node's base), or None (FROM an image)."""
    if recipe.from_image in E2B_BASE_IMAGES:
        return base_template
    return recipe.from_template or None


@dataclass(frozen=True)
class RecipeInputs:
    """The node's settings a recipe build uses beside its build machine."""

    files_dir: Path  # COPY archives uploaded by clients, by files hash
    ready_timeout_s: float
    registries: tuple[str, ...]
    insecure_registries: tuple[str, ...]
    pull_concurrency: int
    ca_bundle: Path | None  # CAs trusted for registries beside the system's
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
    found = lookup(s, name)
    sn = found.snapshot if found is not None else None
    if sn is None or sn.config is None:
        return None
    rows = stack_of(s, sn.id, LayerKind.DISK)
    if any(r.local_path is None for r in rows):
        return None
    cfg = sn.config
    return _Start(tuple(Path(str(r.local_path)) for r in rows), f"template {name}", None,
                  GuestDefaults(dict(cfg.env_vars), cfg.default_user, cfg.default_workdir),
                  cfg.default_user or "user", _key(f"template-snapshot:{sn.id}"))


async def build_recipe(machine: BuildMachine, converter: ImageConverter, inputs: RecipeInputs, *,
                       template_id: str, alias: str | None, build_id: str, recipe: Recipe, vcpus: int,
                       mem_mib: int, disk_size_mb: int, build_log: BuildLog,
                       description: str | None = None) -> BuildResult:
    """Build ``template_id`` from ``recipe`` (see the module docstring), logging to ``build_log``."""
    started = time.monotonic()  # the whole build, pull and conversion included (as template_builds.duration_ms)
    say = build_log.info
    from_template = parent_template(recipe, inputs.base_template)
    if recipe.from_image in E2B_BASE_IMAGES:
        say(f"{recipe.from_image} is this node's {inputs.base_template!r} template")
    if from_template:
        start = await machine.db.run(_template_start, from_template)
        if start is None:
            raise TemplateBuildError(f"template {from_template!r} does not exist or is not ready on this node")
        say(f"FROM template {from_template} ({len(start.layers)} layers)")
    elif recipe.from_image:
        say(f"pulling {recipe.from_image}")
        image = await pull(recipe.from_image, store_dir=machine.images_cache_dir / "oci",
                           registries=inputs.registries, insecure_registries=inputs.insecure_registries,
                           concurrency=inputs.pull_concurrency, credentials=recipe.credentials,
                           ca_bundle=inputs.ca_bundle,
                           progress=lambda line: build_log.add(line))
        say(f"pulled {image.canonical} ({len(image.layers)} layers)")
        touch(layer.path for layer in image.layers)  # blobs found in the store were used again
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

    source = machine.source(await machine.kit(), layers=(*start.layers, *cached_layers),
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
                                 ready_timeout_s=max(inputs.ready_timeout_s, recipe.ready_timeout_s or 0),
                                 first=first, after_step=after_step)
        build_log.add("snapshotting the build VM", step="finalize")
        return GuestDefaults(state.env, state.user if state.user_set else start.defaults.default_user,
                             state.workdir)

    result = await machine.build(source, template_id=template_id, alias=alias, vcpus=vcpus, mem_mib=mem_mib,
                                 disk_size_mb=disk_size_mb, build_id=build_id, prepare=prepare)
    say(f"template {alias or template_id} ready in {time.monotonic() - started:.1f}s (boot {result.boot_s:.1f}s, "
        f"snapshot {result.capture_s * 1000:.0f} ms)")
    return result
