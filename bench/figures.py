"""The row every bench script reports, its table and its JSON: what ``make bench`` merges.

Imported by the scripts as a sibling module (``python bench/bench_x.py`` puts ``bench/`` first
on ``sys.path``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class Row:
    """One figure, in the form the ``make bench`` harness merges."""

    figure: str
    unit: str
    median: float
    min: float
    max: float
    baseline: str
    ratio: float
    goal: str
    met: bool


def print_table(table: Sequence[Row], *, value: str, digits: int) -> None:
    """Figure, median, min-max, ratio and goal (with its verdict), one aligned line each."""
    width = max(len(r.figure) for r in table)
    spans = [f"{r.min:.{digits}f}-{r.max:.{digits}f}" for r in table]
    span_width = max(len("min-max"), *(len(s) for s in spans))
    value_width = max(len(value), *(len(f"{r.median:.{digits}f}") for r in table))
    print(f"{'figure':<{width}}  {value:>{value_width}}  {'min-max':>{span_width}}  {'ratio':>6}  goal")
    for r, span in zip(table, spans, strict=True):
        verdict = ("met" if r.met else "NOT MET") if r.goal else ""
        line = (
            f"{r.figure:<{width}}  {r.median:{value_width}.{digits}f}  {span:>{span_width}}  {r.ratio:6.2f}"
        )
        print(f"{line}  {r.goal} {verdict}".rstrip())


def write_json(table: Sequence[Row], path: str) -> None:
    with open(path, "w") as f:
        json.dump([asdict(r) for r in table], f, indent=2)
        f.write("\n")
