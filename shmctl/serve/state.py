"""The agent's numbers between passes and scrapes: ``WatchMetrics``.

The pass loop (the main thread) records each finished pass; the HTTP thread builds a fresh
``Exposition`` from the latest numbers per scrape. Both take one lock, which the pass loop
holds only to record a finished pass, so a scrape never waits on a scan.

``WatchMetrics`` keeps the latest numbers of every root (never a scan's entries) and the reap
counters. Series of vanished roots are dropped with their state, and past ``top_roots`` roots
the rest are folded into ``root="other"``, so a scrape stays bounded however many pods come
and go (docs/agent-memory.md). The exposition itself (families, labels, escaping) is
``shmctl.render.metrics``'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvoffload.errors import ConfigError
from kvoffload.liveness import lease
from kvoffload.liveness.events import PassReport, RootPass
from kvoffload.liveness.roots import pod_uid_of
from shmctl.render.metrics import (
    DEFAULT_TOP_ENGINES,
    DEFAULT_TOP_ROOTS,
    OTHER_ROOTS,
    Exposition,
    ReapCounters,
    RootNumbers,
    RootSeries,
    label_text,
    rank_roots,
)


class WatchMetrics:
    """The latest numbers of every watched root, as one exposition per scrape.

    A root is kept as ``RootSeries`` (numbers, never a scan's entries), so this holds a few
    hundred bytes per root whatever its files. A scrape names the ``top_roots`` roots whose
    orphans pin most memory and folds the others into ``root="other"`` (``add_watched``): its
    size is bounded however many roots the node has. The reap counters of a root count from
    when it was first seen; while a root is folded its removals count in ``root="other"``'s
    counters instead, so that every exported counter only ever grows.
    """

    def __init__(
        self,
        *,
        interval_s: float,
        top_engines: int = DEFAULT_TOP_ENGINES,
        top_roots: int = DEFAULT_TOP_ROOTS,
        reaping: bool = False,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        if top_roots < 0:
            raise ConfigError("--top-roots", f"must not be negative, got {top_roots}")
        self._lock = threading.Lock()
        self._latest: dict[Path, RootSeries] = {}
        #: Every root's removals since it was first seen, by label (exported while it is named).
        self._counters = ReapCounters()
        #: Removals in roots that were folded when they happened (``root="other"``'s counters).
        self._other_files = 0
        self._other_bytes = 0
        self._other_conflicts = 0
        self._named: frozenset[str] = frozenset()
        self._top_engines = top_engines
        self._top_roots = top_roots
        self._interval_s = interval_s
        #: With --reap every watched root has its counters, from 0: ``increase()`` then counts
        #: a root's first removal too (a series that starts at 1 would hide it).
        self._reaping = reaping
        self._monotonic = monotonic
        self._passes = 0
        self._roots = 0
        self._pass_seconds: float | None = None
        self._last_pass_done: float | None = None
        #: ``/proc`` walks by reason since the start, and when the last one was made.
        self._walks: dict[str, int] = {}
        self._walk_at: float | None = None
        self.alive = True

    def record(self, report: PassReport) -> None:
        with self._lock:
            for root in report.vanished:
                self._latest.pop(root, None)
                self._counters.forget(root)
            for result in report.roots:
                series = self._series(result)
                if series is not None:
                    self._latest[result.root] = series
            self._named = rank_roots(self._latest.values(), self._top_roots)
            for result in report.roots:
                label = label_text(str(result.root))
                reaped = result.reaped
                files = len(reaped.removed) if reaped is not None else 0
                freed = reaped.freed_bytes if reaped is not None else 0
                conflicts = reaped.conflicts if reaped is not None else 0
                if files or conflicts or self._reaping:
                    self._counters.add(label, files, freed, conflicts)
                if label not in self._named:
                    self._other_files += files
                    self._other_bytes += freed
                    self._other_conflicts += conflicts
            for reason in report.proc_walks:
                self._walks[reason] = self._walks.get(reason, 0) + 1
            self._walk_at = report.proc_walk_at
            self._passes += 1
            self._roots = report.matched
            self._pass_seconds = report.seconds
            self._last_pass_done = self._monotonic()

    def _series(self, result: RootPass) -> RootSeries | None:
        label = label_text(str(result.root))
        pod_uid = pod_uid_of(label) or ""
        if result.report is not None and result.usage is not None:
            numbers = RootNumbers.of_watch(
                result.report, result.usage, scan_seconds=result.scan_seconds, top_engines=self._top_engines
            )
            return RootSeries(label, pod_uid, result.attempted_at, result.last_success, numbers=numbers)
        if result.error is None:
            return None
        problem = result.error.message.removeprefix(f"{result.error.root}: ")
        return RootSeries(label, pod_uid, result.attempted_at, result.last_success, error=problem)

    @property
    def series_roots(self) -> tuple[Path, ...]:
        """Every root that has series now, named or folded into ``root="other"``."""
        with self._lock:
            return tuple(self._latest)

    def text(self) -> bytes:
        with self._lock:
            exposition = Exposition(top_engines=self._top_engines, pod_uid_label=True)
            exposition.add_lease_break_time(lease.break_time_s())
            exposition.add_watched(tuple(self._latest.values()), self._named)
            exposition.add_reaps(self._exported_counters())
            exposition.add_watch(
                up=self.alive, passes=self._passes, roots=self._roots, pass_seconds=self._pass_seconds
            )
            exposition.add_proc_walks(self._walks, self._walk_at)
            return exposition.text()

    def _exported_counters(self) -> ReapCounters:
        named = self._named
        counters = ReapCounters(
            {label: n for label, n in self._counters.files.items() if label in named},
            {label: n for label, n in self._counters.resident_bytes.items() if label in named},
            {label: n for label, n in self._counters.conflicts.items() if label in named},
        )
        folded = len(self._latest) > len(named)
        if self._other_files or self._other_conflicts or (folded and self._reaping):
            counters.add(OTHER_ROOTS, self._other_files, self._other_bytes, self._other_conflicts)
        return counters

    def healthy(self) -> bool:
        """Alive, and a pass finished within three intervals (at least a second: a busy loop)."""
        with self._lock:
            done = self._last_pass_done
        if not self.alive or done is None:
            return False
        return self._monotonic() - done <= 3 * max(self._interval_s, 1.0)
