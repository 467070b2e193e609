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

import contextlib
import dataclasses
import fnmatch
import glob
import os
import shlex
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Unpack

from kvoffload.errors import ConfigError, RootError
from kvoffload.liveness import lease, park
from kvoffload.liveness.namespace import Visibility
from kvoffload.liveness.oneshot import WHOLE_BELOW, JudgedRoot
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
from kvoffload.liveness.scan import DEFAULT_ROOT, ScanKeywords, ScanOptions, Status, open_root
from kvoffload.shm import mounts

__all__ = [
    "FD_RESERVE",
    "MAX_BATCH_FILES",
    "PARK_SETTLE_S",
    "STREAMED_FIELDS",
    "Outcome",
    "ReapFilter",
    "ReapReport",
    "ReapSink",
    "batch_files",
    "reap",
    "reap_command",
    "reap_into",
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


class ReapSink(Protocol):
    """Where ``reap_into`` hands the report's lists of entries (``STREAMED_FIELDS``), a batch
    at a time, as the reap produces them: a command writes them out instead of holding them."""

    def take(self, field: str, entries: Sequence[ScanEntry]) -> None: ...


#: The ``ReapReport`` fields that ``reap_into`` hands to its sink instead of returning. Within
#: one outcome of the removal they come as ``removed``, ``failed``, ``kept``, ``conflicts``,
#: ``restored``: a failed entry is also kept, and comes first.
STREAMED_FIELDS = (
    "removed",
    "kept",
    "unknown",
    "filtered_out",
    "parked",
    "restored",
    "conflicts",
    "other_users_left",
    "failed",
    "live",
)


class _Collected:
    """A sink that keeps every list: ``reap``'s whole report."""

    def __init__(self) -> None:
        self.lists: dict[str, list[ScanEntry]] = {name: [] for name in STREAMED_FIELDS}

    def take(self, field: str, entries: Sequence[ScanEntry]) -> None:
        self.lists[field].extend(entries)


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

    The whole report is held (every entry removed or kept); ``reap_into`` hands the lists
    out as they come instead.

    ``legacy``: the scan settings as separate keywords (``grace_s=0``), laid over ``options``;
    kept for one release (issue #29).
    """
    collected = _Collected()
    report = reap_into(
        collected,
        root,
        ScanOptions.of(options, legacy),
        filters=filters,
        dry_run=dry_run,
        now=now,
        only=only,
        should_stop=should_stop,
        root_fd=root_fd,
        any_filesystem=any_filesystem,
    )
    lists = {name: tuple(entries) for name, entries in collected.lists.items()}
    return dataclasses.replace(report, **lists)  # type: ignore[arg-type]


def reap_into(
    sink: ReapSink,
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
    whole_below: int = WHOLE_BELOW,
) -> ReapReport:
    """``reap``, a region at a time: the root is judged as a stream (``oneshot.JudgedRoot``),
    each orphaned region the filters choose is removed in a batch as the stream reaches it,
    and every list of the report (``STREAMED_FIELDS``) goes to ``sink`` as it is produced.
    The report returned has those lists empty; everything else is ``reap``'s.

    What dead reapers left parked is settled first, before any region is judged, as ``reap``
    always did. ``whole_below``: see ``oneshot.WHOLE_BELOW``.
    """
    options = options if options is not None else ScanOptions()
    with open_root(root, root_fd) as dir_fd:
        if not any_filesystem:
            _require_memory_filesystem(root, dir_fd)
        return _reap_root(
            sink,
            root,
            dir_fd,
            options,
            filters=filters,
            dry_run=dry_run,
            now=now,
            only=only,
            should_stop=should_stop,
            whole_below=whole_below,
        )


def _require_memory_filesystem(root: Path | str, dir_fd: int) -> None:
    if mounts.memory_filesystem(dir_fd) is None:
        raise RootError(
            root,
            "is not on a tmpfs or hugetlbfs: reap removes region files only where they live",
            fix="pass the shm mount (/dev/shm, a pod memory volume), or --any-filesystem to remove anyway",
        )


class _Unmatched:
    """``ReapFilter.unmatched`` over entries seen a region at a time."""

    def __init__(self, filters: ReapFilter) -> None:
        self.filters = filters
        self._patterns = set(filters.engine_ids)
        self._pids = set(filters.owner_pids)
        self._engine = ""

    def see(self, entries: Sequence[ScanEntry]) -> None:
        for e in entries:
            if self._patterns and e.engine_id != self._engine:
                self._engine = e.engine_id
                self._patterns -= {p for p in self._patterns if fnmatch.fnmatchcase(e.engine_id, p)}
            if self._pids and e.owner is not None:
                self._pids.discard(e.owner.pid)

    def result(self) -> tuple[str, ...]:
        missing = [f"--engine {shell_word(p)}" for p in self.filters.engine_ids if p in self._patterns]
        missing += [f"--pid {pid}" for pid in self.filters.owner_pids if pid in self._pids]
        return tuple(missing)


class _Confirmed:
    """What the operator confirmed (an earlier dry run's ``removed``): only it may go, and
    each file of it is accounted for, removed or kept with why."""

    def __init__(self, plan: ReapReport) -> None:
        self._plan = {e.name: e for e in plan.removed}
        self._confirmed = {(e.name, e.identity) for e in plan.removed}
        self._seen: set[str] = set()

    def narrow(self, region: Sequence[ScanEntry], chosen: list[ScanEntry], done: Outcome) -> list[ScanEntry]:
        """The files of ``chosen`` the plan named (the same inode); a planned file of ``region``
        that is not among them is kept with its verdict now."""
        chosen = [e for e in chosen if (e.name, e.identity) in self._confirmed]
        going = {(e.name, e.identity) for e in chosen}
        for current in region:
            planned = self._plan.get(current.name)
            if planned is None:
                continue
            self._seen.add(current.name)
            if (current.name, current.identity) in going:
                continue
            if current.identity != planned.identity:
                done.keep(current, Status.UNKNOWN, "the name now refers to another file")
            else:
                done.kept.append(current)
        return chosen

    def gone(self, done: Outcome) -> None:
        """Planned files no region has any more: removed by someone else."""
        for name, planned in self._plan.items():
            if name not in self._seen:
                done.keep(planned, Status.ORPHANED, GONE)


class _Told:
    """What the reap counts of the lists it hands out: the bytes freed, the parks removed."""

    def __init__(self, sink: ReapSink) -> None:
        self.sink = sink
        self.freed = 0
        self.parks_removed: list[str] = []

    def outcome(self, done: Outcome) -> None:
        sink = self.sink
        sink.take("removed", done.removed)
        sink.take("failed", done.failed)
        sink.take("kept", done.kept)
        sink.take("conflicts", [e for e in done.kept if e.status is Status.PARKED])
        sink.take("restored", done.restored)
        self.freed += sum(e.resident_bytes for e in done.removed)
        self.parks_removed.extend(done.parks_removed)


def _reap_root(
    sink: ReapSink,
    root: Path | str,
    dir_fd: int,
    options: ScanOptions,
    *,
    filters: ReapFilter,
    dry_run: bool,
    now: float | None,
    only: ReapReport | None,
    should_stop: Callable[[], bool] | None,
    whole_below: int,
) -> ReapReport:
    all_users = options.all_users
    euid = None if all_users else os.geteuid()
    told = _Told(sink)
    unmatched = _Unmatched(filters)
    confirmed = _Confirmed(only) if only is not None else None
    with (
        JudgedRoot(root, options, root_fd=dir_fd, now=now, whole_below=whole_below) as judged,
        contextlib.ExitStack() as stack,
    ):
        unmatched.see(judged.parks.parked)
        # What dead reapers left parked: settled first, whatever the filters (a live file must
        # get its name back at once); only the filters' engines are removed, the rest given back.
        parked = tuple(e for e in judged.parks.parked if e.parked is not None and not e.parked.reaper_running)
        dead = tuple(p for p in judged.parks.parks if p.running is False)
        parking: park.ParkDir | None = None
        if dry_run:
            sink.take("parked", parked)
        else:
            stack.enter_context(lease.sigio_ignored())
            parking = stack.enter_context(park.ParkDir(dir_fd, proc_root=options.proc_root))
            if dead:
                done = Outcome()
                settle_parked(
                    dir_fd,
                    parked,
                    parks=dead,
                    parking=parking,
                    adopter=park.Adopter.of(all_users),
                    remove_engines=filters.matches_engine,
                    remove_others=bool(all_users),
                    use_lease=judged.lease_enabled,
                    outcome=done,
                )
                told.outcome(done)
        # The regions the filters choose go as the stream reaches them, a batch at a time: each
        # is proven dead again under its lease (``remove_regions``) moments after it was judged.
        pending: list[list[ScanEntry]] = []
        pending_files = 0
        batch = batch_files()
        for region in judged.regions():
            unmatched.see(region)
            chosen = _choose(sink, region, filters, euid)
            if confirmed is not None:
                kept_now = Outcome()
                chosen = confirmed.narrow(region, chosen, kept_now)
                sink.take("kept", kept_now.kept)
            if not chosen:
                continue
            if parking is None:
                sink.take("removed", chosen)
                told.freed += sum(e.resident_bytes for e in chosen)
                continue
            pending.append(chosen)
            pending_files += len(chosen)
            if pending_files >= batch:
                told.outcome(_remove(dir_fd, pending, options, should_stop, parking))
                pending, pending_files, batch = [], 0, batch_files()
        if pending and parking is not None:
            told.outcome(_remove(dir_fd, pending, options, should_stop, parking))
        if confirmed is not None:
            gone = Outcome()
            confirmed.gone(gone)
            sink.take("kept", gone.kept)
        report = judged.report()
    return ReapReport(
        schema_version=SCHEMA_VERSION,
        root=report.root,
        dry_run=dry_run,
        removed=(),
        kept=(),
        freed_bytes=told.freed,
        summary=report.summary,
        visibility=report.visibility,
        lease_enabled=report.lease_enabled,
        unmatched_filters=unmatched.result(),
        lease_break_time_s=report.lease_break_time_s,
        parks_removed=tuple(told.parks_removed),
        untrusted_parks=report.untrusted_parks,
        families=report.families,
    )


def _choose(
    sink: ReapSink, region: Sequence[ScanEntry], filters: ReapFilter, euid: int | None
) -> list[ScanEntry]:
    """The files of ``region`` this reap may remove: orphaned, chosen by the filters, and (unless
    ``euid`` is None: ``all_users``) all of ``euid``'s. What the filters leave out, another
    user's region, and the unknown and live files they chose are handed to ``sink``."""
    for status, name in ((Status.UNKNOWN, "unknown"), (Status.LIVE, "live")):
        same = [e for e in region if e.status is status]
        if same and filters.selects(same):
            sink.take(name, same)
    orphaned = [e for e in region if e.status is Status.ORPHANED]
    if not orphaned:
        return []
    if not filters.selects(orphaned):
        sink.take("filtered_out", orphaned)
        return []
    # A region goes whole or not at all: one file of another user's keeps all of it.
    if euid is not None and any(e.uid != euid for e in orphaned):
        sink.take("other_users_left", orphaned)
        return []
    return orphaned


def _remove(
    dir_fd: int,
    regions: list[list[ScanEntry]],
    options: ScanOptions,
    should_stop: Callable[[], bool] | None,
    parking: park.ParkDir,
) -> Outcome:
    return remove_regions(
        dir_fd,
        regions,
        options.proc_root,
        options.assume_not_holding,
        should_stop,
        parking=parking,
    )


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
