"""Sandbox lifecycle: ``start``, ``ls``, ``pause``, ``resume``, ``timeout``, ``rm``, ``fork``.

These are control-plane calls on the node's REST API (``docs/api.md``); only attaching a shell after
``start`` goes through envd (:mod:`.shell`).
"""

from __future__ import annotations

from typing import Any

import click

from .conn import Conn, connection_options
from .output import echo_json, err, parse_kv, print_table

__all__ = ["register"]


def _list_sandboxes(conn: Conn, states: str, metadata: dict[str, str]) -> list[dict[str, Any]]:
    from urllib.parse import quote, urlencode

    params: dict[str, str] = {"state": states}
    if metadata:
        # the SDK's double encoding: the filter is itself a query string
        params["metadata"] = urlencode({quote(k): quote(v) for k, v in metadata.items()})
    rows: list[dict[str, Any]] = conn.api.pages("/v2/sandboxes", params)
    return rows


@click.command("ls")
@click.option("--state", "states", default="running,paused", show_default=True,
              help="Comma-separated states to list.")
@click.option("--metadata", "metadata", multiple=True, metavar="K=V", help="Metadata filter (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON.")
@connection_options
def ls_cmd(conn: Conn, states: str, metadata: tuple[str, ...], as_json: bool) -> None:
    """List sandboxes (follows pagination)."""
    rows = _list_sandboxes(conn, states, parse_kv(metadata, "--metadata"))
    if as_json:
        echo_json(rows)
        return
    print_table(
        ("SANDBOX ID", "TEMPLATE", "STATE", "CPU", "MEM MB", "STARTED", "ENDS", "METADATA"),
        [(r["sandboxID"], r.get("alias") or r["templateID"], r["state"], r.get("cpuCount"), r.get("memoryMB"),
          r["startedAt"][:19], r["endAt"][:19], ",".join(f"{k}={v}" for k, v in (r.get("metadata") or {}).items()))
         for r in rows],
        empty="no sandboxes",
    )


@click.command("start")
@click.argument("template")
@click.option("-d", "--detach", is_flag=True, help="Print the sandbox id and return (no shell).")
@click.option("--timeout", type=click.IntRange(min=0), default=None, metavar="S",
              help="Seconds until the sandbox ends (pauses); the node's default when omitted.")
@click.option("--cpu", type=click.IntRange(min=1, max=64), default=None, help="vCPUs (see below).")
@click.option("--mem", type=click.IntRange(min=128), default=None, metavar="MB", help="Memory in MiB (see below).")
@click.option("--env", "envs", multiple=True, metavar="K=V", help="Environment variable (repeatable).")
@click.option("--metadata", "metadata", multiple=True, metavar="K=V", help="Metadata (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="With -d: print the created sandbox as JSON.")
@connection_options
def start_cmd(conn: Conn, template: str, detach: bool, timeout: int | None, cpu: int | None, mem: int | None,
              envs: tuple[str, ...], metadata: tuple[str, ...], as_json: bool) -> None:
    """Create a sandbox from TEMPLATE (a template name, id or snapshot id) and attach a shell to it.

    Without -d the terminal is attached to a login shell in the sandbox; the sandbox keeps running when the
    shell exits (until its timeout; `aenv rm ID` ends it).

    --cpu/--mem: a sandbox restores its template's snapshot, which fixes its size; another size comes from a
    template NAME-<cpu>cpu-<mem>mb derived from TEMPLATE, built (once per build of TEMPLATE) on first use.
    """
    if cpu is not None or mem is not None:
        from .sizing import sized_template

        template = sized_template(conn, template, cpu, mem)
    body: dict[str, Any] = {"templateID": template, "metadata": parse_kv(metadata, "--metadata"),
                            "envVars": parse_kv(envs, "--env")}
    if timeout is not None:
        body["timeout"] = timeout
    created = conn.api.json("POST", "/v2/sandboxes", json=body)
    sandbox_id = created["sandboxID"]
    if detach:
        echo_json(created) if as_json else click.echo(sandbox_id)
        return
    err(f"sandbox {sandbox_id} started; attaching (it keeps running after the shell exits)")
    from .shell import attach_shell

    raise click.exceptions.Exit(attach_shell(conn, sandbox_id, envs=parse_kv(envs, "--env")))


@click.command("pause")
@click.argument("sandbox_id")
@connection_options
def pause_cmd(conn: Conn, sandbox_id: str) -> None:
    """Pause a running sandbox (its memory and disk are captured; it holds no CPU or memory)."""
    conn.api.request("POST", f"/sandboxes/{sandbox_id}/pause")
    click.echo(f"{sandbox_id} paused")


@click.command("resume")
@click.argument("sandbox_id")
@click.option("--timeout", type=click.IntRange(min=0), default=None, metavar="S", help="New timeout in seconds.")
@connection_options
def resume_cmd(conn: Conn, sandbox_id: str, timeout: int | None) -> None:
    """Resume a paused sandbox."""
    body = {"timeout": timeout} if timeout is not None else {}
    conn.api.request("POST", f"/sandboxes/{sandbox_id}/resume", json=body)
    click.echo(f"{sandbox_id} running")


@click.command("timeout")
@click.argument("sandbox_id")
@click.argument("seconds", type=click.IntRange(min=0))
@connection_options
def timeout_cmd(conn: Conn, sandbox_id: str, seconds: int) -> None:
    """Make a sandbox end SECONDS from now (it pauses then, or is killed if it was created without autoPause)."""
    conn.api.request("POST", f"/sandboxes/{sandbox_id}/timeout", json={"timeout": seconds})
    click.echo(f"{sandbox_id} ends in {seconds}s")


@click.command("rm")
@click.argument("sandbox_ids", nargs=-1, required=True, metavar="ID...")
@connection_options
def rm_cmd(conn: Conn, sandbox_ids: tuple[str, ...]) -> None:
    """Kill sandboxes (running or paused). Every id is tried; the exit code is 1 if any failed."""
    conn.api.delete_each({sid: f"/sandboxes/{sid}" for sid in sandbox_ids})


@click.command("fork")
@click.argument("sandbox_id")
@click.option("--count", type=click.IntRange(min=1), default=1, show_default=True, help="Number of children.")
@click.option("--timeout", type=click.IntRange(min=0), default=None, metavar="S", help="Each child's timeout.")
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON (children and errors).")
@connection_options
def fork_cmd(conn: Conn, sandbox_id: str, count: int, timeout: int | None, as_json: bool) -> None:
    """Fork a running sandbox into COUNT children: one child id per line, each failed child's error on stderr;
    the exit code is 1 if any child failed."""
    body: dict[str, Any] = {"count": count}
    if timeout is not None:
        body["timeout"] = timeout
    results = conn.api.json("POST", f"/sandboxes/{sandbox_id}/fork", json=body)
    if as_json:
        echo_json(results)
    failed = 0
    for i, r in enumerate(results):
        if r.get("sandbox"):
            if not as_json:
                click.echo(r["sandbox"]["sandboxID"])
        else:
            failed += 1
            e = r.get("error") or {}
            err(f"child {i + 1}: {e.get('code', '?')}: {e.get('message', 'unknown error')}")
    if failed:
        raise click.exceptions.Exit(1)


def register(group: click.Group) -> None:
    for cmd in (start_cmd, ls_cmd, pause_cmd, resume_cmd, timeout_cmd, rm_cmd, fork_cmd):
        group.add_command(cmd)
