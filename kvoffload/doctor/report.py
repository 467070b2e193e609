"""``diagnose(root)``: every check of ``shmctl doctor``, in order, as one ``DoctorReport``.

The report is what ``shmctl doctor`` renders (a table, or ``--json`` with ``SCHEMA_VERSION``):
the checks in the order the package docstring lists them, and a summary that counts them by
status; ``failed`` (any ``fail``) decides the command's exit status.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload import procfs
from kvoffload.doctor.checks import (
    Check,
    CheckStatus,
    check_cap_lease,
    check_huge_pages,
    check_leases,
    check_populate_write,
    check_processes,
    check_root,
    check_space,
    check_textfile,
)
from kvoffload.doctor.facts import PlannedRegion, lease_facts, root_facts
from kvoffload.shm import mounts
from kvoffload.shm.names import DEFAULT_ROOT

SCHEMA_VERSION = 1


@dataclass(frozen=True, slots=True)
class DoctorSummary:
    ok: int
    warn: int
    fail: int
    skip: int

    @classmethod
    def of(cls, checks: Iterable[Check]) -> DoctorSummary:
        counts = Counter(c.status for c in checks)
        return cls(*(counts[s] for s in CheckStatus))


@dataclass(frozen=True, slots=True)
class DoctorReport:
    schema_version: int
    root: Path
    checks: tuple[Check, ...]
    summary: DoctorSummary

    @property
    def failed(self) -> bool:
        return self.summary.fail > 0

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)


def diagnose(
    root: Path | str = DEFAULT_ROOT,
    *,
    planned: Sequence[PlannedRegion] = (),
    textfile: Path | None = None,
    proc_root: Path = procfs.PROC_ROOT,
    sysfs: Path = mounts.THP_SYSFS,
) -> DoctorReport:
    """Every check, in the package docstring's order. ``textfile`` None: the default directory,
    checked only where it exists.

    Raises ``ConfigError`` for an empty root and ``RootError`` for one that is missing, not a
    directory or unreadable: a root that cannot be looked at has no verdicts to give.
    """
    path = Path(root)
    facts = root_facts(path, proc_root=proc_root)
    leases = lease_facts(proc_root)
    checks = (
        check_root(facts),
        check_space(facts, planned),
        check_huge_pages(facts, planned, proc_root=proc_root, sysfs=sysfs),
        check_leases(leases),
        check_cap_lease(leases, proc_root=proc_root),
        check_processes(leases, proc_root=proc_root),
        check_populate_write(),
        check_textfile(textfile),
    )
    return DoctorReport(SCHEMA_VERSION, path, checks, DoctorSummary.of(checks))
