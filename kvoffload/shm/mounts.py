"""Which mount holds a path, and whether its tmpfs backs files with huge pages.

The public API, for the region, the plan and ``shmctl scan``:

* ``root_mount(path) -> MountInfo | None``: the mount of this process's mount namespace
  that holds ``path`` (resolved): the longest mount point that is a prefix of it, and of
  several mounts stacked on one point the last one listed (the one on top). Read from
  ``/proc/self/mountinfo``, or ``/proc/self/mounts`` where that is missing; octal escapes
  in mount points (``\\040`` for a space) are decoded. ``None`` only when neither can be
  read.
* ``MountInfo``: ``mount_point``, ``fs_type``, ``source``, the superblock ``options``, and
  for a tmpfs its ``huge=`` policy (``huge``; ``"never"`` when the option is absent, as the
  kernel defaults) and ``size=`` (``size_bytes``), plus the system-wide
  ``/sys/kernel/mm/transparent_hugepage/shmem_enabled`` as read with it
  (``shmem_enabled``). ``huge_pages`` is the policy the kernel applies to the mount's
  files: ``deny`` there turns every tmpfs off, ``force`` turns every one on.
* ``huge_pages_advice(info) -> str | None``: for a tmpfs whose files get 4 KiB pages, the
  fix in one command, with the speed-up measured by ``bench/bench_region.py`` and a link to
  the docs for the rest (Docker, Kubernetes); ``None`` where huge pages are already on or
  where a remount would not change anything. ``huge_pages_pay_off(bytes)`` is the rule for
  which regions it is given for (``HUGE_PAGES_PAY_OFF_BYTES``, 1 GiB).
* ``huge_page_size()``: the size of one PMD huge page (2 MiB on x86-64).

Invariant: nothing here writes or mounts anything, and every path it reads is a parameter
with the real one as default, so tests can point it at files of their own.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvoffload import syscalls

MOUNTINFO = Path("/proc/self/mountinfo")
MOUNTS = Path("/proc/self/mounts")
THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage")
#: The kernel's default huge= for a tmpfs mounted without the option.
TMPFS_DEFAULT_HUGE = "never"
HUGE_POLICIES = ("never", "always", "within_size", "advise")
#: Creating and pre-faulting a 1 GiB region on a tmpfs mounted huge=within_size against the
#: same on a default mount (huge=never), both kvoffload on two populate threads:
#: bench/bench_region.py (docs/benchmarks.md, "Latest figures": 12.0 / 2.20 GiB/s); a test holds
#: this figure to that table.
#: The figure the advice quotes; the bench prints the current one as a row.
HUGE_PAGE_SPEEDUP = 5.0
#: The smallest region the huge-page advice is given for: at the bench's 2.2 GiB/s on 4 KiB pages
#: a 1 GiB region takes about 0.45 s to pre-fault (0.08 s on huge pages); below it the saving is
#: a fraction of an engine's start, not worth a remount of the node's /dev/shm.
HUGE_PAGES_PAY_OFF_BYTES = 1 << 30
#: Where the advice's long form lives: Docker, Kubernetes, shmem_enabled, and the rule above.
HUGE_PAGES_DOC = "docs/doctor.md#huge-pages"
_DEFAULT_HUGE_PAGE = 2 << 20
_ESCAPE = re.compile(rb"\\([0-7]{3})")
_SIZE = re.compile(r"^(\d+)([kmgtpe]?)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class MountInfo:
    """One mount, as this process's mount namespace sees it."""

    mount_point: Path
    fs_type: str
    source: str
    #: Superblock options as the kernel lists them (tmpfs: size=, nr_inodes=, huge=, ...).
    options: tuple[str, ...]
    #: A tmpfs's huge= policy ("never" when the option is absent); None on other filesystems.
    huge: str | None
    #: A tmpfs's size= in bytes; None when it has none (unlimited) or is no tmpfs.
    size_bytes: int | None
    #: /sys/kernel/mm/transparent_hugepage/shmem_enabled when read; None where the kernel has none.
    shmem_enabled: str | None = None
    #: The mount's id (mountinfo's first field, statx's ``stx_mnt_id``); None from /proc/mounts.
    mount_id: int | None = None

    @property
    def is_tmpfs(self) -> bool:
        return self.fs_type == "tmpfs"

    @property
    def huge_pages(self) -> str:
        """The policy the kernel applies to this mount's files: one of ``HUGE_POLICIES``.

        ``shmem_enabled=deny`` forces every tmpfs to never, ``force`` to always (the kernel's
        "for emergencies" and "for testing" switches); otherwise the mount's own huge= rules.
        Only a tmpfs has huge pages here: anything else is "never".
        """
        if not self.is_tmpfs:
            return "never"
        if self.shmem_enabled == "deny":
            return "never"
        if self.shmem_enabled == "force":
            return "always"
        return self.huge if self.huge in HUGE_POLICIES else TMPFS_DEFAULT_HUGE


# ----------------------------------------------------------------- parsing


def _unescape(field: bytes) -> str:
    """A mount table field with its octal escapes (``\\040`` space, ``\\134`` backslash) decoded."""
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def parse_size(text: str) -> int | None:
    """tmpfs's size= as the kernel prints it (``24683584k``) in bytes; None if unreadable."""
    match = _SIZE.match(text.strip())
    if match is None:
        return None
    number, suffix = int(match.group(1)), match.group(2).lower()
    return number << (10 * " kmgtpe".index(suffix)) if suffix else number


def _mount(point: bytes, fs_type: bytes, source: bytes, options: bytes) -> MountInfo:
    fs = _unescape(fs_type)
    opts = tuple(_unescape(options).split(","))
    huge: str | None = None
    size: int | None = None
    if fs == "tmpfs":
        huge = TMPFS_DEFAULT_HUGE
        for opt in opts:
            key, _, value = opt.partition("=")
            if key == "huge":
                huge = value
            elif key == "size":
                size = parse_size(value) or None
    return MountInfo(Path(_unescape(point)), fs, _unescape(source), opts, huge, size)


def parse_mountinfo(text: bytes) -> list[MountInfo]:
    """The mounts of a ``/proc/PID/mountinfo``, in the order listed.

    A line is ``ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS``;
    lines that do not have that shape are skipped.
    """
    found = []
    for line in text.splitlines():
        fields = line.split()
        try:
            dash = fields.index(b"-", 6)
        except ValueError:
            continue
        if len(fields) < dash + 4:
            continue
        mount = _mount(fields[4], fields[dash + 1], fields[dash + 2], fields[dash + 3])
        found.append(dataclasses.replace(mount, mount_id=int(fields[0])) if fields[0].isdigit() else mount)
    return found


def parse_mounts(text: bytes) -> list[MountInfo]:
    """The mounts of a ``/proc/mounts`` (``SOURCE POINT FSTYPE OPTIONS 0 0``), in the order listed."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 4:
            found.append(_mount(fields[1], fields[2], fields[0], fields[3]))
    return found


def read_shmem_enabled(sysfs: Path = THP_SYSFS) -> str | None:
    """The bracketed choice of ``shmem_enabled`` (``always within_size advise [never] deny force``)."""
    try:
        text = (sysfs / "shmem_enabled").read_text()
    except OSError:
        return None
    match = re.search(r"\[([a-z_]+)\]", text)
    return match.group(1) if match else None


def huge_page_size(sysfs: Path = THP_SYSFS) -> int:
    """Bytes of one PMD-sized huge page (``hpage_pmd_size``; 2 MiB where the kernel does not say)."""
    try:
        size = int((sysfs / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return _DEFAULT_HUGE_PAGE
    return size if size > 0 else _DEFAULT_HUGE_PAGE


def _holds(point: str, target: str) -> bool:
    """Is the resolved path ``target`` at or below the mount point ``point``?"""
    return point in ("/", target) or target.startswith(point.rstrip("/") + "/")


def mount_of(path: Path | str, mounts: list[MountInfo]) -> MountInfo | None:
    """The mount in ``mounts`` holding ``path``: the longest prefix; the last listed among equals."""
    target = os.path.realpath(path)
    best: MountInfo | None = None
    for info in mounts:
        point = str(info.mount_point)
        # Later entries on the same point were mounted over the earlier ones: >= keeps the last.
        if _holds(point, target) and (best is None or len(point) >= len(str(best.mount_point))):
            best = info
    return best


def _point(field: bytes) -> str:
    """A mount point field as ``str(MountInfo.mount_point)`` spells it.

    The kernel writes canonical paths, which a ``Path`` leaves as they are: one is built only
    for a point that it could change (``//``, ``/.``, a trailing slash).
    """
    point = _unescape(field)
    if "//" in point or "/." in point or (point.endswith("/") and point != "/"):
        point = str(Path(point))
    return point


def _holders(
    text: bytes, parse: Callable[[bytes], list[MountInfo]], field: int, target: str
) -> list[MountInfo]:
    """The mounts of the table ``text`` whose point holds ``target``, in the order listed.

    Only their lines are parsed whole: a host with many mounts (containers, test mounts) lists
    a hundred or more, and building every ``MountInfo`` cost milliseconds of each region's start.
    ``field`` is where a line keeps its mount point (4 in mountinfo, 1 in mounts).
    """
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) > field and _holds(_point(fields[field]), target):
            found += parse(line)  # [] for a malformed line, as the whole table's parse skips it
    return found


def root_mount(
    path: Path | str,
    *,
    mountinfo: Path = MOUNTINFO,
    mounts: Path = MOUNTS,
    sysfs: Path = THP_SYSFS,
) -> MountInfo | None:
    """The mount that holds ``path`` (see the module docstring), with the system's shmem_enabled."""
    target = os.path.realpath(path)
    try:
        table = _holders(mountinfo.read_bytes(), parse_mountinfo, 4, target)
    except OSError:
        try:
            table = _holders(mounts.read_bytes(), parse_mounts, 1, target)
        except OSError:
            return None
    info = mount_of(target, table)
    if info is None:
        return None
    return MountInfo(
        info.mount_point,
        info.fs_type,
        info.source,
        info.options,
        info.huge,
        info.size_bytes,
        read_shmem_enabled(sysfs),
    )


# ----------------------------------------------------------------- advice


def huge_pages_advice(info: MountInfo | None, *, factor: float = HUGE_PAGE_SPEEDUP) -> str | None:
    """How to give a tmpfs root huge pages, or None where it has them (or is no tmpfs).

    One command on the real mount point, shell-quoted, the measured speed-up and the link to
    ``HUGE_PAGES_DOC``, short enough for two lines of a terminal: what Docker and Kubernetes
    need (their tmpfs takes no huge=) is the doc's to say, not every run's.
    """
    if info is None or not info.is_tmpfs or info.huge_pages != "never":
        return None
    point = shlex.quote(str(info.mount_point))
    remount = f"mount -o remount,huge=within_size {point}"
    if info.shmem_enabled == "deny":
        # The sysfs path is the doc's: with it the line no longer fits two lines of a terminal.
        return f"on the host: shmem_enabled deny to never, then {remount} ({HUGE_PAGES_DOC})"
    return f"on the host: {remount}: pre-faulting is about {factor:g}x faster ({HUGE_PAGES_DOC})"


def huge_pages_pay_off(region_bytes: int | None) -> bool:
    """Whether a region of ``region_bytes`` is worth a remount for huge pages (None: any region).

    The docs' rule (docs/doctor.md#huge-pages): from ``HUGE_PAGES_PAY_OFF_BYTES`` up, where 4 KiB
    pages add a noticeable fraction of a second to every engine start.
    """
    return region_bytes is None or region_bytes >= HUGE_PAGES_PAY_OFF_BYTES


@dataclass(frozen=True, slots=True)
class HugePages:
    """How the root's mount backs the region: huge pages or 4 KiB ones, and the fix for the latter.

    ``huge`` is the mount's own huge= (a tmpfs without the option: "never"), ``effective``
    what the kernel applies once ``shmem_enabled`` (deny, force) has had its say. ``fix`` is
    ``huge_pages_advice``'s, where the region in view is one huge pages pay off for.
    """

    mount_point: Path | None
    fs_type: str | None
    huge: str | None
    shmem_enabled: str | None
    effective: str
    fix: str | None


def check_huge_pages(
    root: Path | str,
    *,
    mountinfo: Path = MOUNTINFO,
    mounts: Path = MOUNTS,
    sysfs: Path = THP_SYSFS,
    region_bytes: int | None = None,
) -> HugePages:
    """Whether the root's mount gives the region huge pages; the fix, with the measured factor, if not.

    ``region_bytes``: the region in view (``init``'s plan, ``doctor``'s largest planned one),
    whose fix is given only where huge pages pay off for it (``huge_pages_pay_off``); None
    (``scan``: the mount alone) gives the fix wherever the mount has 4 KiB pages.
    """
    info = root_mount(root, mountinfo=mountinfo, mounts=mounts, sysfs=sysfs)
    if info is None:
        return HugePages(None, None, None, read_shmem_enabled(sysfs), "never", None)
    return HugePages(
        mount_point=info.mount_point,
        fs_type=info.fs_type,
        huge=info.huge,
        shmem_enabled=info.shmem_enabled,
        effective=info.huge_pages,
        fix=huge_pages_advice(info) if huge_pages_pay_off(region_bytes) else None,
    )


#: ``statfs.f_type`` of the filesystems region files live on (linux/magic.h).
TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
_MEMORY_FILESYSTEMS = {TMPFS_MAGIC: "tmpfs", HUGETLBFS_MAGIC: "hugetlbfs"}


def filesystem_magic(fd: int) -> int | None:
    """``fstatfs(fd).f_type``: which filesystem the open file or directory is on; None if unknown."""
    try:
        return syscalls.fstatfs_type(fd)
    except OSError:
        return None


def memory_filesystem(fd: int) -> str | None:
    """``"tmpfs"`` or ``"hugetlbfs"`` for a directory on one of them; None for any other filesystem."""
    magic = filesystem_magic(fd)
    return None if magic is None else _MEMORY_FILESYSTEMS.get(magic)
