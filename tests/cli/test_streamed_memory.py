"""The one-shot commands hold a region at a time: 100,000 files stay within the agent's 100 MiB.

Before issue #31, ``scan --json`` at 100,000 files peaked at 261 MiB (its whole report and the
JSON text of it), ``reap`` at 263 MiB and ``metrics`` at 207 MiB. Each now reads the root as a
stream and writes as it goes (docs/agent-memory.md). The peak is the kernel's high-water mark of
the process, ``VmHWM``, read every 10 ms until it exits (not ``wait4``'s ``ru_maxrss``, which
keeps the high-water mark of this test process that forked it); the bound is generous beside
the figures (about 50 MiB), and far below what the whole report took.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.peak import run_with_peak
from tests.support.procs import Child, region_path

MIB = 1 << 20
RSS_BOUND = 100 * MIB
FILES = 100_000


def run_peak(tmp_path: Path, *args: str) -> tuple[int, str, str, int]:
    """``python -m shmctl ARGS``: exit status, stdout, stderr, and its ``VmHWM`` in bytes."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    code, peak = run_with_peak([sys.executable, "-m", "shmctl", *args], out, err)
    return code, out.read_text(encoding="utf-8"), err.read_text(encoding="utf-8"), peak


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.xdist_group("cpu-heavy")  # CPU-bound: one at a time, never against each other
def test_scan_reap_and_metrics_over_100000_files_stay_within_100_mib(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(FILES):
            # Empty base files whose creator is gone: orphans; memory is about files, not bytes.
            name = region_path(root, f"{engine_id}{i:06d}").name
            os.close(os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600, dir_fd=fd))
    finally:
        os.close(fd)
    live = region_path(root, f"{engine_id}live")
    where = ("--root", str(root), "--grace", "0s")
    with Child("vllm", live):
        code, out, err, peak = run_peak(tmp_path, "scan", *where, "--json")
        assert (code, err) == (1, "")
        document = json.loads(out)
        assert document["summary"]["orphaned"] == FILES
        assert document["summary"]["live"] == 1
        assert len(document["entries"]) == FILES + 1
        del document, out
        assert peak <= RSS_BOUND, f"scan --json: VmHWM {peak / MIB:.1f} MiB"

        code, out, err, peak = run_peak(tmp_path, "scan", *where)
        assert code == 1
        assert len(out.splitlines()) == FILES + 3
        assert peak <= RSS_BOUND, f"scan: VmHWM {peak / MIB:.1f} MiB"

        code, out, err, peak = run_peak(tmp_path, "metrics", *where)
        assert code == 0
        assert f'shmctl_region_files{{root="{root}",status="orphaned"}} {FILES}.0' in out
        assert peak <= RSS_BOUND, f"metrics: VmHWM {peak / MIB:.1f} MiB"

        code, out, err, peak = run_peak(tmp_path, "reap", *where, "--dry-run", "--json")
        assert code == 0
        assert len(json.loads(out)["removed"]) == FILES
        assert peak <= RSS_BOUND, f"reap --dry-run --json: VmHWM {peak / MIB:.1f} MiB"

        code, out, err, peak = run_peak(tmp_path, "reap", *where, "--yes")
        assert code == 0, err
        assert out.splitlines()[-1].startswith(f"removed {FILES} file(s)")
        assert os.listdir(root) == [live.name], "every orphan removed, the live region kept"
        assert peak <= RSS_BOUND, f"reap --yes: VmHWM {peak / MIB:.1f} MiB"
