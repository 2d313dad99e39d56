"""The ``kvmhost`` fixtures: one KVM host VM (vm.py) for the package, its node ready to serve.

A test module sets ``KVMHOST_VMM`` (the node's ``vmm.kind`` inside) and asks for ``host``; a module with another
kind than the previous one's restarts the node inside with it (``KvmHost.switch_vmm``) instead of a new VM."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from . import vm


def _wait_base(host: vm.KvmHost, timeout_s: float = 900) -> None:
    """Until the node's ``base`` is ready, built by the VMM it runs now (after a ``switch_vmm`` the old one's
    build is ready until the node has seen it needs another)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=host.url, headers={"X-API-KEY": host.api_key}, timeout=30) as c:
        while time.monotonic() < deadline:
            try:
                r = c.get("/templates/base")
            except httpx.HTTPError as e:
                if not host.alive() or "KVMHOST-NODE-EXITED" in host.node_log():
                    raise AssertionError(f"the KVM host's node went away ({e}):\n{host.node_log()[-4000:]}") from e
                time.sleep(2)  # a slow answer under double emulation: ask again
                continue
            if r.status_code == 200 and r.json()["buildStatus"] == "ready" and _base_vmm(host) == host.vmm:
                return
            if r.status_code == 200 and r.json()["buildStatus"] == "error":
                raise AssertionError(f"base template build failed in the KVM host:\n{host.node_log()[-4000:]}")
            time.sleep(2)
    raise AssertionError(f"base template not ready in the KVM host after {timeout_s:.0f} s:\n"
                         f"{host.node_log()[-4000:]}")


def _base_vmm(host: vm.KvmHost) -> str:
    """The VMM of the node's ``base`` boot snapshot, as ``vmm.kind`` names it (``auto`` picks Firecracker on a
    KVM host)."""
    rows = host.sql("SELECT s.vmm FROM templates t JOIN snapshots s ON s.id = t.boot_snapshot_id "
                    "WHERE t.id = 'base'")
    vmm = rows[0]["vmm"] if rows else ""
    return "auto" if vmm == "firecracker" and host.vmm == "auto" else vmm


#: Run when named (`scripts/dev test tests/kvmhost`, or AENV_TEST_SERIAL=1 for the whole suite in one pytest): one VM
#: for the package, 30-40 minutes on a 2-core machine, more than CI's budget leaves beside the rest. The nested VM's
#: failures in earlier full-suite runs were a kernel oops in the VM under multi-threaded TCG (vm.up's docstring);
#: with one vCPU they have not recurred. AENV_KVMHOST_TESTS=0 skips them even when named.
SKIP = os.environ.get("AENV_KVMHOST_TESTS") == "0"


def bring_up(vmm_kind: str) -> Iterator[vm.KvmHost]:
    if SKIP:
        pytest.skip("KVM host VM tests skipped: AENV_KVMHOST_TESTS=0")
    if shutil.which("qemu-system-x86_64") is None or shutil.which("debootstrap") is None:
        pytest.skip("qemu-system-x86_64 and debootstrap are needed for the KVM host VM (scripts/setup.sh)")
    run_dir = Path(tempfile.mkdtemp(prefix="aenv-kvmhost-", dir="/var/tmp"))
    try:
        # shell: tests inspect the node's SQLite and act on the host inside (127.0.0.1 only, like the API)
        host = vm.up(run_dir, vmm=vmm_kind, shell=True, progress=lambda m: print(f"kvmhost: {m}", flush=True))
        yield host
    finally:
        vm.down(run_dir)
        try:  # for post-mortems: the run directory goes away
            shutil.copy(run_dir / "console.log", Path("/var/tmp") / "aenv-kvmhost-last-console.log")
        except OSError:
            pass
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="package")
def kvm_vm() -> Iterator[vm.KvmHost]:
    """One KVM host VM for every module of this package (it takes minutes to come up), gone after the last;
    its node starts with ``vmm.kind = auto`` (Firecracker), what the first module (test_firecracker) asks."""
    yield from bring_up("auto")


@pytest.fixture(scope="module")
def kvm_host(kvm_vm: vm.KvmHost, request: pytest.FixtureRequest) -> vm.KvmHost:
    """The KVM host VM, its node's ``vmm.kind`` the module's ``KVMHOST_VMM`` (the node restarted inside with it
    if the previous module ran another) and its ``base`` built by that VMM."""
    vmm_kind = getattr(request.module, "KVMHOST_VMM", None)
    if vmm_kind is None:
        raise AssertionError(f"{request.module.__name__} uses the kvm_host fixture but sets no KVMHOST_VMM")
    if kvm_vm.vmm != vmm_kind:
        kvm_vm.switch_vmm(vmm_kind)
    _wait_base(kvm_vm)
    return kvm_vm


@pytest.fixture
def host(kvm_host: vm.KvmHost, monkeypatch: pytest.MonkeyPatch) -> vm.KvmHost:
    """The module's KVM host, the unmodified E2B SDK pointed at its node the way a user would (environment
    variables)."""
    for k, v in kvm_host.env().items():
        monkeypatch.setenv(k, v)
    return kvm_host
