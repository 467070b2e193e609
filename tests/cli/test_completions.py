"""Shell completion: the shipped scripts are current, and Tab completes from live data.

That shells find and load the installed files is tests/system/test_install_shells.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload import faults

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


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_shipped_completion_scripts_are_current(shell: str) -> None:
    fresh = subprocess.run(
        [sys.executable, "-m", "shmctl", "--show-completion", shell],
        env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    # `python -m shmctl` names itself like the console script would.
    assert fresh == (REPO / "completions" / f"shmctl.{shell}").read_text(), "run `make completions`"


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


def test_the_zsh_function_file_calls_typers_completion_function_instead_of_binding_it() -> None:
    typer_zsh = (REPO / "completions" / "shmctl.zsh").read_text().splitlines()
    function_file = (REPO / "completions" / "_shmctl").read_text().splitlines()
    assert typer_zsh[-1] == "compdef _shmctl_completion shmctl"
    assert function_file[0] == "#compdef shmctl"
    assert function_file[-1] == '_shmctl_completion "$@"'
    # typer's function itself, and with it the _SHMCTL_COMPLETE protocol, is unchanged.
    body = typer_zsh[typer_zsh.index("_shmctl_completion() {") : -1]
    assert function_file[-1 - len(body) : -1] == body


def test_commands_complete() -> None:
    assert complete("shmctl ", 1) == ["scan", "reap", "init", "faults", "audit", "metrics", "watch", "doctor"]


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
_COMMANDS = ("scan", "reap", "init", "faults", "audit", "metrics", "watch", "doctor")
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
