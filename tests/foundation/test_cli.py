"""The CLIs: aenv-node (config show, db upgrade, errors) and aenv (auth, ls)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import free_port
from .test_supervisor import _serve, _wait_health


def run(args: list[str], env: dict[str, str] | None = None, module: str = "aenv_node.cli.node"):
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=60)


def test_config_show_reflects_flags_and_env(tmp_path: Path) -> None:
    r = run(["--state-dir", str(tmp_path), "config", "show", "--json"], {"AENV_API_LISTEN": "127.0.0.1:9999"})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["node"]["state_dir"] == str(tmp_path) and doc["api"]["listen"] == "127.0.0.1:9999"
    r = run(["config", "show", "--state-dir", str(tmp_path / "x")])
    assert f'state_dir = "{tmp_path / "x"}"' in r.stdout


def test_db_upgrade_creates_the_tables(tmp_path: Path) -> None:
    r = run(["db", "upgrade", "--state-dir", str(tmp_path)])
    assert r.returncode == 0, r.stderr
    tables = subprocess.run(["sqlite3", str(tmp_path / "aenv.db"), ".tables"], capture_output=True,
                            text=True).stdout.split()
    for t in ("sandboxes", "snapshots", "layers", "events", "cache_entries", "network_slots",
              "templates", "template_builds", "nodes"):
        assert t in tables


@pytest.mark.parametrize("args, env, message", [
    (["config", "show"], {"AENV_VMM_KIND": "xen"}, "vmm.kind"),
    (["config", "show"], {"AENV_CONFIG": "/nonexistent/c.toml"}, "cannot read config file"),
    (["serve"], {"AENV_API_LISTEN": "nohost"}, "is not HOST:PORT"),
])
def test_errors_are_one_line_and_nonzero(tmp_path: Path, args, env, message) -> None:
    r = run([*args, "--state-dir", str(tmp_path)], env)
    assert r.returncode != 0
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_aenv_auth_and_ls_against_a_live_node(tmp_path: Path) -> None:
    state = tmp_path / "state"
    port = free_port()
    proc = _serve(state, port)
    env = {"XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_health(url, proc)
        bad = run(["auth", "--url", url, "--key", "wrong"], env, module="aenv_node.cli.client")
        assert bad.returncode != 0 and "401: invalid API key" in bad.stderr
        assert not (tmp_path / "xdg" / "aenv" / "config.json").exists()
        r = run(["ls"], env, module="aenv_node.cli.client")
        assert r.returncode != 0 and "aenv auth" in r.stderr
        r = run(["auth", "--url", url, "--key-file", str(state / "secrets" / "api-key")], env,
                module="aenv_node.cli.client")
        assert r.returncode == 0, r.stderr
        saved = tmp_path / "xdg" / "aenv" / "config.json"
        assert oct(saved.stat().st_mode & 0o777) == "0o600"
        r = run(["ls"], env, module="aenv_node.cli.client")
        assert r.returncode == 0 and r.stdout.strip() == "no sandboxes", r.stderr
        r = run(["ls", "--json"], env, module="aenv_node.cli.client")
        assert json.loads(r.stdout) == []
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def test_key_rotate_replaces_the_key_of_a_running_node(live_node, node_config) -> None:
    """``aenv-node key rotate`` prints a new key; the running node (no restart) soon accepts only it."""
    import trio

    old = live_node.api_key
    out = await trio.to_thread.run_sync(
        lambda: run(["key", "rotate"], env={"AENV_STATE_DIR": str(node_config.state_dir)}))
    assert out.returncode == 0, out.stderr
    new = out.stdout.strip()
    assert new.startswith("aenv_") and new != old and "a running node uses it" in out.stderr
    assert (node_config.state_dir / "secrets" / "api-key").stat().st_mode & 0o777 == 0o600
    with trio.fail_after(10):
        while True:
            async with live_node.client(key=new) as c:
                if (await c.get("/v2/sandboxes")).status_code == 200:
                    break
            await trio.sleep(0.2)
    async with live_node.client(key=old) as c:
        r = await c.get("/v2/sandboxes")
        assert r.status_code == 401 and r.json()["message"] == "invalid API key"


def test_key_rotate_refuses_a_key_set_in_the_configuration(tmp_path: Path) -> None:
    out = run(["key", "rotate"], env={"AENV_STATE_DIR": str(tmp_path), "AENV_API_API_KEY": "fixed"})
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1].startswith("Error: the API key is set in "
                                                                                   "the configuration"), out.stderr
    assert not (tmp_path / "secrets" / "api-key").exists()
