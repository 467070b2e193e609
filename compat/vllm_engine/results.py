"""A scenario's rows, and the results made of them: the table and ``results.json``.

A row is one check of one scenario (scenario, expected, got, pass). A scenario's process writes
its rows as JSON; the harness reads them back, prints the table under the versions of the
engine's venv, and writes it to ``<work>/results.md`` and the rows to ``<work>/results.json``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Row:
    scenario: str
    expected: str
    got: str
    passed: bool


def render_table(rows: Sequence[Row]) -> str:
    lines = ["| scenario | expected | got | pass |", "|---|---|---|---|"]
    for r in rows:
        cells = (r.scenario, r.expected, r.got, "yes" if r.passed else "**NO**")
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines)


def render_report(rows: Sequence[Row], versions: str) -> str:
    """The table under the versions of the engine's venv: what is printed and kept in results.md."""
    return f"Versions: {versions}.\n\n" + render_table(rows)


def write_results(work: Path, report: str, rows: Sequence[Row]) -> None:
    (work / "results.md").write_text(report + "\n")
    (work / "results.json").write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
