"""``aenv-node image serve`` and ``image seal`` as real processes, checked with QEMU's own NBD client
(qemu-io / qemu-img): serve an imported ext4 layer with a writable upper, write through NBD, stop with SIGTERM
(exit 0, flushed), seal the upper into a layer, serve the new stack and find the written bytes there."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from aenv_node.storage.repository import layer_key
from aenv_node.storage.upper import Upper
from tests.storage.frontends.nbd_rawclient import RawClient

from .conftest import IMAGE_SIZE, Cli, compare, qemu_io, sha256_file, wait_gone


def patch(path: Path, out: Path, writes: list[tuple[int, bytes]]) -> Path:
    data = bytearray(path.read_bytes())
    for off, b in writes:
        data[off : off + len(b)] = b
    out.write_bytes(data)
    return out


def test_serve_write_seal_serve_again(cli: Cli, ext4_image: Path, sock_dir: Path, tmp_path: Path) -> None:
    base = cli.import_layer(ext4_image)
    upper = tmp_path / "upper"
    sock = sock_dir / "nbd.sock"

    # 1. serve base + a new upper; the export is the ext4 image; write through NBD
    with cli.serve("--layers", base, "--upper", str(upper), "--nbd", str(sock)) as srv:
        assert srv.uri == f"nbd+unix:///?socket={sock}"
        compare(srv.uri, ext4_image)
        qemu_io(srv.uri, "write -P 0xab 0 64k", "write -P 0xcd 1000000 5000")  # the second: partial blocks
        qemu_io(srv.uri, "read -P 0xab 0 64k", "read -P 0xcd 1000000 5000")
        # the upper is in use: sealing it now is refused
        assert "in use by another process" in cli.fails("image", "seal", "--upper", str(upper))
        assert srv.stop(signal.SIGTERM) == 0, srv.stderr
    assert "SIGTERM: flushing and stopping" in srv.stderr
    assert wait_gone(sock)  # the socket file is removed on exit
    expected1 = patch(ext4_image, tmp_path / "expected1.img", [(0, b"\xab" * 65536), (1000000, b"\xcd" * 5000)])
    assert Upper.peek(upper) == (IMAGE_SIZE, [base])  # the upper records the stack it was written over

    # 2. seal: a new layer in the repository and a row; the upper continues, empty, over base + sealed
    p = cli.run("image", "seal", "--upper", str(upper))
    sealed = p.stdout.strip()
    assert sealed.startswith("sha256:") and sealed != base and "sealing" in p.stderr
    stored = cli.repository / layer_key(sealed)
    assert sha256_file(stored) == sealed
    rows = cli.layer_rows()
    assert set(rows) == {base, sealed}
    assert rows[sealed] == ("disk", stored.stat().st_size, IMAGE_SIZE, layer_key(sealed), 0)
    assert Upper.peek(upper) == (IMAGE_SIZE, [base, sealed])
    assert not any((cli.state_dir / "tmp").iterdir())  # staging removed

    # 3. the new stack, read-only (no upper): the written bytes come from the sealed layer
    with cli.serve("--layers", f"{base},{sealed}", "--nbd", str(sock)) as srv:
        compare(srv.uri, expected1)
        qemu_io(srv.uri, "read -P 0xab 0 64k", read_only=True)
        # no upper: the export is read-only, so a read-write open is refused
        rw = subprocess.run(["qemu-io", "-f", "raw", srv.uri, "-c", "write -P 1 0 4k"], capture_output=True,
                            text=True, timeout=60, check=False)
        assert rw.returncode != 0 and "wrote" not in rw.stdout
        assert srv.stop() == 0, srv.stderr

    # 4. the sealed upper reopened from its recorded stack alone (no --layers): write again, seal again
    with cli.serve("--upper", str(upper), "--nbd", str(sock)) as srv:
        compare(srv.uri, expected1)
        qemu_io(srv.uri, "write -P 0xef 2M 64k")
        assert srv.stop(signal.SIGINT) == 0, srv.stderr
    sealed2 = cli.run("image", "seal", "--upper", str(upper)).stdout.strip()
    expected2 = patch(expected1, tmp_path / "expected2.img", [(2 << 20, b"\xef" * 65536)])
    with cli.serve("--layers", f"{base},{sealed},{sealed2}", "--nbd", str(sock)) as srv:
        compare(srv.uri, expected2)
        assert srv.stop() == 0, srv.stderr
    assert set(cli.layer_rows()) == {base, sealed, sealed2}

    # an upper written over one stack is not served over another
    line = cli.fails("image", "serve", "--layers", base, "--upper", str(upper), "--nbd", str(sock))
    assert "was written over layers" in line


def test_sigterm_flushes_acknowledged_writes(cli: Cli, ext4_image: Path, sock_dir: Path, tmp_path: Path) -> None:
    """Writes the client never flushed survive SIGTERM (the server flushes on the way out); the same writes
    after SIGKILL are lost -- which shows the first check really depends on that flush."""
    base = cli.import_layer(ext4_image)
    sock = sock_dir / "nbd.sock"
    for sig, survives in ((signal.SIGTERM, True), (signal.SIGKILL, False)):
        upper = tmp_path / f"upper-{sig.name}"
        with cli.serve("--layers", base, "--upper", str(upper), "--nbd", str(sock)) as srv:
            # a WRITE acknowledged but never followed by a FLUSH (qemu-io always flushes when it closes), the
            # client still connected when the server is stopped
            with RawClient(str(sock)) as client:
                client.go()
                assert client.write(128 * 1024, b"\x5a" * 8192) == 0
                code = srv.stop(sig)
        assert code == (0 if survives else -signal.SIGKILL), srv.stderr
        with cli.serve("--upper", str(upper), "--nbd", str(sock)) as srv:
            if survives:
                qemu_io(srv.uri, "read -P 0x5a 128k 8k")
            else:
                compare(srv.uri, ext4_image)
            assert srv.stop() == 0


def test_serve_through_cache_and_cache_stats(cli: Cli, ext4_image: Path, sock_dir: Path) -> None:
    """``--cache`` reads the layers through the local cache even from a local repository; its counters reach
    ``cache_entries`` and ``cache stats`` prints them."""
    base = cli.import_layer(ext4_image)
    empty = cli.run("cache", "stats", "--json")
    import json

    doc = json.loads(empty.stdout)
    assert doc["layers"] == [] and doc["totals"]["layers"] == 0
    sock = sock_dir / "nbd.sock"
    with cli.serve("--layers", base, "--cache", "--nbd", str(sock)) as srv:
        compare(srv.uri, ext4_image)
        compare(srv.uri, ext4_image)  # the second pass is served from the cache
        assert srv.stop() == 0, srv.stderr
    size = (cli.repository / layer_key(base)).stat().st_size
    doc = json.loads(cli.run("cache", "stats", "--json").stdout)
    [row] = doc["layers"]
    assert row["digest"] == base and row["size_bytes"] == size
    assert row["fetched_bytes"] > 0 and row["cached_bytes"] > 0 and row["misses"] > 0 and row["hits"] > 0
    assert row["evicted_bytes"] == 0 and row["last_access_at"]
    assert doc["totals"]["layers"] == 1 and doc["totals"]["fetched_bytes"] == row["fetched_bytes"]
    assert doc["cache"]["capacity_bytes"] > 0
    table = cli.run("cache", "stats").stdout.splitlines()
    assert table[0].split()[:3] == ["LAYER", "SIZE", "CACHED"]
    assert table[1].startswith(base[:19]) and table[2].startswith("TOTAL")
    assert str(cli.state_dir / "cache") in table[-1]
