"""What the agent tells: its events, and the reports of a pass and of each root in it.

Events are values; the caller renders them (``shmctl watch`` writes one JSON line each, named
by ``event``). Nothing here prints. A report keeps numbers, never a root's entries: a
``RootScan`` of a root of 100,000 files is as small as one of an empty root
(docs/agent-memory.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from kvoffload.errors import RootError
from kvoffload.liveness.report import ScanSummary
from kvoffload.liveness.roots import RootIdentity
from kvoffload.liveness.scan import Status

__all__ = [
    "Event",
    "KeptOtherUser",
    "KeptParked",
    "KeptUnknown",
    "ParkRemoved",
    "ParkUntrusted",
    "ParkedSettled",
    "PassReport",
    "PassSummary",
    "RemovalFailed",
    "RemovalRefused",
    "Removed",
    "RemovedFile",
    "RootAppeared",
    "RootNoMatch",
    "RootPass",
    "RootReap",
    "RootReplaced",
    "RootResolved",
    "RootScan",
    "RootUnreadable",
    "RootVanished",
    "Usage",
]


@dataclass(frozen=True, slots=True)
class Usage:
    """Size and free bytes of a root's filesystem (what ``shutil.disk_usage`` gives)."""

    total: int
    free: int


@dataclass(frozen=True, slots=True)
class Event:
    """Something an operator's log should show; ``event`` names its kind."""

    event: ClassVar[str]
    time: float
    root: Path | None
    pod_uid: str | None


@dataclass(frozen=True, slots=True)
class RootAppeared(Event):
    event: ClassVar[str] = "root_appeared"


@dataclass(frozen=True, slots=True)
class RootVanished(Event):
    event: ClassVar[str] = "root_vanished"


@dataclass(frozen=True, slots=True)
class RootUnreadable(Event):
    """The root could not be scanned; told once per spell (again when the error changes)."""

    event: ClassVar[str] = "root_unreadable"
    error: str = ""


@dataclass(frozen=True, slots=True)
class RootNoMatch(Event):
    """A ``--root`` glob matched no directory this pass; told every pass it matches none.
    ``root`` and ``pod_uid`` are null: there is no root, only the ``pattern``."""

    event: ClassVar[str] = "root_no_match"
    pattern: str = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class RootResolved(Event):
    """A path the operator gave (a plain root, or a glob's fixed part) held a symlink or ``..``:
    resolved once, when the agent started, to ``target``; told once. What ``target`` names
    is what is watched, and never through a symlink again."""

    event: ClassVar[str] = "root_resolved"
    target: Path = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class RootReplaced(Event):
    """Another directory is at the root's path now (``old`` and ``new`` differ): a new root,
    whose nominations start over."""

    event: ClassVar[str] = "root_replaced"
    old: RootIdentity = field(kw_only=True)
    new: RootIdentity = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class RemovalRefused(Event):
    """With ``--reap``, a root not on a tmpfs or hugetlbfs: scanned, nothing removed. Told once
    per spell (again when the reason changes)."""

    event: ClassVar[str] = "removal_refused"
    reason: str = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class Removed(Event):
    """One engine's region files removed; ``bytes`` is the resident memory freed."""

    event: ClassVar[str] = "removed"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0


@dataclass(frozen=True, slots=True)
class KeptUnknown(Event):
    """A region nobody could prove dead or alive: kept. Told when it becomes unknown."""

    event: ClassVar[str] = "kept_unknown"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class KeptOtherUser(Event):
    """With ``reap``, an orphaned region with a file of another uid: judged dead, but removed only
    with ``all_users=True`` (``--all-users``). Told when it becomes orphaned (or its files change)."""

    event: ClassVar[str] = "kept_other_user"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0
    #: The owners of its files that are not the agent's uid.
    uids: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ParkedSettled(Event):
    """Files a dead reaper left parked (docs/reap-protocol.md), given back their names
    (``action`` ``restored``: in use, or not provably dead), or left parked because their
    name was taken meanwhile (``conflict``: both files kept). Those proven dead are removed,
    and told as ``removed``."""

    event: ClassVar[str] = "parked"
    engine_id: str = ""
    action: str = ""
    bytes: int = 0
    files: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RemovalFailed(Event):
    """Orphaned files the agent should have removed and could not, for a failure of its own (an
    errno; a root out of inodes where others may rename): kept, with the reason. Told each
    time it happens."""

    event: ClassVar[str] = "removal_failed"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class KeptParked(Event):
    """With ``reap``, an orphaned region not nominated because files of it (same engine, same
    owner) wait in a reaper's park directory: removed once they are settled. Told when it
    starts (again if its files change)."""

    event: ClassVar[str] = "kept_parked"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ParkUntrusted(Event):
    """An entry named like a reaper's park directory that is not one (docs/reap-protocol.md:
    the trust rules): never entered, renamed or removed, and nothing in it holds back a
    region. Told once per entry (again if its owner, mode or reason changes)."""

    event: ClassVar[str] = "park_untrusted"
    name: str = ""
    kind: str = ""
    uid: int = 0
    mode: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ParkRemoved(Event):
    """A park directory a dead reaper left, emptied (or never finished), removed."""

    event: ClassVar[str] = "park_removed"
    name: str = ""


@dataclass(frozen=True, slots=True)
class PassSummary(Event):
    """The end of a pass: ``orphaned_bytes`` is what orphans still pin after it."""

    event: ClassVar[str] = "pass"
    roots: int = 0
    orphaned_bytes: int = 0
    removed_files: int = 0
    seconds: float = 0.0
    errors: int = 0
    #: Why this pass walked ``/proc``, a reason per walk (``walks.WALK_REASONS``); empty when
    #: the leases decided everything and the walk-only numbers are the last walk's.
    proc_walks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class RootScan:
    """What a pass keeps of one root's scan: numbers, never its entries.

    It shows the root as the pass left it: a file removed in the pass is not counted, a file
    the removal kept is counted under the verdict the removal found, and what a dead reaper
    left parked is counted where its settling put it. Its size does not depend on the number
    of files: a root of 100,000 files is as small here as an empty one.
    """

    root: Path
    scanned_at: float
    #: Files and bytes per verdict, as ``scan``'s summary counts them.
    summary: ScanSummary
    #: Resident bytes (st_blocks*512) per verdict, every ``Status`` a key.
    resident_bytes: Mapping[Status, int]
    #: The ``top_engines`` engines whose orphaned files pin most memory: (engine id, bytes),
    #: largest first, ties by engine id. ``orphaned_other_bytes`` is the rest, together.
    orphaned_engines: tuple[tuple[str, int], ...] = ()
    orphaned_other_bytes: int = 0
    #: Apparent size of the largest region (base and segments, any verdict).
    region_size_max: int = 0
    #: Bytes of unlinked region files of the root's filesystem still mapped or open.
    unlinked_mapped_bytes: int = 0
    #: Regions per verdict, as scan's table counts its rows: an engine's files that share a
    #: verdict are one region (a base and its segments), under each verdict its files have.
    regions: Mapping[Status, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RemovedFile:
    """A region file a pass removed, by its name in the root."""

    name: str


@dataclass(frozen=True, slots=True)
class RootReap:
    """What a pass removed in one root; the ``removed`` and ``parked`` events tell it by engine."""

    removed: tuple[RemovedFile, ...] = ()
    #: Resident memory of the removed files (st_blocks*512): what the root's mount got back.
    freed_bytes: int = 0
    #: Files a dead reaper left parked that got their names back, and that stay parked because
    #: their name was taken (``ParkedSettled``).
    restored: int = 0
    conflicts: int = 0


@dataclass(frozen=True, slots=True)
class RootPass:
    """One root's turn in a pass: the scan that shows the disk as the pass left it, or the error."""

    root: Path
    pod_uid: str | None
    attempted_at: float
    scan_seconds: float
    report: RootScan | None = None
    usage: Usage | None = None
    error: RootError | None = None
    #: When the root was last scanned successfully (this pass, or an earlier one).
    last_success: float | None = None
    #: What this pass removed, when something was nominated (or a dead reaper's park settled).
    reaped: RootReap | None = None


@dataclass(frozen=True, slots=True)
class PassReport:
    """What one pass did. ``vanished`` roots had series before and have none now."""

    number: int
    started_at: float
    seconds: float
    matched: int
    roots: tuple[RootPass, ...]
    vanished: tuple[Path, ...]
    summary: PassSummary
    stopped: bool = False
    #: Why this pass walked ``/proc`` (as ``PassSummary.proc_walks``).
    proc_walks: tuple[str, ...] = ()
    #: When the last walk was made, this pass's or an earlier one (None: none yet).
    proc_walk_at: float | None = None
