"""``scripts/kvmhost up|down|status``: the KVM host VM from the command line (see ``vm.py``)."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from . import vm


def _say(msg: str) -> None:
    click.echo(f"kvmhost: {msg}", err=True)


@click.group()
@click.option("--dir", "run_dir", type=click.Path(path_type=Path), default=vm.DEFAULT_RUN_DIR, show_default=True,
              help="run directory of the VM (its drives, console log and state.json)")
@click.pass_context
def main(ctx: click.Context, run_dir: Path) -> None:
    """A QEMU TCG VM acting as a KVM host (nested SVM) with aenv-node running inside."""
    ctx.obj = run_dir


@main.command()
@click.option("--vmm", type=click.Choice(["auto", "firecracker", "qemu"]), default="auto", show_default=True,
              help="vmm.kind of the node inside (auto picks Firecracker: the VM has KVM)")
@click.option("--mem-mib", type=int, default=6144, show_default=True)
@click.option("--vcpus", type=int, default=1, show_default=True,
              help="more than 1 risks a kernel oops in the VM (vm.up says why)")
@click.option("--port", type=int, default=None, help="host port for the node's API (default: a free one)")
@click.option("--shell", is_flag=True, help="a root shell inside for debugging (`kvmhost sh`), on 127.0.0.1 only")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning"]), default="info", show_default=True,
              help="node.log_level of the node inside (its log is on the VM's console)")
@click.pass_obj
def up(run_dir: Path, vmm: str, mem_mib: int, vcpus: int, port: int | None, shell: bool, log_level: str) -> None:
    """Build (cached) and boot the VM, wait for the node inside, print how to reach it."""
    try:
        host = vm.up(run_dir, vmm=vmm, mem_mib=mem_mib, vcpus=vcpus, port=port, shell=shell,
                     log_level=log_level, progress=_say)
    except RuntimeError as e:
        raise click.ClickException(str(e)) from e
    click.echo(f"# aenv-node in the KVM host VM (pid {host.pid}), API at {host.url}")
    for k, v in host.env().items():
        click.echo(f"export {k}={shlex.quote(v)}")


@main.command()
@click.pass_obj
def down(run_dir: Path) -> None:
    """Stop the VM and remove its scratch drives."""
    click.echo("stopped" if vm.down(run_dir) else "not running")


@main.command()
@click.argument("command", nargs=-1, required=True)
@click.pass_obj
def sh(run_dir: Path, command: tuple[str, ...]) -> None:
    """Run COMMAND as root inside the VM (started with `up --shell`) and print its output."""
    host = vm.KvmHost.load(run_dir)
    if host is None or not host.alive():
        raise click.ClickException("the KVM host VM is not up")
    try:
        click.echo(host.sh(" ".join(command)), nl=False)
    except (RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from e


@main.command()
@click.pass_obj
def status(run_dir: Path) -> None:
    """Say whether the VM is up and its node answers; exit 1 when it is not up."""
    host = vm.KvmHost.load(run_dir)
    if host is None or not host.alive():
        click.echo("down")
        sys.exit(1)
    click.echo(f"up: pid {host.pid}, {host.mem_mib} MiB, {host.vcpus} vCPUs, vmm={host.vmm}, node "
               f"{'healthy' if host.healthy() else 'not answering'} at {host.url}, console {host.console}")


if __name__ == "__main__":
    main()
