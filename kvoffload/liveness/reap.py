"""Remove orphaned region files, and nothing else, even if the directory changes under us.

Only entries a fresh scan calls ``orphaned`` are candidates, narrowed by the operator's
filters (engine, dead owner pid, age) and to the caller's own files: root judges every user's
files, but removes another user's only with ``all_users=True`` (``--all-users``); without it
their orphans stay, listed (``other_users_left``). A scan is a snapshot, so before each region is
removed it is proven again (anchors D5), with every file of the group:

1. opened through the root's directory fd, ``O_RDONLY|O_NOFOLLOW|O_NONBLOCK`` (a link
   planted since the scan fails to open; a fifo cannot block us);
2. ``fstat`` must equal the scanned ``(st_dev, st_ino)``: a name reused by a new engine
   is another inode (vLLM #57422) and is kept;
3. ``flock(LOCK_EX|LOCK_NB)``: refused means a kvoffload participant holds it; granted,
   it also makes a kvoffload joiner that arrives now wait (and then see the file was
   unlinked);
4. proof that nobody holds it now. Where the scan had the write lease (``lease``), each
   file is removed under its own lease, taken on the fd of step 1 and held for that one
   file's check-and-unlink (an opener blocks in the kernel meanwhile):

   a. ``F_SETLEASE F_WRLCK`` must be granted (refused: someone opened it since the scan);
   b. the name is re-``lstat``ed: still a regular file, one link, the same inode;
   c. no opener may have arrived (``lease.contested``: ``F_GETLEASE`` and a second take);
   d. the file is moved into this reaper's park directory (``park.ParkDir``: 0700, locked
      while the reaper runs) under its own name, and the move is proven: ``fstatat`` of the
      parked name must be the leased inode, a regular file with one link, else it is someone
      else's file (an engine re-created the name, a symlink or directory was swapped in, in
      the instant before the rename) and goes straight back (``RENAME_NOREPLACE``). Then the
      lease is checked again and released. An opener that resolved the name a moment before
      is in the kernel on our inode: ``F_GETLEASE`` shows a break only once it reaches
      ``break_lease``, but taking the held lease again fails as soon as it counts itself
      among the inode's opens (a fanotify permission check can hold it in between), so both
      are asked;
   e. after all files of the batch are parked and a short wait (``PARK_SETTLE_S``), each is
      leased and checked once more, its parked name proven to be the inode again, unlinked
      inside the park directory (no other user can put a file there), and its link count
      proven 0. Any sign of an opener at c, d or e gives every parked file of the region its
      name back (the opener gets the file it asked for, intact: "raced with an opener"); a
      name taken meanwhile leaves the file parked, reported as a conflict. What no check can
      see is an opener that resolved the name before the rename and is then kept off the
      CPU, before it counts itself among the inode's opens, for longer than that wait: Linux
      has no unlink-by-inode, and such an opener gets the removed file.

   Where no lease could be taken, a fresh ``/proc`` pass restricted to the locked inodes
   (one per batch of regions, see ``batch_files``) must show no holder and no uninspected
   process; the name is re-``lstat``ed, and the file parked, proven and unlinked as above;
5. segments first and the base last, so a new creator can only win ``O_EXCL`` on the base
   once the whole old region is gone;
6. locks released by closing the fds.

A reaper killed at any point leaves its park directory, unlocked. Every reap first settles
what dead reapers left (``settle_parked``): files proven dead again are removed, the rest get
their names back, a name taken meanwhile is a conflict (both kept). docs/reap-protocol.md
has every outcome.

Nothing here follows a link, truncates or chmods anything, creates anything but the park
directory, or touches a name outside the region pattern. An item that fails any check is
kept, with the reason; a failure to unlink one item is reported, never raised. Removal
happens only on tmpfs or hugetlbfs unless the caller says otherwise (``any_filesystem``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import fnmatch
import glob
import os
import shlex
import stat
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload import procfs
from kvoffload.errors import ConfigError, RootError
from kvoffload.liveness import lease, park
from kvoffload.liveness.holders import HolderIndex, collect_holders
from kvoffload.liveness.lease import LeaseState
from kvoffload.liveness.namespace import Visibility
from kvoffload.liveness.scan import (
    DEFAULT_GRACE_S,
    DEFAULT_ROOT,
    SCHEMA_VERSION,
    ScanEntry,
    ScanReport,
    ScanSummary,
    Status,
    open_probe_fd,
    open_root,
    scan,
    uids_text,
)
from kvoffload.shm import mounts

_GONE = "gone before removal (removed by someone else)"
_RACED = "kept: raced with an opener (it opened the file during removal)"
_REGION_KEPT = "kept: another file of its region was kept (a region goes whole or not at all)"
_STOPPED = "kept: the reap was stopped before this region (the process is shutting down)"
#: The most files one batch holds open at once, however many fds the process may have.
MAX_BATCH_FILES = 1024
#: Fds kept free beside a batch: the root, the park directory, a /proc walk's two, the prober's
#: pipe, and a little room for what the caller holds (an agent's listener).
FD_RESERVE = 8


def batch_files() -> int:
    """Files per batch: a quarter of the soft fd limit at most (and 1024), never more than the
    fds actually free now, and at least 1.

    Every file of a batch stays open (LOCK_EX) until the batch is done, and each batch costs
    one settle wait (and, without a lease, one ``/proc`` pass): bigger batches are faster,
    but a batch must never run the process out of fds. At ``ulimit -n 64`` a batch is a few
    files, at 16 one or two: slower, and every orphan still goes.
    """
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 1
    if soft == resource.RLIM_INFINITY:
        soft = 4 * MAX_BATCH_FILES
    try:
        in_use = len(os.listdir("/proc/self/fd")) - 1  # the listing's own fd is closed again
    except OSError:
        in_use = 8
    return max(1, min(MAX_BATCH_FILES, soft // 4, soft - in_use - FD_RESERVE))


#: How long parked files (moved to the park directory, lease released) wait before their last
#: check: an opener that resolved the region name just before the rename needs only to be
#: scheduled to enter the file's open count. One wait per batch, not per file.
PARK_SETTLE_S = 0.002


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

    @property
    def unknown_resident_bytes(self) -> int:
        return sum(e.resident_bytes for e in self.unknown)


def select(
    report: ScanReport, filters: ReapFilter = ReapFilter(), status: Status = Status.ORPHANED
) -> tuple[ScanEntry, ...]:
    """The entries of ``report`` with ``status`` that ``filters`` choose, whole regions at a time."""
    groups: dict[str, list[ScanEntry]] = {}
    for e in report.entries:
        if e.status is status:
            groups.setdefault(e.engine_id, []).append(e)
    return tuple(e for group in groups.values() if filters.selects(group) for e in group)


def reap(
    root: Path | str = DEFAULT_ROOT,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    filters: ReapFilter = ReapFilter(),
    dry_run: bool = False,
    all_users: bool | None = None,
    assume_not_holding: Collection[int] = (),
    use_lease: bool = True,
    proc_root: Path = procfs.PROC_ROOT,
    now: float | None = None,
    only: ReapReport | None = None,
    should_stop: Callable[[], bool] | None = None,
    root_fd: int | None = None,
    any_filesystem: bool = False,
) -> ReapReport:
    """Scan ``root`` and remove the orphaned regions ``filters`` select.

    ``all_users`` is ``scan``'s: whose files are judged (None, the default: every user's as
    root, the caller's own otherwise). Only True removes another user's files; otherwise the
    orphaned regions with a file of another uid are left and listed (``other_users_left``).

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
    """
    with open_root(root, root_fd) as dir_fd:
        if not any_filesystem:
            _require_memory_filesystem(root, dir_fd)
        return _reap_root(
            root,
            dir_fd,
            grace_s=grace_s,
            filters=filters,
            dry_run=dry_run,
            all_users=all_users,
            assume_not_holding=assume_not_holding,
            use_lease=use_lease,
            proc_root=proc_root,
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
    *,
    grace_s: float,
    filters: ReapFilter,
    dry_run: bool,
    all_users: bool | None,
    assume_not_holding: Collection[int],
    use_lease: bool,
    proc_root: Path,
    now: float | None,
    only: ReapReport | None,
    should_stop: Callable[[], bool] | None,
) -> ReapReport:
    report = scan(
        root,
        grace_s=grace_s,
        all_users=all_users,
        assume_not_holding=assume_not_holding,
        use_lease=use_lease,
        proc_root=proc_root,
        now=now,
        root_fd=dir_fd,
    )
    selected = select(report, filters)
    chosen, theirs = _split_by_owner(selected, None if all_users else os.geteuid())
    kept: list[ScanEntry] = []
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
                kept.append(_kept(e, Status.ORPHANED, _GONE))
            elif current.identity != e.identity:
                kept.append(_kept(current, Status.UNKNOWN, "the name now refers to another file"))
            else:
                kept.append(current)
    # What dead reapers left parked: settled first, whatever the filters (a live file must get
    # its name back at once); only the filters' engines are removed, the rest given back.
    parked = tuple(e for e in report.entries if e.parked is not None and not e.parked.reaper_running)
    empty = [p.name for p in report.parks if p.running is False and p.files == 0 and p.problem is None]
    restored: list[ScanEntry] = []
    if dry_run:
        removed: list[ScanEntry] = list(chosen)
    else:
        removed = []
        with lease.sigio_ignored():
            if parked or empty:
                settle_parked(
                    dir_fd,
                    parked,
                    empty=empty,
                    remove_engines=filters.matches_engine,
                    remove_others=bool(all_users),
                    use_lease=report.lease_enabled,
                    removed=removed,
                    kept=kept,
                    restored=restored,
                )
            groups: dict[str, list[ScanEntry]] = {}
            for e in chosen:
                groups.setdefault(e.engine_id, []).append(e)
            done, stay = remove_regions(
                dir_fd, groups.values(), proc_root, frozenset(assume_not_holding), should_stop
            )
        removed.extend(done)
        kept.extend(stay)
    return ReapReport(
        schema_version=SCHEMA_VERSION,
        root=report.root,
        dry_run=dry_run,
        removed=tuple(removed),
        kept=tuple(kept),
        freed_bytes=sum(e.resident_bytes for e in removed),
        summary=report.summary,
        unknown=select(report, filters, Status.UNKNOWN),
        visibility=report.visibility,
        lease_enabled=report.lease_enabled,
        filtered_out=_left_out(report, selected),
        unmatched_filters=filters.unmatched(report.entries),
        other_users_left=theirs,
        parked=parked if dry_run else (),
        restored=tuple(restored),
        conflicts=tuple(e for e in kept if e.status is Status.PARKED),
        lease_break_time_s=report.lease_break_time_s,
    )


def _split_by_owner(
    entries: Sequence[ScanEntry], euid: int | None
) -> tuple[tuple[ScanEntry, ...], tuple[ScanEntry, ...]]:
    """(the regions this reap may remove, the regions with a file of a uid other than ``euid``);
    with ``euid`` None (``all_users``), every region is removable."""
    # A region goes whole or not at all: one file of another user's keeps all of it.
    theirs = {e.engine_id for e in entries if euid is not None and e.uid != euid}
    return (
        tuple(e for e in entries if e.engine_id not in theirs),
        tuple(e for e in entries if e.engine_id in theirs),
    )


def _left_out(report: ScanReport, selected: Sequence[ScanEntry]) -> tuple[ScanEntry, ...]:
    chosen = {e.name for e in selected}
    return tuple(e for e in report.with_status(Status.ORPHANED) if e.name not in chosen)


def _kept(entry: ScanEntry, status: Status, reason: str) -> ScanEntry:
    return dataclasses.replace(entry, status=status, reason=reason)


def _errname(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, e.strerror or str(e))


def remove_regions(
    dir_fd: int,
    groups: Iterable[list[ScanEntry]],
    proc_root: Path,
    assume_not_holding: frozenset[int],
    should_stop: Callable[[], bool] | None = None,
) -> tuple[list[ScanEntry], list[ScanEntry]]:
    """Remove regions proven orphaned, each proven dead again first (the module docstring's
    protocol), in batches sized to the fds free now (``batch_files``); (removed, kept).

    For a caller that judged the root itself (``shmctl watch`` streams a root of 100,000
    files region by region rather than hold a whole ``ScanReport``): ``groups`` are whole
    regions with this pass's evidence (``lease`` decides whether each is re-proven under its
    write lease or by a fresh ``/proc`` pass), ``dir_fd`` the root they were judged in, and
    the caller must hold ``lease.sigio_ignored()``. Everything else should call ``reap``.
    """
    removed: list[ScanEntry] = []
    kept: list[ScanEntry] = []
    with park.ParkDir(dir_fd, proc_root=proc_root) as parking:
        batch: list[list[ScanEntry]] = []
        files = 0
        size = batch_files()
        for group in groups:
            if batch and files + len(group) > size:
                _reap_batch(parking, dir_fd, batch, proc_root, assume_not_holding, removed, kept, should_stop)
                batch, files, size = [], 0, batch_files()
            batch.append(group)  # a region larger than a batch is a batch of its own
            files += len(group)
        if batch:
            _reap_batch(parking, dir_fd, batch, proc_root, assume_not_holding, removed, kept, should_stop)
    return removed, kept


_Locked = list[tuple[ScanEntry, int]]  # entry, fd holding LOCK_EX


def _leased(locked: _Locked) -> bool:
    """Was every file of the region proven free by its lease in the scan?"""
    return all(e.lease is LeaseState.FREE for e, _ in locked)


def _reap_batch(
    parking: park.ParkDir,
    dir_fd: int,
    groups: list[list[ScanEntry]],
    proc_root: Path,
    assume_not_holding: frozenset[int],
    removed: list[ScanEntry],
    kept: list[ScanEntry],
    should_stop: Callable[[], bool] | None = None,
) -> None:
    """Prove each region dead once more, park its files, prove again, unlink (module docstring)."""
    with contextlib.ExitStack() as locks:
        locked_groups: list[_Locked] = []
        for group in groups:
            # Between regions is the one point to stop at: nothing of this one is locked yet,
            # and the ones already locked are finished below as usual.
            if should_stop is not None and should_stop():
                kept.extend(_kept(e, Status.ORPHANED, _STOPPED) for e in group)
                continue
            # Segments first, base last (step 5).
            members = sorted(group, key=lambda e: (e.segment == 0, e.segment))
            locked = _lock_group(dir_fd, members, locks, kept)
            if locked:
                locked_groups.append(locked)
        unleased = [g for g in locked_groups if not _leased(g)]
        index = None
        if unleased:
            # Step 4, without a lease: who holds these inodes right now? Our lock fds do not count.
            index = collect_holders(
                proc_root,
                inodes=[e.identity for g in unleased for e, _ in g],
                ignore_fds={os.getpid(): [fd for g in unleased for _, fd in g]},
                deleted=False,
                locks=False,  # we hold LOCK_EX on every one of these files
            )
        waiting: list[tuple[_Locked, bool]] = []
        for locked in locked_groups:
            leased = _leased(locked)
            if not leased:
                assert index is not None  # built above for every unleased region
                verdict = _still_dead(locked, index, assume_not_holding)
                if verdict is not None:
                    kept.extend(_kept(e, verdict[0], f"kept: {verdict[1]}") for e, _ in locked)
                    continue
            stay = _park_region(parking, dir_fd, locked, leased)
            if stay is not None:
                kept.extend(stay)
            else:
                waiting.append((locked, leased))
        if any(leased for _, leased in waiting):
            # Step 4e: an opener that resolved a name just before its rename gets time to show
            # in the file's open count before the last check; one wait per batch.
            time.sleep(PARK_SETTLE_S)
        for locked, leased in waiting:
            _finish_region(parking, locked, leased, removed, kept)


def _lock_group(
    dir_fd: int, members: list[ScanEntry], batch_locks: contextlib.ExitStack, kept: list[ScanEntry]
) -> _Locked:
    """Open and LOCK_EX every file of a region (steps 1-3); on any failure keep the whole region."""
    locked: _Locked = []
    gone: list[ScanEntry] = []
    opened: list[int] = []
    try:
        for e in members:
            try:
                fd = open_probe_fd(dir_fd, e.name)
            except FileNotFoundError:
                gone.append(_kept(e, Status.ORPHANED, _GONE))
                continue
            except OSError as err:
                if err.errno == errno.ELOOP:
                    why = "replaced by a symlink"
                elif err.errno in (errno.EMFILE, errno.ENFILE):
                    why = (
                        f"cannot open ({_errname(err)}): its region needs {len(members)} fds; raise ulimit -n"
                    )
                else:
                    why = f"cannot open ({_errname(err)})"
                return _keep_region(members, gone, kept, Status.UNKNOWN, f"{e.name} {why}")
            opened.append(fd)
            st = os.fstat(fd)
            if st.st_ino != e.ino or st.st_dev != e.dev:
                return _keep_region(
                    members, gone, kept, Status.UNKNOWN, f"{e.name} now refers to another file"
                )
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return _keep_region(members, gone, kept, Status.LIVE, f"{e.name}: lock held")
            locked.append((e, fd))
        # Closing releases the lock and any lease: the batch does it once it is done.
        batch_locks.callback(_close_all, opened)
        opened = []
    finally:
        _close_all(opened)  # a region kept early: nothing of it stays open
    kept.extend(gone)
    return locked


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _keep_region(
    members: list[ScanEntry], gone: list[ScanEntry], kept: list[ScanEntry], status: Status, reason: str
) -> _Locked:
    done = {e.name for e in gone}
    kept.extend(gone)
    kept.extend(_kept(e, status, f"kept: {reason}") for e in members if e.name not in done)
    return []


def _still_dead(
    locked: _Locked, index: HolderIndex, assume_not_holding: frozenset[int]
) -> tuple[Status, str] | None:
    """None if nobody holds any file of the region now; else the verdict that keeps it."""
    for e, _ in locked:
        holders = index.holders_of(*e.identity)
        if holders:
            shown = ", ".join(f"{h.pid}:{h.name}" for h in holders[:3])
            return Status.LIVE, f"held since the scan by {len(holders)} process(es): {shown}"
    blind = index.blind_spots(assume_not_holding)
    if blind:
        return Status.UNKNOWN, f"cannot inspect {blind[0].describe()}; liveness unproven"
    return None


def _lease_refusal(answer: lease.LeaseProbe) -> str:
    if answer.held:
        return "opened since the scan (write lease refused)"
    return f"no write lease now ({answer.error})"


def _name_changed(dir_fd: int, e: ScanEntry) -> ScanEntry | None:
    try:
        st = os.stat(e.name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return _kept(e, Status.ORPHANED, _GONE)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or (st.st_dev, st.st_ino) != e.identity:
        return _kept(e, Status.UNKNOWN, "kept: the name changed just before removal")
    return None


def _park_region(parking: park.ParkDir, dir_fd: int, locked: _Locked, leased: bool) -> list[ScanEntry] | None:
    """Park every file of a region (None), or none: the region's entries as kept, names given back."""
    done: list[ScanEntry] = []
    for i, (e, fd) in enumerate(locked):
        outcome = _park(parking, dir_fd, e, fd, leased)
        if outcome is None:
            done.append(e)
            continue
        # A region goes whole or not at all: what was parked goes back, the rest stays put.
        stay = [outcome]
        stay.extend(_restore(parking, p, _REGION_KEPT, _follow(outcome.status)) for p in done)
        stay.extend(_kept(rest, _follow(outcome.status), _REGION_KEPT) for rest, _ in locked[i + 1 :])
        return stay
    return None


def _follow(status: Status) -> Status:
    # A file kept because its region lost a member: what the kept member is, unless that
    # member now waits parked (a conflict), which the others are not.
    return Status.LIVE if status is Status.PARKED else status


def _park(parking: park.ParkDir, dir_fd: int, e: ScanEntry, fd: int, leased: bool) -> ScanEntry | None:
    """Steps 4a-d for one file: under its own lease when there is one, move it to the park
    directory and prove the move took the proven inode. None when it is parked."""
    fsuid = os.geteuid()
    if leased:
        answer = lease.take(fd, e.uid, fsuid)
        if not answer.free:
            status = Status.LIVE if answer.held else Status.UNKNOWN
            return _kept(e, status, f"kept: {_lease_refusal(answer)}")
    try:
        problem = _name_changed(dir_fd, e)
        if problem is not None:
            return problem
        if leased and lease.contested(fd, e.uid, fsuid):
            return _kept(e, Status.LIVE, _RACED)
        try:
            outcome = parking.park(e.name, e.identity)
        except OSError as err:
            return _kept(
                e, Status.ORPHANED, f"kept: cannot move it to a private directory first ({_errname(err)})"
            )
        if outcome.moved is park.Moved.GONE:
            return _kept(e, Status.ORPHANED, _GONE)
        if outcome.moved is not park.Moved.PARKED:
            return _someone_elses(parking, e, fd, outcome)
        if leased and lease.contested(fd, e.uid, fsuid):
            return _restore(parking, e)
        return None
    finally:
        if leased:
            lease.release(fd)


def _someone_elses(parking: park.ParkDir, e: ScanEntry, fd: int, outcome: park.ParkOutcome) -> ScanEntry:
    """The rename took another file than the one proven dead (its name was re-created)."""
    other = outcome.other[1] if outcome.other is not None else "?"
    ours = (
        "the file proven dead was removed by someone else first"
        if os.fstat(fd).st_nlink == 0
        else "the file proven dead no longer has this name"
    )
    if outcome.moved is park.Moved.RETURNED:
        why = f"kept: the name was re-created during removal (inode {other}, given back untouched); {ours}"
        return _kept(e, Status.UNKNOWN, why)
    why = (
        f"conflict: the name was re-created during removal (inode {other}) and taken again before "
        f"that file could be given back ({outcome.error}); it waits in {parking.name}, "
        f"nothing removed; {ours}"
    )
    return _parked_entry(parking, e, why)


def _parked_entry(parking: park.ParkDir, e: ScanEntry, why: str) -> ScanEntry:
    where = e.path.parent / (parking.name or "") / e.name
    return dataclasses.replace(e, status=Status.PARKED, reason=why, path=where)


def _finish_region(
    parking: park.ParkDir, locked: _Locked, leased: bool, removed: list[ScanEntry], kept: list[ScanEntry]
) -> None:
    """Step 4e for one region's parked files: all go, or (an opener on any) all get their names back."""
    fsuid = os.geteuid()
    # All or nothing: every file is checked before any goes. A one-file region skips this
    # round; ``_finish`` makes the same check, under the same lease, right before the unlink.
    if leased and len(locked) > 1 and any(_contested_now(fd, e.uid, fsuid) for e, fd in locked):
        kept.extend(_restore(parking, e) for e, _ in locked)
        return
    for e, fd in locked:
        outcome = _finish(parking, e, fd, leased)
        if outcome is None:
            removed.append(e)
        else:
            kept.append(outcome)


def _contested_now(fd: int, st_uid: int, fsuid: int) -> bool:
    answer = lease.take(fd, st_uid, fsuid)
    if not answer.free:
        return True
    try:
        return lease.contested(fd, st_uid, fsuid)
    finally:
        lease.release(fd)


def _finish(parking: park.ParkDir, e: ScanEntry, fd: int, leased: bool) -> ScanEntry | None:
    """The last check of one parked file (under its lease again, where it has one), the unlink
    in the park directory, and the proof that the inode has no name left.

    Nobody can open a name in the park directory but its owner; only an opener that resolved
    the region name before the rename can be on the inode, and it shows in the open count now.
    """
    fsuid = os.geteuid()
    if leased and not lease.take(fd, e.uid, fsuid).free:
        return _restore(parking, e)
    try:
        if leased and lease.contested(fd, e.uid, fsuid):
            return _restore(parking, e)
        try:
            problem = parking.unlink(e.name, e.identity, fd)
        except OSError as err:
            return _restore(parking, e, f"kept: unlink failed ({_errname(err)})", Status.ORPHANED)
        if problem is not None:
            return _kept(e, Status.UNKNOWN, f"kept: {problem}")
        return None
    finally:
        if leased:
            lease.release(fd)


def _restore(
    parking: park.ParkDir, e: ScanEntry, why: str = _RACED, status: Status = Status.LIVE
) -> ScanEntry:
    """Give a parked file its name back, intact; a name taken meanwhile is a conflict."""
    try:
        parking.restore(e.name)
    except OSError as err:
        return _parked_entry(
            parking,
            e,
            f"conflict: {why.removeprefix('kept: ')}, and its name could not be given back "
            f"({_errname(err)}: another file took it meanwhile); it waits in {parking.name}, nothing removed",
        )
    return _kept(e, status, why)


def settle_parked(
    dir_fd: int,
    parked: Sequence[ScanEntry],
    *,
    empty: Sequence[str] = (),
    remove_engines: Callable[[str], bool],
    remove_others: bool,
    use_lease: bool,
    removed: list[ScanEntry],
    kept: list[ScanEntry],
    restored: list[ScanEntry],
) -> None:
    """Settle what dead reapers left parked: proven dead goes, anything else gets its name back.

    Each park directory is adopted first (its lock, taken by us: another reap or agent that
    comes now sees it held and leaves it alone). Per region: every file ``remove`` by the
    scan's evidence (and chosen by the operator's filters) is proven dead once more under its
    lease and unlinked; any other file, or a file whose proof fails now, is renamed back to its
    name, and a name taken meanwhile is a conflict (both kept). Removing needs a lease: without
    one, a dead parked file goes back to its name, where an ordinary reap judges it; so does a
    region with a file of another uid unless ``remove_others`` (``--all-users``).
    ``empty`` names dead reapers' park directories with nothing left in them: removed.
    """
    by_dir: dict[str, list[ScanEntry]] = {name: [] for name in empty}
    for e in parked:
        assert e.parked is not None
        by_dir.setdefault(e.parked.directory, []).append(e)
    euid = os.geteuid()
    for name, entries in by_dir.items():
        found = park.inspect_park(dir_fd, name)
        if found is None or found.running is not False or (euid not in (0, found.uid)):
            continue
        park_fd = park.adopt(dir_fd, found)
        if park_fd is None:
            continue  # someone else adopted it just now
        try:
            for engine_id, files in _by_engine(entries).items():
                remove = (
                    use_lease
                    and remove_engines(engine_id)
                    and all(f.parked is not None and f.parked.action == "remove" for f in files)
                )
                foreign = sorted({f.uid for f in files if f.uid != euid})
                held = None
                if remove and foreign and not remove_others:
                    remove = False
                    held = f"{uids_text(foreign)}: another user's region is removed only with --all-users"
                for e in files:
                    _settle_parked(dir_fd, park_fd, name, e, remove, removed, kept, restored, held)
            with contextlib.suppress(OSError):
                park.remove_if_empty(dir_fd, name, park_fd)
        finally:
            os.close(park_fd)


def _by_engine(entries: Iterable[ScanEntry]) -> dict[str, list[ScanEntry]]:
    groups: dict[str, list[ScanEntry]] = {}
    for e in entries:
        groups.setdefault(e.engine_id, []).append(e)
    return groups


def _settle_parked(
    dir_fd: int,
    park_fd: int,
    park_name: str,
    e: ScanEntry,
    remove: bool,
    removed: list[ScanEntry],
    kept: list[ScanEntry],
    restored: list[ScanEntry],
    held: str | None = None,
) -> None:
    why = "a dead reap left it parked; "
    if held is not None:
        why += f"not removed ({held}); "
    if remove:
        problem = _remove_parked(park_fd, e)
        if problem is None:
            removed.append(_kept(e, Status.ORPHANED, f"{why}proven dead again and removed"))
            return
        why += f"not removed ({problem}); "
    try:
        park.renameat2(park_fd, e.name, dir_fd, e.name)
    except FileNotFoundError:
        kept.append(_kept(e, Status.ORPHANED, _GONE))
        return
    except OSError as err:
        taken = "another file took its name" if err.errno == errno.EEXIST else _errname(err)
        kept.append(
            _kept(
                e,
                Status.PARKED,
                f"conflict: {why}it could not be given back ({taken}); "
                f"it waits in {park_name}, nothing removed",
            )
        )
        return
    restored.append(_kept(e, e.parked.verdict if e.parked else Status.UNKNOWN, f"{why}given back its name"))


def _remove_parked(park_fd: int, e: ScanEntry) -> str | None:
    """Prove a parked file dead under its lease and unlink it; None when done, else why not."""
    try:
        fd = open_probe_fd(park_fd, e.name)
    except OSError as err:
        return f"cannot open it ({_errname(err)})"
    try:
        if os.fstat(fd).st_ino != e.ino:
            return "another file has its name in the park directory"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return "its lock is held"
        fsuid = os.geteuid()
        answer = lease.take(fd, e.uid, fsuid)
        if not answer.free:
            return _lease_refusal(answer)
        try:
            if lease.contested(fd, e.uid, fsuid):
                return "opened as we looked"
            return park.unlink_proven(park_fd, e.name, e.identity, fd)
        finally:
            lease.release(fd)
    finally:
        os.close(fd)


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
