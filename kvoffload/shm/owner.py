"""The owner record: who created a kvoffload region, stored on the file itself.

vLLM's files carry no owner (its name has only the engine id). Files kvoffload creates
carry an extended attribute ``user.kvoffload.owner`` with the creator's pid, process
start time (clock ticks since boot, as ``/proc/PID/stat`` field 22), boot id, PID
namespace, hostname, uid, engine id and creation time. A pid alone is not identity:
pids are reused, so "the owner is alive" means same boot, same pid namespace, same
pid, same start time, and not a zombie (``kvoffload.liveness.ownership`` judges that). The
record is a hint for operators and for ``--pid`` filters; verdicts come from the lease,
holders and locks, never from it alone.

Writing is best effort: a filesystem that refuses user xattrs simply has no record.
"""

from __future__ import annotations

import json
import math
import os
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
            hostname=os.uname().nodename,  # gethostname() without importing socket
            uid=os.geteuid(),
            engine_id=engine_id,
            created_at=time.time(),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> OwnerRecord:
        """The record in ``data``; ``ValueError`` naming the field when it is not the documented shape.

        Anyone who can write the file can write the record, so every field is checked for
        its type and range: a bad record is ignored with the reason, never trusted or crashed on.
        """
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return cls(
            pid=_int(data, "pid", 1, _PID_MAX),
            start_ticks=_int(data, "start_ticks", 0, _U64_MAX),
            boot_id=_text(data, "boot_id", optional=True),
            pid_ns=_text(data, "pid_ns", optional=True),
            hostname=_text(data, "hostname", optional=True) or "",
            uid=_int(data, "uid", 0, _U32_MAX),
            engine_id=_text(data, "engine_id") or "",
            created_at=_number(data, "created_at"),
        )


#: ``PID_MAX_LIMIT`` on 64-bit Linux; uids are 32-bit; start ticks a 64-bit counter.
_PID_MAX = 1 << 22
_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
_TEXT_MAX = 1024


def _int(data: dict[str, Any], key: str, low: int, high: int) -> int:
    value = data.get(key)
    if type(value) is not int:  # bool is an int subclass: refuse it too
        raise ValueError(f"{key} is not an integer")
    if not low <= value <= high:
        raise ValueError(f"{key} is out of range")
    return value


def _number(data: dict[str, Any], key: str) -> float:
    value = data.get(key)
    if type(value) not in (int, float):
        raise ValueError(f"{key} is not a number")
    number = float(value)  # type: ignore[arg-type]  # an int or a float, checked above
    if not math.isfinite(number):
        raise ValueError(f"{key} is not finite")
    return number


def _text(data: dict[str, Any], key: str, *, optional: bool = False) -> str | None:
    value = data.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > _TEXT_MAX:
        raise ValueError(f"{key} is not a string of at most {_TEXT_MAX} characters")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 20:
        raise ValueError("an integer of more than 20 digits")
    return int(text)


def write_owner(fd: int, record: OwnerRecord) -> bool:
    """Attach ``record`` to the open file; False where the filesystem refuses xattrs."""
    try:
        os.setxattr(fd, XATTR_NAME, json.dumps(record.to_json(), sort_keys=True).encode())
    except OSError:
        return False
    return True


def read_owner(fd_or_path: int | str | Path) -> OwnerRecord | None:
    """The record on an open fd or path (never following a symlink); None if absent or bad."""
    return inspect_owner(fd_or_path)[0]


def inspect_owner(fd_or_path: int | str | Path) -> tuple[OwnerRecord | None, str | None]:
    """The record and, when there is one that cannot be used, why it was ignored.

    ``(None, None)``: no record (vLLM's own files, a filesystem without xattrs).
    """
    try:
        if isinstance(fd_or_path, int):
            raw = os.getxattr(fd_or_path, XATTR_NAME)
        else:
            raw = os.getxattr(fd_or_path, XATTR_NAME, follow_symlinks=False)
    except OSError:
        return None, None
    if len(raw) > _MAX_RECORD_BYTES:
        return None, f"owner record ignored: larger than {_MAX_RECORD_BYTES} bytes"
    try:
        data = json.loads(raw, parse_constant=_refuse_constant, parse_int=_bounded_int)
        return OwnerRecord.from_json(data), None
    except RecursionError:
        return None, "owner record ignored: nested too deeply"
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"owner record ignored: {e}"
