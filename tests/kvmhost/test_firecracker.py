"""The production path: Firecracker running Linux guests on a KVM host (a TCG VM with nested SVM, here), driven
by the unmodified E2B SDK from this machine. One VM for the whole module (it takes minutes to come up)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from . import flows, vm
from .conftest import bring_up

pytestmark = [pytest.mark.vm, pytest.mark.slow]


@pytest.fixture(scope="module")
def fc_host() -> Iterator[vm.KvmHost]:
    yield from bring_up("auto")  # auto must pick Firecracker on a KVM host


@pytest.fixture
def host(fc_host: vm.KvmHost, use_host) -> vm.KvmHost:  # type: ignore[no-untyped-def]
    return use_host(fc_host)


def test_auto_picks_firecracker_with_kvm_and_ublk_disks(host: vm.KvmHost) -> None:
    log = host.node_log()
    assert "VMM firecracker with kvm" in log, log[-3000:]
    assert "sandbox disks through ublk" in log, log[-3000:]


def test_quickstart(host: vm.KvmHost) -> None:
    flows.quickstart()


def test_pause_resume_with_a_running_process(host: vm.KvmHost) -> None:
    flows.pause_resume_with_running_process()


def test_snapshot_then_create(host: vm.KvmHost) -> None:
    flows.snapshot_then_create()


def test_fork_children_diverge(host: vm.KvmHost) -> None:
    flows.fork_diverges()


def test_ttl_pause_then_auto_resume(host: vm.KvmHost) -> None:
    flows.ttl_pauses_and_traffic_resumes()
