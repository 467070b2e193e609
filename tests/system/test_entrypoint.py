"""The container wrapper's contract (``deploy/docker/entrypoint.sh``), run for real with a fake engine.

The wrapper runs ``shmctl reap --yes --grace "${SHMCTL_GRACE:-0s}"`` and then ``exec``s the
engine. Which outcomes of reap let the engine start, and which stop it, is the table in
docs/deployment.md ("The wrapper's contract"); each row is a test here. And a region another
container of the pod is creating at that very moment is never taken: a real creator holds one
in each step of vLLM's create protocol while the wrapper runs.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import REPO, Child, leave_orphan, region_path

ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"
ENGINE = ("sh", "-c", "echo engine started")
STARTED = "engine started"


def run_entrypoint(root: Path, *, path: str | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    if path is None:
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *ENGINE],
        env={**os.environ, "PATH": path, "SHMCTL_ROOT": str(root), **env},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def started(result: subprocess.CompletedProcess[str]) -> bool:
    return STARTED in result.stdout.splitlines()


# ------------------------------------------------------------------ reap's outcomes, real


def test_an_empty_root_reaps_nothing_and_the_engine_starts(root: Path) -> None:
    result = run_entrypoint(root)
    assert (result.returncode, started(result)) == (0, True), result.stderr
    assert result.stderr == ""


def test_a_dead_region_is_removed_named_with_its_reason_and_the_engine_starts(
    root: Path, engine_id: str
) -> None:
    dead = leave_orphan(root, engine_id)
    result = run_entrypoint(root)
    assert (result.returncode, started(result)) == (0, True), result.stderr
    assert not dead.exists()
    # The reap's lines come before the engine's: the operator reads what was removed and why.
    before_engine = result.stdout.split(STARTED)[0]
    removed = [line for line in before_engine.splitlines() if line.split()[:2] == ["removed", engine_id]]
    assert len(removed) == 1, result.stdout
    assert "write lease granted" in removed[0], result.stdout


def test_a_root_that_cannot_be_read_exits_3_and_the_engine_starts_anyway(tmp_path: Path) -> None:
    # No root (an emptyDir not mounted where the pod spec says): the engine starts and says
    # itself whether its region fits; one error line from shmctl says why nothing was reaped.
    result = run_entrypoint(tmp_path / "missing")
    assert (result.returncode, started(result)) == (0, True), result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("shmctl: error: ")
    assert "(fix: " in line


def test_a_usage_error_exits_2_and_the_engine_does_not_start(root: Path) -> None:
    # A bad SHMCTL_GRACE is the pod spec's mistake: it stops the start, visibly, every time.
    result = run_entrypoint(root, SHMCTL_GRACE="soon")
    assert (result.returncode, started(result)) == (2, False), result.stdout
    (line,) = result.stderr.splitlines()
    assert line.startswith("shmctl: error: ")
    assert "Traceback" not in result.stderr


def test_no_shmctl_on_path_exits_127_and_the_engine_does_not_start(root: Path) -> None:
    result = run_entrypoint(root, path="/usr/bin:/bin")
    assert (result.returncode, started(result)) == (127, False), result.stderr


# ------------------------------------------------------------------ reap's other exit codes

#: Exit codes reap cannot be made to return on demand here (1 is scan's, never reap's; 130 and
#: 143 are an interrupted reap): a ``shmctl`` on PATH that exits with the code stands in for it,
#: to test the wrapper's side of the table.
STAND_IN_CODES = {0: True, 1: False, 2: False, 3: True, 130: False, 143: False}


@pytest.mark.parametrize(("code", "starts"), sorted(STAND_IN_CODES.items()))
def test_each_reap_exit_code_starts_or_stops_the_engine_as_documented(
    root: Path, tmp_path: Path, code: int, starts: bool
) -> None:
    fake = tmp_path / "shmctl"
    fake.write_text(f"#!/bin/sh\nexit {code}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    result = run_entrypoint(root, path=f"{tmp_path}{os.pathsep}/usr/bin:/bin")
    assert started(result) is starts, result
    assert result.returncode == (0 if starts else code)


def test_the_documented_table_matches_the_codes_tested() -> None:
    text = (REPO / "docs" / "deployment.md").read_text()
    section = text.split("### The wrapper's contract", 1)[1].split("\n## ", 1)[0]
    for code, starts in STAND_IN_CODES.items():
        row = next((line for line in section.splitlines() if line.startswith(f"| {code} |")), None)
        assert row is not None, f"no row for exit {code}"
        assert ("starts" in row.split("|")[3]) is starts, row


# ------------------------------------------------------------------ a concurrent creator

#: vLLM's creator, held at one step of its protocol (``O_CREAT|O_EXCL``, ``ftruncate``, ``mmap``):
#: the region another container of the pod is bringing up while this one's wrapper runs.
CREATOR = r"""
import mmap, os, sys
step, path, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
keep = []
if step in ("sized", "mapped"):
    os.ftruncate(fd, size)
if step == "mapped":
    keep.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED))
    keep[-1][0] = 1
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("grace", ["0s", "30s"])
@pytest.mark.parametrize("step", ["created", "sized", "mapped"])
def test_a_region_another_container_is_creating_is_never_taken(
    root: Path, engine_id: str, step: str, grace: str
) -> None:
    creating = region_path(root, engine_id + "-new")
    dead = leave_orphan(root, engine_id)
    with Child(step, creating, script=CREATOR):
        result = run_entrypoint(root, SHMCTL_GRACE=grace)
        assert creating.exists()
    assert (result.returncode, started(result)) == (0, True), result.stderr
    removed = [line for line in result.stdout.splitlines() if line.split()[:1] == ["removed"]]
    # What was removed, not the summary's note of the live region kept (the creator's, named).
    removed = [line.split("; live: ")[0] for line in removed]
    assert not [line for line in removed if creating.name in line or engine_id + "-new" in line]
    # The dead one beside it goes with grace 0s; the default keeps it while it is that young.
    assert dead.exists() is (grace != "0s")
    creating.unlink()
