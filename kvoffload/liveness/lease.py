"""Evidence from a write lease: does any other open file description of this inode exist?

Linux grants ``fcntl(fd, F_SETLEASE, F_WRLCK)`` only when the caller's fd is the inode's
only open file description on the whole kernel: any PID or mount namespace, any uid.
A mapping keeps its file description, so a process that mapped the file and closed its
fd still counts, and read-only opens count since Linux 5.3. So:

* granted (``free``): nobody anywhere has the file open or mapped. This is proof that no
  ``/proc`` walk can give: it needs no process to be visible or readable;
* ``EAGAIN`` (``held``): someone has it, perhaps a process this scan cannot see;
* anything else (``None``, with the reason): no evidence either way. The caller must own
  the file (fsuid) or have ``CAP_LEASE``; some filesystems refuse leases.

While a lease is held, another process's ``open`` of the file blocks in the kernel until
we release it, and we are sent ``SIGIO`` (default action: terminate). So a lease is held
for microseconds (one file's probe, or one file's check-and-unlink in ``reap``) and only
inside ``sigio_ignored()``. A pending break shows in ``F_GETLEASE``, which then reports the
type the lease is being broken to: that is how ``reap`` learns an opener arrived.

A holder that cannot answer (stopped, traced, starved) would keep an engine's ``open``
waiting for ``fs.lease-break-time`` (45 s). ``watchdog`` prevents it: ``sigio_ignored`` starts
a watchdog that kills such a holder once an opener waits on it, and ``take`` … ``release``
mark the hold for it and defer job-control stops (Ctrl-Z) until the lease is given back.
Every hold therefore ends with ``release``, never with a bare ``close``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from kvoffload import procfs
from kvoffload.liveness import watchdog

_lock = threading.Lock()
_depth = 0
_previous: signal.Handlers | None = None


class LeaseState(StrEnum):
    FREE = "free"
    HELD = "held"


@dataclass(frozen=True, slots=True)
class LeaseProbe:
    """The lease's answer for one file: ``state`` None means no evidence, ``error`` says why."""

    state: LeaseState | None
    error: str | None = None

    @property
    def free(self) -> bool:
        return self.state is LeaseState.FREE

    @property
    def held(self) -> bool:
        return self.state is LeaseState.HELD


FREE = LeaseProbe(LeaseState.FREE)
HELD = LeaseProbe(LeaseState.HELD)
DISABLED = LeaseProbe(None, "disabled (--no-lease)")
NOT_PROBED = LeaseProbe(None, "not probed")
#: Granted, then broken before we let go: someone opened the file while we looked. It is
#: ``held`` as far as any verdict goes (the opener has it now).
BROKEN = LeaseProbe(LeaseState.HELD, "an opener arrived while the lease was held")


def unavailable_reason(error: OSError, st_uid: int, fsuid: int) -> str:
    """Why the kernel gave no lease, in words an operator can act on."""
    if error.errno in (errno.EACCES, errno.EPERM):
        return f"not the file's owner (uid {st_uid}, we are {fsuid}) and no CAP_LEASE"
    if error.errno == errno.EINVAL:
        return "the filesystem refuses leases (or fs.leases-enable is 0)"
    return f"F_SETLEASE failed ({errno.errorcode.get(error.errno or 0, str(error))})"


def take(fd: int, st_uid: int, fsuid: int) -> LeaseProbe:
    """Try to take a write lease on ``fd``; on ``free`` the caller holds it until ``release``.

    The hold is marked for the watchdog, and job-control stops deferred, before the
    ``F_SETLEASE``: a stop right after the grant is a stop while holding. Taking again a
    lease already held (``contested``) leaves it, and its mark, in place whatever the answer.
    """
    new = watchdog.hold(fd)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except BlockingIOError:
        if new:
            watchdog.drop(fd)
        return HELD
    except OSError as e:
        if new:
            watchdog.drop(fd)
        return LeaseProbe(None, unavailable_reason(e, st_uid, fsuid))
    return FREE


def broken(fd: int) -> bool:
    """Has an opener arrived since ``take``? (Then the lease is being broken, or gone.)"""
    try:
        return fcntl.fcntl(fd, fcntl.F_GETLEASE) != fcntl.F_WRLCK
    except OSError:
        return True  # cannot tell: act as if someone arrived


def contested(fd: int, st_uid: int, fsuid: int) -> bool:
    """Is anyone else opening the file now, while we hold its lease?

    ``F_GETLEASE`` shows a pending break, but an ``open`` counts itself among the inode's
    opens before it breaks the lease (between the two it may block in a fanotify permission
    check, or simply be preempted). Taking the held lease again sees that count: it fails
    with ``EAGAIN`` and leaves the lease in place. Either sign means someone arrived.
    """
    return broken(fd) or not take(fd, st_uid, fsuid).free


def release(fd: int) -> None:
    """Give the lease back; a blocked opener proceeds, a deferred Ctrl-Z stops us now.

    Closing the fd would drop the lease too, but not the watchdog's mark nor the deferral.
    """
    try:  # noqa: SIM105 - contextlib.suppress costs a microsecond per lease, twice per file
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError:
        pass  # not held (refused, or the fd is gone): nothing to give back
    watchdog.drop(fd)


def break_time_s(proc_root: Path = procfs.PROC_ROOT) -> float | None:
    """``fs.lease-break-time``: how long an opener waits on a holder that never answers.

    That is an engine's wait if every shmctl process is frozen at once (a cgroup freezer:
    the watchdog too). None if it cannot be read.
    """
    try:
        text = (proc_root / "sys" / "fs" / "lease-break-time").read_text()
        return float(int(text.strip()))
    except (OSError, ValueError):
        return None


def leases_enabled(proc_root: Path = procfs.PROC_ROOT) -> bool | None:
    """``fs.leases-enable``: whether the kernel grants leases at all. None if it cannot be read.

    At 0 every ``F_SETLEASE`` fails with ``EINVAL``: no file gets the lease's proof, and a
    verdict rests on ``/proc`` and locks alone.
    """
    try:
        return int((proc_root / "sys" / "fs" / "leases-enable").read_text().strip()) != 0
    except (OSError, ValueError):
        return None


def batched() -> contextlib.AbstractContextManager[None]:
    """Around a run of leases taken one after another (``watchdog.batched``): each is marked
    for the watchdog as before, and Ctrl-Z is deferred from one to the next, a few ms at most."""
    return watchdog.batched()


def guard_status() -> watchdog.GuardStatus:
    """Whether a watchdog guards this process's leases (``watchdog``), and why not."""
    return watchdog.status()


@contextlib.contextmanager
def sigio_ignored() -> Iterator[str | None]:
    """Make sure a lease break cannot kill this process; yields None, or why leases are unsafe.

    The kernel sends ``SIGIO`` to a lease holder when another process opens the file. Its
    default action terminates the process, so while leases may be taken ``SIGIO`` is
    ignored (the break itself is what ``broken`` reads). Only the main thread may change a
    signal's disposition: elsewhere leases are safe only if the program already handles or
    ignores ``SIGIO`` (a long-running host can call this once from its main thread).
    Nested and concurrent uses share one change, undone by the last to leave.

    Where leases are safe it also starts the watchdog (``watchdog.start``), once per process:
    a spawn, so a process with threads may call it. It outlives the block: a long-running
    host pays the spawn once, and it exits with this process.
    """
    global _depth, _previous
    unsafe = None
    with _lock:
        default = _depth == 0 and signal.getsignal(signal.SIGIO) is signal.SIG_DFL
        if default and threading.current_thread() is not threading.main_thread():
            unsafe = "SIGIO has its default action (terminate) and only the main thread can change it"
        else:
            if default:
                _previous = signal.signal(signal.SIGIO, signal.SIG_IGN)  # type: ignore[assignment]
            _depth += 1
    if unsafe is not None:
        yield unsafe
        return
    watchdog.start()
    try:
        yield None
    finally:
        with _lock:
            _depth -= 1
            # Only the main thread may restore it; a thread that leaves last leaves SIGIO
            # ignored, and the main thread's next exit puts the old action back.
            if (
                _depth == 0
                and _previous is not None
                and threading.current_thread() is threading.main_thread()
            ):
                signal.signal(signal.SIGIO, _previous)
                _previous = None
