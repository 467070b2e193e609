"""A reaper's private directory: made, locked and marked, and the proofs around every move.

Linux renames and unlinks by name, never by inode: whatever a name holds at the instant of
the syscall is what moves or goes. ``reap`` therefore never unlinks a name in a shared
directory. It moves the file it proved dead into a directory of its own and proves, after
the move, that the moved inode is the proven one:

* ``ParkDir`` is ``ROOT/.shmctl-park-<pid>-<start ticks>-<random>``, made by the reaper
  before it opens the first file it removes (mode 0700: nobody but its uid and root can
  add, rename or remove a name inside), on the root's filesystem (a rename never copies),
  ``flock``ed for as long as the reaper runs (the kernel drops that lock the moment the
  reaper dies, in any PID namespace: a held lock *is* a running reaper), and **marked**:
  an empty file named for the root (``mark_name``), which only the directory's owner can
  make in it (``trust`` says why that is the proof a later reaper needs).
* ``park`` renames ``ROOT/NAME`` to ``PARK/NAME`` (the original name, kept whole) and then
  ``fstatat``s it: a different inode, a link or anything but a regular file with one link
  is someone else's (an engine re-created the name in the window) and is renamed back at
  once (``RENAME_NOREPLACE``: never over a third file).
* ``unlink_proven`` removes ``PARK/NAME`` only after the same proof, then checks on the fd
  that the inode's link count reached 0. Inside the 0700 directory no other user can put
  a file between the proof and the unlink.

A reaper that dies leaves its directory behind, unlocked, with whatever it had parked; which
such directories a later reaper may adopt is ``trust``'s to say.
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
from kvoffload.syscalls import RENAME_NOREPLACE, renameat2

__all__ = [
    "DIR_FLAGS",
    "MARK_PREFIX",
    "PARK_PREFIX",
    "RENAME_NOREPLACE",
    "Identity",
    "Moved",
    "ParkDir",
    "ParkName",
    "ParkOutcome",
    "RootId",
    "errname",
    "format_park_name",
    "identity",
    "is_park_name",
    "mark_name",
    "open_park",
    "parse_park_name",
    "renameat2",
    "rmdir_if",
    "sole_regular",
    "unlink_proven",
]

PARK_PREFIX = ".shmctl-park-"
#: The empty file a reaper makes in its park directory as soon as it has made and locked it,
#: named ``MARK_PREFIX<root st_dev>-<root st_ino>`` (``mark_name``).
MARK_PREFIX = ".shmctl-mark-"
_PARK_NAME = re.compile(r"\.shmctl-park-([1-9]\d{0,9})-(\d{1,20})-([0-9a-f]{16})\Z")
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MARK_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: A directory's birth time is stamped with the coarse clock (a jiffy, up to 10 ms), which can
#: read earlier than the fine clock read just before the ``mkdir``.
_BIRTH_SLACK_NS = 50_000_000

Identity = tuple[int, int]


def is_park_name(name: str) -> bool:
    """Named like a park directory: a candidate for ``trust.judge``, never a park for that alone."""
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


def identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino)


def sole_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def errname(e: OSError) -> str:
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


def mark_name(root: RootId) -> str:
    """The mark's name in a park directory of ``root``: it says which root the park was made in."""
    return f"{MARK_PREFIX}{root.dev}-{root.ino}"


def _write_mark(park_fd: int, root: RootId) -> None:
    # Empty: an inode and a name, no data page, so it is made on a root full by bytes too.
    os.close(os.open(mark_name(root), _MARK_WRITE, 0o400, dir_fd=park_fd))


def open_park(root_fd: int, name: str) -> int:
    return os.open(name, DIR_FLAGS, dir_fd=root_fd)


def rmdir_if(root_fd: int, name: str, park_fd: int) -> bool:
    """``rmdir ROOT/name`` if the name still holds ``park_fd``'s directory (checked just before:
    ``rmdir`` acts on a name, and only an empty directory can go)."""
    try:
        named = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if identity(named) != identity(os.fstat(park_fd)):
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
            fd = os.open(name, DIR_FLAGS, dir_fd=self._root_fd)
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
                    rmdir_if(self._root_fd, name, fd)
            os.close(fd)
            raise
        self._fd, self.name, self._identity, self._mark = fd, name, identity(st), mark_name(root)
        return fd

    def _check_made(self, fd: int, st: os.stat_result, name: str, before: int) -> None:
        """The directory open as ``fd`` is the one our ``mkdir`` just made: a directory swapped
        in at the name between the two calls (in a root where others may rename) is refused."""
        named = os.stat(name, dir_fd=self._root_fd, follow_symlinks=False)
        born = syscalls.statx(fd).birth_ns
        if (
            identity(st) != identity(named)
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
        if identity(st) == proven and sole_regular(st):
            return ParkOutcome(Moved.PARKED)
        # Someone else's file (or a link to ours): it was at the name an instant ago, and
        # goes back there, untouched, unless a third file took the name in between.
        try:
            renameat2(fd, name, self._root_fd, name)
        except OSError as e:
            return ParkOutcome(Moved.STUCK, identity(st), errname(e))
        return ParkOutcome(Moved.RETURNED, identity(st))

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
        if identity(st) == proven and sole_regular(st):
            return ParkOutcome(Moved.PARKED)
        try:
            renameat2(fd, name, park_fd, name)
        except OSError as e:
            return ParkOutcome(Moved.STUCK, identity(st), errname(e))
        return ParkOutcome(Moved.RETURNED, identity(st))

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
                    rmdir_if(self._root_fd, self.name or "", fd)
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
    if identity(st) != proven or not sole_regular(st):
        return "its parked name now holds another file"
    os.unlink(name, dir_fd=park_fd)
    if os.fstat(fd).st_nlink != 0:
        return "unlinked, yet another name still keeps the inode"
    return None
