"""Is this node ready for shmctl and vLLM's KV offload? One verdict per check, each with its fix.

``diagnose(root)`` answers what an operator asks before trusting ``scan`` and ``reap`` or
starting an engine with CPU offload, in this order:

* ``root``: is the root on a memory filesystem (tmpfs, hugetlbfs), writable, how big, how
  full (``statvfs``, exact bytes), against the node's memory (``/proc/meminfo``);
* ``space``: do the planned regions fit (``--plan`` sized as ``shmctl init --dry-run`` sizes
  them, or ``--need BYTES``), with the plan's own fix when they do not;
* ``huge-pages``: does the root's mount back the planned regions with huge pages (the mount's
  ``huge=`` and ``shmem_enabled``), weighed only for a planned region of 1 GiB or more (an
  ``init`` matter: nothing planned is ``skip``); the fix is the one ``init --dry-run`` prints;
* ``leases``: ``fs.leases-enable`` and ``fs.lease-break-time``;
* ``cap-lease``: ``CAP_LEASE`` in the effective set (a lease on other users' files);
* ``processes``: can the fds and maps of every process be read, and does this ``/proc``
  show every process: the same pass ``scan`` makes; its fix names only the capabilities
  missing from this process's ``CapEff``;
* ``populate-write``: does the kernel pre-fault with ``MADV_POPULATE_WRITE`` (Linux >= 5.14),
  asked through the region's own probe;
* ``textfile``: can ``shmctl metrics --textfile`` write where node_exporter reads.

Each ``Check`` carries a status word, a one-line finding, the fix where there is one, and
the facts it was decided on (``data``, in exact figures). A finding and a fix each fit two
lines of an 80-column terminal in ``shmctl doctor``'s table (``FINDING_WIDTH``,
``FIX_WIDTH``); what does not fit is in docs/doctor.md, under the check's anchor the fix
links to. The words mean: ``ok``; ``warn``:
shmctl works, with less certainty, speed or room than it could have; ``fail``: something will
not work (a region does not fit or would not be in memory, reap can prove nothing, the
textfile cannot be written); ``skip``: nothing to check (no plan given, no textfile
directory, leases off).

The modules, one concern each (every public name is importable from here, as
``kvoffload.doctor.X``):

* ``facts``: what the checks decide on (the dataclasses in each check's ``data``) and the
  readers of the root, ``/proc/meminfo``, ``CapEff`` and the lease sysctls;
* ``planned``: the regions ``--plan`` and ``--need`` ask room for;
* ``checks``: each check, its verdict, its finding and its fix;
* ``report``: ``diagnose``, which runs every check in order, and ``DoctorReport``.

Invariants: nothing on the node is changed. The only writes are one page of anonymous
memory (the populate probe) and an empty dot file created and removed at once in the
textfile directory (node_exporter reads only ``*.prom``). Every path read is a parameter
with the real one as default: ``proc_root`` (``/proc/sys`` is read under it, as
``lease.break_time_s`` reads it), ``sysfs`` (transparent_hugepage), the root and the
textfile directory.
"""

from kvoffload.doctor.checks import (
    CAP_DAC_READ_SEARCH,
    CAP_LEASE,
    CAP_SYS_PTRACE,
    DEFAULT_TEXTFILE,
    DOCKER_DEFAULT_SHM,
    PROCESS_CAPABILITIES,
    PROM_FILE,
    Check,
    CheckStatus,
    check_cap_lease,
    check_huge_pages,
    check_leases,
    check_populate_write,
    check_processes,
    check_root,
    check_space,
    check_textfile,
    missing_capabilities,
)
from kvoffload.doctor.facts import (
    MEMORY_FILESYSTEMS,
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
    lease_facts,
    read_meminfo,
    root_facts,
)
from kvoffload.doctor.planned import planned_bytes, planned_from_config, planned_from_files
from kvoffload.doctor.report import SCHEMA_VERSION, DoctorReport, DoctorSummary, diagnose
from kvoffload.fixes import FINDING_WIDTH, FIX_WIDTH

# The huge-pages check's facts are the mount's own report (``kvoffload.shm.mounts``).
from kvoffload.shm.mounts import HugePages
from kvoffload.shm.names import DEFAULT_ROOT

__all__ = [
    "CAP_DAC_READ_SEARCH",
    "CAP_LEASE",
    "CAP_SYS_PTRACE",
    "DEFAULT_ROOT",
    "DEFAULT_TEXTFILE",
    "DOCKER_DEFAULT_SHM",
    "FINDING_WIDTH",
    "FIX_WIDTH",
    "MEMORY_FILESYSTEMS",
    "PROCESS_CAPABILITIES",
    "PROM_FILE",
    "SCHEMA_VERSION",
    "CapabilityFacts",
    "Check",
    "CheckStatus",
    "DoctorReport",
    "DoctorSummary",
    "Facts",
    "HugePages",
    "LeaseFacts",
    "PlannedRegion",
    "PopulateFacts",
    "ProcessFacts",
    "RootFacts",
    "SpaceFacts",
    "TextfileFacts",
    "check_cap_lease",
    "check_huge_pages",
    "check_leases",
    "check_populate_write",
    "check_processes",
    "check_root",
    "check_space",
    "check_textfile",
    "diagnose",
    "effective_capabilities",
    "lease_facts",
    "missing_capabilities",
    "planned_bytes",
    "planned_from_config",
    "planned_from_files",
    "read_meminfo",
    "root_facts",
]
