"""Classify every region file in the shm root as live, orphaned, starting, unknown or skipped.

The verdict comes from kernel evidence, never from age: an mmap'ed region's mtime freezes
at init (tmpfs only bumps it on a page's first write fault), so an old file says nothing
about its owner. Evidence, gathered once per scan whatever the number of files:

* holders: processes whose fds or mappings refer to the file's ``(st_dev, st_ino)``
  (``holders.collect_holders``: one pass over ``/proc``);
* the lock: kvoffload participants hold ``flock(LOCK_SH)`` while they map a region, so a
  refused ``LOCK_EX|LOCK_NB`` proves a holder exists and a granted one proves no
  participant is left, in any PID namespace;
* the owner record (kvoffload files only): who created it, a hint that names a dead owner
  (a pid whose start time differs was reused) and is never evidence on its own.

Liveness is fail-closed. ``orphaned`` needs no holder, no lock, complete evidence (every
process that could have opened the file was inspected; the recorded owner, if any, is
not seen running) and an age past the grace period; anything short of that is
``unknown`` or ``starting``, and only ``orphaned`` is ever reaped. Processes in a PID
namespace we cannot see are invisible, not uninspectable: for vLLM's lockless files,
run the scan where the engines' processes are visible (the host, or a shared PID
namespace); kvoffload's files carry the lock that crosses namespaces.

Files we have no business judging are ``skipped``: symlinks (never followed), non-regular
files, files with more than one link, and other users' files unless ``all_users``.

A region is a base file plus segment files ``.mmap.N``; the group shares one verdict
(a segment mapped by a live engine keeps its base alive and vice versa), so segments
follow their base.

Everything goes through a directory fd of the root with ``follow_symlinks=False``; the
only file this module opens is a region file, read-only, ``O_NOFOLLOW|O_NONBLOCK``, to
probe its lock and read its owner record.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from kvoffload import procfs
from kvoffload.errors import ConfigError, RootError
from kvoffload.liveness.holders import DeletedMapping, Holder, HolderIndex, Uninspected, collect_holders
from kvoffload.shm import names
from kvoffload.shm.owner import OwnerRecord, judge_owner, read_owner

DEFAULT_ROOT = Path("/dev/shm")
DEFAULT_GRACE_S = 30.0
SCHEMA_VERSION = 1
_REMOVED = "removed during the scan"
_PROBE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class Status(StrEnum):
    LIVE = "live"
    ORPHANED = "orphaned"
    STARTING = "starting"
    UNKNOWN = "unknown"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class OwnerView:
    """The owner record of a kvoffload file and whether that process still runs."""

    pid: int
    start_ticks: int
    boot_id: str | None
    pid_ns: str | None
    hostname: str
    uid: int
    engine_id: str
    created_at: float
    alive: bool | None
    liveness: str


@dataclass(frozen=True, slots=True)
class ScanEntry:
    """One directory entry matching the region name pattern, and its verdict."""

    name: str
    path: Path
    engine_id: str
    segment: int
    status: Status
    reason: str
    kind: str
    size_bytes: int
    resident_bytes: int
    uid: int
    age_s: float
    dev: int
    ino: int
    nlink: int
    holders: tuple[Holder, ...] = ()
    owner: OwnerView | None = None
    #: True: a LOCK_EX probe was refused; False: granted; None: not probed (skipped files).
    lock_held: bool | None = None

    @property
    def identity(self) -> tuple[int, int]:
        return (self.dev, self.ino)


@dataclass(frozen=True, slots=True)
class ScanSummary:
    """Entries per status and the memory orphans pin (resident = st_blocks × 512)."""

    total: int
    live: int
    orphaned: int
    starting: int
    unknown: int
    skipped: int
    orphaned_size_bytes: int
    orphaned_resident_bytes: int
    resident_bytes: int
    uninspected_processes: int

    @classmethod
    def of(cls, entries: tuple[ScanEntry, ...], uninspected: int) -> ScanSummary:
        count = {s: 0 for s in Status}
        for e in entries:
            count[e.status] += 1
        orphans = [e for e in entries if e.status is Status.ORPHANED]
        return cls(
            total=len(entries),
            live=count[Status.LIVE],
            orphaned=count[Status.ORPHANED],
            starting=count[Status.STARTING],
            unknown=count[Status.UNKNOWN],
            skipped=count[Status.SKIPPED],
            orphaned_size_bytes=sum(e.size_bytes for e in orphans),
            orphaned_resident_bytes=sum(e.resident_bytes for e in orphans),
            resident_bytes=sum(e.resident_bytes for e in entries if e.status is not Status.SKIPPED),
            uninspected_processes=uninspected,
        )


@dataclass(frozen=True, slots=True)
class ScanReport:
    """What ``scan`` found. Serialised as is for ``shmctl scan --json``."""

    schema_version: int
    root: Path
    scanned_at: float
    grace_s: float
    entries: tuple[ScanEntry, ...]
    summary: ScanSummary
    #: Processes whose fds or maps could not be read (``assume_not_holding`` ones included).
    uninspected: tuple[Uninspected, ...]
    #: Region files that were unlinked but are still mapped or open, per process.
    deleted: tuple[DeletedMapping, ...]
    #: Pids the operator vouched for (``--assume-not-holding``): not counted as blind spots.
    assumed_not_holding: tuple[int, ...] = ()

    @property
    def blind_spots(self) -> tuple[Uninspected, ...]:
        """Uninspected processes nobody vouched for: what can keep files ``unknown``."""
        return tuple(u for u in self.uninspected if u.pid not in self.assumed_not_holding)

    def with_status(self, status: Status) -> tuple[ScanEntry, ...]:
        return tuple(e for e in self.entries if e.status is status)


@contextlib.contextmanager
def open_root(root: Path | str) -> Iterator[int]:
    """A directory fd of the shm root; every error becomes a ``RootError`` with a fix.

    The root itself may be a symlink (``/dev/shm -> /run/shm`` on some systems): the
    operator names it. Entries inside it are never followed.
    """
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RootError(root, "does not exist", fix="pass --root or set SHMCTL_ROOT") from None
    except NotADirectoryError:
        raise RootError(root, "is not a directory", fix="pass the shm mount point as --root") from None
    except PermissionError:
        raise RootError(
            root, "permission denied", fix="run as the user that owns the regions, or as root"
        ) from None
    except OSError as e:
        raise RootError(root, f"cannot open: {e.strerror}") from None
    try:
        yield fd
    finally:
        os.close(fd)


@dataclass(frozen=True, slots=True)
class _Listed:
    name: str
    region: names.RegionName
    st: os.stat_result


@dataclass(slots=True)
class _Probe:
    lock_held: bool | None = None
    owner: OwnerRecord | None = None
    problem: str | None = None


def scan(
    root: Path | str = DEFAULT_ROOT,
    *,
    grace_s: float = DEFAULT_GRACE_S,
    all_users: bool = False,
    assume_not_holding: Collection[int] = (),
    proc_root: Path = procfs.PROC_ROOT,
    now: float | None = None,
) -> ScanReport:
    """Judge every ``vllm_offload_*.mmap[.N]`` entry of ``root``.

    ``all_users`` (root only) judges other users' files too. ``assume_not_holding`` lists
    pids the operator vouches for: processes that cannot be inspected (a container's
    init, say) but are known not to map regions; without it such a process keeps every
    file it could open ``unknown``.
    """
    if grace_s < 0:
        raise ConfigError("grace", f"must not be negative, got {grace_s:g}s")
    euid = os.geteuid()
    if all_users and euid != 0:
        raise ConfigError(
            "all_users", "only root may judge other users' files", fix="run as root, or drop --all-users"
        )
    root = Path(root)
    with open_root(root) as dir_fd:
        listed = _list_regions(root, dir_fd)
        devices = {os.fstat(dir_fd).st_dev} | {item.st.st_dev for item in listed}
        index = collect_holders(proc_root, devices=devices)
        when = time.time() if now is None else now
        entries = _judge(
            root,
            dir_fd,
            listed,
            index,
            when=when,
            grace_s=grace_s,
            owner_uids=None if all_users else {euid},
            assume_not_holding=frozenset(assume_not_holding),
            proc_root=proc_root,
        )
    return ScanReport(
        schema_version=SCHEMA_VERSION,
        root=root,
        scanned_at=when,
        grace_s=float(grace_s),
        entries=entries,
        summary=ScanSummary.of(entries, len(index.uninspected)),
        uninspected=index.uninspected,
        deleted=index.deleted,
        assumed_not_holding=tuple(sorted(assume_not_holding)),
    )


def _list_regions(root: Path, dir_fd: int) -> list[_Listed]:
    try:
        entry_names = os.listdir(dir_fd)
    except OSError as e:
        raise RootError(root, f"cannot list: {e.strerror}", fix="run as root or the regions' owner") from None
    listed = []
    for name in sorted(entry_names):
        region = names.parse(name)
        if region is None:
            continue
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed since the listing
        except PermissionError:
            raise RootError(
                root, "permission denied on its entries", fix="the directory needs search (x) permission"
            ) from None
        listed.append(_Listed(name, region, st))
    return listed


_KINDS = (
    (stat.S_ISREG, "file"),
    (stat.S_ISLNK, "symlink"),
    (stat.S_ISDIR, "directory"),
    (stat.S_ISFIFO, "fifo"),
    (stat.S_ISSOCK, "socket"),
    (stat.S_ISCHR, "character device"),
    (stat.S_ISBLK, "block device"),
)


def _kind(mode: int) -> str:
    return next((kind for test, kind in _KINDS if test(mode)), "unknown type")


def _skip_reason(item: _Listed, owner_uids: set[int] | None) -> str | None:
    st = item.st
    kind = _kind(st.st_mode)
    if kind == "symlink":
        return "symlink: never followed"
    if kind != "file":
        return f"{kind}: not a region file"
    if st.st_nlink > 1:
        return f"{st.st_nlink} hard links: another name shares this inode"
    if owner_uids is not None and st.st_uid not in owner_uids:
        return f"owned by uid {st.st_uid}, not you (root can judge it with --all-users)"
    return None


def _probe(dir_fd: int, item: _Listed) -> _Probe:
    """Open read-only without following links, check it is still the listed inode,
    read the owner record and try ``LOCK_EX|LOCK_NB`` (released at once)."""
    try:
        fd = os.open(item.name, _PROBE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return _Probe(problem=_REMOVED)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return _Probe(problem="replaced by a symlink during the scan")
        return _Probe(problem=f"cannot open it to probe its lock ({errno.errorcode.get(e.errno or 0, e)})")
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != (item.st.st_dev, item.st.st_ino):
            return _Probe(problem="replaced by another file during the scan")
        owner = read_owner(fd) if item.region.segment == 0 else None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _Probe(lock_held=True, owner=owner)
        except OSError as e:
            return _Probe(owner=owner, problem=f"lock probe failed ({errno.errorcode.get(e.errno or 0, e)})")
        return _Probe(lock_held=False, owner=owner)
    finally:
        os.close(fd)  # also releases the probe's lock


@dataclass(slots=True)
class _Group:
    """The files of one engine's region that are ours to judge, and their shared evidence."""

    engine_id: str
    members: list[_Listed] = field(default_factory=list)
    skipped_base: str | None = None


def _judge(
    root: Path,
    dir_fd: int,
    listed: list[_Listed],
    index: HolderIndex,
    *,
    when: float,
    grace_s: float,
    owner_uids: set[int] | None,
    assume_not_holding: frozenset[int],
    proc_root: Path,
) -> tuple[ScanEntry, ...]:
    groups: dict[str, _Group] = {}
    skipped: dict[str, str] = {}
    for item in listed:
        group = groups.setdefault(item.region.engine_id, _Group(item.region.engine_id))
        reason = _skip_reason(item, owner_uids)
        if reason is not None:
            skipped[item.name] = reason
            if item.region.segment == 0:
                group.skipped_base = reason
        else:
            group.members.append(item)

    entries: list[ScanEntry] = []
    for item in listed:
        if item.name in skipped:
            entries.append(_entry(root, item, Status.SKIPPED, skipped[item.name], when, index, None, None))
    for group in groups.values():
        entries.extend(_judge_group(root, dir_fd, group, index, when, grace_s, assume_not_holding, proc_root))
    entries.sort(key=lambda e: (e.engine_id, e.segment, e.name))
    return tuple(entries)


def _judge_group(
    root: Path,
    dir_fd: int,
    group: _Group,
    index: HolderIndex,
    when: float,
    grace_s: float,
    assume_not_holding: frozenset[int],
    proc_root: Path,
) -> list[ScanEntry]:
    if not group.members:
        return []
    if group.skipped_base is not None:
        reason = f"its base file is skipped ({group.skipped_base})"
        return [_entry(root, m, Status.SKIPPED, reason, when, index, None, None) for m in group.members]

    probes = {m.name: _probe(dir_fd, m) for m in group.members}
    members = [m for m in group.members if probes[m.name].problem != _REMOVED]
    if not members:
        return []
    base = next((m for m in members if m.region.segment == 0), None)
    record = probes[base.name].owner if base is not None else None
    owner = _owner_view(record, proc_root) if record is not None else None
    status, reason = _verdict(members, probes, base, owner, index, when, grace_s, assume_not_holding)
    if base is None:
        reason = f"segment without its base file; {reason}"
    entries = []
    for m in members:
        why = reason if m is base or base is None else f"follows its base file: {reason}"
        entries.append(
            _entry(root, m, status, why, when, index, owner if m is base else None, probes[m.name].lock_held)
        )
    return entries


def _verdict(
    members: list[_Listed],
    probes: dict[str, _Probe],
    base: _Listed | None,
    owner: OwnerView | None,
    index: HolderIndex,
    when: float,
    grace_s: float,
    assume_not_holding: frozenset[int],
) -> tuple[Status, str]:
    """The group's verdict and the reason for it, fail-closed (see the module docstring)."""
    holders = {h.pid: h for m in members for h in index.holders_of(m.st.st_dev, m.st.st_ino)}
    if holders:
        shown = ", ".join(f"{h.pid}:{h.name}" for h in list(holders.values())[:3])
        more = f" and {len(holders) - 3} more" if len(holders) > 3 else ""
        return Status.LIVE, f"held by {len(holders)} process(es): {shown}{more}"
    if any(probes[m.name].lock_held for m in members):
        return Status.LIVE, "lock held (holder may be in another PID namespace)"
    if any((m.st.st_dev, m.st.st_ino) in index.anonymous_locks for m in members):
        return Status.LIVE, "locked by a process outside our PID namespace"
    problems = [f"{m.name}: {probes[m.name].problem}" for m in members if probes[m.name].problem]
    if problems:
        return Status.UNKNOWN, f"{problems[0]}; liveness unproven"
    blind: dict[int, Uninspected] = {}
    for m in members:
        for u in index.blind_spots(m.st.st_uid, m.st.st_mode, assume_not_holding=assume_not_holding):
            blind.setdefault(u.pid, u)
    if blind:
        first = next(iter(blind.values()))
        if len(blind) == 1:
            return Status.UNKNOWN, f"cannot inspect {first.describe()}; liveness unproven"
        return (
            Status.UNKNOWN,
            f"cannot inspect {len(blind)} processes ({first.describe()}, ...); liveness unproven",
        )
    if owner is not None and owner.alive is True:
        return (
            Status.UNKNOWN,
            f"{owner.liveness} but neither maps, opens nor locks it; liveness unproven",
        )
    # An owner we cannot judge by pid (another PID namespace, another container's hostname)
    # needs no pid: every kvoffload participant holds the lock, in any namespace, and the
    # probe above found it free. This is what lets a restarted container reap the region of
    # its previous incarnation instead of crash-looping on it (vLLM #54002).
    age = min(_age(m.st, when) for m in members)
    if age < grace_s:
        return (
            Status.STARTING,
            f"no holder yet; changed {age:.0f}s ago, within the {grace_s:g}s grace period",
        )
    if base is not None and base.st.st_size == 0:
        reason = "empty base file and no process maps or opens it: its creator died before sizing it"
    else:
        reason = "no process maps or opens it"
    if owner is not None:
        reason += f"; {owner.liveness}"
        if owner.alive is None:
            reason += ", and no process in any namespace holds its lock"
    return Status.ORPHANED, reason


def _age(st: os.stat_result, when: float) -> float:
    # ctime moves on creation, ftruncate, xattr writes and first-touch writes; mtime is
    # kept in case a filesystem lags. Age only delays a verdict; it never proves death.
    return max(0.0, when - max(st.st_mtime, st.st_ctime))


def _owner_view(record: OwnerRecord, proc_root: Path) -> OwnerView:
    liveness = judge_owner(record, proc_root)
    return OwnerView(
        pid=record.pid,
        start_ticks=record.start_ticks,
        boot_id=record.boot_id,
        pid_ns=record.pid_ns,
        hostname=record.hostname,
        uid=record.uid,
        engine_id=record.engine_id,
        created_at=record.created_at,
        alive=liveness.alive,
        liveness=liveness.reason,
    )


def _entry(
    root: Path,
    item: _Listed,
    status: Status,
    reason: str,
    when: float,
    index: HolderIndex,
    owner: OwnerView | None,
    lock_held: bool | None,
) -> ScanEntry:
    st = item.st
    regular = stat.S_ISREG(st.st_mode)
    return ScanEntry(
        name=item.name,
        path=root / item.name,
        engine_id=item.region.engine_id,
        segment=item.region.segment,
        status=status,
        reason=reason,
        kind=_kind(st.st_mode),
        size_bytes=st.st_size if regular else 0,
        resident_bytes=st.st_blocks * 512 if regular else 0,
        uid=st.st_uid,
        age_s=round(_age(st, when), 3),
        dev=st.st_dev,
        ino=st.st_ino,
        nlink=st.st_nlink,
        holders=index.holders_of(st.st_dev, st.st_ino) if regular else (),
        owner=owner,
        lock_held=lock_held,
    )
