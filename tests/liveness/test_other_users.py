"""Root sees all: as root, ``scan``, ``metrics`` and ``watch`` judge every user's regions.

Another uid's files are made for real (``os.chown``) and held by real processes of that uid
(``setpriv``); the CLI runs as a subprocess, as root or, under ``setpriv``, as a user of its own.
What is specified:

* as root, a dead file of uid 1000 is ``orphaned`` and one a uid-1000 process maps is ``live``,
  without ``--all-users`` (``--all-users`` is accepted and changes nothing);
* judging is not removing: ``reap`` (and ``watch --reap``) removes another user's file only with
  ``--all-users``; without it the orphan stays, and the text, the JSON and the agent's events
  say how many, whose and the fix;
* a non-root user judges only its own files (others' are ``skipped``, with the reason), and
  ``--all-users`` is a usage error for it (exit 2);
* ``--own-only`` makes root judge only its own files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.liveness.events import KeptOtherUser, Removed
from kvoffload.liveness.reap import reap
from kvoffload.liveness.watch import WatchConfig, Watcher
from shmctl.render.watch import event_document
from tests.support.parks import dead_park
from tests.support.procs import NOBODY, REPO, Child, region_path, write_file
from tests.support.schemas import validate

pytestmark = pytest.mark.root

OTHER_UID = 1000
SECOND_UID = 1001
#: A scanner that is not root, in the tests where one is.
SCANNER_UID = 1002
ONLY_ROOT = "only root can judge another user's file"
#: As ``scan``, ``metrics`` and ``reap`` have always said it (``watch`` names its flag).
USAGE = (
    "shmctl: error: {key}: only root may judge other users' files (fix: run as root, or drop --all-users)\n"
)

JSON = dict[str, Any]


def as_user(uid: int) -> tuple[str, ...]:
    return ("setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups")


@pytest.fixture(autouse=True)
def _root_and_setpriv() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to make files and processes of other uids")


@pytest.fixture
def shared(root: Path) -> Path:
    """The root as /dev/shm is: world-writable and sticky, so every uid may create files in it."""
    root.chmod(0o1777)
    return root


def owned_by(uid: int, path: Path) -> Path:
    os.chown(path, uid, uid)
    return path


def dead_file(root: Path, engine_id: str, uid: int, segment: int = 0) -> Path:
    """A region file of ``uid`` that nobody holds: the write lease proves it dead."""
    return owned_by(uid, write_file(region_path(root, engine_id, segment), 8192, touch=2))


def shmctl(*args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*prefix, sys.executable, "-m", "shmctl", *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def entries_by_name(report: JSON) -> dict[str, JSON]:
    return {e["name"]: e for e in report["entries"]}


def names(entries: list[JSON]) -> list[str]:
    return sorted(e["name"] for e in entries)


# ------------------------------------------------------------------ scan, as root


def test_as_root_scan_judges_another_users_dead_file_orphaned_and_their_held_file_live(
    shared: Path, engine_id: str
) -> None:
    dead = dead_file(shared, f"{engine_id}-dead", OTHER_UID)
    held = dead_file(shared, f"{engine_id}-held", OTHER_UID)
    with Child("map-only", held, prefix=as_user(OTHER_UID)) as holder:
        done = shmctl("scan", "--root", str(shared), "--grace", "0s", "--json")
    assert done.returncode == 1, done.stderr  # an orphan was found
    report = json.loads(done.stdout)
    validate(report, "scan")
    entries = entries_by_name(report)
    orphan, live = entries[dead.name], entries[held.name]
    assert (orphan["status"], orphan["uid"], orphan["decided_by"], orphan["reason"]) == (
        "orphaned",
        OTHER_UID,
        "lease",
        NOBODY,
    )
    assert (live["status"], live["uid"]) == ("live", OTHER_UID)
    assert [h["pid"] for h in live["holders"]] == [holder.pid]
    assert report["summary"]["skipped"] == 0


def test_as_root_all_users_is_accepted_and_changes_no_verdict(shared: Path, engine_id: str) -> None:
    dead_file(shared, engine_id, OTHER_UID)
    plain = shmctl("scan", "--root", str(shared), "--grace", "0s", "--json")
    everyone = shmctl("scan", "--root", str(shared), "--grace", "0s", "--json", "--all-users")
    assert (plain.returncode, everyone.returncode) == (1, 1), plain.stderr + everyone.stderr

    def verdicts(done: subprocess.CompletedProcess[str]) -> list[tuple[str, str]]:
        return [(e["name"], e["status"]) for e in json.loads(done.stdout)["entries"]]

    assert verdicts(plain) == verdicts(everyone) != []


def test_as_root_the_scan_summary_names_the_reap_that_removes_other_users_orphans(
    shared: Path, engine_id: str
) -> None:
    dead_file(shared, engine_id, OTHER_UID)
    done = shmctl("scan", "--root", str(shared), "--grace", "0s")
    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines()[-1].endswith("`shmctl reap --all-users` removes them")


def test_own_only_makes_root_skip_other_users_files_and_cannot_be_combined_with_all_users(
    shared: Path, engine_id: str
) -> None:
    theirs = dead_file(shared, engine_id, OTHER_UID)
    done = shmctl("scan", "--root", str(shared), "--grace", "0s", "--json", "--own-only")
    assert done.returncode == 0, done.stderr  # nothing of its own is orphaned
    e = entries_by_name(json.loads(done.stdout))[theirs.name]
    assert (e["status"], e["reason"]) == (
        "skipped",
        f"owned by uid {OTHER_UID}, not you (judging your own files only: --own-only)",
    )
    both = shmctl("scan", "--root", str(shared), "--own-only", "--all-users")
    assert both.returncode == 2
    assert both.stdout == ""
    assert both.stderr == (
        "shmctl: error: --own-only: cannot be combined with --all-users (fix: pass one of them, or neither)\n"
    )


def test_as_root_metrics_counts_another_users_orphan_without_all_users(shared: Path, engine_id: str) -> None:
    dead = dead_file(shared, engine_id, OTHER_UID)
    done = shmctl("metrics", "--root", str(shared), "--grace", "0s")
    assert done.returncode == 0, done.stderr
    values = {
        (sample.name, sample.labels.get("status")): sample.value
        for family in text_string_to_metric_families(done.stdout)
        for sample in family.samples
    }
    assert values[("shmctl_orphan_bytes", None)] == dead.stat().st_blocks * 512
    assert values[("shmctl_regions", "orphaned")] == 1
    assert values[("shmctl_regions", "skipped")] == 0


# ------------------------------------------------------------------ reap, as root


def test_as_root_reap_without_all_users_leaves_another_users_orphan_and_says_so(
    shared: Path, engine_id: str
) -> None:
    mine = write_file(region_path(shared, f"{engine_id}-mine"), 8192, touch=2)
    theirs = dead_file(shared, f"{engine_id}-theirs", OTHER_UID)
    resident = theirs.stat().st_blocks * 512
    plan = shmctl("reap", "--root", str(shared), "--grace", "0s", "--dry-run", "--bytes")
    done = shmctl("reap", "--root", str(shared), "--grace", "0s", "--yes", "--bytes")
    assert (plan.returncode, done.returncode) == (0, 0), plan.stderr + done.stderr
    note = (
        f"left 1 orphaned file(s) of other users (uid {OTHER_UID}), {resident} bytes resident: "
        "pass --all-users to remove them"
    )
    # The dry run shows the other user's orphan with its verdict, never as something to remove.
    rows = [line.split()[:2] for line in plan.stdout.splitlines()[1:-1]]
    assert sorted(rows) == [["left", f"{engine_id}-theirs"], ["would-remove", f"{engine_id}-mine"]]
    assert f"uid {OTHER_UID}, not yours: removed only with --all-users; {NOBODY}" in plan.stdout
    assert plan.stdout.splitlines()[-1] == f"would remove 1 file(s), freeing 8192 bytes; {note}"
    assert done.stdout.splitlines()[-1] == f"removed 1 file(s), freed 8192 bytes; {note}"
    assert not mine.exists()
    assert theirs.exists()
    again = shmctl("reap", "--root", str(shared), "--grace", "0s", "--yes")
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1].startswith("nothing to reap; left 1 orphaned file(s) of other users")


def test_as_root_reap_json_lists_the_orphans_of_other_users_it_left(shared: Path, engine_id: str) -> None:
    first = dead_file(shared, f"{engine_id}-a", OTHER_UID)
    second = dead_file(shared, f"{engine_id}-b", SECOND_UID)
    # A region with one file of another user is left whole, root's own base included.
    base = write_file(region_path(shared, f"{engine_id}-c"), 8192, touch=2)
    segment = dead_file(shared, f"{engine_id}-c", OTHER_UID, segment=1)
    done = shmctl("reap", "--root", str(shared), "--grace", "0s", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    validate(report, "reap")
    assert report["removed"] == []
    left = report["other_users_left"]
    assert names(left) == sorted(p.name for p in (first, second, base, segment))
    assert {e["status"] for e in left} == {"orphaned"}
    assert sorted({e["uid"] for e in left}) == [0, OTHER_UID, SECOND_UID]
    assert all(p.exists() for p in (first, second, base, segment))
    text = shmctl("reap", "--root", str(shared), "--grace", "0s", "--yes")
    assert f"left 4 orphaned file(s) of other users (uids {OTHER_UID}, {SECOND_UID})" in text.stdout


def test_as_root_reap_with_all_users_removes_another_users_orphan_and_keeps_their_live_region(
    shared: Path, engine_id: str
) -> None:
    dead = dead_file(shared, f"{engine_id}-dead", OTHER_UID)
    held = dead_file(shared, f"{engine_id}-held", OTHER_UID)
    with Child("map-only", held, prefix=as_user(OTHER_UID)):
        done = shmctl("reap", "--root", str(shared), "--grace", "0s", "--yes", "--json", "--all-users")
        assert held.exists()
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    validate(report, "reap")
    assert names(report["removed"]) == [dead.name]
    assert report["other_users_left"] == []
    assert not dead.exists()


def test_a_dead_reapers_parked_file_of_another_user_gets_its_name_back_unless_all_users(
    root: Path, engine_id: str
) -> None:
    def parked_file() -> tuple[Path, Path]:
        # Parked by a root reaper (with --all-users) that was SIGKILLed: marked, unlocked.
        file = dead_file(root, engine_id, OTHER_UID)
        folder = dead_park(root, file)
        return folder, folder / file.name

    folder, parked = parked_file()
    left = reap(root, grace_s=0)
    assert left.removed == ()
    assert [e.name for e in left.restored] == [parked.name]
    assert f"not removed (uid {OTHER_UID}: another user's region is removed only with --all-users)" in (
        left.restored[0].reason
    )
    assert (root / parked.name).exists()
    assert not folder.exists()
    (root / parked.name).unlink()

    folder, parked = parked_file()
    gone = reap(root, grace_s=0, all_users=True)
    assert [e.name for e in gone.removed] == [parked.name]
    assert not (root / parked.name).exists()
    assert not folder.exists()


# ------------------------------------------------------------------ watch, as root


def watch_passes(root: Path, passes: int, *, all_users: bool | None = None) -> list[Any]:
    seen: list[Any] = []
    config = WatchConfig(roots=(str(root),), interval_s=0, reap=True, grace_s=0, all_users=all_users)
    watcher = Watcher(config, on_event=seen.append)
    for _ in range(passes):
        watcher.run_pass()
    for event in seen:
        validate(json.loads(json.dumps(event_document(event))), "watch-event")
    return seen


def test_the_agent_reaps_its_own_orphan_and_tells_once_that_it_keeps_another_users(
    shared: Path, engine_id: str
) -> None:
    mine = write_file(region_path(shared, f"{engine_id}-mine"), 8192, touch=2)
    theirs = dead_file(shared, f"{engine_id}-theirs", OTHER_UID)
    seen = watch_passes(shared, 3)
    assert [e.engine_id for e in seen if isinstance(e, Removed)] == [f"{engine_id}-mine"]
    (kept,) = [e for e in seen if isinstance(e, KeptOtherUser)]  # told once in three passes
    assert (kept.engine_id, kept.files, kept.uids) == (f"{engine_id}-theirs", 1, (OTHER_UID,))
    assert kept.bytes == theirs.stat().st_blocks * 512
    assert kept.reason == (
        f"orphaned, owned by uid {OTHER_UID}: another user's region is removed only with --all-users"
    )
    assert not mine.exists()
    assert theirs.exists()


def test_the_agent_with_all_users_reaps_another_users_orphan(shared: Path, engine_id: str) -> None:
    theirs = dead_file(shared, engine_id, OTHER_UID)
    seen = watch_passes(shared, 2, all_users=True)
    assert [e.engine_id for e in seen if isinstance(e, Removed)] == [engine_id]
    assert not any(isinstance(e, KeptOtherUser) for e in seen)
    assert not theirs.exists()


# ------------------------------------------------------------------ a user who is not root


def test_a_non_root_user_judges_its_own_files_and_skips_other_users_with_the_reason(
    shared: Path, engine_id: str
) -> None:
    own = dead_file(shared, f"{engine_id}-own", SCANNER_UID)
    theirs = dead_file(shared, f"{engine_id}-theirs", OTHER_UID)
    roots = write_file(region_path(shared, f"{engine_id}-root"), 8192, touch=2)
    done = shmctl("scan", "--root", str(shared), "--grace", "0s", "--json", prefix=as_user(SCANNER_UID))
    assert done.returncode == 1, done.stderr
    entries = entries_by_name(json.loads(done.stdout))
    assert entries[own.name]["status"] == "orphaned"
    for path, uid in ((theirs, OTHER_UID), (roots, 0)):
        e = entries[path.name]
        assert (e["status"], e["reason"]) == ("skipped", f"owned by uid {uid}, not you ({ONLY_ROOT})")
    reaped = shmctl(
        "reap", "--root", str(shared), "--grace", "0s", "--yes", "--json", prefix=as_user(SCANNER_UID)
    )
    assert reaped.returncode == 0, reaped.stderr
    report = json.loads(reaped.stdout)
    assert (names(report["removed"]), report["other_users_left"]) == ([own.name], [])
    assert theirs.exists()
    assert roots.exists()


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["scan"], "--all-users"),
        (["metrics"], "--all-users"),
        (["reap", "--dry-run"], "--all-users"),
        (["watch", "--once"], "--all-users"),
    ],
    ids=lambda value: value[0] if isinstance(value, list) else "",
)
def test_all_users_is_a_usage_error_for_a_non_root_user(shared: Path, argv: list[str], key: str) -> None:
    done = shmctl(*argv, "--root", str(shared), "--all-users", prefix=as_user(SCANNER_UID))
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr == USAGE.format(key=key)
