"""Rendering of ``AuditReport``."""

from __future__ import annotations

import shlex

from kvoffload.liveness.audit import AuditReport
from shmctl.render import console, emit_json, human_bytes, printable


def audit_report(report: AuditReport, *, json_output: bool) -> None:
    if json_output:
        emit_json({**_fields(report), "clean": report.clean})
        return
    out = console(stderr=True)  # the command's own output owns stdout
    command = printable(shlex.join(report.command), escape_backslash=False)
    if report.clean:
        out.print(
            f"shmctl audit: clean: `{command}` left no region in {report.root} "
            f"(exit {report.command_exit_code}, {report.duration_s:.1f}s)",
            markup=False,
        )
        return
    out.print(
        f"shmctl audit: LEAK: `{command}` left {len(report.leaked)} region file(s) and "
        f"{len(report.leaked_deleted)} mapped-but-deleted region(s), "
        f"{human_bytes(report.leaked_resident_bytes)} resident",
        markup=False,
    )
    for entry in report.leaked:
        out.print(
            f"  {entry.status}\t{printable(str(entry.path))}\t{human_bytes(entry.resident_bytes)}\t"
            f"{printable(entry.reason)}",
            markup=False,
        )
    for d in report.leaked_deleted:
        out.print(
            f"  deleted\t{printable(d.path)}\tpid {d.pid} ({printable(d.name)})\t"
            f"{human_bytes(d.mapped_bytes)} mapped",
            markup=False,
        )
    out.print(
        f"  remove orphans with: shmctl reap --root {shlex.quote(str(report.root))} --grace 0s --yes",
        markup=False,
    )


def _fields(report: AuditReport) -> dict[str, object]:
    from shmctl.render import to_jsonable

    data = to_jsonable(report)
    assert isinstance(data, dict)
    return data
