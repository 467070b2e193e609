"""A hostile or merely messy shm root: links, odd file types, swaps at the worst moment, other
users' files, names that almost match, a full filesystem. Whatever happens, nothing live or
foreign is removed, and every verdict says why in ``reason``.

Swaps at an exact moment use ``ProcGate``: a /proc tree the test controls whose one process
makes every holder pass wait for the test (the pass inside ``scan``; step 4 of ``reap``,
after the files are locked and before they are unlinked). Races in a loop use real threads
and processes against the real /proc.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
from kvoffload.errors import InsufficientSpaceError
from kvoffload.liveness.reap import reap
from kvoffload.liveness.report import ScanEntry, ScanReport
from kvoffload.liveness.scan import Status, scan
from kvoffload.shm import names
from shmctl.app import main
from tests.support.hostile import (
    ForeignHolder,
    ProcGate,
    as_user,
    fill,
    fill_after_the_space_check,
    shmctl,
    small_tmpfs,
)
from tests.support.procs import REPO, Child, entry, region_path, shm_dir, write_file

KEPT_CHANGED = "kept: the name changed just before removal"


@pytest.fixture
def outside() -> Iterator[Path]:
    """Another directory on the same tmpfs: hard links can reach it, reaps of ``root`` cannot."""
    with shm_dir() as path:
        yield path


def fingerprint(path: Path) -> tuple[int, int, int, int, bytes]:
    """What must not change about a victim: inode, links, size, mode and its first bytes."""
    st = os.lstat(path)
    head = path.read_bytes()[:16] if stat.S_ISREG(st.st_mode) else b""
    return (st.st_ino, st.st_nlink, st.st_size, st.st_mode, head)


# ----------------------------------------------------------------------------- links


SYMLINK_TARGETS = [
    "victim outside the root",
    "victim inside the root",
    "live region",
    "directory",
    "dangling",
]


@pytest.mark.parametrize("target", SYMLINK_TARGETS)
def test_a_symlink_with_a_region_name_is_skipped_and_nothing_it_points_to_is_touched(
    root: Path, engine_id: str, tmp_path: Path, target: str
) -> None:
    victim = _make_victim(target, root, engine_id, tmp_path)
    link = region_path(root, engine_id)
    link.symlink_to(victim)
    before = fingerprint(victim) if os.path.lexists(victim) else None
    with Child("map-only", victim) if target == "live region" else contextlib.nullcontext():
        report = reap(root, grace_s=0)
        skipped = entry(report_of(root), link.name)
        if target == "live region":
            assert entry(report_of(root), victim.name).status is Status.LIVE
    assert report.removed == ()
    assert (skipped.status, skipped.kind, skipped.reason) == (
        Status.SKIPPED,
        "symlink",
        "symlink: never followed",
    )
    assert link.is_symlink()
    assert os.readlink(link) == str(victim)
    if before is not None:
        assert fingerprint(victim) == before


def report_of(root: Path) -> ScanReport:
    return scan(root, grace_s=0)


def _make_victim(target: str, root: Path, engine_id: str, tmp_path: Path) -> Path:
    if target == "victim outside the root":
        return write_file(tmp_path / "victim")
    if target == "victim inside the root":
        return write_file(root / "victim")
    if target == "live region":
        return write_file(region_path(root, engine_id + "-live"))
    if target == "directory":
        (tmp_path / "dir").mkdir()
        return tmp_path / "dir"
    return tmp_path / "nothing-here"


def test_two_region_names_on_one_inode_are_both_skipped_and_kept(root: Path, engine_id: str) -> None:
    first = write_file(region_path(root, engine_id))
    second = region_path(root, engine_id + "-alias")
    os.link(first, second)
    report = reap(root, grace_s=0)
    assert report.removed == ()
    fresh = report_of(root)
    for path in (first, second):
        e = entry(fresh, path.name)
        assert (e.status, e.reason) == (Status.SKIPPED, "2 hard links: another name shares this inode")
    assert os.stat(first).st_nlink == 2


def test_a_hard_link_to_a_live_region_keeps_the_region_and_its_alias(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    live = write_file(region_path(root, engine_id))
    alias = root / "alias-of-live"
    os.link(live, alias)
    with Child("map-only", live):
        report = reap(root, grace_s=0)
        assert entry(report_of(root), live.name).status is Status.SKIPPED
    assert report.removed == ()
    assert os.stat(live).st_nlink == 2


def test_a_socket_and_a_device_with_region_names_are_left_alone(root: Path, engine_id: str) -> None:
    sock_path = region_path(root, engine_id + "-sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(sock_path))
        kinds = {sock_path.name: "socket"}
        device = region_path(root, engine_id + "-dev")
        try:
            os.mknod(device, 0o600 | stat.S_IFCHR, os.makedev(1, 3))
            kinds[device.name] = "character device"
        except PermissionError:
            pass  # no CAP_MKNOD here: the socket still makes the point
        report = reap(root, grace_s=0)
        assert report.removed == ()
        fresh = report_of(root)
        for name, kind in kinds.items():
            e = entry(fresh, name)
            assert (e.status, e.kind, e.reason) == (Status.SKIPPED, kind, f"{kind}: not a region file")
            assert os.path.lexists(root / name)
    finally:
        sock.close()


# ------------------------------------------------------------- swaps at the worst moment


def swap_in_symlink(path: Path, target: Path) -> Callable[[], None]:
    def swap() -> None:
        tmp = path.with_name(path.name + ".swap")
        tmp.symlink_to(target)
        os.replace(tmp, path)

    return swap


def swap_in_new_file(path: Path) -> Callable[[], None]:
    def swap() -> None:
        tmp = write_file(path.with_name(path.name + ".swap"))
        os.replace(tmp, path)

    return swap


def test_a_file_swapped_for_a_symlink_during_the_scan_is_unknown_not_orphaned(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    path = write_file(region_path(root, engine_id))
    victim = write_file(tmp_path / "victim")
    before = fingerprint(victim)
    with ProcGate(tmp_path, [swap_in_symlink(path, victim)]) as gate:
        e = entry(scan(root, grace_s=0, proc_root=gate.root), path.name)
    assert e.status is Status.UNKNOWN
    assert e.reason == f"{path.name}: replaced by a symlink during the scan; liveness unproven"
    assert path.is_symlink()
    assert fingerprint(victim) == before


def test_a_name_reused_by_a_new_file_during_the_scan_is_unknown_not_orphaned(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    path = write_file(region_path(root, engine_id))
    with ProcGate(tmp_path, [swap_in_new_file(path)]) as gate:
        e = entry(scan(root, grace_s=0, proc_root=gate.root), path.name)
    assert e.status is Status.UNKNOWN
    assert e.reason == f"{path.name}: replaced by another file during the scan; liveness unproven"


def _late_changes(path: Path, outside: Path) -> dict[str, tuple[Callable[[], None], Status, str]]:
    """What can happen to a name between reap's lock and its unlink, and what reap must say."""

    def remove() -> None:
        path.unlink()

    def hard_link() -> None:
        os.link(path, outside / "second-name")

    def fifo() -> None:
        tmp = path.with_name(path.name + ".swap")
        os.mkfifo(tmp)
        os.replace(tmp, path)

    return {
        "symlink": (swap_in_symlink(path, outside / "victim"), Status.UNKNOWN, KEPT_CHANGED),
        "new engine, same name": (swap_in_new_file(path), Status.UNKNOWN, KEPT_CHANGED),
        "second hard link": (hard_link, Status.UNKNOWN, KEPT_CHANGED),
        "fifo": (fifo, Status.UNKNOWN, KEPT_CHANGED),
        "removed by someone else": (remove, Status.ORPHANED, "gone before removal (removed by someone else)"),
    }


@pytest.mark.parametrize(
    "change", ["symlink", "new engine, same name", "second hard link", "fifo", "removed by someone else"]
)
def test_reap_keeps_a_name_that_changes_after_its_files_are_locked(
    root: Path, engine_id: str, tmp_path: Path, outside: Path, change: str
) -> None:
    path = write_file(region_path(root, engine_id))
    victim = write_file(outside / "victim")
    before = fingerprint(victim)
    act, status, reason = _late_changes(path, outside)[change]
    # Pass 0 is reap's scan; pass 1 is its re-check with the files locked (step 4, the path
    # without a lease; with one, the same re-lstat runs under the lease instead of a pass).
    with ProcGate(tmp_path, [None, act]) as gate:
        report = reap(root, grace_s=0, use_lease=False, proc_root=gate.root)
    assert gate.passes == 2
    assert report.removed == ()
    assert [(e.name, e.status, e.reason) for e in report.kept] == [(path.name, status, reason)]
    assert fingerprint(victim) == before
    if change != "removed by someone else":
        assert os.path.lexists(path)


def test_a_symlink_planted_between_the_plan_and_the_reap_is_kept(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    path = write_file(region_path(root, engine_id))
    victim = write_file(tmp_path / "victim")
    plan = reap(root, grace_s=0, dry_run=True)
    assert [e.name for e in plan.removed] == [path.name]
    swap_in_symlink(path, victim)()
    report = reap(root, grace_s=0, only=plan)
    assert report.removed == ()
    assert [(e.status, e.reason) for e in report.kept] == [
        (Status.UNKNOWN, "the name now refers to another file")
    ]
    assert path.is_symlink()
    assert victim.read_bytes()[:1] == b"x"


@pytest.mark.slow
def test_a_name_flipping_between_file_symlink_and_hard_link_never_fools_a_reaper_in_a_loop(
    root: Path, engine_id: str, tmp_path: Path, outside: Path
) -> None:
    path = region_path(root, engine_id)
    live = write_file(region_path(root, engine_id + "-live"))
    victim = write_file(tmp_path / "victim")
    before = fingerprint(victim)
    regular: set[tuple[int, int]] = set()
    planted: set[tuple[int, int]] = set()
    stop = threading.Event()
    failures: list[BaseException] = []

    def flip() -> None:
        n = 0
        try:
            while not stop.is_set():
                n += 1
                tmp = path.with_name(f"{path.name}.{n}")
                kind = n % 3
                if kind == 0:
                    tmp.symlink_to(victim if n % 2 else live)
                    st = os.lstat(tmp)
                    planted.add((st.st_dev, st.st_ino))
                else:
                    write_file(tmp, 4096)
                    st = os.lstat(tmp)
                    if kind == 2:  # a second name outside the root, kept: never one link
                        os.link(tmp, outside / f"second-name-{n}")
                        planted.add((st.st_dev, st.st_ino))
                    else:
                        regular.add((st.st_dev, st.st_ino))
                os.replace(tmp, path)
                time.sleep(0.0002)
        except BaseException as e:
            failures.append(e)

    removed: list[ScanEntry] = []
    flipper = threading.Thread(target=flip, name="flipper")
    with Child("map-only", live):
        flipper.start()
        try:
            deadline = time.monotonic() + 2.0
            rounds = 0
            while time.monotonic() < deadline or rounds < 5:
                rounds += 1
                report = reap(root, grace_s=0)
                removed.extend(report.removed)
        finally:
            stop.set()
            flipper.join(10)
        assert live.exists()
        assert entry(report_of(root), live.name).status is Status.LIVE
    assert failures == []
    assert all(e.name == path.name for e in removed)
    assert {e.identity for e in removed} <= regular  # never a symlink, never a linked inode
    assert not {e.identity for e in removed} & planted
    assert fingerprint(victim) == before


_RECREATE = r"""
import json, mmap, os, random, sys, time
path, seconds = sys.argv[1], float(sys.argv[2])
random.seed(0)
violations, generations = [], 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    generations += 1
    # The previous generation crashed and left its file; the new engine (same pinned id)
    # clears the name and creates the region again: same name, new inode.
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 2 * mmap.PAGESIZE)
    mm = mmap.mmap(fd, 2 * mmap.PAGESIZE, flags=mmap.MAP_SHARED)
    mm[0] = 1
    ino = os.fstat(fd).st_ino
    time.sleep(random.choice((0.0, 0.001, 0.005)))
    try:
        if os.stat(path).st_ino != ino:
            violations.append(f"generation {generations}: replaced while attached")
    except FileNotFoundError:
        violations.append(f"generation {generations}: removed while attached")
    mm.close()
    os.close(fd)  # a crash: no unlink, the file is the reaper's now
print(json.dumps({"generations": generations, "violations": violations}), flush=True)
"""


@pytest.mark.slow
def test_an_engine_recreating_its_pinned_name_never_loses_the_live_generation_to_a_reaper(
    root: Path, engine_id: str
) -> None:
    path = region_path(root, engine_id)
    engine = subprocess.Popen(
        [sys.executable, "-c", _RECREATE, str(path), "2.0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    removed = 0
    try:
        while engine.poll() is None:
            report = reap(root, grace_s=0)
            removed += len(report.removed)
            assert all(e.status in (Status.ORPHANED, Status.UNKNOWN, Status.LIVE) for e in report.kept)
        out, err = engine.communicate(timeout=30)
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.communicate()
    assert engine.returncode == 0, err
    result = json.loads(out)
    assert result["violations"] == []
    assert result["generations"] > 10
    path.unlink(missing_ok=True)


# ----------------------------------------------------------------------- other users


@pytest.mark.root
def test_another_users_live_file_is_kept_even_with_all_users(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    os.chown(path, 65534, 65534)
    with ForeignHolder(path) as holder:
        mine = reap(root, grace_s=0)
        everyone = reap(root, grace_s=0, all_users=True)
        e = entry(scan(root, grace_s=0, all_users=True), path.name)
    assert (mine.removed, mine.other_users_left, everyone.removed) == ((), (), ())
    assert e.status is Status.LIVE
    assert [h.pid for h in e.holders] == [holder.pid]
    assert e.reason.startswith(f"held by 1 process(es): {holder.pid}:")
    skipped = entry(scan(root, grace_s=0, all_users=False), path.name)
    assert skipped.reason == "owned by uid 65534, not you (judging your own files only: --own-only)"
    assert [x.name for x in reap(root, grace_s=0).other_users_left] == [path.name]
    assert [x.name for x in reap(root, grace_s=0, all_users=True).removed] == [path.name]


@pytest.mark.root
def test_a_non_root_reaper_proves_its_own_file_dead_by_lease_and_never_touches_roots(
    root: Path, engine_id: str
) -> None:
    os.chmod(root, 0o1777)  # like /dev/shm
    roots_file = write_file(region_path(root, engine_id + "-root"))
    own = write_file(region_path(root, engine_id + "-nobody"))
    os.chown(own, 65534, 65534)

    def reap_as_nobody(use_lease: bool) -> dict[str, object]:
        verdicts = {
            e.name: [e.status.value, e.reason] for e in scan(root, grace_s=0, use_lease=use_lease).entries
        }
        report = reap(root, grace_s=0, use_lease=use_lease)
        return {"removed": [e.name for e in report.removed], "verdicts": verdicts}

    # Without the lease it cannot see root's processes, so its own file stays unknown.
    unleased = as_user(65534, lambda: reap_as_nobody(False))
    assert unleased["removed"] == []
    status, reason = unleased["verdicts"][own.name]
    assert status == "unknown"
    assert "EACCES" in reason
    # With it, its own file is proven free (it owns it) whatever it cannot inspect.
    leased = as_user(65534, lambda: reap_as_nobody(True))
    assert leased["removed"] == [own.name]
    assert leased["verdicts"][roots_file.name] == [
        "skipped",
        "owned by uid 0, not you (only root can judge another user's file)",
    ]
    assert roots_file.exists()
    assert not own.exists()


# ---------------------------------------------------------------------------- names


def near_misses(engine_id: str) -> list[str]:
    """Names that look like region files and are not: never listed, never touched."""
    return [
        "vllm_offload_.mmap",
        f"vllm_offload_{engine_id}.mmap.0",
        f"vllm_offload_{engine_id}.mmap.00",
        f"vllm_offload_{engine_id}.mmap.01",
        f"vllm_offload_{engine_id}.mmap.32",
        f"vllm_offload_{engine_id}.mmap.33",
        f"vllm_offload_{engine_id}.mmap.100",
        f"vllm_offload_{engine_id}.mmap.",
        f"vllm_offload_{engine_id}.mmap.-1",
        f"vllm_offload_{engine_id}.mmap.\u0663",  # ARABIC-INDIC DIGIT THREE
        f"vllm_offload_{engine_id}.mmapx",
        f"vllm_offload_{engine_id}.MMAP",
        f"VLLM_OFFLOAD_{engine_id}.mmap",
        f"vllm_offload_{engine_id}.mmap\n",
        f"vllm_offload_{engine_id}.mmap.1\n",
        f" vllm_offload_{engine_id}.mmap",
        f"vllm_offload_{engine_id}.mmap ",
        f"vllm_ec_{engine_id}.mmap",
        f"vllm_offload_{engine_id}.mmap.tmp",
        f"vllm_offload_{engine_id}",
    ]


def test_names_that_almost_match_are_never_listed_or_removed(root: Path, engine_id: str) -> None:
    for name in near_misses(engine_id):
        write_file(root / name)
    assert report_of(root).entries == ()
    assert reap(root, grace_s=0).removed == ()
    assert sorted(os.listdir(root)) == sorted(near_misses(engine_id))


def exotic_names(engine_id: str) -> list[bytes]:
    """Region names an engine id may legally produce, or a hostile user may plant."""
    tail = ".mmap.1"  # 255 bytes: an engine id this long could not name its .mmap.31
    long_id = engine_id + "x" * (names.NAME_MAX - len(names.PREFIX) - len(tail) - len(engine_id))
    return [
        f"vllm_offload_{engine_id}-ünïcødé-🚀.mmap".encode(),
        f"vllm_offload_{engine_id}-new\nline.mmap".encode(),
        f"vllm_offload_{engine_id}-tab\tbed.mmap".encode(),
        f"vllm_offload_{engine_id}-\x1b[31mred.mmap".encode(),
        f"vllm_offload_{engine_id}-back\\slash.mmap".encode(),
        f"vllm_offload_{engine_id}-bidi\u202etxt.mmap".encode(),
        b"vllm_offload_" + engine_id.encode() + b"-not-utf8-\xff\xfe.mmap",
        f"vllm_offload_{long_id}{tail}".encode(),
        f"vllm_offload_{engine_id}.mmap.mmap.5".encode(),
    ]


def test_exotic_names_parse_and_are_judged_as_regions(engine_id: str) -> None:
    for raw in exotic_names(engine_id):
        name = os.fsdecode(raw)
        parsed = names.parse(name)
        assert parsed is not None, raw
        assert parsed.name == name
    assert len(exotic_names(engine_id)[7]) == names.NAME_MAX


def test_exotic_names_are_reported_one_per_line_and_reaped_by_the_cli(root: Path, engine_id: str) -> None:
    planted = set()
    for raw in exotic_names(engine_id):
        write_file(Path(os.fsdecode(bytes(root) + b"/" + raw)))
        planted.add(raw)
    strict = {"PYTHONIOENCODING": "utf-8", "NO_COLOR": "1"}  # a UTF-8 locale: no surrogateescape

    done = shmctl("scan", "--root", str(root), "--grace", "0", "--json", env=strict)
    assert (done.returncode, done.stderr) == (1, "")
    doc = json.loads(done.stdout)
    assert {os.fsencode(e["name"]) for e in doc["entries"]} == planted
    assert {e["status"] for e in doc["entries"]} == {"orphaned"}

    done = shmctl("scan", "--root", str(root), "--grace", "0", env=strict)
    assert (done.returncode, done.stderr) == (1, "")
    lines = done.stdout.splitlines()
    assert len(lines) == 1 + len(planted) + 1  # header, one line per file, summary
    # Every name is one field: its spaces and control characters are escapes, not columns.
    rows = [line.split(None, 7) for line in lines[1:-1]]
    assert all(len(row) == 8 and row[0] == "orphaned" and row[2] == "1" for row in rows), rows
    assert "\x1b" not in done.stdout
    assert "\u202e" not in done.stdout

    done = shmctl("reap", "--root", str(root), "--grace", "0", "--yes", env=strict)
    assert (done.returncode, done.stderr) == (0, "")
    lines = done.stdout.splitlines()
    assert len(lines) == 1 + len(planted) + 1
    assert all(line.split(None, 3)[0::2] == ["removed", "1"] for line in lines[1:-1])
    assert os.listdir(root) == []


@pytest.mark.system_wide  # an audit of the /dev/shm tmpfs: another test's regions would be leaks
def test_audit_reports_a_leaked_file_with_control_characters_on_escaped_lines(
    root: Path, engine_id: str
) -> None:
    path = root / f"vllm_offload_{engine_id}-\x1b[2J\nforged.mmap"
    make = "import os, sys; os.close(os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o600))"
    done = shmctl(
        "audit", "--root", str(root), "--", sys.executable, "-c", make, str(path), env={"NO_COLOR": "1"}
    )
    assert done.returncode == 1, done.stderr
    assert "\x1b" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 3  # the verdict, the leaked file, how to remove it
    assert lines[0].startswith("shmctl: audit: leaked: ")
    assert lines[1].startswith(f"shmctl: audit:   vllm_offload_{engine_id}-\\x1b[2J\\nforged.mmap: 0 bytes ")
    assert lines[1].split(", ")[2] in (Status.UNKNOWN, Status.ORPHANED)
    path.unlink()


# ------------------------------------------------------------------------ exhaustion


@pytest.mark.root
def test_a_full_root_still_scans_and_its_orphans_are_reaped(tmp_path: Path, engine_id: str) -> None:
    with small_tmpfs(tmp_path) as mnt:
        orphan = write_file(region_path(mnt, engine_id), 1 << 16, touch=4)
        filler = fill(mnt)
        assert os.statvfs(mnt).f_bavail == 0
        done = shmctl("scan", "--root", str(mnt), "--grace", "0", "--json")
        assert done.returncode == 1, done.stderr
        assert [e["name"] for e in json.loads(done.stdout)["entries"]] == [orphan.name]
        done = shmctl("reap", "--root", str(mnt), "--grace", "0", "--yes")
        assert (done.returncode, done.stderr) == (0, "")
        assert sorted(os.listdir(mnt)) == [filler.name]


@pytest.mark.root
def test_a_region_that_does_not_fit_the_root_is_refused_and_leaves_nothing(
    tmp_path: Path, engine_id: str
) -> None:
    with small_tmpfs(tmp_path, "1m") as mnt:
        with pytest.raises(InsufficientSpaceError) as info:
            SharedOffloadRegion(engine_id, 64, None, 8 * PAGESIZE, PAGESIZE, root=mnt)
        assert "MiB required" in str(info.value)
        assert info.value.fix is not None
        assert "--shm-size" in info.value.fix
        assert os.listdir(mnt) == []


@pytest.mark.root
def test_a_root_that_fills_up_after_the_space_check_fails_the_reservation_cleanly(
    tmp_path: Path, engine_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with small_tmpfs(tmp_path, "1m") as mnt:
        filled = fill_after_the_space_check(monkeypatch, mnt)
        with pytest.raises(InsufficientSpaceError) as info:
            SharedOffloadRegion(engine_id, 4, None, 2 * PAGESIZE, PAGESIZE, root=mnt)
        assert filled == [mnt / "filler"]
        cause = info.value.__cause__
        assert isinstance(cause, OSError)
        assert cause.errno == 28  # ENOSPC from posix_fallocate, not the pre-check
        assert os.listdir(mnt) == ["filler"]


@pytest.mark.root
@pytest.mark.slow
def test_init_in_a_root_too_small_for_the_region_exits_3_with_the_fix_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    config = json.dumps({"kv_connector_extra_config": {"cpu_bytes_to_use": 4 << 20}})
    with small_tmpfs(tmp_path, "1m") as mnt:
        done = shmctl(
            "init", "--root", str(mnt), "--kv-transfer-config", config, "--kv-bytes-per-block", "4096"
        )
        # Refused before any worker starts, by the dry run's rule (vLLM's own check, in the
        # region, is tested where the region is made: it is never reached here).
        assert (done.returncode, done.stdout) == (3, "")
        assert done.stderr == (
            f"shmctl: error: {mnt}: 1.0 MiB free of 1.0 MiB (tmpfs), the region needs 4.0 MiB: it does "
            f"not fit; nothing was started (fix: mount -o remount,size=4M {mnt} (docs/doctor.md#space))\n"
        )
        assert os.listdir(mnt) == []


@pytest.mark.root
def test_metrics_into_a_full_textfile_directory_fail_on_one_line_and_leave_no_temp_file(
    tmp_path: Path, root: Path
) -> None:
    with small_tmpfs(tmp_path) as mnt:
        fill(mnt)
        done = shmctl("metrics", "--root", str(root), "--textfile", str(mnt))
        assert (done.returncode, done.stdout) == (3, "")
        assert done.stderr == (
            f"shmctl: error: {mnt}: cannot write shmctl.prom: No space left on device "
            f"(fix: free space on the filesystem that holds {mnt} (df {mnt}), or pass another --textfile)\n"
        )
        assert os.listdir(mnt) == ["filler"]


def run_cli_as_nobody(argv: list[str]) -> tuple[int, str]:
    """``main(argv)`` in a forked child as uid 65534; its exit code and stderr."""

    def run() -> dict[str, object]:
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = main(argv)
        return {"code": int(code), "stderr": err.getvalue()}

    result = as_user(65534, run)
    assert "error" not in result, result
    return int(result["code"]), str(result["stderr"])


@pytest.mark.root
@pytest.mark.parametrize(
    ("mode", "problem"), [(0o700, "permission denied"), (0o744, "permission denied on its entries")]
)
@pytest.mark.parametrize("command", ["scan", "reap"])
def test_a_root_nobody_may_read_is_exit_3_on_one_line_and_left_untouched(
    root: Path, engine_id: str, mode: int, problem: str, command: str
) -> None:
    locked = root / "locked"  # every directory above it is searchable by uid 65534
    locked.mkdir()
    orphan = write_file(region_path(locked, engine_id))
    try:
        # Import every module the command needs while we still can: the child, as uid 65534,
        # may not be able to read this interpreter's standard library.
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(
                [
                    command,
                    "--root",
                    str(locked),
                    "--grace",
                    "0",
                    "--dry-run" if command == "reap" else "--json",
                ]
            )
        os.chmod(locked, mode)
        extra = ["--yes"] if command == "reap" else []
        code, err = run_cli_as_nobody([command, "--root", str(locked), "--grace", "0", *extra])
        assert code == 3, err
        assert err.startswith(f"shmctl: error: --root {locked}: {problem} (fix: ")
        assert err.count("\n") == 1
        assert orphan.exists()
    finally:
        os.chmod(locked, 0o755)
        orphan.unlink()
        locked.rmdir()
