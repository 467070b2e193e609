"""Which directories named like a park are really a reaper's: the only ones ever entered.

A reaper that dies leaves its directory behind, unlocked, with whatever it had parked.
Later reapers adopt it (``settle.settle_parked``), but a name is no proof: where a user owns
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

A trusted park whose reaper is dead is adopted (``adopt``: locked by us, judged again on the
locked fd) and, once emptied, removed (``remove_dead``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from dataclasses import dataclass

from kvoffload import syscalls
from kvoffload.liveness.park.directory import (
    DIR_FLAGS,
    MARK_PREFIX,
    Identity,
    ParkName,
    RootId,
    errname,
    identity,
    mark_name,
    open_park,
    parse_park_name,
    rmdir_if,
    sole_regular,
)
from kvoffload.shm import families as shm_families

__all__ = [
    "NO_MARK",
    "Adopter",
    "FoundPark",
    "Untrusted",
    "adopt",
    "judge",
    "lock_held",
    "remove_dead",
]

_MARK_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


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
        return f"its mark cannot be read ({errname(e)})"
    try:
        mark = os.fstat(fd)
    finally:
        os.close(fd)
    if not sole_regular(mark) or mark.st_uid != st.st_uid or mark.st_size != 0:
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
        fd = os.open(name, DIR_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        return _untrusted(name, st, f"cannot open it ({errname(e)})")
    try:
        now = os.fstat(fd)
        if identity(now) != identity(st):
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
            name, identity(st), st.st_uid, reaper, lock_held(fd), None, f"cannot list it ({errname(e)})"
        )
    if problem is not None:
        if inside:
            return _untrusted(name, st, problem)
        return FoundPark(name, identity(st), st.st_uid, reaper, lock_held(fd), (), unfinished=True)
    mark = mark_name(root)
    # Files of every family: a reaper parks whichever it was asked to remove (``--family``).
    parked = {n for n in inside if shm_families.parse(n) is not None}
    files = tuple(sorted(parked))
    others = tuple(sorted(n for n in inside if n != mark and n not in parked))
    return FoundPark(name, identity(st), st.st_uid, reaper, lock_held(fd), files, others=others)


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
    if identity(st) != found.identity:
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
    return rmdir_if(root_fd, found.name, park_fd)
