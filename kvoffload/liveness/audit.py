"""Audit: did a command leave shared memory behind?

A CI step wraps the command it runs (``shmctl audit -- pytest -x``). Before, we record the
identities ``(st_dev, st_ino)`` of the region files already in the root and the deleted
regions already mapped by some process; after the command exits, every region file that
was not there before is a leak, whatever its verdict (a file still held by a daemon the
command left running is as much a leak as an orphan), and so is a deleted region newly
mapped by a process that outlived the command. The verdicts come from ``scan``.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvoffload.errors import ConfigError
from kvoffload.liveness.holders import DeletedMapping
from kvoffload.liveness.scan import DEFAULT_ROOT, ScanEntry, scan


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What a command left behind. Serialised as is for ``shmctl audit --json``."""

    root: Path
    command: tuple[str, ...]
    command_exit_code: int
    duration_s: float
    leaked: tuple[ScanEntry, ...]
    leaked_deleted: tuple[DeletedMapping, ...]
    leaked_resident_bytes: int
    preexisting: int

    @property
    def clean(self) -> bool:
        return not self.leaked and not self.leaked_deleted


def _deleted_key(d: DeletedMapping) -> tuple[int, int, int]:
    return (d.pid, d.dev, d.ino)


def audit(
    command: Sequence[str],
    root: Path | str = DEFAULT_ROOT,
    *,
    settle_s: float = 0.0,
) -> AuditReport:
    """Run ``command`` (inheriting stdio) and report the region files it left in ``root``."""
    if not command:
        raise ConfigError(
            "command", "nothing to run", fix="write the command after --, e.g. shmctl audit -- pytest"
        )
    before = scan(root, grace_s=0)
    known = {e.identity for e in before.entries}
    known_deleted = {_deleted_key(d) for d in before.deleted}
    started = time.monotonic()
    try:
        completed = subprocess.run(list(command), check=False)
    except FileNotFoundError:
        raise ConfigError(
            "command", f"{command[0]!r} not found", fix="check the command's name and PATH"
        ) from None
    except PermissionError:
        raise ConfigError("command", f"{command[0]!r} is not executable") from None
    duration = time.monotonic() - started
    if settle_s > 0:
        time.sleep(settle_s)  # let processes the command signalled finish exiting
    after = scan(root, grace_s=0)
    leaked = tuple(e for e in after.entries if e.identity not in known)
    leaked_deleted = tuple(d for d in after.deleted if _deleted_key(d) not in known_deleted)
    resident = sum(e.resident_bytes for e in leaked) + sum(d.resident_bytes or 0 for d in leaked_deleted)
    return AuditReport(
        root=Path(root),
        command=tuple(command),
        command_exit_code=completed.returncode,
        duration_s=duration,
        leaked=leaked,
        leaked_deleted=leaked_deleted,
        leaked_resident_bytes=resident,
        preexisting=len(known),
    )
