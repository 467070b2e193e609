"""One region file's own evidence, from one open: its owner record, its write lease, its lock.

A scan probes every file it may judge; ``prober`` runs these probes in a forked child beside
the ``/proc`` pass where that pays. The only file opened is the region file itself,
read-only, ``O_NOFOLLOW|O_NONBLOCK`` (``open_probe_fd``, which ``reap`` opens with too), and
it is checked to be the inode that was listed. Closing it releases the lease and the lock.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass

from kvoffload.liveness import lease, lock
from kvoffload.liveness.lease import LeaseProbe
from kvoffload.liveness.listing import Listed
from kvoffload.shm.owner import OwnerRecord, inspect_owner

__all__ = ["REMOVED", "Probe", "open_probe_fd", "probe_file"]

REMOVED = "removed during the scan"
_PROBE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
#: Another prober (a concurrent scan or reap) holds its lease for microseconds; an open
#: meanwhile fails with EWOULDBLOCK under O_NONBLOCK. Try again this many times.
_LEASED_RETRIES = 5


@dataclass(slots=True)
class Probe:
    lock_held: bool | None = None
    lease: LeaseProbe = lease.NOT_PROBED
    owner: OwnerRecord | None = None
    owner_problem: str | None = None
    problem: str | None = None


def open_probe_fd(dir_fd: int, name: str) -> int:
    """Open a region file to probe it: read-only, no links, no blocking (also on a lease)."""
    for attempt in range(_LEASED_RETRIES):
        try:
            return os.open(name, _PROBE_FLAGS, dir_fd=dir_fd)
        except BlockingIOError:
            if attempt == _LEASED_RETRIES - 1:
                raise
            time.sleep(0.001 * (attempt + 1))
    raise AssertionError("unreachable")


def probe_file(dir_fd: int, item: Listed, lease_off: LeaseProbe | None, euid: int) -> Probe:
    """Open read-only without following links, check it is still the listed inode, read the
    owner record, probe the write lease and, unless the lease was granted, ``LOCK_EX|LOCK_NB``.

    A granted lease means ours is the inode's only open file description, so no flock can be
    held on it: ``lock_held`` is False without a probe. Closing the fd releases both the
    lease and the lock; the lease is held from ``take`` to that ``close``, two syscalls.
    """
    try:
        fd = open_probe_fd(dir_fd, item.name)
    except FileNotFoundError:
        return Probe(problem=REMOVED)
    except BlockingIOError:
        return Probe(problem="another process holds a lease on it (a concurrent shmctl?)")
    except OSError as e:
        if e.errno == errno.ELOOP:
            return Probe(problem="replaced by a symlink during the scan")
        return Probe(problem=f"cannot open it to probe it ({errno.errorcode.get(e.errno or 0, e)})")
    try:
        st = os.fstat(fd)
        if st.st_ino != item.st.st_ino or st.st_dev != item.st.st_dev:
            return Probe(problem="replaced by another file during the scan")
        owner, owner_problem = inspect_owner(fd) if item.region.segment == 0 else (None, None)
        answer = lease_off or lease.take(fd, st.st_uid, euid)
        if answer.free:
            # Checked before the close releases it: an opener that arrived while we held the
            # lease is blocked on it now, and the file is in use the moment we let go.
            if lease.contested(fd, st.st_uid, euid):
                return Probe(None, lease.BROKEN, owner, owner_problem)
            return Probe(False, answer, owner, owner_problem)
        lock_held, problem = lock.probe(fd)
        return Probe(lock_held, answer, owner, owner_problem, problem)
    finally:
        lease.release(fd)  # explicitly, so the lease's bookkeeping (its guard) sees it end
        os.close(fd)  # releases the lock probe
