"""``shmctl doctor``'s checks: one verdict per check, with the finding in exact figures and the fix.

Each ``check_*`` takes its facts (``kvoffload.doctor.facts``) or gathers them itself, and
returns a ``Check``: its name, a status word, a one-line finding, the fix where there is one,
and the facts it was decided on. The words mean: ``ok``; ``warn``: shmctl works, with less
certainty, speed or room than it could have; ``fail``: something will not work (a region does
not fit or would not be in memory, reap can prove nothing, the textfile cannot be written);
``skip``: nothing to check (no plan given, no textfile directory, leases off).

Invariants: nothing on the node is changed. The only writes are one page of anonymous memory
(the populate probe) and an empty dot file created and removed at once in the textfile
directory (node_exporter reads only ``*.prom``).
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
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload import procfs
from kvoffload.doctor.facts import (
    CapabilityFacts,
    Facts,
    LeaseFacts,
    PlannedRegion,
    PopulateFacts,
    ProcessFacts,
    RootFacts,
    SpaceFacts,
    TextfileFacts,
    effective_capabilities,
)
from kvoffload.shm import mounts

if TYPE_CHECKING:
    from kvoffload.liveness.holders import Uninspected

#: Where Debian's and Ubuntu's prometheus-node-exporter package reads textfiles.
DEFAULT_TEXTFILE = Path("/var/lib/prometheus/node-exporter")
#: The file ``shmctl metrics --textfile DIR`` writes (``shmctl.render.metrics.FILENAME``).
PROM_FILE = "shmctl.prom"
#: Bit of ``CAP_LEASE`` in ``CapEff`` (linux/capability.h).
CAP_LEASE = 28
#: Docker's default ``--shm-size``: a container's /dev/shm that no real region fits.
DOCKER_DEFAULT_SHM = 64 << 20


class CheckStatus(StrEnum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    status: CheckStatus
    finding: str
    fix: str | None
    data: Facts


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


# ----------------------------------------------------------------- root and space


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
        from kvoffload.bringup.plan import check_capacity

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
