"""Bad input: one clear line on stderr, a non-zero exit, and no half-written layer in the repository."""

from __future__ import annotations

from pathlib import Path

from .conftest import Cli

UNKNOWN = "sha256:" + "0" * 64


def assert_repository_clean(cli: Cli, expect: list[Path] | None = None) -> None:
    assert cli.repo_files() == (expect or [])
    staging = cli.state_dir / "tmp"
    assert not staging.exists() or not any(staging.iterdir())


def test_import_bad_input(cli: Cli, tmp_path: Path) -> None:
    assert "no such file" in cli.fails("layer", "import", str(tmp_path / "missing.img"))
    assert "is a directory" in cli.fails("layer", "import", str(tmp_path))
    empty = tmp_path / "empty.img"
    empty.touch()
    assert "empty" in cli.fails("layer", "import", str(empty))
    small = tmp_path / "small.img"
    small.write_bytes(b"x" * 8192)
    assert "smaller than" in cli.fails("layer", "import", str(small), "--virtual-size", "4K")
    assert "not a size" in cli.fails("layer", "import", str(small), "--virtual-size", "lots")
    assert "not a multiple of 4096" in cli.fails("layer", "import", str(small), "--virtual-size", "10000")
    assert_repository_clean(cli)
    assert cli.layer_rows() == {}


def test_serve_bad_input(cli: Cli, ext4_image: Path, sock_dir: Path, tmp_path: Path) -> None:
    sock = str(sock_dir / "nbd.sock")
    assert "not a layer digest" in cli.fails("image", "serve", "--layers", "sha256:abc", "--nbd", sock)
    new_upper = tmp_path / "new-upper"
    assert "not in the repository" in cli.fails("image", "serve", "--layers", UNKNOWN, "--upper", str(new_upper),
                                                "--nbd", sock)
    assert not new_upper.exists()  # not left behind
    digest = cli.import_layer(ext4_image)
    stored = cli.repo_files()
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("not an upper")
    line = cli.fails("image", "serve", "--layers", digest, "--upper", str(junk), "--nbd", sock)
    assert "holds no writable upper" in line
    assert sorted(p.name for p in junk.iterdir()) == ["notes.txt"]  # nothing written into it
    assert "records no layer stack" in cli.fails("image", "serve", "--upper", str(tmp_path / "new"), "--nbd", sock)
    assert "give --layers" in cli.fails("image", "serve", "--nbd", sock)
    # a socket path that is a regular file is refused, not replaced
    taken = sock_dir / "taken"
    taken.write_text("x")
    assert "not a socket" in cli.fails("image", "serve", "--layers", digest, "--nbd", str(taken))
    assert taken.read_text() == "x"
    assert_repository_clean(cli, stored)


def test_seal_bad_input(cli: Cli, tmp_path: Path) -> None:
    assert "not a directory" in cli.fails("image", "seal", "--upper", str(tmp_path / "missing"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no writable upper" in cli.fails("image", "seal", "--upper", str(empty))
    (empty / "log.0").write_bytes(b"garbage" * 20)
    (empty / "data.0").write_bytes(bytes(4096))
    assert "holds no writable upper" in cli.fails("image", "seal", "--upper", str(empty))
    assert_repository_clean(cli)
    assert cli.layer_rows() == {}
