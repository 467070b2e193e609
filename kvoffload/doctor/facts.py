"""What ``shmctl doctor`` decides on: facts about the root, the node and the kernel, as read.

Each check (``kvoffload.doctor.checks``) carries one of these as its ``data``, so the JSON
report shows the figures behind every verdict. The readers here only read: ``root_facts``
(the root's filesystem from ``fstatfs``, its size and use from ``statvfs``, its mount point
from the mount table, the node's memory from ``/proc/meminfo``), ``lease_facts`` (the lease
sysctls), ``read_meminfo`` and ``effective_capabilities``; the facts the other checks gather
(processes, the populate probe, the textfile directory) are made by the checks themselves.

Invariant: every path read is a parameter with the real one as default (``proc_root``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvoffload import procfs
from kvoffload.liveness import lease
from kvoffload.shm import mounts
from kvoffload.shm.mounts import HugePages

MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs")


@dataclass(frozen=True, slots=True)
class RootFacts:
    """The root's filesystem (``fstatfs``, the mount table) and the node's memory (``meminfo``)."""

    path: Path
    mount_point: Path | None
    fs_type: str | None
    read_only: bool
    size_bytes: int
    used_bytes: int
    free_bytes: int
    mem_total_bytes: int | None
    mem_available_bytes: int | None
    #: ``Shmem`` of meminfo: every tmpfs and shared anonymous page on the node, this root's too.
    shmem_bytes: int | None

    @property
    def in_memory(self) -> bool:
        return self.fs_type in MEMORY_FILESYSTEMS


@dataclass(frozen=True, slots=True)
class PlannedRegion:
    """A region the root is to hold: an engine's config sized as ``init --dry-run`` does, or bytes."""

    source: str
    engine_id: str | None
    bytes: int
    #: vLLM's ``kv_bytes_per_chunk`` for a config (how far cpu_bytes_to_use can go down); 0 for bytes.
    chunk_bytes: int


@dataclass(frozen=True, slots=True)
class SpaceFacts:
    regions: tuple[PlannedRegion, ...]
    needed_bytes: int
    free_bytes: int
    mem_available_bytes: int | None


@dataclass(frozen=True, slots=True)
class LeaseFacts:
    """``fs.leases-enable`` and ``fs.lease-break-time``; None where ``/proc/sys`` says nothing."""

    leases_enable: bool | None
    lease_break_time_s: float | None


@dataclass(frozen=True, slots=True)
class CapabilityFacts:
    euid: int
    #: ``CapEff`` of ``/proc/self/status``, hex as the kernel writes it; None if unreadable.
    cap_eff: str | None
    cap_lease: bool | None


@dataclass(frozen=True, slots=True)
class ProcessFacts:
    """One pass over ``/proc`` as ``scan`` makes it: who could be read, who not, and why."""

    inspected: int
    uninspected: int
    #: "ERROR on WHAT" (``EACCES on fd``, ``hidepid on /proc mount (hidepid=2)``) -> processes.
    reasons: dict[str, int]
    #: The first few, as ``scan`` names them: ``pid 1 (init: EACCES on fd 0)``.
    first: tuple[str, ...]
    pid_namespace: str | None
    complete: bool


@dataclass(frozen=True, slots=True)
class PopulateFacts:
    kernel: str
    supported: bool | None
    error: str | None


@dataclass(frozen=True, slots=True)
class TextfileFacts:
    directory: Path
    #: Given with ``--textfile``; the default directory is only checked where it exists.
    requested: bool
    exists: bool
    is_directory: bool
    writable: bool | None
    error: str | None
    #: Seconds since ``shmctl.prom`` there was written; None when there is none.
    prom_age_s: float | None


Facts = (
    RootFacts
    | SpaceFacts
    | HugePages
    | LeaseFacts
    | CapabilityFacts
    | ProcessFacts
    | PopulateFacts
    | TextfileFacts
)


def read_meminfo(proc_root: Path = procfs.PROC_ROOT) -> dict[str, int]:
    """``/proc/meminfo`` in bytes (the kernel writes kB, meaning KiB); {} when unreadable."""
    try:
        text = (proc_root / "meminfo").read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields = value.split()
        if fields and fields[0].isdigit():
            found[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return found


def effective_capabilities(proc_root: Path = procfs.PROC_ROOT) -> int | None:
    """``CapEff`` of ``/proc/self/status``; None when it cannot be read."""
    try:
        text = (proc_root / "self" / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "CapEff":
            try:
                return int(value.strip(), 16)
            except ValueError:
                return None
    return None


def root_facts(root: Path, *, proc_root: Path = procfs.PROC_ROOT) -> RootFacts:
    """The root's filesystem, size, use and read-only flag, and the node's memory.

    Which filesystem is the kernel's answer for the open directory (``fstatfs``); the mount
    point comes from the mount table, which only matches paths.
    """
    from kvoffload.liveness.scan import open_root

    with open_root(root) as fd:
        vfs = os.fstatvfs(fd)
        kind = mounts.memory_filesystem(fd)
    info = mounts.root_mount(
        root, mountinfo=proc_root / "self" / "mountinfo", mounts=proc_root / "self" / "mounts"
    )
    memory = read_meminfo(proc_root)
    return RootFacts(
        path=root,
        mount_point=None if info is None else info.mount_point,
        fs_type=kind or (None if info is None else info.fs_type),
        read_only=bool(vfs.f_flag & os.ST_RDONLY),
        size_bytes=vfs.f_blocks * vfs.f_frsize,
        used_bytes=(vfs.f_blocks - vfs.f_bfree) * vfs.f_frsize,
        free_bytes=vfs.f_bavail * vfs.f_frsize,
        mem_total_bytes=memory.get("MemTotal"),
        mem_available_bytes=memory.get("MemAvailable"),
        shmem_bytes=memory.get("Shmem"),
    )


def lease_facts(proc_root: Path = procfs.PROC_ROOT) -> LeaseFacts:
    return LeaseFacts(lease.leases_enabled(proc_root), lease.break_time_s(proc_root))
