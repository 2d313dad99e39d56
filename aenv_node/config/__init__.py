"""The node's configuration: one TOML document, typed, with a clear precedence.

Precedence, lowest first:

1. the embedded default (``aenv_node/config/default.toml``), which works on a
   development machine with no file at all;
2. a TOML file: ``--config FILE``, else ``$AENV_CONFIG``, else
   ``/etc/aenv/config.toml`` when it exists;
3. environment variables ``AENV_<SECTION>_<KEY>`` (``AENV_STATE_DIR`` is the
   short form of ``AENV_NODE_STATE_DIR``);
4. explicit overrides (command-line flags such as ``--state-dir``).

Unknown sections or keys are errors: a typo in a config file must not be
silently ignored. Every key is documented in ``docs/configuration.md`` (a test
keeps the two in step).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

__all__ = [
    "Config",
    "ConfigError",
    "LogsSection",
    "load_config",
    "DEFAULT_CONFIG_TEXT",
    "SYSTEM_CONFIG_PATH",
]

SYSTEM_CONFIG_PATH = Path("/etc/aenv/config.toml")
DEFAULT_CONFIG_TEXT = resources.files(__package__).joinpath("default.toml").read_text()


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type, or unknown."""


@dataclass(frozen=True)
class NodeSection:
    state_dir: Path = Path("/var/lib/aenv")
    node_id: str = ""
    log_level: str = "info"
    shutdown_grace_s: float = 30.0
    data_plane: bool = True
    pause_on_stop: bool = False


@dataclass(frozen=True)
class ApiSection:
    listen: str = "127.0.0.1:8000"
    domain: str = ""
    api_key: str = ""

    @property
    def host(self) -> str:
        return self.listen.rsplit(":", 1)[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rsplit(":", 1)[1])


@dataclass(frozen=True)
class SandboxSection:
    default_template: str = "base"
    default_timeout_s: int = 300
    max_timeout_s: int = 86400
    default_cpu_count: int = 2
    default_memory_mb: int = 512
    default_disk_size_mb: int = 2048
    fork_max_count: int = 20
    ttl_check_interval_s: float = 1.0


@dataclass(frozen=True)
class VmmSection:
    kind: str = "auto"
    accel: str = "auto"
    qemu_binary: str = "qemu-system-x86_64"
    firecracker_binary: str = "/opt/aenv/bin/firecracker"
    tcg_tb_size_mb: int = 64
    tcg_tb_size_restore_mb: int = 16
    ksm: bool = False
    free_page_reporting: bool = True
    cgroups: bool = True
    memory_overhead_mib: int = 512
    pids_max: int = 1024
    jailer: bool = False
    jailer_binary: str = "/opt/aenv/bin/jailer"
    jailer_uid: int = 65534
    jailer_gid: int = 65534
    jailer_chroot_base: str = ""


@dataclass(frozen=True)
class NetSection:
    pool_cidr: str = "10.11.0.0/16"
    warm_slots: int = 2
    egress: bool = True
    dns_port: int = 10053
    egress_proxy_port: int = 10080
    dns_upstreams: tuple[str, ...] = ()
    uplinks: tuple[str, ...] = ()


@dataclass(frozen=True)
class StorageSection:
    repository: str = "posix_fs"
    repository_path: str = ""
    s3_endpoint: str = ""
    s3_bucket: str = ""
    s3_region: str = ""
    s3_prefix: str = "aenv/"
    s3_conditional_writes: str = "auto"
    s3_max_attempts: int = 5
    cache_dir: str = ""
    cache_capacity_bytes: int = 20 * 1024**3
    cache_high_watermark: float = 0.95
    cache_low_watermark: float = 0.70
    repository_gc_interval_s: float = 3600
    repository_gc_grace_s: float = 3600
    block_frontend: str = "auto"
    ublk_queues: int = 2


@dataclass(frozen=True)
class ImagesSection:
    cache_dir: str = ""
    registries: tuple[str, ...] = ("docker.io",)
    insecure_registries: tuple[str, ...] = ()
    pull_concurrency: int = 4
    ca_bundle: str = ""


@dataclass(frozen=True)
class TemplatesSection:
    boot_timeout_s: float = 180.0
    ready_timeout_s: float = 300.0
    max_concurrent_builds: int = 2
    build_default: bool = True
    code_interpreter: bool = True
    cache_ttl_s: float = 604800.0


@dataclass(frozen=True)
class SnapshotSection:
    periodic_interval_s: float = 0
    compact_after_layers: int = 8
    capture_buffer_mib: int = 512
    capture_buffers: int = 1
    gc_interval_s: float = 600
    gc_orphan_grace_s: float = 3600
    gc_patience_s: float = 5
    quiesce: str = "pause"
    publish_retry_interval_s: float = 30


@dataclass(frozen=True)
class LogsSection:
    max_lines_per_sandbox: int = 10_000
    max_line_chars: int = 2048
    retention_s: float = 604800.0
    poll_interval_s: float = 0.5


@dataclass(frozen=True)
class ClusterSection:
    scheduler_url: str = ""
    advertise_url: str = ""
    heartbeat_interval_s: float = 2.0


@dataclass(frozen=True)
class P2pSection:
    enabled: bool = False
    timeout_s: float = 2.0
    max_attempts: int = 2
    max_range_bytes: int = 4 * 1024 * 1024
    max_concurrent_serves: int = 16
    holders_ttl_s: float = 2.0
    announce_max_layers: int = 1000


_CHOICES: dict[tuple[str, str], tuple[str, ...]] = {
    ("vmm", "kind"): ("auto", "qemu", "firecracker"),
    ("vmm", "accel"): ("auto", "kvm", "tcg"),
    ("storage", "repository"): ("posix_fs", "s3"),
    ("storage", "s3_conditional_writes"): ("auto", "true", "false"),
    ("storage", "block_frontend"): ("auto", "nbd", "ublk", "fuse"),
    ("node", "log_level"): ("debug", "info", "warning", "error"),
    ("snapshot", "quiesce"): ("pause", "off"),
}


@dataclass(frozen=True)
class Config:
    node: NodeSection = field(default_factory=NodeSection)
    api: ApiSection = field(default_factory=ApiSection)
    sandbox: SandboxSection = field(default_factory=SandboxSection)
    vmm: VmmSection = field(default_factory=VmmSection)
    net: NetSection = field(default_factory=NetSection)
    storage: StorageSection = field(default_factory=StorageSection)
    snapshot: SnapshotSection = field(default_factory=SnapshotSection)
    images: ImagesSection = field(default_factory=ImagesSection)
    templates: TemplatesSection = field(default_factory=TemplatesSection)
    logs: LogsSection = field(default_factory=LogsSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    p2p: P2pSection = field(default_factory=P2pSection)

    # Derived paths: one place decides the state directory's layout.
    @property
    def state_dir(self) -> Path:
        return self.node.state_dir

    @property
    def database_path(self) -> Path:
        return self.state_dir / "aenv.db"

    @property
    def api_key_path(self) -> Path:
        return self.state_dir / "secrets" / "api-key"

    @property
    def repository_path(self) -> Path:
        return Path(self.storage.repository_path or self.state_dir / "repository")

    @property
    def cache_dir(self) -> Path:
        return Path(self.storage.cache_dir or self.state_dir / "cache")

    @property
    def sandboxes_dir(self) -> Path:
        return self.state_dir / "sandboxes"

    @property
    def images_cache_dir(self) -> Path:
        """Where guest kits and template root filesystems are built and cached by content hash."""
        return Path(self.images.cache_dir or self.state_dir)

    @property
    def layers_dir(self) -> Path:
        """Local layer files (sealed uppers, imported rootfs) before and after commit."""
        return self.state_dir / "layers"

    @property
    def templates_dir(self) -> Path:
        """Snapshot files (vmstate, memory images) of templates and sandboxes."""
        return self.state_dir / "snapshots"

    @property
    def jailer_chroot_base(self) -> Path:
        """Where the jailer makes each Firecracker's chroot: by default in the state directory, on the filesystem
        of the snapshots (a jailed capture is renamed out of its chroot, and inputs are hard-linked in)."""
        return Path(self.vmm.jailer_chroot_base or self.state_dir / "jailer")

    @property
    def run_dir(self) -> Path:
        """Short-lived sockets (NBD, VMM API). Unix socket paths are limited to 107 bytes, so this
        lives under /run, keyed by a hash of the state directory (several nodes per host)."""
        import hashlib

        tag = hashlib.sha256(str(self.state_dir.resolve()).encode()).hexdigest()[:8]
        return Path("/run/aenv") / tag

    def as_toml_dict(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for sec in dataclasses.fields(self):
            values = dataclasses.asdict(getattr(self, sec.name))
            out[sec.name] = {k: (str(v) if isinstance(v, Path) else v) for k, v in values.items()}
        return out

    def as_environment(self) -> dict[str, str]:
        """Every key as the ``AENV_<SECTION>_<KEY>`` variable that sets it: a process started with these reads
        exactly this configuration (the node hands its own to the data plane it starts)."""
        out: dict[str, str] = {}
        for sec_name, values in self.as_toml_dict().items():
            for key, value in values.items():
                if isinstance(value, bool):
                    text = "true" if value else "false"
                elif isinstance(value, (tuple, list)):
                    text = ",".join(value)
                else:
                    text = str(value)
                out[f"AENV_{sec_name.upper()}_{key.upper()}"] = text
        return out


def _section_types() -> dict[str, type]:
    out: dict[str, type] = {}
    for f in dataclasses.fields(Config):
        if not isinstance(f.default_factory, type):  # every section is a dataclass field with default_factory
            raise TypeError(f"config section {f.name} has no section class as its default_factory")
        out[f.name] = f.default_factory
    return out


def _coerce(section: str, key: str, ftype: Any, value: Any, origin: str) -> Any:
    where = f"{section}.{key} (from {origin})"
    try:
        if ftype in (bool, "bool"):
            if isinstance(value, bool):
                out: Any = value
            elif isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
                out = True
            elif isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
                out = False
            else:
                raise ValueError(f"expected a boolean, got {value!r}")
        elif ftype in (int, "int"):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(f"expected an integer, got {value!r}")
            out = int(value)
        elif ftype in (float, "float"):
            if isinstance(value, bool):
                raise ValueError(f"expected a number, got {value!r}")
            out = float(value)
        elif ftype in (Path, "Path"):
            if not isinstance(value, (str, Path)) or not str(value):
                raise ValueError(f"expected a path, got {value!r}")
            out = Path(value)
        elif ftype in (tuple[str, ...], "tuple[str, ...]"):
            # a TOML array of strings, or (from the environment) one comma-separated string
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
                raise ValueError(f"expected a list of strings, got {value!r}")
            out = tuple(i.strip() for i in items if i.strip())
        else:
            if not isinstance(value, str):
                raise ValueError(f"expected a string, got {value!r}")
            out = value
    except ValueError as exc:
        raise ConfigError(f"config {where}: {exc}") from None
    choices = _CHOICES.get((section, key))
    if choices and out not in choices:
        raise ConfigError(f"config {where}: {out!r} is not one of {', '.join(choices)}")
    return out


def _merge(
    values: dict[str, dict[str, Any]], doc: Mapping[str, Any], origin: str
) -> None:
    sections = _section_types()
    for sec_name, sec_values in doc.items():
        if sec_name not in sections:
            raise ConfigError(f"config {origin}: unknown section [{sec_name}]")
        if not isinstance(sec_values, Mapping):
            raise ConfigError(f"config {origin}: [{sec_name}] must be a table")
        ftypes = {f.name: f.type for f in dataclasses.fields(sections[sec_name])}
        for key, value in sec_values.items():
            if key not in ftypes:
                raise ConfigError(f"config {origin}: unknown key {sec_name}.{key}")
            values[sec_name][key] = _coerce(sec_name, key, ftypes[key], value, origin)


def _env_doc(environ: Mapping[str, str]) -> dict[str, dict[str, str]]:
    doc: dict[str, dict[str, str]] = {}
    sections = _section_types()
    if environ.get("AENV_STATE_DIR"):
        doc.setdefault("node", {})["state_dir"] = environ["AENV_STATE_DIR"]
    for sec_name, sec_type in sections.items():
        for f in dataclasses.fields(sec_type):
            var = f"AENV_{sec_name.upper()}_{f.name.upper()}"
            if var in environ:
                doc.setdefault(sec_name, {})[f.name] = environ[var]
    return doc


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Build the effective configuration (see the module docstring for precedence)."""
    environ = os.environ if environ is None else environ
    values: dict[str, dict[str, Any]] = {name: {} for name in _section_types()}
    _merge(values, tomllib.loads(DEFAULT_CONFIG_TEXT), "embedded default")

    file_path: Path | None = None
    if path is not None:
        file_path = Path(path)
    elif environ.get("AENV_CONFIG"):
        file_path = Path(environ["AENV_CONFIG"])
    elif SYSTEM_CONFIG_PATH.exists():
        file_path = SYSTEM_CONFIG_PATH
    if file_path is not None:
        try:
            text = file_path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config file {file_path}: {exc.strerror}") from None
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file_path} is not valid TOML: {exc}") from None
        _merge(values, doc, str(file_path))

    _merge(values, _env_doc(environ), "environment")
    if overrides:
        _merge(values, {k: dict(v) for k, v in overrides.items() if v}, "command line")

    sections = _section_types()
    cfg = Config(**{name: sections[name](**vals) for name, vals in values.items()})
    _validate(cfg)
    return cfg


def _validate(cfg: Config) -> None:
    try:
        if not 0 < cfg.api.port < 65536:
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(f"config api.listen: {cfg.api.listen!r} is not HOST:PORT") from None
    st = cfg.storage
    if not 0 < st.cache_low_watermark < st.cache_high_watermark <= 1:
        raise ConfigError(
            "config storage: need 0 < cache_low_watermark < cache_high_watermark <= 1"
        )
    if st.repository == "s3" and not (st.s3_endpoint and st.s3_bucket and st.s3_region):
        raise ConfigError(
            "config storage: repository = \"s3\" needs s3_endpoint, s3_bucket and s3_region"
        )
    if st.repository_gc_interval_s < 0 or st.repository_gc_grace_s < 0:
        raise ConfigError("config storage: repository_gc_interval_s and repository_gc_grace_s must be >= 0 "
                          "(interval 0 turns the repository collection off)")
    if cfg.sandbox.default_timeout_s > cfg.sandbox.max_timeout_s:
        raise ConfigError("config sandbox: default_timeout_s exceeds max_timeout_s")
    if cfg.images.ca_bundle and not os.access(cfg.images.ca_bundle, os.R_OK):
        raise ConfigError(f"config images.ca_bundle: {cfg.images.ca_bundle!r} is not a readable file")
    if cfg.templates.cache_ttl_s < 0:
        raise ConfigError("config templates.cache_ttl_s must be >= 0")
    lg = cfg.logs
    if lg.max_lines_per_sandbox < 1 or lg.max_line_chars < 80 or lg.retention_s < 0 or lg.poll_interval_s <= 0:
        raise ConfigError("config logs: need max_lines_per_sandbox >= 1, max_line_chars >= 80, retention_s >= 0 "
                          "and poll_interval_s > 0")
    if cfg.storage.s3_max_attempts < 1:
        raise ConfigError("config storage.s3_max_attempts must be >= 1")
    if cfg.snapshot.publish_retry_interval_s < 0:
        raise ConfigError("config snapshot.publish_retry_interval_s must be >= 0")
    if cfg.snapshot.capture_buffer_mib < 0 or cfg.snapshot.capture_buffers < 0:
        raise ConfigError("config snapshot: capture_buffer_mib and capture_buffers must be >= 0")
    net = cfg.net
    for key, port in (("dns_port", net.dns_port), ("egress_proxy_port", net.egress_proxy_port)):
        if not 0 <= port < 65536:
            raise ConfigError(f"config net.{key}: {port} is not a port (1-65535, or 0 for none)")
    if net.dns_port and net.dns_port == net.egress_proxy_port:
        raise ConfigError("config net: dns_port and egress_proxy_port must differ")
    for upstream in net.dns_upstreams:
        host, _, port_text = upstream.partition(":")
        try:
            ipaddress.IPv4Address(host)
            if port_text and not 0 < int(port_text) < 65536:
                raise ValueError
        except ValueError:
            raise ConfigError(f"config net.dns_upstreams: {upstream!r} is not IPV4[:PORT]") from None
    _validate_jailer(cfg.vmm)
    _validate_cluster(cfg.cluster)
    _validate_p2p(cfg.p2p, cfg.cluster)


def _validate_p2p(p: P2pSection, cl: ClusterSection) -> None:
    if p.enabled and not cl.scheduler_url:
        raise ConfigError("config p2p.enabled: peers are found through the scheduler; set cluster.scheduler_url")
    if p.timeout_s <= 0 or p.holders_ttl_s < 0:
        raise ConfigError("config p2p: need timeout_s > 0 and holders_ttl_s >= 0")
    if p.max_attempts < 1 or p.max_concurrent_serves < 1 or not 1 <= p.announce_max_layers <= 10_000:
        raise ConfigError("config p2p: need max_attempts >= 1, max_concurrent_serves >= 1 and "
                          "1 <= announce_max_layers <= 10000")
    if p.max_range_bytes < 256 * 1024 or p.max_range_bytes % 4096:
        raise ConfigError("config p2p.max_range_bytes must be a multiple of 4096 and at least 262144 (a chunk)")


def _validate_cluster(cl: ClusterSection) -> None:
    for key in ("scheduler_url", "advertise_url"):
        url = getattr(cl, key)
        if url and not (url.startswith(("http://", "https://")) and len(url.split("://", 1)[1].strip("/")) > 0):
            raise ConfigError(f"config cluster.{key}: {url!r} is not an http:// or https:// URL")
    if cl.heartbeat_interval_s <= 0:
        raise ConfigError("config cluster.heartbeat_interval_s must be > 0")


def _validate_jailer(vm: VmmSection) -> None:
    for key in ("jailer_uid", "jailer_gid"):
        value = getattr(vm, key)
        if not 0 < value < 2**32 - 1:
            raise ConfigError(f"config vmm.{key}: {value} is not an unprivileged id (1 to 4294967294; 0 would leave "
                              "Firecracker root in its jail)")
    if vm.jailer_chroot_base and not Path(vm.jailer_chroot_base).is_absolute():
        raise ConfigError(f"config vmm.jailer_chroot_base: {vm.jailer_chroot_base!r} is not an absolute path")
    if not vm.jailer:
        return
    if vm.kind == "qemu":
        raise ConfigError("config vmm.jailer: the jailer runs Firecracker only, and vmm.kind is qemu")
    if not (os.path.isfile(vm.jailer_binary) and os.access(vm.jailer_binary, os.X_OK)):
        raise ConfigError(f"config vmm.jailer_binary: {vm.jailer_binary!r} is not an executable file "
                          "(scripts/setup.d/30-firecracker.sh installs it)")
    if "firecracker" not in Path(vm.firecracker_binary).name:
        raise ConfigError(f"config vmm.firecracker_binary: {vm.firecracker_binary!r}: the jailer runs only a binary "
                          "whose file name contains 'firecracker'")
