"""The fault matrix and the room in its root: every cell needs the whole region, so the
matrix checks the root before each cell and never runs one into ``InsufficientSpaceError``.

A root too small for one cell is an error before anything runs (the dry-run plan's
pre-flight and fix). A crash cell whose files survive the reap stops the matrix with the
kept files, the reap's reason and the reap command: the cells after it would pile their
own files on top. A root that fills up between cells stops it before the cell that would
not fit. The small roots are real tmpfs mounts (root only); the rest run on /dev/shm.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvoffload.bringup import FailMode, plan, run_matrix
from kvoffload.bringup.plan import CapacityError
from kvoffload.bringup.report import KeptFile, MatrixCell
from kvoffload.liveness.reap import reap_command
from kvoffload.settings import PAGESIZE, OffloadingSettings
from kvoffload.shm import names
from shmctl.app import main
from tests.support.procs import Child

pytest.importorskip("torch")

MIB = 1 << 20
KV_BYTES_PER_BLOCK = 4 * PAGESIZE
CPU, TIERING = "CPUOffloadingSpec", "TieringOffloadingSpec"


def kv_transfer_config(engine_id: str, spec: str = CPU, cpu_bytes: int = 4 * MIB) -> dict[str, Any]:
    extra: dict[str, Any] = {"spec_name": spec, "cpu_bytes_to_use": cpu_bytes}
    if spec == TIERING:
        extra["secondary_tiers"] = [{"type": "example"}]
    return {"kv_connector": "OffloadingConnector", "engine_id": engine_id, "kv_connector_extra_config": extra}


def make_config(
    engine_id: str,
    root: Path,
    spec: str = CPU,
    *,
    cpu_bytes: int = 4 * MIB,
    world_size: int = 1,
    lifetime: str = "kvoffload",
) -> OffloadingSettings:
    return OffloadingSettings.from_kv_transfer_config(
        kv_transfer_config(engine_id, spec, cpu_bytes),
        worker_kv_bytes_per_block=KV_BYTES_PER_BLOCK,
        world_size=world_size,
        root=root,
        lifetime="vllm" if lifetime == "vllm" else "kvoffload",
    )


def init(
    capsys: pytest.CaptureFixture[str], root: Path, config: dict[str, Any], *argv: str
) -> tuple[int, str, str]:
    code = main(
        [
            "init",
            "--kv-transfer-config",
            json.dumps(config),
            "--kv-bytes-per-block",
            str(KV_BYTES_PER_BLOCK),
            "--root",
            str(root),
            *argv,
        ]
    )
    out, err = capsys.readouterr()
    return code, out, err


@contextmanager
def small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` at ``where``, unmounted (with whatever is left in it) at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=False, capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"this environment does not allow mounting a tmpfs: {done.stderr.strip()!r}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=True)


@contextmanager
def held_crash_file(root: Path, cell_engine_id: str) -> Iterator[Child]:
    """A file named for a matrix cell's engine, held open and mapped by a live process.

    To the matrix it is what that cell's crash left and the reap must keep (it is live).
    """
    path = root / names.format_name(cell_engine_id)
    child = Child("vllm", path)
    try:
        yield child
    finally:
        child.kill()
        path.unlink(missing_ok=True)


# ----------------------------------------------------------------- before the first cell


def test_a_root_too_small_for_one_cell_stops_the_matrix_before_it_starts_with_the_plans_fix(
    capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    huge = kv_transfer_config(engine_id, cpu_bytes=1 << 50)
    code, out, _ = init(capsys, root, huge, "--dry-run", "--json")
    fix = json.loads(out)["capacity"]["fix"]
    assert code == 1
    code, out, err = init(capsys, root, huge, "--matrix", "--fail-at", "worker", "--json")
    assert (code, out) == (3, "")
    assert err.startswith(f"shmctl: error: {root}: ")
    assert err.count("\n") == 1
    assert "each cell of the matrix needs 1048576.0 GiB: it does not fit" in err
    # The plan's fix minus its free-space figures (the size to mount, the bytes that would fit),
    # which move as other tests, on other workers too, use /dev/shm.
    assert re.sub(r"at most \d+", "at most N", fix.split("; ", 1)[1]) in re.sub(
        r"at most \d+", "at most N", err
    )
    assert os.listdir(root) == []


def test_the_matrix_runs_no_cell_when_one_would_not_fit(engine_id: str, root: Path) -> None:
    config = make_config(engine_id, root, cpu_bytes=1 << 50)
    ran: list[MatrixCell] = []
    with pytest.raises(CapacityError) as caught:
        run_matrix(config, stages=["worker"], on_cell=lambda cell, i, n: ran.append(cell))
    assert ran == []
    capacity = caught.value.capacity
    assert (capacity.fits, capacity.needed_bytes) == (False, plan(config).sizing.total_bytes)
    assert caught.value.fix == capacity.fix is not None
    assert os.listdir(root) == []


# ----------------------------------------------------------------- after a crash cell


def test_a_crash_cell_whose_files_the_reap_keeps_stops_the_matrix_naming_them(
    engine_id: str, root: Path
) -> None:
    config = make_config(engine_id, root)
    with held_crash_file(root, f"{engine_id}-c000") as holder:
        report = run_matrix(config, stages=["validate", "worker"], modes=[], include_crash=True)
        assert [(c.stage, c.mode, c.leaked) for c in report.cells] == [("validate", "crash", True)]
        stopped = report.stopped
        assert stopped is not None
        assert (stopped.reason, stopped.stage, stopped.mode, stopped.not_run) == (
            "kept",
            "worker",
            "crash",
            1,
        )
        assert stopped.kept == (KeptFile(holder.path, "live", f"held by 1 process(es): {holder.pid}:python"),)
        assert stopped.reap_command == reap_command(root, f"{engine_id}-c000")
        assert report.cells[0].kept == stopped.kept
    assert os.listdir(root) == []


@pytest.mark.parametrize("json_output", [True, False], ids=["json", "plain"])
def test_the_cli_reports_the_kept_files_the_reason_and_the_reap_command_and_exits_1(
    json_output: bool, capsys: pytest.CaptureFixture[str], root: Path, engine_id: str
) -> None:
    config = kv_transfer_config(engine_id)
    argv = ["--matrix", "--fail-at", "validate", "--fail-at", "worker", "--fail-mode", "crash"]
    with held_crash_file(root, f"{engine_id}-c000") as holder:
        code, out, err = init(capsys, root, config, *argv, *(["--json"] if json_output else []))
    command = reap_command(root, f"{engine_id}-c000")
    reason = f"held by 1 process(es): {holder.pid}:python"
    assert (code, err) == (1, "")
    if json_output:
        doc = json.loads(out)
        assert [c["stage"] for c in doc["cells"]] == ["validate"]
        assert doc["stopped"] == {
            "reason": "kept",
            "message": "the crash at validate left 1 file(s) that the reap kept; every later cell "
            "would leave its own on top until the root is full",
            "stage": "worker",
            "mode": "crash",
            "not_run": 1,
            "kept": [{"path": str(holder.path), "status": "live", "reason": reason}],
            "reap_command": command,
            "capacity": None,
        }
    else:
        lines = out.splitlines()
        assert [line.split(None, 2) for line in lines if line.startswith(str(holder.path))] == [
            [str(holder.path), "live", reason]
        ]
        assert f"  {command}" in lines
        assert any(
            line.startswith("matrix stopped after 1 of 2 cells, before worker x crash: ") for line in lines
        )
        assert lines[-1].startswith("0 passed, 1 failed, 1 leaked, 1 not run: 1 cells in ")
    assert os.listdir(root) == []


@pytest.mark.root
def test_a_crash_matrix_on_a_small_tmpfs_never_runs_a_cell_out_of_space(
    engine_id: str, tmp_path: Path
) -> None:
    """The issue's run: vLLM's lifetime, so most crash cells leave a populated region. Each is
    reaped before the next cell, or (where the scan cannot prove them dead) the matrix stops at
    the first one it has to keep; either way no cell fails for lack of space."""
    with small_tmpfs(tmp_path / "shm", "64m") as shm:
        config = make_config(engine_id, shm, TIERING, cpu_bytes=16 * MIB, world_size=2, lifetime="vllm")
        report = run_matrix(config, modes=[], include_crash=True)
        errors = [c.error.type for c in report.cells if c.error is not None]
        assert "InsufficientSpaceError" not in errors
        if report.stopped is None:
            assert (len(report.cells), report.failed) == (len(plan(config).stages), 0)
            assert os.listdir(shm) == []
        else:
            assert report.stopped.reason == "kept"
            assert sorted(os.listdir(shm)) == sorted(k.path.name for k in report.stopped.kept)
            assert report.stopped.reap_command == report.cells[-1].reap_command is not None


# ----------------------------------------------------------------- between cells


@pytest.mark.root
def test_the_matrix_stops_before_a_cell_the_root_no_longer_has_room_for(
    engine_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cells that leak fill a 10 MiB root 4 MiB at a time: the third would not fit."""
    monkeypatch.setenv("KVOFFLOAD_INIT_SKIP_RELEASE", "worker")
    with small_tmpfs(tmp_path / "shm", "10m") as shm:
        config = make_config(engine_id, shm, TIERING)
        modes = [FailMode.parse(m) for m in ("raise", "oserror:EFAULT", "cleanup-raise")]
        report = run_matrix(config, stages=["scheduler.region"], modes=modes)
        assert [(c.mode, c.leaked, c.error.type if c.error else None) for c in report.cells] == [
            ("raise", True, "InjectedFault"),
            ("oserror:EFAULT", True, "OSError"),
        ]
        stopped = report.stopped
        assert stopped is not None
        assert (stopped.reason, stopped.mode, stopped.not_run) == ("capacity", "cleanup-raise", 1)
        assert (
            stopped.message
            == f"2.0 MiB free in {shm}, the next cell needs 4.0 MiB; earlier cells left 8.0 MiB there"
        )
        assert stopped.capacity is not None
        assert stopped.capacity.fix is not None
        # What the earlier cells left may be orphans: the reap of that root comes first.
        assert stopped.capacity.fix.startswith(f"remove orphaned regions: shmctl reap --root {shm}")
