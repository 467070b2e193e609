"""Remove orphaned region files, and nothing else, even if the directory changes under us.

Only entries a fresh scan calls ``orphaned`` are candidates, narrowed by the operator's
filters (engine, dead owner pid, age). A scan is a snapshot, so before each region is
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
   d. the name is renamed (``RENAME_NOREPLACE``) to a private, unguessable name of the
      region pattern, and the lease checked again; the lease is released. An opener that
      resolved the name a moment before is in the kernel on our inode: ``F_GETLEASE`` shows
      a break only once it reaches ``break_lease``, but taking the held lease again fails as
      soon as it counts itself among the inode's opens (a fanotify permission check can hold
      it in between), so both are asked;
   e. after all files of the batch are parked and a short wait (``PARK_SETTLE_S``), each is
      leased and checked once more, then its private name is unlinked. Any sign of an opener
      at c, d or e keeps the file and gives its name back (the opener gets the file it asked
      for, intact: "raced with an opener"). A reaper that dies meanwhile leaves one file under
      a region-pattern name, which a later reap judges like any other. What no check can see
      is an opener that resolved the name before the rename and is then kept off the CPU,
      before it counts itself among the inode's opens, for longer than that wait: Linux has
      no unlink-by-inode, and such an opener gets the removed file.

   Where no lease could be taken, a fresh ``/proc`` pass restricted to the locked inodes
   (one per batch of regions, see ``batch_files``) must show no holder and no
   uninspected process, and the name is re-``lstat``ed and unlinked;
5. segments first and the base last, so a new creator can only win ``O_EXCL`` on the base
   once the whole old region is gone;
6. locks released by closing the fds.

Nothing here follows a link, creates, truncates or chmods anything, or touches a name
outside the region pattern. An item that fails any check is kept, with the reason; a
failure to unlink one item is reported, never raised.
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
from kvoffload.liveness import lease
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
)
from kvoffload.shm import mounts, names

_GONE = "gone before removal (removed by someone else)"
_RACED = "kept: raced with an opener (it opened the file during removal)"
_REGION_KEPT = "kept: another file of its region was kept (a region goes whole or not at all)"
_STOPPED = "kept: the reap was stopped before this region (the process is shutting down)"
#: Regions re-proven together where no lease can be taken: one /proc pass (~10 ms on a quiet
#: host) re-checks a batch of at least this many files. Each file stays LOCK_EX'ed from before
#: that pass until after its unlink, so a kvoffload participant can never slip in.
RECHECK_BATCH_FILES = 128
#: The most files one batch holds open at once, however many fds the process may have.
MAX_BATCH_FILES = 1024


def batch_files() -> int:
    """Files per batch: a quarter of the soft fd limit, between 128 and 1024.

    Every file of a batch stays open (LOCK_EX) until the batch is done, and each batch costs
    one settle wait (and, without a lease, one ``/proc`` pass): bigger batches are faster,
    but a batch must never run the process out of fds (an open that fails keeps the region).
    """
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return RECHECK_BATCH_FILES
    if soft == resource.RLIM_INFINITY:
        return MAX_BATCH_FILES
    return max(RECHECK_BATCH_FILES, min(MAX_BATCH_FILES, soft // 4))


#: How long parked files (renamed to a private name, lease released) wait before their last
#: check: an opener that resolved the region name just before the rename needs only to be
#: scheduled to enter the file's open count. One wait per batch, not per file.
PARK_SETTLE_S = 0.002
#: ``RENAME_NOREPLACE`` (linux/fs.h): never replace what another process created meanwhile.
_RENAME_NOREPLACE = 1


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
    all_users: bool = False,
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

    ``only`` is an earlier dry-run report (what the operator confirmed): nothing outside it
    is removed, and anything in it that is no longer orphaned, or is another inode now,
    is kept with the new verdict.

    ``should_stop`` is asked before each region is locked (a long-running caller's SIGTERM):
    once it answers True, the regions not yet begun are kept, still ``orphaned``, with the
    reason. A region already locked is finished, so nothing is ever left half-removed or
    parked under a private name.

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
    all_users: bool,
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
    chosen = selected = select(report, filters)
    kept: list[ScanEntry] = []
    if only is not None:
        confirmed = {(e.name, e.identity) for e in only.removed}
        chosen = tuple(e for e in chosen if (e.name, e.identity) in confirmed)
        now_chosen = {(e.name, e.identity) for e in chosen}
        fresh = {e.name: e for e in report.entries}
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
    if dry_run:
        removed: list[ScanEntry] = list(chosen)
    else:
        groups: dict[str, list[ScanEntry]] = {}
        for e in chosen:
            groups.setdefault(e.engine_id, []).append(e)
        with lease.sigio_ignored():
            removed, stay = _reap(
                dir_fd, groups.values(), proc_root, frozenset(assume_not_holding), should_stop
            )
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
    )


def _left_out(report: ScanReport, selected: Sequence[ScanEntry]) -> tuple[ScanEntry, ...]:
    chosen = {e.name for e in selected}
    return tuple(e for e in report.with_status(Status.ORPHANED) if e.name not in chosen)


def _kept(entry: ScanEntry, status: Status, reason: str) -> ScanEntry:
    return dataclasses.replace(entry, status=status, reason=reason)


def _errname(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, e.strerror or str(e))


def _reap(
    dir_fd: int,
    groups: Iterable[list[ScanEntry]],
    proc_root: Path,
    assume_not_holding: frozenset[int],
    should_stop: Callable[[], bool] | None = None,
) -> tuple[list[ScanEntry], list[ScanEntry]]:
    """Reap region by region; regions without a lease are re-checked once per batch."""
    removed: list[ScanEntry] = []
    kept: list[ScanEntry] = []
    batch: list[list[ScanEntry]] = []
    files = 0
    size = batch_files()
    for group in groups:
        batch.append(group)
        files += len(group)
        if files >= size:
            _reap_batch(dir_fd, batch, proc_root, assume_not_holding, removed, kept, should_stop)
            batch = []
            files = 0
    if batch:
        _reap_batch(dir_fd, batch, proc_root, assume_not_holding, removed, kept, should_stop)
    return removed, kept


_Locked = list[tuple[ScanEntry, int]]  # entry, fd holding LOCK_EX


def _leased(locked: _Locked) -> bool:
    """Was every file of the region proven free by its lease in the scan?"""
    return all(e.lease is LeaseState.FREE for e, _ in locked)


def _reap_batch(
    dir_fd: int,
    groups: list[list[ScanEntry]],
    proc_root: Path,
    assume_not_holding: frozenset[int],
    removed: list[ScanEntry],
    kept: list[ScanEntry],
    should_stop: Callable[[], bool] | None = None,
) -> None:
    """Prove each region dead once more and unlink its files (module docstring, steps 1-6)."""
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
        parking: dict[str, list[_Parked]] = {}
        # Regions with a file kept while parking, and that file's status: none of them goes.
        spoiled: dict[str, Status] = {}
        for locked in locked_groups:
            leased = _leased(locked)
            verdict = None
            if not leased:
                assert index is not None  # built above for every unleased region
                verdict = _still_dead(locked, index, assume_not_holding)
            if verdict is not None:
                kept.extend(_kept(e, verdict[0], f"kept: {verdict[1]}") for e, _ in locked)
                continue
            for e, fd in locked:
                if e.engine_id in spoiled:
                    kept.append(_kept(e, spoiled[e.engine_id], _REGION_KEPT))
                    continue
                if not leased:
                    outcome = _unlink(dir_fd, e)
                else:
                    parked = _park(dir_fd, e, fd)
                    if isinstance(parked, str):
                        parking.setdefault(e.engine_id, []).append((e, fd, parked))
                        continue
                    if parked is not None:
                        spoiled[e.engine_id] = parked.status
                    outcome = parked
                if outcome is None:
                    removed.append(e)
                else:
                    kept.append(outcome)
        if parking:
            # Step 4e: an opener that resolved a name just before its rename gets time to show
            # in the file's open count before the last check; one wait per batch.
            time.sleep(PARK_SETTLE_S)
            for engine_id, files in parking.items():
                _finish_region(dir_fd, files, spoiled.get(engine_id), removed, kept)


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
                why = (
                    "replaced by a symlink" if err.errno == errno.ELOOP else f"cannot open ({_errname(err)})"
                )
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


def _unlink(dir_fd: int, e: ScanEntry) -> ScanEntry | None:
    """Unlink one locked file if its name still names it; else the entry as kept."""
    problem = _name_changed(dir_fd, e)
    if problem is not None:
        return problem
    try:
        os.unlink(e.name, dir_fd=dir_fd)
    except FileNotFoundError:
        return _kept(e, Status.ORPHANED, _GONE)
    except OSError as err:
        return _kept(e, Status.ORPHANED, f"kept: unlink failed ({_errname(err)})")
    return None


def _name_changed(dir_fd: int, e: ScanEntry) -> ScanEntry | None:
    try:
        st = os.stat(e.name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return _kept(e, Status.ORPHANED, _GONE)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or (st.st_dev, st.st_ino) != e.identity:
        return _kept(e, Status.UNKNOWN, "kept: the name changed just before removal")
    return None


def _park(dir_fd: int, e: ScanEntry, fd: int) -> ScanEntry | str | None:
    """Step 4a-d for one file, under its own write lease held for this file only.

    Returns the private name the file now has (to be finished by ``_finish``), the entry as
    kept, or None when it was unlinked outright (no ``renameat2`` here).
    """
    fsuid = os.geteuid()
    answer = lease.take(fd, e.uid, fsuid)
    if not answer.free:
        return _kept(e, Status.LIVE if answer.held else Status.UNKNOWN, f"kept: {_lease_refusal(answer)}")
    try:
        problem = _name_changed(dir_fd, e)
        if problem is not None:
            return problem
        if lease.contested(fd, e.uid, fsuid):
            return _kept(e, Status.LIVE, _RACED)
        private = _private_name(e)
        try:
            _rename_noreplace(dir_fd, e.name, private)
        except OSError as err:
            if err.errno not in (errno.ENOSYS, errno.EINVAL):
                return _kept(e, Status.ORPHANED, f"kept: rename before unlink failed ({_errname(err)})")
            return _unlink(dir_fd, e)  # no renameat2 here: the lease checks above still hold
        if lease.contested(fd, e.uid, fsuid):
            return _restore(dir_fd, e, private)
        return private
    finally:
        lease.release(fd)


_Parked = tuple[ScanEntry, int, str]  # entry, its locked fd, its private name


def _finish_region(
    dir_fd: int,
    files: list[_Parked],
    spoiled: Status | None,
    removed: list[ScanEntry],
    kept: list[ScanEntry],
) -> None:
    """Step 4e for one region's parked files: all go, or (an opener on any) all get their names back.

    ``spoiled`` is the status of a file of the region that was kept while parking, if any.
    """
    fsuid = os.geteuid()
    if spoiled is not None:
        kept.extend(_restore(dir_fd, e, private, _REGION_KEPT, spoiled) for e, _, private in files)
        return
    # All or nothing: every file is checked before any goes. A one-file region skips this
    # round; ``_finish`` makes the same check, under the same lease, right before the unlink.
    if len(files) > 1 and any(_contested_now(fd, e.uid, fsuid) for e, fd, _ in files):
        kept.extend(_restore(dir_fd, e, private) for e, _, private in files)
        return
    for e, fd, private in files:
        outcome = _finish(dir_fd, e, fd, private)
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


def _finish(dir_fd: int, e: ScanEntry, fd: int, private: str) -> ScanEntry | None:
    """The last check of one parked file, under its lease again, then the unlink.

    Nobody can open the private name (unguessable); only an opener that resolved the region
    name before the rename can be on the inode, and it shows in the open count by now.
    """
    fsuid = os.geteuid()
    if not lease.take(fd, e.uid, fsuid).free:
        return _restore(dir_fd, e, private)
    try:
        if lease.contested(fd, e.uid, fsuid):
            return _restore(dir_fd, e, private)
        try:
            os.unlink(private, dir_fd=dir_fd)
        except OSError as err:
            return _kept(e, Status.ORPHANED, f"kept as {private}: unlink failed ({_errname(err)})")
        return None
    finally:
        lease.release(fd)


def _restore(
    dir_fd: int, e: ScanEntry, private: str, why: str = _RACED, status: Status = Status.LIVE
) -> ScanEntry:
    """An opener is on this inode (or its region was kept): give the name back, file intact."""
    try:
        _rename_noreplace(dir_fd, private, e.name)
    except OSError as err:
        return _kept(
            e,
            Status.LIVE,
            f"kept as {private}: raced with an opener, and the name could not be restored ({_errname(err)})",
        )
    return _kept(e, status, why)


def _private_name(e: ScanEntry) -> str:
    # Of the region pattern, so a reaper that dies between rename and unlink leaves a file
    # the next reap judges like any other; unguessable, so nobody can plant it.
    return names.format_name(f".shmctl-reap-{os.urandom(16).hex()}", 0, _check=False)


_libc_renameat2: Callable[[int, bytes, int, bytes, int], int] | None = None


def _rename_noreplace(dir_fd: int, old: str, new: str) -> None:
    """``renameat2(dir_fd, old, dir_fd, new, RENAME_NOREPLACE)``: fails rather than replace."""
    global _libc_renameat2
    if _libc_renameat2 is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        function = getattr(libc, "renameat2", None)
        if function is None:
            raise OSError(errno.ENOSYS, "renameat2 is not in this libc")
        function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
        function.restype = ctypes.c_int
        _libc_renameat2 = function
    encode = os.fsencode
    if _libc_renameat2(dir_fd, encode(old), dir_fd, encode(new), _RENAME_NOREPLACE) != 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), old)


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
