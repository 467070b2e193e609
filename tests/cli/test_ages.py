"""The age an operator reads is the age the grace period judges, and ``starting`` says when
(issue #32): scan's CHANGED column, the "removable in" of a ``starting`` row, and the
summary lines of scan and reap.

Real files on the real /dev/shm tmpfs, real commands. Every expected figure is derived from
the file's measured ctime and the clock read around the command, never hard-coded.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import pytest

from shmctl.app import main
from tests.support.hostile import shmctl
from tests.support.procs import leave_orphan, region_path, write_file

GRACE_S = 30


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def ctime(path: Path) -> float:
    return os.stat(path).st_ctime_ns / 1e9


def row(out: str, engine_id: str) -> str:
    """``engine_id``'s row of a scan table."""
    (found,) = [r for r in out.splitlines()[1:] if r.split()[1:2] == [engine_id]]
    return found


def cell(out: str, column: str, engine_id: str) -> str:
    """The ``column`` cell of ``engine_id``'s row in a scan table (not REASON: it has spaces)."""
    return row(out, engine_id).split()[out.splitlines()[0].split().index(column)]


def seconds(text: str) -> int:
    """``12s`` as 12; anything else (``2m``) fails the test that expected seconds."""
    assert re.fullmatch(r"\d+s", text), text
    return int(text[:-1])


def removable_in(reason: str) -> int:
    (found,) = re.findall(r"removable in (\d+)s", reason)
    return int(found)


def test_a_mtime_set_back_two_minutes_shows_a_just_changed_age(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    two_minutes_ago = time.time() - 120
    os.utime(path, (two_minutes_ago, two_minutes_ago))  # as `touch -d '-2 min'`: ctime is now
    changed = ctime(path)
    done = shmctl("scan", "--root", str(root))
    after = time.time()
    assert (done.returncode, done.stderr) == (0, "")
    age = seconds(cell(done.stdout, "CHANGED", engine_id))
    assert age <= after - changed  # counted from the ctime the touch moved to now, not "2m"
    assert cell(done.stdout, "STATUS", engine_id) == "starting"
    assert f"changed {age}s ago, within the {GRACE_S}s grace period" in done.stdout
    path.unlink()


def test_the_json_keeps_ls_s_age_and_adds_the_changed_one(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    two_minutes_ago = time.time() - 120
    os.utime(path, (two_minutes_ago, two_minutes_ago))
    st = os.stat(path)
    doc = json.loads(shmctl("scan", "--root", str(root), "--json").stdout)
    (e,) = doc["entries"]
    assert e["age_s"] >= 120  # seconds since mtime, as ls -l counts it: unchanged
    assert (e["mtime_ns"], e["ctime_ns"]) == (st.st_mtime_ns, st.st_ctime_ns)
    assert 0 <= e["changed_age_s"] <= doc["scanned_at"] - st.st_ctime_ns / 1e9 + 1e-3
    path.unlink()


def test_a_starting_row_says_when_it_becomes_removable(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    changed = ctime(path)
    before = time.time()
    done = shmctl("scan", "--root", str(root), "--grace", f"{GRACE_S}s", "--json")
    after = time.time()
    (e,) = json.loads(done.stdout)["entries"]
    assert e["status"] == "starting"
    # The scan's clock read lies between before and after: the wait lies between the two.
    assert GRACE_S - (after - changed) <= e["removable_in_s"] <= GRACE_S - (before - changed)
    assert e["removable_at"] == pytest.approx(changed + GRACE_S, abs=1e-3)
    assert removable_in(e["reason"]) == math.ceil(e["removable_in_s"])

    before = time.time()
    table = shmctl("scan", "--root", str(root), "--grace", f"{GRACE_S}s").stdout
    after = time.time()
    assert cell(table, "STATUS", engine_id) == "starting"
    wait = removable_in(row(table, engine_id))
    assert math.ceil(GRACE_S - (after - changed)) <= wait <= math.ceil(GRACE_S - (before - changed))
    # What CHANGED shows and what is left of the grace add up to it: one age.
    assert seconds(cell(table, "CHANGED", engine_id)) + wait == GRACE_S
    path.unlink()


def test_reap_dry_run_says_when_the_starting_ones_become_removable(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    older = write_file(region_path(root, f"{engine_id}-older"))
    time.sleep(2.1)  # two ctimes whole seconds apart: a span, not one figure
    newer = write_file(region_path(root, f"{engine_id}-newer"))
    before = time.time()
    code, out, err = run(capsys, "reap", "--root", str(root), "--dry-run", "--grace", f"{GRACE_S}s")
    after = time.time()
    assert (code, err) == (0, "")
    found = re.fullmatch(
        rf"nothing to reap: 2 region file\(s\) in {re.escape(str(root))}: 2 starting "
        r"\(removable in (\d+)s to (\d+)s; run again after that\)\n",
        out,
    )
    assert found, out
    first, last = (int(g) for g in found.groups())
    for shown, path in ((first, older), (last, newer)):
        soonest, latest = GRACE_S - (after - ctime(path)), GRACE_S - (before - ctime(path))
        assert math.ceil(soonest) <= shown <= math.ceil(latest)
    newer.unlink()
    older.unlink()


def test_a_reap_that_leaves_starting_files_says_when_to_run_again(
    root: Path, engine_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    orphan = leave_orphan(root, f"{engine_id}-dead")
    time.sleep(3.1)  # the orphan is past a 3s grace; the file made next is not
    fresh = write_file(region_path(root, f"{engine_id}-new"))
    before = time.time()
    code, out, err = run(capsys, "reap", "--root", str(root), "--yes", "--grace", "3s")
    after = time.time()
    assert (code, err) == (0, "")
    assert not orphan.exists()
    summary = out.splitlines()[-1]
    assert summary.startswith("removed 1 file(s), freed ")
    wait = re.fullmatch(
        r".*; 1 starting file\(s\) left \(removable in (\d+)s; run again after that\)", summary
    )
    assert wait, summary
    changed = ctime(fresh)
    assert math.ceil(3 - (after - changed)) <= int(wait.group(1)) <= math.ceil(3 - (before - changed))
    fresh.unlink()
