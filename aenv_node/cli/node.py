"""``aenv-node``: run the node and administer its state.

Every command takes ``--state-dir`` and ``--config``; the effective
configuration is the embedded default overlaid by the file, ``AENV_*``
environment variables and the flags (see docs/configuration.md).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
from pathlib import Path
from typing import Any

import click

from .. import __version__
from ..config import Config
from ._common import build_config, config_option, one_line_errors, setup_logging, state_dir_option


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="aenv-node")
@config_option
@state_dir_option
@click.pass_context
def main(ctx: click.Context, config_path: Path | None, state_dir: Path | None) -> None:
    """aenv-node: a self-hosted runtime for agent sandboxes (E2B-compatible)."""
    ctx.ensure_object(dict)
    ctx.obj["config_path"] = config_path
    ctx.obj["state_dir"] = state_dir


def _cfg(ctx: click.Context, state_dir: Path | None, **api: Any) -> Config:
    return build_config(
        ctx.obj.get("config_path"), state_dir or ctx.obj.get("state_dir"), **api
    )


def pass_config(fn: Any) -> Any:
    """Decorator for subcommands (also used by plug-in groups): adds --state-dir and passes Config."""

    @state_dir_option
    @click.pass_context
    @one_line_errors
    def wrapper(ctx: click.Context, state_dir: Path | None, **kwargs: Any) -> Any:
        return ctx.invoke(fn, _cfg(ctx, state_dir), **kwargs)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


@main.command()
@state_dir_option
@click.option("--listen", default=None, help="HOST:PORT to serve the API on (default 127.0.0.1:8000).")
@click.option("--pause-on-stop", is_flag=True, default=None,
              help="On SIGTERM pause and publish running sandboxes, also with a data plane (node.pause_on_stop).")
@click.pass_context
@one_line_errors
def serve(ctx: click.Context, state_dir: Path | None, listen: str | None, pause_on_stop: bool | None) -> None:
    """Run the node: migrate the database, reconcile, serve the API until SIGTERM."""
    import trio

    from ..api.server import ApiServer
    from ..runtime import Node, ensure_api_key, run_node
    from ..runtime.assemble import install_sandbox_services
    from ..state import Database

    from ..faults import check_armed

    cfg = _cfg(ctx, state_dir, listen=listen)
    if pause_on_stop:
        cfg = dataclasses.replace(cfg, node=dataclasses.replace(cfg.node, pause_on_stop=True))
    setup_logging(cfg.node.log_level)
    try:
        check_armed()
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    key, key_path = ensure_api_key(cfg)
    node = Node(cfg, Database(cfg.database_path), key, key_path)
    sandboxes = install_sandbox_services(node)
    node.services.append(ApiServer(node, sandboxes=sandboxes))
    if cfg.cluster.scheduler_url:
        from ..cluster import HeartbeatSender

        heartbeat = HeartbeatSender(node, slot_capacity=sandboxes.parts.netcfg.capacity)
        node.services.append(heartbeat)
        # a sandbox that ran on a node the scheduler counts dead is taken over from its last checkpoint
        sandboxes.ops.owner_dead = heartbeat.owner_is_dead

    async def main_task() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(run_node, node)
            where = f"API key in {key_path}" if key_path else "API key from config"
            click.echo(
                f"aenv-node {__version__} serving http://{cfg.api.listen} "
                f"(state {cfg.state_dir}; {where})",
                err=True,
            )

    try:
        trio.run(main_task)
    except BaseExceptionGroup as group:
        raise click.ClickException(_first_error(group)) from None


@main.command()
@click.option("--url", default=None, help="The node's API (default http://<api.listen>, 0.0.0.0 as 127.0.0.1).")
@click.option("--timeout", default=900.0, show_default=True,
              help="Seconds to wait for every running sandbox to be paused and published.")
@pass_config
def drain(cfg: Config, url: str | None, timeout: float) -> None:
    """Drain the running node: it takes no new sandbox operation (503: a gateway places them on other nodes),
    pauses every running sandbox and publishes it to the repository, so another node resumes it on its next
    connect; returns when that is done. The node stays drained until it stops (a Kubernetes preStop, or before
    `systemctl stop`)."""
    import httpx

    if url is None:
        host = cfg.api.host if cfg.api.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        url = f"http://{'[' + host + ']' if ':' in host else host}:{cfg.api.port}"
    try:
        key_value = cfg.api.api_key or cfg.api_key_path.read_text().strip()
    except FileNotFoundError:
        raise click.ClickException(f"no API key: {cfg.api_key_path} is missing (is the node's state here?)") from None
    try:
        r = httpx.post(f"{url.rstrip('/')}/node/drain", headers={"X-API-KEY": key_value}, timeout=timeout)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"no node answers at {url}: {exc}") from None
    if r.status_code != 200:
        try:
            message = r.json()["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text[:200]
        raise click.ClickException(f"drain failed ({r.status_code}): {message}")
    report = r.json()
    click.echo(f"drained: {report['paused']} paused, {report['running']} still running, "
               f"{report['unpublished']} not yet published")
    if report["running"] or report["unpublished"]:
        raise click.ClickException("the node did not drain entirely (its log says why)")


@main.group()
def key() -> None:
    """The node's API key (the X-API-KEY every client sends)."""


@key.command("rotate")
@pass_config
def key_rotate(cfg: Config) -> None:
    """Replace the API key with a new one and print it: a running node accepts only the new key within a
    second, no restart (refused when the key is set in the configuration, api.api_key)."""
    from ..runtime import rotate_api_key
    from ..runtime.api_key import ApiKeyFromConfig, RELOAD_INTERVAL_S

    try:
        new = rotate_api_key(cfg)
    except ApiKeyFromConfig as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(new)
    click.echo(f"written to {cfg.api_key_path}; a running node uses it within {RELOAD_INTERVAL_S:.0f} s", err=True)


@main.group()
def dataplane() -> None:
    """The node's data plane: the process that serves sandbox disks and runs their VMMs (node.data_plane)."""


@dataplane.command("run")
@pass_config
def dataplane_run(cfg: Config) -> None:
    """Run the data plane until SIGTERM (which ends every VMM and disk it holds).

    The node starts it by itself when node.data_plane is true; run it by hand only to debug it."""
    import trio

    from ..dataplane import serve_dataplane
    from ..runtime.api_key import key_reader
    from ..runtime.node import node_id_for
    from ..runtime.peers import peer_options
    from ..storage.cache import LayerCache, run_janitor
    from ..storage.repository import repository_from_config

    setup_logging(cfg.node.log_level)
    st = cfg.storage

    async def main_task() -> None:
        repository = repository_from_config(cfg)
        # P2P (p2p.enabled): the disks' missing ranges are asked of peers first, and this cache serves peers
        # through the node's API (cache.read)
        peers = peer_options(cfg, node_id_for(cfg), key_reader(cfg))
        # its own cache directory beside the control plane's (that one is another process's, with its own
        # bookkeeping): ``<storage.cache_dir>-dataplane``
        cache = LayerCache(cfg.cache_dir.with_name(cfg.cache_dir.name + "-dataplane"), repository,
                           capacity_bytes=st.cache_capacity_bytes, high_watermark=st.cache_high_watermark,
                           low_watermark=st.cache_low_watermark, peers=peers)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(run_janitor, cache)
                await serve_dataplane(cfg.run_dir, cache)
                nursery.cancel_scope.cancel()
        finally:
            cache.close()
            if peers is not None:
                peers.source.close()
            repository.close()

    trio.run(main_task)


@dataplane.command("status")
@pass_config
def dataplane_status(cfg: Config) -> None:
    """Whether the data plane runs, and what it holds (one line per disk and VMM)."""
    from ..dataplane import DataPlaneUnavailable
    from ..dataplane.wire import call_blocking

    sock = cfg.run_dir / "dataplane.sock"
    try:
        info = call_blocking(sock, "ping")
        disks = call_blocking(sock, "disk.list")
        vmms = call_blocking(sock, "vmm.list")
    except DataPlaneUnavailable:
        raise click.ClickException(f"no data plane answers at {sock}") from None
    click.echo(f"data plane pid {info['pid']}: {len(disks)} disks, {len(vmms)} VMMs")
    for d in disks:
        click.echo(f"disk {d['sandbox_id']} {d['source']} ({len(d['layers'])} layers)")
    for v in vmms:
        click.echo(f"vmm {v['pid']} {v['key']}")


@dataplane.command("stop")
@click.option("--timeout", default=60.0, show_default=True, help="Seconds to wait for it to exit.")
@pass_config
def dataplane_stop(cfg: Config, timeout: float) -> None:
    """Stop the data plane: every VMM it runs is killed and every disk closed (stop the node first; running
    sandboxes then fall back to their last periodic snapshot at the node's next start)."""
    import os
    import signal
    import time

    from ..vmm.process import read_pid_file

    pid = read_pid_file(cfg.run_dir / "dataplane.pid")
    if pid is None or b"dataplane" not in _cmdline(pid):
        click.echo("no data plane runs", err=True)
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and b"dataplane" in _cmdline(pid):
        if time.monotonic() > deadline:
            raise click.ClickException(f"the data plane (pid {pid}) did not exit within {timeout:.0f} s")
        time.sleep(0.05)
    click.echo(f"data plane (pid {pid}) stopped", err=True)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _first_error(exc: BaseException) -> str:
    """One line for the error that stopped the node (Trio wraps it in exception groups)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return str(exc) if type(exc).__module__.startswith("aenv_node") else f"{type(exc).__name__}: {exc}"


@main.group()
def db() -> None:
    """The SQLite state database."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
@pass_config
def db_upgrade(cfg: Config, revision: str) -> None:
    """Migrate the database to REVISION (creates it if missing)."""
    from ..state import Database

    database = Database(cfg.database_path)
    database.upgrade(revision)
    click.echo(f"{cfg.database_path}: at revision {database.current_revision()}")


@db.command("downgrade")
@click.argument("revision")
@pass_config
def db_downgrade(cfg: Config, revision: str) -> None:
    """Migrate the database down to REVISION ("base" drops every table)."""
    from ..state import Database

    database = Database(cfg.database_path)
    database.downgrade(revision)
    click.echo(f"{cfg.database_path}: at revision {database.current_revision()}")


@main.group()
def config() -> None:
    """The effective configuration."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of TOML.")
@pass_config
def config_show(cfg: Config, as_json: bool) -> None:
    """Print the effective configuration (defaults + file + environment + flags)."""
    doc = cfg.as_toml_dict()
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    for section, values in doc.items():
        click.echo(f"[{section}]")
        for key, value in values.items():
            click.echo(f"{key} = {json.dumps(value)}")
        click.echo()


# Command groups owned by other layers, added when their module is present.
_PLUGINS = {
    "kit": ("aenv_node.cli.kit", "kit"),
    "rootfs": ("aenv_node.cli.kit", "rootfs"),
    "layer": ("aenv_node.cli.storage", "layer"),
    "image": ("aenv_node.cli.storage", "image"),
    "cache": ("aenv_node.cli.storage", "cache"),
    "scheduler": ("aenv_node.cli.cluster", "scheduler"),
    "gateway": ("aenv_node.cli.cluster", "gateway"),
}
for _name, (_module, _attr) in _PLUGINS.items():
    try:
        _group = getattr(importlib.import_module(_module), _attr)
    except (ImportError, AttributeError):
        continue
    main.add_command(_group, _name)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
