"""A lease never stalls an engine: a watchdog kills a lease holder that cannot let go.

While we hold a write lease, an engine's ``open()`` of the file blocks in the kernel until
we release it or ``fs.lease-break-time`` (45 s) passes. A lease is held for microseconds,
but a holder that is stopped (``SIGSTOP``, a debugger's ptrace stop) or starved keeps it,
and the engine waits the whole 45 s. The kernel drops a dead holder's lease at once, so:

* every thread that takes a lease marks its slot in a small table shared with a watchdog
  process (``hold``, before the ``F_SETLEASE``) and clears it after the release (``drop``);
* the watchdog polls the table every ``POLL_S``. When a slot is holding and an opener is
  waiting on one of that process's leases (``BREAKING`` in ``/proc/locks``), and the
  holder is stopped (state ``T``), traced-stopped (``t`` on two polls running, so a
  process merely run under strace survives its syscall stops) or has held that same lease
  longer than ``HOLD_LIMIT_S``, it SIGKILLs the holder. The opener then proceeds within
  about ``HOLD_LIMIT_S + POLL_S``. Nobody waiting, nobody killed: a debugger may stop a
  holder for as long as no engine needs the file;
* job-control stops (``SIGTSTP``, ``SIGTTIN``, ``SIGTTOU``: Ctrl-Z) are blocked from
  ``hold`` to ``drop`` and delivered at the unblock, so they never stop a holder. Inside
  ``batched()`` (a run of probes or removals, one lease after another) the unblock waits
  for the next ``drop`` at least ``BATCH_DEFER_S`` after the block, or the batch's end: a
  Ctrl-Z stops us a few milliseconds later, and a file's lease costs a table write instead
  of two ``pthread_sigmask`` calls and a ``getpid`` (they were half the lease's cost).

Invariants:

* The watchdog is spawned (``posix_spawn`` of this file as a script), never forked: a
  process with threads (``watch --listen`` serves HTTP) cannot fork safely, and a spawn
  copies nothing of the parent. It gets the table's memfd as its stdin and nothing else
  (it closes any other inherited fd first), runs in a session of its own with ``/`` as its
  cwd (a Ctrl-Z or ``kill -STOP -PGID`` to our group never reaches it, no directory is
  kept busy), ignores the terminal's signals, and exits within a poll once its parent has
  gone (``getppid`` changes; ``PR_SET_PDEATHSIG`` would fire when the spawning *thread*
  exits). It opens no region file, so it is never anyone's holder.
* A slot names a thread by pid, tid and start time: the watchdog never kills a recycled
  pid, and a slot whose thread is gone is claimed again.
* Forked children (the scan's prober) share the table through the inherited mapping and
  claim their own slots on their first lease.
* Without a watchdog (no ``sys.executable``, a spawn that fails) leases work as before;
  ``status()`` says why there is none. Nothing here raises into a lease's caller.

This file is also the watchdog's script: run as ``__main__`` it imports only the standard
library, so it starts in a few milliseconds.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import sys
import time

#: ``SHMCTL_LEASE_GUARD=off``: no watchdog. Only for pausing a reaper on purpose (a debugger,
#: ``strace -e inject=...:delay_enter=``, as the window tests do): the watchdog exists to kill
#: exactly such a holder once an engine waits on it.
DISABLE_ENV = "SHMCTL_LEASE_GUARD"
#: How often the watchdog looks at the table.
POLL_S = 0.05
#: A holder that keeps one lease longer than this while an opener waits is killed.
HOLD_LIMIT_S = 0.5
SLOTS = 256
#: Inside ``batched()``, job-control stops stay blocked between one lease and the next for at
#: most about this long (plus one lease), so a Ctrl-Z still stops a long batch promptly.
BATCH_DEFER_S = 0.02

#: Header: magic, heartbeat (polls done), kills, last pid killed, slots ever claimed.
_HEADER = struct.Struct("=QQQQQ")
_HEADER_SIZE = 64
_BEAT_AT, _KILLS_AT, _LAST_AT, _USED_AT = 8, 16, 24, 32
#: Slot: pid, tid, start time (clock ticks), state (seq << 1 | holding). Native order: only
#: processes of this machine read it, and a native 8-byte store is one instruction.
_SLOT = struct.Struct("=iiQQ")
_STATE = struct.Struct("=Q")
_STATE_AT = 16
_SIZE = _HEADER_SIZE + SLOTS * _SLOT.size
_MAGIC = 0x6B766C6561736531  # "kvlease1"
_JOB_STOPS = frozenset({signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU})
_TERMINAL = (signal.SIGINT, signal.SIGHUP, *_JOB_STOPS)


def _start_ticks(path: str) -> int | None:
    """Field 22 (starttime) of a ``stat`` file; None if unreadable."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError:
        return None
    return int(text[text.rindex(b")") + 2 :].split()[19])


# ---------------------------------------------------------------------------------------
# The watchdog process (this file run as a script)
# ---------------------------------------------------------------------------------------


def _breaking(pids: set[int]) -> set[int] | None:
    """The pids among ``pids`` with a lease an opener waits on; None if /proc/locks is unreadable."""
    try:
        with open("/proc/locks", "rb") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = set()
    for line in lines:
        fields = line.split()
        # "1: LEASE  BREAKING  UNLCK 5186 00:1b:3917 0 EOF" (waiters' lines have "->" first)
        if len(fields) > 4 and fields[1] == b"LEASE" and fields[2] == b"BREAKING":
            pid = int(fields[4]) if fields[4].lstrip(b"-").isdigit() else 0
            if pid in pids:
                found.add(pid)
    return found


def _watch(parent: int, poll_s: float, hold_limit_s: float) -> int:
    """The watchdog's loop: table on fd 0, runs until ``parent`` is no longer our parent."""
    for signum in _TERMINAL:
        signal.signal(signum, signal.SIG_IGN)
    os.chdir("/")  # keep no directory of the parent's busy (an unmount of its root)
    # Whatever else we inherited (a parent's inheritable fd) is not ours to keep open.
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    try:
        table = mmap.mmap(0, _SIZE)
    except (OSError, ValueError):
        return 2
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # the mapping keeps the table; stdin need not
    os.close(null)
    if _HEADER.unpack_from(table, 0)[0] != _MAGIC:
        return 2
    #: slot -> (state, first seen holding, seen traced-stopped on the previous poll)
    seen: dict[int, tuple[int, float, bool]] = {}
    heartbeat = 0
    while os.getppid() == parent:
        heartbeat += 1
        # Field by field: the lease takers write the slot count beside them.
        _STATE.pack_into(table, _BEAT_AT, heartbeat)
        used = _STATE.unpack_from(table, _USED_AT)[0]
        now = time.monotonic()
        suspects: dict[int, list[int]] = {}
        current: dict[int, tuple[int, float, bool]] = {}
        for slot in range(min(used, SLOTS)):
            at = _HEADER_SIZE + slot * _SLOT.size
            pid, tid, ticks, state = _SLOT.unpack_from(table, at)
            if pid <= 0 or not state & 1:
                continue
            stat = f"/proc/{pid}/task/{tid}/stat"
            try:
                with open(stat, "rb") as f:
                    text = f.read()
            except OSError:
                continue  # gone: its leases went with it
            rest = text[text.rindex(b")") + 2 :].split()
            if int(rest[19]) != ticks or rest[0] in (b"Z", b"X", b"x"):
                continue  # another thread now has that id, or it is dying
            before = seen.get(slot)
            first = before[1] if before is not None and before[0] == state else now
            traced = rest[0] == b"t"
            current[slot] = (state, first, traced)
            stuck = (
                rest[0] == b"T"
                or (traced and before is not None and before[0] == state and before[2])
                or now - first > hold_limit_s
            )
            if stuck:
                suspects.setdefault(pid, []).append(at)
        seen = current
        if suspects:
            waited_on = _breaking(set(suspects))
            for pid, slots in suspects.items():
                # Unreadable /proc/locks: the engine's wait is the contract, kill anyway.
                if waited_on is not None and pid not in waited_on:
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    continue
                for at in slots:
                    _STATE.pack_into(table, at + _STATE_AT, 0)
                _STATE.pack_into(table, _KILLS_AT, _STATE.unpack_from(table, _KILLS_AT)[0] + 1)
                _STATE.pack_into(table, _LAST_AT, pid)
        time.sleep(poll_s)
    return 0


if __name__ == "__main__":  # pragma: no cover - runs as the watchdog process
    sys.exit(_watch(int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])))


# ---------------------------------------------------------------------------------------
# The lease takers' side
# ---------------------------------------------------------------------------------------

import contextlib  # noqa: E402 - the watchdog needs none of what follows
import fcntl  # noqa: E402
import threading  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from kvoffload import syscalls  # noqa: E402


@dataclass(frozen=True, slots=True)
class GuardStatus:
    """Whether a watchdog watches this process's leases, and what it has done."""

    #: A watchdog runs and has polled the table at least once.
    watching: bool
    watchdog_pid: int | None = None
    #: Why there is no watchdog (leases then work unguarded, as before).
    error: str | None = None
    #: Lease holders it killed (this process's or its forked children's).
    kills: int = 0
    last_killed: int | None = None


class _Table:
    """The shared slot table of one process tree, and the watchdog that reads it."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        fd = os.memfd_create("shmctl-lease-guard", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, _SIZE)
            self.map = mmap.mmap(fd, _SIZE)
        except BaseException:
            os.close(fd)
            raise
        #: Kept open: claims lock it (POSIX locks exclude our forked children too) and a
        #: watchdog that died is spawned again with it.
        self.fd = fd
        _HEADER.pack_into(self.map, 0, _MAGIC, 0, 0, 0, 0)
        self.watchdog: int | None = None
        self.error: str | None = None
        self.checked = 0.0
        self.claiming = threading.Lock()

    def spawn(self, poll_s: float, hold_limit_s: float) -> None:
        """Start the watchdog (never raises: a failure is ``error``)."""
        script = os.path.abspath(__file__)
        if not sys.executable or not os.path.isfile(script):
            self.error = "no Python interpreter or watchdog script on disk to spawn"
            return
        argv = [sys.executable, "-I", "-S", script, str(os.getpid()), repr(poll_s), repr(hold_limit_s)]
        try:
            self.watchdog = os.posix_spawn(
                sys.executable,
                argv,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_DUP2, self.fd, 0),
                    (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                    (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0),
                ],
                setsid=True,
                setsigmask=(),
                setsigdef=(signal.SIGTERM, signal.SIGIO, signal.SIGPIPE),
            )
            self.error = None
        except OSError as e:
            self.watchdog = None
            self.error = f"cannot spawn the watchdog ({e.strerror or e})"
        self.checked = time.monotonic()

    def alive(self) -> bool:
        """Reap a watchdog that exited; True while ours runs."""
        if self.watchdog is None:
            return False
        try:
            pid, _ = os.waitpid(self.watchdog, os.WNOHANG)
        except ChildProcessError:
            pid = self.watchdog  # someone else reaped it
        if pid == 0:
            return True
        self.watchdog = None
        self.error = "the watchdog exited"
        return False

    def header(self) -> tuple[int, int, int, int, int]:
        magic, beat, kills, last, used = _HEADER.unpack_from(self.map, 0)
        return magic, beat, kills, last, used

    def claim(self, pid: int, tid: int) -> int | None:
        """A slot for this thread: a free one, or one whose thread is gone."""
        ticks = _start_ticks(f"/proc/self/task/{tid}/stat")
        if ticks is None:
            return None
        with self.claiming:
            return self._claim(pid, tid, ticks)

    def _claim(self, pid: int, tid: int, ticks: int) -> int | None:
        try:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)  # excludes our forked children; not our threads
        except OSError:
            return None
        try:
            used = self.header()[4]
            chosen = None
            for slot in range(used):
                at = _HEADER_SIZE + slot * _SLOT.size
                owner, owner_tid, owner_ticks, _ = _SLOT.unpack_from(self.map, at)
                if owner == 0 or _start_ticks(f"/proc/{owner}/task/{owner_tid}/stat") != owner_ticks:
                    chosen = slot
                    break
            if chosen is None:
                if used >= SLOTS:
                    return None
                chosen = used
                _STATE.pack_into(self.map, _USED_AT, used + 1)
            _SLOT.pack_into(self.map, _HEADER_SIZE + chosen * _SLOT.size, pid, tid, ticks, 0)
            return chosen
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN)


class _Thread(threading.local):
    """One thread's leases: its slot, the fds it holds leases on, its mask before ``hold``
    (None while job-control stops are not blocked by us), and its ``batched()`` depth."""

    pid = 0
    slot_at: int | None = None
    seq = 0
    fds: set[int]
    mask: object = None
    #: ``batched()`` blocks entered and not left.
    batch = 0
    #: When (``time.monotonic``) the stops were blocked, in a batch.
    blocked_at = 0.0

    def __init__(self) -> None:
        self.fds = set()


_table: _Table | None = None
_error: str | None = None
_lock = threading.Lock()
_thread = _Thread()
_mask: syscalls.SignalMask | None = None
#: Holds between two looks at whether our watchdog still runs.
_CHECK_EVERY = 4096
#: This process's pid: ``os.getpid`` is a syscall, and ``hold`` needs it for every lease.
_pid = os.getpid()


def _forgotten_in_child() -> None:
    global _lock, _pid
    _pid = os.getpid()
    # Another thread may have held them at the fork.
    _lock = threading.Lock()
    if _table is not None:
        _table.claiming = threading.Lock()


os.register_at_fork(after_in_child=_forgotten_in_child)


def start(*, poll_s: float = POLL_S, hold_limit_s: float = HOLD_LIMIT_S) -> GuardStatus:
    """Make sure a watchdog watches this process's leases (idempotent, cheap when it does).

    Called where leases may be taken (``lease.sigio_ignored``). A forked child uses its
    parent's table and watchdog; it never spawns one of its own.
    """
    global _table, _error, _mask
    with _lock:
        if _mask is None:
            # Without ctypes the standard library's pthread_sigmask does it, a little slower.
            with contextlib.suppress(ImportError, OSError, AttributeError):
                _mask = syscalls.SignalMask(_JOB_STOPS)
        if _table is None:
            try:
                _table = _Table()
            except OSError as e:
                _error = f"no shared table ({e.strerror or e})"
                return status()
        if os.environ.get(DISABLE_ENV, "").lower() in ("off", "0", "no"):
            _error = f"turned off ({DISABLE_ENV}={os.environ[DISABLE_ENV]})"
            return status()
        if _table.owner == os.getpid() and not _table.alive():
            _table.spawn(poll_s, hold_limit_s)
    return status()


def stop() -> None:
    """Stop this process's watchdog and free its table, once it will take no lease for long.

    A process that reaps once and lives on (vLLM's client, after the ``shmctl_reap`` plugin)
    would otherwise keep a watchdog polling ``/proc/locks`` for its whole life. Only the
    table's owner stops it, and only while no thread of it holds a lease; a later lease
    starts a new one (``start``).
    """
    global _table
    with _lock:
        table = _table
        if table is None or table.owner != os.getpid() or _thread.fds:
            return
        if table.watchdog is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(table.watchdog, signal.SIGTERM)  # its default action: it exits at once
            with contextlib.suppress(ChildProcessError):
                os.waitpid(table.watchdog, 0)
            table.watchdog = None
        table.map.close()
        os.close(table.fd)
        _table = None
        # This thread's slot was in that table: its next lease claims one in the new table.
        _thread.pid = 0
        _thread.slot_at = None


def status() -> GuardStatus:
    """What the guard does for this process now."""
    if _table is None:
        return GuardStatus(False, error=_error or "not started")
    _, beat, kills, last, _ = _table.header()
    mine = _table.owner == os.getpid()
    running = _table.alive() if mine else beat > 0
    return GuardStatus(
        watching=running and beat > 0,
        watchdog_pid=_table.watchdog if mine else None,
        error=None if running else (_table.error or _error),
        kills=kills,
        last_killed=last or None,
    )


def hold(fd: int) -> bool:
    """Before ``F_SETLEASE`` on ``fd``: mark this thread holding, defer job-control stops.

    True when ``fd`` was not held already (then a refused lease must be ``drop``ped).
    """
    me = _thread
    fds = me.fds
    if fds:
        if fd in fds:
            return False
        fds.add(fd)
        return True
    if me.mask is None:  # else still blocked since the batch's last lease (``batched``)
        mask = _mask
        me.mask = mask.block() if mask is not None else signal.pthread_sigmask(signal.SIG_BLOCK, _JOB_STOPS)
        if me.batch:
            me.blocked_at = time.monotonic()
    fds.add(fd)
    table = _table
    if table is not None:
        pid = _pid
        if me.pid != pid:  # this thread's first lease, or a forked child's
            _claim(me, table, pid)
        if me.slot_at is not None:
            me.seq += 1
            _STATE.pack_into(table.map, me.slot_at, me.seq << 1 | 1)
            if me.seq % _CHECK_EVERY == 0 and pid == table.owner and not table.alive():
                start()  # killed, OOM: a long-running agent gets a new one
    return True


def _claim(me: _Thread, table: _Table, pid: int) -> None:
    me.pid = pid
    slot = table.claim(pid, threading.get_native_id())
    me.slot_at = None if slot is None else _HEADER_SIZE + slot * _SLOT.size + _STATE_AT


def adopt() -> None:
    """In a forked child that will take leases: claim its slot now, before the first one.

    ``hold`` would claim it anyway; claiming early keeps that ``/proc`` read and lock out
    of the first lease's hold.
    """
    table = _table
    pid = os.getpid()
    if table is not None and _thread.pid != pid:
        _claim(_thread, table, pid)


def drop(fd: int) -> None:
    """After the lease on ``fd`` is released (or refused): clear the mark, deliver deferred stops."""
    me = _thread
    fds = me.fds
    if fd not in fds:
        return
    fds.discard(fd)
    if fds:
        return
    table = _table
    if table is not None and me.slot_at is not None:
        _STATE.pack_into(table.map, me.slot_at, me.seq << 1)
    if me.batch and time.monotonic() - me.blocked_at < BATCH_DEFER_S:
        return  # the batch's next lease comes in microseconds: stops stay deferred till then
    _unblock(me)


def _unblock(me: _Thread) -> None:
    """Put back the thread's mask from before the block: a deferred stop stops us now."""
    old, me.mask = me.mask, None
    if isinstance(old, set):
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    elif old is not None and _mask is not None:
        _mask.restore(old)


@contextlib.contextmanager
def batched() -> Iterator[None]:
    """A run of leases taken one after another by this thread (a scan's probes, a batch of
    removals): job-control stops stay blocked from one lease to the next, up to
    ``BATCH_DEFER_S`` at a time, and are delivered at the latest when the block ends.

    Every lease is still marked in the table from its ``hold`` to its ``drop``: the watchdog
    sees each hold as before. Nested blocks are one.
    """
    me = _thread
    me.batch += 1
    try:
        yield
    finally:
        me.batch -= 1
        if not me.batch and not me.fds and me.mask is not None:
            _unblock(me)
