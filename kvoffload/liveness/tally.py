"""One root's numbers in a pass of the agent, added up a region at a time (``RootScan``).

The agent judges a root as a stream (``ScanStream``) and keeps no entry past its region:
each region is counted here as the pass leaves it (removed, kept, given back), and only the
counts, the largest orphaned engines and what was removed survive the pass. The engines are
trimmed to ``top_engines`` as they come, so memory does not grow with the root.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kvoffload.liveness.events import RemovedFile, RootReap, RootScan
from kvoffload.liveness.report import ScanEntry, SummaryCount
from kvoffload.liveness.scan import Status

if TYPE_CHECKING:
    from kvoffload.liveness.holders import DeletedMapping, Uninspected

__all__ = ["OTHER_ENGINES", "Judged", "Tally"]

#: The engine id under which an exposition sums the orphaned engines it does not name.
OTHER_ENGINES = "other"


class Judged(Protocol):
    """What ``Tally.scan`` reads of the scan it counted: a ``ScanStream`` (the agent's), or a
    ``oneshot.JudgedRoot`` (``shmctl metrics``'s)."""

    @property
    def scanned_at(self) -> float: ...

    @property
    def uninspected(self) -> tuple[Uninspected, ...]: ...

    @property
    def deleted(self) -> tuple[DeletedMapping, ...]: ...


class Tally:
    """One root's numbers, added up a region at a time as the pass leaves it (``RootScan``)."""

    def __init__(self, top_engines: int) -> None:
        #: Files, bytes and waits by status: the summary's numbers, counted as ``scan``'s are.
        self.counted = SummaryCount()
        self.regions = dict.fromkeys(Status, 0)
        self.region_size_max = 0
        self.top_engines = top_engines
        #: Candidates for the named engines, as (-bytes, engine id): at most twice the names kept.
        self._engines: list[tuple[int, str]] = []
        self._other = 0
        self.removed: list[RemovedFile] = []
        self.freed = 0
        self.restored = 0
        self.conflicts = 0
        #: A dead reaper's park was settled (the pass reaped, even if nothing went).
        self.settled = False
        self._reaped = False

    def count(self, entries: Sequence[ScanEntry]) -> None:
        """One engine's files as they stand after the pass."""
        self.counted.add(entries)
        size = 0
        orphaned: int | None = None
        for e in entries:
            size += e.size_bytes
            if e.status is Status.ORPHANED:
                orphaned = (orphaned or 0) + e.resident_bytes
        for status in {e.status for e in entries}:
            self.regions[status] += 1
        self.region_size_max = max(self.region_size_max, size)
        if orphaned is not None and entries[0].engine_id == OTHER_ENGINES:
            # The exposition sums the engines it does not name as "other": one really named so
            # is summed with them, so it must not take a named engine's place here either.
            self._other += orphaned
        elif orphaned is not None:
            self._engines.append((-orphaned, entries[0].engine_id))
            if len(self._engines) > 2 * self.top_engines + 64:
                self._trim()

    def remove(self, entries: Sequence[ScanEntry]) -> None:
        self._reaped = True
        self.removed.extend(RemovedFile(e.name) for e in entries)
        self.freed += sum(e.resident_bytes for e in entries)

    def _trim(self) -> None:
        self._engines.sort()
        self._other += sum(-minus for minus, _ in self._engines[self.top_engines :])
        del self._engines[self.top_engines :]

    def reaped(self) -> RootReap | None:
        if not (self._reaped or self.settled):
            return None
        return RootReap(tuple(self.removed), self.freed, self.restored, self.conflicts)

    def scan(self, root: Path, stream: Judged) -> RootScan:
        self._trim()
        return RootScan(
            root=root,
            scanned_at=stream.scanned_at or time.time(),
            summary=self.counted.summary(len(stream.uninspected)),
            resident_bytes=dict(self.counted.resident),
            orphaned_engines=tuple((engine_id, -minus) for minus, engine_id in self._engines),
            orphaned_other_bytes=self._other,
            region_size_max=self.region_size_max,
            unlinked_mapped_bytes=sum(d.mapped_bytes for d in stream.deleted),
            regions=dict(self.regions),
        )
