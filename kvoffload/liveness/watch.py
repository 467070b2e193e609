"""Watch every shm root of a node: scan each pass, reap only what stays orphaned two passes running.

One GPU node runs many engines, each pod's ``/dev/shm`` its own tmpfs (a Kubernetes
``emptyDir`` with ``medium: Memory``, under ``/var/lib/kubelet/pods/UID/volumes/...``). A
``Watcher`` expands its root globs every pass, scans every directory they match with the
same evidence as ``scan`` and, with ``reap``, removes the regions that were ``orphaned`` with
the very same ``(st_dev, st_ino)`` files in the previous pass too.

Invariants:

* Never reap on an old verdict. The previous pass only nominates; the reap itself is the
  library ``reap``, which scans again and proves each region dead again under its lease
  (``only=`` restricts it to the nominated files, by name and inode).
* A region goes whole: it is nominated only when every file of it was orphaned, with the
  same identities, in both passes.
* A root's trouble is an event, never an exit: a root that cannot be read, one that
  vanishes mid-pass (its pod deleted, the tmpfs unmounted) or a ``/proc`` error ends that
  root's turn in this pass and the loop goes on. The state of a vanished root (its
  nominations, its series) is dropped, so memory stays flat while pods come and go.
* Stopping (``should_stop``) is honoured between roots and, inside a reap, between
  regions: what has begun is finished, nothing is left half-removed.

The loop is meant for the main thread: it enters ``lease.sigio_ignored()`` once for all its
passes (only the main thread may ignore ``SIGIO``). Elsewhere the scans run without leases,
fail-closed. A process with other threads (an HTTP server) probes serially (see ``prober``).

Events are values (the dataclasses below); the caller renders them. Nothing here prints.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from kvoffload import procfs
from kvoffload.errors import ConfigError, KvOffloadError, RootError
from kvoffload.liveness import lease
from kvoffload.liveness.holders import HolderIndex, collect_holders
from kvoffload.liveness.reap import ReapReport, reap
from kvoffload.liveness.scan import DEFAULT_ROOT, SCHEMA_VERSION, ScanEntry, ScanReport, Status, scan

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_INTERVAL_S",
    "KUBELET_ROOTS",
    "Event",
    "KeptUnknown",
    "PassReport",
    "PassSummary",
    "Removed",
    "RootAppeared",
    "RootPass",
    "RootUnreadable",
    "RootVanished",
    "Usage",
    "WatchConfig",
    "Watcher",
    "pod_uid_of",
]

DEFAULT_INTERVAL_S = 60.0
#: Longer than scan's 30 s: an agent that reaps on its own should leave a slow start alone.
DEFAULT_GRACE_S = 600.0
#: Every memory-backed emptyDir of every pod on a node, as the kubelet mounts them.
KUBELET_ROOTS = "/var/lib/kubelet/pods/*/volumes/kubernetes.io~empty-dir/*"
_POD_UID = re.compile(r"/pods/([^/]+)/volumes/")
#: How long the loop sleeps at most before it looks at ``should_stop`` again.
_STOP_POLL_S = 0.05

Identities = frozenset[tuple[int, int]]


def pod_uid_of(root: Path | str) -> str | None:
    """The pod UID of a kubelet volume path (``.../pods/<uid>/volumes/...``); None elsewhere."""
    match = _POD_UID.search(str(root))
    return match.group(1) if match else None


@dataclass(frozen=True, slots=True)
class WatchConfig:
    """What to watch and how; validated before anything is scanned."""

    roots: tuple[str, ...] = (str(DEFAULT_ROOT),)
    interval_s: float = DEFAULT_INTERVAL_S
    reap: bool = False
    grace_s: float = DEFAULT_GRACE_S
    all_users: bool = False
    assume_not_holding: frozenset[int] = frozenset()
    use_lease: bool = True
    proc_root: Path = procfs.PROC_ROOT

    def __post_init__(self) -> None:
        if not self.roots:
            raise ConfigError("--root", "no root to watch", fix="pass --root /dev/shm")
        for pattern in self.roots:
            _check_pattern(pattern)
        if self.interval_s < 0:
            raise ConfigError("--interval", f"must not be negative, got {self.interval_s:g}s")
        if self.grace_s < 0:
            raise ConfigError("--grace", f"must not be negative, got {self.grace_s:g}s")
        if self.all_users and os.geteuid() != 0:
            raise ConfigError(
                "--all-users",
                "only root may judge other users' files",
                fix="run as root, or drop --all-users",
            )


def _check_pattern(pattern: str) -> None:
    example = f"pass /dev/shm or a glob such as {KUBELET_ROOTS}"
    if not pattern.strip():
        raise ConfigError("--root", "is empty (it would mean the current directory)", fix=example)
    if "\0" in pattern:
        raise ConfigError("--root", f"{pattern!r} holds a NUL byte", fix=example)
    if not pattern.startswith("/"):
        # An agent's working directory means nothing: a relative glob would watch whatever it is.
        raise ConfigError("--root", f"{pattern!r} is not an absolute path", fix=example)


def literal_roots(patterns: Collection[str]) -> frozenset[Path]:
    """The patterns without glob characters: roots watched whether or not they exist."""
    return frozenset(Path(p) for p in patterns if not glob.has_magic(p))


def expand_roots(patterns: Collection[str]) -> list[Path]:
    """The directories the patterns match now, in order, each once.

    A pattern without glob characters names its root whether or not it exists (a missing
    ``/dev/shm`` is an error to report, not a root that went away); a glob names what it
    matches (a deleted pod's volume simply stops matching).
    """
    found: dict[Path, None] = {}
    for pattern in patterns:
        if not glob.has_magic(pattern):
            found.setdefault(Path(pattern), None)
            continue
        for match in sorted(glob.glob(pattern)):
            if os.path.isdir(match):
                found.setdefault(Path(match), None)
    return list(found)


@dataclass(frozen=True, slots=True)
class Usage:
    """Size and free bytes of a root's filesystem (what ``shutil.disk_usage`` gives)."""

    total: int
    free: int


@dataclass(frozen=True, slots=True)
class Event:
    """Something an operator's log should show; ``event`` names its kind."""

    event: ClassVar[str]
    time: float
    root: Path | None
    pod_uid: str | None


@dataclass(frozen=True, slots=True)
class RootAppeared(Event):
    event: ClassVar[str] = "root_appeared"


@dataclass(frozen=True, slots=True)
class RootVanished(Event):
    event: ClassVar[str] = "root_vanished"


@dataclass(frozen=True, slots=True)
class RootUnreadable(Event):
    """The root could not be scanned; told once per spell (again when the error changes)."""

    event: ClassVar[str] = "root_unreadable"
    error: str = ""


@dataclass(frozen=True, slots=True)
class Removed(Event):
    """One engine's region files removed; ``bytes`` is the resident memory freed."""

    event: ClassVar[str] = "removed"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0


@dataclass(frozen=True, slots=True)
class KeptUnknown(Event):
    """A region nobody could prove dead or alive: kept. Told when it becomes unknown."""

    event: ClassVar[str] = "kept_unknown"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class PassSummary(Event):
    """The end of a pass: ``orphaned_bytes`` is what orphans still pin after it."""

    event: ClassVar[str] = "pass"
    roots: int = 0
    orphaned_bytes: int = 0
    removed_files: int = 0
    seconds: float = 0.0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class RootPass:
    """One root's turn in a pass: the scan that shows the disk as the pass left it, or the error."""

    root: Path
    pod_uid: str | None
    attempted_at: float
    scan_seconds: float
    report: ScanReport | None = None
    usage: Usage | None = None
    error: RootError | None = None
    #: When the root was last scanned successfully (this pass, or an earlier one).
    last_success: float | None = None
    #: The reap of this pass, when something was nominated.
    reaped: ReapReport | None = None


@dataclass(frozen=True, slots=True)
class PassReport:
    """What one pass did. ``vanished`` roots had series before and have none now."""

    number: int
    started_at: float
    seconds: float
    matched: int
    roots: tuple[RootPass, ...]
    vanished: tuple[Path, ...]
    summary: PassSummary
    stopped: bool = False


@dataclass(slots=True)
class _RootState:
    """What a root's next pass needs from this one; dropped when the root vanishes."""

    pod_uid: str | None
    orphaned: dict[str, Identities] = field(default_factory=dict)
    unknown: dict[str, Identities] = field(default_factory=dict)
    error: str | None = None
    last_success: float | None = None


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
        self._literals = literal_roots(config.roots)
        self.passes = 0
        self._holders: HolderIndex | None = None

    @property
    def watched(self) -> tuple[Path, ...]:
        """The roots matched in the last pass (and not vanished since)."""
        return tuple(self._roots)

    def run(
        self, *, max_passes: int | None = None, on_pass: Callable[[PassReport], None] | None = None
    ) -> int:
        """Pass every ``interval_s`` (from the start of one to the next) until stopped; the passes done."""
        done = 0
        with lease.sigio_ignored():
            while not self._should_stop():
                started = self._monotonic()
                report = self.run_pass()
                done += 1
                if on_pass is not None:
                    on_pass(report)
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

    def run_pass(self) -> PassReport:
        self.passes += 1
        started_at = self._clock()
        started = self._monotonic()
        matched = expand_roots(self.config.roots)
        present = set(matched)
        vanished = [root for root in self._roots if root not in present]
        for root in vanished:
            self._vanish(root)
        for root in matched:
            if root not in self._roots:
                state = self._roots[root] = _RootState(pod_uid_of(root))
                self._emit(RootAppeared(self._clock(), root, state.pod_uid))
        results: list[RootPass] = []
        stopped = False
        # One /proc pass for every root: a node with 100 pod volumes reads each process once a
        # pass, not once a root. Each root's scan checks that it covers its files' devices.
        self._holders = self._pass_holders(matched)
        for root in matched:
            if self._should_stop():
                stopped = True
                break
            result = self._watch_root(root)
            if result is None:
                vanished.append(root)
            else:
                results.append(result)
        self._holders = None  # evidence of this pass only
        seconds = self._monotonic() - started
        summary = PassSummary(
            self._clock(),
            None,
            None,
            roots=len(matched),
            orphaned_bytes=sum(r.report.summary.orphaned_resident_bytes for r in results if r.report),
            removed_files=sum(len(r.reaped.removed) for r in results if r.reaped is not None),
            seconds=seconds,
            errors=sum(1 for r in results if r.error is not None),
        )
        self._emit(summary)
        return PassReport(
            self.passes, started_at, seconds, len(matched), tuple(results), tuple(vanished), summary, stopped
        )

    def _emit(self, event: Event) -> None:
        if self._on_event is not None:
            self._on_event(event)

    def _vanish(self, root: Path) -> None:
        state = self._roots.pop(root)
        self._emit(RootVanished(self._clock(), root, state.pod_uid))

    def _pass_holders(self, roots: list[Path]) -> HolderIndex | None:
        devices = set()
        for root in roots:
            with contextlib.suppress(OSError):
                devices.add(os.stat(root).st_dev)
        if not devices:
            return None
        try:
            return collect_holders(self.config.proc_root, devices=devices)
        except OSError:
            return None  # each root's scan then walks /proc itself and reports what fails

    def _scan(self, root: Path, *, fresh: bool = False) -> ScanReport:
        config = self.config
        return scan(
            root,
            grace_s=config.grace_s,
            all_users=config.all_users,
            assume_not_holding=config.assume_not_holding,
            use_lease=config.use_lease,
            proc_root=config.proc_root,
            holders=None if fresh else self._holders,
        )

    def _watch_root(self, root: Path) -> RootPass | None:
        """Scan (and reap) one root; None when it vanished under us."""
        state = self._roots[root]
        attempted_at = self._clock()
        started = self._monotonic()
        reaped = None
        try:
            report = self._scan(root)
            nominated = _nominate(report, state.orphaned) if self.config.reap else {}
            if nominated and not self._should_stop():
                reaped = self._reap(report, nominated)
                self._tell_reaped(root, state, reaped)
                if reaped.removed:
                    # The metrics and the next nominations must show the disk as it is now.
                    report = self._scan(root, fresh=True)
            usage = _usage(root)
        except (KvOffloadError, OSError) as error:
            if root not in self._literals and not os.path.isdir(root):
                self._vanish(root)  # a pod deleted, its volume unmounted and removed mid-pass
                return None
            problem = _as_root_error(root, error)
            if problem.message != state.error:
                state.error = problem.message
                text = problem.message.removeprefix(f"{root}: ")
                self._emit(RootUnreadable(self._clock(), root, state.pod_uid, error=text))
            state.orphaned = {}  # a gap in the evidence: nominations start over
            return RootPass(
                root,
                state.pod_uid,
                attempted_at,
                self._monotonic() - started,
                error=problem,
                last_success=state.last_success,
                reaped=reaped,
            )
        state.error = None
        state.last_success = report.scanned_at
        state.orphaned = _regions_with(report, Status.ORPHANED)
        self._tell_unknown(root, state, report)
        return RootPass(
            root,
            state.pod_uid,
            attempted_at,
            self._monotonic() - started,
            report=report,
            usage=usage,
            last_success=state.last_success,
            reaped=reaped,
        )

    def _reap(self, report: ScanReport, nominated: dict[str, list[ScanEntry]]) -> ReapReport:
        # ``only`` alone picks the files, by name and inode. No engine filter: it would match
        # through fnmatch, whose pattern cache (32,768 entries) would keep every engine id an
        # agent ever reaped, and engines come and go with new ids for as long as it runs.
        config = self.config
        chosen = tuple(e for entries in nominated.values() for e in entries)
        plan = ReapReport(
            schema_version=SCHEMA_VERSION,
            root=report.root,
            dry_run=True,
            removed=chosen,
            kept=(),
            freed_bytes=sum(e.resident_bytes for e in chosen),
            summary=report.summary,
        )
        return reap(
            report.root,
            grace_s=config.grace_s,
            all_users=config.all_users,
            assume_not_holding=config.assume_not_holding,
            use_lease=config.use_lease,
            proc_root=config.proc_root,
            only=plan,
            should_stop=self._should_stop,
        )

    def _tell_reaped(self, root: Path, state: _RootState, reaped: ReapReport) -> None:
        for engine_id, entries in _by_engine(reaped.removed).items():
            files = len(entries)
            freed = sum(e.resident_bytes for e in entries)
            self._emit(
                Removed(self._clock(), root, state.pod_uid, engine_id=engine_id, bytes=freed, files=files)
            )
        # The re-proof can find what the scan could not see (a file that cannot be opened now).
        for engine_id, entries in _by_engine(
            tuple(e for e in reaped.kept if e.status is Status.UNKNOWN)
        ).items():
            self._emit(
                KeptUnknown(
                    self._clock(),
                    root,
                    state.pod_uid,
                    engine_id=engine_id,
                    bytes=sum(e.resident_bytes for e in entries),
                    files=len(entries),
                    reason=entries[0].reason,
                )
            )

    def _tell_unknown(self, root: Path, state: _RootState, report: ScanReport) -> None:
        unknown = _by_engine(report.with_status(Status.UNKNOWN))
        now = {engine: frozenset(e.identity for e in entries) for engine, entries in unknown.items()}
        for engine_id, entries in unknown.items():
            if state.unknown.get(engine_id) == now[engine_id]:
                continue  # told already, and nothing about it changed
            reason = next((e.reason for e in entries if e.segment == 0), entries[0].reason)
            self._emit(
                KeptUnknown(
                    self._clock(),
                    root,
                    state.pod_uid,
                    engine_id=engine_id,
                    bytes=sum(e.resident_bytes for e in entries),
                    files=len(entries),
                    reason=reason,
                )
            )
        state.unknown = now


def _by_engine(entries: tuple[ScanEntry, ...]) -> dict[str, list[ScanEntry]]:
    groups: dict[str, list[ScanEntry]] = {}
    for e in entries:
        groups.setdefault(e.engine_id, []).append(e)
    return groups


def _regions_with(report: ScanReport, status: Status) -> dict[str, Identities]:
    """The identities of each region all of whose files have ``status``."""
    groups = _by_engine(report.entries)
    return {
        engine: frozenset(e.identity for e in entries)
        for engine, entries in groups.items()
        if all(e.status is status for e in entries)
    }


def _nominate(report: ScanReport, before: dict[str, Identities]) -> dict[str, list[ScanEntry]]:
    """Regions orphaned now with exactly the files (by inode) they were orphaned with last pass."""
    now = _regions_with(report, Status.ORPHANED)
    groups = _by_engine(report.entries)
    return {engine: groups[engine] for engine, ids in now.items() if before.get(engine) == ids}


def _usage(root: Path) -> Usage:
    try:
        usage = shutil.disk_usage(root)
    except OSError as e:  # unmounted or removed since the scan opened it
        raise RootError(root, f"cannot read its filesystem's size: {e.strerror or e}") from None
    return Usage(usage.total, usage.free)


def _as_root_error(root: Path, error: BaseException) -> RootError:
    if isinstance(error, RootError):
        return error
    if isinstance(error, OSError):
        return RootError(root, f"{error.strerror or error}")
    return RootError(root, str(error))
