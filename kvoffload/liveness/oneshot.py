"""The one-shot commands' scan (``shmctl scan``, ``reap``, ``metrics``), read a region at a time.

``scan`` returns a root's every entry at once: about 2.6 KiB per file at its peak, 261 MiB for
100,000 files. The commands need each entry only long enough to write it, count it or remove
it, so they read a ``JudgedRoot`` instead: the report's fields that are known before any entry
(``head``), the parked files (``parks``), every other region once (``regions``), and, once
those are read, the fields that are counted over them (``report``: the summary, the
uninspected processes, the unlinked mappings).

A root of fewer than ``WHOLE_BELOW`` directory entries is scanned whole by ``scan`` (its probes
run in a child beside the ``/proc`` walk; its whole report is a few tens of MiB at most) and
handed out region by region; a bigger one is judged by ``ScanStream``, ``STREAM_CHUNK_FILES`` files at a time,
so that what is held does not grow with the root (``docs/agent-memory.md``). The evidence and
the verdicts are ``scan``'s either way, and so is the order: entries by (engine id, segment,
name), each region's files together.

One difference from ``scan``: the stream judges every file against one clock reading taken as
it starts (``scanned_at``), not after the ``/proc`` walk; a file can only look younger by that
(the grace period judges it more cautiously), never older.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload.liveness import lease
from kvoffload.liveness.holders import DeletedMapping, Uninspected
from kvoffload.liveness.namespace import visibility
from kvoffload.liveness.park.parked import JudgedParks
from kvoffload.liveness.report import SCHEMA_VERSION, ScanEntry, ScanReport, SummaryCount
from kvoffload.liveness.scan import ScanOptions, ScanStream, open_root, scan
from kvoffload.shm import families as shm_families
from kvoffload.shm import mounts

if TYPE_CHECKING:
    from kvoffload.liveness.events import RootScan

__all__ = ["WHOLE_BELOW", "JudgedRoot", "count_root", "order_key"]

#: Directory entries below which a root is scanned whole: ``scan``'s prober then overlaps the
#: probes with the ``/proc`` walk (10,000 files: 0.37 s wall against the stream's 0.41), and
#: the report costs about 1.7 KiB a file at its peak (16,000 files: 51 MiB of RSS in all,
#: against the stream's 24), well inside the 100 MiB every command is held to.
WHOLE_BELOW = 20_000


def order_key(entry: ScanEntry) -> tuple[str, int, str]:
    """``scan``'s order of entries: engine id, segment, name."""
    return (entry.engine_id, entry.segment, entry.name)


def _entries_below(dir_fd: int, limit: int) -> bool:
    """Whether the root has fewer than ``limit`` entries (one listing, names only). A root that
    cannot be listed is scanned whole: ``scan`` says why, in its own words."""
    if limit <= 0:
        return False
    try:
        return len(os.listdir(dir_fd)) < limit
    except OSError:
        return True


class JudgedRoot:
    """A root's scan for a one-shot command, read a region at a time (the module's doc).

    Use it as a context manager: it holds the root's directory fd (``dir_fd``, through which a
    reap removes what it was told) until it is closed. ``regions()`` may be read once; the
    ``report()`` after it has every field of ``scan``'s but ``entries``.
    """

    def __init__(
        self,
        root: Path | str,
        options: ScanOptions | None = None,
        *,
        root_fd: int | None = None,
        now: float | None = None,
        whole_below: int = WHOLE_BELOW,
    ) -> None:
        self.root = Path(root)
        self.options = options if options is not None else ScanOptions()
        self._root_fd = root_fd
        self._now = now
        self._whole_below = whole_below
        self._stack = contextlib.ExitStack()
        self.dir_fd = -1
        self._whole: ScanReport | None = None
        self._stream: ScanStream | None = None
        self._count = SummaryCount()
        self._read = False
        #: The report as it stands before any region is read: ``entries`` empty, ``summary``
        #: the parked files' alone, no uninspected process, no unlinked mapping.
        self.head = ScanReport(SCHEMA_VERSION, self.root, 0.0, 0.0, (), SummaryCount().summary(0), (), ())
        #: The park directories, their files (``parked`` entries), and the look-alikes.
        self.parks = JudgedParks()

    def __enter__(self) -> JudgedRoot:
        with contextlib.ExitStack() as stack:
            self.dir_fd = stack.enter_context(open_root(self.root, self._root_fd))
            if _entries_below(self.dir_fd, self._whole_below):
                self._enter_whole()
            else:
                self._enter_stream(stack)
            self._stack = stack.pop_all()
        return self

    def _enter_whole(self) -> None:
        report = scan(self.root, self.options, now=self._now, root_fd=self.dir_fd)
        self._whole = report
        parked = tuple(e for e in report.entries if e.parked is not None)
        self.parks = JudgedParks(report.parks, parked, report.untrusted_parks)
        self._count.add(parked)
        self.head = dataclasses.replace(
            report, entries=(), summary=self._count.summary(0), uninspected=(), deleted=()
        )

    def _enter_stream(self, stack: contextlib.ExitStack) -> None:
        options = self.options
        now = time.time() if self._now is None else self._now
        stream = stack.enter_context(ScanStream(self.root, options, root_fd=self.dir_fd, now=now))
        self._stream = stream
        judged = stream.parked()
        parked = tuple(sorted(judged.parked, key=order_key))
        self.parks = JudgedParks(judged.parks, parked, judged.untrusted)
        self._count.add(parked)
        self.head = ScanReport(
            schema_version=SCHEMA_VERSION,
            root=self.root,
            scanned_at=now,
            grace_s=float(options.grace_s),
            entries=(),
            summary=self._count.summary(0),
            uninspected=(),
            deleted=(),
            assumed_not_holding=tuple(sorted(options.assume_not_holding)),
            visibility=visibility(options.proc_root),
            lease_enabled=stream.lease_enabled,
            huge_pages=mounts.check_huge_pages(self.root),
            parks=judged.parks,
            lease_break_time_s=lease.break_time_s(options.proc_root),
            untrusted_parks=judged.untrusted,
            families=shm_families.ordered(options.families),
        )

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the root's fd (and the stream); idempotent."""
        self._stack.close()
        self._whole = None

    @property
    def scanned_at(self) -> float:
        return self.head.scanned_at

    @property
    def lease_enabled(self) -> bool:
        return self.head.lease_enabled

    def regions(self) -> Iterator[tuple[ScanEntry, ...]]:
        """Every region of the root but the parked files, once, by engine id: its entries by
        segment, then name (files that are ``skipped`` themselves included)."""
        if self._read:
            raise RuntimeError("JudgedRoot.regions() is read once")
        self._read = True
        for region in self._judged():
            self._count.add(region)
            yield region

    def _judged(self) -> Iterator[tuple[ScanEntry, ...]]:
        if self._stream is not None:
            yield from self._stream.regions()
            return
        assert self._whole is not None, "JudgedRoot is used inside its with block"
        units: dict[tuple[str, str], list[ScanEntry]] = {}
        for e in self._whole.entries:
            if e.parked is None:
                units.setdefault(e.unit, []).append(e)
        for unit in units.values():
            yield tuple(unit)

    def entries(self) -> Iterator[ScanEntry]:
        """Every entry, the parked ones included, in ``scan``'s order (engine id, segment, name)."""
        flat = itertools.chain.from_iterable(self.regions())
        return heapq.merge(flat, self.parks.parked, key=order_key)

    @property
    def uninspected(self) -> tuple[Uninspected, ...]:
        if self._stream is not None:
            return self._stream.uninspected
        return self._whole.uninspected if self._whole is not None else ()

    @property
    def deleted(self) -> tuple[DeletedMapping, ...]:
        if self._stream is not None:
            return self._stream.deleted
        return self._whole.deleted if self._whole is not None else ()

    def report(self) -> ScanReport:
        """``scan``'s report of what was read, but its ``entries``: the summary counted over the
        regions read and the parked files."""
        uninspected = self.uninspected
        return dataclasses.replace(
            self.head,
            summary=self._count.summary(len(uninspected)),
            uninspected=uninspected,
            deleted=self.deleted,
        )


def count_root(
    root: Path | str,
    options: ScanOptions | None = None,
    *,
    top_engines: int,
    now: float | None = None,
    whole_below: int = WHOLE_BELOW,
) -> RootScan:
    """``shmctl metrics``'s numbers of a root (``RootScan``), counted a region at a time as the
    agent counts them (``Tally``): files, regions and bytes per verdict, the ``top_engines``
    orphaned engines and the rest, the unlinked mappings, the uninspected processes."""
    from kvoffload.liveness.tally import Tally  # the agent's counting; `scan` never loads it

    tally = Tally(top_engines)
    with JudgedRoot(root, options, now=now, whole_below=whole_below) as judged:
        by_engine: dict[str, list[ScanEntry]] = {}
        for e in judged.parks.parked:
            by_engine.setdefault(e.engine_id, []).append(e)
        for entries in by_engine.values():
            tally.count(entries)
        for region in judged.regions():
            tally.count(region)
        return tally.scan(judged.root, judged)
