"""One file's row: both sides' settled outcomes, compared test by test."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence

from .differences import Difference
from .outcomes import PSEUDO, Outcome


@dataclasses.dataclass(frozen=True)
class FileRow:
    """One file's line of the table; every test that passes on vLLM is counted once, in one of
    ``passed_kvoffload``, ``vllm_only``, ``flaky``, ``deliberate`` and ``unexpected``."""

    file: str
    tests: int  # collected on vLLM (0 when the file does not import, or skips whole)
    not_on_vllm: int  # skipped or failed on vLLM here
    passed_vllm: int  # passed on vLLM at the first try
    passed_kvoffload: int  # passed on kvoffload at the first try, kvoffload code running
    vllm_only: tuple[str, ...]  # passed on kvoffload, but no kvoffload code ran
    flaky: tuple[tuple[str, str], ...]  # (test, the side(s) that needed the rerun)
    deliberate: int
    unexpected: tuple[Outcome, ...]
    stale: tuple[str, ...]
    reasons: tuple[tuple[str, int], ...]  # why tests do not pass on vLLM here, most frequent first


def compare(
    test_file: str,
    vllm: Iterable[Outcome],
    kvo: Iterable[Outcome],
    differences: Sequence[Difference],
    kvoffload_ran: frozenset[str] | None = None,
) -> FileRow:
    """One file's row from both sides' settled outcomes (``settle``).

    ``kvoffload_ran``: the tests during which kvoffload code ran; ``None`` counts every
    kvoffload pass as kvoffload's (no probe).
    """
    base = {o.test: o for o in vllm}
    ours = {o.test: o for o in kvo}
    reasons: collections.Counter[str] = collections.Counter()
    unexpected, vllm_only, flaky, stale = [], [], [], []
    deliberate = passed_vllm = passed_kvo = not_on_vllm = 0
    for test, theirs in base.items():
        if test.endswith(PSEUDO):
            if theirs.outcome != "passed":
                reasons[_reason(theirs)] += 1
            continue
        if theirs.outcome not in ("passed", "flaky"):
            not_on_vllm += 1
            reasons[_reason(theirs)] += 1
            continue
        passed_vllm += theirs.outcome == "passed"
        mine = ours.get(test) or ours.get(f"{test_file}::<collection>") or ours.get(f"{test_file}::<run>")
        listed = any(d.covers(test) for d in differences)
        if mine is not None and mine.test == test and mine.outcome in ("passed", "flaky"):
            if listed:
                stale.append(test)
            sides = [side for side, o in (("vLLM", theirs), ("kvoffload", mine)) if o.outcome == "flaky"]
            if sides:
                flaky.append((test, " and ".join(sides)))
            elif kvoffload_ran is not None and test not in kvoffload_ran:
                vllm_only.append(test)
            else:
                passed_kvo += 1
        elif listed:
            deliberate += 1
        else:
            unexpected.append(
                mine
                if mine is not None and mine.test == test
                else Outcome(test, "missing", mine.message if mine else "not run")
            )
    return FileRow(
        file=test_file,
        tests=sum(1 for t in base if not t.endswith(PSEUDO)),
        not_on_vllm=not_on_vllm,
        passed_vllm=passed_vllm,
        passed_kvoffload=passed_kvo,
        vllm_only=tuple(vllm_only),
        flaky=tuple(flaky),
        deliberate=deliberate,
        unexpected=tuple(unexpected),
        stale=tuple(stale),
        reasons=tuple(reasons.most_common()),
    )


def _reason(o: Outcome) -> str:
    if o.test.endswith("::<collection>"):
        what = "skipped whole" if o.outcome == "skipped" else "does not import"
        return f"{what}: {o.message}"
    if o.test.endswith("::<run>"):
        return f"the run failed: {o.message}"
    return f"{o.outcome}: {o.message}" if o.message else o.outcome
