"""The Dockerfile subset of ``aenv build``: good files convert (through the e2b SDK), every instruction
outside the subset is an error naming its line, EXPOSE/LABEL/VOLUME/MAINTAINER are warnings."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv_node.cli.aenv.dockerfile import IGNORED, SUPPORTED, DockerfileError, check_dockerfile, to_template

GOOD = """\
# syntax=docker/dockerfile:1
ARG VERSION=3.12
FROM python:${VERSION}
ENV APP_HOME=/app PORT=8080
WORKDIR $APP_HOME
COPY requirements.txt ./
ADD app.py /app/app.py
RUN pip install -r requirements.txt \\
    && rm -rf /root/.cache
USER user
EXPOSE 8080
LABEL org.example=1
CMD ["python", "app.py"]
"""


def _steps(template) -> list[dict]:
    t = template._template
    return t._serialize(t._instructions_with_hashes())


def test_good_file_converts(tmp_path: Path) -> None:
    (tmp_path / "requirements.txt").write_text("flask\n")
    (tmp_path / "app.py").write_text("print('hi')\n")
    (tmp_path / "Dockerfile").write_text(GOOD)
    parsed = to_template(tmp_path / "Dockerfile", tmp_path)
    assert [w.split(": ", 1)[1].split(" ")[0] for w in parsed.warnings] == ["EXPOSE", "LABEL"]
    assert all(str(tmp_path / "Dockerfile") in w for w in parsed.warnings)
    assert ":11:" in parsed.warnings[0] and ":12:" in parsed.warnings[1]
    body = _steps(parsed.template)
    assert body["fromImage"] == "python:3.12"
    assert body["startCmd"] == "python app.py"
    kinds = [s["type"] for s in body["steps"]]
    assert kinds.count("COPY") == 2 and "RUN" in kinds and "ENV" in kinds
    assert all(len(s.get("filesHash") or "x" * 64) == 64 for s in body["steps"])
    run = next(s for s in body["steps"] if s["type"] == "RUN")
    assert "pip install -r requirements.txt" in run["args"][0]


def test_entrypoint_and_cmd_make_the_start_command(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text('FROM alpine\nENTRYPOINT ["/bin/serve"]\nCMD ["--port", "80"]\n')
    body = _steps(to_template(tmp_path / "Dockerfile", tmp_path).template)
    assert body["startCmd"] == "/bin/serve --port 80"


def test_minimal_file_has_no_warnings() -> None:
    assert check_dockerfile("FROM debian:bookworm\nRUN apt-get update\n") == []


@pytest.mark.parametrize("instruction", ["HEALTHCHECK CMD curl -f http://localhost/", "SHELL [\"/bin/bash\", \"-c\"]",
                                         "ONBUILD RUN make", "STOPSIGNAL SIGTERM"])
def test_unsupported_instruction_names_its_line(instruction: str) -> None:
    content = f"FROM alpine\nRUN true\n\n{instruction}\nRUN false\n"
    with pytest.raises(DockerfileError) as info:
        check_dockerfile(content, "ctx/Dockerfile")
    message = str(info.value)
    assert message.startswith("ctx/Dockerfile:4: " + instruction.split()[0] + " is not supported")
    assert "\n" not in message


@pytest.mark.parametrize("instruction", sorted(IGNORED))
def test_ignored_instructions_warn_with_their_line(instruction: str) -> None:
    warnings = check_dockerfile(f"FROM alpine\n{instruction} x=1\n")
    assert len(warnings) == 1 and warnings[0].startswith(f"Dockerfile:2: {instruction} ignored")


def test_supported_set_is_the_issue_subset() -> None:
    assert SUPPORTED == {"FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "USER", "CMD", "ENTRYPOINT"}


@pytest.mark.parametrize("content, line, needle", [
    ("FROM a AS build\nRUN make\nFROM b\nCOPY --from=build /x /x\n", 3, "second FROM"),
    ("RUN true\n", None, "no FROM"),
    ("FROM alpine\nRUN <<EOF\necho\n", 2, "heredoc"),
])
def test_structure_errors(content: str, line: int | None, needle: str) -> None:
    with pytest.raises(DockerfileError) as info:
        check_dockerfile(content)
    assert needle in str(info.value)
    if line is not None:
        assert str(info.value).startswith(f"Dockerfile:{line}: ")


def test_sdk_errors_keep_the_line(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM alpine\nRUN true\nADD https://example.com/x.tgz /x\n")
    with pytest.raises(DockerfileError) as info:
        to_template(tmp_path / "Dockerfile", tmp_path)
    assert str(info.value) == f"{tmp_path / 'Dockerfile'}:3: ADD from a remote URL is not supported: https://example.com/x.tgz"


def test_build_command_reports_the_line(tmp_path: Path, run_aenv) -> None:
    (tmp_path / "Dockerfile").write_text("FROM alpine\nHEALTHCHECK NONE\n")
    r = run_aenv("build", str(tmp_path / "Dockerfile"), "--url", "http://127.0.0.1:9", "--key", "k")
    assert r.code == 1
    assert r.err.strip().splitlines() == [f"Error: {tmp_path / 'Dockerfile'}:2: HEALTHCHECK is not supported "
                                          "(supported: ADD, ARG, CMD, COPY, ENTRYPOINT, ENV, FROM, RUN, USER, "
                                          "WORKDIR; ignored: EXPOSE, LABEL, MAINTAINER, VOLUME)"]


def test_arg_before_from_is_substituted() -> None:
    from aenv_node.cli.aenv.dockerfile import expand_from

    out = expand_from("ARG REG=docker.io\nARG V=3.12\nFROM --platform=linux/amd64 \\\n  ${REG}/python:$V AS app\nRUN x\n")
    assert out.splitlines() == ["ARG REG=docker.io", "ARG V=3.12", "FROM --platform=linux/amd64 docker.io/python:3.12 AS app",
                                "", "RUN x"]


def test_arg_without_value_in_from_is_an_error() -> None:
    from aenv_node.cli.aenv.dockerfile import expand_from

    with pytest.raises(DockerfileError) as info:
        expand_from("ARG V\nFROM python:${V}\n")
    assert str(info.value).startswith("Dockerfile:2: FROM uses $V")
