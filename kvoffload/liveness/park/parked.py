"""What waits in a root's park directories, judged as a scan judges region files.

Every entry of a root named like a park directory is judged (``trust.judge``): a trusted
park becomes a ``ParkView``, anything else an ``UntrustedPark``, never entered. Each region
file in a trusted park becomes a ``parked`` entry, judged on the same evidence as any region
file but with no grace period (its reaper proved it dead once, and renaming it changed its
ctime) and never as ``orphaned``: what the evidence says decides the ``action`` ``reap``
takes (``ParkedView``; ``settle`` takes it).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from kvoffload.liveness.holders import HolderIndex
from kvoffload.liveness.lease import LeaseProbe
from kvoffload.liveness.listing import Owners, Sorted, child_path, stat_names
from kvoffload.liveness.park.directory import RootId, open_park
from kvoffload.liveness.park.trust import Adopter, FoundPark, Untrusted, judge
from kvoffload.liveness.park.views import ParkedView, ParkView, UntrustedPark
from kvoffload.liveness.probe import probe_file
from kvoffload.liveness.report import ScanEntry, entry_of
from kvoffload.liveness.verdict import FileEvidence, ScannerView, Status, decide
from kvoffload.shm import families as shm_families

__all__ = ["JudgedParks", "judge_parks"]


@dataclass(frozen=True, slots=True)
class JudgedParks:
    """The park directories of a root (``ScanReport.parks``), the files in them (``parked``
    entries), and the entries named like parks that are not a reaper's."""

    parks: tuple[ParkView, ...] = ()
    parked: tuple[ScanEntry, ...] = ()
    untrusted: tuple[UntrustedPark, ...] = ()


def judge_parks(
    root: Path,
    dir_fd: int,
    park_names: list[str],
    index: HolderIndex,
    view: ScannerView,
    *,
    probe_args: tuple[LeaseProbe | None, int],
    when: float,
    owners: Owners,
    adopter: Adopter,
) -> JudgedParks:
    """Every entry of the root named like a park directory: trusted or not, and a ``parked``
    entry for each region file in a trusted one.

    A parked file is judged on the same evidence as any region file, but with no grace
    period (its reaper proved it dead once, and renaming it changed its ctime) and never as
    ``orphaned``: its status is ``parked``, and what the evidence says decides the action
    ``reap`` takes (``ParkedView``). A reaper parks only regular files with one link, and one
    that is not root only files of its own uid: anything else in its directory is a stranger,
    never judged or touched, and keeps the directory.
    """
    lease_off, euid = probe_args
    root_id = RootId.of(dir_fd)
    views: list[ParkView] = []
    entries: list[ScanEntry] = []
    untrusted: list[UntrustedPark] = []
    for name in park_names:
        found = judge(dir_fd, name, root_id, adopter)
        if found is None:
            continue
        if isinstance(found, Untrusted):
            untrusted.append(UntrustedPark(name, found.kind, found.uid, f"{found.mode:04o}", found.reason))
            continue
        parked: list[ScanEntry] = []
        if found.files:
            try:
                park_fd = open_park(dir_fd, name)
            except OSError:
                park_fd = -1
            if park_fd >= 0:
                try:
                    parked = _judge_parked(
                        root, dir_fd, park_fd, found, index, view, lease_off, euid, when, owners
                    )
                finally:
                    os.close(park_fd)
        reaper = found.reaper
        views.append(
            ParkView(
                name=name,
                uid=found.uid,
                reaper_pid=reaper.pid if reaper else None,
                reaper_start_ticks=reaper.start_ticks if reaper else None,
                running=found.running,
                files=len(parked),
                problem=found.problem,
                unfinished=found.unfinished,
                strangers=len(found.others) + len(found.files or ()) - len(parked),
            )
        )
        entries.extend(parked)
    return JudgedParks(tuple(views), tuple(entries), tuple(untrusted))


def _judge_parked(
    root: Path,
    dir_fd: int,
    park_fd: int,
    found: FoundPark,
    index: HolderIndex,
    view: ScannerView,
    lease_off: LeaseProbe | None,
    euid: int,
    when: float,
    owners: Owners,
) -> list[ScanEntry]:
    # A reaper parks the files of every family it was asked to remove (``--family``); what it
    # left is judged whatever this scan's families, so that a dead reaper's work is settled.
    named = []
    for name in found.files or ():
        found_in = shm_families.parse(name)
        if found_in is not None:
            family, region = found_in
            named.append((name, region, family))
    listed = stat_names(root, park_fd, named)
    # A reaper parks only what it proved: regular files with one link (and, unless it is root,
    # of its own uid). Anything else in its directory (a symlink, a fifo, a directory, a hard
    # link, another uid's file) its owner put there: a stranger, never judged, moved or removed.
    listed = [
        m
        for m in listed
        if stat.S_ISREG(m.st.st_mode) and m.st.st_nlink == 1 and found.uid in (0, m.st.st_uid)
    ]
    groups = Sorted.of(listed, owners)
    by_name = {m.name: m for m in listed}
    reaper = found.reaper
    running = found.running is not False  # unreadable lock state: as if it ran (hands off)
    folder = child_path(root, found.name)
    entries = []
    for group in groups.groups.values():
        members = group.members + [by_name[name] for name, _ in group.skipped]
        probes = (
            {}
            if running or group.skipped
            else {m.name: probe_file(park_fd, m, lease_off, euid) for m in members}
        )
        if running:
            verdict_status, why = Status.UNKNOWN, "its reaper is still at work"
        elif group.skipped:
            verdict_status, why = Status.UNKNOWN, f"not ours to judge ({group.skipped[0][1]})"
        else:
            verdict = decide(
                [
                    FileEvidence(
                        m.name,
                        index.holders.get((m.st.st_dev, m.st.st_ino), ()),
                        probes[m.name].lock_held,
                        probes[m.name].lease,
                        (m.st.st_dev, m.st.st_ino) in index.anonymous_locks,
                        probes[m.name].problem,
                    )
                    for m in members
                ],
                view,
                owner=None,
                base_empty=False,
                age=float("inf"),
                grace_s=0.0,
            )
            verdict_status, why = verdict.status, verdict.reason
        for m in members:
            taken = _taken_by(dir_fd, m.name)
            if running:
                action = "left to its reaper"
            elif verdict_status is Status.ORPHANED:
                action = "remove"
            elif taken is not None:
                action = "conflict"
            else:
                action = "restore"
            who = f"reap pid {reaper.pid}" if reaper else "a reap"
            state = "running" if running else "dead"
            reason = f"parked by {who} ({state}) in {found.name}: {why}; {action}"
            if taken is not None:
                reason += f" (its name now holds inode {taken[1]})"
            entry = entry_of(folder, m, Status.PARKED, reason, when, index, probe=probes.get(m.name))
            entries.append(
                dataclasses.replace(
                    entry,
                    parked=ParkedView(
                        directory=found.name,
                        reaper_pid=reaper.pid if reaper else None,
                        reaper_start_ticks=reaper.start_ticks if reaper else None,
                        reaper_running=running,
                        verdict=verdict_status,
                        action=action,
                        name_taken_by=taken,
                    ),
                )
            )
    return entries


def _taken_by(dir_fd: int, name: str) -> tuple[int, int] | None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)
