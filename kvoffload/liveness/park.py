"""A reaper's private directory, and which directories named like one are really a reaper's.

Linux renames and unlinks by name, never by inode: whatever a name holds at the instant of
the syscall is what moves or goes. ``reap`` therefore never unlinks a name in a shared
directory. It moves the file it proved dead into a directory of its own and proves, after
the move, that the moved inode is the proven one:

* ``ParkDir`` is ``ROOT/.shmctl-park-<pid>-<start ticks>-<random>``, made by the reaper
  before it opens the first file it removes (mode 0700: nobody but its uid and root can
  add, rename or remove a name inside), on the root's filesystem (a rename never copies),
  ``flock``ed for as long as the reaper runs (the kernel drops that lock the moment the
  reaper dies, in any PID namespace: a held lock *is* a running reaper), and **marked**.
* ``park`` renames ``ROOT/NAME`` to ``PARK/NAME`` (the original name, kept whole) and then
  ``fstatat``s it: a different inode, a link or anything but a regular file with one link
  is someone else's (an engine re-created the name in the window) and is renamed back at
  once (``RENAME_NOREPLACE``: never over a third file).
* ``unlink_proven`` removes ``PARK/NAME`` only after the same proof, then checks on the fd
  that the inode's link count reached 0. Inside the 0700 directory no other user can put
  a file between the proof and the unlink.

A reaper that dies leaves its directory behind, unlocked, with whatever it had parked.
Later reapers adopt it (``reap.settle_parked``), but a name is no proof: where a user owns
the root (a pod volume), they can rename any directory in it, root's private 0700 ones
included, to a park name, and mode and owner come with the directory. So a directory is a
reaper's park (``judge``) only when all of these hold, checked on its open fd:

* its name is exactly ``.shmctl-park-PID-TICKS-HEX16``;
* it is a directory (never followed if a symlink), on the root's filesystem, on the root's
  mount (not a mount point);
* its owner is the adopter, or a uid whose files the adopter may remove in this run
  (root with ``--all-users``): ``Adopter``;
* its mode is exactly 0700;
* it holds the **mark** its reaper made in it right after making and locking it: an empty
  regular file with one link, owned by the directory's owner, named for the root's
  ``(st_dev, st_ino)`` (``mark_name``). A name can be made in a 0700 directory only by the
  directory's owner (or root), and nobody else can rename one in from outside: so the mark
  proves the directory's own uid made it there, for this root. (An extended attribute would
  prove the same, but ``trusted.*`` needs CAP_SYS_ADMIN, which a DaemonSet does not grant,
  tmpfs takes ``user.*`` only since Linux 6.6 and hugetlbfs none; an empty file needs no
  data page, so it is made on a root full by bytes too.)

Anything else named like a park is ``Untrusted``: never entered, renamed or removed, and
reported with its owner, mode and the reason. One exception, ``unfinished``: an *empty*,
unmarked directory that passes every other check and is the adopter's own is what a reaper
killed between its ``mkdir`` and its mark (or between removing its mark and its ``rmdir``)
leaves; it is removed. Whoever could have put such a directory at a park name could have
removed it themselves (``rename`` and ``rmdir`` ask the same permission of the parent), and
an empty directory holds no data.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvoffload import procfs, syscalls
from kvoffload.shm import names
from kvoffload.syscalls import RENAME_NOREPLACE, renameat2

__all__ = [
    "MARK_PREFIX",
    "PARK_PREFIX",
    "RENAME_NOREPLACE",
    "Adopter",
    "FoundPark",
    "Moved",
    "ParkDir",
    "ParkName",
    "ParkOutcome",
    "RootId",
    "Untrusted",
    "adopt",
    "is_park_name",
    "judge",
    "mark_name",
    "parse_park_name",
    "remove_dead",
    "renameat2",
    "unlink_proven",
]

PARK_PREFIX = ".shmctl-park-"
#: The empty file a reaper makes in its park directory as soon as it has made and locked it,
#: named ``MARK_PREFIX<root st_dev>-<root st_ino>`` (``mark_name``).
MARK_PREFIX = ".shmctl-mark-"
_PARK_NAME = re.compile(r"\.shmctl-park-([1-9]\d{0,9})-(\d{1,20})-([0-9a-f]{16})\Z")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MARK_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_MARK_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: A directory's birth time is stamped with the coarse clock (a jiffy, up to 10 ms), which can
#: read earlier than the fine clock read just before the ``mkdir``.
_BIRTH_SLACK_NS = 50_000_000

Identity = tuple[int, int]


def is_park_name(name: str) -> bool:
    """Named like a park directory: a candidate for ``judge``, never a park for that alone."""
    return name.startswith(PARK_PREFIX)


@dataclass(frozen=True, slots=True)
class ParkName:
    """What a park directory's name says about the reaper that made it."""

    pid: int
    start_ticks: int
    token: str


def parse_park_name(name: str) -> ParkName | None:
    match = _PARK_NAME.match(name)
    if match is None:
        return None
    return ParkName(int(match.group(1)), int(match.group(2)), match.group(3))


def format_park_name(pid: int, start_ticks: int) -> str:
    return f"{PARK_PREFIX}{pid}-{start_ticks}-{os.urandom(8).hex()}"


def _identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino)


def _sole_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def _errname(e: OSError) -> str:
    return errno.errorcode.get(e.errno or 0, e.strerror or str(e))


@dataclass(frozen=True, slots=True)
class RootId:
    """The root a park directory belongs to: its inode, and the mount it is reached through."""

    dev: int
    ino: int
    mount_id: int | None

    @classmethod
    def of(cls, root_fd: int) -> RootId:
        st = os.fstat(root_fd)
        return cls(st.st_dev, st.st_ino, syscalls.mount_id(root_fd))


@dataclass(frozen=True, slots=True)
class Adopter:
    """Whose park directories this run may adopt: its own, and (root with ``--all-users``)
    those of every uid whose files it may remove."""

    uid: int
    every_uid: bool = False

    @classmethod
    def of(cls, all_users: bool | None, euid: int | None = None) -> Adopter:
        uid = os.geteuid() if euid is None else euid
        return cls(uid, uid == 0 and bool(all_users))

    def refusal(self, owner: int) -> str | None:
        """None if a park of ``owner`` may be adopted; else why not."""
        if owner == self.uid or self.every_uid:
            return None
        if self.uid == 0:
            return f"owned by uid {owner}: another user's park is adopted only with --all-users"
        return f"owned by uid {owner}, not by this user (uid {self.uid})"


NO_MARK = "it holds no mark (a reaper of ours marks its park directory as it makes it)"


def mark_name(root: RootId) -> str:
    """The mark's name in a park directory of ``root``: it says which root the park was made in."""
    return f"{MARK_PREFIX}{root.dev}-{root.ino}"


def _write_mark(park_fd: int, root: RootId) -> None:
    # Empty: an inode and a name, no data page, so it is made on a root full by bytes too.
    os.close(os.open(mark_name(root), _MARK_WRITE, 0o400, dir_fd=park_fd))


def _mark_problem(park_fd: int, st: os.stat_result, root: RootId) -> str | None:
    """None if the directory open as ``park_fd`` holds its reaper's mark for ``root``; else why not.

    ``NO_MARK`` (no mark at all) is the one answer ``unfinished`` may follow.
    """
    try:
        fd = os.open(mark_name(root), _MARK_READ, dir_fd=park_fd)
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            if any(n.startswith(MARK_PREFIX) for n in os.listdir(park_fd)):
                return "its mark names another root: it was made elsewhere and moved here"
        return NO_MARK
    except OSError as e:
        return f"its mark cannot be read ({_errname(e)})"
    try:
        mark = os.fstat(fd)
    finally:
        os.close(fd)
    if not _sole_regular(mark) or mark.st_uid != st.st_uid or mark.st_size != 0:
        return "its mark is not the empty file its owner makes"
    return None


@dataclass(frozen=True, slots=True)
class Untrusted:
    """An entry named like a park directory that is not a reaper's: never entered, renamed or
    removed; reported so that nobody can hide anything behind one."""

    name: str
    #: ``directory``, ``symlink``, ``file``, or what else the entry is.
    kind: str
    uid: int
    #: Permission bits (``st_mode & 0o7777``).
    mode: int
    reason: str


@dataclass(frozen=True, slots=True)
class FoundPark:
    """A trusted park directory found in a root: whose, and whether its reaper still runs."""

    name: str
    identity: Identity
    uid: int
    reaper: ParkName | None
    #: True: its lock is held (the reaper, or an adopter, is at work); False: nobody holds it.
    running: bool | None
    #: The region-pattern names inside it (None when it could not be read, with ``problem``).
    files: tuple[str, ...] | None
    problem: str | None = None
    #: Entries inside that are neither its mark nor named like a region file: no reaper of ours
    #: puts them there, so they are left, and so is the directory.
    others: tuple[str, ...] = ()
    #: An empty, unmarked directory of the adopter's own (see the module's docstring): a
    #: reaper killed while it made or removed its park directory.
    unfinished: bool = False


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "directory"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISFIFO(mode):
        return "fifo"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "device"


def _untrusted(name: str, st: os.stat_result, reason: str) -> Untrusted:
    return Untrusted(name, _kind(st.st_mode), st.st_uid, stat.S_IMODE(st.st_mode), reason)


def _shape_problem(name: str, st: os.stat_result, root: RootId, adopter: Adopter) -> str | None:
    """What ``lstat`` alone shows is wrong with ``name`` as a park directory (no fd needed:
    a root full of other users' look-alikes costs one ``lstat`` each)."""
    if not stat.S_ISDIR(st.st_mode):
        return f"a {_kind(st.st_mode)}, not a directory: never followed"
    if parse_park_name(name) is None:
        return "its name is not a reaper's (.shmctl-park-PID-TICKS-HEX16)"
    if st.st_dev != root.dev:
        return "on another filesystem than the root"
    refused = adopter.refusal(st.st_uid)
    if refused is not None:
        return refused
    if stat.S_IMODE(st.st_mode) != 0o700:
        return f"mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return None


def _fd_problem(fd: int, st: os.stat_result, root: RootId, adopter: Adopter) -> str | None:
    """The checks of ``_shape_problem`` again on the open directory, plus its mount and mark."""
    if not stat.S_ISDIR(st.st_mode) or st.st_dev != root.dev:
        return "not a directory on the root's filesystem"
    refused = adopter.refusal(st.st_uid)
    if refused is not None:
        return refused
    if stat.S_IMODE(st.st_mode) != 0o700:
        return f"mode {stat.S_IMODE(st.st_mode):04o}, not 0700"
    if root.mount_id is not None:
        mount = syscalls.mount_id(fd)
        if mount is not None and mount != root.mount_id:
            return "a mount point, not a directory of the root's mount"
    return _mark_problem(fd, st, root)


def judge(root_fd: int, name: str, root: RootId, adopter: Adopter) -> FoundPark | Untrusted | None:
    """What ``ROOT/name`` (an entry named like a park) is: a trusted park (``FoundPark``), an
    ``Untrusted`` look-alike, or None when it vanished (the next pass sees what is there then)."""
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    problem = _shape_problem(name, st, root, adopter)
    if problem is not None:
        return _untrusted(name, st, problem)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        return _untrusted(name, st, f"cannot open it ({_errname(e)})")
    try:
        now = os.fstat(fd)
        if _identity(now) != _identity(st):
            return None  # replaced as we looked
        return _judge_open(fd, name, now, root, adopter)
    finally:
        os.close(fd)


def _judge_open(
    fd: int, name: str, st: os.stat_result, root: RootId, adopter: Adopter
) -> FoundPark | Untrusted:
    reaper = parse_park_name(name)
    problem = _fd_problem(fd, st, root, adopter)
    # An untrusted directory is not even listed, but for the one look an unfinished park needs.
    if problem is not None and not (problem == NO_MARK and st.st_uid == adopter.uid):
        return _untrusted(name, st, problem)
    try:
        inside = os.listdir(fd)
    except OSError as e:
        if problem is not None:
            return _untrusted(name, st, problem)
        return FoundPark(
            name, _identity(st), st.st_uid, reaper, lock_held(fd), None, f"cannot list it ({_errname(e)})"
        )
    if problem is not None:
        if inside:
            return _untrusted(name, st, problem)
        return FoundPark(name, _identity(st), st.st_uid, reaper, lock_held(fd), (), unfinished=True)
    mark = mark_name(root)
    files = tuple(sorted(n for n in inside if names.parse(n) is not None))
    others = tuple(sorted(n for n in inside if n != mark and names.parse(n) is None))
    return FoundPark(name, _identity(st), st.st_uid, reaper, lock_held(fd), files, others=others)


def lock_held(fd: int) -> bool | None:
    """Is the park directory's lock held by someone (its reaper, or an adopter)?"""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def open_park(root_fd: int, name: str) -> int:
    return os.open(name, _DIR_FLAGS, dir_fd=root_fd)


def adopt(root_fd: int, found: FoundPark, root: RootId, adopter: Adopter) -> int | None:
    """Open and lock a dead reaper's park directory for ourselves, and judge it again on the
    locked fd; None if someone has it now, or it is no longer the trusted park ``found`` was."""
    try:
        fd = open_park(root_fd, found.name)
    except OSError:
        return None
    try:
        if _adoptable(fd, found, root, adopter):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _adoptable(fd: int, found: FoundPark, root: RootId, adopter: Adopter) -> bool:
    st = os.fstat(fd)
    if _identity(st) != found.identity:
        return False  # another directory is at the name now
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    problem = _fd_problem(fd, st, root, adopter)
    if problem is None:
        return True
    return found.unfinished and problem == NO_MARK and not os.listdir(fd)


def remove_dead(root_fd: int, found: FoundPark, park_fd: int, root: RootId) -> bool:
    """Remove an adopted park directory (``park_fd``, locked by us) once nothing but its mark is
    left in it; True when it is gone. A park of another uid is left to that uid (its mark is
    in a directory its owner can rename in: we never unlink there)."""
    if found.uid != os.geteuid():
        return False
    try:
        left = os.listdir(park_fd)
    except OSError:
        return False
    mark = mark_name(root)
    if left not in ([], [mark]):
        return False
    if left:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(mark, dir_fd=park_fd)
    return _rmdir_if(root_fd, found.name, park_fd)


def _rmdir_if(root_fd: int, name: str, park_fd: int) -> bool:
    """``rmdir ROOT/name`` if the name still holds ``park_fd``'s directory (checked just before:
    ``rmdir`` acts on a name, and only an empty directory can go)."""
    try:
        named = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if _identity(named) != _identity(os.fstat(park_fd)):
        return False
    try:
        os.rmdir(name, dir_fd=root_fd)
    except OSError:
        return False  # not empty after all (a file given back failed)
    return True


class Moved(StrEnum):
    """What one ``park`` did."""

    PARKED = "parked"  # the proven inode is now PARK/NAME
    GONE = "gone"  # the name held nothing: someone removed it first
    RETURNED = "returned"  # the name held another file, now back at its name, untouched
    STUCK = "stuck"  # the name held another file, and its name was taken before we could give it back


@dataclass(frozen=True, slots=True)
class ParkOutcome:
    moved: Moved
    #: The identity of what the name held, where it was not the proven inode.
    other: Identity | None = None
    error: str | None = None


class ParkDir:
    """A reaper's park directory in one root, made, locked and marked by ``open``; removed by
    ``close`` when nothing but its mark is left in it.

    Used as a context manager. ``open`` raises ``OSError`` when the directory cannot be made
    (``ENOSPC`` on a root out of inodes: see ``reap``'s fallback) and leaves nothing behind.
    """

    def __init__(self, root_fd: int, *, proc_root: Path = procfs.PROC_ROOT) -> None:
        self._root_fd = root_fd
        self._proc_root = proc_root
        self._fd: int | None = None
        self.name: str | None = None
        self._identity: Identity | None = None
        self._mark = ""

    def __enter__(self) -> ParkDir:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def opened(self) -> bool:
        return self._fd is not None

    @property
    def fd(self) -> int:
        assert self._fd is not None, "the park directory is opened first"
        return self._fd

    def open(self) -> int:
        """The directory's fd, making, locking and marking it on first use."""
        if self._fd is not None:
            return self._fd
        pid = os.getpid()
        try:
            ticks = procfs.read_stat(pid, self._proc_root).start_ticks
        except (OSError, ValueError, IndexError):
            ticks = 0
        name = format_park_name(pid, ticks)
        root = RootId.of(self._root_fd)
        before = time.time_ns()
        os.mkdir(name, 0o700, dir_fd=self._root_fd)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=self._root_fd)
            raise
        ours = False
        try:
            st = os.fstat(fd)
            self._check_made(fd, st, name, before)
            ours = True
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if stat.S_IMODE(st.st_mode) != 0o700:  # a umask took bits the mode needs
                os.fchmod(fd, 0o700)
            _write_mark(fd, root)
        except OSError:
            # Only the directory our mkdir made goes (one swapped in at its name is another's).
            with contextlib.suppress(OSError):
                if ours and not os.listdir(fd):
                    _rmdir_if(self._root_fd, name, fd)
            os.close(fd)
            raise
        self._fd, self.name, self._identity, self._mark = fd, name, _identity(st), mark_name(root)
        return fd

    def _check_made(self, fd: int, st: os.stat_result, name: str, before: int) -> None:
        """The directory open as ``fd`` is the one our ``mkdir`` just made: a directory swapped
        in at the name between the two calls (in a root where others may rename) is refused."""
        named = os.stat(name, dir_fd=self._root_fd, follow_symlinks=False)
        born = syscalls.statx(fd).birth_ns
        if (
            _identity(st) != _identity(named)
            or st.st_uid != os.geteuid()
            or st.st_mode & 0o077
            or os.listdir(fd)
            or (born is not None and born < before - _BIRTH_SLACK_NS)
        ):
            raise OSError(errno.EEXIST, "the park directory was replaced as it was made", name)

    def park(self, name: str, proven: Identity) -> ParkOutcome:
        """Move ``ROOT/name`` here and prove it is ``proven``; anything else goes back at once."""
        fd = self.open()
        try:
            renameat2(self._root_fd, name, fd, name)
        except FileNotFoundError:
            return ParkOutcome(Moved.GONE)
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if _identity(st) == proven and _sole_regular(st):
            return ParkOutcome(Moved.PARKED)
        # Someone else's file (or a link to ours): it was at the name an instant ago, and
        # goes back there, untouched, unless a third file took the name in between.
        try:
            renameat2(fd, name, self._root_fd, name)
        except OSError as e:
            return ParkOutcome(Moved.STUCK, _identity(st), _errname(e))
        return ParkOutcome(Moved.RETURNED, _identity(st))

    def take(self, park_fd: int, name: str, proven: Identity) -> ParkOutcome:
        """Move ``name`` from another park directory (``park_fd``) here and prove it is
        ``proven``: what an adopter does before it acts on a file in a directory another
        uid can rename in. Anything else goes back there at once."""
        fd = self.open()
        try:
            renameat2(park_fd, name, fd, name)
        except FileNotFoundError:
            return ParkOutcome(Moved.GONE)
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if _identity(st) == proven and _sole_regular(st):
            return ParkOutcome(Moved.PARKED)
        try:
            renameat2(fd, name, park_fd, name)
        except OSError as e:
            return ParkOutcome(Moved.STUCK, _identity(st), _errname(e))
        return ParkOutcome(Moved.RETURNED, _identity(st))

    def restore(self, name: str) -> None:
        """Give ``name`` back to the root, never over another file (``FileExistsError`` then)."""
        renameat2(self.fd, name, self._root_fd, name)

    def unlink(self, name: str, proven: Identity, fd: int) -> str | None:
        """Remove ``PARK/name`` if it is ``proven``; None when done, else why it stays."""
        return unlink_proven(self.fd, name, proven, fd)

    def close(self) -> None:
        """Remove the directory if nothing but its mark is left in it, then let go of it (and
        its lock). Killed between the two removals, it leaves an ``unfinished`` directory."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):  # left behind, it is settled by the next reap
                if os.listdir(fd) == [self._mark]:
                    os.unlink(self._mark, dir_fd=fd)
                    _rmdir_if(self._root_fd, self.name or "", fd)
        finally:
            os.close(fd)


def unlink_proven(park_fd: int, name: str, proven: Identity, fd: int) -> str | None:
    """Unlink ``name`` in a park directory if it is the ``proven`` inode (open as ``fd``).

    Proven before (the name holds that inode, a regular file with one link) and after
    (the inode's link count is 0: no other name keeps its memory). None when done.
    """
    try:
        st = os.stat(name, dir_fd=park_fd, follow_symlinks=False)
    except FileNotFoundError:
        return "gone from the park directory before its unlink"
    if _identity(st) != proven or not _sole_regular(st):
        return "its parked name now holds another file"
    os.unlink(name, dir_fd=park_fd)
    if os.fstat(fd).st_nlink != 0:
        return "unlinked, yet another name still keeps the inode"
    return None
