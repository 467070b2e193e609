"""A signal that lands while shmctl reports its outcome ends it with one line, never a traceback.

``strace -e inject=write:signal=SIG:when=N`` delivers the signal right after the N-th write
(the error line, the JSON document): the windows a Ctrl-C, a service stop or a closed terminal
hit when they come at the end of a command.
"""

from __future__ import annotations

import signal
import subprocess

import pytest

from tests.support.traced import TRACED_ENV, cli, needs_strace

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def signalled_after_write(when: int, signum: signal.Signals, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            "strace",
            "-f",
            "-qq",
            "-o",
            "/dev/null",
            "-e",
            "trace=write",
            "-e",
            f"inject=write:signal={signum.name}:when={when}",
            *cli(*argv),
        ],
        capture_output=True,
        text=True,
        env=TRACED_ENV,
        timeout=60,
        check=False,
    )


@needs_strace
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_a_signal_right_after_the_error_line_exits_with_that_line_alone(signum: signal.Signals) -> None:
    done = signalled_after_write(1, signum, "init", "--kv-transfer-config", "{bad")
    assert "Traceback" not in done.stderr
    assert done.returncode == 128 + signum
    [line] = done.stderr.splitlines()
    assert line.startswith("shmctl: error: ")
    assert done.stdout == ""


@needs_strace
@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_a_signal_right_after_a_commands_output_exits_without_a_traceback(signum: signal.Signals) -> None:
    done = signalled_after_write(1, signum, "faults", "--json")
    assert "Traceback" not in done.stderr
    assert done.returncode == 128 + signum
    assert len(done.stderr.splitlines()) <= 1  # at most the "interrupted" line
    assert done.stdout.startswith("{")


@needs_strace
@pytest.mark.parametrize("argv", [("--help",), ("scan", "--help")], ids=" ".join)
def test_ctrl_c_during_an_answer_given_without_typer_is_one_line(argv: tuple[str, ...]) -> None:
    """``--help`` is printed by shmctl.launch, before shmctl.app's signal handling exists."""
    done = signalled_after_write(1, signal.SIGINT, *argv)
    assert "Traceback" not in done.stderr
    assert done.returncode == 130
    assert done.stderr == "shmctl: error: interrupted\n"
    assert done.stdout.startswith("Usage: shmctl")
