"""Evidence from the owner record: is the process that created a kvoffload file still running?

The record (``kvoffload.shm.owner``) names the creator by pid, start time, boot, PID
namespace and host. A pid alone is not identity: pids are reused, so "alive" means same
boot, same host, same PID namespace, same pid, same start time, and not a zombie. This is a
hint that explains a verdict and feeds ``reap --pid``; it never proves a file dead or alive
on its own (a live owner may have handed the region on; a dead one may have joiners).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvoffload import procfs
from kvoffload.shm.owner import OwnerRecord


@dataclass(frozen=True, slots=True)
class OwnerLiveness:
    """Whether the recorded owner still runs: ``alive`` is True, False or None (cannot tell)."""

    alive: bool | None
    reason: str


@dataclass(frozen=True, slots=True)
class Host:
    """What every owner record is compared with: this boot, host name and PID namespace, as
    seen through ``proc_root``. Read once per scan, not once per region (two file reads a
    region were a fifth of an agent pass over 100 pod volumes)."""

    proc_root: Path
    boot_id: str | None
    nodename: str
    pid_ns: str | None

    @classmethod
    def of(cls, proc_root: Path = procfs.PROC_ROOT) -> Host:
        return cls(
            proc_root,
            procfs.read_boot_id(proc_root),
            os.uname().nodename,
            procfs.pid_namespace("self", proc_root),
        )


def judge_owner(
    record: OwnerRecord, proc_root: Path = procfs.PROC_ROOT, *, host: Host | None = None
) -> OwnerLiveness:
    """Is the recorded owner process still the one that created the file?

    ``host`` is ``Host.of(proc_root)`` made once by a caller judging many records.
    """
    if host is None:
        host = Host.of(proc_root)
    proc_root = host.proc_root
    boot_id = host.boot_id
    if record.boot_id and boot_id and record.boot_id != boot_id:
        return OwnerLiveness(False, "owner ran in an earlier boot")
    if record.hostname and record.hostname != host.nodename:
        return OwnerLiveness(None, f"owner ran on host {record.hostname!r}, not this one")
    own_ns = host.pid_ns
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
