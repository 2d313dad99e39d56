"""Templates: ``aenv pull IMAGE``, ``aenv build DOCKERFILE``, ``aenv template ls|rm|watch|import-vm``.

A build is made with the e2b SDK's ``Template`` builder (``Template.build_in_background``: it registers the
build, uploads COPY/ADD files by hash, starts the recipe), then followed with :func:`.build_progress.follow_build`
on the node's status route. ``ls``/``rm`` are the node's REST routes (``GET /templates``, ``DELETE
/templates/{id}``).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Optional

import click

from .conn import Conn, connection_options
from .output import echo_json, err, print_table

__all__ = ["default_name", "register"]

_NAME_OK = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")


def default_name(ref: str) -> str:
    """A template name for an image reference: `ghcr.io/org/app:1.2` -> `app-1.2`, `python` -> `python`."""
    ref = ref.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]
    repo, _, tag = last.partition(":")
    name = f"{repo}-{tag}" if tag and tag != "latest" else repo
    name = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-._") or "template"
    return name[:128]


def _check_name(name: str) -> str:
    base = name.split(":", 1)[0]
    if not _NAME_OK.fullmatch(base):
        raise click.BadParameter(f"{name!r}: lowercase letters, digits, '.', '_', '-' (optionally NAME:TAG)",
                                 param_hint="--name")
    return name


def _size_options(fn: Any) -> Any:
    fn = click.option("--disk-mb", type=click.IntRange(min=0), default=None,
                      help="Minimum free disk after the build, MiB.")(fn)
    fn = click.option("--mem", type=click.IntRange(min=128), default=None, metavar="MB",
                      help="Memory of its sandboxes, MiB.")(fn)
    fn = click.option("--cpu", type=click.IntRange(min=1, max=64), default=None,
                      help="vCPUs of its sandboxes.")(fn)
    return fn


def _build_options(fn: Any) -> Any:
    fn = click.option("--json", "as_json", is_flag=True, help="Print the result (ids, status) as JSON.")(fn)
    fn = click.option("--timeout", type=click.FloatRange(min=0), default=None, metavar="S",
                      help="Stop following after S seconds (the build goes on) with a non-zero exit.")(fn)
    fn = click.option("-d", "--detach", is_flag=True, help="Print the build id and return.")(fn)
    fn = click.option("--no-cache", is_flag=True, help="Rebuild every step.")(fn)
    fn = click.option("--ready-cmd", default=None, metavar="CMD",
                      help="Ready once CMD exits 0 (default with a start command: wait 20 s).")(fn)
    fn = click.option("--start-cmd", default=None, metavar="CMD", help="Command left running in the template.")(fn)
    return _size_options(fn)


def _run_build(conn: Conn, template: Any, name: str, *, cpu: Optional[int], mem: Optional[int],
               disk_mb: Optional[int], start_cmd: Optional[str], ready_cmd: Optional[str], no_cache: bool,
               detach: bool, timeout: Optional[float], as_json: bool) -> None:
    from e2b import Template, wait_for_timeout

    conn.check()
    if start_cmd is not None:
        template = template.set_start_cmd(start_cmd, ready_cmd or wait_for_timeout(20_000))
    elif ready_cmd is not None:
        template = template.set_ready_cmd(ready_cmd)
    info = Template.build_in_background(template, name, cpu_count=cpu, memory_mb=mem, min_free_disk_mb=disk_mb,
                                        skip_cache=no_cache, **conn.sdk_opts())
    ids = {"templateID": info.template_id, "buildID": info.build_id, "name": name}
    if detach:
        if as_json:
            echo_json(ids)
        else:
            click.echo(info.build_id)
        return
    err(f"building {name}: template {info.template_id}, build {info.build_id}")
    from .build_progress import follow_build

    status = follow_build(conn, info.template_id, info.build_id, timeout)
    if as_json:
        echo_json({**ids, "status": status.get("status")})
    else:
        click.echo(name)


@click.command("pull")
@click.argument("image")
@click.option("--name", default=None, help="Template name (NAME or NAME:TAG; default from IMAGE).")
@click.option("--username", default=None, help="Registry user (with --password-stdin).")
@click.option("--password-stdin", is_flag=True, help="Read the registry password from stdin.")
@_build_options
@connection_options
def pull_cmd(conn: Conn, image: str, name: Optional[str], username: Optional[str], password_stdin: bool,
             **build: Any) -> None:
    """Build a template from the OCI image IMAGE (pulled by the node), with live progress per layer and step.

    Registry credentials are used for this pull only: the node never stores them.
    """
    if password_stdin != (username is not None):
        raise click.UsageError("--username and --password-stdin go together")
    password = None
    if password_stdin:
        password = sys.stdin.read().rstrip("\r\n")
        if not password:
            raise click.UsageError("--password-stdin: nothing on stdin")
    name = _check_name(name or default_name(image))
    from e2b import Template

    template = Template().from_image(image, username=username, password=password)
    _run_build(conn, template, name, **build)


@click.command("build")
@click.argument("dockerfile", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--name", default=None, help="Template name (default: the context directory's name).")
@click.option("--context", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Directory COPY/ADD sources are relative to (default: the Dockerfile's).")
@_build_options
@connection_options
def build_cmd(conn: Conn, dockerfile: Path, name: Optional[str], context: Optional[Path], **build: Any) -> None:
    """Build a template from DOCKERFILE: FROM, RUN, COPY, ADD (local files), ENV, ARG, WORKDIR, USER,
    CMD/ENTRYPOINT (the start command). EXPOSE, LABEL, VOLUME, MAINTAINER are ignored with a warning; any other
    instruction is an error naming its line. --start-cmd/--ready-cmd override CMD/ENTRYPOINT."""
    from .dockerfile import to_template

    context = (context or dockerfile.parent).resolve()
    name = _check_name(name or default_name(context.name))
    parsed = to_template(dockerfile, context)
    for warning in parsed.warnings:
        err(f"warning: {warning}")
    _run_build(conn, parsed.template, name, **build)


@click.group("template", cls=click.Group)
def template_group() -> None:
    """List, remove and follow templates."""


@template_group.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON.")
@connection_options
def template_ls(conn: Conn, as_json: bool) -> None:
    """List templates."""
    rows = conn.api.json("GET", "/templates")
    if as_json:
        echo_json(rows)
        return
    print_table(
        ("TEMPLATE ID", "NAMES", "STATUS", "CPU", "MEM MB", "DISK MB", "BUILDS", "CREATED"),
        [(t["templateID"], ",".join(t.get("names") or t.get("aliases") or []), t.get("buildStatus"),
          t.get("cpuCount"), t.get("memoryMB"), t.get("diskSizeMB"), t.get("buildCount", ""),
          str(t.get("createdAt", ""))[:19]) for t in rows],
        empty="no templates",
    )


@template_group.command("rm")
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@connection_options
def template_rm(conn: Conn, names: tuple[str, ...]) -> None:
    """Delete templates (by name or id; a snapshot id works too). Sandboxes made from one keep running."""
    conn.api.delete_each({name: f"/templates/{name}" for name in names})


def _find_build(conn: Conn, build_id: str) -> str:
    """The template a build belongs to (the node has no route by build id: look through the templates)."""
    for t in conn.api.json("GET", "/templates"):
        if t.get("buildID") == build_id:
            return str(t["templateID"])
        detail = conn.api.json("GET", f"/templates/{t['templateID']}")
        if any(b.get("buildID") == build_id for b in detail.get("builds") or []):
            return str(t["templateID"])
    raise click.ClickException(f"build {build_id} not found (give its template: --template NAME)")


@template_group.command("watch")
@click.argument("build_id", metavar="BUILD")
@click.option("--template", "template_id", default=None, help="The build's template (saves a search).")
@click.option("--timeout", type=click.FloatRange(min=0), default=None, metavar="S", help="Stop after S seconds.")
@connection_options
def template_watch(conn: Conn, build_id: str, template_id: Optional[str], timeout: Optional[float]) -> None:
    """Follow build BUILD (the id `aenv pull -d` printed) to its end; the exit code is 1 if it failed."""
    from .build_progress import follow_build

    follow_build(conn, template_id or _find_build(conn, build_id), build_id, timeout)
    click.echo(f"build {build_id} ready")


@template_group.command("import-vm")
@click.argument("kernel", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--name", required=True, help="Template name.")
@click.option("--ready", "ready_console", required=True, metavar="TEXT",
              help="The guest is up once its console prints TEXT.")
@click.option("--mem", type=click.IntRange(min=16), default=128, metavar="MB", show_default=True,
              help="Memory of its sandboxes, MiB.")
@click.option("--cpu", type=click.IntRange(min=1, max=64), default=1, show_default=True,
              help="vCPUs of its sandboxes.")
@click.option("--timeout", type=click.IntRange(min=1, max=600), default=30, metavar="S", show_default=True,
              help="How long the guest may take to print TEXT.")
@click.option("--json", "as_json", is_flag=True, help="Print the node's answer as JSON.")
@connection_options
def template_import_vm(conn: Conn, kernel: Path, name: str, ready_console: str, mem: int, cpu: int, timeout: int,
                       as_json: bool) -> None:
    """Import a VM without envd as a template: KERNEL (an x86-64 ELF with a PVH note: a unikernel, a test
    guest) is booted by the node until its console prints TEXT. Its sandboxes run once their VMM does; the
    SDK's commands and files need envd and do not work in them."""
    if not _NAME_OK.fullmatch(name) or ":" in name:
        raise click.BadParameter(f"{name!r}: lowercase letters, digits, '.', '_', '-'", param_hint="--name")
    body = kernel.read_bytes()
    answer = conn.api.request("POST", "/node/vm-templates", content=body,
                              params={"alias": name, "readyConsole": ready_console, "memoryMB": mem,
                                      "cpuCount": cpu, "timeoutS": timeout},
                              headers={"content-type": "application/octet-stream"},
                              timeout=timeout + 60).json()
    if as_json:
        echo_json(answer)
    else:
        err(f"imported {name}: template {answer['templateID']}, up {answer['bootMs']:.0f} ms after its boot")
        click.echo(name)


def register(group: click.Group) -> None:
    group.add_command(pull_cmd)
    group.add_command(build_cmd)
    group.add_command(template_group)
