"""``reap`` removes orphans and nothing else, even when the directory changes under it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.liveness.reap import ReapFilter, ReapReport, reap
from kvoffload.liveness.report import ScanEntry
from kvoffload.liveness.scan import Status
from kvoffload.shm import owner
from tests.support.procs import (
    Child,
    churn,
    leave_orphan,
    region_path,
    uninspectable_pids,
    write_file,
)

EVERYTHING = ReapFilter()


def reap_now(
    root: Path,
    *,
    filters: ReapFilter = EVERYTHING,
    dry_run: bool = False,
    all_users: bool | None = None,
    now: float | None = None,
    only: ReapReport | None = None,
) -> ReapReport:
    return reap(
        root,
        grace_s=0,
        filters=filters,
        dry_run=dry_run,
        all_users=all_users,
        now=now,
        only=only,
    )


def names(entries: Iterable[ScanEntry]) -> list[str]:
    return sorted(e.name for e in entries)


def test_the_orphan_of_a_sigkilled_holder_is_reaped_and_its_memory_counted(
    root: Path, engine_id: str
) -> None:
    path = leave_orphan(root, engine_id)
    resident = os.stat(path).st_blocks * 512
    report = reap_now(root)
    assert names(report.removed) == [path.name]
    assert (report.kept, report.freed_bytes, report.dry_run) == ((), resident, False)
    assert resident > 0
    assert not path.exists()


def test_a_file_with_a_live_holder_is_never_reaped(root: Path, engine_id: str) -> None:
    path = region_path(root, engine_id)
    with Child("vllm", path):
        report = reap_now(root)
        assert (report.removed, report.kept) == ((), ())
        assert report.summary.live == 1
        assert path.exists()
    path.unlink()


def test_a_live_holder_keeps_its_file_even_with_a_dead_owners_pid_on_record(
    root: Path, engine_id: str
) -> None:
    held = region_path(root, engine_id)
    ghost = write_file(region_path(root, engine_id + "-ghost"))
    with Child("vllm", held) as child:
        real = owner.OwnerRecord.for_current_process(engine_id)
        dead_owner = owner.OwnerRecord(**{**real.to_json(), "pid": child.pid, "start_ticks": 1})
        for path in (held, ghost):
            fd = os.open(path, os.O_RDONLY)
            owner.write_owner(fd, dead_owner)
            os.close(fd)
        report = reap_now(root, filters=ReapFilter(owner_pids=(child.pid,)))
        assert names(report.removed) == [ghost.name]
        assert held.exists()
    held.unlink()


def test_filters_select_by_engine_and_dead_owner_pid(root: Path, engine_id: str) -> None:
    mine = leave_orphan(root, engine_id, mode="region")
    other = leave_orphan(root, engine_id + "-other")
    record = owner.read_owner(mine)
    assert record is not None
    assert names(reap_now(root, dry_run=True, filters=ReapFilter(owner_pids=(record.pid,))).removed) == [
        mine.name
    ]
    assert names(reap_now(root, filters=ReapFilter(engine_ids=(engine_id + "-other",))).removed) == [
        other.name
    ]
    assert mine.exists()
    assert names(reap_now(root, filters=ReapFilter(engine_ids=(engine_id,))).removed) == [mine.name]


def test_older_than_is_an_extra_filter_after_liveness(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    assert reap_now(root, filters=ReapFilter(older_than_s=3600)).removed == ()
    later = time.time() + 7200
    assert names(reap_now(root, filters=ReapFilter(older_than_s=3600), now=later).removed) == [path.name]
    with pytest.raises(ConfigError):
        ReapFilter(older_than_s=-1)


def test_dry_run_removes_nothing_and_reports_what_would_go(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    report = reap_now(root, dry_run=True)
    assert report.dry_run
    assert names(report.removed) == [path.name]
    assert report.freed_bytes == os.stat(path).st_blocks * 512
    assert path.exists()
    reap_now(root)


def test_segments_go_with_their_base(root: Path, engine_id: str) -> None:
    files = [write_file(region_path(root, engine_id, segment)) for segment in (0, 1, 2)]
    report = reap_now(root)
    assert names(report.removed) == sorted(p.name for p in files)
    assert [e.segment for e in report.removed] == [1, 2, 0]  # base last
    assert os.listdir(root) == []


def test_a_region_with_a_held_segment_is_not_reaped(root: Path, engine_id: str) -> None:
    base = write_file(region_path(root, engine_id))
    segment = write_file(region_path(root, engine_id, 1))
    with Child("map-only", segment):
        assert reap_now(root).removed == ()
    assert base.exists()
    assert segment.exists()
    reap_now(root)


def test_a_symlink_to_a_victim_is_left_alone_and_the_victim_survives(
    root: Path, engine_id: str, victim: Path
) -> None:
    link = region_path(root, engine_id)
    link.symlink_to(victim)
    assert reap_now(root).removed == ()
    assert link.is_symlink()
    assert victim.read_bytes()[:1] == b"x"


def test_a_hard_link_a_fifo_and_a_directory_with_region_names_are_left_alone(
    root: Path, engine_id: str, victim: Path
) -> None:
    os.link(victim, region_path(root, engine_id + "-hard"))
    os.mkfifo(region_path(root, engine_id + "-fifo"))
    os.mkdir(region_path(root, engine_id + "-dir"))
    report = reap_now(root)
    assert report.removed == ()
    assert report.summary.skipped == 3
    assert len(os.listdir(root)) == 3
    assert os.stat(victim).st_nlink == 2


@pytest.mark.root
def test_another_users_file_is_reaped_only_with_all_users(root: Path, engine_id: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a file to uid 65534")
    path = write_file(region_path(root, engine_id))
    os.chown(path, 65534, 65534)
    left = reap_now(root)
    assert left.removed == ()
    assert [(e.name, e.status, e.uid) for e in left.other_users_left] == [(path.name, Status.ORPHANED, 65534)]
    assert path.exists()
    assert names(reap_now(root, all_users=True).removed) == [path.name]


def test_without_a_lease_an_unknown_file_is_never_reaped(root: Path, engine_id: str, tmp_path: Path) -> None:
    path = write_file(region_path(root, engine_id))
    proc = tmp_path / "proc" / "4242"
    (proc / "fd").mkdir(parents=True)
    (proc / "stat").write_text("4242 (blind) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 99 0 0\n")
    (proc / "maps").mkdir()  # unreadable, and no status: it could hold anything
    report = reap(root, grace_s=0, use_lease=False, proc_root=tmp_path / "proc")
    assert (report.removed, report.summary.unknown) == ((), 1)
    assert [e.name for e in report.unknown] == [path.name]
    assert path.exists()
    path.unlink()


def test_a_name_reused_after_the_plan_is_kept(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    plan = reap_now(root, dry_run=True)
    path.unlink()
    write_file(path)  # a new engine with the same pinned engine_id, same name, new inode
    report = reap_now(root, only=plan)
    assert report.removed == ()
    assert [(e.name, e.status, e.reason) for e in report.kept] == [
        (path.name, Status.UNKNOWN, "the name now refers to another file")
    ]
    assert path.exists()
    path.unlink()


def test_a_holder_that_attaches_after_the_plan_keeps_the_file(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    plan = reap_now(root, dry_run=True)
    assert names(plan.removed) == [path.name]
    with Child("map-only", path):
        report = reap_now(root, only=plan)
    assert report.removed == ()
    assert [(e.status, e.reason.split(":")[0]) for e in report.kept] == [
        (Status.LIVE, "held by 1 process(es)")
    ]
    assert path.exists()
    reap_now(root)


def test_only_what_the_plan_listed_is_removed(root: Path, engine_id: str) -> None:
    first = leave_orphan(root, engine_id)
    plan = reap_now(root, dry_run=True)
    second = leave_orphan(root, engine_id + "-later")
    assert names(reap_now(root, only=plan).removed) == [first.name]
    assert second.exists()
    reap_now(root)


def test_a_reaper_looping_against_a_process_that_creates_and_attaches_never_removes_a_live_region(
    root: Path,
) -> None:
    creator = churn(root, seconds=2.0)
    removed = 0
    try:
        while creator.poll() is None:
            removed += len(reap_now(root).removed)
        out, err = creator.communicate(timeout=30)
    finally:
        if creator.poll() is None:
            creator.kill()
            creator.communicate()
    assert creator.returncode == 0, err
    result = json.loads(out)
    assert result["violations"] == []
    assert result["iterations"] > 10
    removed += len(reap_now(root).removed)  # the creator is gone: all that is left is orphaned
    assert removed == result["orphans"]
    assert os.listdir(root) == []


def test_every_engine_filter_counts_and_globs_select_by_pattern(root: Path, engine_id: str) -> None:
    a, b, c = (leave_orphan(root, f"{engine_id}-{x}") for x in ("a1", "b1", "c1"))
    both = ReapFilter(engine_ids=(f"{engine_id}-a1", f"{engine_id}-c1"))
    assert names(reap_now(root, dry_run=True, filters=both).removed) == sorted([a.name, c.name])
    pattern = ReapFilter(engine_ids=(f"{engine_id}-[ab]*",))
    assert names(reap_now(root, dry_run=True, filters=pattern).removed) == sorted([a.name, b.name])
    every = ReapFilter(engine_ids=(f"{engine_id}-*",))
    assert names(reap_now(root, filters=every).removed) == sorted([a.name, b.name, c.name])


def test_an_engine_id_with_glob_characters_is_matched_only_by_itself(root: Path, engine_id: str) -> None:
    starred = leave_orphan(root, f"{engine_id}-x*")
    plain = leave_orphan(root, f"{engine_id}-xyz")
    chosen = reap_now(root, filters=ReapFilter.exactly(f"{engine_id}-x*")).removed
    assert names(chosen) == [starred.name]
    assert plain.exists()
    plain.unlink()


def test_filter_values_that_name_no_region_are_reported(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    filters = ReapFilter(engine_ids=(engine_id, "kvtest-nothing-*"), owner_pids=(2**22 + 1,))
    report = reap_now(root, dry_run=True, filters=filters)
    assert report.unmatched_filters == ("--engine 'kvtest-nothing-*'", f"--pid {2**22 + 1}")
    assert report.removed == ()  # the pid condition holds for no region
    assert names(report.filtered_out) == [path.name]
    path.unlink()


def test_age_and_older_than_count_from_mtime_as_ls_does(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    two_hours_ago = time.time() - 7200
    os.utime(path, (two_hours_ago, two_hours_ago))  # ctime is now: only mtime is old
    report = reap_now(root, dry_run=True, filters=ReapFilter(older_than_s=3600))
    assert names(report.removed) == [path.name]
    (entry,) = report.removed
    assert entry.mtime_ns == os.stat(path).st_mtime_ns
    assert 7200 <= entry.age_s < 7200 + 60
    path.unlink()


def test_the_grace_period_still_sees_a_file_changed_just_now_despite_an_old_mtime(
    root: Path, engine_id: str
) -> None:
    path = leave_orphan(root, engine_id)
    os.utime(path, (time.time() - 7200,) * 2)
    report = reap(root, grace_s=60, dry_run=True)
    assert report.removed == ()
    assert report.summary.starting == 1
    path.unlink()


@pytest.fixture
def fd_limit() -> Iterable[Callable[[int], None]]:
    """Lower this process's soft fd limit for one test; the old one comes back after it."""
    import resource

    before = resource.getrlimit(resource.RLIMIT_NOFILE)

    def lower(soft: int) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))

    yield lower
    resource.setrlimit(resource.RLIMIT_NOFILE, before)


@pytest.mark.parametrize(("soft", "files"), [(256, 64), (2048, 512), (8192, 1024)])
def test_a_batch_holds_at_most_a_quarter_of_the_fd_limit(
    fd_limit: Callable[[int], None], soft: int, files: int
) -> None:
    from kvoffload.liveness.reap import batch_files

    fd_limit(soft)
    assert batch_files() == files


@pytest.mark.parametrize("soft", [16, 24, 64])
def test_a_batch_never_needs_more_fds_than_are_free(fd_limit: Callable[[int], None], soft: int) -> None:
    from kvoffload.liveness.reap import FD_RESERVE, batch_files

    in_use = len(os.listdir("/proc/self/fd")) - 1  # before the limit: at 16 pytest may hold more
    fd_limit(soft)
    assert 1 <= batch_files() <= max(1, soft - in_use - FD_RESERVE)


@pytest.mark.parametrize("lease", [True, False], ids=["lease", "no-lease"])
def test_orphans_across_several_batches_all_go_and_a_holder_between_them_stays(
    root: Path, engine_id: str, fd_limit: Callable[[int], None], lease: bool
) -> None:
    fd_limit(512)  # 128 files a batch: three batches and a bit
    orphans = [write_file(region_path(root, f"{engine_id}-{i:03d}"), 4096) for i in range(400)]
    held = write_file(region_path(root, f"{engine_id}-200-held"), 4096)
    with Child("map-only", held):
        report = reap(root, grace_s=0, use_lease=lease, assume_not_holding=uninspectable_pids())
        still = held.exists()
    assert sorted(e.name for e in report.removed) == sorted(p.name for p in orphans)
    assert not any(p.exists() for p in orphans)
    assert still
    assert report.kept == ()
