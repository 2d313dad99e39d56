"""QEMU with KVM (``-cpu host``) running Linux guests on a KVM host (a TCG VM with nested SVM, here): the core
E2B SDK flows. The same node code as under TCG; only the accelerator differs."""

from __future__ import annotations

import pytest
from e2b import Sandbox

from . import flows, vm

pytestmark = [pytest.mark.vm, pytest.mark.slow]
KVMHOST_VMM = "qemu"  # vm.up passes it as the node's vmm.kind (auto would pick Firecracker)


def test_qemu_runs_with_kvm_host_cpu_and_nbd_disks(host: vm.KvmHost) -> None:
    log = host.node_log()
    assert "VMM qemu with kvm" in log, log[-3000:]
    assert "sandbox disks through nbd" in log, log[-3000:]
    sb = Sandbox.create()
    try:  # on a KVM host with a vendor KVM module the guest gets the host's CPU model as it is
        args = host.sh("ps -eo args | grep [q]emu-system")
        assert " -cpu host " in args and "arch-capabilities" not in args, args
    finally:
        sb.kill()


def test_quickstart(host: vm.KvmHost) -> None:
    flows.quickstart()


def test_pause_resume_with_a_running_process(host: vm.KvmHost) -> None:
    flows.pause_resume_with_running_process()


def test_fork_children_diverge(host: vm.KvmHost) -> None:
    flows.fork_diverges()
