"""Help that an operator can trust: whole summaries, examples in every command's help and in the
man page, and every example accepted by the parser of the command it shows."""

from __future__ import annotations

import shlex
import subprocess
import sys
from typing import Any

import pytest
import typer.main

from shmctl import helptext
from shmctl.app import app
from tests.support.procs import REPO

ROOT: Any = typer.main.get_command(app)


def _commands() -> list[str]:
    ctx = ROOT.context_class(ROOT, info_name="shmctl")
    return list(ROOT.list_commands(ctx))


def _help(*argv: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "shmctl", *argv, "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"COLUMNS": "80", "PATH": "/usr/bin:/bin"},
        timeout=60,
        check=True,
    )
    return done.stdout


def test_every_command_has_a_summary_and_examples() -> None:
    assert set(_commands()) == set(helptext.SUMMARIES) == set(helptext.EXAMPLES)


def test_the_command_list_prints_every_summary_whole_at_80_columns() -> None:
    text = _help()
    width = max(map(len, helptext.SUMMARIES))  # click pads every name to the longest
    for name, summary in helptext.SUMMARIES.items():
        assert len(summary) <= helptext.SUMMARY_LIMIT, name
        assert f"  {name:<{width}}  {summary}\n" in text, name
    assert "..." not in text.split("Commands:", 1)[1]


@pytest.mark.parametrize("command", sorted(helptext.EXAMPLES))
def test_each_help_ends_with_its_examples(command: str) -> None:
    text = _help(command)
    tail = "".join(f"    # {what}\n    $ {line}\n" for line, what in helptext.EXAMPLES[command])
    assert text.endswith("  Examples:\n\n" + tail)


def _examples() -> list[tuple[str, str]]:
    pairs = [(line, "root") for line, _ in helptext.ROOT_EXAMPLES]
    pairs += [(line, name) for name, examples in helptext.EXAMPLES.items() for line, _ in examples]
    return pairs


@pytest.mark.parametrize(("line", "command"), _examples(), ids=[p[0] for p in _examples()])
def test_every_example_parses_with_its_commands_own_parser(line: str, command: str) -> None:
    """An example that names a flag the command lacks, or gives a choice it refuses, fails here."""
    words = shlex.split(_shmctl_part(line))
    if words[0] == "sudo":
        words = words[1:]
    assert words[0] == "shmctl"
    name = words[1]
    assert command in ("root", name)
    sub = ROOT.get_command(ROOT.context_class(ROOT, info_name="shmctl"), name)
    assert sub is not None, name
    ctx = sub.make_context(name, words[2:])  # raises click's usage error on a bad flag
    ctx.close()


def _shmctl_part(line: str) -> str:
    """The shmctl command of an example line: before a pipe or a redirection, inside ``<(...)``."""
    if line.startswith("source <(") and line.endswith(")"):
        line = line.removeprefix("source <(").removesuffix(")")
    return line.split(" | ", 1)[0].split(" > ", 1)[0]


def test_an_example_line_is_cut_to_its_shmctl_command() -> None:
    assert _shmctl_part("source <(shmctl completion bash)") == "shmctl completion bash"
    assert _shmctl_part('shmctl completion zsh > "${fpath[1]}/_shmctl"') == "shmctl completion zsh"
    assert _shmctl_part("shmctl man | man -l -") == "shmctl man"


def test_examples_never_teach_a_zero_grace() -> None:
    for line, _ in _examples():
        assert "--grace 0" not in line, line
