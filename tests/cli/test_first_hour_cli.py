"""An operator's first hour (issue #32): the small things a new operator met, each pinned.

* ``audit --report FIFO`` (or ``--junit``) with no reader fails in bounded time, before the
  command runs, instead of hanging after it;
* a bad ``--root`` names where it came from: ``SHMCTL_ROOT=...`` or ``--root ...``;
* an error names the flag (``--all-users``), never a Python name;
* files skipped because they are other users' are said once on stderr.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.hostile import shmctl

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
