"""``code-interpreter-v1``, built by the node from its definition in the repository through the recipe path
(FROM base, COPY of the server and its wheels, RUN of an offline pip install, the server as start command),
driven by the unmodified ``e2b_code_interpreter`` SDK; and the step cache makes a restart rebuild nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.sandbox.conftest import NodeProcess, node_in_tmp

e2b_code_interpreter = pytest.importorskip("e2b_code_interpreter")

pytestmark = [pytest.mark.vm, pytest.mark.slow]


def _wait_ready(node: NodeProcess, name: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    with node.api() as c:
        while True:
            r = c.get(f"/templates/{name}")
            if r.status_code == 200 and r.json()["buildStatus"] == "ready":
                return
            assert not (r.status_code == 200 and r.json()["buildStatus"] == "error"), node.log()[-3000:]
            assert time.monotonic() < deadline, node.log()[-3000:]
            time.sleep(1)


@pytest.fixture(scope="module")
def ci_node() -> Iterator[NodeProcess]:
    with node_in_tmp("aenv-ci-", AENV_TEMPLATES_CODE_INTERPRETER="true") as node:
        _wait_ready(node, "code-interpreter-v1")
        yield node


def test_run_code_with_the_unmodified_sdk(ci_node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in ci_node.sdk_env().items():
        monkeypatch.setenv(k, v)
    # its default template: code-interpreter-v1; the sandbox outlives a slow kernel start under TCG (the default
    # 300 s lifetime paused it in the middle of create_code_context on a loaded 2-core host)
    sb = e2b_code_interpreter.Sandbox.create(timeout=1800)
    try:
        assert sb.run_code("x = 21 * 2\nx").text == "42"
        assert sb.run_code("x + 1").text == "43"  # state persists
        err = sb.run_code("1 / 0").error
        assert err is not None and err.name == "ZeroDivisionError"
        out = sb.run_code("print('hello'); import sys; print('oops', file=sys.stderr)")
        assert out.logs.stdout == ["hello\n"] and out.logs.stderr == ["oops\n"]
        # a new kernel starts in about a second on a KVM host; under TCG on a busy 2-core host, a minute or more
        ctx = sb.create_code_context(request_timeout=300)
        assert sb.run_code("'x' in globals()", context=ctx).text == "False"  # its own globals
        assert sb.run_code("import os; os.getcwd()").text == "/home/user"
        # the same guest: files written by code are visible to commands
        sb.run_code("open('/home/user/from_code.txt', 'w').write('written by a kernel')")
        assert sb.files.read("/home/user/from_code.txt") == "written by a kernel"
    finally:
        sb.kill()


def test_a_restarted_node_keeps_the_built_template(ci_node: NodeProcess) -> None:
    builds = ci_node.sql("SELECT count(*) FROM template_builds WHERE source LIKE 'builtin code-interpreter-v1%'")
    assert builds[0][0] == 1
    [(source,)] = ci_node.sql("SELECT source FROM template_builds WHERE status = 'ready' AND "
                              "source LIKE 'builtin code-interpreter-v1%'")
    assert "files=" in source and "base=snp_" in source
