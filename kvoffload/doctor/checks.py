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
from kvoffload.fixes import DOC, fit
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
#: Bits of the capabilities the ``/proc`` pass needs to read other users' processes.
CAP_DAC_READ_SEARCH = 2
CAP_SYS_PTRACE = 19
#: Where each check's whole story is (``DOC``): a finding and its fix fit two lines of a
#: terminal (``FINDING_WIDTH``, ``FIX_WIDTH``: kvoffload.fixes), and what does not fit is under
#: the check's anchor there.


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


def _link(anchor: str) -> str:
    return f"{DOC}#{anchor}"


# ----------------------------------------------------------------- root and space


def _memory_text(facts: RootFacts) -> str:
    # Sizes for a person: the exact bytes of every figure are the check's data (--json).
    parts = [
        f"{key} {_human(value)}"
        for key, value in (
            ("MemTotal", facts.mem_total_bytes),
            ("MemAvailable", facts.mem_available_bytes),
            ("Shmem", facts.shmem_bytes),
        )
        if value is not None
    ]
    return "node: " + ", ".join(parts) if parts else "node memory unknown (no /proc/meminfo)"


def check_root(facts: RootFacts) -> Check:
    where = facts.mount_point if facts.mount_point is not None else "an unknown mount point"
    quoted = shlex.quote(str(where))
    fs = facts.fs_type or "an unknown filesystem"
    fs = fs if where == facts.path else f"{fs} at {where}"
    size = f"{fs}, {_human(facts.size_bytes)}"
    if not facts.in_memory:
        return Check(
            "root",
            CheckStatus.FAIL,
            f"{facts.path} is on {size}: not tmpfs or hugetlbfs, so regions there go to disk and reap "
            "removes nothing there",
            "--root the engines' shm mount, or: "
            f"mount -t tmpfs -o size=BYTES,huge=within_size tmpfs {shlex.quote(str(facts.path))}",
            facts,
        )
    if facts.read_only:
        return Check(
            "root",
            CheckStatus.FAIL,
            f"{facts.path}: {size}, read-only: no region can be created and reap removes nothing",
            f"mount -o remount,rw {quoted}",
            facts,
        )
    if facts.fs_type == "tmpfs" and facts.size_bytes == DOCKER_DEFAULT_SHM:
        return Check(
            "root",
            CheckStatus.WARN,
            f"{facts.path}: {size}: Docker's default --shm-size, too small for a real region",
            "docker run --shm-size=BYTES (or --ipc=host); Kubernetes: emptyDir {medium: Memory, "
            "sizeLimit: BYTES}; --need says how much",
            facts,
        )
    total = facts.mem_total_bytes
    if facts.fs_type == "tmpfs" and total is not None and facts.size_bytes > total:
        return Check(
            "root",
            CheckStatus.WARN,
            f"{facts.path}: {size}, more than MemTotal {_human(total)}: regions that fill it push the "
            "node into swap or the OOM killer",
            f"mount -o remount,size={total // 2} {quoted} (half of MemTotal, the kernel's default)",
            facts,
        )
    usage = f"{_human(facts.used_bytes)} used, {_human(facts.free_bytes)} free"
    return Check("root", CheckStatus.OK, f"{facts.path}: {size}, {usage}; {_memory_text(facts)}", None, facts)


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
    # Each region's source, engine id and exact bytes are the data's (--json).
    need = f"{len(regions)} planned region(s) need {_human(needed)}"
    if needed > facts.free_bytes:
        from kvoffload.bringup.plan import check_capacity

        # The plan's own remedy (--shm-size, sizeLimit, remount, a lower cpu_bytes_to_use):
        # the same words init --dry-run and a real bring-up print.
        chunk = regions[0].chunk_bytes if len(regions) == 1 else 0
        fix = check_capacity(facts.path, needed, chunk).fix
        return Check(
            "space",
            CheckStatus.FAIL,
            f"{need}; {facts.path} has {_human(facts.free_bytes)} free: {needed - facts.free_bytes} "
            "bytes short, it does not fit",
            fix,
            data,
        )
    if available is not None and needed > available:
        return Check(
            "space",
            CheckStatus.WARN,
            f"{need}: it fits the {_human(facts.free_bytes)} free, but MemAvailable is "
            f"{_human(available)}: pre-faulting would push the node into swap or the OOM killer",
            "free memory on the node first, or lower cpu_bytes_to_use",
            data,
        )
    room = f", MemAvailable {_human(available)}" if available is not None else ""
    fits = f"{need}: {_human(facts.free_bytes)} free{room}: it fits"
    return Check("space", CheckStatus.OK, fits, None, data)


def check_huge_pages(
    facts: RootFacts,
    planned: Sequence[PlannedRegion] = (),
    *,
    proc_root: Path = procfs.PROC_ROOT,
    sysfs: Path = mounts.THP_SYSFS,
) -> Check:
    """Whether the root's mount gives the planned regions huge pages where they pay off.

    Huge pages are ``init``'s matter: the speed of pre-faulting a region. So 4 KiB pages are
    a ``warn`` only for a planned region (``--plan``, ``--need``) that huge pages pay off for
    (``mounts.huge_pages_pay_off``: 1 GiB and up), with ``huge_pages_advice``'s fix, word for
    word what ``shmctl init --dry-run`` prints for it; with nothing planned the check is
    ``skip``, and a smaller region is ``ok``.
    """
    largest = max((r.bytes for r in planned), default=0)
    pages = mounts.check_huge_pages(
        facts.path,
        mountinfo=proc_root / "self" / "mountinfo",
        mounts=proc_root / "self" / "mounts",
        sysfs=sysfs,
        region_bytes=largest,
    )
    system = f"shmem_enabled {pages.shmem_enabled}" if pages.shmem_enabled else "no shmem_enabled"
    if facts.fs_type == "hugetlbfs":
        return Check(
            "huge-pages", CheckStatus.OK, f"{facts.path} is hugetlbfs: every page is a huge page", None, pages
        )
    if facts.fs_type != "tmpfs":
        return Check("huge-pages", CheckStatus.SKIP, f"{facts.path} is not a tmpfs (see root)", None, pages)
    policy = f"{pages.mount_point}: huge={pages.huge}, {system}"
    if pages.effective != "never":
        return Check(
            "huge-pages", CheckStatus.OK, f"{policy}: regions get huge pages ({pages.effective})", None, pages
        )
    if not planned:
        return Check(
            "huge-pages",
            CheckStatus.SKIP,
            f"{policy}: 4 KiB pages; --plan or --need says whether a region needs huge pages",
            None,
            pages,
        )
    if pages.fix is None:
        return Check(
            "huge-pages",
            CheckStatus.OK,
            f"{policy}: 4 KiB pages, enough for a region of {_human(largest)} (huge pages pay off "
            f"from {_human(mounts.HUGE_PAGES_PAY_OFF_BYTES)})",
            None,
            pages,
        )
    return Check(
        "huge-pages",
        CheckStatus.WARN,
        f"{policy}: a region of {_human(largest)} gets 4 KiB pages",
        pages.fix,
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
            "fs.leases-enable = 0: no write lease, so scan proves files free from /proc and locks "
            "alone (what they cannot prove stays unknown)",
            "sysctl -w fs.leases-enable=1, and keep it in /etc/sysctl.d/ (the sysctl is node-wide)",
            facts,
        )
    wait = facts.lease_break_time_s
    if wait == 0:
        return Check(
            "leases",
            CheckStatus.WARN,
            "fs.lease-break-time = 0: a lease break never times out, so an engine's open() waits "
            "as long as a frozen shmctl holds it",
            "sysctl -w fs.lease-break-time=5 (1 to 5 s bounds a frozen shmctl at no cost; docs/leases.md)",
            facts,
        )
    bound = (
        f"fs.lease-break-time = {wait:g} s bounds an engine's wait on a frozen shmctl"
        if wait is not None
        else "fs.lease-break-time cannot be read"
    )
    return Check(
        "leases", CheckStatus.OK, f"fs.leases-enable = 1: leases prove files free; {bound}", None, facts
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
            f"CapEff cannot be read from {proc_root}/self/status: whether leases reach other users' "
            "files is unknown",
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
        f"CAP_LEASE is not in the effective set (CapEff {facts.cap_eff}, uid {euid}): another user's "
        "dead region stays unknown, never reaped",
        # Root is part of the fix only for a process that is not: a capability added to a
        # non-root process is lost at exec where no ambient set keeps it (Kubernetes).
        f"{'add CAP_LEASE' if euid == 0 else 'run as root with CAP_LEASE'}: docker run --cap-add LEASE, "
        f"Kubernetes capabilities.add: [LEASE] ({_link('cap-lease')})",
        facts,
    )


# ----------------------------------------------------------------- processes


def _reason(error: str, what: str) -> str:
    # "fd 12" and "fd 3" are one reason: which fd failed first is chance.
    return f"{error} on {what.split(maxsplit=1)[0] if what.startswith('fd ') else what}"


def check_processes(leases: LeaseFacts, *, proc_root: Path = procfs.PROC_ROOT) -> Check:
    """Read every process's fds and maps as ``scan`` does, and count those that refuse.

    The fix is true to this process's effective capabilities (``CapEff``): it names only the
    capabilities the pass needs that are missing, and where none is missing it says so rather
    than advise what is already held.
    """
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
        # The commonest reason and the first process: every reason and the first three are
        # the data's (--json), as scan names them.
        (reason, n), *others = reasons.most_common()
        more = f" +{len(others)} reason{'s' if len(others) > 1 else ''}" if others else ""
        first = f"; pid {refused[0].pid} first" if refused else ""
        total = index.processes + len(refused)
        problems.append(f"{len(refused)} of {total} processes unreadable ({n} {reason}{more}{first})")
    if not view.complete:
        problems.append(f"{proc_root} shows a child PID namespace" if view.pid_namespace else view.detail)
    caps = effective_capabilities(proc_root)
    fixes = _process_fixes(blind, complete=view.complete, caps=caps)
    if leases.leases_enable is False:
        status = CheckStatus.FAIL
        outcome = "leases are off: what they hold stays unknown, never reaped"
        fixes.insert(0, "sysctl -w fs.leases-enable=1")
    else:
        status = CheckStatus.WARN
        outcome = "the lease still proves files free, but not who holds them"
    return Check("processes", status, "; ".join([*problems, outcome]), _fits(fixes, "processes"), facts)


#: The capabilities the /proc pass needs for other users' processes, as the fix names them.
PROCESS_CAPABILITIES = (("CAP_SYS_PTRACE", CAP_SYS_PTRACE), ("CAP_DAC_READ_SEARCH", CAP_DAC_READ_SEARCH))


def missing_capabilities(caps: int | None) -> list[str]:
    """The names of ``PROCESS_CAPABILITIES`` not in ``caps`` (CapEff); all of them when unknown."""
    return [name for name, bit in PROCESS_CAPABILITIES if caps is None or not caps >> bit & 1]


def _process_fixes(blind: Sequence[Uninspected], *, complete: bool, caps: int | None) -> list[str]:
    fixes = []
    errors = {u.error for u in blind}
    if "hidepid" in errors:
        fixes.append("mount -o remount,hidepid=0 /proc")
    if errors & {"EACCES", "EPERM"}:
        missing = missing_capabilities(caps)
        if missing:
            add = f"add {' and '.join(missing)}"
            fixes.append(add if os.geteuid() == 0 else f"run as root, or {add}")
        else:
            # Both held, and still refused: a Linux security module, or a process in a user
            # namespace above this one. No capability would help; a vouch is what is left.
            fixes.append(
                "CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH are held: vouch with --assume-not-holding PID"
            )
    if not complete:
        fixes.append("run in the host's PID namespace (hostPID: true)")
    if not fixes:
        fixes.append("run again: a process that could not be read may have been exiting")
    return fixes


def _fits(fixes: Sequence[str], anchor: str) -> str:
    """``fixes`` joined, as many as fit ``FIX_WIDTH`` with the link to the rest, in order."""
    return fit(fixes, anchor)


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
            f"madvise(MADV_POPULATE_WRITE) failed on Linux {kernel}: {code} ({e.strerror}); a region "
            "would fail the same way",
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
        f"Linux {kernel} has no MADV_POPULATE_WRITE (5.14 has): regions are pre-faulted a byte per "
        "page, a slower start",
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
                f"no {path} (Debian's and Ubuntu's node_exporter textfile directory); --textfile DIR "
                "checks another",
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
            f"make {quoted} writable to this user (a read-only mount: mount -o remount,rw {quoted})",
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
