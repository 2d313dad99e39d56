"""A VM without envd imported as a template (``POST /node/vm-templates``, ``templates/import_vm.py``), on a node
running Firecracker: the tests' tiny PVH guest, which prints ``AENV BOOT`` and then a tick line 50 times a
second on its console, and has no envd, no disk driver and no network stack.

* The import boots it until its console says it is up and keeps the boot snapshot: a template whose sandboxes
  report no envd version.
* Its sandboxes run once their VMM does (no ``/init``): the guest ticks on from the snapshot; a pause (no
  quiesce) stops the ticks and a connect goes on from there; a kill leaves no VMM.
* Bad input is a clear error that leaves nothing: not an x86-64 ELF is a 400; a guest that never prints its
  ready line is a 502 quoting its console, with no snapshot kept and no VMM left.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from ..vmm.tinyguest import build_tiny_guest, console_ticks
from .conftest import NodeProcess, node_in_tmp, processes_mentioning
from .test_aenv_cli import aenv

pytestmark = pytest.mark.vm

OCTETS = {"content-type": "application/octet-stream"}


@pytest.fixture(scope="module")
def fc_node() -> Iterator[NodeProcess]:
    with node_in_tmp("aenv-vmimport-", wait_template=False, AENV_VMM_KIND="firecracker", AENV_VMM_ACCEL="kvm",
                     AENV_TEMPLATES_BUILD_DEFAULT="false", AENV_NET_WARM_SLOTS="1") as n:
        yield n


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return build_tiny_guest(tmp_path_factory.mktemp("tiny")).read_bytes()


def _import(c: httpx.Client, kernel: bytes, alias: str, ready: str, timeout_s: int = 30) -> httpx.Response:
    return c.post("/node/vm-templates", params={"alias": alias, "memoryMB": 64, "readyConsole": ready,
                                                "timeoutS": timeout_s}, content=kernel, headers=OCTETS)


def _ticks_after(console: Path, tick: int, timeout: float = 20) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ticks = console_ticks(console)
        if ticks and ticks[-1] > tick:
            return ticks[-1]
        time.sleep(0.05)
    raise AssertionError(f"the guest did not tick past {tick}: {console_ticks(console)[-3:]}")


def test_an_imported_vm_runs_pauses_resumes_and_dies_without_envd(fc_node: NodeProcess, tiny: bytes) -> None:
    with fc_node.api() as c:
        r = _import(c, tiny, "tiny", "AENV BOOT")
        assert r.status_code == 201, r.text
        imported = r.json()
        assert imported["bootMs"] > 0 and imported["snapshotID"].startswith("snp_")
        assert fc_node.sql("SELECT envd_version, status FROM templates WHERE alias = 'tiny'") == [("", "ready")]

        r = c.post("/sandboxes", json={"templateID": "tiny", "timeout": 120})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        assert r.json()["envdVersion"] == ""
        console = fc_node.state_dir / "sandboxes" / sid / "console.log"
        first = _ticks_after(console, 0)  # restored from the boot snapshot, it ticks on (no /init was awaited)
        assert fc_node.sql(f"SELECT state FROM sandboxes WHERE id = '{sid}'") == [("running",)]
        before = _ticks_after(console, first)

        assert c.post(f"/sandboxes/{sid}/pause").status_code == 204
        fc_node.wait_state(sid, "paused")
        assert not processes_mentioning(sid)
        commit = fc_node.sql(f"SELECT detail FROM events WHERE sandbox_id = '{sid}' AND operation = 'snapshot_commit'")
        assert commit and '"quiesce_ms"' not in commit[-1][0]  # no envd: nothing to quiesce

        r = c.post(f"/sandboxes/{sid}/connect", json={"timeout": 120})
        assert r.status_code == 201, r.text
        # a new console: the guest's tick counter goes on from where it paused (a boot would count from 1)
        _ticks_after(console, 0)
        assert min(console_ticks(console)) > before
        assert c.delete(f"/sandboxes/{sid}").status_code == 204
        assert fc_node.sql(f"SELECT state FROM sandboxes WHERE id = '{sid}'") == [("killed",)]
        assert not processes_mentioning(sid)


def test_a_bad_kernel_or_a_guest_that_never_comes_up_is_refused_and_leaves_nothing(fc_node: NodeProcess,
                                                                                    tiny: bytes) -> None:
    with fc_node.api() as c:
        r = _import(c, b"#!/bin/sh\necho not a kernel\n", "notelf", "AENV BOOT")
        assert r.status_code == 400 and "not an ELF file" in r.json()["message"], r.text
        elf32 = bytearray(tiny[:64])
        elf32[4] = 1  # ELFCLASS32
        r = _import(c, bytes(elf32), "elf32", "AENV BOOT")
        assert r.status_code == 400 and "x86-64" in r.json()["message"], r.text
        assert fc_node.sql("SELECT count(*) FROM templates WHERE alias IN ('notelf', 'elf32')") == [(0,)]

        r = _import(c, tiny, "mute", "a line it never prints", timeout_s=2)
        assert r.status_code == 502, r.text
        assert "not ready 2 s after its boot" in r.json()["message"] and "T 000000" in r.json()["message"]
        [(tid, status)] = fc_node.sql("SELECT id, status FROM templates WHERE alias = 'mute'")
        assert status == "error"
        assert fc_node.sql(f"SELECT count(*) FROM snapshots WHERE template_id = '{tid}'") == [(0,)]
        builds = fc_node.sql(f"SELECT id, status FROM template_builds WHERE template_id = '{tid}'")
        assert [b[1] for b in builds] == ["error"]
        assert not processes_mentioning(builds[0][0])  # its VMM is gone
        assert not list((fc_node.state_dir / "builds" / builds[0][0]).glob("upper*"))
        r = c.post("/sandboxes", json={"templateID": "mute"})
        assert r.status_code == 409 and "no successful build" in r.json()["message"], r.text


def test_the_cli_imports_a_vm_and_says_why_it_cannot(fc_node: NodeProcess, tiny: bytes, tmp_path: Path) -> None:
    kernel = tmp_path / "tiny.elf"
    kernel.write_bytes(tiny)
    ok = aenv(fc_node, "template", "import-vm", str(kernel), "--name", "tiny-cli", "--ready", "AENV BOOT", "--mem",
              "64")
    assert ok.returncode == 0 and ok.stdout == "tiny-cli\n", ok.stderr
    assert "imported tiny-cli" in ok.stderr
    assert fc_node.sql("SELECT status FROM templates WHERE alias = 'tiny-cli'") == [("ready",)]
    script = tmp_path / "not-a-kernel"
    script.write_text("#!/bin/sh\n")
    bad = aenv(fc_node, "template", "import-vm", str(script), "--name", "nope", "--ready", "AENV BOOT")
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert "not an ELF file" in bad.stderr
