"""``--family`` on the commands that judge files: scan, reap, metrics, watch, and the wrapper.

Without ``--family`` every command is what it was (the offload regions, the same table);
with it the other families' files are listed, counted and removed, and the table says each
row's family. Real files in a private root; the wrapper is the shipped ``entrypoint.sh``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.shm.families import FAMILY_NAMES
from shmctl.app import main
from tests.liveness.test_families import MAKERS, OTHERS, hold
from tests.support.hostile import shmctl
from tests.support.procs import REPO, leave_orphan, write_file
from tests.support.schemas import validate

ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"
OFFLOAD_HEADER = ["STATUS", "ENGINE", "FILES", "SIZE", "RESIDENT", "CHANGED", "HOLDERS", "REASON"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def dead_others(root: Path) -> dict[str, Path]:
    """A dead file of every family but offload, past a grace of 0s."""
    return {family: write_file(root / MAKERS[family](), 4096) for family in OTHERS}


@pytest.mark.parametrize("command", ["scan", "reap", "metrics"])
def test_an_unknown_family_is_one_line_naming_the_families_and_exit_2(
    root: Path, dead_others: dict[str, Path], command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ("--yes",) if command == "reap" else ()
    code, out, err = run(capsys, command, "--root", str(root), "--family", "foo", *extra)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith("shmctl: error: --family: unknown family 'foo' (fix: pass one of ")
    assert all(name in err for name in (*FAMILY_NAMES, "all"))
    assert all(p.exists() for p in dead_others.values())


def test_scan_without_family_is_the_offload_table_as_it_was(
    root: Path, engine_id: str, dead_others: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    leave_orphan(root, engine_id)
    code, out, err = run(capsys, "scan", "--root", str(root), "--grace", "0s")
    assert (code, err) == (1, "")
    header, row, summary = out.splitlines()
    assert header.split() == OFFLOAD_HEADER
    assert row.split()[:2] == ["orphaned", engine_id]
    assert summary.startswith(f"1 region file(s) in {root}: 1 orphaned;")
    assert not any(p.name in out for p in dead_others.values())


def test_scan_with_a_family_shows_a_family_column_and_the_files_names(
    root: Path, dead_others: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "scan", "--root", str(root), "--grace", "0s", "--family", "psm")
    assert (code, err) == (1, "")
    header, row, summary = out.splitlines()
    assert header.split() == [OFFLOAD_HEADER[0], "FAMILY", *OFFLOAD_HEADER[1:]]
    assert row.split()[:3] == ["orphaned", "psm", dead_others["psm"].name]
    assert summary.endswith("`shmctl reap --family psm` removes them")


def test_scan_json_says_each_entrys_family_and_the_families_judged(
    root: Path, engine_id: str, dead_others: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    leave_orphan(root, engine_id)
    code, out, err = run(capsys, "scan", "--root", str(root), "--grace", "0s", "--family", "all", "--json")
    assert (code, err) == (1, "")
    doc = json.loads(out)
    validate(doc, "scan")
    assert doc["families"] == list(FAMILY_NAMES)
    by_family = {e["family"]: e for e in doc["entries"]}
    assert by_family["offload"]["engine_id"] == engine_id
    for family, path in dead_others.items():
        assert (by_family[family]["name"], by_family[family]["engine_id"]) == (path.name, path.name)
        assert by_family[family]["status"] == "orphaned"


def test_reap_removes_the_other_families_only_when_asked(
    root: Path, dead_others: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "reap", "--root", str(root), "--grace", "0s", "--yes", "--json")
    assert (code, err) == (0, "")
    assert json.loads(out)["removed"] == []
    assert all(p.exists() for p in dead_others.values())
    code, out, err = run(
        capsys, "reap", "--root", str(root), "--grace", "0s", "--yes", "--json", "--family", "all"
    )
    assert (code, err) == (0, "")
    doc = json.loads(out)
    validate(doc, "reap")
    assert sorted((e["family"], e["name"]) for e in doc["removed"]) == sorted(
        (f, p.name) for f, p in dead_others.items()
    )
    assert not any(p.exists() for p in dead_others.values())


def test_reap_keeps_a_held_file_of_a_family_it_was_asked_for(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = root / MAKERS["psm"]()
    with hold("psm", path):
        code, out, err = run(capsys, "reap", "--root", str(root), "--grace", "0s", "--yes", "--family", "psm")
        assert path.exists()
    path.unlink()
    assert (code, err) == (0, "")
    assert out.startswith("nothing to reap: 1 file(s)")
    assert "1 live" in out


def test_metrics_counts_the_families_asked_for(
    root: Path, dead_others: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    def orphaned(*flags: str) -> str:
        code, out, err = run(capsys, "metrics", "--root", str(root), "--grace", "0s", *flags)
        assert (code, err) == (0, "")
        return next(
            line
            for line in out.splitlines()
            if line.startswith("shmctl_region_files{") and 'status="orphaned"' in line
        )

    assert orphaned().endswith(" 0.0")
    assert orphaned("--family", "all").endswith(f" {float(len(OTHERS))}")


def test_the_agent_reaps_a_family_it_watches_and_no_other(root: Path, dead_others: dict[str, Path]) -> None:
    result = shmctl(
        "watch",
        "--root",
        str(root),
        "--grace",
        "0s",
        "--reap",
        "--max-passes",
        "2",
        "--interval",
        "0.05s",
        "--family",
        "nccl",
    )
    assert result.returncode == 0, result.stderr
    events = [json.loads(line) for line in result.stdout.splitlines()]
    for event in events:
        validate(event, "watch-event")
    removed = [e for e in events if e["event"] == "removed"]
    assert [e["engine_id"] for e in removed] == [dead_others["nccl"].name]
    assert not dead_others["nccl"].exists()
    assert all(p.exists() for f, p in dead_others.items() if f != "nccl")


def test_the_wrapper_removes_the_families_it_is_given_and_the_offload_regions(
    root: Path, engine_id: str, dead_others: dict[str, Path]
) -> None:
    region = leave_orphan(root, engine_id)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    result = subprocess.run(
        ["sh", str(ENTRYPOINT), "sh", "-c", "echo engine started"],
        env={**os.environ, "PATH": path, "SHMCTL_ROOT": str(root), "SHMCTL_FAMILIES": "psm sem"},
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "engine started"
    assert not region.exists()
    assert not dead_others["psm"].exists()
    assert not dead_others["sem"].exists()
    assert dead_others["nccl"].exists()
    assert dead_others["torch"].exists()


def test_family_completes_from_the_registry() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "shmctl"],
        env={
            **os.environ,
            "COMP_WORDS": "shmctl scan --family ",
            "COMP_CWORD": "3",
            "_SHMCTL_COMPLETE": "complete_bash",
        },
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert result.stdout.split() == [*FAMILY_NAMES, "all"]
