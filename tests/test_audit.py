"""shmctl audit: a CI step that fails when a command leaves shared memory behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvoffload.liveness.audit import audit

SHM = Path("/dev/shm")

MAKE_REGION = """
import os, sys
fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 20)
os.pwrite(fd, b"x", 0)
"""

# Maps a region, unlinks it, then lingers in the background (a daemon the command left).
LINGER = """
import mmap, os, sys, time
path = sys.argv[1]
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 1 << 20)
mm = mmap.mmap(fd, 1 << 20)
mm[0] = 1
os.unlink(path)
if os.fork():
    os._exit(0)
sys.stdout.close()
time.sleep(float(sys.argv[2]))
"""


def shmctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shmctl", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_audit_reports_a_region_the_command_left(engine_id: str, tmp_path: Path) -> None:
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    try:
        report = audit([sys.executable, "-c", MAKE_REGION, str(path)], SHM)
        assert not report.clean
        assert [e.path for e in report.leaked] == [path]
        assert report.leaked_resident_bytes >= 4096
        assert report.command_exit_code == 0
    finally:
        path.unlink(missing_ok=True)


def test_audit_ignores_files_that_were_there_before(engine_id: str) -> None:
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    subprocess.run([sys.executable, "-c", MAKE_REGION, str(path)], check=True)
    try:
        report = audit(["true"], SHM)
        assert report.clean
        assert report.preexisting >= 1
    finally:
        path.unlink()


def test_audit_catches_a_deleted_region_still_mapped_by_a_leftover_process(engine_id: str) -> None:
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    report = audit([sys.executable, "-c", LINGER, str(path), "5"], SHM)
    lingering = [d for d in report.leaked_deleted if d.engine_id == engine_id]
    try:
        assert lingering, report
        assert lingering[0].mapped_bytes == 1 << 20
        assert not report.clean
    finally:
        for d in lingering:
            os.kill(d.pid, 9)


def test_cli_audit_exit_codes(engine_id: str) -> None:
    path = SHM / f"vllm_offload_{engine_id}.mmap"
    try:
        leak = shmctl("audit", "--json", "--", sys.executable, "-c", MAKE_REGION, str(path))
        assert leak.returncode == 1, leak.stderr
        doc = json.loads(leak.stdout)
        assert doc["clean"] is False
        assert [e["path"] for e in doc["leaked"]] == [str(path)]
    finally:
        path.unlink(missing_ok=True)
    clean = shmctl("audit", "--", "true")
    assert (clean.returncode, clean.stdout) == (0, "")
    assert "clean" in clean.stderr
    failed = shmctl("audit", "--", "false")
    assert failed.returncode == 3
    missing = shmctl("audit", "--", "no-such-command-kvtest")
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1
    assert "not found" in missing.stderr
