"""An operator's first hour (issue #32): the small things a new operator met, each pinned.

* ``audit --report FIFO`` (or ``--junit``) with no reader fails in bounded time, before the
  command runs, instead of hanging after it;
* a bad ``--root`` names where it came from: ``SHMCTL_ROOT=...`` or ``--root ...``;
* an error names the flag (``--all-users``), never a Python name;
* files skipped because they are other users' are said once on stderr.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmctl.app import main
from tests.support.hostile import shmctl
from tests.support.procs import region_path, write_file

NOBODY = 65534

# --- audit's outputs: a FIFO nobody reads -------------------------------------------------


@pytest.mark.parametrize("option", ["--report", "--junit"])
def test_a_fifo_nobody_reads_is_refused_before_the_command_runs(option: str, tmp_path: Path) -> None:
    fifo, marker, root = tmp_path / "out.fifo", tmp_path / "ran", tmp_path / "root"
    os.mkfifo(fifo)
    root.mkdir()
    # The old code ran the command, then blocked for ever opening the FIFO: the timeout fails it.
    done = shmctl("audit", "--root", str(root), option, str(fifo), "--", "touch", str(marker), timeout=60)
    assert (done.returncode, done.stdout) == (3, ""), done.stderr
    assert done.stderr == (
        f"shmctl: error: {option}: {fifo} is a FIFO that nothing reads (waited 3s for a reader) "
        f"(fix: start its reader first (cat {fifo} &), or name another file)\n"
    )
    assert not marker.exists()


def test_a_fifo_with_a_reader_gets_the_whole_report_after_the_command(tmp_path: Path) -> None:
    fifo, root = tmp_path / "out.fifo", tmp_path / "root"
    os.mkfifo(fifo)
    root.mkdir()
    with subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE) as reader:
        # The command writes to stdout: the report (on the FIFO) must not be mixed into it, and
        # the reader, there from the start, must not see its end of file before the report.
        done = shmctl("audit", "--root", str(root), "--report", str(fifo), "--", "echo", "from the command")
        received, _ = reader.communicate(timeout=60)
    assert (done.returncode, done.stdout) == (0, "from the command\n"), done.stderr
    assert b'"exit_reason": "clean"' in received
    assert received.endswith(b"}\n")


def test_an_output_the_system_refuses_is_exit_3_and_a_usage_error_exit_2(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    missing = shmctl("audit", "--root", str(root), "--report", str(tmp_path / "no" / "a.json"), "--", "true")
    dash = shmctl("audit", "--root", str(root), "--report", "-", "--", "true")
    assert (missing.returncode, dash.returncode) == (3, 2), (missing.stderr, dash.stderr)
    assert missing.stderr.count("\n") == dash.stderr.count("\n") == 1


# --- a bad root names where it came from ---------------------------------------------------

_CONFIG = (
    '{"kv_connector":"OffloadingConnector","kv_connector_extra_config":'
    '{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":104857600}}'
)
#: Every command that takes --root (and SHMCTL_ROOT), with what it needs to reach the root.
ROOTED_COMMANDS = {
    "scan": ["scan"],
    "reap": ["reap", "--dry-run"],
    "metrics": ["metrics"],
    "doctor": ["doctor"],
    "audit": ["audit", "--", "true"],
    "init": ["init", "--kv-transfer-config", _CONFIG, "--model", "llama-3-8b", "--dry-run"],
}


def _with_root(command: str, root: str) -> list[str]:
    args = ROOTED_COMMANDS[command]
    return [args[0], "--root", root, *args[1:]]


@pytest.mark.parametrize("command", list(ROOTED_COMMANDS))
def test_a_bad_shmctl_root_is_named_as_the_variable_with_a_fix_about_it(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    done = shmctl(*ROOTED_COMMANDS[command], env={"SHMCTL_ROOT": str(missing)})
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"shmctl: error: SHMCTL_ROOT={missing}: does not exist (fix: set SHMCTL_ROOT to the directory "
        "that holds the region files, or unset it for /dev/shm)"
    )
    assert "pass --root" not in done.stderr


@pytest.mark.parametrize("command", list(ROOTED_COMMANDS))
def test_a_bad_root_option_is_named_as_the_option(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    # The flag outranks a good SHMCTL_ROOT: the error must name the flag, not the variable.
    done = shmctl(*_with_root(command, str(missing)), env={"SHMCTL_ROOT": str(tmp_path)})
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"shmctl: error: --root {missing}: does not exist (fix: pass the directory that holds the "
        "region files as --root, or leave it out for /dev/shm)"
    )
    assert "SHMCTL_ROOT" not in done.stderr


def test_a_root_that_is_a_file_keeps_its_own_words_under_the_variable(tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("")
    done = shmctl("scan", env={"SHMCTL_ROOT": str(a_file)})
    assert done.returncode == 3
    assert done.stderr.startswith(f"shmctl: error: SHMCTL_ROOT={a_file}: is not a directory (fix: set ")


def test_another_path_in_an_error_is_not_named_as_the_root(tmp_path: Path) -> None:
    root, textfile = tmp_path / "root", tmp_path / "no-such-dir"
    root.mkdir()
    done = shmctl("metrics", "--textfile", str(textfile), env={"SHMCTL_ROOT": str(root)})
    assert done.returncode == 3
    assert done.stderr.startswith(f"shmctl: error: {textfile}: is not a directory"), done.stderr


# --- as another user: flags by their names, and what was skipped --------------------------


def as_nobody(argv: list[str]) -> tuple[int, str, str]:
    """``shmctl ARGV`` run in-process in a forked child as uid 65534: (exit, stdout, stderr).

    In-process because this interpreter's files may be private to root; the child imports
    only what ``main`` already imported here, so it is run once first, as root, to warm up.
    """
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to uid 65534")
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    code_r, code_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
            code = main(argv)
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os.write(code_w, str(code).encode())
            os._exit(0)
    for fd in (out_w, err_w, code_w):
        os.close(fd)
    # Small outputs: each pipe is read to its end in turn, then the child is reaped.
    with os.fdopen(out_r, errors="replace") as out, os.fdopen(err_r, errors="replace") as err:
        stdout, stderr = out.read(), err.read()
    with os.fdopen(code_r) as code_file:
        code = int(code_file.read())
    os.waitpid(pid, 0)
    return code, stdout, stderr


def warmed(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    main(argv)
    capsys.readouterr()
    return argv


@pytest.mark.root
@pytest.mark.parametrize("command", ["scan", "metrics"])
def test_all_users_refused_to_another_user_names_the_flag(
    command: str, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = warmed([command, "--root", str(root), "--all-users"], capsys)
    code, out, err = as_nobody(argv)
    assert (code, out) == (2, "")
    assert err == (
        "shmctl: error: --all-users: only root may judge other users' files "
        "(fix: run as root, or drop --all-users)\n"
    )


@pytest.fixture
def roots_files(root: Path, engine_id: str) -> Path:
    """Three region files owned by root in a root every user may read."""
    for n in range(3):
        write_file(region_path(root, f"{engine_id}-{n}"))
    return root


SKIPPED_NOTE = (
    "shmctl: note: 3 files were skipped because they belong to other users, whose files only root "
    "can judge: run as root or as their owner to judge them (--own-only skips them without this note)\n"
)


@pytest.mark.root
def test_other_users_files_skipped_are_said_once_on_stderr(
    roots_files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = as_nobody(warmed(["scan", "--root", str(roots_files)], capsys))
    assert code == 0, err
    assert err == SKIPPED_NOTE
    assert "note" not in out
    assert out.rstrip("\n").splitlines()[-1].endswith("3 skipped"), out


@pytest.mark.root
def test_the_skipped_note_stays_off_the_json(roots_files: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = as_nobody(warmed(["scan", "--root", str(roots_files), "--json"], capsys))
    assert (code, err) == (0, SKIPPED_NOTE)
    assert json.loads(out)["summary"]["skipped"] == 3


@pytest.mark.root
def test_own_only_skips_other_users_files_without_a_note(
    roots_files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = as_nobody(warmed(["scan", "--root", str(roots_files), "--own-only"], capsys))
    assert (code, err) == (0, "")


def test_root_judges_every_users_files_and_has_nothing_to_note(roots_files: Path) -> None:
    done = shmctl("scan", "--root", str(roots_files))
    assert "shmctl: note:" not in done.stderr
