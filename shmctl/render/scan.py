"""Rendering of ``ScanReport`` and ``ReapReport``: JSON, or a table of regions.

The JSON is the report dataclass serialised by ``to_jsonable``, so tables and scripts
read one source of truth. Tables show one row per region (its base file and segments
that share a status), the same columns and rows on a terminal and in a pipe
(``write_table``); only the row limit differs: a terminal shows ``--limit`` rows (50 by
default), a pipe every row unless ``--limit`` is given. A header line comes first and a
summary line last, as ``ls -l`` prints ``total``; ``--no-headers`` drops both, so
``| wc -l`` and ``| awk`` see region rows only. Engine ids are arbitrary strings: their
control characters and spaces are escapes in a table (a name cannot forge a line, a column
or a terminal sequence).

With ``--family`` beyond ``offload`` a FAMILY column follows STATUS (and ENGINE is a file's
own name for the families that do not group); without it the table is what it always was,
since operators' scripts parse it.

CHANGED is the one age a table shows: the age the grace period judges (the youngest file's
ctime, which no ``touch`` sets back), so a ``starting`` row's CHANGED and its "removable in"
add up to ``--grace``. ``ls -l``'s mtime age is the JSON's ``age_s``, what ``--older-than``
selects on.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload.liveness.listing import uids_text
from kvoffload.liveness.park import ParkView, UntrustedPark
from kvoffload.liveness.report import ScanEntry, ScanReport, ScanSummary
from kvoffload.liveness.scan import Evidence, Status
from shmctl.render import (
    Cell,
    Column,
    amount_text,
    color_enabled,
    error_line,
    human_age,
    human_bytes,
    printable,
    size_text,
    styled,
    token,
    warning_line,
    write_table,
)
from shmctl.render.document import JsonDocument, JsonSpill, RowSpill, stdout_bytes

if TYPE_CHECKING:  # annotations only: `shmctl scan` never imports the reaper
    from kvoffload.liveness.holders import Holder
    from kvoffload.liveness.namespace import Visibility
    from kvoffload.liveness.oneshot import JudgedRoot
    from kvoffload.liveness.reap import ReapReport

STYLE = {
    Status.ORPHANED: "bold red",
    Status.PARKED: "magenta",
    Status.UNKNOWN: "yellow",
    Status.STARTING: "cyan",
    Status.LIVE: "green",
    Status.SKIPPED: "dim",
}
_ORDER = {status: rank for rank, status in enumerate(STYLE)}
#: Rows a terminal shows unless ``--limit`` says otherwise; a pipe gets every row.
TERMINAL_LIMIT = 50

SCAN_COLUMNS = (
    Column("STATUS"),
    Column("ENGINE"),
    Column("FILES", right=True),
    Column("SIZE", right=True),
    Column("RESIDENT", right=True),
    Column("CHANGED", right=True),
    Column("HOLDERS"),
    Column("REASON"),
)
REAP_COLUMNS = (
    Column("RESULT"),
    Column("ENGINE"),
    Column("FILES", right=True),
    Column("SIZE", right=True),
    Column("RESIDENT", right=True),
    Column("REASON"),
)
FAMILY_COLUMN = Column("FAMILY")
DELETED_COLUMNS = (
    Column("PID", right=True),
    Column("PROCESS"),
    Column("MAPPED", right=True),
    Column("VIA"),
    Column("PATH"),
)


@dataclass(frozen=True, slots=True)
class _Row:
    """One region (or the files of it that share a status) as a table row."""

    entries: tuple[ScanEntry, ...]

    @property
    def first(self) -> ScanEntry:
        return self.entries[0]

    @property
    def engine(self) -> str:
        return token(self.first.engine_id)

    @property
    def resident(self) -> int:
        return sum(e.resident_bytes for e in self.entries)

    @property
    def size(self) -> int:
        return sum(e.size_bytes for e in self.entries)

    @property
    def changed(self) -> float:
        """The youngest file's ``changed_age_s``: the age the region's grace period judged."""
        return min(e.changed_age_s for e in self.entries)

    @property
    def holders(self) -> list[Holder]:
        seen: dict[int, Holder] = {}
        for e in self.entries:
            for h in e.holders:
                seen.setdefault(h.pid, h)
        return list(seen.values())


def _rows(entries: Iterable[ScanEntry]) -> list[_Row]:
    grouped: dict[tuple[str, str, Status], list[ScanEntry]] = {}
    for e in entries:
        grouped.setdefault((e.family, e.engine_id, e.status), []).append(e)
    rows = [_Row(tuple(sorted(g, key=lambda e: e.segment))) for g in grouped.values()]
    rows.sort(key=lambda r: (_ORDER[r.first.status], -r.resident, r.first.name))
    return rows


def _beyond_offload(families: Sequence[str]) -> bool:
    return tuple(families) != ("offload",)


def _with_family(
    columns: Sequence[Column], rows: list[Sequence[Cell]], families: Sequence[str]
) -> tuple[Sequence[Column], list[Sequence[Cell]]]:
    """``columns``, and ``rows`` (whose last cell is the family), with FAMILY after the first
    column when ``families`` asks for more than the offload regions; without the family
    otherwise (the table scripts parse)."""
    if not _beyond_offload(families):
        return columns, [row[:-1] for row in rows]
    return (
        (columns[0], FAMILY_COLUMN, *columns[1:]),
        [(row[0], row[-1], *row[1:-1]) for row in rows],
    )


def _holders_text(holders: Sequence[Holder], shown: int = 3) -> str:
    if not holders:
        return "-"
    text = ",".join(f"{h.pid}:{token(h.name)}" for h in holders[:shown])
    return text + (f",+{len(holders) - shown}" if len(holders) > shown else "")


def summary_line(
    summary: ScanSummary,
    root: object,
    *,
    exact: bool = False,
    reap: str = "shmctl reap",
    families: Sequence[str] = ("offload",),
) -> str:
    what = "file" if _beyond_offload(families) else "region file"
    if not summary.total:
        return f"no {what}s in {printable(str(root))}"
    wait = _starting_wait(summary)
    counts = ", ".join(
        f"{getattr(summary, s.value)} {s.value}" + (f" ({wait})" if s is Status.STARTING and wait else "")
        for s in Status
        if getattr(summary, s.value)
    )
    line = f"{summary.total} {what}(s) in {printable(str(root))}: {counts}"
    if summary.orphaned:
        line += (
            f"; orphans pin {amount_text(summary.orphaned_resident_bytes, exact=exact)} "
            f"({amount_text(summary.orphaned_size_bytes, exact=exact)} apparent); `{reap}` removes them"
        )
    return line


def _starting_wait(summary: ScanSummary) -> str:
    """When the ``starting`` files leave the grace period: ``removable in 12s to 28s; run again
    after that``. Empty when nothing is starting."""
    first, last = summary.starting_first_removable_in_s, summary.starting_last_removable_in_s
    if first is None or last is None:
        return ""
    soonest, latest = _wait_text(first), _wait_text(last)
    span = soonest if soonest == latest else f"{soonest} to {latest}"
    return f"removable in {span}; run again after that"


def _wait_text(seconds: float) -> str:
    """A wait, rounded up so that it is never early: ``28s``, ``10m``, ``3h``, ``2d``."""
    s = math.ceil(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{math.ceil(s / 60)}m"
    if s < 172800:
        return f"{math.ceil(s / 3600)}h"
    return f"{math.ceil(s / 86400)}d"


def _limit(limit: int | None) -> int:
    """Rows to show: ``--limit`` when given (0: all), else 50 on a terminal and all in a pipe."""
    if limit is not None:
        return limit
    return TERMINAL_LIMIT if sys.stdout.isatty() else 0


def _stderr_line(text: str, style: str | None = None) -> None:
    line = printable(text, escape_backslash=False)
    sys.stderr.write(styled(line, style, color=color_enabled(sys.stderr)) + "\n")
    sys.stderr.flush()


def _summary(text: str, *, headers: bool) -> None:
    """The closing line on stdout, left out with ``--no-headers`` (rows only).

    Escaped as a whole (names in it are escaped already; ``printable`` leaves their escapes
    as they are): the filters are the operator's words, and may be a name pasted from a
    listing (``--engine "$(ls ...)"``).
    """
    if headers:
        line = printable(text, escape_backslash=False)
        sys.stdout.write(styled(line, "bold", color=color_enabled(sys.stdout)) + "\n")


@dataclass(slots=True)
class _Seen:
    """What the lines around a scan's table or JSON say of its entries, counted as they pass."""

    euid: int
    unknown: int = 0
    first_unknown: ScanEntry | None = None
    unknown_unleased: bool = False
    unseen: int = 0
    first_unseen: ScanEntry | None = None
    others_skipped: int = 0
    foreign_orphans: bool = False
    orphan_families: set[str] = field(default_factory=set)

    def add(self, entries: Iterable[ScanEntry]) -> None:
        for e in entries:
            status = e.status
            if status is Status.UNKNOWN:
                self.unknown += 1
                if self.first_unknown is None:
                    self.first_unknown = e
                if e.lease is None:
                    self.unknown_unleased = True
            elif status is Status.LIVE:
                if e.decided_by is Evidence.LEASE:
                    self.unseen += 1
                    if self.first_unseen is None:
                        self.first_unseen = e
            elif status is Status.ORPHANED:
                self.foreign_orphans = self.foreign_orphans or e.uid != self.euid
                self.orphan_families.add(e.family)
            elif status is Status.SKIPPED and "owned by uid " in e.reason:
                self.others_skipped += 1


@dataclass(frozen=True, slots=True)
class ScanShown:
    """What a command needs of the scan it showed: the report but its entries (the summary
    counted), the skipped files of other users, and whether a dead reap left files parked."""

    report: ScanReport
    others_skipped: int
    unsettled: bool


def scan_judged(
    judged: JudgedRoot,
    *,
    json_output: bool,
    show_deleted: bool,
    limit: int | None = None,
    exact_bytes: bool = False,
    headers: bool = True,
) -> ScanShown:
    """A scan read a region at a time (``JudgedRoot``), as JSON or as a table.

    The JSON goes out as its entries are judged, in ``scan``'s order, the stderr lines after
    it (they count the entries). The table's rows wait in a temporary file until every region
    is in (they are sorted and aligned over all), a terminal's ``--limit`` best kept in memory.
    """
    seen = _Seen(os.geteuid())
    unsettled = any(e.parked is not None and not e.parked.reaper_running for e in judged.parks.parked)
    if json_output:
        report = _scan_json(judged, seen)
        _warn_blind_spots(report, seen)
        untrusted_parks_line(report.untrusted_parks, report.parks)
        return ScanShown(report, seen.others_skipped, unsettled)
    families = judged.head.families
    rows = RowSpill(_with_family_columns(SCAN_COLUMNS, families), cap=_limit(limit))
    try:
        for region in judged.regions():
            seen.add(region)
            _scan_rows(rows, region, families, exact_bytes)
        seen.add(judged.parks.parked)
        _scan_rows(rows, judged.parks.parked, families, exact_bytes)
        report = judged.report()
        _warn_blind_spots(report, seen)
        untrusted_parks_line(report.untrusted_parks, report.parks)
        rows.write(headers=headers)
    finally:
        rows.close()
    if rows.hidden:
        _stderr_line(
            f"… {rows.hidden} more region(s) not shown (--limit 0 shows all; --json for scripts)",
            "dim",
        )
    if show_deleted:
        _deleted_table(report, exact_bytes=exact_bytes, headers=headers)
    # How the root's mount backs regions (huge pages or 4 KiB ones) is in the JSON's
    # ``huge_pages``; its fix is `shmctl doctor`'s and `init --dry-run`'s to say, not every scan's.
    _summary(
        summary_line(
            report.summary,
            report.root,
            exact=exact_bytes,
            reap=_reap_command(seen, report.families),
            families=report.families,
        ),
        headers=headers,
    )
    return ScanShown(report, seen.others_skipped, unsettled)


#: Entries encoded at once: a batch of ``scan --json`` is one call of the encoder.
_JSON_BATCH = 256


def _scan_json(judged: JudgedRoot, seen: _Seen) -> ScanReport:
    """``scan --json``, the document ``json_text`` writes for the whole report, written as the
    entries come: its fields in the report's order (the summary and what else is counted
    follow the entries, as they always did). Nothing is written before the first entries are
    judged, so a root whose files cannot be judged at all (its entries cannot be ``lstat``ed)
    is an error line alone, as before."""
    names = [f.name for f in dataclasses.fields(ScanReport)]
    at = names.index("entries")
    document: JsonDocument | None = None
    batch: list[ScanEntry] = []
    for entry in judged.entries():
        batch.append(entry)
        if len(batch) >= _JSON_BATCH:
            document = _write_entries(document, judged, names[:at], batch, seen)
            batch = []
    document = _write_entries(document, judged, names[:at], batch, seen)
    document.end_list()
    report = judged.report()
    document.fields(report, names[at + 1 :])
    document.close()
    return report


def _write_entries(
    document: JsonDocument | None, judged: JudgedRoot, head: list[str], batch: list[ScanEntry], seen: _Seen
) -> JsonDocument:
    """``batch`` into ``document``, begun here (its ``head`` fields) if it was not yet."""
    if document is None:
        document = JsonDocument(stdout_bytes(), pretty=sys.stdout.isatty())
        document.fields(judged.head, head)
        document.begin_list("entries")
    seen.add(batch)
    document.items(batch)
    return document


def _with_family_columns(columns: Sequence[Column], families: Sequence[str]) -> tuple[Column, ...]:
    """``columns`` with FAMILY after the first where ``families`` asks for more than offload."""
    if not _beyond_offload(families):
        return tuple(columns)
    return (columns[0], FAMILY_COLUMN, *columns[1:])


def _family_cells(cells: list[str], family: str, families: Sequence[str]) -> list[str]:
    """A row's cells with its family after the first, as ``_with_family_columns``."""
    return [cells[0], family, *cells[1:]] if _beyond_offload(families) else cells


def _scan_rows(rows: RowSpill, entries: Iterable[ScanEntry], families: Sequence[str], exact: bool) -> None:
    for row in _rows(entries):
        first = row.first
        cells = [
            first.status.value,
            row.engine,
            str(len(row.entries)),
            size_text(row.size, exact=exact),
            size_text(row.resident, exact=exact),
            human_age(row.changed),
            _holders_text(row.holders),
            printable(first.reason),
        ]
        rows.add(
            (_ORDER[first.status], -row.resident, first.name),
            _family_cells(cells, first.family, families),
            STYLE[first.status],
        )


def _reap_command(seen: _Seen, families: Sequence[str]) -> str:
    """The reap that removes every orphan of the scan: root's own reap leaves other users' files."""
    command = "shmctl reap --all-users" if seen.foreign_orphans else "shmctl reap"
    if _beyond_offload(families):
        command += "".join(f" --family {name}" for name in families if name in seen.orphan_families)
    return command


def _deleted_table(report: ScanReport, *, exact_bytes: bool, headers: bool) -> None:
    if not report.deleted:
        _summary("no unlinked region is still mapped or open", headers=headers)
        return
    if headers:
        sys.stdout.write("\n")
    write_table(
        DELETED_COLUMNS,
        [
            (
                str(d.pid),
                token(d.name),
                size_text(d.mapped_bytes, exact=exact_bytes),
                ",".join(d.via),
                printable(d.path),
            )
            for d in report.deleted
        ],
        headers=headers,
    )


def _warn_blind_spots(report: ScanReport, seen: _Seen) -> None:
    _note_visibility(report.visibility, report.lease_enabled, seen.unseen, seen.first_unseen)
    blind = report.blind_spots
    if not seen.unknown or not blind or not seen.unknown_unleased or seen.first_unknown is None:
        return
    shown = "; ".join(u.describe() for u in blind[:3])
    more = f" and {len(blind) - 3} more" if len(blind) > 3 else ""
    warning_line(
        f"could not inspect {len(blind)} process(es): {shown}{more}. Files they could hold "
        f"are 'unknown' and never reaped where no write lease can be taken; "
        f"{unknown_fix(seen.first_unknown)}"
    )


def _note_visibility(
    view: Visibility | None, lease_enabled: bool, unseen: int, first_unseen: ScanEntry | None
) -> None:
    """Say once when this /proc cannot show every holder: the lease still proves them."""
    if view is not None and not view.complete:
        proof = "proven by the write lease, not named" if lease_enabled else "unproven: leases are off"
        warning_line(f"this scan's /proc shows {view.detail}; holders outside it are {proof}", note=True)
    elif unseen and first_unseen is not None:
        warning_line(
            f"{unseen} file(s) are held by processes this /proc does not show "
            f"(the write lease was refused): {printable(first_unseen.name)} first",
            note=True,
        )


def unknown_fix(entry: ScanEntry) -> str:
    """What an operator can do about a file the evidence could not decide."""
    error = entry.lease_error or ""
    if entry.decided_by is Evidence.OWNER:
        return "its owner process still runs: stop it first, or confirm it does not use the file"
    if entry.decided_by is Evidence.PROBE:
        return "it changed during the scan: run the command again"
    if error.startswith("disabled"):
        return "drop --no-lease so the write lease can prove it free"
    if error.startswith("not the file's owner"):
        return "run as root or as the file's owner, so a write lease can be taken"
    return (
        "run as root in the engines' PID namespace, or vouch for a process that maps no region "
        "with --assume-not-holding PID"
    )


def _reap_rows(
    verb: str, entries: Sequence[ScanEntry], *, exact: bool, style: str | None = None
) -> list[Sequence[Cell]]:
    return [
        (
            (verb, STYLE[row.first.status] if verb == "kept" else style),
            row.engine,
            str(len(row.entries)),
            size_text(row.size, exact=exact),
            size_text(row.resident, exact=exact),
            printable(_other_user_reason(row) if verb == "left" else row.first.reason),
            row.first.family,
        )
        for row in _rows(entries)
    ]


def _other_user_reason(row: _Row) -> str:
    owners = uids_text(_foreign_uids(row.entries))
    return f"{owners}, not yours: removed only with --all-users; {row.first.reason}"


def _foreign_uids(entries: Iterable[ScanEntry]) -> list[int]:
    """The owners of ``entries`` other than us (a region left whole may hold a file of ours)."""
    euid = os.geteuid()
    return sorted({e.uid for e in entries if e.uid != euid})


@dataclass(slots=True)
class _Listed:
    """One list of a reap report as it passes: its files, their resident bytes, the first."""

    files: int = 0
    resident: int = 0
    first: ScanEntry | None = None
    #: Regions (units) among them, counted as they change.
    regions: int = 0
    _unit: tuple[str, str] | None = None

    def add(self, entries: Sequence[ScanEntry]) -> None:
        for e in entries:
            self.files += 1
            self.resident += e.resident_bytes
            if self.first is None:
                self.first = e
            if e.unit != self._unit:
                self._unit = e.unit
                self.regions += 1


#: The rows of a reap's table, in this order: (list, the first column's word, its style;
#: None: the status's).
_REAP_VERBS = (
    ("removed", "removed", None),
    ("restored", "restored", None),
    ("parked", "parked", None),
    ("failed", "failed", "bold red"),
    ("kept", "kept", None),
    ("other_users_left", "left", STYLE[Status.ORPHANED]),
)


class ReapWriter:
    """A reap's report written as the reap produces it: the sink of ``reap_into``.

    Every list of entries goes, as it comes, to a temporary file (``--json``: ``JsonSpill``, one
    per list) or into the table's rows (``RowSpill``); only counts, bytes and the first entry of
    each list are held. ``finish`` writes the stderr lines, then the document or the table and
    the summary line, exactly as for a whole ``ReapReport`` (``reap_report``).
    """

    def __init__(
        self,
        *,
        dry_run: bool,
        json_output: bool,
        families: Sequence[str],
        filters_text: str = "",
        exact_bytes: bool = False,
        headers: bool = True,
    ) -> None:
        from kvoffload.liveness.reap import STREAMED_FIELDS
        from kvoffload.liveness.removal import STOPPED  # the reap's own words (scan never loads it)

        self._stopped_reason = STOPPED
        self.dry_run = dry_run
        self.json_output = json_output
        self.families = tuple(families)
        self.filters_text = filters_text
        self.exact = exact_bytes
        self.headers = headers
        self.lists = {name: _Listed() for name in STREAMED_FIELDS}
        self.stopped = 0
        self.foreign_uids: set[int] = set()
        self._euid = os.geteuid()
        self._failed: set[int] = set()
        self._spills = (
            {name: JsonSpill(pretty=sys.stdout.isatty()) for name in STREAMED_FIELDS} if json_output else {}
        )
        self._rows = None if json_output else RowSpill(_with_family_columns(REAP_COLUMNS, families))
        self._verbs = {name: (rank, verb, style) for rank, (name, verb, style) in enumerate(_REAP_VERBS)}

    def take(self, field: str, entries: Sequence[ScanEntry]) -> None:
        if not entries:
            return
        self.lists[field].add(entries)
        if field == "kept":
            self.stopped += sum(1 for e in entries if e.reason == self._stopped_reason)
        elif field == "other_users_left":
            self.foreign_uids.update(e.uid for e in entries if e.uid != self._euid)
        if self._rows is None:
            self._spills[field].add(entries)
            return
        if field == "failed":
            self._failed = {id(e) for e in entries}
        elif field == "kept" and self._failed:
            # A failed entry is kept too (``failed`` comes first): its row is the failed one.
            entries = [e for e in entries if id(e) not in self._failed]
            self._failed = set()
        verb = self._verbs.get(field)
        if verb is not None:
            self._add_rows(entries, *verb)

    def _add_rows(self, entries: Sequence[ScanEntry], rank: int, verb: str, style: str | None) -> None:
        assert self._rows is not None
        if verb == "removed" and self.dry_run:
            verb = "would-remove"
        for row in _rows(entries):
            first = row.first
            cells = [
                verb,
                row.engine,
                str(len(row.entries)),
                size_text(row.size, exact=self.exact),
                size_text(row.resident, exact=self.exact),
                printable(_other_user_reason(row) if verb == "left" else first.reason),
            ]
            self._rows.add(
                (rank, _ORDER[first.status], -row.resident, first.name),
                _family_cells(cells, first.family, self.families),
                STYLE[first.status] if verb == "kept" else style,
            )

    def finish(self, report: ReapReport) -> None:
        """The stderr lines, then ``--json``'s document or the table and the summary line."""
        try:
            _note_visibility(report.visibility, report.lease_enabled, 0, None)
            untrusted_parks_line(report.untrusted_parks)
            self._failed_line(report)
            for missing in report.unmatched_filters:
                warning_line(f"{missing} matches no region in {printable(str(report.root))}")
            self._kept_unknown_line()
            if self._rows is None:
                self._document(report)
                return
            self._rows.write(headers=self.headers)
            _summary(self._summary_line(report), headers=self.headers)
        finally:
            self.close()

    def close(self) -> None:
        for spill in self._spills.values():
            spill.close()
        if self._rows is not None:
            self._rows.close()

    def _document(self, report: ReapReport) -> None:
        document = JsonDocument(stdout_bytes(), pretty=sys.stdout.isatty())
        for f in dataclasses.fields(report):
            spill = self._spills.get(f.name)
            if spill is None:
                document.field(f.name, getattr(report, f.name))
            else:
                document.spilled(f.name, spill)
        document.close()

    def _failed_line(self, report: ReapReport) -> None:
        """One line on stderr when reap failed to remove what it proved orphaned: why, and the fix."""
        failed = self.lists["failed"]
        first = failed.first
        if first is None:
            return
        error_line(
            f"could not remove {failed.files} orphaned file(s) in {printable(str(report.root))}: "
            f"{printable(first.name)}: {printable(first.reason.removeprefix('kept: '))} "
            f"(fix: {_failure_fix(first.reason, str(report.root))})"
        )

    def _kept_unknown_line(self) -> None:
        """One stderr line whenever reap kept files it could not prove dead: never silent."""
        unknown = self.lists["unknown"]
        first = unknown.first
        if first is None:
            return
        warning_line(
            f"kept {unknown.files} unknown file(s), {human_bytes(unknown.resident)} "
            f"resident: {printable(first.name)}: {printable(first.reason)} (fix: {unknown_fix(first)})"
        )

    def _live_note(self) -> str:
        """``; live: ENGINE: held by …`` for the first live region reap kept (and how many more):
        a restarting engine that does not fit waits on them, and the operator needs the pids."""
        live = self.lists["live"]
        first = live.first
        if first is None:
            return ""
        more = live.regions - 1
        tail = f" (and {more} more live region(s))" if more else ""
        return f"; live: {printable(first.engine_id)}: {printable(first.reason)}{tail}"

    def _other_users_note(self) -> str:
        """What the reap left of other users' orphans, and the fix; empty when it left none."""
        left = self.lists["other_users_left"]
        if not left.files:
            return ""
        resident = amount_text(left.resident, exact=self.exact)
        return (
            f"left {left.files} orphaned file(s) of other users ({uids_text(sorted(self.foreign_uids))}), "
            f"{resident} resident: pass --all-users to remove them"
        )

    def _filter_notes(self) -> str:
        left = self.lists["filtered_out"]
        if not left.files:
            return ""
        return (
            f"; {left.files} orphaned file(s) ({amount_text(left.resident, exact=self.exact)} "
            f"resident) do not match {self.filters_text or 'the filters'} and stay"
        )

    def _summary_line(self, report: ReapReport) -> str:
        lists, exact = self.lists, self.exact
        files = lists["removed"].files
        kept, failed, conflicts = lists["kept"].files, lists["failed"].files, lists["conflicts"].files
        restored, parked = lists["restored"].files, lists["parked"].files
        freed = amount_text(report.freed_bytes, exact=exact)
        others = self._other_users_note()
        quiet = not (kept or restored or parked or report.parks_removed)
        # Where the summary line is not the scan's own (which says it), the starting files still
        # say when a reap could take them: an operator who sees them left runs reap again then.
        wait = _starting_wait(report.summary)
        starting = f"; {report.summary.starting} starting file(s) left ({wait})" if wait else ""
        if not files and quiet:
            if others:
                line = f"nothing to reap; {others}" + self._filter_notes() + starting
            elif lists["filtered_out"].files:
                line = "nothing to reap" + self._filter_notes() + starting
            else:
                line = "nothing to reap: " + summary_line(
                    report.summary, report.root, exact=exact, families=report.families
                )
        else:
            verb = "would remove" if report.dry_run else "removed"
            line = f"{verb} {files} file(s), {'freeing' if report.dry_run else 'freed'} {freed}"
            if restored:
                line += f"; gave {restored} parked file(s) back their names"
            if parked:
                line += f"; {parked} file(s) left parked by a dead reap to settle"
            if report.parks_removed:
                line += f"; removed {len(report.parks_removed)} park director(ies) dead reapers left"
            if failed:
                line += f"; could not remove {failed} (see the failed rows)"
            if self.stopped:
                line += f"; {self.stopped} not begun: the reap was stopped"
            changed = kept - conflicts - failed - self.stopped
            if changed:
                line += f"; kept {changed} that changed since the plan"
            if conflicts:
                line += f"; {conflicts} conflict(s): parked, name taken, nothing removed"
            if others:
                line += f"; {others}"
            line += self._filter_notes() + starting
        return line + self._live_note()


def reap_report(
    report: ReapReport,
    *,
    json_output: bool,
    filters_text: str = "",
    exact_bytes: bool = False,
    headers: bool = True,
) -> None:
    """A whole ``ReapReport``, as ``ReapWriter`` writes a reap that streams."""
    from kvoffload.liveness.reap import STREAMED_FIELDS

    writer = ReapWriter(
        dry_run=report.dry_run,
        json_output=json_output,
        families=report.families,
        filters_text=filters_text,
        exact_bytes=exact_bytes,
        headers=headers,
    )
    # ``failed`` before ``kept``: a failed entry is kept too, and shown once, as failed.
    for name in ("failed", *(n for n in STREAMED_FIELDS if n != "failed")):
        writer.take(name, getattr(report, name))
    writer.finish(report)


def _failure_fix(reason: str, root: str) -> str:
    if "ENOSPC" in reason or "EDQUOT" in reason:
        return (
            f"free one inode in {printable(root)} (remove a file you know is unused, or remount it with "
            "more nr_inodes), then run reap again"
        )
    if "EMFILE" in reason or "ENFILE" in reason:
        return "raise ulimit -n, then run reap again"
    if "EACCES" in reason or "EPERM" in reason or "EROFS" in reason:
        return "run as root or as the files' owner, on a writable mount"
    return "run reap again once the cause is gone"


def untrusted_parks_line(untrusted: Sequence[UntrustedPark], parks: Sequence[ParkView] = ()) -> None:
    """Say what is named like a reaper's park directory and was left alone, and why."""
    if untrusted:
        first = untrusted[0]
        more = f" and {len(untrusted) - 1} more (--json lists them)" if len(untrusted) > 1 else ""
        warning_line(
            f"{len(untrusted)} entr(ies) named like a reaper's park directory that this run may not "
            f"trust were left untouched: {printable(first.name)} ({first.kind}, uid {first.uid}, "
            f"mode {first.mode}: {printable(first.reason)}){more}"
        )
    for p in parks:
        if p.strangers:
            warning_line(
                f"park directory {printable(p.name)} holds {p.strangers} entr(ies) no reaper of ours parks: "
                "they, and the directory, are left untouched"
            )


def reap_preview(report: ReapReport, *, shown: int = 20, exact_bytes: bool = False) -> None:
    """What a confirmed reap will remove, on stderr (stdout is for the result)."""
    rows = _reap_rows("will-remove", report.removed, exact=exact_bytes)
    write_table(*_with_family(REAP_COLUMNS, rows[:shown], report.families), stream=sys.stderr)
    if len(rows) > shown:
        _stderr_line(f"… and {len(rows) - shown} more region(s) (--dry-run --json lists all)")


def confirm_question(report: ReapReport) -> str:
    return f"Remove {len(report.removed)} orphaned file(s), freeing {human_bytes(report.freed_bytes)}?"


def reap_declined() -> None:
    _stderr_line("nothing removed")
