"""A test's outcome on one side, and what it is once its failures were run again.

``PSEUDO`` tests stand for a whole file: ``<collection>`` (it did not import, or skipped
whole) and ``<run>`` (the run failed or timed out); they are never counted as tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Outcome:
    test: str  # "kv_offload/cpu/test_manager.py::test_name[param]"
    outcome: str  # passed, failed, error, skipped; after a rerun also flaky
    message: str = ""


PSEUDO = ("::<collection>", "::<run>")


def settle(first: Sequence[Outcome], rerun: Sequence[Outcome]) -> list[Outcome]:
    """Each test's outcome after the rerun of its failures: ``flaky`` when it passed only then."""
    again = {o.test: o for o in rerun if not o.test.endswith(PSEUDO)}
    settled = []
    for o in first:
        second = again.get(o.test)
        if second is None:
            settled.append(o)
        elif second.outcome == "passed":
            settled.append(Outcome(o.test, "flaky", o.message))
        else:
            settled.append(second)
    return settled
