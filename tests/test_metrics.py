"""shmctl metrics: the scan as Prometheus gauges, on stdout or as a node_exporter textfile."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.liveness.scan import scan

MAKE_REGION = """
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 20)
os.pwrite(fd, b"x", 0)
"""


def shmctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shmctl", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_metrics_match_the_scan(engine_id: str, tmp_path: Path) -> None:
    root = tmp_path / "kvtest-root"
    root.mkdir()
    subprocess.run(
        [sys.executable, "-c", MAKE_REGION, str(root / f"vllm_offload_{engine_id}.mmap")], check=True
    )
    out = shmctl("metrics", "--root", str(root))
    assert out.returncode == 0, out.stderr
    report = scan(root)
    status = report.entries[0].status.value
    assert f'shmctl_regions{{root="{root}",status="{status}"}} 1' in out.stdout
    assert "# TYPE shmctl_orphan_bytes gauge" in out.stdout
    assert f'shmctl_root_free_bytes{{root="{root}"}}' in out.stdout


def test_metrics_textfile_is_written_atomically(tmp_path: Path) -> None:
    root = tmp_path / "kvtest-root"
    root.mkdir()
    out_dir = tmp_path / "textfile"
    out_dir.mkdir()
    result = shmctl("metrics", "--root", str(root), "--textfile", str(out_dir))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert [p.name for p in out_dir.iterdir()] == ["shmctl.prom"]
    text = (out_dir / "shmctl.prom").read_text()
    assert text.endswith("\n")
    assert "shmctl_last_run_timestamp_seconds" in text


@pytest.mark.parametrize("where", ["missing", "file"])
def test_metrics_textfile_must_be_a_directory(tmp_path: Path, where: str) -> None:
    target = tmp_path / "out"
    if where == "file":
        target.write_text("")
    result = shmctl("metrics", "--root", str(tmp_path), "--textfile", str(target))
    assert result.returncode == 3
    assert result.stderr.count("\n") == 1
    assert "not a directory" in result.stderr
