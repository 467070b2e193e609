"""The removal protocol: regions a scan judged orphaned, proven dead again, parked, proven, unlinked.

``reap`` and ``shmctl watch --reap`` hand whole regions here (``remove_regions``), judged
moments ago; a scan is a snapshot, so each region is proven dead again first (anchors D5),
with every file of the group:

1. the reaper's park directory (``park.ParkDir``: 0700, locked, marked) is made **before the
   first file is opened**, so that nothing slow happens while a file's lease is held or its
   name is away;
2. every file is opened through the root's directory fd, ``O_RDONLY|O_NOFOLLOW|O_NONBLOCK``
   (a link planted since the scan fails to open; a fifo cannot block us), ``fstat`` must
   equal the scanned ``(st_dev, st_ino)`` (a name reused by a new engine is another inode:
   vLLM #57422) and ``flock(LOCK_EX|LOCK_NB)`` must be granted (refused: a kvoffload
   participant holds it; granted, it makes a kvoffload joiner that arrives now wait);
3. proof that nobody holds it now. Where the scan had the write lease, each file is removed
   under its own lease, taken on the fd of step 2 and held for that one file's check and
   move: ``F_SETLEASE F_WRLCK`` must be granted; the name is ``lstat``ed again (a regular
   file, one link, the same inode); no opener may have arrived (``lease.contested``); the
   file is moved into the park directory under its own name and the move proven by
   ``fstatat`` (anything else at the name goes straight back, ``RENAME_NOREPLACE``); the
   opener check again; the lease released. Where no lease could be taken, a fresh ``/proc``
   pass over the batch's inodes must show no holder and no uninspected process;
4. after a short wait per batch (``PARK_SETTLE_S``), each parked file is leased and checked
   once more, its parked name proven to be the inode, unlinked inside the park directory
   (no other user can put a file there), and its link count proven 0. An opener seen at
   any check gives every parked file of the region its name back ("raced with an opener");
5. segments first and the base last, so a new creator can only win ``O_EXCL`` on the base
   once the whole old region is gone; locks go with the fds.

**A root out of inodes.** ``mkdir`` of the park directory fails with ``ENOSPC`` when the
root's tmpfs has no inode left, and a full ``/dev/shm`` is what this tool exists for. Then
the first region is removed **in place**, under the same proofs, where no uid but the
reaper's own and root's can rename or unlink its names (``others_can_rename``: a root owned
by the reaper's uid or root, not writable by group or others, or sticky with the region's
files the reaper's or root's): every file's lease is held at once, each name is checked,
no opener may have arrived, then the files are unlinked and each link count proven 0. Each
unlink frees an inode; the park directory is tried again before the next region. What this
path gives up is the give-back: an opener that resolved a name before its unlink, and counts
itself among the inode's opens only after the last check (microseconds), gets the removed
file, as before the park directory existed. Where others can rename, nothing is removed and
the run says why (``Outcome.failed``).

Nothing here follows a link, truncates or chmods anything, creates anything but the park
directory and its mark, or touches a name outside the region pattern. A file that fails a
check is kept with the reason; a failure of the reaper's own (an errno) is kept *and* listed
as ``failed``, so that a run which removed nothing it should have can say so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.liveness import lease, park
from kvoffload.liveness.holders import HolderIndex, collect_holders
from kvoffload.liveness.lease import LeaseState
from kvoffload.liveness.park.directory import errname
from kvoffload.liveness.probe import open_probe_fd
from kvoffload.liveness.report import ScanEntry
from kvoffload.liveness.scan import Status

GONE = "gone before removal (removed by someone else)"
RACED = "kept: raced with an opener (it opened the file during removal)"
_REGION_KEPT = "kept: another file of its region was kept (a region goes whole or not at all)"
STOPPED = "kept: the reap was stopped before this region (the process is shutting down)"
#: The most files one batch holds open at once, however many fds the process may have.
MAX_BATCH_FILES = 1024
#: Fds kept free beside a batch: the root, the park directory, a /proc walk's two, the prober's
#: pipe, and a little room for what the caller holds (an agent's listener).
FD_RESERVE = 8
#: How long parked files (moved to the park directory, lease released) wait before their last
#: check: an opener that resolved the region name just before the rename needs only to be
#: scheduled to enter the file's open count. One wait per batch, not per file.
PARK_SETTLE_S = 0.002
#: Errors of ``mkdir`` that mean the root has no room for one more inode.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


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


@dataclass(slots=True)
class Outcome:
    """What a removal did, file by file; one per run, filled as it goes."""

    removed: list[ScanEntry] = field(default_factory=list)
    kept: list[ScanEntry] = field(default_factory=list)
    #: Kept because the reaper itself failed (an errno: no room for its park directory, a file
    #: it could not open or unlink), not because the file changed: also in ``kept``.
    failed: list[ScanEntry] = field(default_factory=list)
    #: Parked files (a dead reaper's) given back their names.
    restored: list[ScanEntry] = field(default_factory=list)
    #: Park directories a dead or killed reaper left, removed by this run.
    parks_removed: list[str] = field(default_factory=list)

    def keep(self, e: ScanEntry, status: Status, reason: str) -> None:
        self.kept.append(kept(e, status, reason))

    def fail(self, e: ScanEntry, reason: str, status: Status = Status.ORPHANED) -> None:
        entry = kept(e, status, reason)
        self.kept.append(entry)
        self.failed.append(entry)


def kept(entry: ScanEntry, status: Status, reason: str) -> ScanEntry:
    return dataclasses.replace(entry, status=status, reason=reason)


def others_can_rename(root: os.stat_result, file_uids: Iterable[int], euid: int) -> bool:
    """Could a process of a uid other than ``euid`` and root rename or unlink, in the directory
    ``root``, the names of files owned by ``file_uids``?

    Renaming or unlinking an entry takes write permission on its directory and, in a sticky
    one, owning the entry or the directory (or CAP_FOWNER). An ACL that grants another user
    write access shows in the group bits (they are the ACL's mask), so the mode tells.
    """
    ours = {euid, 0}
    if root.st_uid not in ours:
        return True  # the root's owner can
    if not root.st_mode & 0o022:
        return False
    if root.st_mode & stat.S_ISVTX:
        return any(uid not in ours for uid in file_uids)
    return True


def remove_regions(
    dir_fd: int,
    groups: Iterable[list[ScanEntry]],
    proc_root: Path,
    assume_not_holding: frozenset[int],
    should_stop: Callable[[], bool] | None = None,
    *,
    parking: park.ParkDir | None = None,
    outcome: Outcome | None = None,
) -> Outcome:
    """Remove regions proven orphaned, each proven dead again first (the module's protocol), in
    batches sized to the fds free now (``batch_files``).

    ``groups`` are whole regions with a scan's evidence (``lease`` decides whether each is
    re-proven under its write lease or by a fresh ``/proc`` pass), ``dir_fd`` the root they
    were judged in; the caller holds ``lease.sigio_ignored()``. ``parking`` is the caller's
    park directory (one per run: ``reap`` settles dead parks into it first); without one, one
    is made here and removed when done. ``should_stop`` is asked before each region is locked.
    """
    done = outcome if outcome is not None else Outcome()
    with contextlib.ExitStack() as stack:
        if parking is None:
            parking = stack.enter_context(park.ParkDir(dir_fd, proc_root=proc_root))
        removal = _Removal(dir_fd, parking, proc_root, assume_not_holding, should_stop, done)
        batch: list[list[ScanEntry]] = []
        files = 0
        size = batch_files()
        for group in groups:
            if batch and files + len(group) > size:
                removal.batch(batch)
                batch, files, size = [], 0, batch_files()
            if not batch:
                removal.prepare()  # the park directory, before the batch's first open
            batch.append(group)  # a region larger than a batch is a batch of its own
            files += len(group)
        if batch:
            removal.batch(batch)
    return done


_Locked = list[tuple[ScanEntry, int]]  # entry, fd holding LOCK_EX


def _leased(locked: _Locked) -> bool:
    """Was every file of the region proven free by its lease in the scan?"""
    return all(e.lease is LeaseState.FREE for e, _ in locked)


class _Removal:
    """One run's removal in one root: its park directory, and what became of each file."""

    def __init__(
        self,
        dir_fd: int,
        parking: park.ParkDir,
        proc_root: Path,
        assume_not_holding: frozenset[int],
        should_stop: Callable[[], bool] | None,
        outcome: Outcome,
    ) -> None:
        self.dir_fd = dir_fd
        self.parking = parking
        self.proc_root = proc_root
        self.assume = assume_not_holding
        self.should_stop = should_stop
        self.out = outcome
        self.fsuid = os.geteuid()
        #: Why the park directory cannot be made now (None once it is, or before it is tried).
        self.no_park: OSError | None = None
        #: The fds each locked region holds (by the id of its ``_Locked``), for this batch.
        self._fds: dict[int, list[int]] = {}

    def prepare(self) -> None:
        """Make the park directory if it is not made yet; remember why not."""
        if self.parking.opened:
            return
        try:
            self.parking.open()
        except OSError as e:
            self.no_park = e
        else:
            self.no_park = None

    def batch(self, groups: list[list[ScanEntry]]) -> None:
        """Prove each region dead once more, park its files, prove again, unlink."""
        with contextlib.ExitStack() as locks:
            # Every region's fds, closed once the batch is done (one callback for the batch).
            opened: list[list[int]] = []
            locks.callback(_close_lists, opened)
            locked_groups: list[_Locked] = []
            for group in groups:
                # Between regions is the one point to stop at: nothing of this one is locked yet,
                # and the ones already locked are finished below as usual.
                if self.should_stop is not None and self.should_stop():
                    for e in group:
                        self.out.keep(e, Status.ORPHANED, STOPPED)
                    continue
                members = sorted(group, key=lambda e: (e.segment == 0, e.segment))  # base last
                locked = self._lock_group(members, opened)
                if locked:
                    locked_groups.append(locked)
            leased_groups = [(g, _leased(g)) for g in locked_groups]
            unleased = [g for g, leased in leased_groups if not leased]
            index = None
            if unleased:
                # Without a lease: who holds these inodes right now? Our lock fds do not count.
                index = collect_holders(
                    self.proc_root,
                    inodes=[e.identity for g in unleased for e, _ in g],
                    ignore_fds={os.getpid(): [fd for g in unleased for _, fd in g]},
                    deleted=False,
                    locks=False,  # we hold LOCK_EX on every one of these files
                )
            waiting: list[tuple[_Locked, bool]] = []
            # One lease after another, each held for one file's check and move: Ctrl-Z is
            # deferred from one to the next (a few ms at most), not blocked and let go per file.
            with lease.batched():
                for locked, leased in leased_groups:
                    if not leased:
                        assert index is not None  # built above for every unleased region
                        verdict = self._still_dead(locked, index)
                        if verdict is not None:
                            for e, _ in locked:
                                self.out.keep(e, verdict[0], f"kept: {verdict[1]}")
                            continue
                    if not self.parking.opened:
                        self.prepare()  # an inode freed by the region before this one
                    if not self.parking.opened:
                        self._without_park(locked, leased)
                        continue
                    if self._park_region(locked, leased):
                        waiting.append((locked, leased))
            self._fds.clear()
            if any(leased for _, leased in waiting):
                # An opener that resolved a name just before its rename gets time to show in the
                # file's open count before the last check; one wait per batch.
                time.sleep(PARK_SETTLE_S)
            with lease.batched():
                for locked, leased in waiting:
                    self._finish_region(locked, leased)

    # -- steps 2 and 3 ------------------------------------------------------------------------

    def _lock_group(self, members: list[ScanEntry], batch_fds: list[list[int]]) -> _Locked:
        """Open and LOCK_EX every file of a region; on any failure keep the whole region."""
        locked: _Locked = []
        gone: list[ScanEntry] = []
        opened: list[int] = []
        try:
            for e in members:
                try:
                    fd = open_probe_fd(self.dir_fd, e.name)
                except FileNotFoundError:
                    gone.append(kept(e, Status.ORPHANED, GONE))
                    continue
                except OSError as err:
                    if err.errno == errno.ELOOP:
                        self._keep_region(members, gone, Status.UNKNOWN, f"{e.name} replaced by a symlink")
                        return []
                    why = f"cannot open ({errname(err)})"
                    if err.errno in (errno.EMFILE, errno.ENFILE):
                        why += f": its region needs {len(members)} fds; raise ulimit -n"
                    self._fail_region(members, gone, f"{e.name} {why}")
                    return []
                opened.append(fd)
                st = os.fstat(fd)
                if st.st_ino != e.ino or st.st_dev != e.dev:
                    self._keep_region(members, gone, Status.UNKNOWN, f"{e.name} now refers to another file")
                    return []
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self._keep_region(members, gone, Status.LIVE, f"{e.name}: lock held")
                    return []
                locked.append((e, fd))
            # Closing releases the lock and any lease: the batch does it once it is done (or the
            # region itself, removed in place: its inodes are freed only when their fds close).
            batch_fds.append(opened)
            self._fds[id(locked)] = opened
            opened = []
        finally:
            _close_all(opened)  # a region kept early: nothing of it stays open
        self.out.kept.extend(gone)
        return locked

    def _keep_region(
        self, members: list[ScanEntry], gone: list[ScanEntry], status: Status, reason: str
    ) -> None:
        done = {e.name for e in gone}
        self.out.kept.extend(gone)
        for e in members:
            if e.name not in done:
                self.out.keep(e, status, f"kept: {reason}")

    def _fail_region(self, members: list[ScanEntry], gone: list[ScanEntry], reason: str) -> None:
        done = {e.name for e in gone}
        self.out.kept.extend(gone)
        for e in members:
            if e.name not in done:
                self.out.fail(e, f"kept: {reason}")

    def _still_dead(self, locked: _Locked, index: HolderIndex) -> tuple[Status, str] | None:
        """None if nobody holds any file of the region now; else the verdict that keeps it."""
        for e, _ in locked:
            holders = index.holders_of(*e.identity)
            if holders:
                shown = ", ".join(f"{h.pid}:{h.name}" for h in holders[:3])
                return Status.LIVE, f"held since the scan by {len(holders)} process(es): {shown}"
        blind = index.blind_spots(self.assume)
        if blind:
            return Status.UNKNOWN, f"cannot inspect {blind[0].describe()}; liveness unproven"
        return None

    def _park_region(self, locked: _Locked, leased: bool) -> bool:
        """Park every file of a region (True), or none: the rest kept, names given back."""
        done: list[ScanEntry] = []
        for i, (e, fd) in enumerate(locked):
            if self._park(e, fd, leased):
                done.append(e)
                continue
            # A region goes whole or not at all: what was parked goes back, the rest stays put.
            status = _follow(self.out.kept[-1].status)
            failed = bool(self.out.failed) and self.out.failed[-1] is self.out.kept[-1]
            for p in done:
                self._restore(p, _REGION_KEPT, status)
            for rest, _ in locked[i + 1 :]:
                if failed:
                    self.out.fail(rest, _REGION_KEPT, status)
                else:
                    self.out.keep(rest, status, _REGION_KEPT)
            return False
        return True

    def _park(self, e: ScanEntry, fd: int, leased: bool) -> bool:
        """One file, under its own lease where it has one: move it to the park directory and
        prove the move took the proven inode. False (and the entry kept) when it stays."""
        if leased:
            answer = lease.take(fd, e.uid, self.fsuid)
            if not answer.free:
                status = Status.LIVE if answer.held else Status.UNKNOWN
                self.out.keep(e, status, f"kept: {_lease_refusal(answer)}")
                return False
        try:
            changed = self._name_changed(e)
            if changed is not None:
                self.out.keep(e, *changed)
                return False
            if leased and lease.contested(fd, e.uid, self.fsuid):
                self.out.keep(e, Status.LIVE, RACED)
                return False
            try:
                moved = self.parking.park(e.name, e.identity)
            except OSError as err:
                self.out.fail(e, f"kept: cannot move it to its park directory ({errname(err)})")
                return False
            if moved.moved is park.Moved.GONE:
                self.out.keep(e, Status.ORPHANED, GONE)
                return False
            if moved.moved is not park.Moved.PARKED:
                self.out.kept.append(self._someone_elses(e, fd, moved))
                return False
            if leased and lease.contested(fd, e.uid, self.fsuid):
                self._restore(e)
                return False
            return True
        finally:
            if leased:
                lease.release(fd)

    def _name_changed(self, e: ScanEntry) -> tuple[Status, str] | None:
        """None if ``e``'s name still holds the proven inode, alone; else how to keep it."""
        try:
            st = os.stat(e.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return Status.ORPHANED, GONE
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or (st.st_dev, st.st_ino) != e.identity:
            return Status.UNKNOWN, "kept: the name changed just before removal"
        return None

    def _someone_elses(self, e: ScanEntry, fd: int, moved: park.ParkOutcome) -> ScanEntry:
        """The rename took another file than the one proven dead (its name was re-created)."""
        other = moved.other[1] if moved.other is not None else "?"
        ours = (
            "the file proven dead was removed by someone else first"
            if os.fstat(fd).st_nlink == 0
            else "the file proven dead no longer has this name"
        )
        if moved.moved is park.Moved.RETURNED:
            why = (
                f"kept: the name was re-created during removal (inode {other}, given back untouched); {ours}"
            )
            return kept(e, Status.UNKNOWN, why)
        why = (
            f"conflict: the name was re-created during removal (inode {other}) and taken again before "
            f"that file could be given back ({moved.error}); it waits in {self.parking.name}, "
            f"nothing removed; {ours}"
        )
        return self._parked_entry(e, why)

    def _parked_entry(self, e: ScanEntry, why: str) -> ScanEntry:
        where = e.path.parent / (self.parking.name or "") / e.name
        return dataclasses.replace(e, status=Status.PARKED, reason=why, path=where)

    # -- step 4 -------------------------------------------------------------------------------

    def _finish_region(self, locked: _Locked, leased: bool) -> None:
        """The parked files of a region: all go, or (an opener on any) all get their names back."""
        # All or nothing: every file is checked before any goes. A one-file region skips this
        # round; ``_finish`` makes the same check, under the same lease, right before the unlink.
        if leased and len(locked) > 1 and any(self._contested_now(e, fd) for e, fd in locked):
            for e, _ in locked:
                self._restore(e)
            return
        for e, fd in locked:
            self._finish(e, fd, leased)

    def _contested_now(self, e: ScanEntry, fd: int) -> bool:
        answer = lease.take(fd, e.uid, self.fsuid)
        if not answer.free:
            return True
        try:
            return lease.contested(fd, e.uid, self.fsuid)
        finally:
            lease.release(fd)

    def _finish(self, e: ScanEntry, fd: int, leased: bool) -> None:
        """The last check of one parked file (under its lease again, where it has one), the
        unlink in the park directory, and the proof that the inode has no name left.

        Nobody can open a name in the park directory but its owner; only an opener that
        resolved the region name before the rename can be on the inode, and it shows in the
        open count now.
        """
        if leased and not lease.take(fd, e.uid, self.fsuid).free:
            self._restore(e)
            return
        try:
            if leased and lease.contested(fd, e.uid, self.fsuid):
                self._restore(e)
                return
            try:
                problem = self.parking.unlink(e.name, e.identity, fd)
            except OSError as err:
                self._restore(e, f"kept: unlink failed ({errname(err)})", Status.ORPHANED, failed=True)
                return
            if problem is not None:
                self.out.keep(e, Status.UNKNOWN, f"kept: {problem}")
                return
            self.out.removed.append(e)
        finally:
            if leased:
                lease.release(fd)

    def _restore(
        self, e: ScanEntry, why: str = RACED, status: Status = Status.LIVE, *, failed: bool = False
    ) -> None:
        """Give a parked file its name back, intact; a name taken meanwhile is a conflict."""
        try:
            self.parking.restore(e.name)
        except OSError as err:
            self.out.kept.append(
                self._parked_entry(
                    e,
                    f"conflict: {why.removeprefix('kept: ')}, and its name could not be given back "
                    f"({errname(err)}: another file took it meanwhile); it waits in "
                    f"{self.parking.name}, nothing removed",
                )
            )
            return
        if failed:
            self.out.fail(e, why, status)
        else:
            self.out.keep(e, status, why)

    # -- a root with no room for the park directory -------------------------------------------

    def _without_park(self, locked: _Locked, leased: bool) -> None:
        """The park directory cannot be made: remove the region in place where nobody but this
        uid and root can rename its names and the root has no inode left; else keep it, failed."""
        error = self.no_park
        why = errname(error) if error is not None else "not made"
        if error is None or error.errno not in _NO_ROOM:
            for e, _ in locked:
                self.out.fail(e, f"kept: cannot make its park directory ({why})")
            return
        root = os.fstat(self.dir_fd)
        if others_can_rename(root, {e.uid for e, _ in locked}, self.fsuid):
            for e, _ in locked:
                self.out.fail(
                    e,
                    f"kept: the root has no inode left for a park directory ({why}), and other users "
                    "may rename names here, so no file is unlinked in place",
                )
            return
        self._remove_in_place(locked, leased)
        # Their inodes are freed once nothing holds them: the park directory may fit now.
        fds = self._fds.pop(id(locked), [])
        _close_all(fds)
        fds.clear()

    def _remove_in_place(self, locked: _Locked, leased: bool) -> None:
        """Every file's lease held at once, every name and opener checked, then every file
        unlinked (segments first) and its link count proven 0 (see the module's docstring)."""
        held: list[int] = []
        try:
            for i, (e, fd) in enumerate(locked):
                why = None
                if leased:
                    answer = lease.take(fd, e.uid, self.fsuid)
                    if answer.free:
                        held.append(fd)
                    else:
                        status = Status.LIVE if answer.held else Status.UNKNOWN
                        why = (status, f"kept: {_lease_refusal(answer)}")
                if why is None:
                    why = self._name_changed(e)
                if why is not None:
                    self._keep_region_for(locked, i, *why)
                    return
            if leased and any(lease.contested(fd, e.uid, self.fsuid) for e, fd in locked):
                for e, _ in locked:
                    self.out.keep(e, Status.LIVE, RACED)
                return
            for e, fd in locked:
                try:
                    os.unlink(e.name, dir_fd=self.dir_fd)
                except OSError as err:
                    self.out.fail(e, f"kept: unlink failed ({errname(err)})")
                    continue
                if os.fstat(fd).st_nlink != 0:
                    self.out.keep(e, Status.UNKNOWN, "kept: unlinked, yet another name still keeps the inode")
                    continue
                self.out.removed.append(
                    kept(
                        e,
                        e.status,
                        f"{e.reason}; removed in place: the root had no inode for a park directory",
                    )
                )
        finally:
            for fd in held:
                lease.release(fd)

    def _keep_region_for(self, locked: _Locked, at: int, status: Status, reason: str) -> None:
        """Keep a region whose file ``at`` failed a check: that file with ``reason``, the others
        as kept for their region."""
        for i, (e, _) in enumerate(locked):
            if i == at:
                self.out.keep(e, status, reason)
            else:
                self.out.keep(e, _follow(status), _REGION_KEPT)


def _follow(status: Status) -> Status:
    # A file kept because its region lost a member: what the kept member is, unless that
    # member now waits parked (a conflict), which the others are not.
    return Status.LIVE if status is Status.PARKED else status


def _lease_refusal(answer: lease.LeaseProbe) -> str:
    if answer.held:
        return "opened since the scan (write lease refused)"
    return f"no write lease now ({answer.error})"


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:  # noqa: SIM105 - contextlib.suppress costs a microsecond per file
            os.close(fd)
        except OSError:
            pass  # closed already: a close of ours must not stop the others


def _close_lists(fd_lists: list[list[int]]) -> None:
    for fds in fd_lists:
        _close_all(fds)
