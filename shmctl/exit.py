"""Exit codes, the same for every command (operators' scripts and CI depend on them)."""

from __future__ import annotations

from enum import IntEnum


class ExitStatus(IntEnum):
    OK = 0  # clean / done
    FINDINGS = 1  # scan found orphans; audit found leaks; init left residue; dry-run does not fit
    USAGE = 2  # bad arguments or configuration
    RUNTIME = 3  # permission on the root, I/O, an init failure that was not injected
    INTERRUPTED = 130  # Ctrl-C
