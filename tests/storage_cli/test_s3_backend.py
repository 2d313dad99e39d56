"""The same commands against an S3 repository (a real moto server over HTTP): layers go to the bucket, serving
reads them on demand through the local cache, whose counters ``cache stats`` shows."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv_node.storage.repository import layer_key
from tests.storage.s3server import (
    ACCESS_KEY,
    REGION,
    SECRET_KEY,
    delete_bucket,
    make_s3_repository,
    moto_endpoint,  # noqa: F401  (fixture)
)

from .conftest import Cli, cli_env, compare, qemu_io


@pytest.fixture
def s3_repo(moto_endpoint: str) -> Iterator[object]:  # noqa: F811
    repo = make_s3_repository(moto_endpoint)  # a fresh bucket
    try:
        yield repo
    finally:
        delete_bucket(repo)


def test_import_serve_seal_over_s3(s3_repo, tmp_path: Path, ext4_image: Path, sock_dir: Path) -> None:  # type: ignore[no-untyped-def]
    cli = Cli(tmp_path / "state", cli_env({
        "AENV_STORAGE_REPOSITORY": "s3",
        "AENV_STORAGE_S3_ENDPOINT": s3_repo.endpoint_url,
        "AENV_STORAGE_S3_BUCKET": s3_repo.bucket,
        "AENV_STORAGE_S3_REGION": REGION,
        "AENV_STORAGE_S3_PREFIX": s3_repo.prefix,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
    }))
    base = cli.import_layer(ext4_image)
    assert s3_repo.list_layers() == [base]
    assert cli.layer_rows()[base][3] == layer_key(base)
    assert not (cli.state_dir / "repository").exists()  # nothing went to a local repository

    sock = sock_dir / "nbd.sock"
    upper = tmp_path / "upper"
    with cli.serve("--layers", base, "--upper", str(upper), "--nbd", str(sock)) as srv:  # cache: by default
        compare(srv.uri, ext4_image)
        qemu_io(srv.uri, "write -P 0xab 0 64k")
        assert srv.stop(signal.SIGTERM) == 0, srv.stderr
    assert "via the cache" in srv.stderr
    sealed = cli.run("image", "seal", "--upper", str(upper)).stdout.strip()
    assert sorted(s3_repo.list_layers()) == sorted([base, sealed])

    expected = bytearray(ext4_image.read_bytes())
    expected[:65536] = b"\xab" * 65536
    (tmp_path / "expected.img").write_bytes(expected)
    with cli.serve("--layers", f"{base},{sealed}", "--nbd", str(sock)) as srv:
        compare(srv.uri, tmp_path / "expected.img")
        assert srv.stop() == 0, srv.stderr

    doc = json.loads(cli.run("cache", "stats", "--json").stdout)
    by_digest = {r["digest"]: r for r in doc["layers"]}
    assert set(by_digest) == {base, sealed}
    assert by_digest[base]["fetched_bytes"] > 0 and by_digest[base]["hits"] > 0
    assert by_digest[sealed]["fetched_bytes"] > 0
