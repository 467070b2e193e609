"""Shell completion: the shipped scripts are current, and Tab completes from live data.

That shells find and load the installed files is tests/system/test_install_shells.py's.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload import faults
from shmctl.completion_scripts import SCRIPTS, SHELLS

REPO = Path(__file__).resolve().parents[2]


def complete(words: str, cword: int, env: dict[str, str] | None = None) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-m", "shmctl"],
        env={
            **os.environ,
            **(env or {}),
            "COMP_WORDS": words,
            "COMP_CWORD": str(cword),
            "_SHMCTL_COMPLETE": "complete_bash",
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return result.stdout.split()


def typer_script(shell: str) -> str:
    """What typer writes for shmctl (``--show-completion``): the protocol each Tab speaks."""
    return subprocess.run(
        [sys.executable, "-m", "shmctl", "--show-completion", shell],
        env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout  # `python -m shmctl` names itself like the console script would


@pytest.mark.parametrize("shell", ["bash", "fish"])
def test_the_bash_and_fish_scripts_are_typers_own(shell: str) -> None:
    assert SCRIPTS[shell] == typer_script(shell), (
        "typer's script changed: update shmctl/completion_scripts.py"
    )


def test_the_zsh_script_holds_typers_completion_function_unchanged() -> None:
    typer_zsh = typer_script("zsh").splitlines()
    assert typer_zsh[-1] == "compdef _shmctl_completion shmctl"
    body = typer_zsh[typer_zsh.index("_shmctl_completion() {") : -1]
    ours = SCRIPTS["zsh"].splitlines()
    assert ours[0] == typer_zsh[0] == "#compdef shmctl"
    start = ours.index("_shmctl_completion() {")
    assert ours[start : start + len(body)] == body


#: Each shell's script and the files of completions/ that hold it.
SHIPPED = {"bash": ("shmctl", "shmctl.bash"), "zsh": ("_shmctl", "shmctl.zsh"), "fish": ("shmctl.fish",)}


def shmctl(*argv: str, through_typer: bool = False) -> subprocess.CompletedProcess[str]:
    """The console script (``shmctl.launch``), or shmctl.app's main without it."""
    program = (
        [sys.executable, "-c", "import sys; from shmctl.app import main; sys.exit(main())"]
        if through_typer
        else [sys.executable, "-m", "shmctl"]
    )
    env = {k: v for k, v in os.environ.items() if k != "_SHMCTL_COMPLETE"}
    return subprocess.run([*program, *argv], env=env, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("through_typer", [False, True], ids=["launch", "typer"])
@pytest.mark.parametrize("shell", SCRIPTS)
def test_completion_prints_exactly_the_shipped_files(shell: str, through_typer: bool) -> None:
    done = shmctl("completion", shell, through_typer=through_typer)
    assert (done.returncode, done.stderr) == (0, "")
    for name in SHIPPED[shell]:
        assert done.stdout == (REPO / "completions" / name).read_text(), name


def test_every_file_of_completions_is_a_script_completion_prints() -> None:
    shipped = {name for names in SHIPPED.values() for name in names}
    assert shipped == {p.name for p in (REPO / "completions").iterdir()}
    assert set(SHIPPED) == set(SHELLS)


@pytest.mark.parametrize("through_typer", [False, True], ids=["launch", "typer"])
def test_a_shell_completion_does_not_know_is_one_line_exit_2_with_the_choices(through_typer: bool) -> None:
    done = shmctl("completion", "tcsh", through_typer=through_typer)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("shmctl: error: ")
    assert "'tcsh'" in done.stderr
    assert "(fix: name one of bash, zsh, fish" in done.stderr


def test_completion_into_a_full_disk_is_one_line_exit_3() -> None:
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "shmctl", "completion", "bash"],
            stdout=full,
            capture_output=False,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 3
    assert done.stderr.startswith("shmctl: error: stdout: No space left on device (fix: ")
    assert done.stderr.count("\n") == 1


def test_completion_into_a_closed_pipe_is_a_quiet_0() -> None:
    done = subprocess.run(
        f"{shlex.quote(sys.executable)} -m shmctl completion zsh | head -c 1 >/dev/null; "
        'echo "${PIPESTATUS[0]}"',
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (done.stdout, done.stderr) == ("0\n", "")


def test_a_completion_script_is_printed_without_importing_typer_or_building_a_command() -> None:
    probe = (
        "import sys; from shmctl import launch; sys.argv = ['shmctl', 'completion', 'fish']; "
        "code = launch.main(); sys.stdout.flush(); "
        "print(code, sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'rich', 'kvoffload') "
        "or m.startswith('shmctl.commands')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout == SCRIPTS["fish"] + "0 []\n"


def test_completion_of_completion_offers_the_shells() -> None:
    assert complete("shmctl completion ", 2) == ["bash", "zsh", "fish"]
    assert complete("shmctl completion z", 2) == ["zsh"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """completions/ as ``make completions`` writes it now."""
    out = tmp_path_factory.mktemp("completions")
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_completions.py"), "-o", str(out)],
        cwd=REPO,
        capture_output=True,
        timeout=120,
        check=True,
    )
    return out


def test_completions_holds_what_the_generator_writes_and_nothing_else(generated: Path) -> None:
    assert sorted(p.name for p in (REPO / "completions").iterdir()) == sorted(
        p.name for p in generated.iterdir()
    )


@pytest.mark.parametrize("name", ["shmctl", "_shmctl", "shmctl.bash", "shmctl.zsh", "shmctl.fish"])
def test_every_shipped_completion_file_is_current(generated: Path, name: str) -> None:
    assert (generated / name).read_text() == (REPO / "completions" / name).read_text(), (
        "run `make completions`"
    )


def test_commands_complete() -> None:
    assert complete("shmctl ", 1) == [*_COMMANDS]


def test_fail_at_completes_from_the_fault_registry() -> None:
    assert complete("shmctl init --fail-at region.", 3) == [
        n for n in faults.names() if n.startswith("region.")
    ]


def test_reap_engine_completes_engine_ids_of_the_root(tmp_path: Path) -> None:
    for name in ("vllm_offload_abc-1.mmap", "vllm_offload_abc-1.mmap.1", "vllm_offload_abd-2.mmap", "other"):
        (tmp_path / name).touch()
    assert complete(f"shmctl reap --root {tmp_path} --engine ab", 5) == ["abc-1", "abd-2"]
    assert complete("shmctl reap --engine ab", 3, {"SHMCTL_ROOT": str(tmp_path)}) == ["abc-1", "abd-2"]


def _enumerated_options() -> list[tuple[str, str, list[str]]]:
    """(command, option, its choices) for every option whose metavar lists its values (a|b|c)."""
    import typer.main

    from shmctl.app import app

    root = typer.main.get_command(app)
    ctx = root.make_context("shmctl", [], resilient_parsing=True)
    found = []
    for name in [None, *root.list_commands(ctx)]:  # type: ignore[attr-defined]
        command = root if name is None else root.get_command(ctx, name)  # type: ignore[attr-defined]
        for param in command.params:
            metavar = getattr(param, "metavar", None) or ""
            if "|" in metavar and param.opts[0].startswith("--"):
                choices = [c for c in metavar.split("|") if c.islower()]  # R stands for a number
                found.append((name or "", param.opts[0], choices))
    return found


@pytest.mark.parametrize(("command", "option", "choices"), _enumerated_options(), ids=str)
def test_every_enumerated_option_completes_its_values(command: str, option: str, choices: list[str]) -> None:
    words = " ".join(w for w in ("shmctl", command, option) if w) + " "
    offered = complete(words, len(words.split()))
    assert choices
    assert set(choices) <= set(offered)


def test_rank_completes_the_workers_of_the_world_size_typed() -> None:
    assert complete("shmctl init --world-size 3 --rank ", 5) == ["scheduler", "0", "1", "2"]


#: Command words as bash hands them over: every prefix of every command, none, nonsense, an
#: option, a quoted word, and a later word (which the fast path leaves to typer).
_COMMANDS = ("scan", "reap", "init", "faults", "audit", "metrics", "watch", "doctor", "completion", "man")
_COMMAND_WORDS = sorted(
    {f"shmctl {name[:n]}" for name in _COMMANDS for n in range(len(name) + 1)}
    | {"shmctl", "shmctl x", "shmctl -", "shmctl --c", "shmctl 's", "shmctl \\s", "shmctl scan --r"}
)


def _answer(argv: list[str], words: str) -> tuple[int, str]:
    cword = "2" if words.count(" ") > 1 else "1"
    env = {**os.environ, "COMP_WORDS": words, "COMP_CWORD": cword, "_SHMCTL_COMPLETE": "complete_bash"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)
    return done.returncode, done.stdout


def test_the_command_word_is_answered_as_typer_answers_it() -> None:
    # The console script answers a bash completion of the command word without typer
    # (shmctl.launch); typer's own answer comes from shmctl.app. Same bytes, same status.
    through_typer = [sys.executable, "-c", "import sys; from shmctl.app import main; sys.exit(main())"]
    launch = [sys.executable, "-m", "shmctl"]
    for words in _COMMAND_WORDS:
        ours, typers = _answer(launch, words), _answer(through_typer, words)
        if launch_answers(words):
            assert ours == typers, words
        else:  # typer answers both; it lists -h and --help in either order from run to run
            assert (ours[0], sorted(ours[1].splitlines())) == (typers[0], sorted(typers[1].splitlines())), (
                words
            )
    assert _answer(launch, "shmctl sc") == (0, "scan\n")


def launch_answers(words: str) -> bool:
    """Does shmctl.launch answer this command word itself (without typer)?"""
    from shmctl.launch import command_word_completions

    env = {"_SHMCTL_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": "1"}
    return words.count(" ") <= 1 and command_word_completions(env) is not None


def test_the_command_word_is_answered_without_importing_typer() -> None:
    probe = (
        "import os, sys; from shmctl import launch; "
        "os.environ.update(_SHMCTL_COMPLETE='complete_bash', COMP_WORDS='shmctl re', COMP_CWORD='1'); "
        "launch.main(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('typer', 'rich', 'kvoffload')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=30, check=True
    )
    assert done.stdout.splitlines() == ["reap", "[]"]
