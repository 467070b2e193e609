"""Remove orphaned region files, and nothing else, even if the directory changes under us.

Only entries a fresh scan calls ``orphaned`` are candidates, narrowed by the operator's
filters (engine, dead owner pid, age) and to the caller's own files: root judges every user's
files, but removes another user's only with ``all_users=True`` (``--all-users``); without it
their orphans stay, listed (``other_users_left``). A scan is a snapshot, so before each region is
removed it is proven again, moved into this reaper's park directory, proven once more and
unlinked there (``removal``: the protocol; ``park``: the directory). Before anything, what dead
reapers left in trusted park directories is settled (``park.settle``): files proven dead again go,
the rest get their names back. docs/reap-protocol.md has every outcome.

Nothing here follows a link, truncates or chmods anything, creates anything but the park
directory and its mark, or touches a name outside the region pattern. An item that fails any
check is kept, with the reason; one the reaper failed on (an errno) is also ``failed``, and
a failure to unlink one item is reported, never raised. Removal happens only on tmpfs or
hugetlbfs unless the caller says otherwise (``any_filesystem``).
"""

from __future__ import annotations

import fnmatch
import glob
import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Unpack

from kvoffload.errors import ConfigError, RootError
from kvoffload.liveness import lease, park
from kvoffload.liveness.namespace import Visibility
from kvoffload.liveness.park import UntrustedPark
from kvoffload.liveness.park.settle import settle_parked
from kvoffload.liveness.removal import (
    FD_RESERVE,
    GONE,
    MAX_BATCH_FILES,
    PARK_SETTLE_S,
    Outcome,
    batch_files,
    remove_regions,
)
from kvoffload.liveness.report import SCHEMA_VERSION, ScanEntry, ScanReport, ScanSummary
from kvoffload.liveness.scan import DEFAULT_ROOT, ScanKeywords, ScanOptions, Status, open_root, scan
from kvoffload.shm import mounts

__all__ = [
    "FD_RESERVE",
    "MAX_BATCH_FILES",
    "PARK_SETTLE_S",
    "Outcome",
    "ReapFilter",
    "ReapReport",
    "batch_files",
    "reap",
    "reap_command",
    "remove_regions",
    "select",
    "settle_parked",
    "shell_word",
]


@dataclass(frozen=True, slots=True)
class ReapFilter:
    """Which orphaned regions to remove: every given kind of condition must hold.

    Within a kind, any value may match: ``--engine 'a*' --engine b`` selects both. Engine
    ids match as shell-style globs (``fnmatchcase``: ``*``, ``?``, ``[...]``; a literal id
    matches itself), the way operators already select files.
    """

    engine_ids: tuple[str, ...] = ()
    #: Regions whose owner record names one of these pids, and that pid is dead.
    owner_pids: tuple[int, ...] = ()
    #: Regions whose youngest file's mtime is at least this old (``ls -l``'s age).
    older_than_s: float | None = None

    def __post_init__(self) -> None:
        if self.older_than_s is not None and self.older_than_s < 0:
            raise ConfigError("older_than", f"must not be negative, got {self.older_than_s:g}s")
        for pattern in self.engine_ids:
            if not pattern:
                raise ConfigError("--engine", "is empty", fix="pass an engine id or a glob such as 'chat-*'")

    @classmethod
    def exactly(cls, engine_id: str) -> ReapFilter:
        """Only the region of ``engine_id``, even where the id holds ``*``, ``?`` or ``[``."""
        return cls(engine_ids=(glob.escape(engine_id),))

    @property
    def active(self) -> bool:
        return bool(self.engine_ids or self.owner_pids or self.older_than_s is not None)

    def matches_engine(self, engine_id: str) -> bool:
        return not self.engine_ids or any(fnmatch.fnmatchcase(engine_id, p) for p in self.engine_ids)

    def selects(self, group: Sequence[ScanEntry]) -> bool:
        if not self.matches_engine(group[0].engine_id):
            return False
        if self.owner_pids:
            owners = [e.owner for e in group if e.owner is not None]
            if not any(o.pid in self.owner_pids and o.alive is False for o in owners):
                return False
        return self.older_than_s is None or min(e.age_s for e in group) >= self.older_than_s

    def unmatched(self, entries: Sequence[ScanEntry]) -> tuple[str, ...]:
        """Each ``--engine`` or ``--pid`` value that names no region of ``entries`` at all."""
        engines = {e.engine_id for e in entries}
        owners = {e.owner.pid for e in entries if e.owner is not None}
        missing = [
            f"--engine {shell_word(p)}"
            for p in self.engine_ids
            if not any(fnmatch.fnmatchcase(engine, p) for engine in engines)
        ]
        missing += [f"--pid {pid}" for pid in self.owner_pids if pid not in owners]
        return tuple(missing)


@dataclass(frozen=True, slots=True)
class ReapReport:
    """What ``reap`` removed (or, dry run, would remove) and what it kept, with reasons.

    ``freed_bytes`` is resident memory (st_blocks × 512) of the removed files: what the
    shm mount gets back. ``summary`` is the scan the reap acted on. ``unknown`` are the
    files the filters chose that the scan could not prove dead: never removed, and the
    reason the operator has to act on.
    """

    schema_version: int
    root: Path
    dry_run: bool
    removed: tuple[ScanEntry, ...]
    kept: tuple[ScanEntry, ...]
    freed_bytes: int
    summary: ScanSummary
    unknown: tuple[ScanEntry, ...] = ()
    visibility: Visibility | None = None
    lease_enabled: bool = True
    #: Orphaned files the filters left out (they stay, and say so).
    filtered_out: tuple[ScanEntry, ...] = ()
    #: The ``--engine``/``--pid`` values that named no region in the root at all.
    unmatched_filters: tuple[str, ...] = ()
    #: Dry run: what dead reapers left parked, each with the ``action`` this reap would take.
    parked: tuple[ScanEntry, ...] = ()
    #: Parked files (of a dead reap, or raced by an opener in this one... see ``kept``) given
    #: back their names by this reap.
    restored: tuple[ScanEntry, ...] = ()
    #: Files that wait in a park directory because their name was taken before they could be
    #: given back: both files kept, nothing removed (also in ``kept``, status ``parked``).
    conflicts: tuple[ScanEntry, ...] = ()
    lease_break_time_s: float | None = None
    #: Orphaned files of other users this reap judged and left: it removes another user's file
    #: only with ``all_users=True`` (``--all-users``). Whole regions, as the scan judged them.
    other_users_left: tuple[ScanEntry, ...] = ()
    #: Files this reap should have removed and could not, for a failure of its own (an errno:
    #: no inode for its park directory where others may rename, a file it could not open or
    #: unlink), with the reason: also in ``kept``. Not empty: ``shmctl reap`` exits 3.
    failed: tuple[ScanEntry, ...] = ()
    #: Park directories dead reapers left (emptied now, or never finished), removed by this reap.
    parks_removed: tuple[str, ...] = ()
    #: Entries named like park directories that are not a reaper's: never entered or removed.
    untrusted_parks: tuple[UntrustedPark, ...] = ()
    #: The families of files judged (``--family``), as the scan's.
    families: tuple[str, ...] = ("offload",)
    #: Files the filters chose that a process holds, each with its holders in its reason:
    #: kept, and what a restart that will not fit is waiting on.
    live: tuple[ScanEntry, ...] = ()

    @property
    def unknown_resident_bytes(self) -> int:
        return sum(e.resident_bytes for e in self.unknown)


def select(
    report: ScanReport, filters: ReapFilter = ReapFilter(), status: Status = Status.ORPHANED
) -> tuple[ScanEntry, ...]:
    """The entries of ``report`` with ``status`` that ``filters`` choose, whole regions at a time."""
    groups: dict[tuple[str, str], list[ScanEntry]] = {}
    for e in report.entries:
        if e.status is status:
            groups.setdefault(e.unit, []).append(e)
    return tuple(e for group in groups.values() if filters.selects(group) for e in group)


def reap(
    root: Path | str = DEFAULT_ROOT,
    options: ScanOptions | None = None,
    *,
    filters: ReapFilter = ReapFilter(),
    dry_run: bool = False,
    now: float | None = None,
    only: ReapReport | None = None,
    should_stop: Callable[[], bool] | None = None,
    root_fd: int | None = None,
    any_filesystem: bool = False,
    **legacy: Unpack[ScanKeywords],
) -> ReapReport:
    """Scan ``root`` by ``options`` (``ScanOptions``, as ``scan``) and remove the orphaned
    regions ``filters`` select.

    ``options.all_users`` is ``scan``'s: whose files are judged (None, the default: every
    user's as root, the caller's own otherwise). Only True removes another user's files;
    otherwise the orphaned regions with a file of another uid are left and listed
    (``other_users_left``).

    ``only`` is an earlier dry-run report (what the operator confirmed): nothing outside it
    is removed, and anything in it that is no longer orphaned, or is another inode now,
    is kept with the new verdict.

    ``should_stop`` is asked before each region is locked (a long-running caller's SIGTERM):
    once it answers True, the regions not yet begun are kept, still ``orphaned``, with the
    reason. A region already locked is finished, so nothing is ever left half-removed or
    parked.

    ``root_fd`` is the root's directory, already open (see ``scan.open_root``): the scan and
    every removal then act on that directory, never on whatever ``root`` names by now.
    Files are removed only from a tmpfs or hugetlbfs (where regions live, and where a file's
    memory is what the operator wants back); ``any_filesystem`` lifts that.

    ``legacy``: the scan settings as separate keywords (``grace_s=0``), laid over ``options``;
    kept for one release (issue #29).
    """
    options = ScanOptions.of(options, legacy)
    with open_root(root, root_fd) as dir_fd:
        if not any_filesystem:
            _require_memory_filesystem(root, dir_fd)
        return _reap_root(
            root,
            dir_fd,
            options,
            filters=filters,
            dry_run=dry_run,
            now=now,
            only=only,
            should_stop=should_stop,
        )


def _require_memory_filesystem(root: Path | str, dir_fd: int) -> None:
    if mounts.memory_filesystem(dir_fd) is None:
        raise RootError(
            root,
            "is not on a tmpfs or hugetlbfs: reap removes region files only where they live",
            fix="pass the shm mount (/dev/shm, a pod memory volume), or --any-filesystem to remove anyway",
        )


def _reap_root(
    root: Path | str,
    dir_fd: int,
    options: ScanOptions,
    *,
    filters: ReapFilter,
    dry_run: bool,
    now: float | None,
    only: ReapReport | None,
    should_stop: Callable[[], bool] | None,
) -> ReapReport:
    report = scan(root, options, now=now, root_fd=dir_fd)
    all_users = options.all_users
    selected = select(report, filters)
    chosen, theirs = _split_by_owner(selected, None if all_users else os.geteuid())
    done = Outcome()
    if only is not None:
        confirmed = {(e.name, e.identity) for e in only.removed}
        chosen = tuple(e for e in chosen if (e.name, e.identity) in confirmed)
        now_chosen = {(e.name, e.identity) for e in chosen}
        fresh = {e.name: e for e in report.entries if e.parked is None}
        for e in only.removed:
            if (e.name, e.identity) in now_chosen:
                continue
            current = fresh.get(e.name)
            if current is None:
                done.keep(e, Status.ORPHANED, GONE)
            elif current.identity != e.identity:
                done.keep(current, Status.UNKNOWN, "the name now refers to another file")
            else:
                done.kept.append(current)
    # What dead reapers left parked: settled first, whatever the filters (a live file must get
    # its name back at once); only the filters' engines are removed, the rest given back.
    parked = tuple(e for e in report.entries if e.parked is not None and not e.parked.reaper_running)
    dead = tuple(p for p in report.parks if p.running is False)
    if dry_run:
        done.removed.extend(chosen)
    else:
        groups: dict[tuple[str, str], list[ScanEntry]] = {}
        for e in chosen:
            groups.setdefault(e.unit, []).append(e)
        with lease.sigio_ignored(), park.ParkDir(dir_fd, proc_root=options.proc_root) as parking:
            if dead:
                settle_parked(
                    dir_fd,
                    parked,
                    parks=dead,
                    parking=parking,
                    adopter=park.Adopter.of(all_users),
                    remove_engines=filters.matches_engine,
                    remove_others=bool(all_users),
                    use_lease=report.lease_enabled,
                    outcome=done,
                )
            remove_regions(
                dir_fd,
                groups.values(),
                options.proc_root,
                options.assume_not_holding,
                should_stop,
                parking=parking,
                outcome=done,
            )
    return ReapReport(
        schema_version=SCHEMA_VERSION,
        root=report.root,
        dry_run=dry_run,
        removed=tuple(done.removed),
        kept=tuple(done.kept),
        freed_bytes=sum(e.resident_bytes for e in done.removed),
        summary=report.summary,
        unknown=select(report, filters, Status.UNKNOWN),
        visibility=report.visibility,
        lease_enabled=report.lease_enabled,
        filtered_out=_left_out(report, selected),
        unmatched_filters=filters.unmatched(report.entries),
        other_users_left=theirs,
        parked=parked if dry_run else (),
        restored=tuple(done.restored),
        conflicts=tuple(e for e in done.kept if e.status is Status.PARKED),
        lease_break_time_s=report.lease_break_time_s,
        failed=tuple(done.failed),
        parks_removed=tuple(done.parks_removed),
        untrusted_parks=report.untrusted_parks,
        families=report.families,
        live=select(report, filters, Status.LIVE),
    )


def _split_by_owner(
    entries: Sequence[ScanEntry], euid: int | None
) -> tuple[tuple[ScanEntry, ...], tuple[ScanEntry, ...]]:
    """(the regions this reap may remove, the regions with a file of a uid other than ``euid``);
    with ``euid`` None (``all_users``), every region is removable."""
    # A region goes whole or not at all: one file of another user's keeps all of it.
    theirs = {e.unit for e in entries if euid is not None and e.uid != euid}
    return (
        tuple(e for e in entries if e.unit not in theirs),
        tuple(e for e in entries if e.unit in theirs),
    )


def _left_out(report: ScanReport, selected: Sequence[ScanEntry]) -> tuple[ScanEntry, ...]:
    chosen = {e.name for e in selected}
    return tuple(e for e in report.with_status(Status.ORPHANED) if e.name not in chosen)


def reap_command(root: Path, engine_id: str) -> str:
    """The ``shmctl reap`` command that removes this engine's orphans, to be pasted into a shell."""
    # --engine takes a glob: an id holding * ? or [ is escaped so it names only itself.
    engine = shell_word(glob.escape(engine_id))
    return f"shmctl reap --root {shell_word(str(root))} --engine {engine} --grace 0 --yes"


def shell_word(text: str) -> str:
    """``text`` as one shell word that gives back exactly ``text``, written in visible characters.

    ``shlex.quote`` leaves a newline or an escape byte literal inside its quotes, and the
    report escapes those for display, so what the operator would copy is not the command.
    Such words are ANSI-C quoted instead (``$'...'``, as bash's ``printf %q`` writes them;
    bash, zsh and ksh read them): each invisible character is the ``\\xHH`` of its bytes,
    so the undecodable bytes of a name (surrogate escapes) come back as the same bytes.
    """
    if text.isprintable():
        return shlex.quote(text)
    spelled = []
    for char in text:
        if char in "\\'":
            spelled.append("\\" + char)
        elif char.isprintable():
            spelled.append(char)
        else:
            spelled.extend(f"\\x{byte:02x}" for byte in char.encode("utf-8", "surrogateescape"))
    return "$'" + "".join(spelled) + "'"
