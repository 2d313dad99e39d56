"""The deployment files (``deploy/``): the Kubernetes manifests are valid objects of the Kubernetes API (the
``kubernetes-validate`` schemas, strict: an unknown field is an error), and every file (Kubernetes, Compose,
systemd) runs commands, flags and settings that exist: each ``aenv-node`` invocation parses with the real CLI,
each ``AENV_*`` variable is a configuration key or a flag's variable, each configuration file loads. The systemd
install script is run for real into a temporary prefix, and the scheduler it installed serves."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import click
import httpx
import kubernetes_validate
import pytest
import yaml

from aenv_node.cli.node import main as cli
from aenv_node.config import load_config

from ..conftest import free_port

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.30"


def _k8s_objects() -> Iterator[tuple[str, dict[str, Any]]]:
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()):
            if doc:
                yield name, doc


def _flag_variables(group: click.Command) -> set[str]:
    found: set[str] = set()
    for param in group.params:
        envvar = param.envvar
        found.update([envvar] if isinstance(envvar, str) else list(envvar or []))
    if isinstance(group, click.Group):
        for sub in group.commands.values():
            found |= _flag_variables(sub)
    return found


KNOWN_VARIABLES = set(load_config(environ={}).as_environment()) | _flag_variables(cli) | {"AENV_CONFIG",
                                                                                       "AENV_STATE_DIR"}


def _parses(args: list[str]) -> None:
    """The real CLI accepts the command line (without running it)."""
    name, *rest = args
    command = cli.commands[name] if isinstance(cli, click.Group) else None
    assert command is not None, f"aenv-node has no command {name!r}"
    command.make_context(f"aenv-node {name}", list(rest), resilient_parsing=False)


def test_kubernetes_manifests_are_valid_and_run_real_commands() -> None:
    kustomization = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    kinds: dict[str, list[str]] = {}
    containers = 0
    for name, obj in _k8s_objects():
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        kinds.setdefault(obj["kind"], []).append(obj["metadata"]["name"])
        spec = obj.get("spec", {}).get("template", {}).get("spec")
        for c in (spec or {}).get("containers", []):
            containers += 1
            for var in c.get("env", []):
                if var["name"].startswith("AENV_"):
                    assert var["name"] in KNOWN_VARIABLES, f"{name}: {var['name']} sets nothing"
            if c["image"] == "aenv-node" and "command" not in c:
                _parses(c["args"])
    assert sorted(kinds) == ["DaemonSet", "Deployment", "Namespace", "Service", "ServiceAccount", "StatefulSet"]
    assert sorted(kinds["Deployment"]) == ["aenv-gateway", "aenv-scheduler"] and kinds["DaemonSet"] == ["aenv-node"]
    assert containers == 4
    # what the generators read exists, and the configuration loads as the node and gateway read it
    for generated in kustomization["configMapGenerator"]:
        for f in generated["files"]:
            load_config(path=DEPLOY / "k8s" / f.split("=")[-1], environ={})
    node = next(o for _n, o in _k8s_objects() if o["kind"] == "DaemonSet")
    pod = node["spec"]["template"]["spec"]
    assert pod["containers"][0]["securityContext"]["privileged"] is True
    assert pod["terminationGracePeriodSeconds"] >= 600  # a stop pauses and publishes every sandbox first
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[:2] == ["aenv-node", "drain"], pre_stop
    _parses(pre_stop[1:])  # the drain the hook runs, within the grace period
    assert float(pre_stop[pre_stop.index("--timeout") + 1]) < pod["terminationGracePeriodSeconds"]
    assert load_config(path=DEPLOY / "k8s" / "config.toml", environ={}).node.pause_on_stop


def test_compose_runs_real_commands() -> None:
    doc = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = doc["services"]
    assert sorted(services) == ["gateway", "node1", "node2", "redis", "scheduler"]
    for name, svc in services.items():
        assert svc["image"] == "aenv-node"
        if "entrypoint" not in svc:
            _parses(svc["command"])
        for var in svc.get("environment", {}):
            assert var in KNOWN_VARIABLES, f"{name}: {var} sets nothing"
    nodes = [services["node1"], services["node2"]]
    assert {n["environment"]["AENV_NODE_NODE_ID"] for n in nodes} == {"node1", "node2"}
    assert all(n["privileged"] and "/dev/kvm" in n["devices"] for n in nodes)


@pytest.mark.slow
def _image_build() -> tuple[list[str], list[str]]:
    """What image/Dockerfile builds with: the sources it copies, and the installer's roles (its one RUN)."""
    lines = (REPO / "image" / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
    copied = [src for line in lines if line.startswith("COPY ") for src in line.split()[1:-1]]
    runs = [line for line in lines if line.startswith("RUN ")]
    assert len(runs) == 1 and "deploy/systemd/install.sh" in runs[0], runs
    words = runs[0].split("&&")[0].split()
    assert "--no-start" in words, words  # an image starts nothing while it is built
    roles = [w for w in words if w in ("node", "scheduler", "gateway", "redis")]
    return copied, roles


def test_the_image_is_built_by_the_installer_from_files_that_exist() -> None:
    copied, roles = _image_build()
    for src in copied:
        assert (REPO / src).exists(), f"image/Dockerfile copies {src}, which is not in the repository"
    # the installer reads its steps from what the image copies
    assert {"deploy", "scripts", "aenv_node", "pyproject.toml"} <= set(copied), copied
    assert sorted(roles) == ["gateway", "node", "redis", "scheduler"]  # one image runs every piece


def test_systemd_install_script_installs_units_that_run(tmp_path: Path) -> None:
    """The installer with the image's roles (the node's kit, rootfs and Firecracker steps are no-ops where the
    development set-up made them already: they are cached by content hash and checked by sha256)."""
    prefix, etc, units = tmp_path / "opt", tmp_path / "etc", tmp_path / "units"
    _copied, roles = _image_build()
    r = subprocess.run([str(DEPLOY / "systemd" / "install.sh"), "--prefix", str(prefix), "--etc", str(etc),
                        "--unit-dir", str(units), "--no-start", *roles],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in units.iterdir()) == ["aenv-gateway.service", "aenv-node.service",
                                                        "aenv-scheduler.service"]
    # a node's pieces: the venv's CLI, the VMM launch helpers beside it, Firecracker and its jailer
    for tool in ("aenv-node", "aenv-seccomp-exec", "aenv-vmm-exec"):
        assert os.access(prefix / "venv" / "bin" / tool, os.X_OK), tool
    assert all(os.access(Path("/opt/aenv/bin") / b, os.X_OK) for b in ("firecracker", "jailer"))
    assert (etc / "cluster.env").stat().st_mode & 0o077 == 0
    key = (etc / "cluster.env").read_text().strip().split("=", 1)[1]
    assert len(key) == 48
    load_config(path=etc / "config.toml", environ={})
    if shutil.which("systemd-analyze"):
        v = subprocess.run(["systemd-analyze", "verify", *map(str, units.iterdir())], capture_output=True,
                           text=True, timeout=120)
        assert "aenv" not in v.stderr, v.stderr
    # the scheduler as its unit starts it: ExecStart with the unit's environment (a real Redis to hold state)
    unit = (units / "aenv-scheduler.service").read_text()
    exec_start = next(line.split("=", 1)[1] for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.startswith(str(prefix / "venv" / "bin" / "aenv-node"))
    from .conftest import start_redis

    redis = start_redis(tmp_path / "redis")
    port = free_port()
    env = {"PATH": os.environ["PATH"], "AENV_SCHEDULER_REDIS": redis.url, "AENV_API_API_KEY": key}
    proc = subprocess.Popen([*exec_start.split(), "--listen", f"127.0.0.1:{port}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/nodes", headers={"X-API-KEY": key}).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        redis.stop()
