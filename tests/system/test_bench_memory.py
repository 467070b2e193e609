"""``bench/bench_memory.py`` at a toy size: a graded row per command, and nothing left behind.

The figures belong to the bench (``make bench``); this holds its shape: every one-shot command
and the agent's pass measured once on the same files, each row graded against the 100 MiB
budget, ``reap --yes`` last (it must leave the directory empty), and its tmpfs (or directory)
gone afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.procs import REPO

BENCH = REPO / "bench"
#: One harness at a time (bench/run.py): its sweep removes bench directories that appear meanwhile.
pytestmark = pytest.mark.xdist_group("bench")
COMMANDS = (
    "scan --json",
    "scan (table, a pipe)",
    "reap --dry-run --json",
    "metrics",
    "watch, one pass",
    "reap --yes",
)


def test_every_command_is_a_graded_row_and_nothing_is_left(tmp_path: Path) -> None:
    tag = f"t{uuid.uuid4().hex[:8]}-"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "run.py"),
            "--json",
            str(tmp_path / "results.json"),
            "--only",
            "memory",
            "--args",
            "memory=--files 400",
        ],
        env={**os.environ, "SHMCTL_BENCH_TAG": tag},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["figure"] for r in rows] == [f"{name}, 400 files, peak RSS" for name in COMMANDS]
    assert all(r["unit"] == "MiB" and r["goal"] == "<= 1.0x budget" for r in rows)
    assert all(r["baseline"] == "budget 100 MiB" and r["median"] > 0 for r in rows)
    assert not [name for name in os.listdir("/dev/shm") if tag in name]
    with open("/proc/self/mountinfo") as mounts:
        assert not [line for line in mounts if tag in line]
