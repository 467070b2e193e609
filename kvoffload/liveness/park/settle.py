"""What a dead reaper left parked: every file proven dead again goes, every other file gets its
name back, and the directory goes once empty.

A reaper can be SIGKILLed between any two syscalls. What it leaves is its park directory,
unlocked, with the files it had moved there under their original names. A scan judges
each such file (``parked``: a ``ParkedView``, its verdict and the ``action`` a reap takes);
this module does it, for ``reap`` and for each reaping pass of ``shmctl watch``.

Only a **trusted** park is touched (``trust.judge``: the exact name, a real 0700 directory on
the root's mount, owned by a uid this run may remove files of, holding its reaper's mark).
It is adopted first: our own lock on it, so that two adopters never act on one directory,
and the trust checks made again on the locked fd. Then, per region:

* every file ``remove`` by the scan's evidence (and chosen by the operator's filters) is
  proven dead once more under its lease and unlinked;
* any other file, or one whose proof fails now, is renamed back to its name (never over
  another file: a name taken meanwhile is a *conflict*, both kept);
* where the park is not the adopter's own uid's (root adopting a user's with
  ``--all-users``), its owner can rename names inside it at any moment: each file is first
  moved into the adopter's own park directory and proven there (``ParkDir.take``), and only
  there unlinked or given back. Nothing is unlinked where another uid can rename.

Removing needs a lease: without one, a dead parked file goes back to its name, where an
ordinary reap judges it; so does a region with a file of another uid unless ``remove_others``
(``--all-users``). A dead park left with nothing but its mark is removed, and so is an
``unfinished`` one (empty and unmarked, the adopter's own); each is reported
(``Outcome.parks_removed``). A park of another uid is emptied but left to its owner.
"""

from __future__ import annotations

import errno
import fcntl
import os
from collections.abc import Callable, Iterable, Sequence

from kvoffload.liveness import lease, park
from kvoffload.liveness.listing import uids_text
from kvoffload.liveness.park.directory import errname
from kvoffload.liveness.park.views import ParkView
from kvoffload.liveness.probe import open_probe_fd
from kvoffload.liveness.removal import GONE, Outcome, kept
from kvoffload.liveness.report import ScanEntry
from kvoffload.liveness.verdict import Status

_WHY = "a dead reap left it parked; "


def settle_parked(
    dir_fd: int,
    parked: Sequence[ScanEntry],
    *,
    parks: Sequence[ParkView],
    parking: park.ParkDir,
    adopter: park.Adopter,
    remove_engines: Callable[[str], bool],
    remove_others: bool,
    use_lease: bool,
    outcome: Outcome,
) -> None:
    """Settle the dead parks among ``parks`` (a scan's, of the root open as ``dir_fd``) and the
    ``parked`` files in them; ``parking`` is this run's own park directory."""
    by_dir: dict[str, list[ScanEntry]] = {p.name: [] for p in parks if p.running is False}
    for e in parked:
        assert e.parked is not None
        if e.parked.directory in by_dir:
            by_dir[e.parked.directory].append(e)
    root = park.RootId.of(dir_fd)
    for name, entries in by_dir.items():
        found = park.judge(dir_fd, name, root, adopter)
        if not isinstance(found, park.FoundPark) or found.running is not False:
            continue  # gone, no longer trusted, or adopted by someone else just now
        park_fd = park.adopt(dir_fd, found, root, adopter)
        if park_fd is None:
            continue
        try:
            settler = _Settler(dir_fd, park_fd, found, parking, outcome)
            for engine_id, files in _by_engine(entries).items():
                remove = (
                    use_lease
                    and remove_engines(engine_id)
                    and all(f.parked is not None and f.parked.action == "remove" for f in files)
                )
                foreign = sorted({f.uid for f in files if f.uid != adopter.uid})
                held = None
                if remove and foreign and not remove_others:
                    remove = False
                    held = f"{uids_text(foreign)}: another user's region is removed only with --all-users"
                for e in files:
                    settler.settle(e, remove, held)
            if park.remove_dead(dir_fd, found, park_fd, root):
                outcome.parks_removed.append(name)
        finally:
            os.close(park_fd)


def _by_engine(entries: Iterable[ScanEntry]) -> dict[str, list[ScanEntry]]:
    groups: dict[str, list[ScanEntry]] = {}
    for e in entries:
        groups.setdefault(e.engine_id, []).append(e)
    return groups


class _Settler:
    """One adopted park directory (``park_fd``, locked by us) and the files in it."""

    def __init__(
        self, dir_fd: int, park_fd: int, found: park.FoundPark, parking: park.ParkDir, outcome: Outcome
    ) -> None:
        self.dir_fd = dir_fd
        self.park_fd = park_fd
        self.found = found
        self.parking = parking
        self.out = outcome
        #: Its owner can rename inside it: files are moved into our own park before anything.
        self.foreign = found.uid != os.geteuid()

    def settle(self, e: ScanEntry, remove: bool, held: str | None) -> None:
        why = _WHY
        if held is not None:
            why += f"not removed ({held}); "
        if not remove and not self._name_free(e):
            self._conflict(e, why, "another file took its name", self.found.name)
            return
        where = self._here(e)
        if where is None:
            return
        if remove:
            problem = _remove_parked(where, e)
            if problem is None:
                self.out.removed.append(kept(e, Status.ORPHANED, f"{why}proven dead again and removed"))
                return
            why += f"not removed ({problem}); "
        self._give_back(where, e, why)

    def _name_free(self, e: ScanEntry) -> bool:
        try:
            os.stat(e.name, dir_fd=self.dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        except OSError:
            pass
        return False

    def _here(self, e: ScanEntry) -> int | None:
        """The fd of a directory only we can rename in that holds ``e``, proven: the adopted
        park itself when it is our uid's, else our own park after ``ParkDir.take``."""
        if not self.foreign:
            return self.park_fd
        try:
            moved = self.parking.take(self.park_fd, e.name, e.identity)
        except OSError as err:
            self.out.fail(
                e,
                f"{_WHY}left in {self.found.name}: cannot move it to our park directory ({errname(err)})",
                Status.PARKED,
            )
            return None
        if moved.moved is park.Moved.GONE:
            self.out.keep(e, Status.ORPHANED, GONE)
            return None
        if moved.moved is not park.Moved.PARKED:
            other = moved.other[1] if moved.other is not None else "?"
            self.out.keep(
                e,
                Status.UNKNOWN,
                f"{_WHY}another file (inode {other}) took its name in {self.found.name}, whose owner "
                "can rename there; that file was put back untouched",
            )
            return None
        return self.parking.fd

    def _conflict(self, e: ScanEntry, why: str, taken: str, waits: str | None) -> None:
        self.out.kept.append(
            kept(
                e,
                Status.PARKED,
                f"conflict: {why}it could not be given back ({taken}); it waits in {waits}, nothing removed",
            )
        )

    def _give_back(self, where: int, e: ScanEntry, why: str) -> None:
        waits = self.found.name if where == self.park_fd else self.parking.name
        try:
            park.renameat2(where, e.name, self.dir_fd, e.name)
        except FileNotFoundError:
            self.out.keep(e, Status.ORPHANED, GONE)
            return
        except OSError as err:
            taken = "another file took its name" if err.errno == errno.EEXIST else errname(err)
            self._conflict(e, why, taken, waits)
            return
        # From a directory nobody else can rename in, never over another file: the name now
        # holds the parked inode, unless someone replaced it since.
        try:
            st = os.stat(e.name, dir_fd=self.dir_fd, follow_symlinks=False)
            back = (st.st_dev, st.st_ino) == e.identity
        except OSError:
            back = False
        if not back:
            why += "given back its name, which another file has taken since; "
        verdict = e.parked.verdict if e.parked else Status.UNKNOWN
        self.out.restored.append(kept(e, verdict, f"{why}given back its name"))


def _remove_parked(park_fd: int, e: ScanEntry) -> str | None:
    """Prove a parked file dead under its lease and unlink it; None when done, else why not."""
    try:
        fd = open_probe_fd(park_fd, e.name)
    except OSError as err:
        return f"cannot open it ({errname(err)})"
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
            if answer.held:
                return "opened since the scan (write lease refused)"
            return f"no write lease now ({answer.error})"
        try:
            if lease.contested(fd, e.uid, fsuid):
                return "opened as we looked"
            return park.unlink_proven(park_fd, e.name, e.identity, fd)
        finally:
            lease.release(fd)
    finally:
        os.close(fd)
