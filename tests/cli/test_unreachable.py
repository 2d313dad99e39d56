"""A node that cannot be reached is ONE clear line and exit code 1, for REST and SDK commands alike."""

from __future__ import annotations

import pytest

REST = [
    ["ls"], ["pause", "sb1"], ["resume", "sb1"], ["timeout", "sb1", "60"], ["fork", "sb1"],
    ["start", "base", "-d"], ["template", "ls"], ["template", "rm", "app"], ["snapshot", "ls"],
    ["snapshot", "create", "sb1"], ["snapshot", "rm", "snap1"], ["events"], ["logs", "sb1"],
    ["template", "watch", "b1", "--template", "t1"],
]


@pytest.mark.parametrize("args", REST, ids=lambda a: " ".join(a))
def test_rest_commands(run_aenv, closed_port: int, args: list[str]) -> None:
    url = f"http://127.0.0.1:{closed_port}"
    r = run_aenv(*args, "--url", url, "--key", "k")
    assert r.code == 1
    assert r.err.strip().splitlines() == [f"Error: cannot reach {url}: [Errno 111] Connection refused"]


def test_auth(run_aenv, closed_port: int) -> None:
    r = run_aenv("auth", "--url", f"http://127.0.0.1:{closed_port}", "--key", "k")
    assert r.code == 1 and len(r.err.strip().splitlines()) == 1 and "cannot reach" in r.err


@pytest.mark.parametrize("args", [["exec", "sb1", "{node}", "--", "true"], ["download", "sb1", "/etc/hostname", "{node}"],
                                  ["upload", "sb1", __file__, "/tmp/x", "{node}"], ["cn", "sb1", "{node}"],
                                  ["pull", "alpine:3", "-d", "{node}"]], ids=lambda a: a[0])
def test_sdk_commands(run_aenv, closed_port: int, args: list[str]) -> None:
    """The commands working through the e2b SDK ask the node over REST first: the same line as the others."""
    url = f"http://127.0.0.1:{closed_port}"
    i = args.index("{node}")
    r = run_aenv(*args[:i], "--url", url, "--key", "k", *args[i + 1:])
    assert r.code == 1, r
    assert r.err.strip().splitlines() == [f"Error: cannot reach {url}: [Errno 111] Connection refused"]
