"""A reaper's private directory: where a file proven dead waits for its unlink, under proof.

Linux renames and unlinks by name, never by inode: whatever a name holds at the instant of
the syscall is what moves or goes. ``reap`` therefore never unlinks a name in a shared
directory. It moves the file it proved dead into a directory of its own and proves, after
the move, that the moved inode is the proven one:

* ``ParkDir`` is ``ROOT/.shmctl-park-<pid>-<start ticks>-<random>``, made by the reaper
  (mode 0700, so nobody but its uid and root can add, rename or remove a name inside) on the
  same filesystem as the root (a rename never copies), and ``flock``ed for as long as the
  reaper runs: the kernel drops that lock the moment the reaper dies, in any PID namespace,
  so a held lock *is* a running reaper, and a free one a dead one (the pid and start time in
  the name are for people, and for a second opinion where the lock is free).
* ``park`` renames ``ROOT/NAME`` to ``PARK/NAME`` (the original name, kept whole: what the
  file was is never lost, whatever the name's length or bytes) and then ``fstatat``s it: a
  different inode, a link or anything but a regular file with one link is someone else's
  (an engine re-created the name in the window) and is renamed back at once
  (``RENAME_NOREPLACE``: never over a third file).
* ``unlink`` removes ``PARK/NAME`` only after the same proof, then checks on the fd that the
  inode's link count reached 0. Inside the 0700 directory no other user can put a file
  between the proof and the unlink.
* ``restore`` renames a parked file back to its name, never over another file: when the
  name was taken meanwhile, the file stays parked and the caller reports a conflict.

A reaper that dies leaves its directory, with whatever it had parked. ``list_park_dirs``
finds such directories, and ``reap`` adopts the dead ones (``adopt``: its own lock on them
first, so two adopters never act on one directory) and gives each file back or removes it
as the evidence says (see ``reap.recover``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvoffload import procfs

PARK_PREFIX = ".shmctl-park-"
_PARK_NAME = re.compile(r"\.shmctl-park-(\d{1,10})-(\d{1,20})-([0-9a-f]{16})\Z")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: ``RENAME_NOREPLACE`` (linux/fs.h): never replace what another process created meanwhile.
RENAME_NOREPLACE = 1

Identity = tuple[int, int]


def is_park_name(name: str) -> bool:
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


_libc_renameat2: Callable[[int, bytes, int, bytes, int], int] | None = None


def renameat2(old_dir: int, old: str, new_dir: int, new: str, flags: int = RENAME_NOREPLACE) -> None:
    """``renameat2(2)``; ``RENAME_NOREPLACE`` by default: fail with ``EEXIST`` rather than replace."""
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
    if _libc_renameat2(old_dir, encode(old), new_dir, encode(new), flags) != 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), old)


def _identity(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino)


def _sole_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


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
    """A reaper's park directory in one root; made on first use, removed by ``close`` when empty.

    Used as a context manager. Anything that fails to make it surfaces as ``OSError`` from
    ``open``; the caller keeps the files it meant to park.
    """

    def __init__(self, root_fd: int, *, proc_root: Path = procfs.PROC_ROOT) -> None:
        self._root_fd = root_fd
        self._proc_root = proc_root
        self._fd: int | None = None
        self.name: str | None = None
        self._identity: Identity | None = None

    def __enter__(self) -> ParkDir:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def opened(self) -> bool:
        return self._fd is not None

    def open(self) -> int:
        """The directory's fd, making and locking it on first use."""
        if self._fd is not None:
            return self._fd
        pid = os.getpid()
        try:
            ticks = procfs.read_stat(pid, self._proc_root).start_ticks
        except (OSError, ValueError, IndexError):
            ticks = 0
        name = format_park_name(pid, ticks)
        os.mkdir(name, 0o700, dir_fd=self._root_fd)
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=self._root_fd)
            raise
        try:
            st = os.fstat(fd)
            named = os.stat(name, dir_fd=self._root_fd, follow_symlinks=False)
            # Ours, as we made it: a directory swapped in at the name in the instant between
            # mkdir and open (a non-sticky root lets anyone rename) is refused.
            if _identity(st) != _identity(named) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise OSError(errno.EEXIST, "the park directory was replaced as it was made", name)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise
        self._fd, self.name, self._identity = fd, name, _identity(st)
        return fd

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
            return ParkOutcome(Moved.STUCK, _identity(st), errno.errorcode.get(e.errno or 0, str(e)))
        return ParkOutcome(Moved.RETURNED, _identity(st))

    def restore(self, name: str) -> None:
        """Give ``name`` back to the root, never over another file (``FileExistsError`` then)."""
        assert self._fd is not None
        renameat2(self._fd, name, self._root_fd, name)

    def unlink(self, name: str, proven: Identity, fd: int) -> str | None:
        """Remove ``PARK/name`` if it is ``proven``; None when done, else why it stays."""
        assert self._fd is not None
        return unlink_proven(self._fd, name, proven, fd)

    def close(self) -> None:
        """Remove the directory if nothing is left in it, then let go of it (and its lock)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):  # left behind, it is settled by the next reap
                remove_if_empty(self._root_fd, self.name or "", fd)
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


def remove_if_empty(root_fd: int, name: str, park_fd: int) -> bool:
    """``rmdir`` the park directory ``name`` if it is still ``park_fd``'s directory and empty."""
    if not name or os.listdir(park_fd):
        return False
    try:
        named = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if _identity(named) != _identity(os.fstat(park_fd)):
        return False
    try:
        os.rmdir(name, dir_fd=root_fd)
    except OSError:
        return False  # not empty after all (a file given back failed), or not ours to remove
    return True


@dataclass(frozen=True, slots=True)
class FoundPark:
    """A park directory found in a root: whose, and whether its reaper still runs."""

    name: str
    identity: Identity
    uid: int
    reaper: ParkName | None
    #: True: its lock is held (the reaper, or an adopter, is at work); False: nobody holds it.
    running: bool | None
    #: The region-pattern names inside it (None when it could not be read, with ``problem``).
    files: tuple[str, ...] | None
    problem: str | None = None


def open_park(root_fd: int, name: str) -> int:
    return os.open(name, _DIR_FLAGS, dir_fd=root_fd)


def inspect_park(root_fd: int, name: str) -> FoundPark | None:
    """What ``ROOT/name`` (a ``.shmctl-park-*`` entry) is; None if it is no directory (then it
    is an ordinary entry: a file or a link named so is never followed or treated as a park)."""
    try:
        st = os.stat(name, dir_fd=root_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    reaper = parse_park_name(name)
    try:
        fd = open_park(root_fd, name)
    except FileNotFoundError:
        return None
    except OSError as e:
        why = errno.errorcode.get(e.errno or 0, str(e))
        return FoundPark(name, _identity(st), st.st_uid, reaper, None, None, f"cannot open it ({why})")
    try:
        if _identity(os.fstat(fd)) != _identity(st):
            return None  # replaced as we looked: the next pass sees what is there then
        running = lock_held(fd)
        try:
            files = tuple(sorted(os.listdir(fd)))
        except OSError as e:
            why = errno.errorcode.get(e.errno or 0, str(e))
            return FoundPark(name, _identity(st), st.st_uid, reaper, running, None, f"cannot list it ({why})")
        return FoundPark(name, _identity(st), st.st_uid, reaper, running, files)
    finally:
        os.close(fd)


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


def adopt(root_fd: int, found: FoundPark) -> int | None:
    """Open and lock a dead reaper's park directory for ourselves; None if someone has it now."""
    try:
        fd = open_park(root_fd, found.name)
    except OSError:
        return None
    try:
        if _identity(os.fstat(fd)) != found.identity:
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
