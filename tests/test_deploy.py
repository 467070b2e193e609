"""The host deployment files do what their comments promise, run for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procs import REPO, Child, leave_orphan, region_path

ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"


def run_entrypoint(
    root: Path, *engine: str, prefix: tuple[str, ...] = (), **env: str
) -> subprocess.CompletedProcess[str]:
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        [*prefix, "sh", str(ENTRYPOINT), *engine],
        env={**os.environ, "PATH": path, "SHMCTL_ROOT": str(root), **env},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_the_entrypoint_removes_a_dead_engines_region_and_starts_the_engine(
    root: Path, engine_id: str
) -> None:
    dead = leave_orphan(root, engine_id)
    live = region_path(root, engine_id + "-live")
    with Child("vllm", live):
        result = run_entrypoint(root, "sh", "-c", "echo engine started")
        assert live.exists()
    assert result.returncode == 0, result.stderr
    assert not dead.exists()
    assert result.stdout.splitlines()[-1] == "engine started"
    assert f"removed\t{dead.name}" in result.stdout


def test_the_entrypoint_says_what_it_kept_before_the_engine_starts(root: Path, engine_id: str) -> None:
    # Without leases, from a PID namespace that cannot see the host, a dead file is unknown:
    # kept, and said so on stderr before the engine runs.
    if os.geteuid() != 0 or not Path("/usr/bin/unshare").exists():
        pytest.skip("needs root and unshare(1)")
    dead = leave_orphan(root, engine_id)
    result = run_entrypoint(
        root,
        "sh",
        "-c",
        "echo engine started >&2",
        prefix=("unshare", "--pid", "--fork", "--mount-proc", "--kill-child"),
        SHMCTL_NO_LEASE="1",
    )
    assert result.returncode == 0, result.stderr
    assert dead.exists()
    kept, started = result.stderr.splitlines()[-2:]
    assert kept.startswith("shmctl: warning: kept 1 unknown file(s), ")
    assert dead.name in kept
    assert "(fix: drop --no-lease" in kept
    assert started == "engine started"
    dead.unlink()
