"""The verdict: one function that combines every source of evidence for a region.

A region (a base file and its segments ``.mmap.N``) is one unit: any file of it held,
unprobed or unknown keeps the whole group. The first evidence that decides, in order:

1. ``proc``: a visible process has a file open or mapped: ``live``, naming it;
2. ``lock``: a kvoffload participant holds its lock (any namespace): ``live``;
3. ``lease``: the write lease was refused, so some open file description exists that
   ``/proc`` did not show (another PID namespace, an uninspectable process): ``live``;
4. ``probe``: a file could not be probed (replaced, unreadable): ``unknown``;
5. without a granted lease on every file, the ``/proc`` walk must be complete: an
   uninspected process, or a ``/proc`` that does not list every process on the kernel,
   leaves the region ``unknown`` (fail-closed: absent is not "not holding");
6. ``owner``: the recorded creator still runs: ``unknown``;
7. ``age``: changed within the grace period: ``starting``;
8. otherwise ``orphaned``, decided by the lease where it was granted on every file
   (no process anywhere has it open or mapped), else by the complete ``/proc`` walk.

Only ``orphaned`` is ever reaped. The reason names the evidence that decided it, and
``decided_by`` says the same for machines.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from kvoffload.liveness.holders import Holder, Uninspected
from kvoffload.liveness.lease import LeaseProbe
from kvoffload.liveness.namespace import Visibility
from kvoffload.liveness.ownership import OwnerLiveness

#: A modification time further ahead of the clock than this was set by hand (``touch -d``),
#: not by a write: it is ignored for age, and the kernel-set ctime is used instead.
CLOCK_SKEW_S = 5.0


class Status(StrEnum):
    LIVE = "live"
    ORPHANED = "orphaned"
    STARTING = "starting"
    UNKNOWN = "unknown"
    SKIPPED = "skipped"
    #: In a reaper's park directory (``park``): on its way out, or back to its name.
    PARKED = "parked"


class Evidence(StrEnum):
    """Which source decided a verdict."""

    PROC = "proc"
    LOCK = "lock"
    LEASE = "lease"
    PROBE = "probe"
    OWNER = "owner"
    AGE = "age"
    FILE = "file"  # skipped: the entry is not ours to judge (a link, another user's file)


@dataclass(frozen=True, slots=True)
class FileEvidence:
    """What each source said about one file of a region."""

    name: str
    holders: tuple[Holder, ...]
    lock_held: bool | None
    lease: LeaseProbe
    #: Locked in ``/proc/locks`` by a process this ``/proc`` does not show.
    anonymous_lock: bool = False
    #: Why the file could not be probed at all, if it could not.
    problem: str | None = None


@dataclass(frozen=True, slots=True)
class ScannerView:
    """What the scanner itself can see: processes it could not read, and whether ``/proc`` is whole."""

    blind_spots: tuple[Uninspected, ...]
    visibility: Visibility


@dataclass(frozen=True, slots=True)
class Verdict:
    status: Status
    reason: str
    decided_by: Evidence
    #: ``starting`` only: seconds from the scan until the grace period ends. From then on the
    #: region is orphaned, and removable, if nobody has opened it meanwhile.
    removable_in_s: float | None = None


def changed_s(st: os.stat_result, when: float) -> float:
    """Seconds since the kernel last saw the file change: the grace period's evidence.

    Never negative, robust to a hand-set future mtime. ctime moves on creation, ftruncate,
    xattr writes and first-touch writes, and only the kernel sets it; mtime is kept in case
    a filesystem lags. This only delays a verdict (the grace period); it never proves death.
    It is the age scan's CHANGED column shows (``ScanEntry.changed_age_s``), so that what an
    operator reads is what the grace period judges: ``touch -d`` must not turn a region being
    created right now into an old one. ``ls -l``'s age is :func:`mtime_age_s`.
    """
    # From the nanosecond fields, as JSON's ``ctime_ns`` reports them: ``st_ctime`` is rounded
    # on its own and can disagree in the last bit, so the two would not subtract to this age.
    ctime_s, mtime_s = st.st_ctime_ns / 1e9, st.st_mtime_ns / 1e9
    changed = ctime_s if mtime_s > when + CLOCK_SKEW_S else max(mtime_s, ctime_s)
    return max(0.0, when - changed)


def mtime_age_s(st: os.stat_result, when: float) -> float:
    """Seconds since the file's mtime, as ``ls -l``, tmpreaper and systemd-tmpfiles count age.

    What ``--older-than`` selects on (JSON ``age_s``); 0 for an mtime in the future.
    """
    return max(0.0, when - st.st_mtime_ns / 1e9)


def decide(
    files: Sequence[FileEvidence],
    view: ScannerView,
    *,
    owner: OwnerLiveness | None,
    base_empty: bool,
    age: float,
    grace_s: float,
) -> Verdict:
    """The region's verdict and the reason for it (module docstring, steps 1-8)."""
    holders = {h.pid: h for f in files for h in f.holders}
    if holders:
        shown = ", ".join(f"{h.pid}:{h.name}" for h in list(holders.values())[:3])
        more = f" and {len(holders) - 3} more" if len(holders) > 3 else ""
        return Verdict(Status.LIVE, f"held by {len(holders)} process(es): {shown}{more}", Evidence.PROC)
    if any(f.lock_held for f in files):
        return Verdict(
            Status.LIVE,
            "kvoffload lock held by a participant (possibly in another PID namespace)",
            Evidence.LOCK,
        )
    opened = next((f.lease.error for f in files if f.lease.held and f.lease.error), None)
    if opened is not None:
        # The lease was granted, then broken before we let go of it: in use from now on.
        return Verdict(Status.LIVE, f"opened during this scan ({opened})", Evidence.LEASE)
    if any(f.lease.held for f in files):
        return Verdict(
            Status.LIVE,
            f"held by a process this scan cannot see: the write lease was refused ({_unseen_cause(view)})",
            Evidence.LEASE,
        )
    if any(f.anonymous_lock for f in files):
        return Verdict(Status.LIVE, "locked by a process outside our PID namespace", Evidence.PROC)
    problems = [f"{f.name}: {f.problem}" for f in files if f.problem]
    if problems:
        return Verdict(Status.UNKNOWN, f"{problems[0]}; liveness unproven", Evidence.PROBE)

    proven = all(f.lease.free for f in files)
    if not proven:
        no_lease = next(f.lease.error for f in files if not f.lease.free) or "not taken"
        blind = view.blind_spots
        if blind:
            who = (
                blind[0].describe()
                if len(blind) == 1
                else f"{len(blind)} processes ({blind[0].describe()}, ...)"
            )
            return Verdict(
                Status.UNKNOWN,
                f"cannot inspect {who} and no write lease ({no_lease}); liveness unproven",
                Evidence.PROC,
            )
        if not view.visibility.complete:
            return Verdict(
                Status.UNKNOWN,
                f"no write lease ({no_lease}) and this /proc does not show every process "
                f"({view.visibility.detail}); liveness unproven",
                Evidence.PROC,
            )
    nobody = (
        "no process anywhere has it open or mapped (write lease granted)"
        if proven
        else f"no process maps or opens it (every process inspected; no write lease: {no_lease})"
    )
    if owner is not None and owner.alive is True:
        return Verdict(Status.UNKNOWN, f"{owner.reason}, yet {nobody}; liveness unproven", Evidence.OWNER)
    if age < grace_s:
        # Whole seconds as the CHANGED column counts them (down), and the wait rounded up: the
        # two add up to the grace period, and "removable in" is never early.
        wait = grace_s - age
        return Verdict(
            Status.STARTING,
            f"{nobody} yet; changed {int(age)}s ago, within the {grace_s:g}s grace period: "
            f"removable in {math.ceil(wait)}s unless it is opened",
            Evidence.AGE,
            wait,
        )
    reason = f"empty base file and {nobody}: its creator died before sizing it" if base_empty else nobody
    if owner is not None:
        reason += f"; {owner.reason}"
    return Verdict(Status.ORPHANED, reason, Evidence.LEASE if proven else Evidence.PROC)


def _unseen_cause(view: ScannerView) -> str:
    if not view.visibility.complete:
        return f"likely a process in another PID namespace: this scan runs in {view.visibility.detail}"
    if view.blind_spots:
        return (
            f"possibly the uninspectable {view.blind_spots[0].describe()}, a process that opened it "
            "after the /proc pass, or an fd in flight between processes"
        )
    return "a process that opened it after the /proc pass, or an fd in flight between processes"
