"""Rendering of ``DoctorReport``: JSON, or a table of checks with the fix under each that is not ok.

One row per check (CHECK, STATUS, FINDING); a check that is not ok and has a fix is followed
by a row whose first two cells are empty and whose FINDING is ``fix: ...``, so the fix sits
under the finding it answers. The same rows on a terminal and in a pipe (``write_table``):
``awk '$2 == "fail"'`` lists the failures, ``grep 'fix:'`` the fixes. A summary line closes
the table, as scan's does.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvoffload.doctor import CheckStatus, DoctorReport
from shmctl.render import Cell, Column, color_enabled, emit_json, styled, write_table

COLUMNS = (Column("CHECK"), Column("STATUS"), Column("FINDING"))
STYLE = {
    CheckStatus.OK: "green",
    CheckStatus.WARN: "yellow",
    CheckStatus.FAIL: "bold red",
    CheckStatus.SKIP: "dim",
}


def doctor_report(report: DoctorReport, *, json_output: bool) -> None:
    if json_output:
        emit_json(report)
        return
    rows: list[Sequence[Cell]] = []
    for check in report.checks:
        rows.append((check.name, (check.status.value, STYLE[check.status]), check.finding))
        if check.fix and check.status is not CheckStatus.OK:
            rows.append(("", "", f"fix: {check.fix}"))
    write_table(COLUMNS, rows)
    sys.stdout.write(styled(summary_line(report), "bold", color=color_enabled(sys.stdout)) + "\n")


def summary_line(report: DoctorReport) -> str:
    s = report.summary
    verdict = "not ready" if s.fail else "ready"
    return f"{len(report.checks)} checks: {s.ok} ok, {s.warn} warn, {s.fail} fail, {s.skip} skip: {verdict}"
