"""Classify every region file in the shm root as live, orphaned, starting, unknown or skipped.

The verdict comes from kernel evidence, never from age: an mmap'ed region's mtime freezes
at init (tmpfs only bumps it on a page's first write fault), so an old file says nothing
about its owner. For each file this module gathers, from one module per source:

* the write lease (``lease``): granted only when no other open file description of the
  inode exists anywhere on the kernel, so it proves "nobody has it" in any PID namespace,
  for any uid, with no ``/proc`` at all; it needs the file's owner or ``CAP_LEASE``;
* the lock (``lock``): kvoffload participants hold ``flock(LOCK_SH)``;
* holders (``holders``): one pass over ``/proc`` for the whole scan, which *names* who
  holds a file and finds unlinked regions still mapped (``--deleted``);
* the owner record (``ownership``): a hint that names the creator, never proof alone;
* whether this ``/proc`` shows every process (``namespace``).

``verdict.decide`` combines them and writes the reason from whichever evidence decided.
Liveness is fail-closed: ``orphaned`` needs a granted lease on every file of the region,
or, where no lease can be taken, a complete ``/proc`` walk (every process inspected, from
the initial PID namespace), plus an age past the grace period. Only ``orphaned`` is ever
reaped.

Files we have no business judging are ``skipped``: symlinks (never followed), non-regular
files, files with more than one link, and other users' files where we may not judge them.
Root judges every user's files (``ps``, ``lsof`` and ``ipcs`` show root everything too); any
other user judges only its own, since it can prove another user's file neither dead nor alive
(``listing.Owners``). Judging is not removing: ``reap`` removes another user's file only when
asked to (``all_users=True``).

A region is a base file plus segment files ``.mmap.N``; the group shares one verdict, and
any file of it that is skipped keeps the whole group (a segment mapped by a live engine
keeps its base alive, and vice versa).

The other files a killed engine leaves (``psm_*``, ``sem.mp-*``, ``nccl-*``, ``torch_*``:
``kvoffload.shm.families``) are judged only when ``ScanOptions.families`` names them, each
file a unit of its own, by the same evidence and the same grace period.

Everything goes through a directory fd of the root with ``follow_symlinks=False``; the
only file a scan opens is a region file, read-only, ``O_NOFOLLOW|O_NONBLOCK``, to probe its
lease and lock and read its owner record.

This module is the scan itself: its settings (``ScanOptions``), the root's directory fd,
and the judging of each region, whole (``scan``) or a region at a time (``ScanStream``).
The files are listed and sorted by ``listing``, probed by ``probe``, written as entries of
``report``; what waits in park directories is judged by ``park.parked``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict, Unpack

from kvoffload import procfs
from kvoffload.errors import ConfigError, RootError
from kvoffload.liveness import lease, park, prober
from kvoffload.liveness.holders import (
    DeletedMapping,
    FileKey,
    Holder,
    HolderIndex,
    Uninspected,
    collect_holders,
)
from kvoffload.liveness.lease import LeaseProbe
from kvoffload.liveness.listing import (
    Group,
    Listed,
    Owners,
    Sorted,
    chunks,
    list_names,
    list_regions,
    stat_names,
    uids_text,
)
from kvoffload.liveness.namespace import visibility
from kvoffload.liveness.ownership import Host, OwnerLiveness, judge_owner
from kvoffload.liveness.park.parked import JudgedParks, judge_parks
from kvoffload.liveness.park.views import ParkedView, ParkView, UntrustedPark
from kvoffload.liveness.probe import REMOVED, Probe, open_probe_fd, probe_file
from kvoffload.liveness.report import (
    SCHEMA_VERSION,
    OwnerView,
    ScanEntry,
    ScanReport,
    ScanSummary,
    entry_of,
)
from kvoffload.liveness.verdict import (
    Evidence,
    FileEvidence,
    ScannerView,
    Status,
    changed_s,
    decide,
)
from kvoffload.liveness.walks import ProcWalks
from kvoffload.shm import families as shm_families
from kvoffload.shm import mounts
from kvoffload.shm.names import DEFAULT_ROOT
from kvoffload.shm.owner import OwnerRecord

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_ROOT",
    "STREAM_CHUNK_FILES",
    "Evidence",
    "ScanKeywords",
    "ScanOptions",
    "ScanStream",
    "Status",
    "open_root",
    "scan",
]
#: Moved to ``kvoffload.liveness.report``, ``kvoffload.liveness.park`` (the park views),
#: ``kvoffload.liveness.probe`` and ``kvoffload.liveness.listing``; kept here for one release
#: (issue #29).
__all__ += [
    "SCHEMA_VERSION",
    "OwnerView",
    "ParkView",
    "ParkedView",
    "ScanEntry",
    "ScanReport",
    "ScanSummary",
    "UntrustedPark",
    "open_probe_fd",
    "uids_text",
]

DEFAULT_GRACE_S = 30.0


@dataclass(frozen=True, slots=True)
class ScanOptions:
    """The settings a scan judges by, one value passed whole: through ``scan`` and
    ``ScanStream``, ``reap``, the agent's ``WatchConfig``, ``audit`` and the metrics.

    A new setting is a field here and a flag in the CLI, nothing in between. Values are
    checked where they are used (``scan`` and ``ScanStream`` refuse a negative grace; the
    agent's ``WatchConfig`` names its own flags), so that each error says what it always said.
    """

    #: Files changed more recently than this are ``starting``, never orphaned.
    grace_s: float = DEFAULT_GRACE_S
    #: Whose files are judged: None every user's as root and the caller's own otherwise, True
    #: every user's (root only), False the caller's own only; the rest are ``skipped``. Only
    #: True lets ``reap`` and the agent remove another user's files.
    all_users: bool | None = None
    #: Pids the operator vouches for: they cannot be inspected, but map no region. It matters
    #: only where no lease can be taken.
    assume_not_holding: frozenset[int] = frozenset()
    #: False judges from ``/proc``, locks and the owner record alone (``--no-lease``).
    use_lease: bool = True
    proc_root: Path = procfs.PROC_ROOT
    #: The families of files judged (``kvoffload.shm.families``): the offload regions unless
    #: told otherwise (``--family``). A name of no family listed here is never looked at.
    families: frozenset[str] = shm_families.DEFAULT

    def __post_init__(self) -> None:
        # Any collection of pids will do; held as a frozenset, so that options compare and hash.
        object.__setattr__(self, "assume_not_holding", frozenset(self.assume_not_holding))
        object.__setattr__(self, "families", shm_families.check(self.families))

    @classmethod
    def of(
        cls, options: ScanOptions | None, legacy: ScanKeywords, *, default: ScanOptions | None = None
    ) -> ScanOptions:
        """``options`` (else ``default``, else every default) with ``legacy``, the settings given
        as separate keywords, laid over it; an unknown keyword is a ``TypeError``."""
        base = options if options is not None else default if default is not None else cls()
        if not legacy:
            return base
        # Any collection of pids is taken here too: ``__post_init__`` makes it a frozenset.
        changes: dict[str, Any] = {**legacy}
        return dataclasses.replace(base, **changes)


#: Superseded by ``ScanOptions``; kept here for one release (issue #29).
class ScanKeywords(TypedDict, total=False):
    """The scan settings as separate keywords, as ``scan``, ``ScanStream``, ``reap`` and
    ``WatchConfig`` took them before ``ScanOptions``."""

    grace_s: float
    all_users: bool | None
    assume_not_holding: Collection[int]
    use_lease: bool
    proc_root: Path


@contextlib.contextmanager
def open_root(root: Path | str, root_fd: int | None = None) -> Iterator[int]:
    """A directory fd of the shm root; every error becomes a ``RootError`` with a fix.

    The root itself may be a symlink (``/dev/shm -> /run/shm`` on some systems): the
    operator names it. Entries inside it are never followed. An empty name is refused:
    the kernel would read it as the current directory.

    ``root_fd`` is a directory fd the caller already opened (and pinned: ``shmctl watch``
    opens each root without following any symlink below its glob's fixed part). It is
    duplicated, never reopened by path, so the scan and the reap act on that very directory
    whatever the path names by now; ``root`` is then only its name in the report.
    """
    if root_fd is not None:
        try:
            fd = os.dup(root_fd)
        except OSError as e:
            raise RootError(root, f"cannot use its directory fd: {e.strerror}") from None
        try:
            yield fd
        finally:
            os.close(fd)
        return
    if str(root) == "":
        raise ConfigError(
            "--root", "is empty (it would mean the current directory)", fix="pass --root /dev/shm"
        )
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


def scan(
    root: Path | str = DEFAULT_ROOT,
    options: ScanOptions | None = None,
    *,
    now: float | None = None,
    parallel: bool | None = None,
    holders: HolderIndex | None = None,
    root_fd: int | None = None,
    **legacy: Unpack[ScanKeywords],
) -> ScanReport:
    """Judge every ``vllm_offload_*.mmap[.N]`` entry of ``root`` (and every file of the other
    families ``options.families`` names) by ``options`` (``ScanOptions``: the grace period,
    whose files, the vouched pids, leases, the ``/proc`` to read, the families).

    ``parallel`` forces probing in a child beside the ``/proc`` pass (True) or after it
    (False); None lets ``prober`` decide from the CPUs, the threads and the number of files.
    ``holders`` is a ``/proc`` pass the caller already made (``shmctl watch`` makes one per
    pass for all its roots); it is used only if it covers every device of the root's files,
    else the scan makes its own. Its evidence is as old as that pass: the lease probes are
    not, and a reap proves each file dead again anyway. ``root_fd`` is the root's directory,
    already open (``open_root``): the scan then never resolves ``root`` by path.

    ``legacy``: the settings as separate keywords (``grace_s=0``), laid over ``options``;
    kept for one release (issue #29).
    """
    options = ScanOptions.of(options, legacy)
    grace_s = options.grace_s
    proc_root = options.proc_root
    if grace_s < 0:
        raise ConfigError("grace", f"must not be negative, got {grace_s:g}s")
    euid = os.geteuid()
    owners = Owners.of(options.all_users, euid)
    root = Path(root)
    with open_root(root, root_fd) as dir_fd, contextlib.ExitStack() as leasing:
        listed, park_names = list_regions(root, dir_fd, options.families)
        regions = Sorted.of(listed, owners)
        # Leases (and their watchdog, a process spawned once) only where a file will be probed:
        # a scan of an empty root (a node with no engine) spawns nothing.
        to_probe = regions.to_probe()
        unsafe = leasing.enter_context(lease.sigio_ignored()) if to_probe or park_names else None
        lease_off = (
            lease.DISABLED if not options.use_lease else None if unsafe is None else LeaseProbe(None, unsafe)
        )
        root_dev = os.fstat(dir_fd).st_dev
        devices = {root_dev} | {item.st.st_dev for item in listed}
        # The probes (open, lease, lock) and the /proc pass are independent: with a second
        # core, a child process probes while we walk /proc (see prober).
        probe = functools.partial(probe_file, dir_fd, lease_off=lease_off, euid=euid)
        if holders is not None and holders.covers(devices):
            index = holders
            with lease.batched():  # one lease after another: Ctrl-Z deferred from one to the next
                probes = {item.name: probe(item) for item in to_probe}
        else:
            with prober.start(to_probe, probe, parallel=parallel) as probing:
                index = collect_holders(proc_root, devices=devices, skip_pids=probing.pids)
                with lease.batched():
                    answers = probing.results()
                probes = {item.name: answer for item, answer in zip(to_probe, answers, strict=True)}
        view = ScannerView(
            index.blind_spots(options.assume_not_holding),
            visibility(proc_root),
        )
        when = time.time() if now is None else now
        entries = _judge(
            root, listed, regions, probes, index, view, when=when, grace_s=grace_s, host=Host.of(proc_root)
        )
        parks = JudgedParks()
        if park_names:
            parks = judge_parks(
                root,
                dir_fd,
                park_names,
                index,
                view,
                probe_args=(lease_off, euid),
                when=when,
                owners=owners,
                adopter=park.Adopter.of(options.all_users, euid),
            )
            entries = tuple(sorted(entries + parks.parked, key=lambda e: (e.engine_id, e.segment, e.name)))
    return ScanReport(
        schema_version=SCHEMA_VERSION,
        root=root,
        scanned_at=when,
        grace_s=float(grace_s),
        entries=entries,
        summary=ScanSummary.of(entries, len(index.uninspected)),
        uninspected=index.uninspected,
        deleted=tuple(d for d in index.deleted if d.dev == root_dev),
        assumed_not_holding=tuple(sorted(options.assume_not_holding)),
        visibility=view.visibility,
        lease_enabled=lease_off is None,
        huge_pages=mounts.check_huge_pages(root),
        parks=parks.parks,
        lease_break_time_s=lease.break_time_s(proc_root),
        untrusted_parks=parks.untrusted,
        families=shm_families.ordered(options.families),
    )


#: Files ``ScanStream`` judges at a time: their lstat results, probes and entries are all it
#: holds besides the root's names, so its memory does not grow with the root.
STREAM_CHUNK_FILES = 512


class ScanStream:
    """One root's scan, a region at a time: what ``shmctl watch`` reads instead of a report.

    ``scan`` returns every entry of the root at once, as ``scan --json`` prints them. An agent
    over a root of 100,000 files needs a summary and the regions it may remove, so it walks
    this instead: the root is listed once (names only, sorted so that the files of a region
    are adjacent), then judged ``STREAM_CHUNK_FILES`` files at a time (lstat, probes, verdict)
    on one ``/proc`` pass. The evidence and the verdicts are ``scan``'s; the caller keeps what
    it needs of each region and lets the rest go. Probes run here, one after the other (an
    agent passes the ``/proc`` pass it made for all its roots, or this makes one first).

    Use it as a context manager: it holds the root's directory fd (``open_root``) and keeps
    ``SIGIO`` ignored (``lease.sigio_ignored``) until it is closed, so a caller may remove
    what it judged through ``dir_fd`` while it goes on. ``parked()`` judges the park
    directories found in the listing; ``regions()`` yields every other region once, as the
    entries of its files (files that are ``skipped`` themselves included), by engine id.

    With ``walks`` (the agent's ``ProcWalks``) and ``holders`` its last walk, the stream is
    lease-first: each chunk is probed before anything else, and a region is judged without
    ``/proc`` when every file's lease answered: granted, with no holder at all (the lease
    proves it; the last walk's holders are never set against it), or refused, with the
    holders the last walk named there if they all still run. Anything else (a lease that
    could not be taken, a refused one the last walk did not name a running holder for, park
    directories, a device the last walk did not record) makes ``walks`` walk ``/proc`` once,
    and the rest of the root is judged on that walk as any stream is. What only a walk yields
    (``uninspected``, ``deleted``) is the last walk's until then. A refused file a walk named
    nobody for (``ProcWalks.unnamed``: its holder is out of this ``/proc``'s sight) needs no
    walk, and is judged with no holder, as that walk did. With ``walks`` and a walk of this
    pass (``walks.fresh``) the stream judges on it and tells ``walks`` which refused files it
    named nobody for.
    """

    def __init__(
        self,
        root: Path | str,
        options: ScanOptions | None = None,
        *,
        holders: HolderIndex | None = None,
        root_fd: int | None = None,
        now: float | None = None,
        walks: ProcWalks | None = None,
        **legacy: Unpack[ScanKeywords],
    ) -> None:
        #: ``legacy``: the settings as separate keywords, as ``scan`` takes them.
        self.options = options = ScanOptions.of(options, legacy)
        if options.grace_s < 0:
            raise ConfigError("grace", f"must not be negative, got {options.grace_s:g}s")
        self._euid = os.geteuid()
        self._owners = Owners.of(options.all_users, self._euid)
        self._adopter = park.Adopter.of(options.all_users, self._euid)
        self.root = Path(root)
        self._host: Host | None = None  # read when the first region is judged
        self._given = holders
        self._root_fd = root_fd
        self._now = now
        self._stack = contextlib.ExitStack()
        self.dir_fd = -1
        self.lease_enabled = options.use_lease
        self._lease_off: LeaseProbe | None = None
        self._names: list[str] = []
        self._park_names: list[str] = []
        self._root_dev = 0
        self._index: HolderIndex | None = None
        self._view: ScannerView | None = None
        #: Lease-first until this stream walks (None: judged on ``/proc`` as any stream).
        self._walks = walks if holders is not None and walks is not None and not walks.fresh else None
        #: Told which refused files a walk named nobody for.
        self._noting = walks
        #: When the last files were judged (``scan``'s ``scanned_at``).
        self.scanned_at = 0.0

    def __enter__(self) -> ScanStream:
        with contextlib.ExitStack() as stack:
            self.dir_fd = stack.enter_context(open_root(self.root, self._root_fd))
            unsafe = stack.enter_context(lease.sigio_ignored())
            if not self.options.use_lease:
                self._lease_off = lease.DISABLED
            elif unsafe is not None:
                self._lease_off = LeaseProbe(None, unsafe)
            self.lease_enabled = self._lease_off is None
            self._names, self._park_names = list_names(self.root, self.dir_fd, self.options.families)
            self._root_dev = os.fstat(self.dir_fd).st_dev
            if self._walks is not None and self._given is not None:
                # The last walk's, for what only a walk yields, until a region needs a walk.
                self._index = self._given
                if not self._given.covers({self._root_dev}):
                    self._walk("new_device")
            else:
                self._cover({self._root_dev})
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the root's fd and let ``SIGIO`` go back; idempotent."""
        self._stack.close()
        self._names = []

    @property
    def files(self) -> int:
        """Region-pattern names in the listing (park directories not included)."""
        return len(self._names)

    @property
    def index(self) -> HolderIndex:
        assert self._index is not None, "ScanStream is used inside its with block"
        return self._index

    @property
    def uninspected(self) -> tuple[Uninspected, ...]:
        return self.index.uninspected

    @property
    def deleted(self) -> tuple[DeletedMapping, ...]:
        """Unlinked region files of the root's filesystem still mapped or open."""
        return tuple(d for d in self.index.deleted if d.dev == self._root_dev)

    def _cover(self, devices: set[int]) -> None:
        """Use an index that records every file of ``devices``: the given one if it does, else
        a ``/proc`` pass of our own (over every device seen so far)."""
        index = self._index if self._index is not None else self._given
        if index is not None and index.covers(devices):
            if index is not self._index:
                self._index, self._view = index, None
            return
        wanted = set(devices)
        if index is not None and index.devices is not None:
            wanted |= index.devices
        self._index = collect_holders(self.options.proc_root, devices=wanted)
        self._view = None

    def _walk(self, reason: str, devices: Collection[int] = ()) -> HolderIndex:
        """The agent's walk for this pass (``ProcWalks.walk``); the rest is judged on it."""
        walks = self._walks
        assert walks is not None
        self._walks = None
        self._index = walks.walk(reason, {self._root_dev, *devices})
        self._view = None
        return self._index

    def _lease_view(self, regions: Sorted, probes: dict[str, Probe], devices: set[int]) -> HolderIndex:
        """The evidence to judge a chunk by: what the leases answered, or a walk made now.

        Granted files get no holder; refused ones the holders the last walk named there, if
        every one of them still runs. Where a lease gave no answer, or named nobody we can
        vouch for, ``/proc`` is walked (``ProcWalks``) and the chunk is judged on that.
        """
        walks = self._walks
        assert walks is not None
        last = self.index
        held: dict[FileKey, tuple[Holder, ...]] = {}
        for group in regions.groups.values():
            if group.skipped:
                continue  # skipped whole, on no evidence
            for m in group.members:
                answer = probes[m.name]
                if answer.problem == REMOVED or answer.lease.free:
                    continue
                if not answer.lease.held:
                    return self._walk("no_lease", devices)
                key = (m.st.st_dev, m.st.st_ino)
                named = last.holders.get(key, ()) if last.covers((key[0],)) else ()
                if named and walks.running(named):
                    held[key] = named
                elif not named and key in walks.unnamed:
                    walks.note_unnamed(key)  # as the walk that found it: held out of sight
                else:
                    return self._walk("holders_changed", devices)
        # Nobody can lock a file nobody has open; a refused lease decides before any lock does.
        return dataclasses.replace(last, holders=held, anonymous_locks=frozenset())

    def _note_unnamed(self, regions: Sorted, probes: dict[str, Probe], index: HolderIndex) -> None:
        """Tell the agent's ``walks`` the refused files this walk named no holder of, where the walk
        could miss one (processes it cannot see or read): with every process in sight, such a
        file was opened after the walk, and the next pass walks to name its holder."""
        noting = self._noting
        assert noting is not None
        view = self._scanner_view()
        if view.visibility.complete and not view.blind_spots:
            return
        for group in regions.groups.values():
            if group.skipped:
                continue
            for m in group.members:
                key = (m.st.st_dev, m.st.st_ino)
                if probes[m.name].lease.held and not index.holders.get(key):
                    noting.note_unnamed(key)

    def _scanner_view(self) -> ScannerView:
        if self._view is None:
            options = self.options
            self._view = ScannerView(
                self.index.blind_spots(options.assume_not_holding), visibility(options.proc_root)
            )
        return self._view

    def _when(self) -> float:
        self.scanned_at = time.time() if self._now is None else self._now
        return self.scanned_at

    def parked(self) -> JudgedParks:
        """The reapers' park directories in the root, a ``parked`` entry per file in them, and
        what is named like one but is not a reaper's."""
        if not self._park_names:
            return JudgedParks()
        if self._walks is not None:
            self._walk("parks")
        return judge_parks(
            self.root,
            self.dir_fd,
            self._park_names,
            self.index,
            self._scanner_view(),
            probe_args=(self._lease_off, self._euid),
            when=self._when(),
            owners=self._owners,
            adopter=self._adopter,
        )

    def regions(self) -> Iterator[tuple[ScanEntry, ...]]:
        """Each region of the root once, judged: its entries by segment, then name."""
        probe = functools.partial(probe_file, self.dir_fd, lease_off=self._lease_off, euid=self._euid)
        for chunk in chunks(self._names, STREAM_CHUNK_FILES):
            listed = stat_names(self.root, self.dir_fd, chunk)
            devices = {item.st.st_dev for item in listed}
            if self._walks is None:
                self._cover(devices)
            regions = Sorted.of(listed, self._owners)
            with lease.batched():  # one lease after another: Ctrl-Z deferred from one to the next
                probes = {item.name: probe(item) for item in regions.to_probe()}
            index = self.index if self._walks is None else self._lease_view(regions, probes, devices)
            if self._walks is None and self._noting is not None:
                self._note_unnamed(regions, probes, index)
            when = self._when()
            view = self._scanner_view()
            skipped: dict[tuple[str, str], list[Listed]] = {}
            for item in listed:
                if item.name in regions.skipped:
                    skipped.setdefault(item.unit, []).append(item)
            for unit, group in regions.groups.items():
                entries = [
                    entry_of(self.root, item, Status.SKIPPED, regions.skipped[item.name], when, index)
                    for item in skipped.get(unit, ())
                ]
                if self._host is None:
                    self._host = Host.of(self.options.proc_root)
                entries += _judge_group(
                    self.root, group, probes, index, view, when, self.options.grace_s, self._host
                )
                if entries:
                    entries.sort(key=lambda e: (e.segment, e.name))
                    yield tuple(entries)


def _judge(
    root: Path,
    listed: list[Listed],
    regions: Sorted,
    probes: dict[str, Probe],
    index: HolderIndex,
    view: ScannerView,
    *,
    when: float,
    grace_s: float,
    host: Host,
) -> tuple[ScanEntry, ...]:
    entries: list[ScanEntry] = []
    skipped = regions.skipped
    for item in listed:
        if item.name in skipped:
            entries.append(entry_of(root, item, Status.SKIPPED, skipped[item.name], when, index))
    for group in regions.groups.values():
        entries.extend(_judge_group(root, group, probes, index, view, when, grace_s, host))
    entries.sort(key=lambda e: (e.engine_id, e.segment, e.name))
    return tuple(entries)


def _judge_group(
    root: Path,
    group: Group,
    probes: dict[str, Probe],
    index: HolderIndex,
    view: ScannerView,
    when: float,
    grace_s: float,
    host: Host,
) -> list[ScanEntry]:
    if not group.members:
        return []
    if group.skipped:
        # A region is one unit: a file of it we may not judge (another uid's, a second hard
        # link) may be mapped by a live engine, so none of its files is ours to call dead.
        name, why = group.skipped[0]
        reason = f"another file of this region is skipped ({name}: {why})"
        return [entry_of(root, m, Status.SKIPPED, reason, when, index) for m in group.members]

    # Each member's probe looked up once, and its age computed once (the verdict's and its
    # entry's): at 10,000 one-file regions the judging cost more than the probes.
    probed = [(m, probes[m.name]) for m in group.members]
    probed = [(m, p) for m, p in probed if p.problem != REMOVED]
    if not probed:
        return []
    members = [m for m, _ in probed]
    base = None
    for m in members:
        if m.region.segment == 0:
            base = m
            break
    record = probes[base.name].owner if base is not None else None
    liveness = judge_owner(record, host=host) if record is not None else None
    evidence = []
    holders = index.holders
    anonymous = index.anonymous_locks
    ages = []
    for m, probe in probed:
        st = m.st
        key = (st.st_dev, st.st_ino)
        evidence.append(
            FileEvidence(
                m.name, holders.get(key, ()), probe.lock_held, probe.lease, key in anonymous, probe.problem
            )
        )
        ages.append(changed_s(st, when))
    verdict = decide(
        evidence,
        view,
        owner=liveness,
        base_empty=base is not None and base.st.st_size == 0,
        age=min(ages),
        grace_s=grace_s,
    )
    reason = verdict.reason
    if base is None:
        reason = f"segment without its base file; {reason}"
    owner_problem = probes[base.name].owner_problem if base is not None else None
    if owner_problem:
        reason = f"{reason}; {owner_problem}"
    owner = _owner_view(record, liveness) if record is not None and liveness is not None else None
    follows = f"follows its base file: {reason}"
    return [
        entry_of(
            root,
            m,
            verdict.status,
            reason if m is base or base is None else follows,
            when,
            index,
            owner=owner if m is base else None,
            probe=probe,
            decided_by=verdict.decided_by,
            removable_in_s=verdict.removable_in_s,
            changed_age_s=age,
        )
        for (m, probe), age in zip(probed, ages, strict=True)
    ]


def _owner_view(record: OwnerRecord, liveness: OwnerLiveness) -> OwnerView:
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
