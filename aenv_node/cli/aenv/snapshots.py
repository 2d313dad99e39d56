"""``aenv snapshot create|ls|rm``: user snapshots of a sandbox (each is a template a sandbox can start from)."""

from __future__ import annotations

from typing import Any, Optional

import click

from .conn import Conn, connection_options
from .output import echo_json, print_table

__all__ = ["register"]


@click.group("snapshot")
def snapshot_group() -> None:
    """Create, list and remove snapshots (start one with `aenv start SNAPSHOT_ID`)."""


@snapshot_group.command("create")
@click.argument("sandbox_id")
@click.option("--name", default=None, help="A name to start it by (`aenv start NAME`).")
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON.")
@connection_options
def snapshot_create(conn: Conn, sandbox_id: str, name: Optional[str], as_json: bool) -> None:
    """Snapshot a running sandbox (a brief pause; it goes on running). Prints the snapshot id."""
    body: dict[str, Any] = {"name": name} if name else {}
    info = conn.api.json("POST", f"/sandboxes/{sandbox_id}/snapshots", json=body)
    if as_json:
        echo_json(info)
    else:
        click.echo(info["snapshotID"])


@snapshot_group.command("ls")
@click.option("--sandbox-id", default=None, help="Only the snapshots of this sandbox.")
@click.option("--json", "as_json", is_flag=True, help="Print the server's JSON.")
@connection_options
def snapshot_ls(conn: Conn, sandbox_id: Optional[str], as_json: bool) -> None:
    """List snapshots, newest first."""
    params: dict[str, str] = {"sandboxID": sandbox_id} if sandbox_id else {}
    rows: list[dict[str, Any]] = conn.api.pages("/snapshots", params)
    if as_json:
        echo_json(rows)
        return
    print_table(
        ("SNAPSHOT ID", "NAMES", "SANDBOX", "PARENT", "KIND", "STATUS", "CREATED"),
        [(s["snapshotID"], ",".join(s.get("names") or []), s.get("sourceSandboxID"), s.get("parentID"),
          s.get("kind"), s.get("status"), str(s.get("createdAt", ""))[:19]) for s in rows],
        empty="no snapshots",
    )


@snapshot_group.command("rm")
@click.argument("snapshot_id")
@connection_options
def snapshot_rm(conn: Conn, snapshot_id: str) -> None:
    """Delete a snapshot (sandboxes started from it keep running)."""
    conn.api.request("DELETE", f"/templates/{snapshot_id}")
    click.echo(snapshot_id)


def register(group: click.Group) -> None:
    group.add_command(snapshot_group)
