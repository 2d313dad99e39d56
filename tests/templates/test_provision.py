"""Provisioning an image's root filesystem for the sandbox contract, on plain directories shaped like images:
the account, sudo, the node's hosts/resolv.conf, the shell check, and symlinks that try to leave the root."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from aenv_node.templates.errors import ImageHasNoShell
from aenv_node.templates.provision import provision_root, resolve_inside

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")


def _image(tmp: Path, *, passwd: str = "root:x:0:0:root:/root:/bin/sh\n", shadow: bool = True,
           sudo: bool = False, bash: bool = False) -> Path:
    root = tmp / "root"
    (root / "bin").mkdir(parents=True)
    shutil.copy("/bin/busybox", root / "bin" / "busybox")
    os.symlink("busybox", root / "bin" / "sh")
    if bash:
        shutil.copy("/bin/busybox", root / "bin" / "bash")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text(passwd)
    (root / "etc" / "group").write_text("root:x:0:\n")
    if shadow:
        (root / "etc" / "shadow").write_text("root:*:19000:0:99999:7:::\n")
        (root / "etc" / "shadow").chmod(0o640)
    if sudo:
        (root / "usr" / "bin").mkdir(parents=True)
        (root / "usr" / "bin" / "sudo").write_bytes(b"#!/bin/sh\n")
    return root


def test_an_image_without_a_user_gets_one_with_sudo_and_the_nodes_files(tmp_path: Path) -> None:
    root = _image(tmp_path, sudo=True, bash=True)
    (root / "run" / "systemd").mkdir(parents=True)
    os.symlink("../run/systemd/stub-resolv.conf", root / "etc" / "resolv.conf")
    p = provision_root(root)
    assert (p.user, p.uid, p.gid, p.created_user, p.sudo) == ("user", 1000, 1000, True, True)
    assert "user:x:1000:1000::/home/user:/bin/bash" in (root / "etc" / "passwd").read_text().splitlines()
    assert "user:x:1000:" in (root / "etc" / "group").read_text().splitlines()
    assert (root / "etc" / "shadow").read_text().splitlines()[-1].startswith("user::")
    assert (root / "etc" / "shadow").stat().st_mode & 0o777 == 0o640
    home = (root / "home" / "user").stat()
    assert (home.st_uid, home.st_gid) == (1000, 1000)
    sudoers = root / "etc" / "sudoers.d" / "user"
    assert sudoers.read_text() == "user ALL=(ALL:ALL) NOPASSWD: ALL\n" and sudoers.stat().st_mode & 0o777 == 0o440
    assert not (root / "etc" / "resolv.conf").is_symlink()
    assert (root / "etc" / "resolv.conf").read_text() == "nameserver 8.8.8.8\n"
    assert not (root / "run" / "systemd" / "stub-resolv.conf").exists()  # replaced, not written through
    assert "127.0.1.1\tsandbox" in (root / "etc" / "hosts").read_text()
    assert (root / "opt" / "aenv").is_dir()
    for d in ("dev", "proc", "sys", "run"):
        assert (root / d).is_dir()
    assert (root / "tmp").stat().st_mode & 0o7777 == 0o1777


def test_uid_1000_taken_gives_the_next_free_one_and_no_sudo_without_sudo(tmp_path: Path) -> None:
    root = _image(tmp_path, shadow=False,
                  passwd="root:x:0:0:root:/root:/bin/sh\nnode:x:1000:1000::/home/node:/bin/sh\n")
    p = provision_root(root)
    assert (p.uid, p.sudo, p.created_user) == (1001, False, True)
    assert "user:x:1001:1001::/home/user:/bin/sh" in (root / "etc" / "passwd").read_text()
    assert not (root / "etc" / "shadow").exists() and not (root / "etc" / "sudoers.d").exists()


def test_an_existing_user_is_kept_as_the_image_has_it(tmp_path: Path) -> None:
    passwd = "root:x:0:0:root:/root:/bin/sh\nuser:x:1234:1234::/srv/user:/bin/sh\n"
    root = _image(tmp_path, passwd=passwd)
    p = provision_root(root)
    assert (p.uid, p.gid, p.created_user) == (1234, 1234, False)
    assert (root / "etc" / "passwd").read_text() == passwd
    assert (root / "srv" / "user").is_dir()


def test_an_image_without_a_shell_is_a_clear_error(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    with pytest.raises(ImageHasNoShell, match="no /bin/sh"):
        provision_root(root)
    (root / "bin").mkdir()
    os.symlink("/nowhere/sh", root / "bin" / "sh")  # dangling
    with pytest.raises(ImageHasNoShell):
        provision_root(root)


def test_symlinks_never_lead_out_of_the_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "hosts").write_text("the host's\n")
    root = _image(tmp_path)
    # /etc/hosts -> an absolute path that, taken on the host, is the sentinel; and a relative climb
    os.symlink(str(outside / "hosts"), root / "etc" / "hosts")
    os.symlink("../../../../../../" + str(outside.relative_to("/")) + "/hostname", root / "etc" / "hostname")
    os.symlink("/", root / "opt")
    provision_root(root)
    assert (outside / "hosts").read_text() == "the host's\n" and not (outside / "hostname").exists()
    assert (root / "etc" / "hosts").read_text().startswith("127.0.0.1")
    assert (root / "aenv").is_dir()  # /opt -> / inside the image: /opt/aenv is the image's /aenv
    assert resolve_inside(root, "/opt/../../../etc/passwd") == root / "etc" / "passwd"
    os.symlink("loop", root / "loop")
    with pytest.raises(Exception, match="too many levels"):
        resolve_inside(root, "/loop/x")
