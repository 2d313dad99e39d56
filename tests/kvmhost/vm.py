"""Start, find and stop the KVM host VM (QEMU TCG, ``-cpu max`` so the guest sees SVM and runs KVM).

One VM per run directory (default ``/var/tmp/aenv-kvmhost``, ``AENV_KVMHOST_DIR``), described by its
``state.json``: QEMU's pid, the node's API URL on this host, the API key.  Its disks:

* ``/dev/vda``: a qcow2 overlay over the cached image (``image.py``), so the image stays pristine;
* ``/dev/vdb``: the node's state and images cache, made fresh at each ``up`` and seeded with this host's guest
  kit and base rootfs (same code, same content hashes, so the node inside finds them and builds nothing) and
  this host's apt package lists (the kit's hash covers package versions, which the node resolves offline);
* ``/dev/vdc``: the project's code (``aenv_node/``, ``migrations/``) from the working tree, read-only.

The node inside listens on 10.0.2.15:8000, forwarded from 127.0.0.1:<port> here by QEMU's user-mode network
with ``restrict=on``: the VM reaches nothing off this machine, and only that one port reaches it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from aenv_node.images import KitSpec, ensure_base_rootfs, ensure_kit

from ..conftest import free_port
from . import image as kvmimage

Progress = Callable[[str], None]
DEFAULT_RUN_DIR = Path(os.environ.get("AENV_KVMHOST_DIR", "/var/tmp/aenv-kvmhost"))
DEFAULT_CACHE = Path(os.environ.get("AENV_IMAGES_CACHE_DIR", os.environ.get("AENV_STATE_DIR", "/var/lib/aenv")))
GUEST_IP = "10.0.2.15"
NODE_PORT = 8000


@dataclass
class KvmHost:
    run_dir: str
    pid: int
    url: str
    api_key: str
    console: str
    qmp: str
    mem_mib: int
    vcpus: int
    vmm: str
    shell_port: int = 0

    def sh(self, command: str, timeout_s: float = 60) -> str:
        """Run ``command`` in the VM as root (only when it was started with ``shell=True``); its output."""
        if not self.shell_port:
            raise RuntimeError("the KVM host VM was started without its debug shell (up --shell)")
        for attempt in range(20):
            chunks: list[bytes] = []
            try:
                with socket.create_connection(("127.0.0.1", self.shell_port), timeout=timeout_s) as s:
                    s.sendall(f"{command}\nexit\n".encode())
                    while data := s.recv(65536):
                        chunks.append(data)
                return b"".join(chunks).decode(errors="replace")
            except ConnectionResetError:
                # the shell inside listens again a moment after each connection ends; QEMU accepted this one
                # here and then found no listener inside (nothing ran): try again
                if chunks or attempt == 19:
                    raise
                time.sleep(0.5)
        raise AssertionError("unreachable")

    def sql(self, query: str) -> list[dict[str, Any]]:
        """The rows of ``query`` (no double quotes in it) against the node's SQLite inside, through ``sh``."""
        out = self.sh(f'sqlite3 -json /var/lib/aenv/aenv.db "{query}"')
        start = out.find("[")  # sqlite3 prints nothing for no rows
        return list(json.loads(out[start:out.rindex("]") + 1])) if start >= 0 else []

    @classmethod
    def load(cls, run_dir: Path) -> KvmHost | None:
        try:
            return cls(**json.loads((run_dir / "state.json").read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        cmdline = Path(f"/proc/{self.pid}/cmdline")
        try:  # the pid is ours only if it is still the QEMU we started (pids are reused)
            return self.run_dir.encode() in cmdline.read_bytes()
        except OSError:
            return False

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def env(self) -> dict[str, str]:
        """What the E2B SDKs and the ``aenv`` CLI on this host need to reach the node inside."""
        return {"E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url, "E2B_API_KEY": self.api_key,
                "E2B_DOMAIN": "kvmhost.local", "AENV_URL": self.url, "AENV_API_KEY": self.api_key}

    def node_log(self) -> str:
        """The VM's console: boot messages, then the node's log lines (prefixed ``node: ``)."""
        return Path(self.console).read_text(errors="replace") if Path(self.console).exists() else ""

    def restart_node(self, signal_name: str = "TERM", *, data_plane: bool = False, timeout_s: float = 300) -> None:
        """Send the node inside SIG``signal_name`` and wait for the init loop (guest_init.sh) to start it again
        on the same state (the VM stays up: it took minutes to come up). ``data_plane``: stop the data plane in
        between too (its sandboxes end), so the next node starts one with its own config."""
        restarts = self.node_log().count("KVMHOST-NODE-RESTART")
        marker = "dataplane" if data_plane else ""
        self.sh(f"echo '{marker}' > /var/lib/aenv/restart && kill -{signal_name} $(cat /run/kvmhost-node.pid)")
        deadline = time.monotonic() + timeout_s
        while self.node_log().count("KVMHOST-NODE-RESTART") == restarts or not self.healthy():
            if not self.alive() or time.monotonic() > deadline:
                raise AssertionError(f"the node in the KVM host did not come back:\n{self.node_log()[-4000:]}")
            time.sleep(1)

    def switch_vmm(self, vmm: str) -> None:
        """Restart the node inside with ``vmm.kind = vmm`` and a new data plane (no sandbox may be running); its
        ``base`` is then rebuilt for the new VMM (``base_template_current`` compares the VMM)."""
        self.sh(f"sed -i 's/^kind = .*/kind = \"{vmm}\"/' /var/lib/aenv/config.toml")
        self.restart_node(data_plane=True)
        self.vmm = vmm
        (Path(self.run_dir) / "state.json").write_text(json.dumps(asdict(self), indent=1))

    def dataplane_log(self) -> str:
        """The log of the node's data plane (a file in the VM: it is not on the console)."""
        return self.sh("tail -c 4000 /var/lib/aenv/logs/dataplane.log 2>&1")


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _node_config(api_key: str, vmm: str, log_level: str) -> str:
    return f"""# the node inside the KVM host VM (written by tests/kvmhost/vm.py)
[node]
state_dir = "/var/lib/aenv"
log_level = "{log_level}"
shutdown_grace_s = 10.0
[api]
listen = "{GUEST_IP}:{NODE_PORT}"
api_key = "{api_key}"
[vmm]
kind = "{vmm}"
[sandbox]
# the VM has one vCPU: a nested guest with two spent its boot in soft lockups, one vCPU waiting on the other
# (a QEMU+KVM base build hung twice for 180 s in a CI run)
default_cpu_count = 1
[net]
egress = false
warm_slots = 1
[templates]
code_interpreter = false  # its wheels come from PyPI: this VM reaches nothing
"""


def _seed(seed: Path, cache_dir: Path, api_key: str, vmm: str, log_level: str, say: Progress) -> None:
    say("guest kit and base rootfs for the sandboxes inside (built here if missing)")
    kit = ensure_kit(cache_dir, progress=say)
    for f in kit.root.iterdir():
        _link_or_copy(f, seed / "kit" / kit.hash / f.name)
    base = ensure_base_rootfs(cache_dir, progress=say)
    _link_or_copy(base, seed / "rootfs" / base.name)
    # the host's import of that rootfs as a layer, when it made one (storage.import_raw_cached): the node inside
    # links it instead of reading the 4 GiB image again under double emulation (91 s of a CI run's bring-up)
    for made in (base.parent / "imported").glob(base.name + ".*"):
        if made.suffix in (".layer", ".json"):
            _link_or_copy(made, seed / "rootfs" / "imported" / made.name)
    lists = seed / "apt/lists"
    lists.mkdir(parents=True)
    for f in Path("/var/lib/apt/lists").iterdir():
        if f.is_file() and f.name != "lock":
            shutil.copy2(f, lists / f.name)
    etc = seed / "apt/etc"
    etc.mkdir()
    for name in ("sources.list", "sources.list.d", "preferences.d", "trusted.gpg.d"):
        src = Path("/etc/apt") / name
        if src.is_dir():
            shutil.copytree(src, etc / name)
        elif src.is_file():
            shutil.copy2(src, etc / name)
    (seed / "config.toml").write_text(_node_config(api_key, vmm, log_level))


def _project_tree(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("aenv_node", "migrations"):
        shutil.copytree(kvmimage.REPO / name, dest / name, ignore=ignore)
    shutil.copy(Path(__file__).with_name("guest_init.sh"), dest / "kvmhost-init.sh")
    shutil.copy(Path(__file__).with_name("raw_ops.py"), dest / "raw_ops.py")  # bench/kvmhost.py runs it inside
    shutil.copy(kvmimage.REPO / "bench" / "_floor.py", dest / "_floor.py")  # raw_ops.py qemu uses it
    shutil.copy(Path(__file__).with_name("ublk_stop.py"), dest / "ublk_stop.py")  # test_firecracker.py runs it


def _mkfs(image: Path, tree: Path, size_mib: int, label: str) -> None:
    with image.open("wb") as f:
        f.truncate(size_mib << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", label, "-b", "4096", "-d", str(tree), str(image)], check=True)


def up(run_dir: Path = DEFAULT_RUN_DIR, *, cache_dir: Path = DEFAULT_CACHE, mem_mib: int = 6144, vcpus: int = 1,
       vmm: str = "auto", port: int | None = None, shell: bool = False, timeout_s: float = 900,
       log_level: str = "info", progress: Progress | None = None) -> KvmHost:
    """Bring the KVM host up (or return the one already running in ``run_dir``) and wait for its node.

    One vCPU by default: with two, the VM's kernel oopsed on an ``int3`` inside KVM's own code
    (``apic_has_pending_timer``) in about one boot of four, as a nested VM's start flipped one of KVM's static keys:
    live text patching through int3 while the other vCPU ran that code, which multi-threaded TCG (QEMU 7.2)
    does not keep coherent. That panic is what earlier showed as "the node went away" mid-test. With one vCPU
    (and so one TCG thread) it has not happened; the nested guests still get their 2 vCPUs, time-shared.
    Single-threaded TCG with two vCPUs avoids it too but made the nested guests too slow to boot."""
    say = progress or (lambda _m: None)
    current = KvmHost.load(run_dir)
    if current is not None and current.alive():
        say(f"already up (pid {current.pid})")
        return current
    down(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    root_image = kvmimage.ensure_image(cache_dir, progress=say)
    boot_kit = ensure_kit(cache_dir / "kvmhost", KitSpec(kernel_package=kvmimage.kernel_package(
        kvmimage.KvmHostSpec())), progress=say)
    api_key = "e2b_" + secrets.token_hex(20)
    t0 = time.monotonic()
    seed = run_dir / "seed"
    shutil.rmtree(seed, ignore_errors=True)
    _seed(seed, cache_dir, api_key, vmm, log_level, say)
    _mkfs(run_dir / "data.ext4", seed, 32768, "aenv-data")
    shutil.rmtree(seed)
    src = run_dir / "src"
    shutil.rmtree(src, ignore_errors=True)
    _project_tree(src)
    _mkfs(run_dir / "project.ext4", src, 512, "aenv-src")
    shutil.rmtree(src)
    overlay = run_dir / "root.qcow2"
    overlay.unlink(missing_ok=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(root_image), str(overlay)],
                   check=True)
    say(f"drives ready in {time.monotonic() - t0:.1f} s")
    port = port or free_port()
    shell_port = free_port() if shell else 0
    fwd = f"hostfwd=tcp:127.0.0.1:{port}-{GUEST_IP}:{NODE_PORT}"
    if shell:
        fwd += f",hostfwd=tcp:127.0.0.1:{shell_port}-{GUEST_IP}:2222"
    console, qmp = run_dir / "console.log", run_dir / "qmp.sock"
    console.unlink(missing_ok=True)
    cmdline = ("console=ttyS0 panic=-1 root=/dev/vda rw aenv.tools=none aenv.init=image "
               f"aenv.image_init=/sbin/aenv-kvmhost-init aenv.ip={GUEST_IP}/24 aenv.gw=10.0.2.2 "
               # TCG on a busy host: TSC calibration against the PIT can fail and hang the 6.12 boot
               "tsc_early_khz=2000000 lpj=4000000 no_timer_check" + (" kvmhost.shell=1" if shell else ""))
    argv = [
        "qemu-system-x86_64", "-name", f"aenv-kvmhost,process=aenv-kvmhost:{run_dir}",
        "-M", "microvm,pit=on,pic=on,rtc=on", "-cpu", "max", "-m", str(mem_mib), "-smp", str(vcpus),
        "-accel", "tcg,thread=multi,tb-size=512",
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        "-serial", f"file:{console}", "-qmp", f"unix:{qmp},server=on,wait=off",
        "-kernel", str(boot_kit.vmlinuz), "-initrd", str(boot_kit.initramfs), "-append", cmdline,
        "-drive", f"id=vd0,file={overlay},format=qcow2,if=none,cache=unsafe,discard=unmap",
        "-device", "virtio-blk-device,drive=vd0",
        "-drive", f"id=vd1,file={run_dir / 'data.ext4'},format=raw,if=none,cache=unsafe,discard=unmap",
        "-device", "virtio-blk-device,drive=vd1",
        "-drive", f"id=vd2,file={run_dir / 'project.ext4'},format=raw,if=none,readonly=on",
        "-device", "virtio-blk-device,drive=vd2",
        "-netdev", f"user,id=n0,restrict=on,{fwd}",
        "-device", "virtio-net-device,netdev=n0",
        "-device", "virtio-rng-device",
    ]  # fmt: skip
    with open(run_dir / "qemu.stderr", "wb") as err:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True)
    host = KvmHost(run_dir=str(run_dir), pid=proc.pid, url=f"http://127.0.0.1:{port}", api_key=api_key,
                   console=str(console), qmp=str(qmp), mem_mib=mem_mib, vcpus=vcpus, vmm=vmm, shell_port=shell_port)
    (run_dir / "state.json").write_text(json.dumps(asdict(host), indent=1))
    say(f"QEMU pid {proc.pid}: booting (console: {console})")
    deadline = time.monotonic() + timeout_s
    while not host.healthy():
        if proc.poll() is not None or "KVMHOST-NODE-EXITED" in host.node_log():
            tail = host.node_log()[-4000:] or (run_dir / "qemu.stderr").read_text(errors="replace")[-2000:]
            down(run_dir)
            raise RuntimeError(f"the KVM host VM stopped before its node answered:\n{tail}")
        if time.monotonic() > deadline:
            tail = host.node_log()[-4000:]
            down(run_dir)
            raise RuntimeError(f"the node in the KVM host VM did not answer within {timeout_s:.0f} s:\n{tail}")
        time.sleep(1)
    say(f"node up in {time.monotonic() - t0:.0f} s at {host.url}")
    return host


def down(run_dir: Path = DEFAULT_RUN_DIR, *, grace_s: float = 20) -> bool:
    """Stop the VM started in ``run_dir`` (by its pid, only if it is still that QEMU) and remove its drives."""
    host = KvmHost.load(run_dir)
    stopped = False
    if host is not None and host.alive():
        os.kill(host.pid, signal.SIGTERM)  # QEMU exits on SIGTERM; the drives are scratch, made again by `up`
        deadline = time.monotonic() + grace_s
        while host.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if host.alive():
            os.kill(host.pid, signal.SIGKILL)
        stopped = True
    for name in ("root.qcow2", "data.ext4", "project.ext4", "qmp.sock", "state.json"):
        (run_dir / name).unlink(missing_ok=True)
    for name in ("seed", "src"):
        shutil.rmtree(run_dir / name, ignore_errors=True)
    return stopped
