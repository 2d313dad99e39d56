"""``aenv-node scheduler`` and ``aenv-node gateway``: the cluster's processes beside the node (docs/cluster.md).

They read the same configuration as the node for what they share with it (the cluster's API key:
``api.api_key``, or ``--api-key-file``); their own settings are flags, each also an environment
variable (``AENV_SCHEDULER_*``, ``AENV_GATEWAY_*``), since neither runs with node state of its own.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Optional

import click

from ._common import build_config, config_option, one_line_errors, setup_logging

__all__ = ["scheduler", "gateway"]

log = logging.getLogger(__name__)


def _api_key(config_path: Optional[Path], key_file: Optional[Path]) -> str:
    if key_file is not None:
        try:
            key = key_file.read_text().strip()
        except OSError as exc:
            raise click.ClickException(f"cannot read --api-key-file {key_file}: {exc.strerror}") from None
    else:
        key = build_config(config_path, None).api.api_key
    if not key:
        raise click.ClickException("no cluster API key: give --api-key-file, or api.api_key (AENV_API_API_KEY)")
    return key


@click.command()
@config_option
@click.option("--listen", default="127.0.0.1:9090", show_default=True, envvar="AENV_SCHEDULER_LISTEN",
              help="HOST:PORT to serve on.")
@click.option("--redis", "redis_url", required=True, envvar="AENV_SCHEDULER_REDIS",
              help="Redis URL holding the cluster's state (redis://host:6379/0).")
@click.option("--redis-prefix", default="aenv:", show_default=True, envvar="AENV_SCHEDULER_REDIS_PREFIX",
              help="Prefix of every key (several clusters can share one Redis).")
@click.option("--api-key-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              envvar="AENV_SCHEDULER_API_KEY_FILE", help="File holding the cluster's API key.")
@click.option("--node-ttl", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              envvar="AENV_SCHEDULER_NODE_TTL", help="Seconds without a heartbeat after which a node is dead.")
@click.option("--cpu-overcommit", type=click.FloatRange(min=0.01), default=4.0, show_default=True,
              envvar="AENV_SCHEDULER_CPU_OVERCOMMIT", help="vCPUs placed per host CPU.")
@click.option("--memory-overcommit", type=click.FloatRange(min=0.01), default=1.5, show_default=True,
              envvar="AENV_SCHEDULER_MEMORY_OVERCOMMIT", help="Guest memory placed per MiB of host memory.")
@click.option("--candidates", type=click.IntRange(min=1), default=3, show_default=True,
              envvar="AENV_SCHEDULER_CANDIDATES", help="K of 'least loaded of K random candidates'.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
@one_line_errors
def scheduler(config_path: Optional[Path], listen: str, redis_url: str, redis_prefix: str,
              api_key_file: Optional[Path], node_ttl: float, cpu_overcommit: float, memory_overcommit: float,
              candidates: int, log_level: str) -> None:
    """Run the cluster's scheduler: node registry, placement, sandbox bindings (state in Redis)."""
    import trio

    from ..cluster import ClusterStore, PlacementPolicy, StoreUnavailable, run_scheduler

    setup_logging(log_level)
    key = _api_key(config_path, api_key_file)
    policy = PlacementPolicy(cpu_overcommit=cpu_overcommit, memory_overcommit=memory_overcommit,
                             candidates=candidates)
    store = ClusterStore(redis_url, prefix=redis_prefix, node_ttl_s=node_ttl)

    async def main_task() -> None:
        try:
            await store.ping()
        except StoreUnavailable as exc:
            raise click.ClickException(str(exc)) from None
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(lambda task_status: run_scheduler(
                listen, store, policy, key, shutdown=stop.wait, task_status=task_status))
            click.echo(f"aenv-node scheduler serving {', '.join(bound)} (redis {redis_url})", err=True)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    stop.set()  # Hypercorn finishes the requests in flight, then run_scheduler returns
                    break

    try:
        trio.run(main_task)
    finally:
        store.close()


@click.command()
@config_option
@click.option("--listen", default="127.0.0.1:8080", show_default=True, envvar="AENV_GATEWAY_LISTEN",
              help="HOST:PORT to serve the E2B API and sandbox traffic on.")
@click.option("--scheduler", "scheduler_url", required=True, envvar="AENV_GATEWAY_SCHEDULER",
              help="The scheduler's URL (http://host:9090).")
@click.option("--api-key-file", type=click.Path(path_type=Path, dir_okay=False), default=None,
              envvar="AENV_GATEWAY_API_KEY_FILE", help="File holding the cluster's API key.")
@click.option("--domain", default=None, envvar="AENV_GATEWAY_DOMAIN",
              help="Sandbox host domain ({port}-{id}.DOMAIN), as the nodes' api.domain [default: api.domain].")
@click.option("--create-attempts", type=click.IntRange(min=1, max=16), default=3, show_default=True,
              envvar="AENV_GATEWAY_CREATE_ATTEMPTS", help="Nodes a create is tried on before it fails.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
@one_line_errors
def gateway(config_path: Optional[Path], listen: str, scheduler_url: str, api_key_file: Optional[Path],
            domain: Optional[str], create_attempts: int, log_level: str) -> None:
    """Run a gateway: the E2B API and sandbox traffic in front of the cluster's nodes (stateless)."""
    import trio

    from ..cluster import Gateway, SchedulerClient, SchedulerUnavailable, run_gateway

    setup_logging(log_level)
    key = _api_key(config_path, api_key_file)
    cfg = build_config(config_path, None)
    gw = Gateway(SchedulerClient(scheduler_url, key), key,
                 domain=cfg.api.domain if domain is None else domain, create_attempts=create_attempts,
                 default_cpu_count=cfg.sandbox.default_cpu_count, default_memory_mb=cfg.sandbox.default_memory_mb)

    async def main_task() -> None:
        try:
            await gw.scheduler.nodes()
        except SchedulerUnavailable as exc:
            log.warning("%s (serving anyway: requests will answer 503 until it does)", exc)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(lambda task_status: run_gateway(
                listen, gw, shutdown=stop.wait, task_status=task_status))
            click.echo(f"aenv-node gateway serving {', '.join(bound)} (scheduler {scheduler_url})", err=True)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    stop.set()
                    break

    trio.run(main_task)
