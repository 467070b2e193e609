"""The suite's own strictness, proven: an unclosed file fails its test, a hung test times out,
an unknown marker is an error, and ``make test`` runs the linters, the type checker and coverage.

Each strictness check runs pytest in a subprocess, with this project's configuration, on a
small test file written for the purpose, and reads the outcome of every test in it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.procs import REPO

PROBES = """
import gc
import time

import pytest


def test_an_unclosed_file_fails(tmp_path):
    f = open(tmp_path / "leaked", "w")  # ResourceWarning when it is collected
    del f


def test_an_unclosed_file_in_a_reference_cycle_fails(tmp_path):
    class Holder:
        pass

    holder = Holder()
    holder.self = holder
    holder.file = open(tmp_path / "cycle", "w")
    del holder
    gc.collect()


def test_a_closed_file_passes(tmp_path):
    with open(tmp_path / "closed", "w") as f:
        f.write("ok")


@pytest.mark.timeout(1)
def test_a_hung_test_times_out():
    time.sleep(60)
"""

UNKNOWN_MARKER = """
import pytest


@pytest.mark.no_such_marker
def test_marked():
    pass
"""


def run_pytest(tmp_path: Path, name: str, source: str) -> subprocess.CompletedProcess[str]:
    probe = tmp_path / name
    probe.write_text(source)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-c",
            str(REPO / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-p",
            "no:cacheprovider",
            "-q",
            "-rA",
            str(probe),
        ],
        cwd=tmp_path,
        env={**os.environ, "COLUMNS": "250"},  # -rA cuts each line to the terminal width
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def outcomes(output: str) -> dict[str, str]:
    """``{test name: PASSED | FAILED | ERROR}`` from pytest's ``-rA`` summary."""
    found: dict[str, str] = {}
    for m in re.finditer(r"^(PASSED|FAILED|ERROR) \S+::(\w+)", output, re.MULTILINE):
        found.setdefault(m.group(2), m.group(1))
    return found


@pytest.mark.slow
def test_unclosed_files_fail_their_test_and_hung_tests_time_out(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, "test_probes.py", PROBES)
    assert outcomes(done.stdout) == {
        "test_an_unclosed_file_fails": "FAILED",
        "test_an_unclosed_file_in_a_reference_cycle_fails": "FAILED",
        "test_a_closed_file_passes": "PASSED",
        "test_a_hung_test_times_out": "FAILED",
    }, done.stdout
    assert "ResourceWarning: unclosed file" in done.stdout
    for name in ("test_an_unclosed_file_fails", "test_an_unclosed_file_in_a_reference_cycle_fails"):
        assert re.search(rf"^FAILED \S+::{name} - pytest\.PytestUnraisable", done.stdout, re.MULTILINE)
    assert re.search(r"^FAILED \S+::test_a_hung_test_times_out - Failed: Timeout", done.stdout, re.MULTILINE)


def test_an_unknown_marker_is_an_error(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, "test_marker.py", UNKNOWN_MARKER)
    assert done.returncode != 0
    assert "'no_such_marker' not found in `markers` configuration option" in done.stdout


def test_make_test_runs_lint_format_check_strict_types_and_coverage() -> None:
    makefile = (REPO / "Makefile").read_text()
    rules = dict(re.findall(r"^([a-z]+):([^\n=]*)$", makefile, re.MULTILINE))
    assert set(rules["test"].split()) >= {"check", "pytest"}
    assert set(rules["check"].split()) >= {"lint", "typecheck"}
    assert "ruff check kvoffload shmctl tests" in makefile
    assert "ruff format --check kvoffload shmctl tests" in makefile
    assert re.search(r"pytest --cov\b", makefile)
    assert re.search(r"pytest --cov\b.* -n \$\(PYTEST_WORKERS\)", makefile)  # on several workers
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert config["tool"]["mypy"]["strict"] is True
    assert set(config["tool"]["mypy"]["packages"]) >= {"kvoffload", "shmctl", "tests"}
    pytest_ini = config["tool"]["pytest"]["ini_options"]
    assert {"--strict-markers", "--strict-config"} <= set(pytest_ini["addopts"].split())
    assert "--dist loadgroup" in pytest_ini["addopts"]  # an xdist_group stays on one worker
    assert pytest_ini["filterwarnings"][0] == "error"
    assert pytest_ini["timeout"] > 0
