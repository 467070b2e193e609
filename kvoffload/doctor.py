"""Is this node ready for shmctl and vLLM's KV offload? One verdict per check, each with its fix.

``diagnose(root)`` answers what an operator asks before trusting ``scan`` and ``reap`` or
starting an engine with CPU offload, in this order:

* ``root``: is the root on a memory filesystem (tmpfs, hugetlbfs), writable, how big, how
  full (``statvfs``, exact bytes), against the node's memory (``/proc/meminfo``);
* ``space``: do the planned regions fit (``--plan`` sized as ``shmctl init --dry-run`` sizes
  them, or ``--need BYTES``), with the plan's own fix when they do not;
* ``huge-pages``: does the root's mount back regions with huge pages (the mount's ``huge=``
  and ``shmem_enabled``); the fix is the one ``init --dry-run`` prints;
* ``leases``: ``fs.leases-enable`` and ``fs.lease-break-time``;
* ``cap-lease``: ``CAP_LEASE`` in the effective set (a lease on other users' files);
* ``processes``: can the fds and maps of every process be read, and does this ``/proc``
  show every process: the same pass ``scan`` makes;
* ``populate-write``: does the kernel pre-fault with ``MADV_POPULATE_WRITE`` (Linux >= 5.14),
  asked through the region's own probe;
* ``textfile``: can ``shmctl metrics --textfile`` write where node_exporter reads.

Each ``Check`` carries a status word, a one-line finding with exact figures, the fix where
there is one, and the facts it was decided on (``data``). The words mean: ``ok``; ``warn``:
shmctl works, with less certainty, speed or room than it could have; ``fail``: something will
not work (a region does not fit or would not be in memory, reap can prove nothing, the
textfile cannot be written); ``skip``: nothing to check (no plan given, no textfile
directory, leases off).

Invariants: nothing on the node is changed. The only writes are one page of anonymous
memory (the populate probe) and an empty dot file created and removed at once in the
textfile directory (node_exporter reads only ``*.prom``). Every path read is a parameter
with the real one as default: ``proc_root`` (``/proc/sys`` is read under it, as
``lease.break_time_s`` reads it), ``sysfs`` (transparent_hugepage), the root and the
textfile directory.
"""

from __future__ import annotations

import errno
import mmap
import os
import shlex
import stat
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload import procfs
from kvoffload.errors import ConfigError
from kvoffload.liveness import lease
from kvoffload.shm import mounts
from kvoffload.shm.mounts import HugePages

if TYPE_CHECKING:
    from kvoffload.config import OffloadingSettings
    from kvoffload.liveness.holders import Uninspected

SCHEMA_VERSION = 1
DEFAULT_ROOT = Path("/dev/shm")
#: Where Debian's and Ubuntu's prometheus-node-exporter package reads textfiles.
DEFAULT_TEXTFILE = Path("/var/lib/prometheus/node-exporter")
#: The file ``shmctl metrics --textfile DIR`` writes (``shmctl.render.metrics.FILENAME``).
PROM_FILE = "shmctl.prom"
#: Bit of ``CAP_LEASE`` in ``CapEff`` (linux/capability.h).
CAP_LEASE = 28
MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs")
#: Docker's default ``--shm-size``: a container's /dev/shm that no real region fits.
DOCKER_DEFAULT_SHM = 64 << 20


class CheckStatus(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


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


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: CheckStatus
    finding: str
    fix: str | None
    data: Facts


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
    """Every check, in the module docstring's order. ``textfile`` None: the default directory,
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
        check_huge_pages(facts, proc_root=proc_root, sysfs=sysfs),
        check_leases(leases),
        check_cap_lease(leases, proc_root=proc_root),
        check_processes(leases, proc_root=proc_root),
        check_populate_write(),
        check_textfile(textfile),
    )
    return DoctorReport(SCHEMA_VERSION, path, checks, DoctorSummary.of(checks))


# ----------------------------------------------------------------- figures


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _amount(n: int) -> str:
    """Exact bytes, and the same for a person: ``25276502016 bytes (23.5 GiB)``."""
    return f"{n} bytes ({_human(n)})"


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


# ----------------------------------------------------------------- root and space


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


def _memory_text(facts: RootFacts) -> str:
    parts = [
        f"{key} {value} ({_human(value)})"
        for key, value in (
            ("MemTotal", facts.mem_total_bytes),
            ("MemAvailable", facts.mem_available_bytes),
            ("Shmem", facts.shmem_bytes),
        )
        if value is not None
    ]
    return "node memory: " + ", ".join(parts) if parts else "node memory unknown (no /proc/meminfo)"


def check_root(facts: RootFacts) -> Check:
    where = facts.mount_point if facts.mount_point is not None else "an unknown mount point"
    quoted = shlex.quote(str(where))
    fs = facts.fs_type or "an unknown filesystem"
    usage = (
        f"{fs if where == facts.path else f'{fs} mounted at {where}'}: {_amount(facts.size_bytes)}, "
        f"{facts.used_bytes} used, {facts.free_bytes} free; {_memory_text(facts)}"
    )
    if not facts.in_memory:
        return Check(
            "root",
            CheckStatus.FAIL,
            f"{facts.path} is on {usage}: not tmpfs or hugetlbfs, so a region there is written to "
            "disk and reap removes nothing from it (without --any-filesystem)",
            "pass the engines' shm mount as --root (/dev/shm), or mount a tmpfs there: "
            f"mount -t tmpfs -o size=BYTES,huge=within_size tmpfs {shlex.quote(str(facts.path))}",
            facts,
        )
    if facts.read_only:
        return Check(
            "root",
            CheckStatus.FAIL,
            f"{facts.path}: {usage}: read-only, so no region can be created and reap removes nothing",
            f"mount -o remount,rw {quoted}",
            facts,
        )
    if facts.fs_type == "tmpfs" and facts.size_bytes == DOCKER_DEFAULT_SHM:
        return Check(
            "root",
            CheckStatus.WARN,
            f"{facts.path}: {usage}: 64 MiB is Docker's default --shm-size, too small for a real region",
            "docker run --shm-size=BYTES (or --ipc=host); Kubernetes: an emptyDir "
            "{medium: Memory, sizeLimit: BYTES}; --plan or --need says how much",
            facts,
        )
    total = facts.mem_total_bytes
    if facts.fs_type == "tmpfs" and total is not None and facts.size_bytes > total:
        return Check(
            "root",
            CheckStatus.WARN,
            f"{facts.path}: {usage}: its size is more than the node's memory, so regions that fill "
            "it would push the node into swap or the OOM killer",
            f"mount -o remount,size={total // 2} {quoted} (half of MemTotal, the kernel's default)",
            facts,
        )
    return Check("root", CheckStatus.OK, f"{facts.path}: {usage}", None, facts)


def planned_from_config(config: OffloadingSettings, source: str) -> PlannedRegion:
    """The region ``config`` would allocate, sized by the same plan ``shmctl init --dry-run`` prints."""
    from kvoffload.engine.plan import plan

    the_plan = plan(config)
    return PlannedRegion(
        source, the_plan.engine_id, the_plan.sizing.total_bytes, the_plan.sizing.kv_bytes_per_chunk
    )


def planned_from_files(
    files: Iterable[Path],
    *,
    kv_bytes_per_block: int | None,
    model: str | None,
    world_size: int = 1,
    gpu_block_size: int = 16,
    root: Path = DEFAULT_ROOT,
) -> list[PlannedRegion]:
    """Each engine config file (``init --config``'s JSON or TOML) as the region it would allocate.

    The geometry (``kv_bytes_per_block`` or a ``model`` preset, world size, block size) is
    the same for every file; ``ConfigError`` when a file or the geometry is wrong.
    """
    files = list(files)
    if not files:
        return []
    from kvoffload.engine.inputs import load_config

    planned = []
    for file in files:
        try:
            config = load_config(
                kv_transfer_config=None,
                config_file=file,
                kv_bytes_per_block=kv_bytes_per_block,
                model=model,
                world_size=world_size,
                gpu_block_size=gpu_block_size,
                root=root,
            )
        except ConfigError as e:
            if e.key != "--config":
                raise
            # The reader is init's, which names its option --config: name ours.
            message = e.message.removeprefix(f"{e.key}: ")
            raise ConfigError("--plan", message, fix=e.fix) from None
        planned.append(planned_from_config(config, str(file)))
    return planned


def planned_bytes(text: str, *, option: str = "--need") -> PlannedRegion:
    """``--need 40g``: bytes, or a number with k, m, g, t (powers of 1024) as tmpfs's size= takes."""
    size = mounts.parse_size(text)
    if size is None or size <= 0:
        raise ConfigError(
            option,
            f"{text!r} is not a size in bytes",
            fix=f"bytes, or a number with k, m, g or t (powers of 1024): {option} 40g",
        )
    return PlannedRegion(option, None, size, 0)


def _regions_text(regions: Sequence[PlannedRegion]) -> str:
    # Engine ids stay in the data: a config without one gets a fresh uuid, as vLLM does.
    shown = [f"{r.bytes} for {r.source}" for r in regions[:3]]
    more = f" and {len(regions) - 3} more" if len(regions) > 3 else ""
    return ", ".join(shown) + more


def check_space(facts: RootFacts, planned: Sequence[PlannedRegion]) -> Check:
    regions = tuple(planned)
    needed = sum(r.bytes for r in regions)
    available = facts.mem_available_bytes
    data = SpaceFacts(regions, needed, facts.free_bytes, available)
    if not regions:
        return Check(
            "space",
            CheckStatus.SKIP,
            "no region planned: --plan FILE (an engine's --kv-transfer-config) or --need BYTES sizes one",
            None,
            data,
        )
    need = f"{len(regions)} planned region(s) need {_amount(needed)} ({_regions_text(regions)})"
    if needed > facts.free_bytes:
        from kvoffload.engine.plan import check_capacity

        # The plan's own remedy (--shm-size, sizeLimit, remount, a lower cpu_bytes_to_use):
        # the same words init --dry-run and a real bring-up print.
        chunk = regions[0].chunk_bytes if len(regions) == 1 else 0
        fix = check_capacity(facts.path, needed, chunk).fix
        return Check(
            "space",
            CheckStatus.FAIL,
            f"{need}; {facts.path} has {_amount(facts.free_bytes)} free: it does not fit",
            fix,
            data,
        )
    if available is not None and needed > available:
        return Check(
            "space",
            CheckStatus.WARN,
            f"{need}: it fits the {_amount(facts.free_bytes)} free, but MemAvailable is "
            f"{_amount(available)}: pre-faulting would push the node into swap or the OOM killer",
            "free memory on the node first, or lower cpu_bytes_to_use",
            data,
        )
    room = f", MemAvailable {_amount(available)}" if available is not None else ""
    return Check(
        "space", CheckStatus.OK, f"{need}: {_amount(facts.free_bytes)} free{room}: it fits", None, data
    )


def check_huge_pages(
    facts: RootFacts, *, proc_root: Path = procfs.PROC_ROOT, sysfs: Path = mounts.THP_SYSFS
) -> Check:
    """Whether the root's mount gives regions huge pages; the fix is ``huge_pages_advice``'s,
    word for word what ``shmctl init --dry-run`` prints."""
    pages = mounts.check_huge_pages(
        facts.path,
        mountinfo=proc_root / "self" / "mountinfo",
        mounts=proc_root / "self" / "mounts",
        sysfs=sysfs,
    )
    system = f"shmem_enabled {pages.shmem_enabled}" if pages.shmem_enabled else "no shmem_enabled"
    if facts.fs_type == "hugetlbfs":
        return Check(
            "huge-pages", CheckStatus.OK, f"{facts.path} is hugetlbfs: every page is a huge page", None, pages
        )
    if facts.fs_type != "tmpfs":
        return Check("huge-pages", CheckStatus.SKIP, f"{facts.path} is not a tmpfs (see root)", None, pages)
    policy = f"huge={pages.huge}, {system}"
    if pages.effective == "never":
        return Check(
            "huge-pages",
            CheckStatus.WARN,
            f"{pages.mount_point}: {policy}: regions get 4 KiB pages",
            pages.fix,
            pages,
        )
    return Check(
        "huge-pages",
        CheckStatus.OK,
        f"{pages.mount_point}: {policy}: regions get huge pages ({pages.effective})",
        None,
        pages,
    )


# ----------------------------------------------------------------- leases


def lease_facts(proc_root: Path = procfs.PROC_ROOT) -> LeaseFacts:
    return LeaseFacts(lease.leases_enabled(proc_root), lease.break_time_s(proc_root))


def check_leases(facts: LeaseFacts) -> Check:
    if facts.leases_enable is None:
        return Check(
            "leases",
            CheckStatus.WARN,
            "fs.leases-enable cannot be read: whether the kernel grants write leases is unknown",
            "make /proc/sys readable to shmctl (sysctl fs.leases-enable should print 1)",
            facts,
        )
    if not facts.leases_enable:
        return Check(
            "leases",
            CheckStatus.WARN,
            "fs.leases-enable = 0: the kernel grants no write lease, so scan proves a file free from "
            "/proc and locks alone (fail-closed: what they cannot prove stays unknown, never reaped)",
            "sysctl -w fs.leases-enable=1, and keep it in /etc/sysctl.d/ (the sysctl is node-wide)",
            facts,
        )
    wait = facts.lease_break_time_s
    if wait == 0:
        return Check(
            "leases",
            CheckStatus.WARN,
            "fs.leases-enable = 1; fs.lease-break-time = 0, which means a lease break never times "
            "out: an engine's open() waits as long as a frozen shmctl holds its lease",
            "sysctl -w fs.lease-break-time=5 (1 to 5 s bounds a frozen shmctl at no cost; docs/leases.md)",
            facts,
        )
    bound = (
        f"fs.lease-break-time = {wait:g} s, the longest an engine's open() waits on a frozen shmctl"
        if wait is not None
        else "fs.lease-break-time cannot be read"
    )
    return Check(
        "leases", CheckStatus.OK, f"fs.leases-enable = 1: write leases prove files free; {bound}", None, facts
    )


def check_cap_lease(leases: LeaseFacts, *, proc_root: Path = procfs.PROC_ROOT) -> Check:
    euid = os.geteuid()
    caps = effective_capabilities(proc_root)
    has = None if caps is None else bool(caps >> CAP_LEASE & 1)
    facts = CapabilityFacts(euid, None if caps is None else f"{caps:016x}", has)
    if leases.leases_enable is False:
        return Check(
            "cap-lease",
            CheckStatus.SKIP,
            "fs.leases-enable = 0: no lease is taken, with CAP_LEASE or without",
            None,
            facts,
        )
    if caps is None:
        return Check(
            "cap-lease",
            CheckStatus.WARN,
            f"CapEff cannot be read from {proc_root}/self/status: whether leases reach other users' files "
            "is unknown",
            None,
            facts,
        )
    if has:
        return Check(
            "cap-lease",
            CheckStatus.OK,
            f"CAP_LEASE is in the effective set (CapEff {facts.cap_eff}): a write lease on any user's file",
            None,
            facts,
        )
    return Check(
        "cap-lease",
        CheckStatus.WARN,
        f"CAP_LEASE is not in the effective set (CapEff {facts.cap_eff}, uid {euid}): a write lease "
        f"only on files uid {euid} owns; another user's dead region stays unknown, never reaped",
        "run shmctl as root with CAP_LEASE: systemd CapabilityBoundingSet=CAP_LEASE (deploy/systemd), "
        "docker run --cap-add LEASE, Kubernetes securityContext.capabilities.add: [LEASE] "
        "(deploy/kubernetes/daemonset.yaml)",
        facts,
    )


# ----------------------------------------------------------------- processes


def _reason(error: str, what: str) -> str:
    # "fd 12" and "fd 3" are one reason: which fd failed first is chance.
    return f"{error} on {what.split(maxsplit=1)[0] if what.startswith('fd ') else what}"


def check_processes(leases: LeaseFacts, *, proc_root: Path = procfs.PROC_ROOT) -> Check:
    """Read every process's fds and maps as ``scan`` does, and count those that refuse."""
    from kvoffload.liveness.holders import collect_holders
    from kvoffload.liveness.namespace import visibility

    index = collect_holders(proc_root, inodes=(), deleted=False, locks=False)
    view = visibility(proc_root)
    blind = index.uninspected
    reasons = Counter(_reason(u.error, u.what) for u in blind)
    facts = ProcessFacts(
        inspected=index.processes,
        uninspected=len(blind),
        reasons=dict(reasons),
        first=tuple(u.describe() for u in blind[:3]),
        pid_namespace=view.pid_namespace,
        complete=view.complete,
    )
    if not blind and view.complete:
        return Check(
            "processes",
            CheckStatus.OK,
            f"the fds and maps of all {index.processes} processes are readable; {proc_root} shows "
            f"{view.detail}",
            None,
            facts,
        )
    problems = []
    refused = [u for u in blind if u.pid > 0]  # pid 0: a whole-/proc blind spot (hidepid, no listing)
    if blind:
        why = ", ".join(f"{n} {reason}" for reason, n in reasons.most_common())
        problems.append(
            f"{len(refused)} of {index.processes + len(refused)} processes cannot be inspected ({why}): "
            + "; ".join(facts.first)
        )
    if not view.complete:
        problems.append(f"{proc_root} shows {view.detail}")
    fixes = _process_fixes(blind, complete=view.complete)
    if leases.leases_enable is False:
        status = CheckStatus.FAIL
        outcome = "leases are off, so every file they could hold stays unknown and reap removes none of it"
        fixes.insert(0, "sysctl -w fs.leases-enable=1 (the lease proves files free whoever holds them)")
    else:
        status = CheckStatus.WARN
        outcome = (
            "the write lease still proves files free, but scan cannot name them as holders "
            "(with --no-lease their files would stay unknown)"
        )
    return Check("processes", status, "; ".join([*problems, outcome]), "; ".join(fixes), facts)


def _process_fixes(blind: Sequence[Uninspected], *, complete: bool) -> list[str]:
    fixes = []
    errors = {u.error for u in blind}
    if "hidepid" in errors:
        fixes.append("remount /proc without hidepid (mount -o remount,hidepid=0 /proc), or run as root")
    if errors & {"EACCES", "EPERM"}:
        if os.geteuid() != 0:
            fixes.append("run as root")
        else:
            fixes.append(
                "give shmctl CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH (docs/fleet.md), or vouch for a "
                "process that maps no region with --assume-not-holding PID"
            )
    if not complete:
        fixes.append("run in the host's PID namespace (Kubernetes hostPID: true; not inside a container's)")
    if not fixes:
        fixes.append("run again: a process that could not be read may have been exiting")
    return fixes


# ----------------------------------------------------------------- kernel


def check_populate_write() -> Check:
    """Ask the kernel for ``MADV_POPULATE_WRITE`` on one page of shared anonymous memory (shmem,
    as a tmpfs file is), through the probe every region makes on its own mapping."""
    from kvoffload.cpu.prefault import probe_populate_write

    kernel = os.uname().release
    try:
        with mmap.mmap(-1, mmap.PAGESIZE) as mm:
            supported = probe_populate_write(mm)
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, str(e.errno))
        facts = PopulateFacts(kernel, None, code)
        return Check(
            "populate-write",
            CheckStatus.WARN,
            f"madvise(MADV_POPULATE_WRITE) on a page of shared memory failed on Linux {kernel}: "
            f"{code} ({e.strerror}); a region would fail the same way",
            "look for a seccomp profile or LSM that refuses madvise to this process",
            facts,
        )
    facts = PopulateFacts(kernel, supported, None)
    if supported:
        return Check(
            "populate-write",
            CheckStatus.OK,
            f"Linux {kernel} pre-faults with madvise(MADV_POPULATE_WRITE): one call per 64 MiB step",
            None,
            facts,
        )
    return Check(
        "populate-write",
        CheckStatus.WARN,
        f"Linux {kernel} has no MADV_POPULATE_WRITE (5.14 and later do): regions are pre-faulted by "
        "writing one byte per page, a slower start",
        "run a kernel >= 5.14",
        facts,
    )


# ----------------------------------------------------------------- textfile


def check_textfile(directory: Path | None = None, *, default: Path = DEFAULT_TEXTFILE) -> Check:
    """Can ``shmctl metrics --textfile`` write into ``directory`` (or the default, if it exists)?

    Writable is proven, not inferred from modes: an empty dot file is created there and
    removed (a read-only mount, an LSM or a full filesystem refuse what ``access`` allows).
    """
    requested = directory is not None
    path = directory if directory is not None else default
    quoted = shlex.quote(str(path))
    collector = "node_exporter's --collector.textfile.directory"
    try:
        st = os.stat(path)
    except FileNotFoundError:
        facts = TextfileFacts(path, requested, False, False, None, "ENOENT", None)
        if not requested:
            return Check(
                "textfile",
                CheckStatus.SKIP,
                f"no {path} (the textfile directory of Debian's and Ubuntu's prometheus-node-exporter); "
                "--textfile DIR checks another",
                None,
                facts,
            )
        return Check(
            "textfile",
            CheckStatus.FAIL,
            f"{path} does not exist",
            f"mkdir -p {quoted} and point {collector} at it",
            facts,
        )
    except OSError as e:
        code = errno.errorcode.get(e.errno or 0, str(e.errno))
        facts = TextfileFacts(path, requested, False, False, None, code, None)
        return Check("textfile", CheckStatus.FAIL, f"{path} cannot be inspected: {e.strerror}", None, facts)
    if not stat.S_ISDIR(st.st_mode):
        facts = TextfileFacts(path, requested, True, False, None, "ENOTDIR", None)
        return Check(
            "textfile",
            CheckStatus.FAIL,
            f"{path} is not a directory",
            f"pass the directory {collector} names as --textfile",
            facts,
        )
    error = _write_probe(path)
    if error is not None:
        facts = TextfileFacts(path, requested, True, True, False, error, None)
        return Check(
            "textfile",
            CheckStatus.FAIL,
            f"{path}: cannot create a file in it ({error}): shmctl metrics cannot write {PROM_FILE} there",
            "run shmctl metrics as a user that may write there, or make the directory writable "
            f"(a read-only mount: mount -o remount,rw {quoted})",
            facts,
        )
    try:
        age: float | None = max(0.0, time.time() - os.stat(path / PROM_FILE).st_mtime)
    except OSError:
        age = None
    facts = TextfileFacts(path, requested, True, True, True, None, age)
    written = (
        f"{PROM_FILE} written {age:.0f} s ago"
        if age is not None
        else f"no {PROM_FILE} yet (shmctl metrics --textfile {quoted} writes it)"
    )
    return Check("textfile", CheckStatus.OK, f"{path} is a writable directory; {written}", None, facts)


def _write_probe(directory: Path) -> str | None:
    """None if a file can be created in ``directory``; else the errno's name and its words."""
    try:
        fd, name = tempfile.mkstemp(prefix=".shmctl-doctor.", dir=directory)
    except OSError as e:
        return f"{errno.errorcode.get(e.errno or 0, str(e.errno))}: {e.strerror}"
    try:
        os.close(fd)
    finally:
        os.unlink(name)
    return None
