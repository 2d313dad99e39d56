"""Fixtures for the ``aenv`` client tests: no node, no VM. ``run_aenv`` runs the real entry point in-process
(one-line errors and exit codes included); ``fake_node`` answers the REST API from a handler function."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Callable

import pytest

from aenv_node.cli.aenv import main


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture(autouse=True)
def _isolated_config(tmp_path, monkeypatch) -> None:
    """No stored config, no environment overrides: each test says where its node is."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.delenv("AENV_URL", raising=False)
    monkeypatch.delenv("AENV_API_KEY", raising=False)
    monkeypatch.delenv("AENV_DEBUG", raising=False)


@pytest.fixture
def run_aenv(capsys) -> Callable[..., Result]:
    def run(*args: str) -> Result:
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
