"""Prometheus text exposition of a ``ScanReport`` (node_exporter textfile format)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Protocol

from kvoffload.errors import RootError
from kvoffload.liveness.scan import ScanReport, Status

FILENAME = "shmctl.prom"


class DiskUsage(Protocol):
    """What ``shutil.disk_usage`` returns."""

    @property
    def total(self) -> int: ...

    @property
    def free(self) -> int: ...


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    """Exact: integers as integers, floats with every digit (repr), never ``:g``'s six."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def prometheus_text(report: ScanReport, usage: DiskUsage, *, scan_seconds: float) -> str:
    root = _label(str(report.root))
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            text = _number(value)
            lines.append(f"{name}{{{labels}}} {text}" if labels else f"{name} {text}")

    per_status = {s: [e for e in report.entries if e.status is s] for s in Status}
    metric(
        "shmctl_regions",
        "gauge",
        "Region files (base and segments) in the shm root, by verdict.",
        [(f'root="{root}",status="{s.value}"', len(es)) for s, es in per_status.items()],
    )
    metric(
        "shmctl_region_resident_bytes",
        "gauge",
        "Memory the region files pin (st_blocks*512), by verdict.",
        [
            (f'root="{root}",status="{s.value}"', sum(e.resident_bytes for e in es))
            for s, es in per_status.items()
        ],
    )
    metric(
        "shmctl_orphan_bytes",
        "gauge",
        "Resident bytes of orphaned regions: what `shmctl reap` would free.",
        [(f'root="{root}"', report.summary.orphaned_resident_bytes)],
    )
    metric(
        "shmctl_unlinked_mapped_bytes",
        "gauge",
        "Bytes of unlinked region files still mapped by some process (freed when it exits).",
        [(f'root="{root}"', sum(d.mapped_bytes for d in report.deleted))],
    )
    metric(
        "shmctl_uninspected_processes",
        "gauge",
        "Processes whose fds or maps could not be read (their regions stay unknown).",
        [(f'root="{root}"', len(report.uninspected))],
    )
    metric(
        "shmctl_root_size_bytes",
        "gauge",
        "Size of the shm root's filesystem.",
        [(f'root="{root}"', usage.total)],
    )
    metric(
        "shmctl_root_free_bytes",
        "gauge",
        "Free bytes in the shm root's filesystem.",
        [(f'root="{root}"', usage.free)],
    )
    metric("shmctl_scan_duration_seconds", "gauge", "How long the scan took.", [("", scan_seconds)])
    metric(
        "shmctl_last_run_timestamp_seconds",
        "gauge",
        "When the scan ran (unix time).",
        [("", report.scanned_at)],
    )
    return "\n".join(lines) + "\n"


def print_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def write_textfile(directory: Path, text: str) -> None:
    """Write ``directory/shmctl.prom`` atomically: node_exporter never reads half a file."""
    if not directory.is_dir():
        raise RootError(directory, "is not a directory", fix="create the textfile collector directory first")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".shmctl.prom.", dir=directory)
    except OSError as e:
        raise _unwritable(directory, e) from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, directory / FILENAME)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise _unwritable(directory, e) from None
        raise


def _unwritable(directory: Path, error: OSError) -> RootError:
    # A full or read-only textfile directory (ENOSPC, EROFS, EACCES) is the operator's to fix;
    # name the file and the cause, not just the errno.
    return RootError(
        directory,
        f"cannot write {FILENAME}: {error.strerror or error}",
        fix="free space in the textfile directory or pass another --textfile",
    )
