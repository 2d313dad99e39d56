"""A recipe's steps, run in the build VM through envd, then its start command and ready check.

Semantics (Dockerfile's, as E2B's builder has them):

- RUN runs ``/bin/sh -c`` as the current USER (or the step's own user), in the current WORKDIR, with the
  environment so far (the image's ``Env``, then every ENV step); a non-zero exit fails the build with the
  step, its exit status and the end of its output.
- ENV adds variables for the next steps and for every sandbox of the template.
- WORKDIR creates the directory (owned by the current user) and makes it the current one.
- USER makes the next steps run as that user; the last one is the template's default user.
- COPY puts an archive the client uploaded (``GET /templates/{id}/files/{hash}`` gave the upload address)
  into the VM and unpacks it at the destination: a directory's contents go into the destination, a file goes
  into a destination ending in ``/`` (or already a directory) or becomes it. Owner: the step's user, else
  the current one; mode when given.
- The start command is started and left running; the ready command is then run every second until it exits
  0, for at most ``ready_timeout_s``. The snapshot is taken after that, so sandboxes have the process up.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import trio

from ..snapshot.envd import ENVD_PORT
from .errors import TemplateBuildError
from .guest_exec import ExecResult, follow_in_guest, run_in_guest
from .recipe import BuildLog, Recipe, Step

__all__ = ["AfterStep", "StepFailed", "StepState", "replay", "run_recipe", "step_key"]


def step_key(parent: str, step: Step) -> str:
    """The cache key of ``step`` over the disk ``parent`` names: the step and its inputs (a COPY's archive by
    its hash). ENV and USER change no file but are in the chain: they change what later steps do."""
    text = json.dumps([parent, step.kind, list(step.args), step.files_hash or ""])
    return hashlib.sha256(text.encode()).hexdigest()


class StepFailed(TemplateBuildError):
    """A step of the recipe failed (the message names it)."""

    def __init__(self, message: str, step: str | None = None) -> None:
        super().__init__(message)
        self.step = step


@dataclass
class StepState:
    """What the steps so far left for the next one (and, at the end, for the template)."""

    user: str = "root"
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    user_set: bool = False  # a USER step ran (its user becomes the template's default)


class _Tail:
    """The last lines of a step's output, for the failure message; every line goes to the build log."""

    def __init__(self, log: BuildLog, step: str) -> None:
        self.log, self.step = log, step
        self.lines: list[str] = []
        self.partial = {"stdout": "", "stderr": ""}

    def __call__(self, stream: str, text: str) -> None:
        buf = self.partial[stream] + text
        *done, self.partial[stream] = buf.split("\n")
        for line in done:
            self._emit(stream, line)

    def _emit(self, stream: str, line: str) -> None:
        self.lines = (self.lines + [line])[-8:]
        self.log.add(line, level="error" if stream == "stderr" else "info", step=self.step)

    def flush(self) -> None:
        for stream, rest in self.partial.items():
            if rest:
                self._emit(stream, rest)
        self.partial = {"stdout": "", "stderr": ""}


async def _run(host: str, cmd: str, state: StepState, log: BuildLog, label: str, step: int, *, user: str | None = None,
               timeout_s: float = 3600) -> None:
    tail = _Tail(log, str(step))
    result = await run_in_guest(host, cmd, user=user or state.user, envs=state.env, cwd=state.workdir,
                                timeout_s=timeout_s, on_output=tail)
    tail.flush()
    if result.exit_code != 0:
        last = " | ".join(tail.lines[-3:])
        raise StepFailed(f"{label} failed: {result.status or f'exit status {result.exit_code}'}"
                         + (f" ({result.error})" if result.error and result.error != result.status else "")
                         + (f": {last}" if last else ""), label)


async def _upload(host: str, data_path: Path, guest_path: str) -> None:
    url = f"http://{host}:{ENVD_PORT}/files"
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10)) as client:
        content = await trio.to_thread.run_sync(data_path.read_bytes)
        r = await client.post(url, params={"path": guest_path, "username": "root"}, content=content,
                              headers={"Content-Type": "application/octet-stream"})
    if r.status_code >= 300:
        raise TemplateBuildError(f"uploading {data_path.name} into the build VM failed: {r.status_code} {r.text[:200]}")


async def _copy(host: str, step: Step, state: StepState, log: BuildLog, label: str, number: int, files: Path
                ) -> None:
    src, dest = step.args[0], step.args[1]
    owner = (step.args[2] if len(step.args) > 2 else "") or state.user
    mode = step.args[3] if len(step.args) > 3 else ""
    archive = files / f"{step.files_hash}.tar" if step.files_hash else None
    if archive is None or not archive.is_file():
        raise StepFailed(f"{label}: the files for hash {step.files_hash} were never uploaded", label)
    tmp = f"/tmp/aenv-copy-{step.files_hash}"
    await _upload(host, archive, tmp + ".tar")
    rel = src.strip("/") or "."
    dest_abs = dest if dest.startswith("/") else f"{state.workdir or '/'}/{dest}"
    q = shlex.quote
    script = (
        f"set -e; mkdir -p {q(tmp)}; tar -xf {q(tmp + '.tar')} -C {q(tmp)}; s={q(tmp + '/' + rel)}; d={q(dest_abs)}; "
        'if [ -d "$s" ]; then mkdir -p "$d"; cp -a "$s"/. "$d"/; t="$d"; '
        'else case "$d" in */) mkdir -p "$d"; t="$d$(basename "$s")";; '
        '*) if [ -d "$d" ]; then t="$d/$(basename "$s")"; else mkdir -p "$(dirname "$d")"; t="$d"; fi;; esac; '
        'cp -a "$s" "$t"; fi; '
        f"chown -R {q(owner)}: \"$t\"; "
        + (f"chmod -R {q(mode)} \"$t\"; " if mode else "")
        + f"rm -rf {q(tmp)} {q(tmp + '.tar')}"
    )
    await _run(host, script, state, log, label, number, user="root")


def replay(step: Step, state: StepState) -> None:
    """What a step does to the state alone (a cached step's effect on the steps after it)."""
    if step.kind == "ENV":
        for k, v in zip(step.args[::2], step.args[1::2], strict=False):
            state.env[k] = v
    elif step.kind == "WORKDIR":
        state.workdir = step.args[0] if step.args[0].startswith("/") else f"{state.workdir or '/'}/{step.args[0]}"
    elif step.kind == "USER":
        state.user, state.user_set = step.args[0], True


AfterStep = Callable[[int, Step], Awaitable[None]]


async def run_recipe(host: str, recipe: Recipe, state: StepState, log: BuildLog, *, files_dir: Path,
                     ready_timeout_s: float, first: int = 1, after_step: AfterStep | None = None) -> StepState:
    """Run ``recipe``'s steps from number ``first`` (the ones before are cached: their state is replayed),
    then its start command and ready check, in the VM whose envd is at ``host``. ``after_step(i, step)`` runs
    after each step that ran (the recipe build seals and caches its layer there)."""
    n = len(recipe.steps)
    for i, step in enumerate(recipe.steps, 1):
        label = f"step {i}/{n} {step.describe()}"
        if i < first:
            replay(step, state)
            log.add(f"{label}: cached", step=str(i))
            continue
        log.add(label, step=str(i))
        if step.kind == "RUN":
            await _run(host, step.args[0], state, log, label, i, user=step.args[1] if len(step.args) > 1 else None)
        elif step.kind == "ENV":
            replay(step, state)
        elif step.kind == "WORKDIR":
            replay(step, state)
            path = state.workdir or "/"
            await _run(host, f"mkdir -p {shlex.quote(path)} && chown {shlex.quote(state.user)}: {shlex.quote(path)}",
                       state, log, label, i, user="root")
        elif step.kind == "USER":
            await _run(host, f"id -u {shlex.quote(step.args[0])} >/dev/null", state, log, label, i, user="root")
            replay(step, state)
        elif step.kind == "COPY":
            await _copy(host, step, state, log, label, i, files_dir)
        else:
            raise StepFailed(f"{label}: unknown step type {step.kind}", label)
        if after_step is not None:
            await after_step(i, step)
    if recipe.start_cmd:
        await _start_and_wait_ready(host, recipe, state, log, ready_timeout_s)
    elif recipe.ready_cmd:
        await _wait_ready(host, recipe.ready_cmd, state, log, ready_timeout_s)
    return state


async def _start_and_wait_ready(host: str, recipe: Recipe, state: StepState, log: BuildLog,
                                timeout_s: float) -> None:
    """Start the start command, its output going to the build log, and wait for the ready command; a start
    command that exits first fails the build with its status and last lines. Following its output stops
    before the snapshot (the process keeps running; the snapshot holds it)."""
    assert recipe.start_cmd is not None
    log.add(f"start command: {recipe.start_cmd}", step="start")
    tail = _Tail(log, "start")
    ended: list[ExecResult] = []

    async def follow(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        result = await follow_in_guest(host, recipe.start_cmd or "", user=state.user, envs=state.env,
                                       cwd=state.workdir, on_output=tail, task_status=task_status)
        tail.flush()
        ended.append(result)
        nursery.cancel_scope.cancel()

    try:
        async with trio.open_nursery() as nursery:
            pid = await nursery.start(follow)
            log.add(f"started (pid {pid})", step="start")
            if recipe.ready_cmd:
                await _wait_ready(host, recipe.ready_cmd, state, log, timeout_s, tail=tail)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # one failure (the ready check's, or envd's): the build says it as is
        if len(group.exceptions) == 1 and isinstance(group.exceptions[0], TemplateBuildError):
            raise group.exceptions[0] from None
        raise
    if ended:
        last = " | ".join(tail.lines[-5:])
        raise StepFailed(f"the start command exited ({ended[0].status or ended[0].exit_code}) before it was ready"
                         + (f": {last}" if last else ""), "start")


async def _wait_ready(host: str, cmd: str, state: StepState, log: BuildLog, timeout_s: float, *,
                      tail: _Tail | None = None) -> None:
    log.add(f"waiting for the ready command: {cmd}", step="ready")
    attempts = 0
    with trio.move_on_after(timeout_s):
        while True:
            attempts += 1
            result = await run_in_guest(host, cmd, user=state.user, envs=state.env, cwd=state.workdir,
                                        timeout_s=min(30.0, timeout_s))
            if result.exit_code == 0:
                log.add(f"ready after {attempts} check(s)", step="ready")
                return
            await trio.sleep(1)
    last = " | ".join(tail.lines[-5:]) if tail is not None else ""
    raise StepFailed(f"the ready command never succeeded within {timeout_s:.0f}s ({attempts} checks): {cmd}"
                     + (f"; the start command's last output: {last}" if last else ""), "ready")


def initial_state(image_env: Mapping[str, str], user: str | None, workdir: str | None) -> StepState:
    return StepState(user=user or "root", workdir=workdir or None, env=dict(image_env))
