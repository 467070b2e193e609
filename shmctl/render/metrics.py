"""Prometheus exposition of scans (node_exporter's textfile format), written by prometheus-client.

An ``Exposition`` is one scrape's worth of metrics in a fresh ``CollectorRegistry`` of its own:
never the client's global registry, so no process or platform collector gets into the file.
``add_scan`` adds one root's series and may be called once per root (a fleet process exports
several roots in one file); ``add_failure`` stands in for a root that could not be read;
``add_reaps`` exports the counters that a long-running process keeps in ``ReapCounters``
across passes.

``shmctl watch`` builds its expositions with ``pod_uid_label=True``: every per-root series
gains the label ``pod_uid`` (the UID in a kubelet volume path, empty elsewhere), and it adds
``add_watched`` and ``add_watch``. Without the flag the output is exactly the one-shot
command's.

Every series count is bounded, however many engines leak or roots a node has: per root, the
``top_engines`` engines pinning most orphaned memory are named and the rest summed as
``engine_id="other"``; in the agent, the ``top_roots`` roots pinning most (``rank_roots``) have
series of their own and the rest are folded into ``root="other"`` (``add_watched``, and
docs/agent-memory.md for what each family's ``other`` holds). A scrape of 10,000 roots is
then as large as one of ``top_roots``. The series are built from numbers (``RootNumbers``),
never from a scan's entries, so an exposition's memory does not grow with files either.

Values are exact: the client writes every number with ``repr`` (Go's exponent form from 1e6
on, as node_exporter does), so sizes keep every byte below 2**53 and ``time.time()`` keeps
every digit: ``1.7961079161234567e+09``, never ``:g``'s six significant digits.

Label values are exact: an engine id, a root or an error is its label as it is, every
character as itself in UTF-8, control characters included (a tab, an ESC, U+2028, a bidi
override), so a label equals what ``scan --json`` gives back for the same name
(``json.loads``). The client escapes ``\\``, ``"`` and a newline, the only escapes the text
format (0.0.4, and OpenMetrics) has; any other backslash escape is invalid there (Go's
expfmt parser, node_exporter's, rejects the whole file). The one character UTF-8 cannot carry
is a lone surrogate: a byte of a file name that is not UTF-8 (``os.listdir``'s
``surrogateescape`` makes it U+DC80-DCFF). ``label_text`` writes it as the six characters
``\\udcXX``, the text ``scan --json`` writes for it (``json.loads`` reads that back as the
surrogate, a Prometheus parser as those six characters). So the rule is: a label is the name
``scan --json`` reports, with each undecodable byte as the text of its JSON escape.

What carries the labels raw: ``/metrics`` (a scraper parses it), the ``--textfile`` file
(node_exporter parses it), and ``shmctl metrics`` into a pipe or a file. Only when
``shmctl metrics`` writes to a terminal does ``print_text`` escape what a person's terminal
would act on (``printable``: ``\\x1b``, ``\\t``, ``\\u202e``), line by line; that output is
for eyes, not for a parser. ``curl :9477/metrics`` on a terminal is curl's output, not
shmctl's: pipe it through ``cat -v`` where names are not trusted.

This module imports prometheus_client; only the metrics code paths import this module, so
``shmctl --help`` and shell completion never load it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.errors import RootError
from kvoffload.liveness.report import ScanReport
from kvoffload.liveness.scan import Status
from shmctl.output_files import write_atomically
from shmctl.render import printable
from shmctl.render.fixes import unwritable_fix

if TYPE_CHECKING:
    from kvoffload.liveness.events import RootScan
    from kvoffload.liveness.reap import ReapReport

FILENAME = "shmctl.prom"
DEFAULT_TOP_ENGINES = 10
#: The engine_id of the series that sums every orphaned engine not exported by name.
OTHER_ENGINES = "other"
#: Roots ``shmctl watch`` exports by name (``--top-roots``): a node's pods, with room to spare.
DEFAULT_TOP_ROOTS = 100
#: The root label of the series that fold every root not exported by name (no root's path
#: is relative, so no root is named this).
OTHER_ROOTS = "other"
LAST_SUCCESS = "shmctl_last_success_timestamp_seconds"


class DiskUsage(Protocol):
    """What ``shutil.disk_usage`` returns."""

    @property
    def total(self) -> int: ...

    @property
    def free(self) -> int: ...


@dataclass(slots=True)
class ReapCounters:
    """Files and bytes reaped per root since this process started (Prometheus counters).

    A counter means something only in a process that outlives its passes (``shmctl watch``):
    Prometheus reads a drop to zero as a restart. The one-shot ``metrics`` command reaps
    nothing and keeps none, so it exports none: a counter written as 0 on every run would
    claim that nothing was reaped while a cron ``shmctl reap`` frees gigabytes.
    """

    files: dict[str, int] = field(default_factory=dict)
    resident_bytes: dict[str, int] = field(default_factory=dict)
    #: Parked files whose name another file took meanwhile (both kept: ``conflict`` events).
    conflicts: dict[str, int] = field(default_factory=dict)

    def record(self, report: ReapReport) -> None:
        """Count one reap pass; a dry run removed nothing, but its root's series start at 0."""
        root = label_text(str(report.root))
        removed = 0 if report.dry_run else len(report.removed)
        freed = 0 if report.dry_run else report.freed_bytes
        conflicts = 0 if report.dry_run else len(report.conflicts)
        self.add(root, removed, freed, conflicts)

    def add(self, label: str, files: int, freed_bytes: int, conflicts: int = 0) -> None:
        """Count ``files`` removed, ``freed_bytes`` freed and ``conflicts`` left parked, under
        the root label ``label``."""
        self.files[label] = self.files.get(label, 0) + files
        self.resident_bytes[label] = self.resident_bytes.get(label, 0) + freed_bytes
        self.conflicts[label] = self.conflicts.get(label, 0) + conflicts

    def forget(self, root: Path | str) -> None:
        """Drop a vanished root's counters: series of pods long gone must not pile up."""
        label = label_text(str(root))
        self.files.pop(label, None)
        self.resident_bytes.pop(label, None)
        self.conflicts.pop(label, None)


#: Verdicts in the order their ``files``/``resident_bytes`` tuples hold them.
STATUSES = tuple(Status)


@dataclass(frozen=True, slots=True)
class RootNumbers:
    """Every number of a scanned root's series: what an exposition needs of a scan, no entry."""

    scanned_at: float
    scan_seconds: float
    #: Regions (as scan's table has rows), files and resident bytes per verdict, in
    #: ``STATUSES`` order.
    regions: tuple[int, ...]
    files: tuple[int, ...]
    resident_bytes: tuple[int, ...]
    orphaned_bytes: int
    #: Named orphaned engines (label text), largest first; ``orphaned_other_bytes`` is the rest.
    orphaned_engines: tuple[tuple[str, int], ...]
    orphaned_other_bytes: int
    unlinked_mapped_bytes: int
    uninspected_processes: int
    size_bytes: int
    free_bytes: int
    #: The largest region's apparent size; None where it is not exported (the one-shot command).
    region_size_max: int | None = None

    @classmethod
    def of_report(
        cls, report: ScanReport, usage: DiskUsage, *, scan_seconds: float, top_engines: int
    ) -> RootNumbers:
        ranked = orphan_bytes_by_engine(report, top_engines)
        return cls(
            scanned_at=report.scanned_at,
            scan_seconds=scan_seconds,
            regions=tuple(len({e.engine_id for e in report.with_status(s)}) for s in STATUSES),
            files=tuple(len(report.with_status(s)) for s in STATUSES),
            resident_bytes=tuple(sum(e.resident_bytes for e in report.with_status(s)) for s in STATUSES),
            orphaned_bytes=report.summary.orphaned_resident_bytes,
            orphaned_engines=tuple(ranked[:-1]),
            orphaned_other_bytes=ranked[-1][1],
            unlinked_mapped_bytes=sum(d.mapped_bytes for d in report.deleted),
            uninspected_processes=len(report.uninspected),
            size_bytes=usage.total,
            free_bytes=usage.free,
        )

    @classmethod
    def of_watch(
        cls, scan: RootScan, usage: DiskUsage, *, scan_seconds: float, top_engines: int
    ) -> RootNumbers:
        """A watch pass's ``RootScan`` (the agent keeps no entries; it counted them as it went)."""
        summary = scan.summary
        count = {
            Status.LIVE: summary.live,
            Status.ORPHANED: summary.orphaned,
            Status.STARTING: summary.starting,
            Status.UNKNOWN: summary.unknown,
            Status.SKIPPED: summary.skipped,
            Status.PARKED: summary.parked,
        }
        ranked = rank_engines(scan.orphaned_engines, scan.orphaned_other_bytes, top_engines)
        return cls(
            scanned_at=scan.scanned_at,
            scan_seconds=scan_seconds,
            regions=tuple(scan.regions.get(s, 0) for s in STATUSES),
            files=tuple(count.get(s, 0) for s in STATUSES),
            resident_bytes=tuple(scan.resident_bytes.get(s, 0) for s in STATUSES),
            orphaned_bytes=summary.orphaned_resident_bytes,
            orphaned_engines=tuple(ranked[:-1]),
            orphaned_other_bytes=ranked[-1][1],
            unlinked_mapped_bytes=scan.unlinked_mapped_bytes,
            uninspected_processes=summary.uninspected_processes,
            size_bytes=usage.total,
            free_bytes=usage.free,
            region_size_max=scan.region_size_max,
        )


@dataclass(frozen=True, slots=True)
class RootSeries:
    """One root as a long-running process last saw it: its numbers, or the error that stopped its scan."""

    #: The root's label (``label_text``) and its pod's UID ("" outside a kubelet volume).
    root: str
    pod_uid: str
    attempted_at: float
    last_success: float | None
    numbers: RootNumbers | None = None
    error: str | None = None

    @property
    def orphaned_bytes(self) -> int:
        return self.numbers.orphaned_bytes if self.numbers is not None else 0


def rank_roots(roots: Iterable[RootSeries], top: int) -> frozenset[str]:
    """The labels of the ``top`` roots whose orphans pin most memory (ties by root label)."""
    ranked = sorted(roots, key=lambda r: (-r.orphaned_bytes, r.root))
    return frozenset(r.root for r in ranked[:top])


class Exposition:
    """The families of one exposition, in output order; empty families are left out."""

    def __init__(
        self,
        *,
        top_engines: int = DEFAULT_TOP_ENGINES,
        version: str | None = None,
        pod_uid_label: bool = False,
    ) -> None:
        if top_engines < 0:
            raise ValueError(f"top_engines must not be negative, got {top_engines}")
        self.top_engines = top_engines
        self.pod_uid_label = pod_uid_label
        root_labels = ["root", "pod_uid"] if pod_uid_label else ["root"]

        def _gauge(name: str, documentation: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, documentation, labels=[*root_labels, *labels])

        self.build_info = InfoMetricFamily(
            "shmctl_build", "shmctl's version, as the label version; the value is always 1."
        )
        self.build_info.add_metric([], {"version": build_version() if version is None else version})
        self.scan_success = _gauge(
            "shmctl_scan_success",
            "1 if the root was scanned, 0 if it could not be read (see shmctl_scan_error_info); "
            "after a 0 the root's other series are absent, not stale.",
        )
        self.scan_error = InfoMetricFamily(
            "shmctl_scan_error",
            "Why the root could not be read, as the label error; present only while "
            "shmctl_scan_success is 0. The value is always 1.",
            labels=root_labels,
        )
        self.last_run = _gauge(
            "shmctl_last_run_timestamp_seconds",
            "When shmctl last tried to scan the root, successfully or not, in unix seconds.",
        )
        self.last_success = _gauge(
            LAST_SUCCESS,
            "When the root was last scanned successfully, in unix seconds. A failed run carries "
            "it over from the textfile it replaces (absent when there is none).",
        )
        self.scan_duration = _gauge("shmctl_scan_duration_seconds", "How long the scan took, in seconds.")
        self.regions = _gauge(
            "shmctl_regions",
            "Regions in the root by verdict, as scan's table has rows: an engine's base file and "
            "segments are one region (under each verdict its files have).",
            "status",
        )
        self.region_files = _gauge(
            "shmctl_region_files",
            "Region files (bases and segments) in the root, by verdict.",
            "status",
        )
        self.region_resident = _gauge(
            "shmctl_region_resident_bytes",
            "Memory the region files pin (st_blocks*512), in bytes, by verdict.",
            "status",
        )
        self.orphan = _gauge(
            "shmctl_orphan_bytes",
            "Memory that orphaned region files pin, in bytes: what `shmctl reap` would free.",
        )
        self.orphan_engine = _gauge(
            "shmctl_orphan_engine_bytes",
            "shmctl_orphan_bytes per engine, in bytes: the largest engines by engine_id, the rest "
            'summed as engine_id="other".',
            "engine_id",
        )
        self.unlinked_mapped = _gauge(
            "shmctl_unlinked_mapped_bytes",
            "Bytes of unlinked region files of the root's filesystem still mapped or open "
            "(freed when their processes exit).",
        )
        self.uninspected = _gauge(
            "shmctl_uninspected_processes",
            "Processes whose fds or maps could not be read, vouched-for ones included "
            "(where no lease can be taken, the regions they might hold stay unknown).",
        )
        self.root_size = _gauge("shmctl_root_size_bytes", "Size of the root's filesystem, in bytes.")
        self.root_free = _gauge(
            "shmctl_root_free_bytes",
            "Bytes of the root's filesystem free for unprivileged users (statvfs f_bavail*f_frsize).",
        )
        self.reaped_files = CounterMetricFamily(
            "shmctl_reaped_files",
            "Region files removed by reap since this process started (long-running modes only).",
            labels=root_labels,
        )
        self.reaped_bytes = CounterMetricFamily(
            "shmctl_reaped_bytes",
            "Memory freed by reap since this process started, in bytes (st_blocks*512 of the "
            "removed files; long-running modes only).",
            labels=root_labels,
        )
        self.reap_conflicts = CounterMetricFamily(
            "shmctl_reap_conflicts",
            "Parked files that could not get their name back because another file took it "
            "meanwhile: both kept, the parked one waits in its park directory (long-running "
            "modes only).",
            labels=root_labels,
        )
        self.region_size_max = _gauge(
            "shmctl_region_size_max_bytes",
            "Apparent size of the root's largest region (base and segments, live or not), in "
            "bytes: what a restarting engine needs again; 0 when there is none.",
        )
        self.watch_up = GaugeMetricFamily("shmctl_watch_up", "1 while shmctl watch runs its pass loop.")
        self.watch_pass_duration = GaugeMetricFamily(
            "shmctl_watch_pass_duration_seconds", "How long the last pass over every root took, in seconds."
        )
        self.watch_passes = CounterMetricFamily(
            "shmctl_watch_passes", "Passes over the roots since this process started."
        )
        self.watch_roots = GaugeMetricFamily(
            "shmctl_watch_roots", "Roots the globs matched in the last pass."
        )
        self.lease_break_time = GaugeMetricFamily(
            "shmctl_lease_break_time_seconds",
            "The node's fs.lease-break-time, in seconds: how long an engine's open() of a region "
            "file can wait on a lease shmctl holds if every shmctl process is frozen at once "
            "(one that stops alone is killed by shmctl's lease watchdog within a second). "
            "Absent when unreadable.",
        )
        self.proc_walks = CounterMetricFamily(
            "shmctl_proc_walks",
            "Walks of /proc by shmctl watch since it started, by why (docs/fleet.md): the other "
            "passes judged every region by its write leases.",
            labels=["reason"],
        )
        self.proc_walk_timestamp = GaugeMetricFamily(
            "shmctl_proc_walk_timestamp_seconds",
            "When shmctl watch last walked /proc, in unix seconds: shmctl_unlinked_mapped_bytes, "
            "shmctl_uninspected_processes and the holders named are as old as this.",
        )
        self._families: tuple[Metric, ...] = (
            self.build_info,
            self.scan_success,
            self.scan_error,
            self.last_run,
            self.last_success,
            self.scan_duration,
            self.regions,
            self.region_files,
            self.region_resident,
            self.orphan,
            self.orphan_engine,
            self.unlinked_mapped,
            self.uninspected,
            self.root_size,
            self.root_free,
            self.reaped_files,
            self.reaped_bytes,
            self.reap_conflicts,
            self.region_size_max,
            self.watch_up,
            self.watch_pass_duration,
            self.watch_passes,
            self.watch_roots,
            self.lease_break_time,
            self.proc_walks,
            self.proc_walk_timestamp,
        )
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def collect(self) -> Iterable[Metric]:
        # A family with no sample (the reap counters of a one-shot run, a failed root's
        # gauges) would still print its HELP and TYPE lines: leave it out.
        return [family for family in self._families if family.samples]

    def add_scan(self, report: ScanReport, usage: DiskUsage, *, scan_seconds: float) -> None:
        """Every series of one scanned root."""
        numbers = RootNumbers.of_report(
            report, usage, scan_seconds=scan_seconds, top_engines=self.top_engines
        )
        self.add_numbers(self._root_labels(report.root), numbers)

    def add_counted(self, scan: RootScan, usage: DiskUsage, *, scan_seconds: float) -> None:
        """Every series of one root that ``shmctl metrics`` counted a region at a time
        (``oneshot.count_root``): the same as ``add_scan`` of its whole report."""
        numbers = RootNumbers.of_watch(scan, usage, scan_seconds=scan_seconds, top_engines=self.top_engines)
        # The largest region is the agent's series (what a restart needs); the one-shot
        # command never exported it.
        self.add_numbers(self._root_labels(scan.root), dataclasses.replace(numbers, region_size_max=None))

    def add_numbers(self, root: list[str], numbers: RootNumbers) -> None:
        """Every series of one scanned root (``root``: its label values), from its numbers."""
        self.scan_success.add_metric(root, 1)
        self.last_run.add_metric(root, numbers.scanned_at)
        self.last_success.add_metric(root, numbers.scanned_at)
        self.scan_duration.add_metric(root, numbers.scan_seconds)
        for status, regions, files, resident in zip(
            STATUSES, numbers.regions, numbers.files, numbers.resident_bytes, strict=True
        ):
            self.regions.add_metric([*root, status.value], regions)
            self.region_files.add_metric([*root, status.value], files)
            self.region_resident.add_metric([*root, status.value], resident)
        self.orphan.add_metric(root, numbers.orphaned_bytes)
        for engine_id, resident in rank_engines(
            numbers.orphaned_engines, numbers.orphaned_other_bytes, self.top_engines
        ):
            self.orphan_engine.add_metric([*root, engine_id], resident)
        self.unlinked_mapped.add_metric(root, numbers.unlinked_mapped_bytes)
        self.uninspected.add_metric(root, numbers.uninspected_processes)
        self.root_size.add_metric(root, numbers.size_bytes)
        self.root_free.add_metric(root, numbers.free_bytes)
        if numbers.region_size_max is not None:
            self.region_size_max.add_metric(root, numbers.region_size_max)

    def add_watched(self, roots: Sequence[RootSeries], named: Collection[str]) -> None:
        """The agent's roots: those in ``named`` (``rank_roots``) with series of their own, every
        other one folded into the series of ``root="other"`` (docs/agent-memory.md)."""
        folded = []
        for series in roots:
            if series.root not in named:
                folded.append(series)
                continue
            labels = [series.root, series.pod_uid]
            if series.numbers is not None:
                self.add_numbers(labels, series.numbers)
            else:
                self._add_error(labels, series.error or "", series.attempted_at, series.last_success)
        if folded:
            self._add_folded(folded)

    def _add_folded(self, roots: list[RootSeries]) -> None:
        """``root="other"``: sums of the folded roots' counts and bytes; success 0 if any failed;
        last run the latest, last success the oldest; the free space and largest region of the
        one with the least room for its largest region; uninspected processes the most."""
        label = [OTHER_ROOTS, ""]
        scanned = [r.numbers for r in roots if r.numbers is not None]
        self.scan_success.add_metric(label, 0 if len(scanned) < len(roots) else 1)
        self.last_run.add_metric(
            label, max(r.attempted_at if r.numbers is None else r.numbers.scanned_at for r in roots)
        )
        successes = [r.numbers.scanned_at if r.numbers is not None else r.last_success for r in roots]
        known = [t for t in successes if t is not None]
        if known:
            self.last_success.add_metric(label, min(known))
        if not scanned:
            return
        self.scan_duration.add_metric(label, sum(n.scan_seconds for n in scanned))
        for i, status in enumerate(STATUSES):
            self.regions.add_metric([*label, status.value], sum(n.regions[i] for n in scanned))
            self.region_files.add_metric([*label, status.value], sum(n.files[i] for n in scanned))
            self.region_resident.add_metric([*label, status.value], sum(n.resident_bytes[i] for n in scanned))
        orphaned = sum(n.orphaned_bytes for n in scanned)
        self.orphan.add_metric(label, orphaned)
        self.orphan_engine.add_metric([*label, OTHER_ENGINES], orphaned)
        self.unlinked_mapped.add_metric(label, sum(n.unlinked_mapped_bytes for n in scanned))
        self.uninspected.add_metric(label, max(n.uninspected_processes for n in scanned))
        tightest = min(scanned, key=lambda n: n.free_bytes - (n.region_size_max or 0))
        self.root_size.add_metric(label, tightest.size_bytes)
        self.root_free.add_metric(label, tightest.free_bytes)
        self.region_size_max.add_metric(label, tightest.region_size_max or 0)

    def _root_labels(self, root: Path | str) -> list[str]:
        """The label values that name a root: ``root``, and ``pod_uid`` when it is on."""
        label = label_text(str(root))
        if not self.pod_uid_label:
            return [label]
        from kvoffload.liveness.roots import pod_uid_of

        return [label, pod_uid_of(label) or ""]

    def add_region_sizes(self, report: ScanReport) -> None:
        """``shmctl_region_size_max_bytes``: the largest region's base plus segments, any verdict."""
        per_engine: dict[str, int] = {}
        for entry in report.entries:
            per_engine[entry.engine_id] = per_engine.get(entry.engine_id, 0) + entry.size_bytes
        self.region_size_max.add_metric(self._root_labels(report.root), max(per_engine.values(), default=0))

    def add_watch(self, *, up: bool, passes: int, roots: int, pass_seconds: float | None) -> None:
        """The agent's own series; the pass duration is absent until a pass has finished."""
        self.watch_up.add_metric([], 1 if up else 0)
        self.watch_passes.add_metric([], passes)
        self.watch_roots.add_metric([], roots)
        if pass_seconds is not None:
            self.watch_pass_duration.add_metric([], pass_seconds)

    def add_proc_walks(self, counts: Mapping[str, int], last_at: float | None) -> None:
        """``shmctl_proc_walks_total{reason}`` and ``shmctl_proc_walk_timestamp_seconds`` (absent
        until a walk was made)."""
        for reason, n in sorted(counts.items()):
            self.proc_walks.add_metric([reason], n)
        if last_at is not None:
            self.proc_walk_timestamp.add_metric([], last_at)

    def add_lease_break_time(self, seconds: float | None) -> None:
        """``shmctl_lease_break_time_seconds`` (``lease.break_time_s()``); nothing when it is None."""
        if seconds is not None:
            self.lease_break_time.add_metric([], seconds)

    def add_failure(
        self, root: Path, error: RootError, *, attempted_at: float, last_success: float | None
    ) -> None:
        """A root that could not be read: success 0, the error, and no figure that could be stale."""
        # The root is its own label; the error label is the problem (a handful of texts per root).
        problem = error.message.removeprefix(f"{error.root}: ")
        self._add_error(self._root_labels(root), problem, attempted_at, last_success)

    def _add_error(
        self, label: list[str], problem: str, attempted_at: float, last_success: float | None
    ) -> None:
        self.scan_success.add_metric(label, 0)
        self.scan_error.add_metric(label, {"error": label_text(problem)})
        self.last_run.add_metric(label, attempted_at)
        if last_success is not None:
            self.last_success.add_metric(label, last_success)

    def add_reaps(self, counters: ReapCounters) -> None:
        for root, files in counters.files.items():
            self.reaped_files.add_metric(self._root_labels(root), files)
        for root, freed in counters.resident_bytes.items():
            self.reaped_bytes.add_metric(self._root_labels(root), freed)
        for root, conflicts in counters.conflicts.items():
            self.reap_conflicts.add_metric(self._root_labels(root), conflicts)

    def text(self) -> bytes:
        """The exposition in Prometheus' text format (UTF-8)."""
        return generate_latest(self.registry)


def label_text(value: str) -> str:
    """``value`` as a label value: itself, each lone surrogate (an undecodable byte of a name,
    from ``surrogateescape``) as the text of its JSON escape ``\\udcXX``, which is what
    ``scan --json`` writes for it. Every other character, control characters included, is its
    own; the client escapes ``\\``, ``"`` and newlines when it writes the exposition."""
    if value.isascii():
        return value
    return _surrogates().sub(_surrogate_text, value)


@functools.cache
def _surrogates() -> re.Pattern[str]:
    # Compiled on first use: only the metrics code paths label anything.
    return re.compile("[\ud800-\udfff]")


def _surrogate_text(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def orphan_bytes_by_engine(report: ScanReport, top: int) -> list[tuple[str, int]]:
    """The ``top`` engines pinning most orphaned bytes (ties by engine_id), then ``other``.

    The series count stays bounded however many engines leak. ``other`` sums the rest, and
    is always there, so the series add up to ``shmctl_orphan_bytes``. An engine really named
    ``other`` is summed into it rather than exported twice under one label set.
    """
    per_engine: dict[str, int] = {}
    for entry in report.with_status(Status.ORPHANED):
        per_engine[entry.engine_id] = per_engine.get(entry.engine_id, 0) + entry.resident_bytes
    return rank_engines(per_engine.items(), 0, top)


def rank_engines(engines: Iterable[tuple[str, int]], rest: int, top: int) -> list[tuple[str, int]]:
    """``engines`` (id, orphaned bytes) as label text, the ``top`` largest (ties by label) and
    ``other`` (``rest`` plus the others, always last): ``orphan_bytes_by_engine``'s rule."""
    per_label: dict[str, int] = {}
    for engine_id, resident in engines:
        label = label_text(engine_id)
        per_label[label] = per_label.get(label, 0) + resident
    rest += per_label.pop(OTHER_ENGINES, 0)
    ranked = sorted(per_label.items(), key=lambda item: (-item[1], item[0]))
    rest += sum(resident for _, resident in ranked[top:])
    return [*ranked[:top], (OTHER_ENGINES, rest)]


@functools.cache
def build_version() -> str:
    """The installed distribution's version (``shmctl.__version__`` when it is not installed).

    Read once per process: package metadata is files on disk, and an agent scraped every few
    seconds (under a flood of connections, say) must not reopen them each time."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shmctl")
    except PackageNotFoundError:
        import shmctl

        return str(getattr(shmctl, "__version__", "unknown"))


def previous_success(directory: Path, root: Path) -> float | None:
    """``shmctl_last_success_timestamp_seconds{root}`` of the textfile this run will replace.

    A one-shot process cannot remember its last good run; the file it wrote can. Anything
    that is not our readable exposition (missing, unreadable, truncated by hand) carries
    nothing.
    """
    try:
        text = (directory / FILENAME).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    wanted = label_text(str(root))
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == LAST_SUCCESS and sample.labels.get("root") == wanted:
                    return float(sample.value)
    except ValueError:
        return None
    return None


def check_textfile_directory(directory: Path) -> None:
    """Refuse a ``--textfile`` that is not a directory before anything is scanned."""
    if not directory.is_dir():
        raise RootError(directory, "is not a directory", fix="create the textfile collector directory first")


def publish(exposition: Exposition, textfile: Path | None) -> None:
    """The exposition on stdout, or atomically as ``textfile/shmctl.prom``."""
    if textfile is None:
        print_text(exposition.text())
    else:
        write_textfile(textfile, exposition)


def print_text(data: bytes) -> None:
    """The exposition on stdout: as the client wrote it, but on a terminal with what the
    terminal would act on escaped (``printable``): labels are exact, and names are anyone's."""
    out = sys.stdout
    if out.isatty():
        text = data.decode("utf-8")
        data = "\n".join(printable(line, escape_backslash=False) for line in text.split("\n")).encode()
    buffer = getattr(out, "buffer", None)
    if buffer is None:  # a text-only stream (a test's StringIO)
        out.write(data.decode("utf-8"))
    else:
        # Bytes as the client encoded them: a non-ASCII label must not depend on the locale.
        out.flush()
        buffer.write(data)
    out.flush()


def write_textfile(directory: Path, exposition: Exposition) -> None:
    """Write ``directory/shmctl.prom`` atomically: node_exporter never reads half a file.

    ``write_atomically`` writes the exposition to a temp file beside the target (same
    filesystem, so the rename is atomic; its name does not end in ``.prom``, so the collector
    ignores it), gives it mode 0644 (node_exporter usually runs as another user, whatever
    this run's umask), renames it over the target, and removes it if writing fails.
    """
    try:
        write_atomically(directory / FILENAME, exposition.text())
    except OSError as e:
        raise _unwritable(directory, e) from None


def _unwritable(directory: Path, error: OSError) -> RootError:
    # Name the file and the cause; the fix is the errno's own (a full disk, a read-only
    # mount, a directory this user may not write, /proc that takes no file from anyone).
    return RootError(
        directory,
        f"cannot write {FILENAME}: {error.strerror or error}",
        fix=unwritable_fix(error, directory, instead="pass another --textfile"),
    )
