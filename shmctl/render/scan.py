"""Rendering of ``ScanReport`` and ``ReapReport``: JSON, a rich table, or plain text.

The JSON is the report dataclass serialised by ``to_jsonable``, so tables and scripts
read one source of truth. Tables show one row per region (base file plus segments) and
at most ``limit`` rows; plain text (not a terminal, ``NO_COLOR``) prints every file, one
tab-separated line each, for grep and awk. Engine ids are arbitrary strings, so names
are never interpreted as rich markup, and their control characters are escapes in text
(a name cannot forge a line, a column or a terminal sequence).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.liveness.holders import Holder
from kvoffload.liveness.namespace import Visibility
from kvoffload.liveness.reap import ReapReport
from kvoffload.liveness.scan import Evidence, ScanEntry, ScanReport, ScanSummary, Status
from shmctl.render import console, emit_json, human_age, human_bytes, plain_output, printable, warning_line

if TYPE_CHECKING:
    from rich.console import Console

STYLE = {
    Status.ORPHANED: "bold red",
    Status.UNKNOWN: "yellow",
    Status.STARTING: "cyan",
    Status.LIVE: "green",
    Status.SKIPPED: "dim",
}
_ORDER = {status: rank for rank, status in enumerate(STYLE)}
_PLAIN_COLUMNS = ("STATUS", "NAME", "SIZE", "RESIDENT", "AGE", "HOLDERS", "REASON")


@dataclass(frozen=True, slots=True)
class _Row:
    """One region (or the files of it that share a status) as a table row."""

    entries: tuple[ScanEntry, ...]

    @property
    def first(self) -> ScanEntry:
        return self.entries[0]

    @property
    def label(self) -> str:
        return printable(self.first.name) + self._segments

    @property
    def engine(self) -> str:
        return printable(self.first.engine_id) + self._segments

    @property
    def _segments(self) -> str:
        extra = len(self.entries) - 1
        return f" (+{extra} segment{'s' * (extra > 1)})" if extra else ""

    @property
    def resident(self) -> int:
        return sum(e.resident_bytes for e in self.entries)

    @property
    def size(self) -> int:
        return sum(e.size_bytes for e in self.entries)

    @property
    def age(self) -> float:
        return min(e.age_s for e in self.entries)

    @property
    def holders(self) -> list[Holder]:
        seen: dict[int, Holder] = {}
        for e in self.entries:
            for h in e.holders:
                seen.setdefault(h.pid, h)
        return list(seen.values())


def _rows(entries: Iterable[ScanEntry]) -> list[_Row]:
    grouped: dict[tuple[str, Status], list[ScanEntry]] = {}
    for e in entries:
        grouped.setdefault((e.engine_id, e.status), []).append(e)
    rows = [_Row(tuple(sorted(g, key=lambda e: e.segment))) for g in grouped.values()]
    rows.sort(key=lambda r: (_ORDER[r.first.status], -r.resident, r.first.name))
    return rows


def _holders_text(holders: Sequence[Holder], shown: int = 3) -> str:
    if not holders:
        return "-"
    text = ", ".join(f"{h.pid}:{printable(h.name)}" for h in holders[:shown])
    return text + (f" +{len(holders) - shown}" if len(holders) > shown else "")


def summary_line(summary: ScanSummary, root: object) -> str:
    if not summary.total:
        return f"no region files in {printable(str(root))}"
    counts = ", ".join(f"{getattr(summary, s.value)} {s.value}" for s in Status if getattr(summary, s.value))
    line = f"{summary.total} region file(s) in {printable(str(root))}: {counts}"
    if summary.orphaned:
        line += (
            f"; orphans pin {human_bytes(summary.orphaned_resident_bytes)} "
            f"({human_bytes(summary.orphaned_size_bytes)} apparent); `shmctl reap` removes them"
        )
    return line


class _Out:
    """Lines for a person: verbatim when plain (tabs kept for cut and awk), styled on a terminal."""

    def __init__(self, *, stderr: bool = False) -> None:
        self.stream = sys.stderr if stderr else sys.stdout
        self.plain = plain_output()
        self.rich: Console | None = None if self.plain else console(stderr=stderr)

    def line(self, text: str, style: str | None = None) -> None:
        if self.rich is None:
            self.stream.write(text + "\n")
        else:
            self.rich.print(text, style=style, markup=False, highlight=False)


def scan_report(report: ScanReport, *, json_output: bool, show_deleted: bool, limit: int) -> None:
    _warn_blind_spots(report)
    if json_output:
        emit_json(report)
        return
    out = _Out()
    if out.rich is None:
        if report.entries:
            out.line("\t".join(_PLAIN_COLUMNS))
        for e in report.entries:
            fields = (
                e.status.value,
                printable(e.name),
                human_bytes(e.size_bytes),
                human_bytes(e.resident_bytes),
                human_age(e.age_s),
                _holders_text(e.holders, shown=len(e.holders)),
                printable(e.reason),
            )
            out.line("\t".join(fields))
        if show_deleted:
            for d in report.deleted:
                out.line(
                    f"deleted\t{d.pid}\t{printable(d.name)}\t{printable(d.path)}\t{human_bytes(d.mapped_bytes)}"
                )
        out.line(summary_line(report.summary, report.root))
        return

    from rich.table import Table
    from rich.text import Text

    rows = _rows(report.entries)
    shown = rows if limit == 0 else rows[:limit]
    table = Table(title=f"region files in {printable(str(report.root))}", title_justify="left")
    table.add_column("status", no_wrap=True)
    table.add_column("engine id", overflow="fold", ratio=2)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("resident", justify="right", no_wrap=True)
    table.add_column("age", justify="right", no_wrap=True)
    table.add_column("holders", overflow="fold", ratio=1)
    table.add_column("reason", overflow="fold", ratio=3)
    for row in shown:
        status = row.first.status
        table.add_row(
            Text(status.value, style=STYLE[status]),
            Text(row.engine),
            human_bytes(row.size),
            human_bytes(row.resident),
            human_age(row.age),
            Text(_holders_text(row.holders)),
            Text(printable(row.first.reason)),
        )
    if rows:
        out.rich.print(table)
    if len(shown) < len(rows):
        out.line(
            f"… {len(rows) - len(shown)} more region(s) not shown (--limit 0 shows all; --json for scripts)",
            style="dim",
        )
    if show_deleted:
        _deleted_table(out.rich, report)
    out.line(summary_line(report.summary, report.root), style="bold")


def _deleted_table(out: Console, report: ScanReport) -> None:
    from rich.table import Table
    from rich.text import Text

    if not report.deleted:
        out.print("no unlinked region is still mapped or open", markup=False)
        return
    table = Table(title="unlinked regions still mapped or open", title_justify="left")
    for column in ("pid", "process", "path", "mapped", "via"):
        table.add_column(column, justify="right" if column in ("pid", "mapped") else "left")
    for d in report.deleted:
        table.add_row(
            str(d.pid),
            Text(printable(d.name)),
            Text(printable(d.path)),
            human_bytes(d.mapped_bytes),
            ",".join(d.via),
        )
    out.print(table)


def _warn_blind_spots(report: ScanReport) -> None:
    _note_visibility(report.visibility, report.lease_enabled, report.unseen_holders)
    blind = report.blind_spots
    unknown = report.with_status(Status.UNKNOWN)
    if not unknown or not blind or all(e.lease is not None for e in unknown):
        return
    shown = "; ".join(u.describe() for u in blind[:3])
    more = f" and {len(blind) - 3} more" if len(blind) > 3 else ""
    warning_line(
        f"could not inspect {len(blind)} process(es): {shown}{more}. Files they could hold "
        f"are 'unknown' and never reaped where no write lease can be taken; {unknown_fix(unknown[0])}"
    )


def _note_visibility(view: Visibility | None, lease_enabled: bool, unseen: Sequence[ScanEntry]) -> None:
    """Say once when this /proc cannot show every holder: the lease still proves them."""
    if view is not None and not view.complete:
        proof = "proven by the write lease, not named" if lease_enabled else "unproven: leases are off"
        warning_line(f"this scan's /proc shows {view.detail}; holders outside it are {proof}", note=True)
    elif unseen:
        warning_line(
            f"{len(unseen)} file(s) are held by processes this /proc does not show "
            f"(the write lease was refused): {printable(unseen[0].name)} first",
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


def kept_unknown_line(report: ReapReport) -> None:
    """One stderr line whenever reap kept files it could not prove dead: never silent."""
    if not report.unknown:
        return
    first = report.unknown[0]
    warning_line(
        f"kept {len(report.unknown)} unknown file(s), {human_bytes(report.unknown_resident_bytes)} "
        f"resident: {printable(first.name)}: {printable(first.reason)} (fix: {unknown_fix(first)})"
    )


def _removal_lines(out: _Out, verb: str, entries: Sequence[ScanEntry]) -> list[str]:
    """One line per file when plain, one per region on a terminal."""
    if out.plain:
        return [f"{verb}\t{printable(e.name)}\t{human_bytes(e.resident_bytes)}" for e in entries]
    return [f"{verb}\t{row.label}\t{human_bytes(row.resident)}" for row in _rows(entries)]


def reap_report(report: ReapReport, *, json_output: bool) -> None:
    _note_visibility(report.visibility, report.lease_enabled, ())
    kept_unknown_line(report)
    if json_output:
        emit_json(report)
        return
    out = _Out()
    for line in _removal_lines(out, "would remove" if report.dry_run else "removed", report.removed):
        out.line(line)
    for e in report.kept:
        out.line(f"kept\t{printable(e.name)}\t{printable(e.reason)}", style=STYLE[e.status])
    files = len(report.removed)
    if not files and not report.kept:
        line = f"nothing to reap: {summary_line(report.summary, report.root)}"
    elif report.dry_run:
        line = f"would remove {files} file(s), freeing {human_bytes(report.freed_bytes)}"
    else:
        line = f"removed {files} file(s), freed {human_bytes(report.freed_bytes)}"
    if report.kept:
        line += f"; kept {len(report.kept)} that changed since the plan"
    out.line(line, style="bold")


def reap_preview(report: ReapReport, *, shown: int = 20) -> None:
    """What a confirmed reap will remove, on stderr (stdout is for the result)."""
    err = _Out(stderr=True)
    lines = _removal_lines(err, "will remove", report.removed)
    for line in lines[:shown]:
        err.line(line)
    if len(lines) > shown:
        err.line(f"… and {len(lines) - shown} more (--dry-run --json lists all)")


def confirm_question(report: ReapReport) -> str:
    return f"Remove {len(report.removed)} orphaned file(s), freeing {human_bytes(report.freed_bytes)}?"


def reap_declined() -> None:
    _Out(stderr=True).line("nothing removed")
