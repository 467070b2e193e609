"""The agent's ``/proc`` walks: the last one kept between passes, a new one only when needed.

A walk of ``/proc`` (``holders.collect_holders``) reads every process of the node: 260-280 ms
of CPU at 2,000 processes, most of an agent's pass. A write lease answers the question a
verdict needs for one file in microseconds, and better (kernel-evidence.md): granted, nobody
anywhere has the file open or mapped; refused, somebody has. So the agent's steady passes rest
on the leases and walk ``/proc`` only for what a lease cannot answer (``ScanStream`` with
``walks``; docs/fleet.md, "Lease-first passes"):

* a file whose lease could not be taken (another uid without ``CAP_LEASE``, ``--no-lease``, a
  filesystem that refuses leases, a probe that failed): its verdict needs a complete walk;
* a refused lease the last walk did not name a holder for, or whose named holders no longer
  run (same pid *and* start time, from ``/proc/PID/stat``): a new engine, or a holder gone
  and another come. A file a walk found refused and held by nobody it could show, where that
  walk could not see or read every process (an agent without ``hostPID`` sees no engine), is
  remembered as such (``unnamed``) and needs no walk while its lease stays refused: another
  walk would show nobody either. Where every process is in sight, such a file was opened after
  the walk, and the next pass walks to name its holder;
* park directories, and a root on a device the last walk did not record;
* a root with nominations (``--reap``): judged on a walk made at its turn, as always;
* every ``every`` passes in any case: what only a walk yields (unlinked regions still mapped,
  processes it could not inspect, and the holders' names) is at most ``every`` intervals old.

Invariants:

* A walk's holders are never set against a fresh lease: a file whose lease is granted now is
  judged with no holder, whatever the last walk saw (``ScanStream`` builds that view).
* Recorded holders name a live region only; they never decide a verdict the lease did not
  (a refused lease is ``live`` whoever holds it).
* At most one walk serves the rest of a pass once it is made (``fresh``), covering every
  device the pass matched; memory is the last walk's index (the held files and the
  processes holding them), never a root's files.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from kvoffload import procfs
from kvoffload.liveness.holders import FileKey, Holder, HolderIndex, collect_holders

__all__ = ["DEFAULT_WALK_EVERY", "WALK_REASONS", "ProcWalks"]

#: Passes between two walks at most (``--walk-every``): the default interval of 60 s makes
#: the walk-only numbers at most 10 minutes old.
DEFAULT_WALK_EVERY = 10

#: Why a walk was made: the ``reason`` label of ``shmctl_proc_walks_total``.
WALK_REASONS = (
    # No walk yet (the agent's first pass), or the last one failed.
    "first",
    # ``every`` passes since the last walk.
    "periodic",
    # A file whose lease could not be taken (or leases are off): only a walk can judge it.
    "no_lease",
    # A refused lease the last walk named no running holder for.
    "holders_changed",
    # A root on a device the last walk did not record.
    "new_device",
    # Park directories to judge (a reaper died mid-way).
    "parks",
    # A root with nominations, judged on fresh evidence before anything is removed.
    "removal",
)


class ProcWalks:
    """The last walk of ``/proc`` and the walks of the current pass (``begin`` … ``walk``)."""

    def __init__(
        self,
        proc_root: Path = procfs.PROC_ROOT,
        *,
        every: int = DEFAULT_WALK_EVERY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.proc_root = proc_root
        self.every = every
        self._clock = clock
        #: The last walk's index, and when it was made (wall clock).
        self.last: HolderIndex | None = None
        self.last_at: float | None = None
        self._last_pass = 0
        self._pass = 0
        #: Walks since this agent started, by reason.
        self.counts: dict[str, int] = {}
        #: This pass's walks, by reason, in order.
        self.reasons: list[str] = []
        #: The devices the pass matched: every walk covers them all.
        self.devices: frozenset[int] = frozenset()
        #: A walk of this pass failed: its roots each walk on their own, as before leases led.
        self.failed = False
        #: Start time of each holder the last walk named, read right after it.
        self._started: dict[int, int | None] = {}
        #: This pass's answers of ``running``, by pid.
        self._running: dict[int, bool] = {}
        #: Files refused a lease that a walk named no holder of, as the last pass left them (one
        #: key per live file held out of this ``/proc``'s sight; orphans are never here).
        self.unnamed: frozenset[FileKey] = frozenset()
        self._unnamed_next: set[FileKey] = set()

    @property
    def fresh(self) -> bool:
        """This pass walked: its index is as new as the pass, and serves every root after it."""
        return bool(self.reasons) and not self.failed

    def begin(self, number: int, devices: Collection[int], *, use_lease: bool = True) -> str | None:
        """Start pass ``number`` over ``devices``; the reason it must walk first, if it must."""
        self._pass = number
        self.devices = frozenset(devices)
        self.reasons = []
        self.failed = False
        self._running = {}
        # Only what the last pass found again is kept: a file gone, or leasable, drops out.
        self.unnamed, self._unnamed_next = frozenset(self._unnamed_next), set()
        if self.last is None:
            return "first"
        if not use_lease:
            return "no_lease"
        if number - self._last_pass >= self.every:
            return "periodic"
        if not self.last.covers(self.devices):
            return "new_device"
        return None

    def walk(self, reason: str, devices: Iterable[int] = ()) -> HolderIndex:
        """Walk ``/proc`` now for every device of the pass (and ``devices``); counted by ``reason``.

        An ``OSError`` is the caller's (a root's scan reports it); the last walk is kept.
        """
        self.reasons.append(reason)
        self.counts[reason] = self.counts.get(reason, 0) + 1
        wanted = set(self.devices)
        wanted.update(devices)
        try:
            index = collect_holders(self.proc_root, devices=wanted)
        except OSError:
            self.failed = True
            raise
        self.failed = False
        self.last, self.last_at, self._last_pass = index, self._clock(), self._pass
        self._running = {}
        # Who held what, with their start times: a later pass checks a holder by these two
        # numbers (a pid reused since is not the holder). Read now, while the walk is fresh.
        pids = {h.pid for found in index.holders.values() for h in found}
        self._started = {pid: self._start_ticks(pid) for pid in pids}
        return index

    def note_unnamed(self, key: FileKey) -> None:
        """``key``'s lease was refused and a walk named no holder of it: no walk will until the
        holder shows (``--walk-every`` looks again)."""
        self._unnamed_next.add(key)

    def running(self, holders: Iterable[Holder]) -> bool:
        """Whether every holder the last walk named still runs: the same pid, the same start time."""
        for h in holders:
            known = self._running.get(h.pid)
            if known is None:
                started = self._started.get(h.pid)
                known = self._running[h.pid] = started is not None and self._start_ticks(h.pid) == started
            if not known:
                return False
        return True

    def _start_ticks(self, pid: int) -> int | None:
        try:
            stat = procfs.read_stat(pid, self.proc_root)
        except (OSError, ValueError, IndexError):
            return None
        return None if stat.is_zombie else stat.start_ticks
