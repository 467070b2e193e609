"""Which directories named like a reaper's park are a reaper's, tried as a hostile user would (#28).

Real uids (``setpriv``), real roots on ``/dev/shm``, real reapers (the library, the agent and the
CLI, some under ``strace -e inject=`` to hold a window open), and real park directories made by
a real ``ParkDir`` in a process that dies (``tests.support.parks``). A user who owns a root (a pod
volume) can rename any directory in it to a park name, a private 0700 one of root's included;
a user anywhere can make look-alikes of their own. None of it may be entered, renamed or removed
unless it carries its reaper's mark, and every refusal is reported.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.liveness import park
from kvoffload.liveness.park import PARK_PREFIX, Adopter, FoundPark, RootId, Untrusted, format_park_name
from kvoffload.liveness.reap import reap
from kvoffload.liveness.scan import scan
from kvoffload.liveness.watch import WatchConfig, Watcher
from tests.support.parks import dead_park, parks, running_park
from tests.support.procs import REPO, Child, region_path, write_file
from tests.support.schemas import validate
from tests.support.traced import Traced, needs_strace

pytestmark = pytest.mark.root

USER = 1000
#: A park name that parses, as a user would type one.
FAKE = f"{PARK_PREFIX}1-1-0123456789abcdef"


@pytest.fixture(autouse=True)
def _root_and_setpriv() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to act as another user")


def as_user(code: str, *args: str, uid: int = USER) -> subprocess.CompletedProcess[str]:
    """Run Python ``code`` as ``uid``; its stdout is the answer."""
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def user_rename(src: Path, dst: Path) -> str:
    """``rename(src, dst)`` as the user; "ok" or the errno's name."""
    done = as_user(
        "import errno, os, sys\n"
        "try:\n    os.rename(sys.argv[1], sys.argv[2]); print('ok')\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])",
        str(src),
        str(dst),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def pod_volume(root: Path) -> Path:
    """The root as a pod's memory volume: owned by the user, who may rename anything in it."""
    os.chown(root, USER, USER)
    root.chmod(0o755)
    return root


def sticky(root: Path) -> Path:
    """The root as /dev/shm is: world-writable and sticky."""
    root.chmod(0o1777)
    return root


def dead(path: Path, uid: int = 0) -> Path:
    """A region file nobody holds, owned by ``uid``."""
    write_file(path, 8192, touch=2)
    os.chown(path, uid, uid)
    return path


def watch(root: Path, passes: int, *, all_users: bool | None = None) -> list[Any]:
    seen: list[Any] = []
    watcher = Watcher(
        WatchConfig(roots=(str(root),), interval_s=0, reap=True, grace_s=0, all_users=all_users),
        on_event=seen.append,
    )
    for _ in range(passes):
        watcher.run_pass()
    return seen


def events(seen: list[Any], kind: str) -> list[Any]:
    return [e for e in seen if e.event == kind]


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shmctl", *argv],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def root_id(root: Path) -> RootId:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return RootId.of(fd)
    finally:
        os.close(fd)


def judged(root: Path, name: str, adopter: Adopter | None = None) -> FoundPark | Untrusted | None:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return park.judge(fd, name, RootId.of(fd), adopter or Adopter.of(None))
    finally:
        os.close(fd)


# -- 1. a mark that nobody else can forge -----------------------------------------------------


def test_a_real_reapers_dead_park_is_trusted_and_settled(root: Path, engine_id: str) -> None:
    folder = dead_park(root, dead(region_path(root, engine_id)))
    found = judged(root, folder.name)
    assert isinstance(found, FoundPark)
    assert (found.running, found.files, found.unfinished) == (
        False,
        (region_path(root, engine_id).name,),
        False,
    )
    report = reap(root, grace_s=0)
    assert [e.name for e in report.removed] == [region_path(root, engine_id).name]
    assert report.parks_removed == (folder.name,)
    assert os.listdir(root) == []


def test_a_root_directory_the_roots_owner_renames_to_a_park_name_is_never_entered(
    root: Path, engine_id: str
) -> None:
    """Issue #28's first row: root's private directory, holding root's dead and live region files,
    renamed to a park name by the user who owns the root. Before the mark, root's reaper adopted
    it: removed the dead file, "gave back" the live one into the user's root, rmdir'ed it."""
    pod_volume(root)
    private = root / "private"
    private.mkdir(mode=0o700)
    gone = dead(private / region_path(root, f"{engine_id}-dead").name)
    live = dead(private / region_path(root, f"{engine_id}-live").name)
    fake = root / FAKE
    with Child("map-only", live):
        assert user_rename(private, fake) == "ok"
        before = sorted(os.listdir(fake))
        for all_users in (None, True):
            report = reap(root, grace_s=0, all_users=all_users)
            assert (report.removed, report.restored, report.parks_removed) == ((), (), ())
            (untrusted,) = report.untrusted_parks
            assert (untrusted.name, untrusted.kind, untrusted.uid, untrusted.mode) == (
                FAKE,
                "directory",
                0,
                "0700",
            )
            assert "no mark" in untrusted.reason
        seen = watch(root, 3)
        (told,) = events(seen, "park_untrusted")  # once, not every pass
        assert (told.name, told.uid, told.mode) == (FAKE, 0, "0700")
        assert not events(seen, "removed")
        done = cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json")
        assert done.returncode == 0, done.stderr
        assert "park directory that this run may not trust were left untouched" in done.stderr
        document = json.loads(done.stdout)
        validate(document, "reap")
        assert [u["name"] for u in document["untrusted_parks"]] == [FAKE]
        assert sorted(os.listdir(fake)) == before
        assert not gone.exists()
        assert (fake / gone.name).exists()
        assert (fake / live.name).stat().st_nlink == 1
        assert sorted(os.listdir(root)) == [FAKE]


def _mkdir_owned(path: Path, uid: int) -> None:
    path.mkdir(mode=0o700)
    os.chown(path, uid, uid)


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda d: d.mkdir(mode=0o700), "no mark"),  # a directory of ours, not empty: not unfinished
        (lambda d: d.mkdir(mode=0o755), "mode 0755, not 0700"),
        (lambda d: _mkdir_owned(d, USER), "owned by uid 1000"),
    ],
    ids=["no-mark", "mode", "owner"],
)
def test_a_look_alike_is_judged_untrusted_with_the_reason_and_its_file_is_untouched(
    root: Path, engine_id: str, make: Any, why: str
) -> None:
    folder = root / format_park_name(4_194_303, 1)
    make(folder)
    inside = dead(folder / region_path(root, engine_id).name)
    found = judged(root, folder.name)
    assert isinstance(found, Untrusted)
    assert why in found.reason
    report = reap(root, grace_s=0)
    assert report.removed == ()
    assert report.restored == ()
    assert inside.exists()
    assert scan(root, grace_s=0).entries == ()  # an untrusted directory's files are never listed


def test_a_real_park_moved_in_from_another_root_is_untrusted(root: Path, engine_id: str) -> None:
    """The mark names the root it was made in: a park moved to another root (by a user who owns
    both) would give its files back there."""
    elsewhere = root / "a"
    here = root / "b"
    elsewhere.mkdir()
    here.mkdir()
    folder = dead_park(elsewhere, dead(region_path(elsewhere, engine_id)))
    folder.rename(here / folder.name)
    found = judged(here, folder.name)
    assert isinstance(found, Untrusted)
    assert "names another root" in found.reason
    assert reap(here, grace_s=0).parks_removed == ()
    assert (here / folder.name / region_path(root, engine_id).name).exists()


def test_a_park_directory_that_is_a_mount_point_is_untrusted(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    """A bind mount shows a real park (its mark, its files) at a second name on the same
    filesystem: adopted there too, its files would be settled twice."""
    real = dead_park(root, dead(region_path(root, engine_id)))
    second = root / format_park_name(4_194_302, 1)
    second.mkdir(mode=0o700)
    done = subprocess.run(["mount", "--bind", str(real), str(second)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {done.stderr!r}")
    try:
        found = judged(root, second.name)
        assert isinstance(found, Untrusted)
        assert "mount point" in found.reason
        assert [u.name for u in scan(root, grace_s=0).untrusted_parks] == [second.name]
    finally:
        subprocess.run(["umount", str(second)], check=True)
    # Unmounted, the second name is an empty, unmarked directory of root's: unfinished, it goes.
    report = reap(root, grace_s=0)
    assert sorted(report.parks_removed) == sorted([real.name, second.name])
    assert os.listdir(root) == []


def test_the_users_empty_look_alikes_are_left_and_reported_by_a_root_reap(root: Path) -> None:
    """Issue #28's fourth row: a user's empty directories named like parks, one of which does not
    even parse; root's `reap --yes` removed both and said nothing."""
    sticky(root)
    made = as_user(
        "import os, sys\nfor n in sys.argv[2:]:\n    os.mkdir(os.path.join(sys.argv[1], n), 0o700)",
        str(root),
        f"{PARK_PREFIX}my-precious",
        FAKE,
    )
    assert made.returncode == 0, made.stderr
    for flags in ((), ("--all-users",)):
        done = cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json", *flags)
        assert done.returncode == 0, done.stderr
        document = json.loads(done.stdout)
        validate(document, "reap")
        reasons = {u["name"]: u["reason"] for u in document["untrusted_parks"]}
        assert set(reasons) == {f"{PARK_PREFIX}my-precious", FAKE}
        assert "its name is not a reaper's" in reasons[f"{PARK_PREFIX}my-precious"]
        assert ("no mark" if flags else "owned by uid 1000") in reasons[FAKE]
        assert document["parks_removed"] == []
        assert "2 entr(ies) named like a reaper's park directory" in done.stderr
    assert sorted(os.listdir(root)) == sorted([f"{PARK_PREFIX}my-precious", FAKE])


# -- 2. nothing unlinked where another uid can rename -------------------------------------------


def test_root_adopting_a_users_park_moves_each_file_into_its_own_park_first(
    root: Path, engine_id: str
) -> None:
    sticky(root)
    mine = dead(region_path(root, engine_id), USER)
    folder = dead_park(root, mine, uid=USER)
    assert isinstance(judged(root, folder.name), Untrusted)  # not without --all-users
    assert isinstance(judged(root, folder.name, Adopter.of(True)), FoundPark)
    kept = reap(root, grace_s=0)
    assert kept.removed == ()
    assert (folder / mine.name).exists()
    report = reap(root, grace_s=0, all_users=True)
    assert [e.name for e in report.removed] == [mine.name]
    # Emptied, but a user's directory: its mark is in a directory its owner can rename in.
    assert report.parks_removed == ()
    assert parks(root) == [folder.name]
    assert os.listdir(folder) == [park.mark_name(root_id(root))]


def test_what_a_user_puts_in_its_own_park_is_never_followed_moved_or_given_back(
    root: Path, engine_id: str, victim: Path
) -> None:
    """With --all-users a user's own park is trusted (only the user could have marked it), and the
    user may put anything in it. A reaper parks only regular files with one link: a symlink to
    a file of root's, a fifo, a directory and a hard-linked pair named like region files are
    strangers, left where they are; the user's own dead files (an escape in one name, 255 bytes
    in another) are judged as parked files and removed."""
    sticky(root)
    before = (victim.stat().st_ino, victim.stat().st_size, victim.stat().st_mtime_ns)
    mine = dead(region_path(root, f"{engine_id}-u"), USER)
    folder = dead_park(root, mine, uid=USER)
    made = as_user(
        "import os, sys\n"
        "d, e, victim = sys.argv[1], sys.argv[2], sys.argv[3]\n"
        "n = lambda tag: os.path.join(d, f'vllm_offload_{e}-{tag}.mmap')\n"
        "os.symlink(victim, n('link'))\n"
        "os.mkfifo(n('fifo'))\n"
        "os.mkdir(n('dir'))\n"
        "open(n('hard'), 'w').close()\n"
        "os.link(n('hard'), n('hard2'))\n"
        "for name in (n('esc\\x1b[31m'), os.path.join(d, 'vllm_offload_' + 'x' * 237 + '.mmap')):\n"
        "    with open(name, 'wb') as f:\n"
        "        f.write(b'\\1' * 4096)\n"
        "    os.utime(name, (1, 1))\n",
        str(folder),
        engine_id,
        str(victim),
    )
    assert made.returncode == 0, made.stderr
    strangers = sorted(f"vllm_offload_{engine_id}-{t}.mmap" for t in ("link", "fifo", "dir", "hard", "hard2"))
    done = cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json", "--all-users")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    validate(report, "reap")
    removed = sorted(e["name"] for e in report["removed"])
    assert removed == sorted(
        [mine.name, f"vllm_offload_{engine_id}-esc\x1b[31m.mmap", "vllm_offload_" + "x" * 237 + ".mmap"]
    )
    assert report["restored"] == []
    assert report["kept"] == []  # not even tried: nothing of theirs was moved out and back
    assert report["parks_removed"] == []
    left = sorted(n for n in os.listdir(folder) if not n.startswith(park.MARK_PREFIX))
    assert left == strangers
    assert os.readlink(folder / f"vllm_offload_{engine_id}-link.mmap") == str(victim)
    assert (victim.stat().st_ino, victim.stat().st_size, victim.stat().st_mtime_ns) == before
    (view,) = scan(root, grace_s=0, all_users=True).parks
    assert view.strangers == 5
    assert sorted(os.listdir(root)) == [folder.name]


@needs_strace
@pytest.mark.parametrize("window", ["renameat2", "unlinkat"])
def test_a_swap_in_an_adopted_users_park_never_makes_root_unlink_an_unproven_file(
    root: Path, engine_id: str, window: str
) -> None:
    """Issue #28's second row: in an adopted park that is not the adopter's own, the user swapped
    a file (root's live region, moved in from the root the user owns) between the reaper's
    proof and its unlink, and root unlinked it. Now each file is moved into root's own park
    first (the first ``renameat2``) and proven there, and unlinked only there (the first
    ``unlinkat``): a swap before the move is caught by the proof, and after it the user can
    no longer reach the file."""
    pod_volume(root)
    mine = dead(region_path(root, f"{engine_id}-u"), USER)
    folder = dead_park(root, mine, uid=USER)
    victim = dead(region_path(root, f"{engine_id}-live"))
    ino = victim.stat().st_ino
    with Child("map-only", victim):
        reaper = Traced(
            window,
            1,
            "delay_enter=1500000",
            "reap",
            "--root",
            str(root),
            "--grace",
            "0s",
            "--yes",
            "--json",
            "--all-users",
        )
        try:
            reaper.wait_in_syscall()
            # Root's park is made before either call (the park directory comes first).
            (ours,) = (n for n in parks(root) if (root / n).stat().st_uid == 0)
            target = folder if window == "renameat2" else root / ours
            swapped = user_rename(victim, target / mine.name)
        finally:
            code, out, err = reaper.finish()
        assert code == 0, err
        report = json.loads(out)
        validate(report, "reap")
        if window == "renameat2":
            assert swapped == "ok"  # in its own directory the user may: the proof catches it
            assert report["removed"] == []
            (kept,) = report["kept"]
            assert f"another file (inode {ino}) took its name" in kept["reason"]
            back = folder / mine.name
        else:
            assert swapped == "EACCES"  # root's park: out of the user's reach
            assert [e["name"] for e in report["removed"]] == [mine.name]
            back = victim
        assert back.stat().st_ino == ino
        assert back.stat().st_nlink == 1


def test_files_of_another_uid_in_a_users_park_are_strangers_never_touched(root: Path, engine_id: str) -> None:
    """A reaper of uid 1000 parks only its own files: a root file in its directory (the user moved
    it there, in a root it owns) is not a parked file, whatever its name."""
    pod_volume(root)
    theirs = dead(region_path(root, f"{engine_id}-u"), USER)
    folder = dead_park(root, theirs, uid=USER)
    planted = dead(root / "planted")
    assert user_rename(planted, folder / region_path(root, f"{engine_id}-r").name) == "ok"
    report = reap(root, grace_s=0, all_users=True)
    assert [e.name for e in report.removed] == [theirs.name]
    (view,) = scan(root, grace_s=0, all_users=True).parks
    assert view.strangers == 1
    assert (folder / region_path(root, f"{engine_id}-r").name).exists()


# -- 3. nobody makes a region unremovable silently ------------------------------------------------


def test_a_users_locked_look_alikes_never_hold_back_roots_orphan(root: Path, engine_id: str) -> None:
    """Issue #28's third row: a user holds the lock of a fake park holding a file named like a
    segment of root's orphan, beside 10,000 empty fake parks. The agent never removed root's
    orphan and said nothing; the 10,000 directories were rmdir'ed silently."""
    sticky(root)
    segment = region_path(root, engine_id, 1)
    made = as_user(
        "import os, sys\n"
        "root, seg = sys.argv[1], sys.argv[2]\n"
        "for i in range(10_000):\n"
        "    os.mkdir(os.path.join(root, f'.shmctl-park-{i + 2}-1-{i:016x}'), 0o700)\n"
        "fake = os.path.join(root, '.shmctl-park-1-1-0123456789abcdef')\n"
        "os.mkdir(fake, 0o700)\n"
        "open(os.path.join(fake, seg), 'w').close()\n",
        str(root),
        segment.name,
    )
    assert made.returncode == 0, made.stderr
    holder = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={USER}",
            f"--regid={USER}",
            "--clear-groups",
            sys.executable,
            "-c",
            "import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDONLY)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('held', flush=True)\nsys.stdin.read()",
            str(root / FAKE),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline() == "held\n"
        base = dead(region_path(root, engine_id))
        seg = dead(segment)
        seen = watch(root, 2)
        assert not base.exists()
        assert not seg.exists()
        assert {e.engine_id for e in events(seen, "removed")} == {engine_id}
        assert len(events(seen, "park_untrusted")) == 10_001
        assert not events(seen, "kept_parked")
        assert len(parks(root)) == 10_001
        assert (root / FAKE / segment.name).exists()
    finally:
        for pipe in (holder.stdin, holder.stdout):
            if pipe is not None:
                pipe.close()
        holder.wait(30)


def test_a_users_running_park_holding_a_file_of_its_own_never_holds_back_roots_region(
    root: Path, engine_id: str
) -> None:
    """With --all-users the user's own park is trusted (it could only have been the user's), its
    lock is held: its file waits for its reaper, but it is the user's, and root's region is root's."""
    sticky(root)
    segment = region_path(root, engine_id, 1)
    theirs = dead(segment, USER)
    with running_park(root, theirs, uid=USER) as folder:
        base, seg = dead(region_path(root, engine_id)), dead(segment)
        seen = watch(root, 2, all_users=True)
        assert not base.exists()
        assert not seg.exists()
        assert not events(seen, "kept_parked")
        assert (folder / segment.name).exists()


def test_a_region_whose_own_file_waits_in_a_running_park_is_held_back_and_says_why(
    root: Path, engine_id: str
) -> None:
    segment = dead(region_path(root, engine_id, 1))
    with running_park(root, segment) as folder:
        base = dead(region_path(root, engine_id))
        seen = watch(root, 3)
        (held,) = events(seen, "kept_parked")
        assert held.engine_id == engine_id
        assert folder.name in held.reason
        assert "its reaper runs" in held.reason
        assert base.exists()
    seen = watch(root, 3)  # its reaper is dead: settled, then the base goes too
    assert not base.exists()
    assert parks(root) == []
    assert sum(e.files for e in events(seen, "removed")) == 2


# -- 5'. the name is away for microseconds: the park directory comes first --------------------


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_the_park_directory_is_made_before_the_first_file_is_opened_for_removal(
    root: Path, engine_id: str, tmp_path: Path
) -> None:
    """Issue #28's sixth row: the park directory was made between the batch's first open and its
    rename, under the first file's lease, and a joiner's window grew from ~10 us to ~2 ms."""
    orphan = dead(region_path(root, engine_id))
    log = tmp_path / "strace.log"
    done = subprocess.run(
        [
            "strace",
            "-f",
            "-qq",
            "-e",
            "trace=mkdirat,openat,fcntl",
            "-o",
            str(log),
            sys.executable,
            "-m",
            "shmctl",
            "reap",
            "--root",
            str(root),
            "--grace",
            "0s",
            "--yes",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "SHMCTL_LEASE_GUARD": "off"},
    )
    assert done.returncode == 0, done.stderr
    assert not orphan.exists()
    lines = log.read_text().splitlines()
    made = next(i for i, line in enumerate(lines) if "mkdirat(" in line and PARK_PREFIX in line)
    opens = [i for i, line in enumerate(lines) if "openat(" in line and f'"{orphan.name}"' in line]
    assert len(opens) == 2  # the scan's probe, then the removal's own open
    assert opens[0] < made < opens[1]
    leases = [line for line in lines[:made] if "F_SETLEASE" in line]
    assert not leases or "F_UNLCK" in leases[-1]  # no lease held while it is made


# -- 4. unfinished park directories -----------------------------------------------------------


def test_an_empty_unmarked_park_of_our_own_is_unfinished_and_removed(root: Path) -> None:
    """What a reaper killed between its mkdir and its mark leaves."""
    folder = root / format_park_name(4_194_303, 1)
    folder.mkdir(mode=0o700)
    found = judged(root, folder.name)
    assert isinstance(found, FoundPark)
    assert found.unfinished
    report = reap(root, grace_s=0)
    assert report.parks_removed == (folder.name,)
    assert os.listdir(root) == []


def test_an_empty_unmarked_park_of_another_user_is_never_removed_even_with_all_users(root: Path) -> None:
    folder = root / format_park_name(4_194_303, 1)
    folder.mkdir(mode=0o700)
    os.chown(folder, USER, USER)
    assert isinstance(judged(root, folder.name, Adopter.of(True)), Untrusted)
    assert reap(root, grace_s=0, all_users=True).parks_removed == ()
    assert folder.exists()


def _park_made(root: Path, timeout: float = 30) -> str:
    """The name of the first park directory to appear in ``root``."""
    deadline = time.monotonic() + timeout
    while not parks(root):
        assert time.monotonic() < deadline, "no park directory was made"
        time.sleep(0.002)
    (made,) = parks(root)
    return made


@needs_strace
def test_a_directory_swapped_in_while_the_reaper_makes_its_park_is_never_used(
    root: Path, engine_id: str
) -> None:
    """Between the park's mkdir and its open, the root's owner renames it away and puts an older,
    empty 0700 directory of root's at its name: the reaper must not mark, use or remove it (its
    birth time gives it away: owner, mode and emptiness are root's as well)."""
    pod_volume(root)
    older = root / "older"
    older.mkdir(mode=0o700)
    time.sleep(0.2)  # born well before the reaper's mkdir
    orphan = dead(region_path(root, engine_id))
    reaper = Traced(
        "mkdirat", 1, "delay_exit=3000000", "reap", "--root", str(root), "--grace", "0s", "--yes", "--json"
    )
    try:
        reaper.wait_in_syscall()
        made = _park_made(root)  # the stop may be at the call's entry: wait for the directory itself
        swapped = (user_rename(root / made, root / "moved-away"), user_rename(older, root / made))
    finally:
        code, out, err = reaper.finish()
    assert swapped == ("ok", "ok")
    assert code == 0, err
    # Refused, the directory at that name stays as it was: not marked, used or removed. The
    # reaper made a park directory of its own again, under a new name, and removed it after.
    assert os.listdir(root / made) == []
    assert (root / made).stat().st_uid == 0
    assert [e["name"] for e in json.loads(out)["removed"]] == [orphan.name]
    assert sorted(os.listdir(root)) == sorted([made, "moved-away"])


# -- 5. a root out of inodes ----------------------------------------------------------------


@pytest.fixture
def inode_full(tmp_path: Path) -> Iterator[Path]:
    from tests.support.mounts import mounted_tmpfs

    with mounted_tmpfs(tmp_path / "tmpfs", "size=8m,nr_inodes=24,mode=1777") as point:
        yield point


def _fill(root: Path, engine_id: str) -> list[Path]:
    """Dead one-file and two-file regions until the filesystem has no inode left."""
    made: list[Path] = []
    for i in range(100):
        for segment in (0, 1) if i % 2 else (0,):
            path = region_path(root, f"{engine_id}-{i:02d}", segment)
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                return made  # a base without its segment is a region of one file
            try:
                os.write(fd, b"\1" * 4096)
            finally:
                os.close(fd)
            os.utime(path, (time.time() - 60, time.time() - 60))
            made.append(path)
    raise AssertionError("the tmpfs never ran out of inodes")


def test_a_root_out_of_inodes_is_freed_first_file_in_place(inode_full: Path, engine_id: str) -> None:
    """Issue #28's fifth row: the park directory's mkdir failed with ENOSPC, nothing was removed,
    exit 0, and the summary said the files had changed since the plan."""
    made = _fill(inode_full, engine_id)
    with pytest.raises(OSError, match="No space left on device"):
        os.mkdir(inode_full / "probe")
    done = cli("reap", "--root", str(inode_full), "--grace", "0s", "--yes", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    validate(report, "reap")
    assert sorted(e["name"] for e in report["removed"]) == sorted(p.name for p in made)
    # In place only until the freed inodes hold the park directory and its mark: the first
    # region or two (regions go in engine order), never the rest.
    in_place = {e["engine_id"] for e in report["removed"] if "removed in place" in e["reason"]}
    assert in_place
    assert in_place <= {f"{engine_id}-00", f"{engine_id}-01"}
    assert report["kept"] == []
    assert report["failed"] == []
    assert os.listdir(inode_full) == []


def test_a_root_out_of_inodes_where_others_may_rename_keeps_everything_and_exits_3(
    inode_full: Path, engine_id: str
) -> None:
    volume = inode_full / "volume"
    volume.mkdir()
    pod_volume(volume)
    made = _fill(volume, engine_id)
    done = cli("reap", "--root", str(volume), "--grace", "0s", "--yes", "--json")
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    validate(report, "reap")
    assert report["removed"] == []
    assert sorted(e["name"] for e in report["failed"]) == sorted(p.name for p in made)
    assert all("no inode left" in e["reason"] for e in report["failed"])
    (line,) = done.stderr.splitlines()
    assert line.startswith("shmctl: error: could not remove")
    assert "free one inode" in line
    text = cli("reap", "--root", str(volume), "--grace", "0s", "--yes")
    assert text.returncode == 3
    assert "changed since the plan" not in text.stdout
    assert f"could not remove {len(made)}" in text.stdout
    assert all(p.exists() for p in made)
