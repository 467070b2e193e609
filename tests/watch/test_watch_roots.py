"""Roots have borders: what ``shmctl watch`` (and ``reap``) treat as a root, and where they remove.

Real directories on the real ``/dev/shm`` tmpfs (the ``root`` fixture), real symlinks, some
planted by a real unprivileged user (``setpriv`` to uid 65534) in a sticky world-writable
directory, and dead regions (files nobody holds: the lease proves it) on both sides of every
border. The rules (``docs/watch-roots.md``):

* a glob's match that is a symlink is never a root, nor is anything reached through one below
  the glob's fixed part; nor is a reaper's park directory;
* a path given with a symlink in it is resolved once, at start (``root_resolved``); a path
  that has a symlink in it later is unreadable (``root_unreadable``), never followed;
* another directory at a root's path is a new root (``root_replaced``): nominations start over;
* removal happens only on a tmpfs or hugetlbfs unless ``--any-filesystem``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import ConfigError
from kvoffload.liveness.events import (
    PassReport,
    RemovalRefused,
    Removed,
    RootReplaced,
    RootResolved,
    RootUnreadable,
)
from kvoffload.liveness.roots import root_identity
from kvoffload.liveness.watch import WatchConfig, Watcher
from kvoffload.shm import mounts
from shmctl.render.watch import EventWriter
from tests.support.hostile import shmctl
from tests.support.procs import region_path, write_file
from tests.support.schemas import validate

NOBODY = 65534
PAGE = 4096


def watcher(*patterns: Path | str, any_filesystem: bool = False) -> tuple[Watcher, list[Any]]:
    seen: list[Any] = []
    config = WatchConfig(
        roots=tuple(str(p) for p in patterns),
        interval_s=0,
        reap=True,
        grace_s=0,
        any_filesystem=any_filesystem,
    )
    return Watcher(config, on_event=seen.append), seen


def dead(directory: Path, engine_id: str) -> Path:
    """A region file nobody holds (the write lease proves it): orphaned from its first scan."""
    directory.mkdir(parents=True, exist_ok=True)
    return write_file(region_path(directory, engine_id), size=2 * PAGE, touch=1)


def removed_in(report: PassReport) -> list[Path]:
    return sorted(r.root / e.name for r in report.roots if r.reaped for e in r.reaped.removed)


def kinds(seen: list[Any]) -> list[str]:
    return [type(e).event for e in seen if type(e).event != "pass"]


def of(seen: list[Any], cls: type) -> list[Any]:
    return [e for e in seen if isinstance(e, cls)]


def as_nobody(*argv: str) -> None:
    """Run ``argv`` as uid/gid 65534 with no groups: an unprivileged user of the node."""
    subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
        check=True,
        capture_output=True,
    )


def require_setpriv() -> None:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to act as an unprivileged user")


def require_not_memory_filesystem(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if mounts.memory_filesystem(fd) is not None:
            pytest.skip(f"{path} is on a tmpfs here: no other filesystem to refuse")
    finally:
        os.close(fd)


# --- a glob's matches: directories, never through a symlink ------------------------------------------


def test_a_glob_match_that_is_a_symlink_is_never_a_root(root: Path, engine_id: str) -> None:
    pods = root / "pods"
    mine = dead(pods / "real", f"{engine_id}-real")
    outside = dead(root / "outside", f"{engine_id}-outside")
    (pods / "to-outside").symlink_to(root / "outside")
    (pods / "to-slash").symlink_to("/")
    (pods / "to-etc").symlink_to("/etc")
    (pods / "to-proc").symlink_to("/proc")
    (pods / "relative").symlink_to("../outside")
    w, seen = watcher(pods / "*")

    reports = [w.run_pass() for _ in range(3)]

    assert w.watched == (pods / "real",)
    assert [r.root for r in reports[0].roots] == [pods / "real"]
    assert removed_in(reports[1]) == [mine]
    assert outside.exists(), "a region behind a symlinked match is never removed"
    assert {e.root for e in seen if type(e).event == "root_appeared"} == {pods / "real"}


def test_a_symlink_an_unprivileged_user_plants_in_a_sticky_dir_is_never_followed(
    root: Path, engine_id: str
) -> None:
    require_setpriv()
    pods = root / "pods"
    pods.mkdir()
    pods.chmod(0o1777)  # world-writable and sticky, as /dev/shm and a memory emptyDir are
    # Root's own dead region, in a directory no glob names: the agent (root, judging only
    # root's files) would remove it if it followed the planted link.
    victim = dead(root / "private", f"{engine_id}-victim")
    (root / "private").chmod(0o700)
    as_nobody("ln", "-s", str(root / "private"), str(pods / "planted"))
    as_nobody("mkdir", str(pods / "honest"))
    assert (pods / "planted").lstat().st_uid == NOBODY
    w, seen = watcher(pods / "*")

    for _ in range(3):
        w.run_pass()

    assert w.watched == (pods / "honest",)
    assert victim.exists()
    assert of(seen, Removed) == []


def test_a_symlink_between_two_glob_levels_is_not_followed(root: Path, engine_id: str) -> None:
    pods = root / "pods"
    honest = dead(pods / "a" / "volumes" / "v", f"{engine_id}-a")
    # A magic level that is a symlink: pods/evil -> outside (outside/volumes/v holds a dead region).
    behind_magic = dead(root / "outside" / "volumes" / "v", f"{engine_id}-magic")
    (pods / "evil").symlink_to(root / "outside")
    # A plain level below the first glob character that is a symlink: pods/b/volumes -> elsewhere.
    (pods / "b").mkdir()
    behind_plain = dead(root / "elsewhere" / "w", f"{engine_id}-plain")
    (pods / "b" / "volumes").symlink_to(root / "elsewhere")
    w, _ = watcher(pods / "*" / "volumes" / "*")

    reports = [w.run_pass() for _ in range(3)]

    assert w.watched == (pods / "a" / "volumes" / "v",)
    assert removed_in(reports[1]) == [honest]
    assert behind_magic.exists()
    assert behind_plain.exists()


def test_a_reapers_park_directories_are_never_roots(root: Path, engine_id: str) -> None:
    park = root / ".shmctl-park-4242-99-0123456789abcdef"
    parked = dead(park, f"{engine_id}-parked")
    dead(root / "pod", f"{engine_id}-pod").unlink()
    (root / ".hidden").mkdir()
    w, _ = watcher(root / "*", root / ".*", root / ".shmctl-*")

    for _ in range(3):
        w.run_pass()

    assert set(w.watched) == {root / "pod", root / ".hidden"}, "a leading dot needs a pattern that has one"
    assert parked.exists()
    with pytest.raises(ConfigError, match="park directory"):
        WatchConfig(roots=(str(park),))


def test_a_glob_match_whose_name_is_not_utf8_is_written_as_a_valid_json_line(root: Path) -> None:
    odd = os.fsdecode(bytes(root) + b"/pod-\xff")
    os.mkdir(odd)
    stream = io.StringIO()
    w = Watcher(WatchConfig(roots=(f"{root}/*",), interval_s=0, grace_s=0), on_event=EventWriter(stream))

    w.run_pass()

    assert "\udcff" not in stream.getvalue(), "no stdout could encode it: its JSON escape instead"
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    for event in events:
        validate(event, "watch-event")
    assert [e["root"] for e in events if e["event"] == "root_appeared"] == [odd]


# --- a path given with a symlink: resolved once, never followed later ------------------------------


def test_a_literal_root_given_as_a_symlink_is_resolved_once_and_told(root: Path, engine_id: str) -> None:
    real, other = root / "real", root / "other"
    orphan = dead(real, f"{engine_id}-real")
    elsewhere = dead(other, f"{engine_id}-other")
    link = root / "shm"
    link.symlink_to(real)
    w, seen = watcher(link)

    first, second = w.run_pass(), w.run_pass()
    # The operator's symlink is pointed elsewhere: the agent keeps the directory it resolved.
    link.unlink()
    link.symlink_to(other)
    later = [w.run_pass() for _ in range(3)]

    resolved = of(seen, RootResolved)
    assert [(e.root, e.target) for e in resolved] == [(link, Path(os.path.realpath(real)))]
    assert kinds(seen)[:2] == ["root_resolved", "root_appeared"]
    assert [r.root for r in first.roots] == [link], "events and metrics keep the name the operator gave"
    assert removed_in(second) == [link / orphan.name]
    assert not orphan.exists()
    assert all(r.summary.errors == 0 and removed_in(r) == [] for r in later)
    assert elsewhere.exists()


def test_a_symlink_in_a_globs_fixed_part_is_resolved_once_and_told(root: Path, engine_id: str) -> None:
    kubelet = root / "var-lib-kubelet"
    kubelet.symlink_to(root / "data" / "kubelet")  # /var/lib/kubelet -> /data/kubelet, as on many nodes
    orphan = dead(root / "data" / "kubelet" / "pods" / "a", f"{engine_id}-a")
    elsewhere = dead(root / "other" / "pods" / "b", f"{engine_id}-b")
    w, seen = watcher(kubelet / "pods" / "*")

    first, second = w.run_pass(), w.run_pass()
    kubelet.unlink()
    kubelet.symlink_to(root / "other")
    later = [w.run_pass() for _ in range(2)]

    assert [(e.root, e.target) for e in of(seen, RootResolved)] == [
        (kubelet / "pods", Path(os.path.realpath(root / "data" / "kubelet" / "pods")))
    ]
    assert [r.root for r in first.roots] == [kubelet / "pods" / "a"], "named as the operator's glob names it"
    assert removed_in(second) == [kubelet / "pods" / "a" / orphan.name]
    assert not orphan.exists()
    assert [r.matched for r in later] == [1, 1], "still the directory resolved at start"
    assert elsewhere.exists()


@pytest.mark.parametrize("swapped", ["the root", "a directory above it"])
def test_a_literal_root_whose_path_has_a_symlink_later_is_unreadable_and_not_followed(
    root: Path, engine_id: str, swapped: str
) -> None:
    given = root / "node" / "shm"
    orphan = dead(given, f"{engine_id}-mine")
    moved = root / "moved"
    away = given if swapped == "the root" else given.parent
    decoy = root / "decoy"
    decoy_region = dead(decoy / "shm" if away != given else decoy, f"{engine_id}-decoy")
    w, seen = watcher(given)

    assert removed_in(w.run_pass()) == []  # nominated
    away.rename(moved)
    away.symlink_to(decoy)
    swapped_passes = [w.run_pass() for _ in range(3)]

    assert [r.summary.errors for r in swapped_passes] == [1, 1, 1]
    assert decoy_region.exists(), "what a symlink at the root's path points at is never reaped"
    unreadable = of(seen, RootUnreadable)
    assert len(unreadable) == 1, "told once per spell"
    assert unreadable[0].error == (
        f"{away} is a symbolic link: not followed (a root's path is resolved once, at start)"
    )
    assert of(seen, RootResolved) == []

    away.unlink()
    moved.rename(away)

    assert removed_in(w.run_pass()) == [], "the gap in the evidence: nominations start over"
    assert orphan.exists()
    assert removed_in(w.run_pass()) == [orphan]


# --- a root is pinned: another directory at its path is a new root ------------------------------------


@pytest.mark.parametrize("given", ["glob", "literal"])
def test_a_root_replaced_by_another_directory_starts_its_nominations_over(
    root: Path, engine_id: str, given: str
) -> None:
    pods = root / "pods"
    pod = pods / "a"
    orphan = dead(pod, f"{engine_id}-a")
    w, seen = watcher(pods / "*" if given == "glob" else pod)
    fd = os.open(pod, os.O_RDONLY | os.O_DIRECTORY)
    try:
        before = root_identity(fd)
    finally:
        os.close(fd)

    assert removed_in(w.run_pass()) == []
    # Swapped between passes: the directory renamed away, a new one at its name, and the very
    # same (orphaned, nominated) file moved into it: orphaned in both, but not in this root twice.
    pod.rename(root / "old-a")
    pod.mkdir()
    (root / "old-a" / orphan.name).rename(orphan)
    after_swap = w.run_pass()
    next_pass = w.run_pass()

    replaced = of(seen, RootReplaced)
    assert [(e.root, e.old) for e in replaced] == [(pod, before)]
    assert replaced[0].new.ino == pod.stat().st_ino != before.ino
    assert replaced[0].new.mnt_id == before.mnt_id
    assert removed_in(after_swap) == []
    assert removed_in(next_pass) == [orphan]
    assert kinds(seen).count("root_replaced") == 1


def test_a_glob_root_replaced_by_a_symlink_vanishes_and_its_target_is_never_touched(
    root: Path, engine_id: str
) -> None:
    pods = root / "pods"
    pod = pods / "a"
    orphan = dead(pod, f"{engine_id}-a")
    old = root / "old-a"
    w, seen = watcher(pods / "*")

    w.run_pass()  # nominated
    pod.rename(old)
    pod.symlink_to(old)
    swapped = [w.run_pass() for _ in range(3)]

    assert swapped[0].vanished == (pod,)
    assert all(r.matched == 0 for r in swapped)
    assert [e.root for e in seen if type(e).event == "root_vanished"] == [pod]
    assert orphan.resolve().exists(), "the directory behind the symlink is never reaped"

    pod.unlink()
    old.rename(pod)

    assert removed_in(w.run_pass()) == [], "a root that comes back is a new root: two passes first"
    assert orphan.exists()
    assert removed_in(w.run_pass()) == [orphan]


# --- removal only on a tmpfs or hugetlbfs, unless told -------------------------------------------------


def test_watch_on_another_filesystem_scans_and_refuses_removal_once(tmp_path: Path, engine_id: str) -> None:
    require_not_memory_filesystem(tmp_path)
    orphan = dead(tmp_path, engine_id)
    w, seen = watcher(tmp_path)

    reports = [w.run_pass() for _ in range(3)]

    assert orphan.exists()
    assert all(r.summary.orphaned_bytes > 0 and r.summary.errors == 0 for r in reports), (
        "scanned all the same"
    )
    refused = of(seen, RemovalRefused)
    assert len(refused) == 1, "told once per spell"
    assert "--any-filesystem" in refused[0].reason
    assert "tmpfs or hugetlbfs" in refused[0].reason
    orphan.unlink()


def test_watch_with_any_filesystem_removes_on_another_filesystem(tmp_path: Path, engine_id: str) -> None:
    require_not_memory_filesystem(tmp_path)
    orphan = dead(tmp_path, engine_id)
    w, seen = watcher(tmp_path, any_filesystem=True)

    first, second = w.run_pass(), w.run_pass()

    assert removed_in(first) == []
    assert removed_in(second) == [orphan]
    assert of(seen, RemovalRefused) == []


def test_reap_on_another_filesystem_is_one_line_naming_the_flag_and_exit_3(
    tmp_path: Path, engine_id: str
) -> None:
    require_not_memory_filesystem(tmp_path)
    orphan = dead(tmp_path, engine_id)

    refused = shmctl("reap", "--root", str(tmp_path), "--grace", "0s", "--yes")

    assert refused.returncode == 3
    assert refused.stdout == ""
    lines = refused.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"shmctl: error: --root {tmp_path}: is not on a tmpfs or hugetlbfs")
    assert "--any-filesystem" in lines[0]
    assert orphan.exists()

    done = shmctl("reap", "--root", str(tmp_path), "--grace", "0s", "--yes", "--any-filesystem")

    assert done.returncode == 0, done.stderr
    assert not orphan.exists()


def test_watch_reap_on_another_filesystem_refuses_on_the_command_line_and_removes_with_the_flag(
    tmp_path: Path, engine_id: str
) -> None:
    require_not_memory_filesystem(tmp_path)
    orphan = dead(tmp_path, engine_id)
    args = (
        "watch",
        "--root",
        str(tmp_path),
        "--grace",
        "0s",
        "--reap",
        "--max-passes",
        "2",
        "--interval",
        "0.05s",
    )

    refused = shmctl(*args)

    assert refused.returncode == 0, refused.stderr
    assert refused.stderr == ""
    events = [json.loads(line) for line in refused.stdout.splitlines()]
    for event in events:
        validate(event, "watch-event")
    assert [e["event"] for e in events] == ["root_appeared", "removal_refused", "pass", "pass"]
    assert events[1]["root"] == str(tmp_path)
    assert orphan.exists()

    done = shmctl(*args, "--any-filesystem")

    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["event"] for line in done.stdout.splitlines()] == [
        "root_appeared",
        "pass",
        "removed",
        "pass",
    ]
    assert not orphan.exists()


def test_the_new_events_match_the_schema(root: Path, engine_id: str) -> None:
    link = root / "shm"
    link.symlink_to(root / "real")
    dead(root / "real", engine_id).unlink()
    stream = io.StringIO()
    w = Watcher(WatchConfig(roots=(str(link),), interval_s=0, grace_s=0), on_event=EventWriter(stream))
    w.run_pass()
    (root / "real").rename(root / "old")
    (root / "real").mkdir()
    w.run_pass()

    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    for event in events:
        validate(event, "watch-event")
    got = {e["event"]: e for e in events}
    assert got["root_resolved"]["target"] == os.path.realpath(root / "real")
    assert set(got["root_replaced"]["old"]) == {"dev", "ino", "mnt_id"}
    assert got["root_replaced"]["old"]["ino"] != got["root_replaced"]["new"]["ino"]
