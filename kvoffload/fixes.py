"""How long a fix may be, and how several remedies share that room.

A fix is read on a terminal at 3 a.m.: ``shmctl doctor``'s row or an error's ``(fix: …)`` fits
two lines of 80 columns. Where a problem has several remedies (a region that does not fit:
reap the dead, resize the mount, shrink the region), the fix keeps the first ones that fit, in
the order given (most specific first), and ends with the docs anchor that lists them all.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Where every remedy is written out in full.
DOC = "docs/doctor.md"
#: The longest finding, so a row of ``shmctl doctor`` (24 columns of CHECK and STATUS) stays
#: within two lines of 80 columns.
FINDING_WIDTH = 160 - 24
#: The longest fix, after ``fix: `` in that row.
FIX_WIDTH = FINDING_WIDTH - len("fix: ")


def doc_link(anchor: str) -> str:
    return f"{DOC}#{anchor}"


def fit(remedies: Sequence[str], anchor: str, width: int = FIX_WIDTH) -> str:
    """``remedies`` joined by ``; ``, as many as fit ``width`` with the link to the rest.

    The first is always kept, however long (a path can be): a fix with no remedy in it would
    send the operator to the docs for the one thing the line could have said.
    """
    link = f" ({doc_link(anchor)})"
    kept: list[str] = []
    for remedy in remedies:
        if kept and len("; ".join([*kept, remedy]) + link) > width:
            break
        kept.append(remedy)
    return "; ".join(kept) + link
