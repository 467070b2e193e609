"""Removal that can never take the wrong file, whoever acts in which window (issue #18).

Real processes throughout. ``strace -e inject=`` opens each window of the reap protocol on
purpose: the reaper (the real CLI) pauses at the entry of one syscall, and an "engine"
process acts in that instant: it re-creates the region name (unlink, ``O_EXCL`` create,
``ftruncate``, ``mmap``, a marker written), or swaps a symlink or a directory in. Then the
reaper goes on, or is SIGKILLed there, and a later ``scan`` and ``reap`` must settle what it
left: a live file gets its name back, a dead one goes, a taken name is a conflict.

Each test states what must hold afterwards: whatever the engine made is at its name, the
same inode, with its data; no symlink or directory is removed or followed; nothing is left
under a private name once settled.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.liveness.park import PARK_PREFIX
from kvoffload.liveness.reap import ReapFilter, reap
from kvoffload.liveness.scan import scan
from shmctl.render.metrics import Exposition, ReapCounters
from tests.support.parks import dead_park, parks, running_park
from tests.support.procs import REPO, region_path, uninspectable_pids, write_file
from tests.support.schemas import validate
from tests.support.traced import _SYSCALLS, Traced, cli, needs_strace

#: The engine, driven over stdin. ``recreate P``: unlink P if there, create it O_EXCL, size it,
#: map it and write a marker, as vLLM's creator does; ``symlink P T`` / ``directory P``: put a
#: symlink (to T) or a directory at P instead; ``open P``: open P O_RDWR as a joiner (this can
#: block on a reaper's lease) and map it; ``check P``: what its file is now. Answers one JSON line.
ENGINE = r"""
import json, mmap, os, sys
keep = []
def answer(**kw):
    print(json.dumps(kw), flush=True)
def what(fd, path):
    st = os.fstat(fd)
    try:
        named = os.stat(path, follow_symlinks=False).st_ino == st.st_ino
    except FileNotFoundError:
        named = False
    return dict(ino=st.st_ino, nlink=st.st_nlink, named=named, marker=os.pread(fd, 4, 0).decode("latin-1"))
for line in sys.stdin:
    words = line.split()
    if not words:
        continue
    command, path = words[0], words[1]
    if command in ("recreate", "symlink", "directory"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if command == "recreate":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 8192)
        m = mmap.mmap(fd, 8192, flags=mmap.MAP_SHARED)
        m[0:4] = b"NEW!"
        keep.append((fd, m, path))
        answer(ino=os.fstat(fd).st_ino)
    elif command == "symlink":
        os.symlink(words[2], path)
        answer(ino=os.lstat(path).st_ino)
    elif command == "directory":
        os.mkdir(path)
        answer(ino=os.lstat(path).st_ino)
    elif command == "open":
        fd = os.open(path, os.O_RDWR)
        keep.append((fd, mmap.mmap(fd, 0, flags=mmap.MAP_SHARED), path))
        answer(**what(fd, path))
    elif command == "check":
        fd = next(k[0] for k in keep if k[2] == path)
        answer(**what(fd, path))
"""


class Engine:
    """An engine process (see ``ENGINE``); its files and mappings go with it."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def send(self, *words: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(" ".join(str(w) for w in words) + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 20) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready = select.select([self.proc.stdout], [], [], timeout)[0]
        assert ready, "the engine did not answer"
        answer: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return answer

    def ask(self, *words: object) -> dict[str, Any]:
        self.send(*words)
        return self.answer()

    def wait_in_open(self, timeout: float = 60) -> None:
        """Block until the engine sits in openat(2), asleep: where a reaper's lease holds it."""
        assert _SYSCALLS is not None
        deadline = time.monotonic() + timeout
        stat = Path(f"/proc/{self.proc.pid}/stat")
        while True:
            current = Path(f"/proc/{self.proc.pid}/syscall").read_text().split()
            asleep = stat.read_text().rsplit(")", 1)[1].split()[0] == "S"
            if current and current[0] == str(_SYSCALLS["openat"]) and asleep:
                return
            assert time.monotonic() < deadline, f"the engine never blocked in open: {current}"
            time.sleep(0.002)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.close()


def run_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*argv), capture_output=True, text=True, cwd=REPO, timeout=120, check=False)


def orphan(root: Path, engine_id: str, segment: int = 0) -> Path:
    return write_file(region_path(root, engine_id, segment), 8192, touch=2)


# -- 1. identity after every path operation -------------------------------------------------

#: The windows: the reaper pauses at the entry of the syscall that follows the check the
#: window is after. ``flock``: between the scan and the reap's lock; ``renameat2``: between the
#: lstat re-check and the park rename; ``unlinkat``: after the proof, before the unlink.
WINDOWS = ["flock", "renameat2", "unlinkat"]


@needs_strace
@pytest.mark.parametrize("swap", ["recreate", "symlink", "directory"])
@pytest.mark.parametrize("window", WINDOWS)
def test_a_name_re_created_in_any_window_of_the_protocol_keeps_what_was_put_there(
    root: Path, engine_id: str, engine: Engine, victim: Path, window: str, swap: str
) -> None:
    path = orphan(root, engine_id)
    reaper = Traced(
        window, 1, "delay_enter=1500000", "reap", "--root", str(root), "--grace", "0s", "--yes", "--json"
    )
    reaper.wait_in_syscall()
    extra = [victim] if swap == "symlink" else []
    made = engine.ask(swap, path, *extra)["ino"]
    code, out, err = reaper.finish()
    assert code == 0, err
    report = json.loads(out)
    validate(report, "reap")
    st = os.lstat(path)
    assert st.st_ino == made, f"the {swap} at the name was taken: {report}"
    if swap == "recreate":
        seen = engine.ask("check", path)
        assert seen == {"ino": made, "nlink": 1, "named": True, "marker": "NEW!"}
    elif swap == "symlink":
        assert stat.S_ISLNK(st.st_mode)
        assert os.readlink(path) == str(victim)
        assert victim.read_bytes()[:1] == b"x"  # the file behind it, intact
    else:
        assert stat.S_ISDIR(st.st_mode)
        os.rmdir(path)
    assert report["removed"] == [] or window == "unlinkat"  # there, the dead file went first
    assert parks(root) == []


@needs_strace
def test_the_park_rename_that_took_a_new_file_gives_it_back_and_says_so(
    root: Path, engine_id: str, engine: Engine
) -> None:
    path = orphan(root, engine_id)
    reaper = Traced(
        "renameat2", 1, "delay_enter=1500000", "reap", "--root", str(root), "--grace", "0s", "--yes", "--json"
    )
    reaper.wait_in_syscall()
    made = engine.ask("recreate", path)["ino"]
    code, out, _ = reaper.finish()
    kept = json.loads(out)["kept"]
    assert code == 0
    assert len(kept) == 1
    assert f"inode {made}, given back untouched" in kept[0]["reason"]
    assert "removed by someone else first" in kept[0]["reason"]  # the engine's unlink freed the orphan


#: Racer for the free-running loop: ``go KIND DELAY_NS PATH`` spins, then re-creates or swaps.
RACER = r"""
import mmap, os, sys, time
keep = []
for line in sys.stdin:
    kind, delay, path = line.split()
    end = time.perf_counter_ns() + int(delay)
    while time.perf_counter_ns() < end:
        pass
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if kind == "recreate":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 4096)
        m = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED)
        m[0:4] = b"NEW!"
        keep[:] = [(fd, m)]
        print(os.fstat(fd).st_ino, flush=True)
    else:
        # Made aside and renamed in, its inode read before: at the name the reaper may already
        # hold it in its park, for the microseconds before it gives it back.
        aside = os.path.join(os.path.dirname(path), "racer-aside")
        os.symlink("/etc/hostname", aside)
        ino = os.lstat(aside).st_ino
        os.rename(aside, path)
        print(ino, flush=True)
"""


@needs_strace
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["recreate", "symlink"])
def test_a_thousand_free_running_races_with_a_re_creating_engine_never_take_its_file(
    root: Path, engine_id: str, empty_proc: Path, kind: str
) -> None:
    racer = subprocess.Popen(
        [sys.executable, "-c", RACER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert racer.stdin is not None
    assert racer.stdout is not None
    rng = random.Random(18)
    path = region_path(root, engine_id)
    outcomes: dict[str, int] = {}
    try:
        for _ in range(1000):
            if os.path.lexists(path):
                os.unlink(path)
            write_file(path, 4096, touch=2)
            racer.stdin.write(f"{kind} {rng.randrange(0, 3_000_000)} {path}\n")
            racer.stdin.flush()
            report = reap(root, grace_s=0, proc_root=empty_proc)
            made = int(racer.stdout.readline())
            st = os.lstat(path)
            assert st.st_ino == made, f"the racer's {kind} lost its name: {report}"
            if kind == "recreate":
                with open(path, "rb") as f:
                    assert f.read(4) == b"NEW!"
            assert parks(root) == []
            key = "removed" if report.removed else (report.kept[0].reason[:40] if report.kept else "none")
            outcomes[key] = outcomes.get(key, 0) + 1
    finally:
        racer.kill()
        racer.wait(10)
        racer.stdin.close()
        racer.stdout.close()
        if os.path.lexists(path):
            os.unlink(path)
    print(outcomes)
    assert outcomes.get("removed", 0) > 0  # the race was run, not dodged: some reaps won it


# -- 2. a parked file always comes back or goes ---------------------------------------------

#: Where the reaper is SIGKILLed: at the entry of the when-th call of a syscall.
KILL_POINTS = {
    "at the park directory's mkdir": ("mkdirat", 1),
    "at the first park rename": ("renameat2", 1),
    "at the second park rename": ("renameat2", 2),
    "at the first unlink": ("unlinkat", 1),
    "at the second unlink": ("unlinkat", 2),
    "at the removal of the park directory's mark": ("unlinkat", 4),
    "at the rmdir of the park directory": ("unlinkat", 5),
}


@needs_strace
@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_reaper_killed_before_any_syscall_leaves_nothing_a_later_reap_cannot_settle(
    root: Path, engine_id: str, engine: Engine, point: str
) -> None:
    dead = [orphan(root, f"{engine_id}-a"), orphan(root, f"{engine_id}-a", 1), orphan(root, f"{engine_id}-b")]
    live = region_path(root, f"{engine_id}-live")
    made = engine.ask("recreate", live)["ino"]
    syscall, when = KILL_POINTS[point]
    killed = Traced(syscall, when, "signal=SIGKILL", "reap", "--root", str(root), "--grace", "0s", "--yes")
    killed.finish()
    scanned = run_cli("scan", "--root", str(root), "--grace", "0s", "--json")
    report = json.loads(scanned.stdout)
    validate(report, "scan")
    for e in report["entries"]:
        if e["status"] == "parked":  # never an engine called .shmctl-park-...
            assert e["parked"]["action"] == "remove"
            assert not e["parked"]["reaper_running"]
            assert e["name"] in {p.name for p in dead}
    assert not any(PARK_PREFIX in e["engine_id"] for e in report["entries"])
    settled = run_cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json")
    assert settled.returncode == 0, settled.stderr
    validate(json.loads(settled.stdout), "reap")
    assert not any(p.exists() for p in dead)
    assert parks(root) == []
    assert engine.ask("check", live) == {"ino": made, "nlink": 1, "named": True, "marker": "NEW!"}
    assert sorted(os.listdir(root)) == [live.name]


@needs_strace
def test_a_reaper_killed_between_its_parks_mkdir_and_its_mark_leaves_a_park_the_next_reap_removes(
    root: Path, engine_id: str
) -> None:
    """The park directory exists unmarked for two syscalls: killed there, the reaper leaves an
    empty, unmarked directory of its own uid (``unfinished``), which is what a later reap may
    remove, and the only unmarked one it ever does."""
    dead = orphan(root, engine_id)
    killed = Traced("mkdirat", 1, "delay_exit=3000000", "reap", "--root", str(root), "--grace", "0s", "--yes")
    pid = killed.wait_in_syscall()
    deadline = time.monotonic() + 30
    while not parks(root):
        assert time.monotonic() < deadline, "the reaper never made its park directory"
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    killed.finish()
    (left,) = parks(root)
    assert os.listdir(root / left) == []
    scanned = json.loads(run_cli("scan", "--root", str(root), "--grace", "0s", "--json").stdout)
    assert [(p["name"], p["unfinished"]) for p in scanned["parks"]] == [(left, True)]
    settled = run_cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json")
    report = json.loads(settled.stdout)
    assert report["parks_removed"] == [left]
    assert [e["name"] for e in report["removed"]] == [dead.name]
    assert os.listdir(root) == []


def _kill_after_the_park_rename(root: Path, path: Path, engine: Engine) -> None:
    """Pause the reaper at the park rename with its lease held; an opener blocks on the lease;
    the rename happens; the reaper is SIGKILLed before anything else. The opener ends up with
    the parked inode and the name is free."""
    reaper = Traced(
        "renameat2",
        1,
        "delay_enter=1000000:delay_exit=3000000",
        "reap",
        "--root",
        str(root),
        "--grace",
        "0s",
        "--yes",
    )
    pid = reaper.wait_in_syscall()
    engine.send("open", path)  # blocks in the kernel on the reaper's lease
    deadline = time.monotonic() + 30
    while os.path.lexists(path):  # the rename, after the enter delay
        assert time.monotonic() < deadline, "the reaper never renamed"
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    reaper.finish()


@needs_strace
def test_a_live_file_parked_by_a_killed_reaper_gets_its_name_back(
    root: Path, engine_id: str, engine: Engine
) -> None:
    path = orphan(root, engine_id)
    _kill_after_the_park_rename(root, path, engine)
    opened = engine.answer()
    assert opened["named"] is False
    assert opened["nlink"] == 1
    scanned = run_cli("scan", "--root", str(root), "--grace", "0s", "--json")
    assert scanned.returncode == 1  # a dead reap left something to settle
    (entry,) = json.loads(scanned.stdout)["entries"]
    assert entry["status"] == "parked"
    assert entry["name"] == path.name
    assert entry["parked"]["verdict"] == "live"
    assert entry["parked"]["action"] == "restore"
    settled = run_cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json")
    assert [e["name"] for e in json.loads(settled.stdout)["restored"]] == [path.name]
    assert engine.ask("check", path) == {**opened, "named": True}
    assert parks(root) == []


@needs_strace
def test_a_parked_live_file_whose_name_was_taken_is_a_conflict_with_both_kept_then_settles(
    root: Path, engine_id: str, engine: Engine
) -> None:
    path = orphan(root, engine_id)
    _kill_after_the_park_rename(root, path, engine)
    opened = engine.answer()
    creator = Engine()
    try:
        made = creator.ask("recreate", path)["ino"]  # a new engine takes the free name
        scanned = json.loads(run_cli("scan", "--root", str(root), "--grace", "0s", "--json").stdout)
        parked = next(e for e in scanned["entries"] if e["status"] == "parked")
        assert parked["parked"]["action"] == "conflict"
        assert parked["parked"]["name_taken_by"][1] == made
        settled = run_cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json")
        assert settled.returncode == 0
        (conflict,) = json.loads(settled.stdout)["conflicts"]
        assert conflict["ino"] == opened["ino"]
        assert "nothing removed" in conflict["reason"]
        assert creator.ask("check", path) == {"ino": made, "nlink": 1, "named": True, "marker": "NEW!"}
        assert engine.ask("check", path)["nlink"] == 1  # the parked one, intact
        # The agent's counter of them: a reap that meets the conflict again counts it again.
        counters = ReapCounters()
        counters.record(reap(root, grace_s=0))
        exposition = Exposition()
        exposition.add_reaps(counters)
        assert f'shmctl_reap_conflicts_total{{root="{root}"}} 1.0' in exposition.text().decode()
        engine.close()  # its last holder exits: now it is dead, and goes
        again = json.loads(run_cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json").stdout)
        assert [e["ino"] for e in again["removed"]] == [opened["ino"]]
        assert parks(root) == []
        assert creator.ask("check", path)["named"] is True
    finally:
        creator.close()


def test_a_running_reapers_park_directory_is_left_to_it(root: Path, engine_id: str) -> None:
    """A park directory whose lock is held belongs to a reap at work: nothing in it is touched."""
    dead = write_file(region_path(root, engine_id), 4096, touch=2)
    with running_park(root, dead) as folder:
        parked = folder / dead.name
        (entry,) = scan(root, grace_s=0).entries
        assert entry.parked is not None
        assert entry.parked.reaper_running
        assert entry.parked.action == "left to its reaper"
        assert entry.lease is None
        assert reap(root, grace_s=0, dry_run=True).parked == ()
        report = reap(root, grace_s=0)
        assert parked.exists()
        assert report.removed == ()
        assert report.restored == ()
    report = reap(root, grace_s=0)  # its reaper is dead now
    assert [e.name for e in report.removed] == [parked.name]
    assert report.parks_removed == (folder.name,)
    assert parks(root) == []


def test_a_park_directory_name_that_is_a_symlink_or_file_is_never_followed(
    root: Path, engine_id: str, victim: Path
) -> None:
    # Behind the link, a dead region file: followed as a park, it would be removed or moved
    # into the root ("given back"); as a file, a park name is nothing to settle.
    elsewhere = write_file(victim.parent / region_path(root, engine_id).name, 4096, touch=2)
    (root / f"{PARK_PREFIX}1-1-0123456789abcdef").symlink_to(victim.parent)
    write_file(root / f"{PARK_PREFIX}2-2-0123456789abcdef", 4096, touch=2)
    assert scan(root, grace_s=0).parks == ()
    report = reap(root, grace_s=0)
    assert report.removed == ()
    assert report.restored == ()
    assert elsewhere.exists()
    assert not (root / elsewhere.name).exists()
    assert (root / f"{PARK_PREFIX}1-1-0123456789abcdef").is_symlink()
    for name in parks(root):
        os.unlink(root / name)
    elsewhere.unlink()


# -- 5. fd limits set the batch ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("nofile", [64, 16])
def test_reap_under_a_low_fd_limit_still_removes_every_orphan(
    root: Path, engine_id: str, nofile: int
) -> None:
    if shutil.which("prlimit") is None:
        pytest.skip("needs prlimit (util-linux)")
    for i in range(2000 if nofile == 64 else 600):
        (root / f"vllm_offload_{engine_id}-{i}.mmap").touch()
        os.utime(root / f"vllm_offload_{engine_id}-{i}.mmap", (1, 1))
    done = subprocess.run(
        [
            "prlimit",
            f"--nofile={nofile}:{nofile}",
            *cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["kept"] == []
    assert os.listdir(root) == []


def test_the_agent_settles_a_dead_reapers_park_in_one_pass(root: Path, engine_id: str) -> None:
    from kvoffload.liveness.watch import WatchConfig, Watcher
    from tests.support.procs import Child

    files = [write_file(region_path(root, f"{engine_id}-{n}"), 4096, touch=2) for n in ("dead", "held")]
    folder = dead_park(root, *files)
    dead, held = (folder / f.name for f in files)
    seen: list[Any] = []
    watcher = Watcher(
        WatchConfig(roots=(str(root),), interval_s=0, reap=True, grace_s=0), on_event=seen.append
    )
    with Child("map-only", held):
        report = watcher.run_pass()
        back = root / held.name
        assert back.exists()
        assert not held.exists()
    assert not dead.exists()
    assert not (root / dead.name).exists()
    assert not folder.exists()
    (result,) = report.roots
    assert result.report is not None
    assert result.report.summary.parked == 0
    events = [(e.event, getattr(e, "engine_id", None)) for e in seen]
    assert ("removed", f"{engine_id}-dead") in events
    assert ("parked", f"{engine_id}-held") in events
    back.unlink()


def test_a_dead_parked_file_whose_name_was_taken_goes_and_the_new_file_stays(
    root: Path, engine_id: str
) -> None:
    folder = dead_park(root, write_file(region_path(root, engine_id), 4096, touch=2))
    parked = folder / region_path(root, engine_id).name
    taken = write_file(root / parked.name, 8192, touch=2)
    new_ino = taken.stat().st_ino
    plan = reap(root, grace_s=0, dry_run=True)
    (entry,) = plan.parked
    assert entry.parked is not None
    assert entry.parked.action == "remove"
    assert entry.parked.name_taken_by == (taken.stat().st_dev, new_ino)
    validate(json.loads(_json(plan)), "reap")
    from tests.support.procs import Child

    with Child("fd-only", taken):  # the new file is a live engine's
        report = reap(root, grace_s=0)
    assert [e.ino for e in report.removed] == [entry.ino]
    assert taken.stat().st_ino == new_ino
    assert not folder.exists()
    taken.unlink()


def test_a_not_chosen_dead_parked_region_is_given_back_to_be_judged_as_usual(
    root: Path, engine_id: str
) -> None:
    folder = dead_park(root, write_file(region_path(root, engine_id), 4096, touch=2))
    parked = folder / region_path(root, engine_id).name
    report = reap(root, grace_s=0, filters=ReapFilter(engine_ids=("someone-else",)))
    assert [e.name for e in report.restored] == [parked.name]
    assert (root / parked.name).exists()
    assert not folder.exists()
    (root / parked.name).unlink()


def _json(report: object) -> str:
    from shmctl.render import dumps

    return dumps(report)


@needs_strace
def test_a_reaper_killed_holding_its_lease_lets_a_blocked_opener_have_the_file_under_its_name(
    root: Path, engine_id: str, engine: Engine
) -> None:
    path = orphan(root, engine_id)
    ino = path.stat().st_ino
    reaper = Traced(
        "renameat2", 1, "delay_enter=5000000", "reap", "--root", str(root), "--grace", "0s", "--yes"
    )
    pid = reaper.wait_in_syscall()  # its lease is held: the opener blocks in the kernel
    engine.send("open", path)
    engine.wait_in_open()
    os.kill(pid, signal.SIGKILL)  # the kernel drops a dead holder's lease at once
    reaper.finish()
    assert engine.answer() == {"ino": ino, "nlink": 1, "named": True, "marker": "x\0\0\0"}
    report = json.loads(run_cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json").stdout)
    assert report["removed"] == []
    assert parks(root) == []


@pytest.mark.slow
def test_sigstop_of_a_real_reap_at_random_moments_never_stalls_an_opener_nor_loses_its_file(
    root: Path, engine_id: str
) -> None:
    """A reap of 2,000 orphans is stopped at random moments until a stop catches a lease held,
    and an engine opens that file: it waits under a second (the watchdog kills the stopped
    reaper), and after a settling reap the file it opened is at its name, whatever the killed
    reaper had done with it; every other orphan is gone."""
    from tests.liveness.test_lease_guard import BOUND_S, leased_inode, timed_open, wait_for_state

    rng = random.Random(engine_id)
    caught = 0
    for _ in range(3):
        paths = [write_file(region_path(root, f"{engine_id}-{i}"), 4096, touch=0) for i in range(2000)]
        by_inode = {p.stat().st_ino: p for p in paths}
        reaper = subprocess.Popen(
            cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json"),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=REPO,
        )
        opened: tuple[Path, int, int] | None = None
        try:
            while opened is None and reaper.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(reaper.pid, signal.SIGSTOP)
                if wait_for_state(reaper.pid, "TZX") != "T":
                    break
                ino = leased_inode(reaper.pid)
                if ino is not None and ino in by_inode:
                    try:
                        waited, fd = timed_open(by_inode[ino])
                    except FileNotFoundError:
                        pass  # stopped at its last check: already parked, the name is free
                    else:
                        assert waited < BOUND_S, f"the opener waited {waited:.3f}s on a stopped reap"
                        opened = (by_inode[ino], fd, ino)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(reaper.pid, signal.SIGCONT)
                time.sleep(rng.uniform(0, 0.003))
            reaper.wait(60)
            settled = run_cli("reap", "--root", str(root), "--grace", "0s", "--yes", "--json")
            assert settled.returncode == 0, settled.stderr
            if opened is not None:
                caught += 1
                path, fd, ino = opened
                assert os.fstat(fd).st_nlink == 1, "the file the engine opened lost its name"
                assert path.stat().st_ino == ino
        finally:
            if reaper.poll() is None:
                reaper.kill()
                reaper.wait(30)
            if opened is not None:
                os.close(opened[1])
        left = sorted(os.listdir(root))
        assert left == ([opened[0].name] if opened is not None else [])
        for name in left:
            os.unlink(root / name)
    assert caught > 0, "no stop ever caught a lease held: the test tested nothing"


def test_without_a_lease_a_dead_parked_file_is_given_back_not_removed(root: Path, engine_id: str) -> None:
    """Removing a parked file needs its lease now; without one it goes back to its name, where an
    ordinary reap judges it on the evidence it has (here a fresh /proc pass)."""
    folder = dead_park(root, write_file(region_path(root, engine_id), 4096, touch=2))
    parked = folder / region_path(root, engine_id).name
    report = reap(root, grace_s=0, use_lease=False, assume_not_holding=uninspectable_pids())
    assert [e.name for e in report.restored] == [parked.name]
    assert report.removed == ()
    assert (root / parked.name).exists()
    assert not folder.exists()
    (root / parked.name).unlink()
