"""The answers shmctl.launch gives without typer are typer's own, byte for byte, or not given.

``shmctl --help``, each command's help and the fixed Tab completions come from
``shmctl/answers.py`` (rendered by ``shmctl.prerender``). Each is compared here with what
``shmctl.app.main`` (typer) prints for the same request in the same environment: on a pipe, on
terminals of several widths, with COLUMNS, NO_COLOR, SHMCTL_ROOT set.
"""

from __future__ import annotations

import fcntl
import os
import pty
import select
import shutil
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import typer

from shmctl import answers, commands, launch, prerender

#: The kept answers are printed only with the typer that rendered them (shmctl.launch falls
#: back to typer with any other): a typer release within pyproject's range must not turn CI red.
rendered_by_this_typer = pytest.mark.skipif(
    typer.__version__ != answers.TYPER_VERSION,
    reason=f"answers rendered with typer {answers.TYPER_VERSION}, this venv has {typer.__version__}: "
    "run `make answers`",
)

REPO = Path(__file__).resolve().parents[2]
THROUGH_TYPER = [sys.executable, "-c", "import sys; from shmctl.app import main; sys.exit(main())"]
LAUNCH = [sys.executable, "-m", "shmctl"]
HELP_REQUESTS = [
    (),
    ("--help",),
    ("-h",),
    *((name, flag) for name in commands.MODULES for flag in ("--help", "-h")),
]


def _environ(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "SHMCTL_ROOT")}
    return env | extra


def _run(
    argv: list[str], env: dict[str, str], stdout: int | None = subprocess.PIPE, cwd: Path = REPO
) -> tuple[int, bytes, bytes]:
    done = subprocess.run(
        argv, env=env, stdout=stdout, stderr=subprocess.PIPE, cwd=cwd, timeout=60, check=False
    )
    return done.returncode, done.stdout or b"", done.stderr


@rendered_by_this_typer
def test_the_kept_answers_are_current() -> None:
    # Stale answers are never printed (the fingerprint), but then every --help pays for typer.
    done = subprocess.run(
        [sys.executable, "-m", "shmctl.prerender", "--check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")


@rendered_by_this_typer
def test_every_help_is_kept_for_a_pipe() -> None:
    for argv in HELP_REQUESTS:
        assert launch.prerendered_help(list(argv), {"COLUMNS": "80"}) is not None, argv


@pytest.mark.parametrize("argv", HELP_REQUESTS, ids=lambda a: " ".join(a) or "bare")
def test_help_on_a_pipe_is_typers(argv: tuple[str, ...]) -> None:
    env = _environ()
    assert _run([*LAUNCH, *argv], env) == _run([*THROUGH_TYPER, *argv], env)


@pytest.mark.parametrize(
    "extra",
    [
        {"COLUMNS": "60"},
        {"COLUMNS": "79"},
        {"COLUMNS": "80"},
        {"COLUMNS": "200"},
        {"COLUMNS": "wide"},
        {"COLUMNS": "0"},
        {"NO_COLOR": "1"},
        {"SHMCTL_ROOT": "/nonexistent"},
        {"TERM": "dumb"},
    ],
    ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()),
)
@pytest.mark.parametrize("argv", [("--help",), ("scan", "--help"), ("reap", "-h")], ids=" ".join)
def test_help_in_each_environment_is_typers(argv: tuple[str, ...], extra: dict[str, str]) -> None:
    env = _environ(**extra)
    assert _run([*LAUNCH, *argv], env) == _run([*THROUGH_TYPER, *argv], env)


def _on_a_terminal(argv: list[str], columns: int) -> tuple[int, bytes]:
    """``argv`` with stdout on a pty ``columns`` wide (COLUMNS unset: the width is the pty's)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    proc = subprocess.Popen(argv, stdout=follower, stderr=subprocess.DEVNULL, env=_environ(), cwd=REPO)
    os.close(follower)
    got = b""
    try:
        while select.select([leader], [], [], 30)[0]:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            got += chunk
    finally:
        os.close(leader)
    return proc.wait(30), got


@pytest.mark.parametrize("columns", [70, 80, 132])
def test_help_on_a_terminal_is_typers(columns: int) -> None:
    for argv in (["--help"], ["scan", "--help"]):
        assert _on_a_terminal([*LAUNCH, *argv], columns) == _on_a_terminal([*THROUGH_TYPER, *argv], columns)


def test_help_narrower_than_80_columns_is_left_to_typer() -> None:
    assert launch.prerendered_help(["--help"], {"COLUMNS": "79"}) is None
    assert launch.prerendered_help(["--help"], {"COLUMNS": "80"}) == answers.HELP[()]


def _completion_env(words: str, cword: int) -> dict[str, str]:
    return {"_SHMCTL_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(cword)}


def _requests() -> list[tuple[str, int]]:
    """(COMP_WORDS, COMP_CWORD) of every kept completion, at several prefixes and a miss."""
    found = []
    for path, kept in answers.OPTIONS.items():
        words = " ".join(("shmctl", *path))
        for prefix in {"-", "--", "-h", "--x", *(o[:3] for o in kept)}:
            found.append((f"{words} {prefix}", len(path) + 1))
    for key, kept in answers.VALUES.items():
        words = " ".join(("shmctl", *key))
        for prefix in {"", "zz", "/tm", "x/y", *(v[:1] for v in kept), *(v[:2] for v in kept)}:
            found.append((f"{words} {prefix}", len(key) + 1))
    return sorted(found)


@rendered_by_this_typer
def test_every_kept_completion_is_typers() -> None:
    # typer's answer in this process (shmctl.prerender calls shmctl.app.main), launch's from
    # its function; the console script's bytes are compared below.
    for words, cword in _requests():
        ours = launch.prerendered_completions(_completion_env(words, cword))
        assert ours is not None, words
        typers = prerender.complete(words, cword)
        if "-h" in ours:  # typer lists -h and --help in either order from run to run
            ours, typers = sorted(ours), sorted(typers)
        assert ours == typers, words


def _after_given_options() -> list[str]:
    """COMP_WORDS with options given before the word completed: each option of each command
    (with a value where it takes one), then an option prefix or the value of another option."""
    found = []
    for command, table in answers.GIVEN.items():
        for name, (_, takes_value, _) in table.items():
            given = f"shmctl {command} {name} 1" if takes_value else f"shmctl {command} {name}"
            found += [f"{given} -", f"{given} --", f"{given} {name}"]
            found += [f"{given} {key[1]} " for key in answers.VALUES if key[0] == command and len(key) == 2]
            if takes_value and name.startswith("--"):
                found.append(f"shmctl {command} {name}=1 --")
        options = [n for n, (_, takes, _) in table.items() if not takes][:3]
        found.append(f"shmctl {command} {' '.join(options)} -")
    return found


@rendered_by_this_typer
def test_options_already_given_are_left_out_as_typer_leaves_them() -> None:
    for words in _after_given_options():
        cword = len(words.split()) - (0 if words.endswith(" ") else 1)
        ours = launch.prerendered_completions(_completion_env(words, cword))
        assert ours is not None, words
        typers = prerender.complete(words, cword)
        if "-h" in ours:  # typer lists -h and --help in either order from run to run
            ours, typers = sorted(ours), sorted(typers)
        assert ours == typers, words


@rendered_by_this_typer
def test_engine_ids_are_listed_from_the_root_the_words_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("vllm_offload_abc-1.mmap", "vllm_offload_abc-1.mmap.1", "vllm_offload_abd-2.mmap", "other"):
        (tmp_path / name).touch()
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("SHMCTL_ROOT", str(tmp_path))
    for words in (
        "shmctl reap --engine ",
        "shmctl reap --engine ab",
        f"shmctl reap --root {tmp_path} --engine a",
        f"shmctl reap --root={tmp_path} --json --engine ",
        f"shmctl reap --root {tmp_path}/empty --engine ",
        f"shmctl reap --root {tmp_path}/empty --root {tmp_path} --engine ",
        "shmctl reap --root /nonexistent --engine ",
        "shmctl reap --engine abc-1 --engine ",
    ):
        cword = len(words.split()) - (0 if words.endswith(" ") else 1)
        ours = launch.prerendered_completions({**_completion_env(words, cword), "SHMCTL_ROOT": str(tmp_path)})
        assert ours == prerender.complete(words, cword), words
    assert launch.prerendered_completions(_completion_env("shmctl reap --engine ", 3)) is not None


@pytest.mark.parametrize(
    ("words", "cword"),
    [
        ("shmctl scan --json --family ", 4),
        ("shmctl scan --root /tmp --", 4),
        ("shmctl reap -n --y", 3),
        ("shmctl init --roundtrip --no-", 3),
        ("shmctl watch --root a --root b --r", 6),
        ("shmctl completion ", 2),
        ("shmctl init --fail-at region.", 3),
        ("shmctl scan --family ", 3),
        ("shmctl scan --family to", 3),
        ("shmctl scan --root /tm", 3),
        ("shmctl --color ", 2),
        ("shmctl -", 1),
        ("shmctl reap --engine ", 3),  # the root's engines, listed by shmctl.launch too
        ("shmctl init --world-size 3 --rank ", 5),  # the ranks of the world size typed: typer's
        ("shmctl scan --grace -", 3),  # a missing value: click's parse stops there
        ("shmctl scan --grace -1 --", 4),
        ("shmctl scan -- --", 3),
        ("shmctl reap -ny --", 3),
        ("shmctl scan --json=1 --", 3),
        ("shmctl scan --color=", 2),
        ("shmctl scan '--fam", 2),
    ],
)
def test_the_console_script_completes_as_typer(words: str, cword: int) -> None:
    env = _environ(**_completion_env(words, cword))
    ours, typers = _run(LAUNCH, env), _run(THROUGH_TYPER, env)
    assert (ours[0], sorted(ours[1].splitlines()), ours[2]) == (
        typers[0],
        sorted(typers[1].splitlines()),
        typers[2],
    )


def test_completions_that_depend_on_the_machine_are_not_kept() -> None:
    for words, cword in [
        ("shmctl init --world-size 3 --rank ", 5),
        ("shmctl scan --grace -", 3),
        ("shmctl scan --grace -1 --", 4),
        ("shmctl scan -- --", 3),
        ("shmctl reap -ny --", 3),
        ("shmctl scan --json=1 --", 3),
        ("shmctl scan --color=", 2),
        ("shmctl scan ", 2),
        ("shmctl --color never scan --", 4),
    ]:
        assert launch.prerendered_completions(_completion_env(words, cword)) is None, words


@rendered_by_this_typer
@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["--help"], {}),
        (["scan", "--help"], {}),
        ([], _completion_env("shmctl scan --", 2)),
        ([], _completion_env("shmctl scan --family ", 3)),
        ([], _completion_env("shmctl reap --engine ", 3)),
    ],
    ids=["help", "scan-help", "options", "values", "engines"],
)
def test_kept_answers_are_printed_without_typer(argv: list[str], env: dict[str, str]) -> None:
    probe = (
        "import os, sys; from shmctl import launch; "
        f"os.environ.update({env!r}); sys.argv = ['shmctl', *{argv!r}]; "
        "code = launch.main(); sys.stdout.flush(); "
        "print(code, sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('typer', 'rich') or m.startswith('kvoffload.liveness')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=_environ(),
        cwd=REPO,
        timeout=60,
        check=True,
    )
    assert done.stdout.splitlines()[-1] == "0 []"


def test_an_edited_source_makes_typer_answer(tmp_path: Path) -> None:
    # A copy of the tree whose scan help says something else: the kept help no longer matches
    # its sources, so typer renders the new one.
    for package in ("shmctl", "kvoffload"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    helptext = tmp_path / "shmctl" / "helptext.py"
    old = "Which region files are live or orphaned, and why."
    helptext.write_text(helptext.read_text().replace(old, "Which files are live, edited."))
    env = _environ(PYTHONPATH=str(tmp_path))
    code, out, err = _run([sys.executable, "-m", "shmctl", "--help"], env, cwd=tmp_path)
    assert (code, err) == (0, b"")
    assert b"Which files are live, edited." in out


def test_another_typer_makes_typer_answer(tmp_path: Path) -> None:
    # vLLM's images carry their own typer: help rendered by another version is not printed.
    import typer

    shutil.copytree(
        Path(typer.__file__).parent, tmp_path / "typer", ignore=shutil.ignore_patterns("__pycache__")
    )
    init = tmp_path / "typer" / "__init__.py"
    init.write_text(init.read_text() + "# another release\n")
    probe = (
        "import sys; from shmctl import launch; sys.argv = ['shmctl', '--help']; "
        "code = launch.main(); sys.stdout.flush(); print(code, 'typer' in sys.modules)"
    )
    env = _environ(PYTHONPATH=os.pathsep.join((str(tmp_path), str(REPO))))
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=60,
        check=True,
    )
    assert done.stdout.splitlines()[-1] == "0 True"


def test_help_into_a_full_disk_is_typers_one_line() -> None:
    env = _environ()
    with open("/dev/full", "wb") as full:
        ours = _run([*LAUNCH, "--help"], env, stdout=full.fileno())
        typers = _run([*THROUGH_TYPER, "--help"], env, stdout=full.fileno())
    assert ours == typers
    assert ours[0] != 0


def test_help_into_a_closed_pipe_is_a_quiet_0() -> None:
    read, write = os.pipe()
    os.close(read)
    try:
        assert _run([*LAUNCH, "--help"], _environ(), stdout=write) == (0, b"", b"")
    finally:
        os.close(write)
