"""``--color`` means the same before the command and after it (issue #32).

The root takes ``--color`` and so does every command. A value given in either place decides,
and when both are given the later one on the line wins (as git's ``-c``); a command's own
default (``auto``) never undoes the root's. ``NO_COLOR`` turns ``auto`` off and nothing else:
``--color always`` typed on the line still colours. Checked on a real pseudo-terminal and in
a pipe, for every placement.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.hostile import shmctl
from tests.support.terminal import on_a_terminal

#: (what goes before the command, what goes after it) -> the mode that should win.
PLACEMENTS = {
    "neither": ((), (), "auto"),
    "root-always": (("--color", "always"), (), "always"),
    "root-never": (("--color", "never"), (), "never"),
    "command-always": ((), ("--color", "always"), "always"),
    "command-never": ((), ("--color", "never"), "never"),
    "root-never-command-always": (("--color", "never"), ("--color", "always"), "always"),
    "root-always-command-never": (("--color", "always"), ("--color", "never"), "never"),
    "root-always-command-auto": (("--color", "always"), ("--color=auto",), "auto"),
}


def expected_colour(mode: str, *, terminal: bool, no_color: bool) -> bool:
    if mode == "auto":
        return terminal and not no_color
    return mode == "always"


def argv(placement: str, root: Path) -> list[str]:
    before, after, _ = PLACEMENTS[placement]
    return [*before, "scan", "--root", str(root), *after]


@pytest.fixture
def empty_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    return root


@pytest.mark.parametrize("no_color", [False, True], ids=["", "NO_COLOR"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_color_on_a_terminal_is_the_last_one_given(placement: str, no_color: bool, empty_root: Path) -> None:
    run = on_a_terminal(*argv(placement, empty_root), env={"NO_COLOR": "1"} if no_color else None)
    assert run.code == 0, run.text
    assert run.plain == f"no region files in {empty_root}\n"
    mode = PLACEMENTS[placement][2]
    assert ("\x1b[" in run.text) == expected_colour(mode, terminal=True, no_color=no_color), run.text


@pytest.mark.parametrize("no_color", [False, True], ids=["", "NO_COLOR"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_color_in_a_pipe_is_the_last_one_given(placement: str, no_color: bool, empty_root: Path) -> None:
    done = shmctl(*argv(placement, empty_root), env={"NO_COLOR": "1" if no_color else None})
    assert (done.returncode, done.stderr) == (0, "")
    mode = PLACEMENTS[placement][2]
    assert ("\x1b[" in done.stdout) == expected_colour(mode, terminal=False, no_color=no_color), done.stdout


@pytest.mark.parametrize("where", ["root", "command"])
def test_an_unknown_color_is_one_usage_line_wherever_it_is_given(where: str, empty_root: Path) -> None:
    args = ["--color", "sometimes", "scan"] if where == "root" else ["scan", "--color", "sometimes"]
    done = shmctl(*args, "--root", str(empty_root))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("shmctl: error: Invalid value for '--color': 'sometimes' is not one of")
    assert done.stderr.count("\n") == 1
