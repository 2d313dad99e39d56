"""The unmodified E2B Python SDK through the proxy: a real envd behind it, and the 502 mapping.

The sync SDK runs in a worker thread (it blocks), while the proxy serves in the
test's Trio run. ``E2B_SANDBOX_URL``'s equivalent, ``sandbox_url``, points at
the proxy: the SDK then sends E2b-Sandbox-Id/Port headers the proxy routes by.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from e2b import ConnectionConfig, Sandbox
from e2b.exceptions import SandboxNotRunningException, SandboxUnreachableException
from packaging.version import Version

from aenv_node.api.proxy import Resolution
from aenv_node.guest import __envd_version__

from .conftest import ProxyEnv

if os.geteuid() != 0:
    pytest.skip("envd needs root", allow_module_level=True)


def make_sandbox(url: str, sandbox_id: str) -> Sandbox:
    config = ConnectionConfig(sandbox_url=url, api_key="unused", request_timeout=20,
                              extra_sandbox_headers={"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"})
    return Sandbox(sandbox_id=sandbox_id, sandbox_domain=None, envd_version=Version(__envd_version__),
                   envd_access_token=None, connection_config=config)


@pytest.fixture(scope="module")
def envd() -> Iterator[Any]:
    from tests.guest.conftest import start_envd, stop_envd

    server = start_envd("root")
    yield server
    stop_envd(server)


async def test_sdk_through_proxy_to_real_envd(proxy_env: ProxyEnv, envd: Any, tmp_path: Any) -> None:
    proxy_env.sandboxes.table["envd1"] = Resolution(host="127.0.0.1", port_map=lambda p: envd.port)
    sandbox = make_sandbox(proxy_env.url, "envd1")
    path = str(tmp_path / "hello.bin")
    data = os.urandom(3 * 1024 * 1024 + 17)

    def drive() -> tuple[Any, ...]:
        result = sandbox.commands.run("echo out; echo err >&2; exit 0")
        sandbox.files.write(path, data)
        back = sandbox.files.read(path, format="bytes")
        streamed = []
        handle = sandbox.commands.run("for i in 1 2 3; do echo line$i; sleep 0.3; done", background=True)
        end = handle.wait(on_stdout=lambda line: streamed.append((time.monotonic(), line)))
        return result, back, streamed, end, sandbox.is_running()

    result, back, streamed, end, running = await trio.to_thread.run_sync(drive)
    assert (result.exit_code, result.stdout, result.stderr) == (0, "out\n", "err\n")
    assert back == data
    assert "".join(line for _, line in streamed) == "line1\nline2\nline3\n" and end.exit_code == 0
    assert streamed[-1][0] - streamed[0][0] > 0.3  # lines arrived as printed, not at the end
    assert running is True
    assert {sid for sid, _ in proxy_env.sandboxes.calls} == {"envd1"}


async def test_sdk_maps_proxy_502_to_not_running(proxy_env: ProxyEnv) -> None:
    sandbox = make_sandbox(proxy_env.url, "gone")

    def drive() -> list[Any]:
        outcomes: list[Any] = [sandbox.is_running()]
        for call in (lambda: sandbox.files.read("/etc/hostname"), lambda: sandbox.commands.run("true")):
            try:
                call()
            except Exception as exc:  # noqa: BLE001 - the exception type is what we check
                outcomes.append(exc)
        return outcomes

    running, files_error, rpc_error = await trio.to_thread.run_sync(drive)
    assert running is False
    assert isinstance(files_error, SandboxNotRunningException), repr(files_error)
    assert isinstance(rpc_error, SandboxNotRunningException), repr(rpc_error)
    assert "The sandbox gone was not found" in str(files_error)


async def test_sdk_maps_closed_port_to_unreachable(proxy_env: ProxyEnv) -> None:
    proxy_env.sandboxes.table["noport"] = Resolution(host="127.0.0.1", port_map=lambda p: proxy_env.closed_port)
    sandbox = make_sandbox(proxy_env.url, "noport")

    def drive() -> Exception | None:
        try:
            sandbox.files.read("/etc/hostname")
        except Exception as exc:  # noqa: BLE001
            return exc
        return None

    error = await trio.to_thread.run_sync(drive)
    assert isinstance(error, SandboxUnreachableException), repr(error)
    assert "port is not open" in str(error)
