"""The owner record: who created a kvoffload region, stored on the file itself.

vLLM's files carry no owner (its name has only the engine id). Files kvoffload creates
carry an extended attribute ``user.kvoffload.owner`` with the creator's pid, process
start time (clock ticks since boot, as ``/proc/PID/stat`` field 22), boot id, PID
namespace, hostname, uid, engine id and creation time. A pid alone is not identity:
pids are reused, so "the owner is alive" means same boot, same pid namespace, same
pid, same start time, and not a zombie. The record is a hint for operators and for
``--pid`` filters; liveness verdicts come from holders and locks, never from it alone.

Writing is best effort: a filesystem that refuses user xattrs simply has no record.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvoffload import procfs

XATTR_NAME = "user.kvoffload.owner"
_MAX_RECORD_BYTES = 4096


@dataclass(frozen=True, slots=True)
class OwnerRecord:
    pid: int
    start_ticks: int
    boot_id: str | None
    pid_ns: str | None
    hostname: str
    uid: int
    engine_id: str
    created_at: float

    @classmethod
    def for_current_process(cls, engine_id: str, proc_root: Path = procfs.PROC_ROOT) -> OwnerRecord:
        pid = os.getpid()
        return cls(
            pid=pid,
            start_ticks=procfs.read_stat(pid, proc_root).start_ticks,
            boot_id=procfs.read_boot_id(proc_root),
            pid_ns=procfs.pid_namespace("self", proc_root),
            hostname=socket.gethostname(),
            uid=os.geteuid(),
            engine_id=engine_id,
            created_at=time.time(),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> OwnerRecord:
        if not isinstance(data, dict):
            raise ValueError("owner record is not a JSON object")
        return cls(
            pid=int(data["pid"]),
            start_ticks=int(data["start_ticks"]),
            boot_id=None if data.get("boot_id") is None else str(data["boot_id"]),
            pid_ns=None if data.get("pid_ns") is None else str(data["pid_ns"]),
            hostname=str(data.get("hostname", "")),
            uid=int(data["uid"]),
            engine_id=str(data["engine_id"]),
            created_at=float(data["created_at"]),
        )


@dataclass(frozen=True, slots=True)
class OwnerLiveness:
    """Whether the recorded owner still runs: ``alive`` is True, False or None (cannot tell)."""

    alive: bool | None
    reason: str


def write_owner(fd: int, record: OwnerRecord) -> bool:
    """Attach ``record`` to the open file; False where the filesystem refuses xattrs."""
    try:
        os.setxattr(fd, XATTR_NAME, json.dumps(record.to_json(), sort_keys=True).encode())
    except OSError:
        return False
    return True


def read_owner(fd_or_path: int | str | Path) -> OwnerRecord | None:
    """The record on an open fd or path (never following a symlink); None if absent or bad."""
    try:
        if isinstance(fd_or_path, int):
            raw = os.getxattr(fd_or_path, XATTR_NAME)
        else:
            raw = os.getxattr(fd_or_path, XATTR_NAME, follow_symlinks=False)
        if len(raw) > _MAX_RECORD_BYTES:
            return None
        return OwnerRecord.from_json(json.loads(raw))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def judge_owner(record: OwnerRecord, proc_root: Path = procfs.PROC_ROOT) -> OwnerLiveness:
    """Is the recorded owner process still the one that created the file?"""
    boot_id = procfs.read_boot_id(proc_root)
    if record.boot_id and boot_id and record.boot_id != boot_id:
        return OwnerLiveness(False, "owner ran in an earlier boot")
    if record.hostname and record.hostname != socket.gethostname():
        return OwnerLiveness(None, f"owner ran on host {record.hostname!r}, not this one")
    own_ns = procfs.pid_namespace("self", proc_root)
    if record.pid_ns and own_ns and record.pid_ns != own_ns:
        return OwnerLiveness(None, f"owner pid {record.pid} is in another PID namespace ({record.pid_ns})")
    try:
        stat = procfs.read_stat(record.pid, proc_root)
    except FileNotFoundError:
        return OwnerLiveness(False, f"owner pid {record.pid} has exited")
    except OSError as e:
        return OwnerLiveness(None, f"owner pid {record.pid} cannot be inspected: {e.strerror}")
    except (ValueError, IndexError):
        return OwnerLiveness(None, f"owner pid {record.pid}: unreadable /proc stat")
    if stat.start_ticks != record.start_ticks:
        return OwnerLiveness(False, f"owner pid {record.pid} was reused by another process ({stat.comm})")
    if stat.is_zombie:
        try:
            running = procfs.live_thread(record.pid, proc_root)
        except OSError as e:
            return OwnerLiveness(None, f"owner pid {record.pid} cannot be inspected: {e.strerror}")
        if running is None:
            return OwnerLiveness(False, f"owner pid {record.pid} is a zombie")
        return OwnerLiveness(
            True,
            f"owner pid {record.pid} ({stat.comm}) is running (thread {running}; its main thread exited)",
        )
    return OwnerLiveness(True, f"owner pid {record.pid} ({stat.comm}) is running")
