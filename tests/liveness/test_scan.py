"""Verdicts of ``scan`` on real processes and a real tmpfs (plus fake /proc trees for blind spots)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError, RootError
from kvoffload.liveness.lease import LeaseState
from kvoffload.liveness.report import ScanReport
from kvoffload.liveness.scan import Evidence, ScanOptions, Status, scan
from kvoffload.shm import owner
from tests.support.procs import (
    NOBODY,
    REPO,
    Child,
    entry,
    fake_proc,
    leave_orphan,
    region_path,
    uninspectable_pids,
    write_file,
)


def judge(root: Path, *, all_users: bool | None = None) -> ScanReport:
    return scan(root, ScanOptions(grace_s=0, all_users=all_users))


def test_a_sigkilled_vllm_creator_leaves_an_orphan(root: Path, engine_id: str) -> None:
    path = leave_orphan(root, engine_id)
    e = entry(judge(root), path.name)
    assert (e.status, e.reason) == (Status.ORPHANED, NOBODY)
    assert (e.engine_id, e.segment, e.holders, e.owner, e.lock_held) == (engine_id, 0, (), None, False)
    assert (e.lease, e.lease_error, e.decided_by) == (LeaseState.FREE, None, Evidence.LEASE)


def test_a_running_vllm_creator_keeps_its_file_live(root: Path, engine_id: str) -> None:
    path = region_path(root, engine_id)
    with Child("vllm", path) as child:
        e = entry(judge(root), path.name)
    assert e.status is Status.LIVE
    assert e.reason.startswith(f"held by 1 process(es): {child.pid}:")
    assert [(h.pid, h.via) for h in e.holders] == [(child.pid, ("fd", "map"))]


@pytest.mark.parametrize("mode", ["map-only", "fd-only"])
def test_a_process_that_only_maps_or_only_opens_the_file_keeps_it_live(
    root: Path, engine_id: str, mode: str
) -> None:
    path = leave_orphan(root, engine_id)
    with Child(mode, path):
        assert entry(judge(root), path.name).status is Status.LIVE
    assert entry(judge(root), path.name).status is Status.ORPHANED


def test_a_kvoffload_region_is_live_by_lock_and_orphaned_once_its_owner_is_killed(
    root: Path, engine_id: str
) -> None:
    path = region_path(root, engine_id)
    child = Child("region", path)
    try:
        live = entry(judge(root), path.name)
        assert live.status is Status.LIVE
        assert live.lock_held is True
        assert [(h.pid, h.via) for h in live.holders] == [(child.pid, ("fd", "map", "lock"))]
        assert live.owner is not None
        assert (live.owner.pid, live.owner.alive) == (child.pid, True)
    finally:
        child.kill()
    dead = entry(judge(root), path.name)
    assert dead.status is Status.ORPHANED
    assert dead.reason == f"{NOBODY}; owner pid {child.pid} has exited"
    assert dead.owner is not None
    assert dead.owner.alive is False
    assert dead.lock_held is False


def test_a_live_process_reusing_a_dead_owners_pid_is_not_the_owner(root: Path, engine_id: str) -> None:
    held = region_path(root, engine_id)
    ghost = write_file(region_path(root, engine_id + "-ghost"))
    with Child("vllm", held) as child:
        # Both files claim an owner with the child's pid but another start time: a dead
        # process whose pid the child now has.
        real = owner.OwnerRecord.for_current_process(engine_id)
        forged = owner.OwnerRecord(
            **{**real.to_json(), "pid": child.pid, "start_ticks": real.start_ticks - 1}
        )
        for path in (held, ghost):
            fd = os.open(path, os.O_RDONLY)
            assert owner.write_owner(fd, forged)
            os.close(fd)
        report = judge(root)
        live, orphan = entry(report, held.name), entry(report, ghost.name)
    assert live.status is Status.LIVE
    assert live.owner is not None
    assert live.owner.alive is False
    assert orphan.status is Status.ORPHANED
    assert f"owner pid {child.pid} was reused by another process" in orphan.reason
    held.unlink()


def test_segments_follow_their_base_file(root: Path, engine_id: str) -> None:
    base = write_file(region_path(root, engine_id))
    segment = write_file(region_path(root, engine_id, 2))
    with Child("map-only", segment) as child:  # vLLM maps segments and closes their fds
        report = judge(root)
        b, s = entry(report, base.name), entry(report, segment.name)
    assert b.status is s.status is Status.LIVE
    assert b.holders == ()
    assert [h.pid for h in s.holders] == [child.pid]
    assert s.reason.startswith("follows its base file: held by 1 process(es)")
    report = judge(root)
    assert {e.status for e in report.entries} == {Status.ORPHANED}
    assert entry(report, segment.name).segment == 2


def test_segments_without_their_base_are_judged_together(root: Path, engine_id: str) -> None:
    write_file(region_path(root, engine_id, 1))
    write_file(region_path(root, engine_id, 2))
    report = judge(root)
    assert [e.status for e in report.entries] == [Status.ORPHANED, Status.ORPHANED]
    assert report.entries[0].reason == f"segment without its base file; {NOBODY}"


def test_an_empty_base_file_without_holder_is_an_orphan_of_a_failed_creator(
    root: Path, engine_id: str
) -> None:
    path = write_file(region_path(root, engine_id), size=0, touch=0)
    e = entry(judge(root), path.name)
    assert e.status is Status.ORPHANED
    assert "creator died before sizing it" in e.reason


def test_a_file_younger_than_the_grace_period_is_starting(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    e = entry(scan(root, grace_s=30), path.name)
    assert e.status is Status.STARTING
    assert "within the 30s grace period" in e.reason
    later = scan(root, grace_s=30, now=time.time() + 31)
    assert entry(later, path.name).status is Status.ORPHANED


def test_age_is_never_evidence_of_death(root: Path, engine_id: str) -> None:
    path = region_path(root, engine_id)
    with Child("vllm", path):
        os.utime(path, (0, 0))  # mtime in 1970
        e = entry(scan(root, grace_s=30, now=time.time() + 86400 * 365), path.name)
        assert e.status is Status.LIVE
    path.unlink()


def test_sizes_are_apparent_and_resident(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id), size=1 << 20, touch=2)
    e = entry(judge(root), path.name)
    assert (e.size_bytes, e.resident_bytes) == (1 << 20, 2 * 4096)
    assert judge(root).summary.orphaned_resident_bytes == 2 * 4096


def test_only_region_names_are_listed(root: Path, engine_id: str) -> None:
    for name in (f"vllm_ec_{engine_id}.mmap", f"vllm_offload_{engine_id}.tmp", "torch_1234", "x.mmap"):
        write_file(root / name)
    legacy = write_file(root / "vllm_offload_1716230400123456789_dp1.mmap")
    hisparse = write_file(root / "vllm_offload_hisparse_1716230400123456789_dp0_dp1.mmap")
    report = judge(root)
    assert [e.name for e in report.entries] == [legacy.name, hisparse.name]


def test_a_symlink_with_a_region_name_is_skipped_and_never_followed(
    root: Path, engine_id: str, victim: Path
) -> None:
    link = region_path(root, engine_id)
    link.symlink_to(victim)
    e = entry(judge(root), link.name)
    assert (e.status, e.reason, e.kind) == (Status.SKIPPED, "symlink: never followed", "symlink")
    assert e.ino == os.lstat(link).st_ino


def test_a_hard_linked_file_is_skipped(root: Path, engine_id: str, victim: Path) -> None:
    link = region_path(root, engine_id)
    os.link(victim, link)
    e = entry(judge(root), link.name)
    assert (e.status, e.reason) == (Status.SKIPPED, "2 hard links: another name shares this inode")


@pytest.mark.parametrize(
    ("make", "kind"),
    [(os.mkfifo, "fifo"), (os.mkdir, "directory")],
)
def test_non_regular_files_are_skipped(
    root: Path, engine_id: str, make: Callable[[Path], None], kind: str
) -> None:
    path = region_path(root, engine_id)
    make(path)
    e = entry(judge(root), path.name)
    assert (e.status, e.reason) == (Status.SKIPPED, f"{kind}: not a region file")


@pytest.mark.root
def test_root_judges_another_users_file_by_default_and_skips_it_only_when_asked(
    root: Path, engine_id: str
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a file to uid 65534")
    path = write_file(region_path(root, engine_id))
    os.chown(path, 65534, 65534)
    judged = entry(judge(root), path.name)
    assert (judged.status, judged.uid, judged.decided_by) == (Status.ORPHANED, 65534, Evidence.LEASE)
    assert entry(judge(root, all_users=True), path.name).status is Status.ORPHANED
    own_only = entry(judge(root, all_users=False), path.name)
    assert own_only.status is Status.SKIPPED
    assert own_only.reason == "owned by uid 65534, not you (judging your own files only: --own-only)"


def test_a_skipped_base_makes_its_segments_skipped(root: Path, engine_id: str, victim: Path) -> None:
    region_path(root, engine_id).symlink_to(victim)
    segment = write_file(region_path(root, engine_id, 1))
    e = entry(judge(root), segment.name)
    base = region_path(root, engine_id).name
    assert (e.status, e.reason) == (
        Status.SKIPPED,
        f"another file of this region is skipped ({base}: symlink: never followed)",
    )


def test_without_a_lease_a_process_that_cannot_be_inspected_makes_an_orphan_candidate_unknown(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    path = write_file(region_path(root, engine_id))
    blind = scan(root, grace_s=0, use_lease=False, proc_root=fake_proc(tmp_path, maps_readable=False))
    e = entry(blind, path.name)
    assert e.status is Status.UNKNOWN
    assert e.reason == (
        "cannot inspect pid 4242 (blind: EISDIR on maps) and no write lease (disabled (--no-lease)); "
        "liveness unproven"
    )
    assert (e.lease, e.lease_error, e.decided_by) == (None, "disabled (--no-lease)", Evidence.PROC)
    assert [u.pid for u in blind.uninspected] == [4242]
    shutil.rmtree(tmp_path / "proc")
    seen = scan(root, grace_s=0, use_lease=False, proc_root=fake_proc(tmp_path, maps_readable=True))
    assert entry(seen, path.name).status is Status.ORPHANED


def test_the_lease_proves_a_file_free_whatever_process_cannot_be_inspected(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    path = write_file(region_path(root, engine_id))
    e = entry(scan(root, grace_s=0, proc_root=fake_proc(tmp_path, maps_readable=False)), path.name)
    assert (e.status, e.reason, e.decided_by) == (Status.ORPHANED, NOBODY, Evidence.LEASE)


def test_without_a_lease_another_uids_uninspectable_process_is_not_excused_by_the_file_mode(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    # It may have opened the 0600 file before a chmod, or before dropping privileges.
    path = write_file(region_path(root, engine_id))
    other_user = fake_proc(tmp_path, maps_readable=False, uid=os.geteuid() + 1000, caps=0)
    e = entry(scan(root, grace_s=0, use_lease=False, proc_root=other_user), path.name)
    assert e.status is Status.UNKNOWN
    assert e.reason.startswith("cannot inspect pid 4242")


def test_the_real_uninspectable_processes_here_make_orphans_unknown_only_without_a_lease(
    root: Path, engine_id: str
) -> None:
    if not uninspectable_pids():
        pytest.skip("every process on this machine can be inspected")
    path = leave_orphan(root, engine_id)
    e = entry(scan(root, grace_s=0, use_lease=False), path.name)
    assert e.status is Status.UNKNOWN
    assert e.reason.startswith("cannot inspect ")
    assert entry(scan(root, grace_s=0), path.name).status is Status.ORPHANED


def run_as_nobody(fn_source: str, root: Path) -> dict[str, str]:
    """Run ``fn_source`` (defines ``result(root)``) as uid 65534 in a child; return its JSON."""
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to uid 65534")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read_end)
            os.setgid(65534)
            os.setuid(65534)
            scope: dict[str, Callable[[Path], dict[str, str]]] = {}
            exec(fn_source, scope)
            out = scope["result"](root)
            os.write(write_end, json.dumps(out).encode())
        except BaseException as e:
            os.write(write_end, json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        data = f.read()
    os.waitpid(pid, 0)
    result = json.loads(data)
    assert isinstance(result, dict)
    return result


@pytest.mark.root
def test_a_user_who_cannot_inspect_roots_processes_sees_its_file_held_by_the_lease(
    root: Path, engine_id: str
) -> None:
    os.chown(root, 65534, 65534)
    path = write_file(region_path(root, engine_id))
    os.chown(path, 65534, 65534)
    source = (
        "from kvoffload.liveness.scan import scan\n"
        "def result(root):\n"
        "    e = scan(root, grace_s=0, use_lease={lease}).entries[0]\n"
        "    return {{'status': e.status.value, 'reason': e.reason, 'lease': e.lease}}\n"
    )
    with Child("fd-only", path):  # a root process holds it; uid 65534 cannot see that
        leased = run_as_nobody(source.format(lease=True), root)
        unleased = run_as_nobody(source.format(lease=False), root)
    assert (leased["status"], leased["lease"]) == ("live", "held"), leased
    assert "write lease was refused" in leased["reason"]
    assert unleased["status"] == "unknown", unleased
    assert "EACCES" in str(unleased["reason"])


@pytest.mark.root
def test_all_users_is_refused_to_a_non_root_caller(root: Path) -> None:
    result = run_as_nobody(
        "from kvoffload.liveness.scan import scan\n"
        "def result(root):\n"
        "    scan(root, all_users=True)\n"
        "    return {}\n",
        root,
    )
    assert result["error"].startswith("ConfigError: all_users: only root")
    with pytest.raises(ConfigError):
        scan(root, grace_s=-1)


def test_a_missing_root_is_a_root_error_with_a_fix(tmp_path: Path) -> None:
    with pytest.raises(RootError, match="does not exist") as info:
        scan(tmp_path / "nope")
    assert info.value.fix
    with pytest.raises(RootError, match="is not a directory"):
        scan(write_file(tmp_path / "file"))


@pytest.mark.root
def test_an_unreadable_root_is_a_root_error(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o755)
    result = run_as_nobody(
        "from kvoffload.liveness.scan import scan\ndef result(root):\n    scan(root)\n    return {}\n", locked
    )
    assert result["error"].startswith("RootError:")
    assert "permission denied" in str(result["error"])


def unshare_available() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "true"], check=False, capture_output=True
    )
    return probe.returncode == 0


IN_OWN_PID_NS = ("unshare", "--pid", "--fork", "--mount-proc")


@pytest.mark.root
def test_a_lock_held_from_a_pid_namespace_we_cannot_see_keeps_the_region_live(
    root: Path, engine_id: str
) -> None:
    if not unshare_available():
        pytest.skip("needs root and unshare(1) to scan from a fresh PID namespace")
    path = region_path(root, engine_id)
    with Child("region", path):
        # The scanner runs in a new PID namespace: the holder is invisible, its lock is not.
        code = (
            "import sys; from kvoffload.liveness.scan import scan; "
            "e = scan(sys.argv[1], grace_s=0).entries[0]; print(e.status.value, e.reason, sep='|')"
        )
        out = subprocess.run(
            [*IN_OWN_PID_NS, sys.executable, "-c", code, str(root)],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=True,
        ).stdout.strip()
    assert out == "live|kvoffload lock held by a participant (possibly in another PID namespace)"


@pytest.mark.root
def test_the_region_of_an_owner_in_another_pid_namespace_is_proven_dead_by_its_free_lock(
    root: Path, engine_id: str
) -> None:
    if not unshare_available():
        pytest.skip("needs root and unshare(1) to create a region from another PID namespace")
    path = region_path(root, engine_id)
    # A restarted container: the creator ran in a PID namespace that is gone now.
    Child("region", path, prefix=(*IN_OWN_PID_NS, "--kill-child")).kill()
    deadline = time.monotonic() + 10
    while True:
        e = entry(judge(root), path.name)
        if e.holders == () or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert e.owner is not None
    assert e.owner.alive is None
    assert e.status is Status.ORPHANED
    assert e.reason.startswith(f"{NOBODY}; owner pid {e.owner.pid} is in another PID ")


@pytest.mark.root
def test_a_region_held_in_another_pid_namespace_is_live_by_its_lock(root: Path, engine_id: str) -> None:
    if not unshare_available():
        pytest.skip("needs root and unshare(1) to create a region from another PID namespace")
    path = region_path(root, engine_id)
    with Child("region", path, prefix=(*IN_OWN_PID_NS, "--kill-child")):
        e = entry(judge(root), path.name)
    assert e.status is Status.LIVE
    assert e.lock_held is True


def test_a_given_proc_pass_is_used_when_it_covers_the_root_and_the_lease_stays_fresh(
    root: Path, engine_id: str
) -> None:
    from kvoffload.liveness.holders import collect_holders

    path = write_file(region_path(root, engine_id))
    index = collect_holders(devices={os.stat(root).st_dev})  # before the holder exists
    with Child("map-only", path) as child:
        given = entry(scan(root, grace_s=0, holders=index), path.name)
        other_device = collect_holders(devices={os.stat("/proc").st_dev})
        own = entry(scan(root, grace_s=0, holders=other_device), path.name)
    # The old pass names nobody, but the lease, probed now, proves the file held.
    assert (given.status, given.decided_by, given.holders, given.lease) == (
        Status.LIVE,
        Evidence.LEASE,
        (),
        LeaseState.HELD,
    )
    # A pass of other devices does not cover the root: the scan walks /proc itself.
    assert (own.status, own.decided_by) == (Status.LIVE, Evidence.PROC)
    assert [h.pid for h in own.holders] == [child.pid]
