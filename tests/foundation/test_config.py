"""Config precedence: embedded default < file < environment < flags."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from aenv_node.config import DEFAULT_CONFIG_TEXT, ConfigError, load_config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_embedded_default_needs_no_file(tmp_path: Path) -> None:
    cfg = load_config(environ={})
    assert cfg.state_dir == Path("/var/lib/aenv")
    assert cfg.api.listen == "127.0.0.1:8000"
    assert cfg.database_path == Path("/var/lib/aenv/aenv.db")
    assert cfg.api_key_path == Path("/var/lib/aenv/secrets/api-key")


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[api]\nlisten = "0.0.0.0:9000"\ndomain = "file.example"\n'
                 '[sandbox]\nfork_max_count = 7\n[node]\nstate_dir = "/from/file"\n')
    cfg = load_config(f, environ={})
    assert (cfg.api.listen, cfg.api.domain, cfg.sandbox.fork_max_count) == ("0.0.0.0:9000", "file.example", 7)
    assert cfg.state_dir == Path("/from/file")

    env = {"AENV_API_LISTEN": "127.0.0.2:9001", "AENV_STATE_DIR": "/from/env",
           "AENV_SANDBOX_FORK_MAX_COUNT": "9", "AENV_NET_EGRESS": "false"}
    cfg = load_config(f, environ=env)
    assert cfg.api.listen == "127.0.0.2:9001"
    assert cfg.api.domain == "file.example"  # untouched by env
    assert cfg.sandbox.fork_max_count == 9 and cfg.net.egress is False
    assert cfg.state_dir == Path("/from/env")

    cfg = load_config(f, environ=env, overrides={"node": {"state_dir": "/from/flag"}})
    assert cfg.state_dir == Path("/from/flag")


def test_lists_from_a_file_or_a_comma_separated_variable(tmp_path: Path) -> None:
    assert load_config(environ={}).images.registries == ("docker.io",)
    f = tmp_path / "c.toml"
    f.write_text('[images]\nregistries = ["registry.local:5000", "docker.io"]\ninsecure_registries = []\n')
    cfg = load_config(f, environ={})
    assert cfg.images.registries == ("registry.local:5000", "docker.io") and cfg.images.insecure_registries == ()
    cfg = load_config(f, environ={"AENV_IMAGES_INSECURE_REGISTRIES": "127.0.0.1:5000, localhost:6000,"})
    assert cfg.images.insecure_registries == ("127.0.0.1:5000", "localhost:6000")
    f.write_text('[images]\nregistries = "docker.io"\n')  # a plain string is one entry, as from the environment
    assert load_config(f, environ={}).images.registries == ("docker.io",)
    f.write_text('[images]\nregistries = [1, 2]\n')
    with pytest.raises(ConfigError, match=r"images\.registries .*expected a list of strings"):
        load_config(f, environ={})


def test_long_env_form_beats_nothing_short_form_used(tmp_path: Path) -> None:
    cfg = load_config(environ={"AENV_NODE_STATE_DIR": "/long"})
    assert cfg.state_dir == Path("/long")


def test_config_file_from_env(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[vmm]\nkind = "qemu"\n')
    assert load_config(environ={"AENV_CONFIG": str(f)}).vmm.kind == "qemu"


@pytest.mark.parametrize(
    "text, message",
    [
        ("[nope]\nx = 1\n", "unknown section [nope]"),
        ("[api]\nlistn = \"x\"\n", "unknown key api.listn"),
        ("[sandbox]\nfork_max_count = \"many\"\n", "sandbox.fork_max_count"),
        ("[vmm]\nkind = \"xen\"\n", "not one of auto, qemu, firecracker"),
        ("[api]\nlisten = \"nohost\"\n", "is not HOST:PORT"),
        ("[storage]\nrepository = \"s3\"\n", "needs s3_endpoint"),
        ("[storage]\ncache_low_watermark = 0.99\n", "cache_low_watermark"),
        ("not toml ===", "not valid TOML"),
        ("[images]\nca_bundle = \"/nonexistent/ca.pem\"\n", "images.ca_bundle: '/nonexistent/ca.pem' is not a readable"),
        ("[templates]\ncache_ttl_s = -1\n", "templates.cache_ttl_s must be >= 0"),
        ("[net]\ndns_port = 70000\n", "net.dns_port: 70000 is not a port"),
        ("[net]\ndns_port = 5000\negress_proxy_port = 5000\n", "dns_port and egress_proxy_port must differ"),
        ("[net]\ndns_upstreams = [\"dns.google\"]\n", "net.dns_upstreams: 'dns.google' is not IPV4[:PORT]"),
        ("[net]\ndns_upstreams = [\"1.1.1.1:0\"]\n", "'1.1.1.1:0' is not IPV4[:PORT]"),
        ("[snapshot]\npublish_retry_interval_s = -1\n", "snapshot.publish_retry_interval_s must be >= 0"),
        ("[vmm]\njailer = \"maybe\"\n", "vmm.jailer (from"),
        ("[vmm]\njailer_uid = 0\n", "vmm.jailer_uid: 0 is not an unprivileged id"),
        ("[vmm]\njailer_gid = -1\n", "vmm.jailer_gid: -1 is not an unprivileged id"),
        ("[vmm]\njailer_uid = 4294967295\n", "vmm.jailer_uid: 4294967295 is not an unprivileged id"),
        ("[vmm]\njailer_gid = \"nogroup\"\n", "vmm.jailer_gid (from"),
        ("[vmm]\njailer_chroot_base = \"jail\"\n", "vmm.jailer_chroot_base: 'jail' is not an absolute path"),
        ("[vmm]\njailer = true\njailer_binary = \"/nonexistent/jailer\"\n",
         "vmm.jailer_binary: '/nonexistent/jailer' is not an executable file"),
        ("[vmm]\njailer = true\nkind = \"qemu\"\n", "vmm.jailer: the jailer runs Firecracker only"),
        ("[vmm]\njailer = true\nfirecracker_binary = \"/usr/bin/fc\"\n", "whose file name contains 'firecracker'"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path: Path, text: str, message: str) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        load_config(f, environ={})
    assert "\n" not in str(caught.value), "a config error is one line"


def test_jailer_keys_from_file_and_environment(tmp_path: Path) -> None:
    """Off by default, its chroots in the state directory unless given; every key read from a file or the
    environment (the node hands its configuration to its data plane that way). That they reach the driver and a
    jailed VM runs so: ``tests/vmm/test_jailer.py::test_the_node_runs_firecracker_jailed_from_its_config``."""
    cfg = load_config(environ={"AENV_STATE_DIR": "/srv/aenv"})
    assert cfg.vmm.jailer is False and (cfg.vmm.jailer_uid, cfg.vmm.jailer_gid) == (65534, 65534)
    assert cfg.jailer_chroot_base == Path("/srv/aenv/jailer")
    f = tmp_path / "c.toml"
    f.write_text('[vmm]\njailer = true\njailer_uid = 1234\njailer_chroot_base = "/srv/jail"\n')
    cfg = load_config(f, environ={"AENV_VMM_JAILER_GID": "2345", "AENV_VMM_JAILER_BINARY": "/bin/sh"})
    assert (cfg.vmm.jailer, cfg.vmm.jailer_uid, cfg.vmm.jailer_gid) == (True, 1234, 2345)
    assert cfg.vmm.jailer_binary == "/bin/sh" and cfg.jailer_chroot_base == Path("/srv/jail")
    assert load_config(environ=cfg.as_environment()).vmm == cfg.vmm


def test_bad_env_value_names_the_variable_origin() -> None:
    with pytest.raises(ConfigError, match=r"net\.egress \(from environment\)"):
        load_config(environ={"AENV_NET_EGRESS": "maybe"})


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.toml", environ={})


def test_every_key_is_documented() -> None:
    doc = DOCS.read_text()
    defaults = tomllib.loads(DEFAULT_CONFIG_TEXT)
    missing = [
        f"{section}.{key}"
        for section, values in defaults.items()
        for key in values
        if f"`{section}.{key}`" not in doc
    ]
    assert missing == []
