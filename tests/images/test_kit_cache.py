"""Content-hash caching of the guest kit: a hit does not rebuild, a changed input rebuilds, and an interrupted
or failed build leaves nothing visible. Real builds (apt, dpkg-deb, mkfs.ext4) with a small stand-in envd."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aenv_node.images.cpio import CharDevice, write_newc
from aenv_node.images.errors import KitBuildError
from aenv_node.images.kit import MANIFEST, KitSpec, ensure_kit, kit_hash, remove_other_kits

pytestmark = pytest.mark.slow

FAKE_ENVD = '"""stand-in envd for the cache tests"""\nVERSION = "{v}"\n'


def make_guest(root: Path, version: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "__init__.py").write_text(FAKE_ENVD.format(v=version))
    (root / "__main__.py").write_text("print('envd stand-in')\n")
    return root


def debugfs_cat(image: Path, path: str) -> str:
    proc = subprocess.run(["debugfs", "-R", f"cat {path}", str(image)], capture_output=True, text=True, check=True)
    return proc.stdout


def visible_kits(state: Path) -> list[str]:
    kit_dir = state / "kit"
    return sorted(p.name for p in kit_dir.iterdir() if not p.name.startswith(".")) if kit_dir.exists() else []


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kitstate")


def test_cache_hit_does_not_rebuild_and_changed_input_rebuilds(state: Path, tmp_path: Path) -> None:
    spec = KitSpec(guest_dir=make_guest(tmp_path / "guest", "1"))
    messages: list[str] = []
    kit = ensure_kit(state, spec, progress=messages.append)
    assert any("building guest kit" in m for m in messages)
    for path in (kit.vmlinuz, kit.vmlinux, kit.initramfs, kit.tools_img):
        assert path.is_file() and path.stat().st_size > 0
    assert kit.vmlinux.read_bytes()[:4] == b"\x7fELF"
    assert 'VERSION = "1"' in debugfs_cat(kit.tools_img, "/python/lib/python3/dist-packages/envd/__init__.py")
    assert kit.manifest["envd_import_error"] is None
    names = [m.rsplit("/", 1)[1].removesuffix(".ko").replace("-", "_") for m in kit.manifest["modules"]]
    for dep, user in (("virtio_ring", "virtio_mmio"), ("virtio", "virtio_blk"), ("failover", "net_failover"),
                      ("net_failover", "virtio_net"), ("virtio_pci_modern_dev", "virtio_pci")):  # fmt: skip
        assert names.index(dep) < names.index(user), names  # dependencies load first
    inode = (kit.root / MANIFEST).stat().st_ino

    messages.clear()
    again = ensure_kit(state, spec, progress=messages.append)
    assert again == kit
    assert (again.root / MANIFEST).stat().st_ino == inode
    assert not any("building" in m for m in messages), messages

    # Change one input (the envd sources): a new kit under a new hash, the old one untouched.
    (spec.guest_dir / "__init__.py").write_text(FAKE_ENVD.format(v="2"))
    changed = ensure_kit(state, spec)
    assert changed.hash != kit.hash
    assert 'VERSION = "2"' in debugfs_cat(changed.tools_img, "/python/lib/python3/dist-packages/envd/__init__.py")
    assert sorted([kit.hash, changed.hash]) == visible_kits(state)

    assert remove_other_kits(state, changed) == [kit.root]
    assert visible_kits(state) == [changed.hash]


def test_hash_covers_spec_versions_and_sources(tmp_path: Path) -> None:
    guest = make_guest(tmp_path / "guest", "1")
    spec = KitSpec(guest_dir=guest)
    versions = {"linux-image-x": "1", "busybox-static": "2"}
    base = kit_hash(spec, versions)
    assert kit_hash(spec, dict(versions)) == base
    assert kit_hash(KitSpec(guest_dir=guest, zstd_level=3), versions) != base
    assert kit_hash(spec, {**versions, "busybox-static": "3"}) != base
    (guest / "extra.py").write_text("x = 1\n")
    assert kit_hash(spec, versions) != base
    (guest / "__pycache__").mkdir()
    (guest / "__pycache__" / "extra.cpython-311.pyc").write_bytes(b"junk")
    with_pyc = kit_hash(spec, versions)
    (guest / "__pycache__" / "extra.cpython-311.pyc").write_bytes(b"other junk")
    assert kit_hash(spec, versions) == with_pyc  # byte-code caches are not inputs


def test_failed_build_leaves_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    guest = tmp_path / "not-a-package"
    guest.mkdir()  # no __init__.py: the envd step fails
    with pytest.raises(KitBuildError, match="envd sources not found"):
        ensure_kit(state, KitSpec(guest_dir=guest))
    assert visible_kits(state) == []
    assert not any(p.name.startswith(".tmp-") for p in (state / "kit").iterdir())


def test_killed_build_leaves_nothing_visible_and_next_build_cleans_up(tmp_path: Path) -> None:
    state = tmp_path / "state"
    guest = make_guest(tmp_path / "guest", "killed")
    code = (
        "import sys; from pathlib import Path; from aenv_node.images.kit import KitSpec, ensure_kit; "
        "ensure_kit(Path(sys.argv[1]), KitSpec(guest_dir=Path(sys.argv[2])))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(state), str(guest)])
    try:
        deadline = time.monotonic() + 120
        staged = None
        while time.monotonic() < deadline and proc.poll() is None:
            tmps = list((state / "kit").glob(".tmp-*/kit/vmlinux")) if (state / "kit").exists() else []
            if tmps:  # mid-build: the kernel is out, the tools drive is not
                staged = tmps[0].parent.parent
                break
            time.sleep(0.05)
        assert staged is not None, "the build never reached its staging directory"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert visible_kits(state) == []
    assert staged.exists()  # the half-built kit is only in the hidden staging directory

    kit = ensure_kit(state, KitSpec(guest_dir=guest))
    assert not staged.exists()
    assert visible_kits(state) == [kit.hash]


def test_cpio_archive_is_readable_by_cpio(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "bin" / "tool").write_bytes(b"#!/bin/sh\necho hi\n")
    (tree / "bin" / "tool").chmod(0o755)
    (tree / "bin" / "link").symlink_to("tool")
    out = tmp_path / "a.cpio"
    with out.open("wb") as f:
        write_newc(tree, f, extra=[CharDevice("dev/console", 5, 1)])
    listing = subprocess.run(["cpio", "-itv"], stdin=out.open("rb"), capture_output=True, text=True, check=True)
    lines = listing.stdout.splitlines()
    assert any(ln.startswith("crw") and ln.endswith("dev/console") for ln in lines)
    assert any(ln.startswith("-rwxr-xr-x") and ln.endswith("bin/tool") for ln in lines)
    assert any(ln.startswith("lrwx") and "bin/link -> tool" in ln for ln in lines)


def test_envd_that_cannot_import_fails_the_build(tmp_path: Path) -> None:
    state = tmp_path / "state"
    guest = make_guest(tmp_path / "guest", "broken")
    (guest / "__init__.py").write_text("import a_module_the_kit_does_not_ship\n")
    with pytest.raises(KitBuildError, match="a_module_the_kit_does_not_ship"):
        ensure_kit(state, KitSpec(guest_dir=guest))
    assert visible_kits(state) == []
