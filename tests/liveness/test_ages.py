"""One age: what an entry reports as changed is what its grace period judged, and a
``starting`` entry says when it leaves that grace period (issue #32).

Real files on the real /dev/shm tmpfs; the scan's clock (``now``) is set from each file's
measured ctime, so every figure is exact and no test waits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvoffload.liveness.report import ScanEntry, ScanReport
from kvoffload.liveness.scan import Status, scan
from tests.support.procs import leave_orphan, region_path, write_file

GRACE_S = 30.0


def entry(report: ScanReport, path: Path) -> ScanEntry:
    (found,) = [e for e in report.entries if e.name == path.name]
    return found


def ctime(path: Path) -> float:
    return os.stat(path).st_ctime_ns / 1e9


def test_a_mtime_set_back_leaves_the_changed_age_at_the_ctime(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    two_minutes_ago = time.time() - 120
    os.utime(path, (two_minutes_ago, two_minutes_ago))  # `touch -d '-2 min'`: ctime is now
    now = ctime(path) + 5.5  # off a whole second: float sums round either way
    e = entry(scan(root, grace_s=GRACE_S, now=now), path)
    assert e.status is Status.STARTING
    assert e.changed_age_s == pytest.approx(5.5, abs=1e-3)
    assert e.ctime_ns == os.stat(path).st_ctime_ns
    assert e.age_s >= 120  # ls -l's age, as before: only the grace's age is the ctime's
    assert "changed 5s ago" in e.reason
    path.unlink()


def test_a_starting_entry_says_when_its_grace_period_ends(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    now = ctime(path) + 10.5
    report = scan(root, grace_s=GRACE_S, now=now)
    e = entry(report, path)
    assert e.status is Status.STARTING
    assert e.removable_in_s == pytest.approx(GRACE_S - 10.5, abs=1e-3)
    assert e.removable_at == pytest.approx(ctime(path) + GRACE_S, abs=1e-3)
    assert e.reason.endswith("within the 30s grace period: removable in 20s unless it is opened")
    assert report.summary.starting_first_removable_in_s == e.removable_in_s
    assert report.summary.starting_last_removable_in_s == e.removable_in_s
    path.unlink()


def test_a_region_is_removable_when_its_youngest_file_leaves_the_grace_period(
    root: Path, engine_id: str
) -> None:
    base = write_file(region_path(root, engine_id))
    segment = write_file(region_path(root, engine_id, 1))
    youngest = max(ctime(base), ctime(segment))
    now = youngest + 3
    report = scan(root, grace_s=GRACE_S, now=now)
    entries = [entry(report, base), entry(report, segment)]
    assert {e.status for e in entries} == {Status.STARTING}
    assert [e.removable_in_s for e in entries] == [pytest.approx(GRACE_S - 3, abs=1e-3)] * 2
    assert [e.removable_at for e in entries] == [pytest.approx(youngest + GRACE_S, abs=1e-3)] * 2
    segment.unlink()
    base.unlink()


def test_the_summary_spans_the_first_and_the_last_starting_region(root: Path, engine_id: str) -> None:
    older = write_file(region_path(root, f"{engine_id}-older"))
    newer = write_file(region_path(root, f"{engine_id}-newer"))
    now = max(ctime(older), ctime(newer)) + 1
    summary = scan(root, grace_s=GRACE_S, now=now).summary
    assert summary.starting == 2
    assert summary.starting_first_removable_in_s == pytest.approx(GRACE_S - (now - ctime(older)), abs=1e-3)
    assert summary.starting_last_removable_in_s == pytest.approx(GRACE_S - (now - ctime(newer)), abs=1e-3)
    newer.unlink()
    older.unlink()


def test_only_starting_entries_have_a_removable_time(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    report = scan(root, grace_s=GRACE_S, now=ctime(path) + GRACE_S + 1)
    e = entry(report, path)
    assert e.status is Status.ORPHANED
    assert (e.removable_in_s, e.removable_at) == (None, None)
    assert e.changed_age_s == pytest.approx(GRACE_S + 1, abs=1e-3)
    assert report.summary.starting_first_removable_in_s is None
    assert report.summary.starting_last_removable_in_s is None
    path.unlink()
