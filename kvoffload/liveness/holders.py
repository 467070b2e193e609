"""Who holds a file: kernel evidence from one pass over ``/proc``.

POSIX shared memory has no attach count; the only ground truth is what each process
has open and mapped. For every process this module reads:

* ``/proc/PID/fd/*``: ``stat`` through the magic link gives the open file's
  ``(st_dev, st_ino)`` (via ``fd``);
* ``/proc/PID/maps``: each file mapping's ``MAJ:MIN`` (hex) and inode (via ``map``).
  Maps alone catch a process that mapped the file and closed its fd, which is how
  vLLM holds its segment files ``.mmap.N`` and how C code usually maps;
* ``/proc/locks``, once: flock/POSIX/OFD locks with the locking pid (via ``lock``).

Files are matched by ``(st_dev, st_ino)``, never by path: a name can be reused by a new
engine and an unlinked file shows as ``path (deleted)``. (On tmpfs the device in maps is
the one ``stat`` reports; on overlay or btrfs it may not be, which is why the shm root,
a tmpfs, is what we scan.)

Invariants:

* fds are read before maps for each process, so a process that opens, maps and then
  closes its fd is seen in every state it can be in;
* a process we cannot read (EACCES, EPERM, any error other than "it exited") is an
  ``Uninspected`` entry, never silently skipped: callers must treat it as a possible
  holder (fail-closed). Processes that exit mid-pass are not failures, and zombies hold
  nothing (they dropped their fds and mappings when they died), except a zombie thread-group
  leader whose other threads still run: those are read through ``/proc/PID/task/TID``;
* nothing here opens, locks or maps the files being judged.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload import procfs
from kvoffload.shm import names

#: ``CAP_DAC_OVERRIDE`` (1) and ``CAP_DAC_READ_SEARCH`` (2): either lets a process open a
#: file whose mode bits would refuse it.
_DAC_CAPS = (1 << 1) | (1 << 2)
_DELETED = " (deleted)"
_VANISHED = (errno.ENOENT, errno.ESRCH)

FileKey = tuple[int, int]  # (st_dev, st_ino)


@dataclass(frozen=True, slots=True)
class Holder:
    """A process that keeps a file alive, and how: ``via`` ⊆ (``fd``, ``map``, ``lock``)."""

    pid: int
    name: str
    via: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Uninspected:
    """A process whose fds or maps could not be read, so it may hold any file.

    ``uids`` are its real, effective, saved and filesystem uids from ``/proc/PID/status``
    (empty when even that was unreadable); ``dac_override`` says whether it has a
    capability that ignores file modes (None: unknown). Both are shown to the operator
    but never used to excuse the process: a file's mode says who may open it now, not who
    opened it before a ``chmod``, or before dropping privileges, or was handed an fd.
    """

    pid: int
    name: str
    error: str
    what: str
    uids: tuple[int, ...] = ()
    dac_override: bool | None = None

    def describe(self) -> str:
        return f"pid {self.pid} ({self.name}: {self.error} on {self.what})"


@dataclass(frozen=True, slots=True)
class DeletedMapping:
    """A region file that was unlinked but is still mapped or open: memory nobody can reap.

    ``mapped_bytes`` sums the process's mappings of it; the sizes come from an open fd
    and are None when the process only maps it.
    """

    pid: int
    name: str
    path: str
    engine_id: str
    segment: int
    dev: int
    ino: int
    mapped_bytes: int
    via: tuple[str, ...]
    size_bytes: int | None = None
    resident_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class HolderIndex:
    """The result of one pass: holders per ``(st_dev, st_ino)``, deleted regions, blind spots."""

    holders: Mapping[FileKey, tuple[Holder, ...]]
    deleted: tuple[DeletedMapping, ...]
    uninspected: tuple[Uninspected, ...]
    #: Locks whose owner is not visible from here (another PID namespace, or an OFD lock).
    anonymous_locks: frozenset[FileKey]
    processes: int
    #: The devices the pass recorded files of (None: every device); ``inodes`` passes: theirs.
    devices: frozenset[int] | None = None

    def covers(self, devices: Collection[int]) -> bool:
        """Did this pass record every file of ``devices``? (Then a scan may use it as is.)"""
        return self.devices is None or self.devices.issuperset(devices)

    def holders_of(self, dev: int, ino: int) -> tuple[Holder, ...]:
        return self.holders.get((dev, ino), ())

    def blind_spots(self, assume_not_holding: Collection[int] = ()) -> tuple[Uninspected, ...]:
        """Uninspected processes nobody vouched for: any of them could hold any file."""
        return tuple(u for u in self.uninspected if u.pid not in assume_not_holding)


@dataclass(slots=True)
class _DeletedSeen:
    path: str
    via: set[str] = field(default_factory=set)
    mapped_bytes: int = 0
    size_bytes: int | None = None
    resident_bytes: int | None = None


@dataclass(slots=True)
class _Seen:
    """Mutable accumulator for one pass."""

    via: dict[FileKey, dict[int, set[str]]] = field(default_factory=dict)
    comm: dict[int, str] = field(default_factory=dict)
    #: Every process read whole (what ``/proc/locks`` may attribute a lock to).
    inspected: set[int] = field(default_factory=set)
    deleted: dict[tuple[int, FileKey], _DeletedSeen] = field(default_factory=dict)
    uninspected: list[Uninspected] = field(default_factory=list)

    def add(self, key: FileKey, pid: int, via: str) -> None:
        self.via.setdefault(key, {}).setdefault(pid, set()).add(via)


def parse_dev(text: str) -> int:
    """``MAJ:MIN`` in hex, as ``/proc/PID/maps`` and ``/proc/locks`` print it, to ``st_dev``."""
    major, _, minor = text.partition(":")
    return os.makedev(int(major, 16), int(minor, 16))


def parse_maps(
    text: str,
    wanted: Callable[[FileKey], bool] | None = None,
    devices: Collection[int] | None = None,
) -> tuple[set[FileKey], dict[FileKey, tuple[str, int]]]:
    """File mappings in a maps text: the wanted keys, and deleted region files with bytes mapped.

    Each line is ``start-end perms offset MAJ:MIN inode [path]``; inode 0 is anonymous.
    ``devices``, when given, promises that ``wanted`` accepts no other device: then only the
    lines of those devices and the lines of deleted region files are looked at, found by one
    regular expression in C (a python holder's maps has hundreds of library and anonymous
    lines; splitting each was most of the time of a ``/proc`` pass).
    """
    keys: set[FileKey] = set()
    deleted: dict[FileKey, tuple[str, int]] = {}
    dev_cache: dict[str, int] = {}
    lines = text.splitlines() if devices is None else _lines_of(text, devices)
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) < 5 or parts[4] == "0":
            continue
        dev_text = parts[3]
        dev = dev_cache.get(dev_text)
        if dev is None:
            try:
                dev = dev_cache[dev_text] = parse_dev(dev_text)
            except ValueError:
                continue
        key = (dev, int(parts[4]))
        if wanted is None or wanted(key):
            keys.add(key)
        if len(parts) == 6 and parts[5].endswith(_DELETED) and names.PREFIX in parts[5]:
            start, _, end = parts[0].partition("-")
            path, size = deleted.get(key, (parts[5][: -len(_DELETED)], 0))
            deleted[key] = (path, size + int(end, 16) - int(start, 16))
    return keys, deleted


#: The minor of the device field of a maps line of a file (a nonzero inode follows it). It
#: starts at the line's first ``:`` (the address, perms and offset fields have none): the
#: regular expression engine skips from one ``:`` to the next in C, where a pattern starting
#: at a space tried every space of the path column's padding (four times slower).
_MINOR_FIELD = re.compile(r":([0-9a-f]{2,}) [1-9]")
#: Up to this many wanted devices, each is looked for directly: one ``str.find`` (memchr
#: speed) costs about half of the regular expression's pass over the same text.
_FIND_EACH_UP_TO = 2
#: Per set of wanted devices, each device as the kernel prints it in maps, by its minor.
_DEVICE_TEXTS: dict[frozenset[int], dict[str, tuple[str, ...]]] = {}
_DEVICE_TEXTS_KEPT = 32


def _device_texts(wanted: frozenset[int]) -> dict[str, tuple[str, ...]]:
    """``{minor: ("MAJ:MIN", ...)}`` of ``wanted`` as ``show_map_vma`` prints them (``%02x:%02x``)."""
    texts = _DEVICE_TEXTS.get(wanted)
    if texts is None:
        if len(_DEVICE_TEXTS) >= _DEVICE_TEXTS_KEPT:
            _DEVICE_TEXTS.clear()  # a watch agent's device sets change as pods come and go
        by_minor: dict[str, list[str]] = {}
        for d in sorted(wanted):
            minor = f"{os.minor(d):02x}"
            by_minor.setdefault(minor, []).append(f"{os.major(d):02x}:{minor}")
        texts = _DEVICE_TEXTS[wanted] = {minor: tuple(found) for minor, found in by_minor.items()}
    return texts


def _lines_of(text: str, devices: Collection[int]) -> list[str]:
    """The maps lines on ``devices``, and those naming a deleted region file, each once.

    Found with C, no per-line Python: ``str.find`` of each wanted device as the kernel prints
    it (``show_map_vma``: ``"%02x:%02x"`` between spaces), and of the `` (deleted)`` suffix.
    Past ``_FIND_EACH_UP_TO`` devices, one regular expression first lists the minors of the
    text's files, and only the wanted devices of those minors are looked for: an agent over
    100 pod volumes wants 100 devices, and a ``find`` of each in every process's maps was a
    second of a 2,000-process ``/proc`` pass. The minors are a filter only: every line of a
    file on a wanted device has its minor among them, so no such line is missed.
    """
    by_minor = _device_texts(frozenset(devices))
    if len(by_minor) <= _FIND_EACH_UP_TO:
        present = [device for found in by_minor.values() for device in found]
    else:
        present = [device for minor in set(_MINOR_FIELD.findall(text)) for device in by_minor.get(minor, ())]
    needles = [f" {device} " for device in sorted(present)]
    needles.append(_DELETED + "\n")
    found: dict[int, str] = {}
    if not text.endswith("\n"):
        text += "\n"
    for needle in needles:
        at = text.find(needle)
        while at >= 0:
            start = text.rfind("\n", 0, at) + 1
            end = text.find("\n", at)  # never -1: the text ends with a newline
            if start not in found:
                found[start] = text[start:end]
            at = text.find(needle, end)
    return list(found.values())


def parse_locks(text: str) -> list[tuple[int, FileKey]]:
    """``(pid, (dev, ino))`` of every granted lock in ``/proc/locks`` (waiters, ``->``, skipped).

    Line shape: ``1: FLOCK  ADVISORY  WRITE 1234 00:1b:5678 0 EOF``. The pid is 0 when the
    owner is not visible from our PID namespace and -1 for OFD locks.
    """
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 6 or parts[1] == "->":
            continue
        try:
            pid = int(parts[4])
            major, minor, ino = parts[5].split(":")
            found.append((pid, (os.makedev(int(major, 16), int(minor, 16)), int(ino))))
        except ValueError:
            continue
    return found


@dataclass(frozen=True, slots=True)
class _Filter:
    devices: frozenset[int] | None
    inodes: frozenset[FileKey] | None

    @property
    def maps_devices(self) -> frozenset[int] | None:
        """Every device ``accepts`` can take (None: any)."""
        if self.inodes is not None:
            return frozenset(dev for dev, _ in self.inodes)
        return self.devices

    def accepts(self, key: FileKey) -> bool:
        if self.inodes is not None:
            return key in self.inodes
        return self.devices is None or key[0] in self.devices


def collect_holders(
    proc_root: Path = procfs.PROC_ROOT,
    *,
    devices: Iterable[int] | None = None,
    inodes: Iterable[FileKey] | None = None,
    ignore_fds: Mapping[int, Collection[int]] | None = None,
    deleted: bool = True,
    locks: bool = True,
    skip_pids: Collection[int] = (),
) -> HolderIndex:
    """One pass over every process in ``proc_root``.

    ``devices``/``inodes`` restrict the index to files on those devices or to exactly those
    files (the pass still reads every process). ``ignore_fds`` maps a pid to fd numbers
    that do not count, such as the reaper's own ``LOCK_EX`` fds; that pid's entries in
    ``/proc/locks`` do not count either. ``deleted=False`` skips the
    list of mapped-but-deleted regions; ``locks=False`` skips ``/proc/locks`` (slow to
    read on some kernels, and pointless to a caller that holds LOCK_EX on every file).
    """
    wanted = _Filter(
        None if devices is None else frozenset(devices),
        None if inodes is None else frozenset(inodes),
    )
    ignored = {pid: frozenset(fds) for pid, fds in (ignore_fds or {}).items()}
    skipped = frozenset(skip_pids)
    seen = _Seen()
    try:
        pids = procfs.list_pids(proc_root)
    except OSError as e:
        seen.uninspected.append(
            Uninspected(0, "every process", errno.errorcode.get(e.errno or 0, str(e)), str(proc_root))
        )
        pids = []
    for pid in pids:
        if pid in skipped:
            continue
        if _inspect(proc_root, pid, wanted, ignored.get(pid, frozenset()), seen, deleted):
            seen.inspected.add(pid)
    # /proc/locks does not say through which fd a lock was taken. The caller's flock on
    # these inodes goes through its ignored fds; any other lock that pid holds on them
    # needs another open fd (flock LOCK_EX excludes every other flock, and a POSIX lock
    # dies with the process's last fd), and that fd is seen above.
    anonymous = _read_locks(proc_root, wanted, seen, frozenset(ignored) | skipped) if locks else set()
    hidden = _hidden_processes(proc_root)
    if hidden is not None:
        seen.uninspected.append(hidden)
    holders = {
        key: tuple(
            Holder(pid, seen.comm.get(pid, "?"), tuple(v for v in ("fd", "map", "lock") if v in via))
            for pid, via in sorted(by_pid.items())
        )
        for key, by_pid in seen.via.items()
    }
    return HolderIndex(
        holders=holders,
        deleted=tuple(_deleted_mappings(seen)),
        uninspected=tuple(seen.uninspected),
        anonymous_locks=frozenset(anonymous),
        processes=len(seen.inspected),
        devices=wanted.maps_devices if wanted.inodes is None else frozenset(),
    )


def _inspect(
    proc_root: Path,
    pid: int,
    wanted: _Filter,
    ignored_fds: frozenset[int],
    seen: _Seen,
    want_deleted: bool,
) -> bool:
    """Record one process; False if it exited, is a zombie or could not be read.

    ``/proc/PID/stat`` is read only where its answer is needed: the name of a process that
    holds a wanted file (or cannot be read), and whether a process with no fd and no mapping
    is a zombie. Most processes hold nothing of ours, and reading every one's stat was a fifth
    of a 2,000-process pass.
    """
    base = f"{proc_root}/{pid}"
    found = _read_files(proc_root, pid, base, wanted, ignored_fds, seen, want_deleted)
    if found is not _NOTHING:
        return bool(found)
    # No fd and no mapping: a kernel thread, or a zombie. A zombie leader may still have live
    # threads (its main thread called pthread_exit): they share its mappings and fds, which
    # only their task directories still show.
    try:
        st = procfs.read_stat(pid, proc_root)
    except OSError as e:
        if e.errno in _VANISHED:
            return False
        seen.uninspected.append(_uninspected(proc_root, pid, "?", e, "stat"))
        return False
    except (ValueError, IndexError):
        seen.uninspected.append(Uninspected(pid, "?", "unparsable", "stat"))
        return False
    if not st.is_zombie:
        return True
    try:
        thread = procfs.live_thread(pid, proc_root)
    except OSError as e:
        if e.errno in _VANISHED:
            return False
        seen.uninspected.append(_uninspected(proc_root, pid, st.comm, e, "task"))
        return False
    if thread is None:
        return False
    found = _read_files(proc_root, pid, f"{base}/task/{thread}", wanted, ignored_fds, seen, want_deleted)
    return found is _NOTHING or bool(found)


#: ``_read_files`` found no fd and no mapping at all.
_NOTHING = object()


def _read_files(
    proc_root: Path,
    pid: int,
    base: str,
    wanted: _Filter,
    ignored_fds: frozenset[int],
    seen: _Seen,
    want_deleted: bool,
) -> object:
    """Record the wanted files ``base`` (a process's or a thread's directory) has open or
    mapped: True, False if it could not be read (or exited), ``_NOTHING`` if it has none."""
    fd_dir = f"{base}/fd"
    # fds first, then maps: open -> mmap -> close is visible in every state (module docstring).
    try:
        fd_names = os.listdir(fd_dir)
    except OSError as e:
        if e.errno in _VANISHED:
            return False
        seen.uninspected.append(_uninspected(proc_root, pid, _comm(proc_root, pid), e, "fd"))
        return False
    holds = False
    accepts = wanted.accepts
    fd_prefix = f"{fd_dir}/"
    for fd_name in fd_names:
        if ignored_fds and fd_name.isdigit() and int(fd_name) in ignored_fds:
            continue
        fd_path = fd_prefix + fd_name
        try:
            fst = os.stat(fd_path)
        except OSError as e:
            if e.errno in _VANISHED:
                continue  # closed meanwhile
            seen.uninspected.append(_uninspected(proc_root, pid, _comm(proc_root, pid), e, f"fd {fd_name}"))
            return False
        key = (fst.st_dev, fst.st_ino)
        if accepts(key):
            seen.add(key, pid, "fd")
            holds = True
        if want_deleted and not fst.st_nlink and stat.S_ISREG(fst.st_mode):
            holds |= _note_deleted_fd(seen, pid, fd_path, key, fst)
    try:
        text = procfs.read_text(f"{base}/maps")
    except OSError as e:
        if e.errno in _VANISHED:
            return False
        seen.uninspected.append(_uninspected(proc_root, pid, _comm(proc_root, pid), e, "maps"))
        return False
    if not fd_names and not text:
        return _NOTHING
    keys, deleted = parse_maps(text, wanted.accepts, wanted.maps_devices)
    for key in keys:
        seen.add(key, pid, "map")
    if want_deleted:
        for key, (path, size) in deleted.items():
            record = seen.deleted.setdefault((pid, key), _DeletedSeen(path))
            record.mapped_bytes = size
            record.via.add("map")
    if holds or keys or (want_deleted and deleted):
        # Named now, while it holds them: read after the pass, the pid could be another's.
        seen.comm[pid] = _comm(proc_root, pid)
    return True


def _comm(proc_root: Path, pid: int) -> str:
    """The process's name from its stat, or "?" where it cannot be read (it exited)."""
    try:
        return procfs.read_stat(pid, proc_root).comm
    except (OSError, ValueError, IndexError):
        return "?"


def _note_deleted_fd(seen: _Seen, pid: int, fd_path: str, key: FileKey, fst: os.stat_result) -> bool:
    """Record an fd on an unlinked region file; True if it was one."""
    try:
        target = os.readlink(fd_path)
    except OSError:
        return False
    path = target[: -len(_DELETED)] if target.endswith(_DELETED) else target
    if names.parse(os.path.basename(path)) is None:
        return False
    record = seen.deleted.setdefault((pid, key), _DeletedSeen(path))
    record.via.add("fd")
    record.size_bytes = fst.st_size
    record.resident_bytes = fst.st_blocks * 512
    return True


def _deleted_mappings(seen: _Seen) -> Iterable[DeletedMapping]:
    for (pid, (dev, ino)), record in sorted(seen.deleted.items(), key=lambda item: item[0]):
        region = names.parse(os.path.basename(record.path))
        if region is None:
            continue
        yield DeletedMapping(
            pid=pid,
            name=seen.comm.get(pid, "?"),
            path=record.path,
            engine_id=region.engine_id,
            segment=region.segment,
            dev=dev,
            ino=ino,
            mapped_bytes=record.mapped_bytes,
            via=tuple(v for v in ("fd", "map") if v in record.via),
            size_bytes=record.size_bytes,
            resident_bytes=record.resident_bytes,
        )


def _read_locks(proc_root: Path, wanted: _Filter, seen: _Seen, ignored_pids: frozenset[int]) -> set[FileKey]:
    """Add lock holders to ``seen``; return the keys locked by processes we cannot see."""
    try:
        text = (proc_root / "locks").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()  # the LOCK_EX probe, not this table, is what proves a lock is held
    anonymous: set[FileKey] = set()
    for pid, key in parse_locks(text):
        if not wanted.accepts(key) or pid in ignored_pids:
            continue
        if pid > 0 and pid in seen.inspected:
            if pid not in seen.comm:
                seen.comm[pid] = _comm(proc_root, pid)
            seen.add(key, pid, "lock")
        else:
            anonymous.add(key)
    return anonymous


def _uninspected(proc_root: Path, pid: int, comm: str, error: OSError, what: str) -> Uninspected:
    uids, dac = _credentials(proc_root, pid)
    code = errno.errorcode.get(error.errno or 0, error.strerror or str(error))
    return Uninspected(pid, comm, code, what, uids, dac)


def _credentials(proc_root: Path, pid: int) -> tuple[tuple[int, ...], bool | None]:
    """Uids and whether the process can bypass file modes, from ``/proc/PID/status``."""
    try:
        text = (proc_root / str(pid) / "status").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return (), None
    uids: tuple[int, ...] = ()
    caps = 0
    seen_caps = False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        try:
            if key == "Uid":
                uids = tuple(int(v) for v in value.split())
            elif key in ("CapEff", "CapPrm"):
                caps |= int(value.strip(), 16)
                seen_caps = True
        except ValueError:
            return (), None
    return uids, (bool(caps & _DAC_CAPS) if seen_caps else None)


def _hidden_processes(proc_root: Path) -> Uninspected | None:
    """A blind spot for the whole pass when ``hidepid`` hides other users' processes from us.

    With ``hidepid`` the kernel omits those processes from the listing instead of
    refusing access, so no per-process error would ever tell us they exist.
    """
    if os.geteuid() == 0:
        return None
    try:
        with open(proc_root / "self" / "mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    target = str(proc_root)
    for line in lines:
        fields = line.split()
        if len(fields) < 5 or fields[4] != target or " - proc " not in line:
            continue
        options = line.rsplit(" ", 1)[-1].split(",")
        for option in options:
            key, _, value = option.partition("=")
            if key == "hidepid" and value not in ("0", "off"):
                return Uninspected(0, "hidden processes", "hidepid", f"{target} mount ({option})")
    return None
