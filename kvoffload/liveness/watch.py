"""Watch every shm root of a node: scan each pass, reap only what stays orphaned two passes running.

One GPU node runs many engines, each pod's ``/dev/shm`` its own tmpfs (a Kubernetes
``emptyDir`` with ``medium: Memory``, under ``/var/lib/kubelet/pods/UID/volumes/...``). A
``Watcher`` matches its root globs every pass, scans every directory they match with the
same evidence as ``scan`` and, with ``reap``, removes the regions that were ``orphaned`` with
the very same ``(st_dev, st_ino)`` files in the previous pass too.

Invariants:

* Never reap on an old verdict. The previous pass only nominates; a root with nominations
  is judged on a ``/proc`` pass of its own, made at its turn, and a region goes only if this
  judgement finds it orphaned with the same files again; the removal is ``reap``'s, which
  locks each region and proves it dead once more under its lease before it unlinks.
* Steady passes are lease-first (``walks``, docs/fleet.md): a region whose files' write
  leases all answer is judged without ``/proc``, with the same verdict, reason and numbers a
  walk would give; ``/proc`` is walked at most once a pass for what a lease cannot answer, and
  every ``walk_every`` passes, so what only a walk yields is at most that many passes old.
* Memory does not grow with files or roots (docs/agent-memory.md). A root is judged a region
  at a time (``ScanStream``) and removed in batches as the judgement goes; what a pass keeps
  of a root is numbers (``RootScan``), and what the next pass needs is one bytes key per
  orphaned region (``region_key``), never an entry.
* A region goes whole: it is nominated only when every file of it was orphaned, with the
  same identities, in both passes.
* A root's trouble is an event, never an exit: a root that cannot be read, one that
  vanishes mid-pass (its pod deleted, the tmpfs unmounted) or a ``/proc`` error ends that
  root's turn in this pass and the loop goes on. The state of a vanished root (its
  nominations, its series) is dropped, so memory stays flat while pods come and go.
* Stopping (``should_stop``) is honoured between roots and, inside a reap, between
  regions: what has begun is finished, nothing is left half-removed.
* Roots have borders (``roots``, ``docs/watch-roots.md``). A path the operator gave is
  resolved once, when the ``Watcher`` is made (``root_resolved`` says so where a symlink was
  in it); every pass opens it again with no symlink allowed anywhere in it, and below a
  glob's fixed part no symlink is followed at all. The scan and the reap act on the root's
  directory fd (``root_fd``), never on its path again; one root is open at a time.
* A root is pinned by ``(st_dev, st_ino, mount id)`` when first seen: another directory at
  its path is a new root (``root_replaced``), and nothing nominated in the old one carries over.
* Removal happens only on a tmpfs or hugetlbfs unless ``any_filesystem``: elsewhere the
  root is scanned and ``removal_refused`` says why nothing goes.
* Judging is not removing. As root the agent judges every user's files (``scan``'s default),
  but removes a region with a file of another uid only with ``all_users=True``
  (``--all-users``); without it such an orphan stays, counted, never nominated, and
  ``kept_other_user`` says so once (again when its files change).
* Nothing is silent: a glob whose fixed part does not exist when the ``Watcher`` is made is a
  ``ConfigError`` naming the kubelet directories of the common distributions
  (``KUBELET_DIRECTORIES``); a glob that matches nothing in a pass is a ``root_no_match``
  event in that pass, every pass.
* ``on_pass`` (the metrics) records a pass before its ``pass`` event is emitted.

The loop is meant for the main thread: it enters ``lease.sigio_ignored()`` once for all its
passes (only the main thread may ignore ``SIGIO``). Elsewhere the scans run without leases,
fail-closed. A process with other threads (an HTTP server) probes serially (see ``prober``).

This module is the loop: which roots a pass has (``roots``), what each root's turn judges and
nominates, what the next pass must remember. A root's removal is ``watch_reap``'s, its
numbers ``tally``'s. Events are values (``events``); the caller renders them. Nothing here
prints.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Unpack

from kvoffload.errors import ConfigError, KvOffloadError, RootError
from kvoffload.liveness import lease, roots
from kvoffload.liveness.events import (
    Event,
    KeptOtherUser,
    KeptParked,
    KeptUnknown,
    ParkedSettled,
    ParkRemoved,
    ParkUntrusted,
    PassReport,
    PassSummary,
    RemovalFailed,
    RemovalRefused,
    Removed,
    RemovedFile,
    RootAppeared,
    RootNoMatch,
    RootPass,
    RootReap,
    RootReplaced,
    RootResolved,
    RootScan,
    RootUnreadable,
    RootVanished,
    Usage,
)
from kvoffload.liveness.holders import HolderIndex
from kvoffload.liveness.listing import uids_text
from kvoffload.liveness.park import UntrustedPark
from kvoffload.liveness.report import ScanEntry
from kvoffload.liveness.roots import (
    KUBELET_DIRECTORIES,
    KUBELET_ROOTS,
    RootIdentity,
    pod_uid_of,
    root_identity,
)
from kvoffload.liveness.scan import DEFAULT_ROOT, ScanKeywords, ScanOptions, ScanStream, Status
from kvoffload.liveness.tally import Tally
from kvoffload.liveness.walks import DEFAULT_WALK_EVERY, ProcWalks
from kvoffload.liveness.watch_reap import REMOVAL_BATCH_FILES, RootReaper, by_engine, region_key
from kvoffload.shm import mounts

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_SCAN",
    "DEFAULT_TOP_ENGINES",
    "DEFAULT_WALK_EVERY",
    "WatchConfig",
    "Watcher",
]
#: Moved to ``kvoffload.liveness.events`` and ``kvoffload.liveness.roots``; kept here for one
#: release (issue #29).
__all__ += [
    "KUBELET_DIRECTORIES",
    "KUBELET_ROOTS",
    "Event",
    "KeptOtherUser",
    "KeptParked",
    "KeptUnknown",
    "ParkRemoved",
    "ParkUntrusted",
    "ParkedSettled",
    "PassReport",
    "PassSummary",
    "RemovalFailed",
    "RemovalRefused",
    "Removed",
    "RemovedFile",
    "RootAppeared",
    "RootIdentity",
    "RootNoMatch",
    "RootPass",
    "RootReap",
    "RootReplaced",
    "RootResolved",
    "RootScan",
    "RootUnreadable",
    "RootVanished",
    "Usage",
    "pod_uid_of",
    "root_identity",
]

DEFAULT_INTERVAL_S = 60.0
#: Longer than scan's 30 s: an agent that reaps on its own should leave a slow start alone.
DEFAULT_GRACE_S = 600.0
#: Orphaned engines named per root (``--top-engines``); the rest are summed.
DEFAULT_TOP_ENGINES = 10
#: How long the loop sleeps at most before it looks at ``should_stop`` again.
_STOP_POLL_S = 0.05


#: How the agent judges a root unless told otherwise: ``scan``'s defaults, with its own grace.
DEFAULT_SCAN = ScanOptions(grace_s=DEFAULT_GRACE_S)


@dataclass(frozen=True, slots=True, init=False)
class WatchConfig:
    """What to watch and how; validated before anything is scanned.

    ``scan`` is how every root is judged (``ScanOptions``, grace ``DEFAULT_GRACE_S``). Its
    ``all_users`` is whose files are judged, as ``scan``'s (None: every user's as root); only
    True removes another user's (``--all-users``). The settings given as separate keywords
    (``grace_s=0``) are laid over ``scan``, kept for one release (issue #29).
    """

    roots: tuple[str, ...]
    interval_s: float
    reap: bool
    scan: ScanOptions
    #: Remove on any filesystem, not only a tmpfs or hugetlbfs (``--any-filesystem``).
    any_filesystem: bool
    #: Orphaned engines a root's ``RootScan`` names (the largest); the rest are one sum.
    top_engines: int
    #: A pass walks ``/proc`` at least every this many passes (``--walk-every``; 1: every
    #: pass); between, leases decide and the walk-only numbers are the last walk's (``walks``).
    walk_every: int

    def __init__(
        self,
        roots: tuple[str, ...] = (str(DEFAULT_ROOT),),
        interval_s: float = DEFAULT_INTERVAL_S,
        reap: bool = False,
        *,
        scan: ScanOptions | None = None,
        any_filesystem: bool = False,
        top_engines: int = DEFAULT_TOP_ENGINES,
        walk_every: int = DEFAULT_WALK_EVERY,
        **legacy: Unpack[ScanKeywords],
    ) -> None:
        # A frozen dataclass's own __init__ sets its fields so too.
        object.__setattr__(self, "roots", roots)
        object.__setattr__(self, "interval_s", interval_s)
        object.__setattr__(self, "reap", reap)
        object.__setattr__(self, "scan", ScanOptions.of(scan, legacy, default=DEFAULT_SCAN))
        object.__setattr__(self, "any_filesystem", any_filesystem)
        object.__setattr__(self, "top_engines", top_engines)
        object.__setattr__(self, "walk_every", walk_every)
        self._check()

    def _check(self) -> None:
        if not self.roots:
            raise ConfigError("--root", "no root to watch", fix="pass --root /dev/shm")
        for pattern in self.roots:
            roots.check_pattern(pattern)
        if self.interval_s < 0:
            raise ConfigError("--interval", f"must not be negative, got {self.interval_s:g}s")
        if self.scan.grace_s < 0:
            raise ConfigError("--grace", f"must not be negative, got {self.scan.grace_s:g}s")
        if self.top_engines < 0:
            raise ConfigError("--top-engines", f"must not be negative, got {self.top_engines}")
        if self.walk_every < 1:
            raise ConfigError(
                "--walk-every",
                f"must be at least 1, got {self.walk_every}",
                fix="pass --walk-every 1 to walk every pass",
            )
        if self.scan.all_users and os.geteuid() != 0:
            raise ConfigError(
                "--all-users",
                "only root may judge other users' files",
                fix="run as root, or drop --all-users",
            )

    # The scan settings as they were read before ``scan`` held them: kept here for one
    # release (issue #29).

    @property
    def grace_s(self) -> float:
        return self.scan.grace_s

    @property
    def all_users(self) -> bool | None:
        return self.scan.all_users

    @property
    def assume_not_holding(self) -> frozenset[int]:
        return self.scan.assume_not_holding

    @property
    def use_lease(self) -> bool:
        return self.scan.use_lease

    @property
    def proc_root(self) -> Path:
        return self.scan.proc_root


#: No region (``_RootState``'s sets, shared by every root that has none).
_NO_REGIONS: frozenset[bytes] = frozenset()


@dataclass(slots=True)
class _RootState:
    """What a root's next pass needs from this one; dropped when the root vanishes.

    Regions are remembered by ``region_key`` (engine id and the identities of its files, in
    one bytes object): a root of 100,000 orphans is a few MiB of keys, not its entries.
    """

    pod_uid: str | None
    #: Regions orphaned in the last pass, every file of them (kept only where removal is allowed).
    orphaned: frozenset[bytes] = _NO_REGIONS
    #: Regions told ``kept_unknown`` in the last pass (told again only when one changes).
    unknown: frozenset[bytes] = _NO_REGIONS
    #: Regions told ``kept_other_user`` in the last pass (likewise).
    others: frozenset[bytes] = _NO_REGIONS
    #: Regions told ``kept_parked`` in the last pass (likewise).
    held: frozenset[bytes] = _NO_REGIONS
    #: Look-alike park directories told ``park_untrusted`` in the last pass (likewise).
    untrusted: frozenset[bytes] = _NO_REGIONS
    error: str | None = None
    last_success: float | None = None
    #: The directory first seen at the root's path (pinned: another one there is a new root).
    identity: RootIdentity | None = None
    #: Why removal is refused here, as last told (None while removal is allowed).
    refused: str | None = None


class Watcher:
    """The pass loop; ``run`` from the main thread, or ``run_pass`` one pass at a time."""

    def __init__(
        self,
        config: WatchConfig,
        *,
        on_event: Callable[[Event], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._on_event = on_event
        self._should_stop = should_stop or (lambda: False)
        self._clock = clock
        self._monotonic = monotonic
        self._roots: dict[Path, _RootState] = {}
        # Resolved once, here: every pass opens what these name, never through a symlink.
        self._patterns = tuple(roots.Pattern.of(p) for p in config.roots)
        self._resolutions = {
            pattern.fixed: pattern.target for pattern in self._patterns if pattern.target != pattern.fixed
        }
        self.passes = 0
        #: The last ``/proc`` walk, kept across passes, and this pass's (``walks``).
        self.walks = ProcWalks(config.scan.proc_root, every=config.walk_every, clock=clock)
        #: Whose regions may be removed: the agent's uid's, or (``all_users``) everyone's.
        self._remover = None if config.scan.all_users else os.geteuid()

    @property
    def watched(self) -> tuple[Path, ...]:
        """The roots matched in the last pass (and not vanished since)."""
        return tuple(self._roots)

    def run(
        self, *, max_passes: int | None = None, on_pass: Callable[[PassReport], None] | None = None
    ) -> int:
        """Pass every ``interval_s`` (from the start of one to the next) until stopped; the passes done.

        ``on_pass`` gets each pass's report before its ``pass`` event is emitted (``run_pass``).
        """
        done = 0
        with lease.sigio_ignored():
            while not self._should_stop():
                started = self._monotonic()
                report = self.run_pass(on_pass=on_pass)
                done += 1
                if report.stopped or (max_passes is not None and done >= max_passes):
                    break
                self._sleep_until(started + self.config.interval_s)
        return done

    def _sleep_until(self, deadline: float) -> None:
        while not self._should_stop():
            left = deadline - self._monotonic()
            if left <= 0:
                return
            time.sleep(min(left, _STOP_POLL_S))

    def run_pass(self, *, on_pass: Callable[[PassReport], None] | None = None) -> PassReport:
        """One pass over every root. ``on_pass`` (the metrics) records the report before the
        ``pass`` event is emitted: whoever reads that event and then scrapes sees this pass."""
        self.passes += 1
        started_at = self._clock()
        started = self._monotonic()
        if self.passes == 1:
            for given, target in self._resolutions.items():
                self._emit(RootResolved(self._clock(), given, pod_uid_of(given), target=target))
        # The fixed part of each glob, open for the pass: its matches are found and opened
        # again below this very directory. One fd per pattern, one more per root being scanned.
        with contextlib.ExitStack() as bases_open:
            bases = roots.open_bases(self._patterns, bases_open)
            matched = self._match(bases)
            present = {m.path for m in matched}
            vanished = [root for root in self._roots if root not in present]
            for root in vanished:
                self._vanish(root)
            for m in matched:
                if m.path not in self._roots:
                    state = self._roots[m.path] = _RootState(pod_uid_of(m.path))
                    self._emit(RootAppeared(self._clock(), m.path, state.pod_uid))
            results: list[RootPass] = []
            stopped = False
            # At most one /proc walk for every root: a node with 100 pod volumes reads each process
            # once a pass, not once a root, and in a steady pass not at all (leases decide).
            self._begin_walks(matched)
            for m in matched:
                if self._should_stop():
                    stopped = True
                    break
                result = self._watch_root(m, bases)
                if result is None:
                    vanished.append(m.path)
                else:
                    results.append(result)
        seconds = self._monotonic() - started
        walks = self.walks
        summary = PassSummary(
            self._clock(),
            None,
            None,
            roots=len(matched),
            orphaned_bytes=sum(r.report.summary.orphaned_resident_bytes for r in results if r.report),
            removed_files=sum(len(r.reaped.removed) for r in results if r.reaped is not None),
            seconds=seconds,
            errors=sum(1 for r in results if r.error is not None),
            proc_walks=tuple(walks.reasons),
        )
        report = PassReport(
            self.passes,
            started_at,
            seconds,
            len(matched),
            tuple(results),
            tuple(vanished),
            summary,
            stopped,
            proc_walks=tuple(walks.reasons),
            proc_walk_at=walks.last_at,
        )
        if on_pass is not None:
            on_pass(report)
        self._emit(summary)
        return report

    def _emit(self, event: Event) -> None:
        if self._on_event is not None:
            self._on_event(event)

    def _vanish(self, root: Path) -> None:
        state = self._roots.pop(root)
        self._emit(RootVanished(self._clock(), root, state.pod_uid))

    def _match(self, bases: dict[roots.Pattern, int]) -> list[roots.Match]:
        """The roots of this pass, in order, each once.

        A plain root is a root whether or not it exists (a missing ``/dev/shm`` is an error to
        report, not a root that went away); a glob names the directories it matches (a
        deleted pod's volume simply stops matching), never a symlink nor anything below one.
        A glob that matches nothing is told (``root_no_match``) every pass it does not.
        """
        found: dict[Path, roots.Match] = {}
        for pattern in self._patterns:
            if pattern.literal:
                if pattern.fixed not in found:
                    found[pattern.fixed] = roots.Match(
                        pattern.fixed, pattern, (), roots.device_of(pattern.resolved)
                    )
                continue
            base = bases.get(pattern)
            matches = 0
            for below, dev in roots.walk(base, pattern.steps) if base is not None else ():
                matches += 1
                path = pattern.fixed.joinpath(*below)
                if path not in found:
                    found[path] = roots.Match(path, pattern, below, dev)
            if not matches:
                self._emit(RootNoMatch(self._clock(), None, None, pattern=pattern.text))
        return list(found.values())

    def _begin_walks(self, matched: list[roots.Match]) -> None:
        """Walk ``/proc`` now if this pass must (its first, every ``walk_every`` passes, without
        leases, a device the last walk did not record); else its roots are judged lease-first."""
        devices = {m.dev for m in matched if m.dev is not None}
        reason = self.walks.begin(self.passes, devices, use_lease=self.config.scan.use_lease)
        if reason is None or not devices:
            return
        # On an error each root's scan walks /proc itself and reports what fails.
        with contextlib.suppress(OSError):
            self.walks.walk(reason)

    def _evidence(self, fresh: bool) -> HolderIndex | None:
        """The holders a root's stream starts from: this pass's walk, or the last one (the stream
        is then lease-first), or None (it walks on its own)."""
        walks = self.walks
        if fresh:
            # Nominations: judged on a walk made at this root's turn, whatever the pass has.
            with contextlib.suppress(OSError):
                walks.walk("removal")
            return walks.last if walks.fresh else None
        if walks.failed or not walks.devices:
            return None
        return walks.last

    def _watch_root(self, match: roots.Match, bases: dict[roots.Pattern, int]) -> RootPass | None:
        """Scan (and reap) one root; None when it vanished under us."""
        root = match.path
        state = self._roots[root]
        attempted_at = self._clock()
        started = self._monotonic()
        tally = Tally(self.config.top_engines)
        try:
            with roots.opened(match, bases) as fd:
                self._pin(root, state, fd)
                removable = self._may_remove(root, state, fd)
                scanned = self._judge(root, state, fd, tally, removable=removable)
                usage = _usage(root, fd)
        except roots.Gone:
            self._vanish(root)  # no directory at the name any more: the glob does not match it
            return None
        except (KvOffloadError, OSError) as error:
            if not match.pattern.literal and not roots.still_matches(match, bases):
                self._vanish(root)  # a pod deleted, its volume unmounted and removed mid-pass
                return None
            problem = _as_root_error(root, error)
            if problem.message != state.error:
                state.error = problem.message
                text = problem.message.removeprefix(f"{root}: ")
                self._emit(RootUnreadable(self._clock(), root, state.pod_uid, error=text))
            state.orphaned = _NO_REGIONS  # a gap in the evidence: nominations start over
            return RootPass(
                root,
                state.pod_uid,
                attempted_at,
                self._monotonic() - started,
                error=problem,
                last_success=state.last_success,
                reaped=tally.reaped(),
            )
        state.error = None
        state.last_success = scanned.scanned_at
        return RootPass(
            root,
            state.pod_uid,
            attempted_at,
            self._monotonic() - started,
            report=scanned,
            usage=usage,
            last_success=state.last_success,
            reaped=tally.reaped(),
        )

    def _judge(self, root: Path, state: _RootState, fd: int, tally: Tally, *, removable: bool) -> RootScan:
        """Judge the root a region at a time (``ScanStream``), remove what was orphaned with the
        same files in the last pass too, and keep only numbers and the next nominations.

        A region goes to the library's removal (``reap``'s, which locks it and proves it dead
        again under its lease) in batches as the stream reaches it; nothing but the batch at
        hand and the keys of the regions is held, however many files the root has.
        """
        config = self.config
        before = state.orphaned
        # Where something may be removed, the verdicts rest on a /proc pass made now: the pass's
        # one walk for every root can be minutes old by the time a root's turn comes.
        fresh = removable and bool(before)
        orphaned: set[bytes] = set()
        unknown: set[bytes] = set()
        others: set[bytes] = set()
        held: set[bytes] = set()
        untrusted: set[bytes] = set()
        pending: list[tuple[ScanEntry, ...]] = []
        pending_files = 0
        holders = self._evidence(fresh)
        with ScanStream(root, config.scan, holders=holders, root_fd=fd, walks=self.walks) as stream:
            reaper = RootReaper(
                root,
                state.pod_uid,
                stream,
                tally,
                options=config.scan,
                remover=self._remover,
                emit=self._emit,
                clock=self._clock,
                should_stop=self._should_stop,
            )
            judged = stream.parked()
            parks, parked = judged.parks, judged.parked
            self._tell_untrusted(root, state, judged.untrusted, untrusted)
            # What a dead reaper left parked is settled every pass (a live file must get its name
            # back now; a dead one was proven dead before it was parked, and is proven dead again
            # under its lease before it goes). A region with files parked (in a trusted park: no
            # other is even listed) is not nominated, if they are its own: same engine and owner.
            waiting = _parked_by(parked)
            if removable and any(p.running is False for p in parks) and not self._should_stop():
                reaper.settle(parks, parked)
            else:
                for entries in by_engine(parked).values():
                    tally.count(entries)
            for region in stream.regions():
                if removable and all(e.status is Status.ORPHANED for e in region):
                    key = region_key(region)
                    foreign = self._foreign_uids(region)
                    waits = _waiting_for(region, waiting)
                    if foreign:
                        self._tell_other_user(root, state, region, key, foreign, others)
                    elif waits:
                        self._tell_held(root, state, region, key, waits, held)
                        orphaned.add(key)
                    elif key in before and not self._should_stop():
                        pending.append(region)
                        pending_files += len(region)
                        if pending_files >= REMOVAL_BATCH_FILES:
                            reaper.remove(pending, orphaned)
                            pending, pending_files = [], 0
                        continue
                    else:
                        orphaned.add(key)
                elif any(e.status is Status.UNKNOWN for e in region):
                    self._tell_unknown(root, state, region, unknown)
                tally.count(region)
            if pending:
                reaper.remove(pending, orphaned)
            scanned = tally.scan(root, stream)
        # Most roots have neither: one shared empty set, not two new ones per root and pass.
        state.orphaned = frozenset(orphaned) if orphaned else _NO_REGIONS
        state.unknown = frozenset(unknown) if unknown else _NO_REGIONS
        state.others = frozenset(others) if others else _NO_REGIONS
        state.held = frozenset(held) if held else _NO_REGIONS
        state.untrusted = frozenset(untrusted) if untrusted else _NO_REGIONS
        return scanned

    def _tell_held(
        self,
        root: Path,
        state: _RootState,
        region: tuple[ScanEntry, ...],
        key: bytes,
        waits: list[ScanEntry],
        told: set[bytes],
    ) -> None:
        """``kept_parked`` for an orphaned region whose own files wait parked, once."""
        told.add(key)
        if key in state.held:
            return
        first = waits[0]
        assert first.parked is not None
        state_word = "its reaper runs" if first.parked.reaper_running else "its reaper is dead"
        self._emit(
            KeptParked(
                self._clock(),
                root,
                state.pod_uid,
                engine_id=region[0].engine_id,
                bytes=sum(e.resident_bytes for e in region),
                files=len(region),
                reason=(
                    f"orphaned, but {len(waits)} file(s) of its region wait in {first.parked.directory} "
                    f"({state_word}): removed once they are settled"
                ),
            )
        )

    def _tell_untrusted(
        self, root: Path, state: _RootState, found: Sequence[UntrustedPark], told: set[bytes]
    ) -> None:
        """``park_untrusted`` for each look-alike park directory, once while it stays as it is."""
        for u in found:
            key = "\0".join((u.name, u.kind, str(u.uid), u.mode, u.reason)).encode("utf-8", "surrogatepass")
            told.add(key)
            if key in state.untrusted:
                continue
            self._emit(
                ParkUntrusted(
                    self._clock(),
                    root,
                    state.pod_uid,
                    name=u.name,
                    kind=u.kind,
                    uid=u.uid,
                    mode=u.mode,
                    reason=u.reason,
                )
            )

    def _foreign_uids(self, region: Sequence[ScanEntry]) -> tuple[int, ...]:
        """The uids of the region's files that keep it from being removed (none with ``all_users``)."""
        if self._remover is None:
            return ()
        return tuple(sorted({e.uid for e in region if e.uid != self._remover}))

    def _tell_other_user(
        self,
        root: Path,
        state: _RootState,
        region: tuple[ScanEntry, ...],
        key: bytes,
        uids: tuple[int, ...],
        told: set[bytes],
    ) -> None:
        """``kept_other_user`` for another user's orphaned region, once (again if its files change)."""
        told.add(key)
        if key in state.others:
            return
        owners = uids_text(uids)
        self._emit(
            KeptOtherUser(
                self._clock(),
                root,
                state.pod_uid,
                engine_id=region[0].engine_id,
                bytes=sum(e.resident_bytes for e in region),
                files=len(region),
                uids=uids,
                reason=f"orphaned, owned by {owners}: another user's region is removed only with --all-users",
            )
        )

    def _tell_unknown(
        self, root: Path, state: _RootState, region: tuple[ScanEntry, ...], told: set[bytes]
    ) -> None:
        """``kept_unknown`` for a region that became unknown (or changed files since it was told)."""
        key = region_key(region)
        told.add(key)
        if key in state.unknown:
            return  # told already, and nothing about it changed
        reason = next((e.reason for e in region if e.segment == 0), region[0].reason)
        self._emit(
            KeptUnknown(
                self._clock(),
                root,
                state.pod_uid,
                engine_id=region[0].engine_id,
                bytes=sum(e.resident_bytes for e in region),
                files=len(region),
                reason=reason,
            )
        )

    def _pin(self, root: Path, state: _RootState, fd: int) -> None:
        """Hold the root to the directory first seen at its path; another one there is a new root."""
        identity = root_identity(fd)
        if state.identity is not None and identity != state.identity:
            self._emit(RootReplaced(self._clock(), root, state.pod_uid, old=state.identity, new=identity))
            # Nothing seen in the old directory carries over: two passes over this one first.
            state.orphaned = _NO_REGIONS
            state.unknown = _NO_REGIONS
            state.others = _NO_REGIONS
        state.identity = identity

    def _may_remove(self, root: Path, state: _RootState, fd: int) -> bool:
        """Whether this pass may remove anything in the root; a refusal is told once per spell."""
        config = self.config
        if not config.reap:
            return False
        if config.any_filesystem or mounts.memory_filesystem(fd) is not None:
            state.refused = None
            return True
        kind = roots.filesystem_type(fd, state.identity.mnt_id if state.identity else None)
        reason = (
            f"not on a tmpfs or hugetlbfs ({kind}): region files are removed only where they live; "
            "scanned, nothing removed (pass --any-filesystem to remove anyway)"
        )
        if reason != state.refused:
            state.refused = reason
            self._emit(RemovalRefused(self._clock(), root, state.pod_uid, reason=reason))
        return False


def _parked_by(parked: Iterable[ScanEntry]) -> dict[tuple[str, int], list[ScanEntry]]:
    """Parked files by (engine id, owner uid): a region is held back by the files of its own."""
    found: dict[tuple[str, int], list[ScanEntry]] = {}
    for e in parked:
        found.setdefault((e.engine_id, e.uid), []).append(e)
    return found


def _waiting_for(
    region: Sequence[ScanEntry], parked: Mapping[tuple[str, int], list[ScanEntry]]
) -> list[ScanEntry]:
    """The parked files that are ``region``'s own: its engine id, and an owner of its files."""
    if not parked:
        return []
    engine_id = region[0].engine_id
    return [p for uid in sorted({e.uid for e in region}) for p in parked.get((engine_id, uid), ())]


def _usage(root: Path, fd: int) -> Usage:
    """What ``shutil.disk_usage`` gives, read from the root's fd (never its path again)."""
    try:
        vfs = os.fstatvfs(fd)
    except OSError as e:
        raise RootError(root, f"cannot read its filesystem's size: {e.strerror or e}") from None
    return Usage(vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize)


def _as_root_error(root: Path, error: BaseException) -> RootError:
    if isinstance(error, RootError):
        return error
    if isinstance(error, OSError):
        return RootError(root, f"{error.strerror or error}")
    return RootError(root, str(error))
