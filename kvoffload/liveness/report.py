"""What a scan reports: an entry per region file, the summary, the report; and how one listed
file and its evidence are written as an entry.

These are values: ``shmctl scan --json`` serialises a ``ScanReport`` as it is, and the
tables are drawn from the same fields. ``SCHEMA_VERSION`` counts the changes of that
document. Park directories and the files in them are reported with ``park``'s views.
"""

from __future__ import annotations

import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload.liveness.holders import DeletedMapping, Holder, HolderIndex, Uninspected
from kvoffload.liveness.lease import LeaseProbe, LeaseState
from kvoffload.liveness.listing import Listed, child_path, file_kind
from kvoffload.liveness.namespace import Visibility
from kvoffload.liveness.park.views import ParkedView, ParkView, UntrustedPark
from kvoffload.liveness.verdict import Evidence, Status, changed_s, mtime_age_s
from kvoffload.shm.mounts import HugePages

if TYPE_CHECKING:
    from kvoffload.liveness.probe import Probe

__all__ = [
    "SCHEMA_VERSION",
    "OwnerView",
    "ScanEntry",
    "ScanReport",
    "ScanSummary",
    "SummaryCount",
    "entry_of",
]

#: 2: entries gained ``lease``, ``lease_error`` and ``decided_by``; the report ``visibility``.
#: 3: ``age_s`` counts from mtime (as ``ls``), unrounded; entries gained ``mtime_ns``.
#: 4: the scan report gained ``huge_pages`` (the root's mount and its huge pages, as the plan's).
#: 5: the status ``parked`` and entries' ``parked``; the report ``parks`` and
#: ``lease_break_time_s``; the summary ``parked`` and ``parked_resident_bytes``.
#: 6: the report ``untrusted_parks``; parks' ``unfinished`` and ``strangers``.
#: 7: entries gained ``changed_age_s`` and ``ctime_ns`` (the age the grace period judges), and
#: ``removable_in_s`` and ``removable_at`` (when a ``starting`` one leaves the grace period);
#: the summary ``starting_first_removable_in_s`` and ``starting_last_removable_in_s``.
#: 8: entries gained ``family`` (``offload``, or the family ``--family`` asked for); a file of
#: another family has its own name as ``engine_id`` and segment 0. The scan and reap reports
#: gained ``families``, the families judged.
SCHEMA_VERSION = 8


@dataclass(frozen=True, slots=True)
class OwnerView:
    """The owner record of a kvoffload file and whether that process still runs."""

    pid: int
    start_ticks: int
    boot_id: str | None
    pid_ns: str | None
    hostname: str
    uid: int
    engine_id: str
    created_at: float
    alive: bool | None
    liveness: str


@dataclass(frozen=True, slots=True)
class ScanEntry:
    """One directory entry named like a file of a family judged (a region file unless
    ``--family`` asked for more), and its verdict."""

    name: str
    path: Path
    engine_id: str
    segment: int
    status: Status
    reason: str
    kind: str
    size_bytes: int
    resident_bytes: int
    uid: int
    #: Seconds since mtime (``ls -l``'s age, what ``--older-than`` selects on). Anyone may set
    #: an mtime back (``touch -d``); the grace period judges ``changed_age_s`` instead.
    age_s: float
    dev: int
    ino: int
    nlink: int
    holders: tuple[Holder, ...] = ()
    owner: OwnerView | None = None
    #: True: a LOCK_EX probe was refused; False: granted, or no probe needed because the write
    #: lease was granted (then no other open file description exists to hold a lock);
    #: None: not probed (skipped files).
    lock_held: bool | None = None
    #: The write lease: ``free`` (nobody anywhere has it open), ``held``, or None (no lease).
    lease: LeaseState | None = None
    #: Why there is no lease answer, when ``lease`` is None.
    lease_error: str | None = None
    #: The evidence that decided the verdict (``verdict.Evidence``).
    decided_by: Evidence = Evidence.FILE
    #: The file's mtime, exact (``st_mtime_ns``).
    mtime_ns: int = 0
    #: Seconds since the kernel last saw the file change (``verdict.changed_s``: its ctime,
    #: which no ``touch`` sets back): the age the grace period judges, and scan's CHANGED.
    changed_age_s: float = 0.0
    #: The file's ctime, exact (``st_ctime_ns``).
    ctime_ns: int = 0
    #: ``starting`` entries: seconds from ``scanned_at`` until the region leaves the grace
    #: period (its youngest file's ``changed_age_s`` reaches it); None for any other status.
    removable_in_s: float | None = None
    #: ``starting`` entries: the same moment as Unix time; None for any other status.
    removable_at: float | None = None
    #: Set for ``parked`` entries: ``name`` is then the original name, ``path`` where it waits.
    parked: ParkedView | None = None
    #: Its family (``kvoffload.shm.families``): ``offload`` for vLLM's region files; for any
    #: other family ``engine_id`` is the file's own name (each such file is a unit of its own).
    family: str = "offload"

    @property
    def identity(self) -> tuple[int, int]:
        return (self.dev, self.ino)

    @property
    def unit(self) -> tuple[str, str]:
        """What it shares its verdict with, and is removed with: the files of its family and
        engine id (a region; one file for the families that do not group)."""
        return (self.family, self.engine_id)


@dataclass(frozen=True, slots=True)
class ScanSummary:
    """Entries per status and the memory orphans pin (resident = st_blocks × 512)."""

    total: int
    live: int
    orphaned: int
    starting: int
    unknown: int
    skipped: int
    orphaned_size_bytes: int
    orphaned_resident_bytes: int
    resident_bytes: int
    uninspected_processes: int
    unknown_resident_bytes: int = 0
    parked: int = 0
    parked_resident_bytes: int = 0
    #: Seconds from the scan until the first and the last ``starting`` region leave the grace
    #: period (``ScanEntry.removable_in_s``); None when nothing is ``starting``.
    starting_first_removable_in_s: float | None = None
    starting_last_removable_in_s: float | None = None

    @classmethod
    def of(cls, entries: Sequence[ScanEntry], uninspected: int) -> ScanSummary:
        count = SummaryCount()
        count.add(entries)
        return count.summary(uninspected)


class SummaryCount:
    """``ScanSummary``'s numbers, added up a region (or a report) at a time: the one count behind
    ``scan``'s summary, the one-shot commands' (``oneshot``) and the agent's (``tally``)."""

    def __init__(self) -> None:
        self.count = dict.fromkeys(Status, 0)
        self.resident = dict.fromkeys(Status, 0)
        self.orphaned_size = 0
        self.first_wait: float | None = None
        self.last_wait: float | None = None

    def add(self, entries: Iterable[ScanEntry]) -> None:
        for e in entries:
            self.count[e.status] += 1
            self.resident[e.status] += e.resident_bytes
            if e.status is Status.ORPHANED:
                self.orphaned_size += e.size_bytes
            wait = e.removable_in_s
            if wait is not None:
                self.first_wait = wait if self.first_wait is None else min(self.first_wait, wait)
                self.last_wait = wait if self.last_wait is None else max(self.last_wait, wait)

    def summary(self, uninspected: int) -> ScanSummary:
        count, resident = self.count, self.resident
        return ScanSummary(
            total=sum(count.values()),
            live=count[Status.LIVE],
            orphaned=count[Status.ORPHANED],
            starting=count[Status.STARTING],
            unknown=count[Status.UNKNOWN],
            skipped=count[Status.SKIPPED],
            orphaned_size_bytes=self.orphaned_size,
            orphaned_resident_bytes=resident[Status.ORPHANED],
            resident_bytes=sum(b for status, b in resident.items() if status is not Status.SKIPPED),
            uninspected_processes=uninspected,
            unknown_resident_bytes=resident[Status.UNKNOWN],
            parked=count[Status.PARKED],
            parked_resident_bytes=resident[Status.PARKED],
            starting_first_removable_in_s=self.first_wait,
            starting_last_removable_in_s=self.last_wait,
        )


@dataclass(frozen=True, slots=True)
class ScanReport:
    """What ``scan`` found. Serialised as is for ``shmctl scan --json``."""

    schema_version: int
    root: Path
    scanned_at: float
    grace_s: float
    entries: tuple[ScanEntry, ...]
    summary: ScanSummary
    #: Processes whose fds or maps could not be read (``assume_not_holding`` ones included).
    uninspected: tuple[Uninspected, ...]
    #: Region files of this root's filesystem that were unlinked but are still mapped or open.
    deleted: tuple[DeletedMapping, ...]
    #: Pids the operator vouched for (``--assume-not-holding``): not counted as blind spots.
    assumed_not_holding: tuple[int, ...] = ()
    #: Whether this scan's ``/proc`` lists every process on the kernel.
    visibility: Visibility | None = None
    #: False when leases were turned off (``--no-lease``) or unsafe to take here.
    lease_enabled: bool = True
    #: How the root's mount backs region files (huge pages or 4 KiB ones), and the fix, as
    #: ``shmctl init --dry-run`` reports it; None for reports made without looking.
    huge_pages: HugePages | None = None
    #: Park directories of reapers (running, or dead and left behind) found in the root.
    parks: tuple[ParkView, ...] = ()
    #: ``fs.lease-break-time``: how long an opener may wait on a lease whose holder is frozen.
    lease_break_time_s: float | None = None
    #: Entries named like park directories that are not a reaper's (never touched).
    untrusted_parks: tuple[UntrustedPark, ...] = ()
    #: The families of files judged (``--family``), in ``kvoffload.shm.families`` order.
    families: tuple[str, ...] = ("offload",)

    @property
    def blind_spots(self) -> tuple[Uninspected, ...]:
        """Uninspected processes nobody vouched for: what can keep files ``unknown``."""
        return tuple(u for u in self.uninspected if u.pid not in self.assumed_not_holding)

    @property
    def unseen_holders(self) -> tuple[ScanEntry, ...]:
        """Entries held, by the lease's word, by a process this scan's ``/proc`` did not show."""
        return tuple(e for e in self.entries if e.decided_by is Evidence.LEASE and e.status is Status.LIVE)

    def with_status(self, status: Status) -> tuple[ScanEntry, ...]:
        return tuple(e for e in self.entries if e.status is status)


def entry_of(
    root: Path,
    item: Listed,
    status: Status,
    reason: str,
    when: float,
    index: HolderIndex,
    *,
    owner: OwnerView | None = None,
    probe: Probe | None = None,
    decided_by: Evidence = Evidence.FILE,
    removable_in_s: float | None = None,
    changed_age_s: float | None = None,
) -> ScanEntry:
    """The entry of a listed file: what its ``lstat`` and its probe said, and the verdict
    (``removable_in_s``: the region's, when it is ``starting``). ``changed_age_s`` is
    ``changed_s(item.st, when)`` where the caller computed it already."""
    st = item.st
    regular = stat.S_ISREG(st.st_mode)
    answer = probe.lease if probe is not None else LeaseProbe(None, "not probed (skipped)")
    return ScanEntry(
        name=item.name,
        path=child_path(root, item.name),
        engine_id=item.region.engine_id,
        segment=item.region.segment,
        status=status,
        reason=reason,
        kind=file_kind(st.st_mode),
        size_bytes=st.st_size if regular else 0,
        resident_bytes=st.st_blocks * 512 if regular else 0,
        uid=st.st_uid,
        age_s=mtime_age_s(st, when),
        mtime_ns=st.st_mtime_ns,
        changed_age_s=changed_s(st, when) if changed_age_s is None else changed_age_s,
        ctime_ns=st.st_ctime_ns,
        removable_in_s=removable_in_s,
        removable_at=None if removable_in_s is None else when + removable_in_s,
        dev=st.st_dev,
        ino=st.st_ino,
        nlink=st.st_nlink,
        holders=index.holders_of(st.st_dev, st.st_ino) if regular else (),
        owner=owner,
        lock_held=probe.lock_held if probe is not None else None,
        lease=answer.state,
        lease_error=answer.error,
        decided_by=decided_by,
        family=item.family,
    )
