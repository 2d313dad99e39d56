"""Every ``aenv`` command parses its arguments and has help; flags that are wrong fail with one line."""

from __future__ import annotations

import click
import pytest

from aenv_node.cli.aenv import cli

# the command set the issue fixes (names as AgentENV's CLI), and the import of a VM without envd (issue 17's
# control-plane bench guest; docs/templates.md)
EXPECTED = {
    "auth", "pull", "build", "template ls", "template rm", "template watch", "start", "cn", "exec", "upload",
    "download", "ls", "pause", "resume", "timeout", "rm", "snapshot create", "snapshot ls", "snapshot rm", "fork",
    "events", "logs", "completion", "template import-vm",
}


def _leaves(group: click.Group, prefix: str = "") -> dict[str, click.Command]:
    out: dict[str, click.Command] = {}
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            out.update(_leaves(cmd, f"{prefix}{name} "))
        else:
            out[f"{prefix}{name}"] = cmd
    return out


LEAVES = _leaves(cli)


def test_exactly_the_issue_commands() -> None:
    assert set(LEAVES) == EXPECTED


@pytest.mark.parametrize("path", sorted(EXPECTED))
def test_help(run_aenv, path: str) -> None:
    r = run_aenv(*path.split(), "--help")
    assert r.code == 0, r.err
    assert f"Usage: aenv {path}" in r.out


@pytest.mark.parametrize("path", sorted(EXPECTED - {"auth", "completion"}))
def test_url_and_key_on_every_remote_command(path: str) -> None:
    names = {opt for p in LEAVES[path].params for opt in getattr(p, "opts", [])}
    assert {"--url", "--key"} <= names


@pytest.mark.parametrize("path", ["ls", "template ls", "snapshot ls", "snapshot create", "fork", "events", "logs",
                                  "start", "pull", "build"])
def test_json_where_data_is_printed(path: str) -> None:
    assert "--json" in {opt for p in LEAVES[path].params for opt in getattr(p, "opts", [])}


@pytest.mark.parametrize("args, needle", [
    (["ls", "--bogus"], "No such option"),
    (["start"], "Missing argument"),
    (["timeout", "sb1", "soon"], "not a valid integer"),
    (["fork", "sb1", "--count", "0"], "--count"),
    (["completion", "tcsh"], "tcsh"),
    (["exec", "sb1"], "Missing argument"),
    (["pull", "python:3", "--username", "u"], "--password-stdin"),
    (["upload", "sb1", "/does/not/exist", "/tmp/x"], "does not exist"),
])
def test_bad_arguments_are_one_line(run_aenv, args: list[str], needle: str) -> None:
    node = [] if args[0] == "completion" else ["--url", "http://127.0.0.1:9", "--key", "k"]
    r = run_aenv(*args, *node)
    assert r.code == 2
    assert r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], r.err


def test_metadata_must_be_key_value(run_aenv) -> None:
    r = run_aenv("ls", "--metadata", "novalue", "--url", "http://127.0.0.1:9", "--key", "k")
    assert r.code == 2 and "KEY=VALUE" in r.err and len(r.err.strip().splitlines()) == 1


def test_start_checks_cpu_and_mem_before_asking_the_node(run_aenv) -> None:
    for flag, value in (("--cpu", "0"), ("--cpu", "65"), ("--mem", "64")):
        r = run_aenv("start", "base", flag, value, "--url", "http://127.0.0.1:9", "--key", "k")
        assert r.code == 2 and flag in r.err and len(r.err.strip().splitlines()) == 1, r.err
    r = run_aenv("start", "base", "--cpu", "4", "--url", "http://127.0.0.1:9", "--key", "k")
    assert r.code == 1 and r.err.startswith("Error: cannot reach") and len(r.err.strip().splitlines()) == 1


def test_not_authenticated_is_one_line(run_aenv) -> None:
    r = run_aenv("ls")
    assert r.code == 1
    assert r.err.strip() == "Error: not authenticated: run `aenv auth --url URL --key KEY` first"


def test_exec_keeps_the_commands_own_flags() -> None:
    ctx = LEAVES["exec"].make_context("exec", ["sb1", "--user", "root", "--", "ls", "-la", "--color"])
    assert ctx.params["command"] == ("ls", "-la", "--color")
    assert ctx.params["user"] == "root"


def test_completion_bash(run_aenv) -> None:
    r = run_aenv("completion", "bash")
    assert r.code == 0
    assert "_AENV_COMPLETE=bash_complete" in r.out
    assert "complete -o nosort -F" in r.out and " aenv" in r.out


@pytest.mark.parametrize("shell, needle", [("zsh", "#compdef aenv"), ("fish", "complete --no-files --command aenv")])
def test_completion_other_shells(run_aenv, shell: str, needle: str) -> None:
    r = run_aenv("completion", shell)
    assert r.code == 0 and needle in r.out


def test_completion_answers_subcommands(monkeypatch, capsys) -> None:
    monkeypatch.setenv("_AENV_COMPLETE", "bash_complete")
    monkeypatch.setenv("COMP_WORDS", "aenv snap")
    monkeypatch.setenv("COMP_CWORD", "1")
    with pytest.raises(SystemExit):
        cli.main(args=[], prog_name="aenv", complete_var="_AENV_COMPLETE")
    assert "plain,snapshot" in capsys.readouterr().out
