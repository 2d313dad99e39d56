"""Pure pieces of envd, checked without a server: multipart, modes, times, paths, packaging."""

from __future__ import annotations

import ast
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio
from hypothesis import given, settings, strategies as st

from aenv_node.guest.control import parse_rfc3339_ns
from aenv_node.guest.entry import go_mode_string, rfc3339_ns
from aenv_node.guest.multipart import MultipartError, MultipartReader, parse_header_params
from aenv_node.guest.process import end_event
from aenv_node.guest.users import User, basic_auth_username, resolve_path

GUEST = Path(__file__).resolve().parents[2] / "aenv_node" / "guest"


def _reader(body: bytes, cuts: list[int], boundary: bytes) -> MultipartReader:
    pieces = []
    last = 0
    for cut in sorted(set(c % (len(body) + 1) for c in cuts)):
        pieces.append(body[last:cut])
        last = cut
    pieces.append(body[last:])
    pieces = [p for p in pieces if p]
    it = iter(pieces)

    async def receive() -> bytes:
        await trio.lowlevel.checkpoint()
        return next(it, b"")

    return MultipartReader(receive, boundary)


async def _collect(reader: MultipartReader) -> list[tuple[str | None, str | None, bytes]]:
    parts = []
    while (part := await reader.next_part()) is not None:
        data = b""
        while chunk := await part.read_chunk():
            data += chunk
        parts.append((part.name, part.filename, data))
    return parts


@settings(max_examples=150, deadline=None)
@given(
    contents=st.lists(st.binary(max_size=3000), min_size=0, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=20000), max_size=12),
)
def test_multipart_roundtrip_any_chunking(contents: list[bytes], cuts: list[int]) -> None:
    boundary = b"XyZ-boundary-123"
    body = b"preamble\r\n"
    for i, data in enumerate(contents):
        body += (b"--" + boundary + b"\r\nContent-Disposition: form-data; name=\"file\"; filename=\"/a/b "
                 + str(i).encode() + b".txt\"\r\nContent-Type: application/octet-stream\r\n\r\n" + data + b"\r\n")
    body += b"--" + boundary + b"--\r\n"
    parts = trio.run(_collect, _reader(body, cuts, boundary))
    assert parts == [("file", f"/a/b {i}.txt", data) for i, data in enumerate(contents)]


def test_multipart_truncated_body_is_an_error() -> None:
    body = b"--B\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nabc"
    with pytest.raises(MultipartError):
        trio.run(_collect, _reader(body, [], b"B"))


def test_header_params() -> None:
    assert parse_header_params('form-data; name="file"; filename="a \\"q\\" b"') == {"name": "file", "filename": 'a "q" b'}
    assert parse_header_params("multipart/form-data; boundary=abc") == {"boundary": "abc"}


@pytest.mark.parametrize("mode,expected", [
    (stat.S_IFREG | 0o644, "-rw-r--r--"),
    (stat.S_IFDIR | 0o755, "drwxr-xr-x"),
    (stat.S_IFLNK | 0o777, "Lrwxrwxrwx"),
    (stat.S_IFDIR | stat.S_ISVTX | 0o777, "dtrwxrwxrwx"),
    (stat.S_IFREG | stat.S_ISUID | 0o755, "urwxr-xr-x"),
    (stat.S_IFCHR | 0o666, "Dcrw-rw-rw-"),
    (stat.S_IFIFO | 0o600, "prw-------"),
])
def test_go_mode_string(mode: int, expected: str) -> None:
    assert go_mode_string(mode) == expected


@given(st.integers(min_value=0, max_value=4_000_000_000 * 10**9))
def test_rfc3339_roundtrip(ns: int) -> None:
    assert parse_rfc3339_ns(rfc3339_ns(ns)) == ns


def test_rfc3339_offsets() -> None:
    assert parse_rfc3339_ns("1970-01-01T01:00:00+01:00") == 0
    assert parse_rfc3339_ns("2024-01-01T00:00:00.5Z") - parse_rfc3339_ns("2024-01-01T00:00:00Z") == 500_000_000
    with pytest.raises(ValueError):
        parse_rfc3339_ns("yesterday")


def test_resolve_path_and_basic_auth() -> None:
    u = User(name="u", uid=1, gid=1, home="/home/u")
    assert resolve_path("", u, None) == "/home/u"
    assert resolve_path("", u, "/work") == "/work"
    assert resolve_path("a/../b", u, None) == "/home/u/b"
    assert resolve_path("~/x", u, None) == "/home/u/x"
    assert resolve_path("/../../etc", u, None) == "/etc"
    with pytest.raises(ValueError):
        resolve_path("~bob/x", u, None)
    assert basic_auth_username("Basic dXNlcjo=") == "user"
    assert basic_auth_username("Bearer x") is None and basic_auth_username(None) is None


def test_end_event_matches_go() -> None:
    assert end_event(0) == {"exitCode": 0, "exited": True, "status": "exit status 0"}
    assert end_event(2)["error"] == "exit status 2"
    assert end_event(-9) == {"exitCode": -1, "exited": False, "status": "signal: killed", "error": "signal: killed"}
    assert end_event(-11)["status"] == "signal: segmentation fault"


def test_guest_imports_nothing_from_the_node() -> None:
    """The package must work when installed alone as ``envd``: only relative imports of itself."""
    allowed = {"trio", "h11", "__future__"}
    for path in GUEST.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                top = (node.module or "").split(".")[0]
                assert top in allowed or top in sys.stdlib_module_names, f"{path.name}: from {node.module}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    assert top in allowed or top in sys.stdlib_module_names, f"{path.name}: import {alias.name}"


def test_runs_as_top_level_envd_package() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copytree(GUEST, os.path.join(tmp, "envd"), ignore=shutil.ignore_patterns("__pycache__"))
        out = subprocess.run([sys.executable, "-m", "envd", "--version"], cwd=tmp, capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": tmp}, timeout=30)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "0.6.4"
        # and it serves under that name
        proc = subprocess.Popen([sys.executable, "-m", "envd", "--host", "127.0.0.1", "--port", "0",
                                 "--default-user", "root", "--no-set-clock"],
                                cwd=tmp, env={**os.environ, "PYTHONPATH": tmp}, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stderr.readline()
            port = int(line.rsplit(":", 1)[1].split()[0])
            import httpx

            assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 204
            r = httpx.post(f"http://127.0.0.1:{port}/process.Process/List", json={})
            assert r.json() == {"processes": []}
        finally:
            proc.terminate()
            assert proc.wait(timeout=10) == 0


def test_requirements_are_pinned() -> None:
    lines = [l.strip() for l in (GUEST / "requirements.txt").read_text().splitlines() if l.strip()]
    assert {l.split("==")[0] for l in lines} >= {"trio", "h11"}
    assert all("==" in l for l in lines)


@pytest.mark.parametrize("header,expected", [
    ("", "identity"), ("gzip", "gzip"), ("gzip, deflate", "gzip"), ("br", "identity"),
    ("identity, gzip", "identity"), ("gzip;q=0.5, identity", "identity"), ("gzip;q=0", "identity"),
    ("*", "identity"), ("*, identity;q=0", "gzip"), ("GZIP;Q=0.9", "gzip"),
])
def test_choose_encoding(header: str, expected: str) -> None:
    from aenv_node.guest.files import choose_encoding

    assert choose_encoding(header) == expected


def test_choose_encoding_nothing_acceptable() -> None:
    from aenv_node.guest.errors import HttpError
    from aenv_node.guest.files import choose_encoding

    with pytest.raises(HttpError) as info:
        choose_encoding("br, identity;q=0")
    assert info.value.status == 400
