"""Boot the guest kit with the base rootfs under QEMU TCG and drive envd from the host.

One VM per module (booting under emulation takes tens of seconds): its NIC is a tap in a network namespace
the test creates (gateway 169.254.0.22), and the client runs inside that namespace. The tests run in file
order; the last one powers the guest off through its init.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv_node.images import ENVD_READY_MARKER, ensure_base_rootfs, ensure_kit

from .guestvm import GuestVM

pytestmark = [pytest.mark.vm, pytest.mark.slow]


def _skip_unless_possible() -> None:
    if shutil.which("qemu-system-x86_64") is None or shutil.which("qemu-img") is None:
        pytest.skip("QEMU is not installed (apt: qemu-system-x86 qemu-utils)")
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces, tap devices, debootstrap)")
    if not Path("/dev/net/tun").exists():
        pytest.skip("/dev/net/tun is missing")


@pytest.fixture(scope="module")
def images() -> tuple:
    _skip_unless_possible()
    state = Path(os.environ.get("AENV_STATE_DIR", "/var/lib/aenv"))
    return ensure_kit(state), ensure_base_rootfs(state)


@pytest.fixture(scope="module")
def vm(images: tuple, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GuestVM]:
    kit, rootfs = images
    before = (rootfs.stat().st_size, rootfs.stat().st_mtime_ns)
    with GuestVM(kit, rootfs, tmp_path_factory.mktemp("guestvm")) as guest:
        guest.boot_seconds = guest.wait_console()
        yield guest
    assert (rootfs.stat().st_size, rootfs.stat().st_mtime_ns) == before, "the cached rootfs was written to"
    netns = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    assert guest.netns not in netns


def test_envd_answers_health_over_the_tap(vm: GuestVM) -> None:
    (health,) = vm.envd({"op": "health", "wait": 60})
    assert health["status"] in (200, 204), health
    print(f"boot to {ENVD_READY_MARKER!r}: {vm.boot_seconds:.1f} s")


def test_run_commands_as_user_and_root(vm: GuestVM) -> None:
    user, root, net, mounts = vm.envd(
        {"op": "run", "cmd": "echo hello from $(id -un) in $HOME; uname -r"},
        {"op": "run", "cmd": "id -u; hostname", "user": "root"},
        {"op": "run", "cmd": "ip -4 -o addr show dev eth0; ip route show default"},
        {"op": "run", "cmd": "grep -E ' (/|/opt/aenv) ' /proc/mounts; echo $PATH; exit 3"},
    )
    assert user["exit_code"] == 0, user
    assert user["stdout"].startswith("hello from user in /home/user\n"), user
    assert user["stdout"].split("\n")[1] == vm.kit.kernel_version
    assert root["stdout"].split() == ["0", "sandbox"], root
    assert "169.254.0.21/30" in net["stdout"] and "default via 169.254.0.22" in net["stdout"], net
    assert mounts["exit_code"] == 3
    lines = mounts["stdout"].splitlines()
    assert any(ln.startswith("/dev/vda / ext4 rw") for ln in lines), lines
    assert any(ln.startswith("/dev/vdb /opt/aenv ext4 ro") for ln in lines), lines
    assert "/opt/aenv" not in lines[-1], "envd's children must not inherit the tools drive on PATH"


def test_files_write_and_read(vm: GuestVM) -> None:
    text = "line one\nzwei ✓\n" * 100
    wrote, read, stat = vm.envd(
        {"op": "write", "path": "/home/user/notes/hello.txt", "data": text},
        {"op": "read", "path": "/home/user/notes/hello.txt"},
        {"op": "run", "cmd": "stat -c '%U %s' /home/user/notes/hello.txt; sha256sum < /home/user/notes/hello.txt"},
    )
    assert wrote["status"] == 200, wrote
    assert wrote["body"][0]["path"] == "/home/user/notes/hello.txt"
    assert read == {"status": 200, "data": text}
    import hashlib

    owner_size, digest = stat["stdout"].splitlines()
    assert owner_size == f"user {len(text.encode())}"
    assert digest.split()[0] == hashlib.sha256(text.encode()).hexdigest()


def test_init_reaps_orphans(vm: GuestVM) -> None:
    # The shell exits at once, orphaning its background children: they become PID 1's to reap.
    (spawn,) = vm.envd({"op": "run", "cmd": "for i in 1 2 3 4 5; do (sleep 0.2 &); done; exit 0"})
    assert spawn["exit_code"] == 0
    time.sleep(3)
    (ps,) = vm.envd({"op": "run", "cmd": "ps -eo pid,ppid,stat,comm --no-headers"})
    zombies = [ln for ln in ps["stdout"].splitlines() if ln.split()[2].startswith("Z")]
    assert zombies == [], ps["stdout"]
    assert "sleep" not in ps["stdout"]


def test_guest_powers_off_cleanly_on_sigterm_to_init(vm: GuestVM) -> None:
    vm.envd({"op": "run", "cmd": "kill -TERM 1", "user": "root", "ignore_errors": True})
    assert vm.proc is not None
    assert vm.proc.wait(timeout=120) == 0, vm.console_text()[-3000:]
    assert "aenv: shutting down" in vm.console_text()
