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

import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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
    emit_json,
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

if TYPE_CHECKING:  # annotations only: `shmctl scan` never imports the reaper
    from kvoffload.liveness.holders import Holder
    from kvoffload.liveness.namespace import Visibility
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


def scan_report(
    report: ScanReport,
    *,
    json_output: bool,
    show_deleted: bool,
    limit: int | None = None,
    exact_bytes: bool = False,
    headers: bool = True,
) -> None:
    _warn_blind_spots(report)
    untrusted_parks_line(report.untrusted_parks, report.parks)
    if json_output:
        emit_json(report)
        return
    rows = _rows(report.entries)
    cap = _limit(limit)
    shown = rows if cap == 0 else rows[:cap]
    table: list[Sequence[Cell]] = [
        (
            (row.first.status.value, STYLE[row.first.status]),
            row.engine,
            str(len(row.entries)),
            size_text(row.size, exact=exact_bytes),
            size_text(row.resident, exact=exact_bytes),
            human_age(row.changed),
            _holders_text(row.holders),
            printable(row.first.reason),
            row.first.family,
        )
        for row in shown
    ]
    if table:
        write_table(*_with_family(SCAN_COLUMNS, table, report.families), headers=headers)
    if len(shown) < len(rows):
        _stderr_line(
            f"… {len(rows) - len(shown)} more region(s) not shown (--limit 0 shows all; --json for scripts)",
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
            reap=_reap_command(report),
            families=report.families,
        ),
        headers=headers,
    )


def _reap_command(report: ScanReport) -> str:
    """The reap that removes every orphan of the scan: root's own reap leaves other users' files."""
    euid = os.geteuid()
    others = any(e.uid != euid for e in report.with_status(Status.ORPHANED))
    command = "shmctl reap --all-users" if others else "shmctl reap"
    if _beyond_offload(report.families):
        found = {e.family for e in report.with_status(Status.ORPHANED)}
        command += "".join(f" --family {name}" for name in report.families if name in found)
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


def _live_note(report: ReapReport) -> str:
    """``; live: ENGINE: held by …`` for the first live region reap kept (and how many more):
    a restarting engine that does not fit waits on them, and the operator needs the pids."""
    if not report.live:
        return ""
    first = report.live[0]
    more = len({e.unit for e in report.live}) - 1
    tail = f" (and {more} more live region(s))" if more else ""
    return f"; live: {printable(first.engine_id)}: {printable(first.reason)}{tail}"


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


def _other_users_note(report: ReapReport, *, exact: bool) -> str:
    """What the reap left of other users' orphans, and the fix; empty when it left none."""
    left = report.other_users_left
    if not left:
        return ""
    uids = _foreign_uids(left)
    resident = amount_text(sum(e.resident_bytes for e in left), exact=exact)
    return (
        f"left {len(left)} orphaned file(s) of other users ({uids_text(uids)}), {resident} resident: "
        "pass --all-users to remove them"
    )


def _filter_notes(report: ReapReport, filters_text: str, *, exact: bool) -> str:
    if not report.filtered_out:
        return ""
    left = report.filtered_out
    return (
        f"; {len(left)} orphaned file(s) ({amount_text(sum(e.resident_bytes for e in left), exact=exact)} "
        f"resident) do not match {filters_text or 'the filters'} and stay"
    )


def reap_report(
    report: ReapReport,
    *,
    json_output: bool,
    filters_text: str = "",
    exact_bytes: bool = False,
    headers: bool = True,
) -> None:
    _note_visibility(report.visibility, report.lease_enabled, ())
    untrusted_parks_line(report.untrusted_parks)
    failed_line(report)
    for missing in report.unmatched_filters:
        warning_line(f"{missing} matches no region in {printable(str(report.root))}")
    kept_unknown_line(report)
    if json_output:
        emit_json(report)
        return
    failed = {id(e) for e in report.failed}
    rows = _reap_rows("would-remove" if report.dry_run else "removed", report.removed, exact=exact_bytes)
    rows += _reap_rows("restored", report.restored, exact=exact_bytes)
    rows += _reap_rows("parked", report.parked, exact=exact_bytes)
    rows += _reap_rows("failed", report.failed, exact=exact_bytes, style="bold red")
    rows += _reap_rows("kept", [e for e in report.kept if id(e) not in failed], exact=exact_bytes)
    rows += _reap_rows("left", report.other_users_left, exact=exact_bytes, style=STYLE[Status.ORPHANED])
    if rows:
        write_table(*_with_family(REAP_COLUMNS, rows, report.families), headers=headers)
    files = len(report.removed)
    freed = amount_text(report.freed_bytes, exact=exact_bytes)
    others = _other_users_note(report, exact=exact_bytes)
    quiet = not (report.kept or report.restored or report.parked or report.parks_removed)
    # Where the summary line is not the scan's own (which says it), the starting files still
    # say when a reap could take them: an operator who sees them left runs reap again then.
    wait = _starting_wait(report.summary)
    starting = f"; {report.summary.starting} starting file(s) left ({wait})" if wait else ""
    if not files and quiet:
        if others:
            line = f"nothing to reap; {others}" + _filter_notes(report, filters_text, exact=exact_bytes)
            line += starting
        elif report.filtered_out:
            line = "nothing to reap" + _filter_notes(report, filters_text, exact=exact_bytes) + starting
        else:
            line = "nothing to reap: " + summary_line(
                report.summary, report.root, exact=exact_bytes, families=report.families
            )
    else:
        verb = "would remove" if report.dry_run else "removed"
        line = f"{verb} {files} file(s), {'freeing' if report.dry_run else 'freed'} {freed}"
        if report.restored:
            line += f"; gave {len(report.restored)} parked file(s) back their names"
        if report.parked:
            line += f"; {len(report.parked)} file(s) left parked by a dead reap to settle"
        if report.parks_removed:
            line += f"; removed {len(report.parks_removed)} park director(ies) dead reapers left"
        if report.failed:
            line += f"; could not remove {len(report.failed)} (see the failed rows)"
        from kvoffload.liveness.removal import STOPPED  # the reap's own words (scan never loads it)

        stopped = sum(1 for e in report.kept if e.reason == STOPPED)
        if stopped:
            line += f"; {stopped} not begun: the reap was stopped"
        changed = len(report.kept) - len(report.conflicts) - len(report.failed) - stopped
        if changed:
            line += f"; kept {changed} that changed since the plan"
        if report.conflicts:
            line += f"; {len(report.conflicts)} conflict(s): parked, name taken, nothing removed"
        if others:
            line += f"; {others}"
        line += _filter_notes(report, filters_text, exact=exact_bytes) + starting
    _summary(line + _live_note(report), headers=headers)


def failed_line(report: ReapReport) -> None:
    """One line on stderr when reap failed to remove what it proved orphaned: why, and the fix."""
    if not report.failed:
        return
    first = report.failed[0]
    error_line(
        f"could not remove {len(report.failed)} orphaned file(s) in {printable(str(report.root))}: "
        f"{printable(first.name)}: {printable(first.reason.removeprefix('kept: '))} "
        f"(fix: {_failure_fix(first.reason, str(report.root))})"
    )


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
