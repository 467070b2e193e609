"""Watch every shm root of a node: scan each pass, reap only what stays orphaned two passes running.

One GPU node runs many engines, each pod's ``/dev/shm`` its own tmpfs (a Kubernetes
``emptyDir`` with ``medium: Memory``, under ``/var/lib/kubelet/pods/UID/volumes/...``). A
``Watcher`` matches its root globs every pass, scans every directory they match with the
same evidence as ``scan`` and, with ``reap``, removes the regions that were ``orphaned`` with
the very same ``(st_dev, st_ino)`` files in the previous pass too.

Invariants:

* Never reap on an old verdict. The previous pass only nominates; a root with nominations
  is judged on a ``/proc`` pass of its own, made at its turn, and a region goes only if this
  judgement finds it orphaned with the same files again; the removal is ``reap``'s, which
  locks each region and proves it dead once more under its lease before it unlinks.
* Memory does not grow with files or roots (docs/agent-memory.md). A root is judged a region
  at a time (``ScanStream``) and removed in batches as the judgement goes; what a pass keeps
  of a root is numbers (``RootScan``), and what the next pass needs is one bytes key per
  orphaned region (``_region_key``), never an entry.
* A region goes whole: it is nominated only when every file of it was orphaned, with the
  same identities, in both passes.
* A root's trouble is an event, never an exit: a root that cannot be read, one that
  vanishes mid-pass (its pod deleted, the tmpfs unmounted) or a ``/proc`` error ends that
  root's turn in this pass and the loop goes on. The state of a vanished root (its
  nominations, its series) is dropped, so memory stays flat while pods come and go.
* Stopping (``should_stop``) is honoured between roots and, inside a reap, between
  regions: what has begun is finished, nothing is left half-removed.
* Roots have borders (``docs/watch-roots.md``). A path the operator gave is resolved once,
  when the ``Watcher`` is made (``root_resolved`` says so where a symlink was in it); every
  pass opens it again with no symlink allowed anywhere in it. Below a glob's fixed part no
  symlink is followed at all: each component is listed and opened relative to its parent's
  fd with ``O_NOFOLLOW``, so a match that is a symlink (one an unprivileged user planted in
  a sticky world-writable directory, say) is never a root. The scan and the reap act on the
  root's directory fd (``root_fd``), never on its path again; one root is open at a time.
* A root is pinned by ``(st_dev, st_ino, mount id)`` when first seen: another directory at
  its path is a new root (``root_replaced``), and nothing nominated in the old one carries over.
* Removal happens only on a tmpfs or hugetlbfs unless ``any_filesystem``: elsewhere the
  root is scanned and ``removal_refused`` says why nothing goes.
* Judging is not removing. As root the agent judges every user's files (``scan``'s default),
  but removes a region with a file of another uid only with ``all_users=True``
  (``--all-users``); without it such an orphan stays, counted, never nominated, and
  ``kept_other_user`` says so once (again when its files change).
* Nothing is silent: a glob whose fixed part does not exist when the ``Watcher`` is made is a
  ``ConfigError`` naming the kubelet directories of the common distributions
  (``KUBELET_DIRECTORIES``); a glob that matches nothing in a pass is a ``root_no_match``
  event in that pass, every pass.
* ``on_pass`` (the metrics) records a pass before its ``pass`` event is emitted.

The loop is meant for the main thread: it enters ``lease.sigio_ignored()`` once for all its
passes (only the main thread may ignore ``SIGIO``). Elsewhere the scans run without leases,
fail-closed. A process with other threads (an HTTP server) probes serially (see ``prober``).

Events are values (the dataclasses below); the caller renders them. Nothing here prints.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import itertools
import os
import re
import stat
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Unpack

from kvoffload import syscalls
from kvoffload.errors import ConfigError, KvOffloadError, RootError
from kvoffload.liveness import lease, park
from kvoffload.liveness import reap as reaping
from kvoffload.liveness.holders import HolderIndex, collect_holders
from kvoffload.liveness.park import PARK_PREFIX
from kvoffload.liveness.scan import (
    DEFAULT_ROOT,
    ParkView,
    ScanEntry,
    ScanKeywords,
    ScanOptions,
    ScanStream,
    ScanSummary,
    Status,
    UntrustedPark,
    uids_text,
)
from kvoffload.shm import mounts

__all__ = [
    "DEFAULT_GRACE_S",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_SCAN",
    "DEFAULT_TOP_ENGINES",
    "KUBELET_ROOTS",
    "Event",
    "KeptOtherUser",
    "KeptParked",
    "KeptUnknown",
    "ParkRemoved",
    "ParkUntrusted",
    "ParkedSettled",
    "PassReport",
    "PassSummary",
    "RemovalFailed",
    "RemovalRefused",
    "Removed",
    "RemovedFile",
    "RootAppeared",
    "RootIdentity",
    "RootNoMatch",
    "RootPass",
    "RootReap",
    "RootReplaced",
    "RootResolved",
    "RootScan",
    "RootUnreadable",
    "RootVanished",
    "Usage",
    "WatchConfig",
    "Watcher",
    "pod_uid_of",
    "root_identity",
]

DEFAULT_INTERVAL_S = 60.0
#: Longer than scan's 30 s: an agent that reaps on its own should leave a slow start alone.
DEFAULT_GRACE_S = 600.0
#: Orphaned engines named per root (``--top-engines``); the rest are summed.
DEFAULT_TOP_ENGINES = 10
#: Every memory-backed emptyDir of every pod on a node, as the kubelet mounts them.
KUBELET_ROOTS = "/var/lib/kubelet/pods/*/volumes/kubernetes.io~empty-dir/*"
#: Where the kubelet keeps its pods (its ``--root-dir``) on the common distributions. k3s has
#: used the default since v0.10 (k3s-io/k3s#840), as RKE2 does; only older k3s used its own.
KUBELET_DIRECTORIES = (
    ("/var/lib/kubelet", "kubeadm, EKS, GKE, AKS, k3s, RKE2"),
    ("/var/lib/k0s/kubelet", "k0s"),
    ("/var/snap/microk8s/common/var/lib/kubelet", "MicroK8s"),
    ("/var/lib/rancher/k3s/agent/kubelet", "k3s before v0.10"),
)
_POD_UID = re.compile(r"/pods/([^/]+)/volumes/")
#: How long the loop sleeps at most before it looks at ``should_stop`` again.
_STOP_POLL_S = 0.05
#: A reaper's private park directories: never a root.
_PARK_PREFIX = PARK_PREFIX
#: A root itself: listed by the scan, so readable; never through a symlink.
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: A directory only passed through: search permission is enough, as for a path lookup.
_PASS_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def pod_uid_of(root: Path | str) -> str | None:
    """The pod UID of a kubelet volume path (``.../pods/<uid>/volumes/...``); None elsewhere."""
    match = _POD_UID.search(str(root))
    return match.group(1) if match else None


#: How the agent judges a root unless told otherwise: ``scan``'s defaults, with its own grace.
DEFAULT_SCAN = ScanOptions(grace_s=DEFAULT_GRACE_S)


@dataclass(frozen=True, slots=True, init=False)
class WatchConfig:
    """What to watch and how; validated before anything is scanned.

    ``scan`` is how every root is judged (``ScanOptions``, grace ``DEFAULT_GRACE_S``). Its
    ``all_users`` is whose files are judged, as ``scan``'s (None: every user's as root); only
    True removes another user's (``--all-users``). The settings given as separate keywords
    (``grace_s=0``) are laid over ``scan``, kept for one release (issue #29).
    """

    roots: tuple[str, ...]
    interval_s: float
    reap: bool
    scan: ScanOptions
    #: Remove on any filesystem, not only a tmpfs or hugetlbfs (``--any-filesystem``).
    any_filesystem: bool
    #: Orphaned engines a root's ``RootScan`` names (the largest); the rest are one sum.
    top_engines: int

    def __init__(
        self,
        roots: tuple[str, ...] = (str(DEFAULT_ROOT),),
        interval_s: float = DEFAULT_INTERVAL_S,
        reap: bool = False,
        *,
        scan: ScanOptions | None = None,
        any_filesystem: bool = False,
        top_engines: int = DEFAULT_TOP_ENGINES,
        **legacy: Unpack[ScanKeywords],
    ) -> None:
        # A frozen dataclass's own __init__ sets its fields so too.
        object.__setattr__(self, "roots", roots)
        object.__setattr__(self, "interval_s", interval_s)
        object.__setattr__(self, "reap", reap)
        object.__setattr__(self, "scan", ScanOptions.of(scan, legacy, default=DEFAULT_SCAN))
        object.__setattr__(self, "any_filesystem", any_filesystem)
        object.__setattr__(self, "top_engines", top_engines)
        self._check()

    def _check(self) -> None:
        if not self.roots:
            raise ConfigError("--root", "no root to watch", fix="pass --root /dev/shm")
        for pattern in self.roots:
            _check_pattern(pattern)
        if self.interval_s < 0:
            raise ConfigError("--interval", f"must not be negative, got {self.interval_s:g}s")
        if self.scan.grace_s < 0:
            raise ConfigError("--grace", f"must not be negative, got {self.scan.grace_s:g}s")
        if self.top_engines < 0:
            raise ConfigError("--top-engines", f"must not be negative, got {self.top_engines}")
        if self.scan.all_users and os.geteuid() != 0:
            raise ConfigError(
                "--all-users",
                "only root may judge other users' files",
                fix="run as root, or drop --all-users",
            )

    # The scan settings as they were read before ``scan`` held them: kept here for one
    # release (issue #29).

    @property
    def grace_s(self) -> float:
        return self.scan.grace_s

    @property
    def all_users(self) -> bool | None:
        return self.scan.all_users

    @property
    def assume_not_holding(self) -> frozenset[int]:
        return self.scan.assume_not_holding

    @property
    def use_lease(self) -> bool:
        return self.scan.use_lease

    @property
    def proc_root(self) -> Path:
        return self.scan.proc_root


def _check_pattern(pattern: str) -> None:
    example = f"pass /dev/shm or a glob such as {KUBELET_ROOTS}"
    if not pattern.strip():
        raise ConfigError("--root", "is empty (it would mean the current directory)", fix=example)
    if "\0" in pattern:
        raise ConfigError("--root", f"{pattern!r} holds a NUL byte", fix=example)
    if not pattern.startswith("/"):
        # An agent's working directory means nothing: a relative glob would watch whatever it is.
        raise ConfigError("--root", f"{pattern!r} is not an absolute path", fix=example)
    names = _components(pattern)
    if any(name.startswith(_PARK_PREFIX) for name in names):
        raise ConfigError(
            "--root",
            f"{pattern!r} names a reaper's private park directory ({_PARK_PREFIX}*), never a root",
            fix=example,
        )
    fixed = _fixed_length(names)
    if ".." in names[fixed:]:
        # Below the fixed part every component is opened relative to its parent: ".." would
        # climb out of what the glob matched.
        raise ConfigError(
            "--root",
            f"{pattern!r} has '..' below its first glob character",
            fix="write the path without '..'",
        )


def _check_fixed_part(pattern: _Pattern) -> None:
    """A glob's fixed part must be a directory when the agent starts."""
    try:
        st = os.stat(pattern.target)
    except FileNotFoundError:
        kubelets = ", ".join(f"{path} ({which})" for path, which in KUBELET_DIRECTORIES)
        raise ConfigError(
            "--root",
            f"{pattern.text!r}: {pattern.fixed} does not exist, so the glob can never match",
            fix=f"use this node's kubelet directory (its --root-dir): {kubelets}",
        ) from None
    except OSError:
        return  # there but not searchable: told every pass as root_no_match
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(
            "--root",
            f"{pattern.text!r}: {pattern.fixed} is not a directory",
            fix="pass a glob whose leading components name a directory",
        )


def _components(path: str) -> list[str]:
    """The names of an absolute path, without the empty and ``.`` ones."""
    return [name for name in path.split("/") if name not in ("", ".")]


def _fixed_length(names: list[str]) -> int:
    """How many leading names hold no glob character: a glob's fixed part (all of a plain path)."""
    return next((i for i, name in enumerate(names) if glob.has_magic(name)), len(names))


@dataclass(frozen=True, slots=True)
class _Step:
    """One component of a glob below its fixed part."""

    name: str
    #: The component's glob, compiled once; None for a plain name (opened as it is).
    match: re.Pattern[str] | None

    @classmethod
    def of(cls, name: str) -> _Step:
        return cls(name, re.compile(fnmatch.translate(name)) if glob.has_magic(name) else None)

    def select(self, listed: list[str]) -> list[str]:
        """The listed names this component matches, sorted; glob's rule for hidden names:
        ``*``, ``?`` and ``[...]`` match a leading dot only in a component that starts with one."""
        if self.match is None:
            return [self.name]
        hidden = self.name.startswith(".")
        return sorted(n for n in listed if (hidden or not n.startswith(".")) and self.match.match(n))


@dataclass(frozen=True, slots=True)
class _Pattern:
    """One ``--root``: its fixed part, resolved once at start, and the glob components below it."""

    #: The fixed part as given: a plain root whole, or a glob's leading components without magic.
    fixed: Path
    #: The fixed part as ``realpath`` resolved it when the ``Watcher`` was made, as names from ``/``.
    resolved: tuple[str, ...]
    steps: tuple[_Step, ...]
    #: The ``--root`` as given, for ``root_no_match``.
    text: str = ""

    @classmethod
    def of(cls, text: str) -> _Pattern:
        """The pattern of ``text``; a ``ConfigError`` for a glob whose fixed part is missing.

        A plain root may be missing (it is reported every pass until it appears); a glob whose
        fixed part is missing is another node layout, and would match nothing, silently, forever.
        """
        names = _components(text)
        n = _fixed_length(names)
        fixed = Path("/", *names[:n])
        resolved = tuple(_components(os.path.realpath(fixed)))
        pattern = cls(fixed, resolved, tuple(_Step.of(name) for name in names[n:]), text)
        if not pattern.literal:
            _check_fixed_part(pattern)
        return pattern

    @property
    def literal(self) -> bool:
        return not self.steps

    @property
    def target(self) -> Path:
        return Path("/", *self.resolved)


@dataclass(frozen=True, slots=True)
class _Match:
    """A root found in this pass: its name, and how to open it again without following a symlink."""

    path: Path
    pattern: _Pattern
    #: Its names below the pattern's fixed part (none for a plain root).
    below: tuple[str, ...]
    #: Its ``st_dev`` when matched, for the pass's one ``/proc`` walk; None when it could not be read.
    dev: int | None


class _PathError(Exception):
    """A component of a root's path could not be opened (``symlink``: because it is a symlink)."""

    def __init__(self, where: Path, error: OSError, *, symlink: bool) -> None:
        super().__init__(f"{where}: {error.strerror or error}")
        self.where = where
        self.error = error
        self.symlink = symlink

    @property
    def gone(self) -> bool:
        """Nothing at the name, or no directory there any more: a glob no longer matches it."""
        return self.symlink or self.error.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)


class _Gone(Exception):
    """A glob's match is no longer a directory there (removed, or replaced by a symlink or file)."""


def _open_below(fd: int, base: Path, names: tuple[str, ...], flags: int) -> int:
    """Open ``names`` (one or more) one by one below ``fd`` (the directory ``base``), never
    through a symlink.

    Every component is opened relative to the one before it with ``O_NOFOLLOW``: the
    kernel then refuses a symlink at each of them, which a path lookup would follow
    anywhere but in its last component. The last is opened with ``flags``.
    """
    current = fd
    where = base
    try:
        for depth, name in enumerate(names, 1):
            where = where / name
            try:
                opened = os.open(name, flags if depth == len(names) else _PASS_FLAGS, dir_fd=current)
            except OSError as e:
                raise _PathError(where, e, symlink=_is_symlink(current, name)) from None
            if current != fd:
                os.close(current)
            current = opened
    except BaseException:
        if current != fd:
            os.close(current)
        raise
    return current


def _open_absolute(names: tuple[str, ...], flags: int) -> int:
    """Open ``/`` + ``names`` with no symlink allowed anywhere in the path."""
    try:
        top = os.open("/", _PASS_FLAGS if names else flags)
    except OSError as e:
        raise _PathError(Path("/"), e, symlink=False) from None
    if not names:
        return top
    try:
        return _open_below(top, Path("/"), names, flags)
    finally:
        os.close(top)


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _walk(
    fd: int, steps: tuple[_Step, ...], below: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], int]]:
    """The directories ``steps`` match below ``fd``, as (names, ``st_dev``); never through a symlink.

    One fd per level is open at a time. What cannot be listed or opened matches nothing, as
    for ``glob``; neither does a symlink, a file, or a reaper's park directory.
    """
    step, rest = steps[0], steps[1:]
    if step.match is None:
        names = [step.name]
    else:
        try:
            names = step.select(os.listdir(fd))
        except OSError:
            return
    for name in names:
        if name.startswith(_PARK_PREFIX):
            continue
        if not rest:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                yield (*below, name), st.st_dev
            continue
        try:
            child = os.open(name, _ROOT_FLAGS if rest[0].match is not None else _PASS_FLAGS, dir_fd=fd)
        except OSError:
            continue  # gone, a file, or a symlink (O_NOFOLLOW): nothing below it is a root
        try:
            yield from _walk(child, rest, (*below, name))
        finally:
            os.close(child)


def _root_error(root: Path, error: _PathError) -> RootError:
    e = error.error
    if error.symlink:
        return RootError(
            root,
            f"{error.where} is a symbolic link: not followed (a root's path is resolved once, at start)",
            fix="restart the agent to resolve the path again, or pass the directory itself as --root",
        )
    if e.errno == errno.ENOENT:
        return RootError(root, "does not exist", fix="pass an existing directory as --root")
    if e.errno == errno.ENOTDIR:
        return RootError(root, f"{error.where} is not a directory", fix="pass a directory as --root")
    if e.errno in (errno.EACCES, errno.EPERM):
        return RootError(root, "permission denied", fix="run as root, or as the user that owns the regions")
    return RootError(root, f"cannot open {error.where}: {e.strerror or e}")


def root_identity(fd: int) -> RootIdentity:
    """The identity of the directory open as ``fd``: its inode and the mount it is reached through."""
    st = os.fstat(fd)
    return RootIdentity(st.st_dev, st.st_ino, syscalls.mount_id(fd))


def _filesystem_type(fd: int, mount_id: int | None, mountinfo: Path = mounts.MOUNTINFO) -> str:
    """What ``fd``'s filesystem is, for a person: its type in the mount table, else its magic number."""
    if mount_id is not None:
        with contextlib.suppress(OSError):
            for mount in mounts.parse_mountinfo(mountinfo.read_bytes()):
                if mount.mount_id == mount_id:
                    return mount.fs_type
    magic = mounts.filesystem_magic(fd)
    return "an unknown filesystem" if magic is None else f"filesystem magic {magic:#x}"


@dataclass(frozen=True, slots=True)
class Usage:
    """Size and free bytes of a root's filesystem (what ``shutil.disk_usage`` gives)."""

    total: int
    free: int


@dataclass(frozen=True, slots=True)
class Event:
    """Something an operator's log should show; ``event`` names its kind."""

    event: ClassVar[str]
    time: float
    root: Path | None
    pod_uid: str | None


@dataclass(frozen=True, slots=True)
class RootAppeared(Event):
    event: ClassVar[str] = "root_appeared"


@dataclass(frozen=True, slots=True)
class RootVanished(Event):
    event: ClassVar[str] = "root_vanished"


@dataclass(frozen=True, slots=True)
class RootUnreadable(Event):
    """The root could not be scanned; told once per spell (again when the error changes)."""

    event: ClassVar[str] = "root_unreadable"
    error: str = ""


@dataclass(frozen=True, slots=True)
class RootIdentity:
    """What a root is, whatever its path names later: its directory's inode and its mount."""

    dev: int
    ino: int
    #: The mount's id (``statx``'s ``STATX_MNT_ID``, or ``/proc/self/fdinfo``); None if neither tells.
    mnt_id: int | None


@dataclass(frozen=True, slots=True)
class RootNoMatch(Event):
    """A ``--root`` glob matched no directory this pass; told every pass it matches none.
    ``root`` and ``pod_uid`` are null: there is no root, only the ``pattern``."""

    event: ClassVar[str] = "root_no_match"
    pattern: str = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class RootResolved(Event):
    """A path the operator gave (a plain root, or a glob's fixed part) held a symlink or ``..``:
    resolved once, when the agent started, to ``target``; told once. What ``target`` names
    is what is watched, and never through a symlink again."""

    event: ClassVar[str] = "root_resolved"
    target: Path = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class RootReplaced(Event):
    """Another directory is at the root's path now (``old`` and ``new`` differ): a new root,
    whose nominations start over."""

    event: ClassVar[str] = "root_replaced"
    old: RootIdentity = field(kw_only=True)
    new: RootIdentity = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class RemovalRefused(Event):
    """With ``--reap``, a root not on a tmpfs or hugetlbfs: scanned, nothing removed. Told once
    per spell (again when the reason changes)."""

    event: ClassVar[str] = "removal_refused"
    reason: str = field(kw_only=True)


@dataclass(frozen=True, slots=True)
class Removed(Event):
    """One engine's region files removed; ``bytes`` is the resident memory freed."""

    event: ClassVar[str] = "removed"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0


@dataclass(frozen=True, slots=True)
class KeptUnknown(Event):
    """A region nobody could prove dead or alive: kept. Told when it becomes unknown."""

    event: ClassVar[str] = "kept_unknown"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class KeptOtherUser(Event):
    """With ``reap``, an orphaned region with a file of another uid: judged dead, but removed only
    with ``all_users=True`` (``--all-users``). Told when it becomes orphaned (or its files change)."""

    event: ClassVar[str] = "kept_other_user"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0
    #: The owners of its files that are not the agent's uid.
    uids: tuple[int, ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ParkedSettled(Event):
    """Files a dead reaper left parked (docs/reap-protocol.md), given back their names
    (``action`` ``restored``: in use, or not provably dead), or left parked because their
    name was taken meanwhile (``conflict``: both files kept). Those proven dead are removed,
    and told as ``removed``."""

    event: ClassVar[str] = "parked"
    engine_id: str = ""
    action: str = ""
    bytes: int = 0
    files: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RemovalFailed(Event):
    """Orphaned files the agent should have removed and could not, for a failure of its own (an
    errno; a root out of inodes where others may rename): kept, with the reason. Told each
    time it happens."""

    event: ClassVar[str] = "removal_failed"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class KeptParked(Event):
    """With ``reap``, an orphaned region not nominated because files of it (same engine, same
    owner) wait in a reaper's park directory: removed once they are settled. Told when it
    starts (again if its files change)."""

    event: ClassVar[str] = "kept_parked"
    engine_id: str = ""
    bytes: int = 0
    files: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ParkUntrusted(Event):
    """An entry named like a reaper's park directory that is not one (docs/reap-protocol.md:
    the trust rules): never entered, renamed or removed, and nothing in it holds back a
    region. Told once per entry (again if its owner, mode or reason changes)."""

    event: ClassVar[str] = "park_untrusted"
    name: str = ""
    kind: str = ""
    uid: int = 0
    mode: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ParkRemoved(Event):
    """A park directory a dead reaper left, emptied (or never finished), removed."""

    event: ClassVar[str] = "park_removed"
    name: str = ""


@dataclass(frozen=True, slots=True)
class PassSummary(Event):
    """The end of a pass: ``orphaned_bytes`` is what orphans still pin after it."""

    event: ClassVar[str] = "pass"
    roots: int = 0
    orphaned_bytes: int = 0
    removed_files: int = 0
    seconds: float = 0.0
    errors: int = 0


@dataclass(frozen=True, slots=True)
class RootScan:
    """What a pass keeps of one root's scan: numbers, never its entries.

    It shows the root as the pass left it: a file removed in the pass is not counted, a file
    the removal kept is counted under the verdict the removal found, and what a dead reaper
    left parked is counted where its settling put it. Its size does not depend on the number
    of files: a root of 100,000 files is as small here as an empty one.
    """

    root: Path
    scanned_at: float
    #: Files and bytes per verdict, as ``scan``'s summary counts them.
    summary: ScanSummary
    #: Resident bytes (st_blocks*512) per verdict, every ``Status`` a key.
    resident_bytes: Mapping[Status, int]
    #: The ``top_engines`` engines whose orphaned files pin most memory: (engine id, bytes),
    #: largest first, ties by engine id. ``orphaned_other_bytes`` is the rest, together.
    orphaned_engines: tuple[tuple[str, int], ...] = ()
    orphaned_other_bytes: int = 0
    #: Apparent size of the largest region (base and segments, any verdict).
    region_size_max: int = 0
    #: Bytes of unlinked region files of the root's filesystem still mapped or open.
    unlinked_mapped_bytes: int = 0
    #: Regions per verdict, as scan's table counts its rows: an engine's files that share a
    #: verdict are one region (a base and its segments), under each verdict its files have.
    regions: Mapping[Status, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RemovedFile:
    """A region file a pass removed, by its name in the root."""

    name: str


@dataclass(frozen=True, slots=True)
class RootReap:
    """What a pass removed in one root; the ``removed`` and ``parked`` events tell it by engine."""

    removed: tuple[RemovedFile, ...] = ()
    #: Resident memory of the removed files (st_blocks*512): what the root's mount got back.
    freed_bytes: int = 0
    #: Files a dead reaper left parked that got their names back, and that stay parked because
    #: their name was taken (``ParkedSettled``).
    restored: int = 0
    conflicts: int = 0


@dataclass(frozen=True, slots=True)
class RootPass:
    """One root's turn in a pass: the scan that shows the disk as the pass left it, or the error."""

    root: Path
    pod_uid: str | None
    attempted_at: float
    scan_seconds: float
    report: RootScan | None = None
    usage: Usage | None = None
    error: RootError | None = None
    #: When the root was last scanned successfully (this pass, or an earlier one).
    last_success: float | None = None
    #: What this pass removed, when something was nominated (or a dead reaper's park settled).
    reaped: RootReap | None = None


@dataclass(frozen=True, slots=True)
class PassReport:
    """What one pass did. ``vanished`` roots had series before and have none now."""

    number: int
    started_at: float
    seconds: float
    matched: int
    roots: tuple[RootPass, ...]
    vanished: tuple[Path, ...]
    summary: PassSummary
    stopped: bool = False


#: No region (``_RootState``'s sets, shared by every root that has none).
_NO_REGIONS: frozenset[bytes] = frozenset()


@dataclass(slots=True)
class _RootState:
    """What a root's next pass needs from this one; dropped when the root vanishes.

    Regions are remembered by ``_region_key`` (engine id and the identities of its files, in
    one bytes object): a root of 100,000 orphans is a few MiB of keys, not its entries.
    """

    pod_uid: str | None
    #: Regions orphaned in the last pass, every file of them (kept only where removal is allowed).
    orphaned: frozenset[bytes] = _NO_REGIONS
    #: Regions told ``kept_unknown`` in the last pass (told again only when one changes).
    unknown: frozenset[bytes] = _NO_REGIONS
    #: Regions told ``kept_other_user`` in the last pass (likewise).
    others: frozenset[bytes] = _NO_REGIONS
    #: Regions told ``kept_parked`` in the last pass (likewise).
    held: frozenset[bytes] = _NO_REGIONS
    #: Look-alike park directories told ``park_untrusted`` in the last pass (likewise).
    untrusted: frozenset[bytes] = _NO_REGIONS
    error: str | None = None
    last_success: float | None = None
    #: The directory first seen at the root's path (pinned: another one there is a new root).
    identity: RootIdentity | None = None
    #: Why removal is refused here, as last told (None while removal is allowed).
    refused: str | None = None


class Watcher:
    """The pass loop; ``run`` from the main thread, or ``run_pass`` one pass at a time."""

    def __init__(
        self,
        config: WatchConfig,
        *,
        on_event: Callable[[Event], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._on_event = on_event
        self._should_stop = should_stop or (lambda: False)
        self._clock = clock
        self._monotonic = monotonic
        self._roots: dict[Path, _RootState] = {}
        # Resolved once, here: every pass opens what these name, never through a symlink.
        self._patterns = tuple(_Pattern.of(p) for p in config.roots)
        self._resolutions = {
            pattern.fixed: pattern.target for pattern in self._patterns if pattern.target != pattern.fixed
        }
        self.passes = 0
        self._holders: HolderIndex | None = None
        #: Whose regions may be removed: the agent's uid's, or (``all_users``) everyone's.
        self._remover = None if config.scan.all_users else os.geteuid()

    @property
    def watched(self) -> tuple[Path, ...]:
        """The roots matched in the last pass (and not vanished since)."""
        return tuple(self._roots)

    def run(
        self, *, max_passes: int | None = None, on_pass: Callable[[PassReport], None] | None = None
    ) -> int:
        """Pass every ``interval_s`` (from the start of one to the next) until stopped; the passes done.

        ``on_pass`` gets each pass's report before its ``pass`` event is emitted (``run_pass``).
        """
        done = 0
        with lease.sigio_ignored():
            while not self._should_stop():
                started = self._monotonic()
                report = self.run_pass(on_pass=on_pass)
                done += 1
                if report.stopped or (max_passes is not None and done >= max_passes):
                    break
                self._sleep_until(started + self.config.interval_s)
        return done

    def _sleep_until(self, deadline: float) -> None:
        while not self._should_stop():
            left = deadline - self._monotonic()
            if left <= 0:
                return
            time.sleep(min(left, _STOP_POLL_S))

    def run_pass(self, *, on_pass: Callable[[PassReport], None] | None = None) -> PassReport:
        """One pass over every root. ``on_pass`` (the metrics) records the report before the
        ``pass`` event is emitted: whoever reads that event and then scrapes sees this pass."""
        self.passes += 1
        started_at = self._clock()
        started = self._monotonic()
        if self.passes == 1:
            for given, target in self._resolutions.items():
                self._emit(RootResolved(self._clock(), given, pod_uid_of(given), target=target))
        # The fixed part of each glob, open for the pass: its matches are found and opened
        # again below this very directory. One fd per pattern, one more per root being scanned.
        with contextlib.ExitStack() as bases_open:
            bases = self._open_bases(bases_open)
            matched = self._match(bases)
            present = {m.path for m in matched}
            vanished = [root for root in self._roots if root not in present]
            for root in vanished:
                self._vanish(root)
            for m in matched:
                if m.path not in self._roots:
                    state = self._roots[m.path] = _RootState(pod_uid_of(m.path))
                    self._emit(RootAppeared(self._clock(), m.path, state.pod_uid))
            results: list[RootPass] = []
            stopped = False
            # One /proc pass for every root: a node with 100 pod volumes reads each process once a
            # pass, not once a root. Each root's scan checks that it covers its files' devices.
            self._holders = self._pass_holders(matched)
            for m in matched:
                if self._should_stop():
                    stopped = True
                    break
                result = self._watch_root(m, bases)
                if result is None:
                    vanished.append(m.path)
                else:
                    results.append(result)
            self._holders = None  # evidence of this pass only
        seconds = self._monotonic() - started
        summary = PassSummary(
            self._clock(),
            None,
            None,
            roots=len(matched),
            orphaned_bytes=sum(r.report.summary.orphaned_resident_bytes for r in results if r.report),
            removed_files=sum(len(r.reaped.removed) for r in results if r.reaped is not None),
            seconds=seconds,
            errors=sum(1 for r in results if r.error is not None),
        )
        report = PassReport(
            self.passes, started_at, seconds, len(matched), tuple(results), tuple(vanished), summary, stopped
        )
        if on_pass is not None:
            on_pass(report)
        self._emit(summary)
        return report

    def _emit(self, event: Event) -> None:
        if self._on_event is not None:
            self._on_event(event)

    def _vanish(self, root: Path) -> None:
        state = self._roots.pop(root)
        self._emit(RootVanished(self._clock(), root, state.pod_uid))

    def _open_bases(self, stack: contextlib.ExitStack) -> dict[_Pattern, int]:
        """Each glob's fixed part, as resolved at start, opened with no symlink in its path.

        One that cannot be opened matches nothing this pass, as a glob whose directory is
        missing matches nothing.
        """
        bases: dict[_Pattern, int] = {}
        for pattern in self._patterns:
            if pattern.literal or pattern in bases:
                continue
            flags = _ROOT_FLAGS if pattern.steps[0].match is not None else _PASS_FLAGS
            with contextlib.suppress(_PathError):
                bases[pattern] = _open_absolute(pattern.resolved, flags)
                stack.callback(os.close, bases[pattern])
        return bases

    def _match(self, bases: dict[_Pattern, int]) -> list[_Match]:
        """The roots of this pass, in order, each once.

        A plain root is a root whether or not it exists (a missing ``/dev/shm`` is an error to
        report, not a root that went away); a glob names the directories it matches (a
        deleted pod's volume simply stops matching), never a symlink nor anything below one.
        A glob that matches nothing is told (``root_no_match``) every pass it does not.
        """
        found: dict[Path, _Match] = {}
        for pattern in self._patterns:
            if pattern.literal:
                if pattern.fixed not in found:
                    found[pattern.fixed] = _Match(pattern.fixed, pattern, (), _device(pattern.resolved))
                continue
            base = bases.get(pattern)
            matches = 0
            for below, dev in _walk(base, pattern.steps) if base is not None else ():
                matches += 1
                path = pattern.fixed.joinpath(*below)
                if path not in found:
                    found[path] = _Match(path, pattern, below, dev)
            if not matches:
                self._emit(RootNoMatch(self._clock(), None, None, pattern=pattern.text))
        return list(found.values())

    def _pass_holders(self, matched: list[_Match]) -> HolderIndex | None:
        devices = {m.dev for m in matched if m.dev is not None}
        if not devices:
            return None
        try:
            return collect_holders(self.config.scan.proc_root, devices=devices)
        except OSError:
            return None  # each root's scan then walks /proc itself and reports what fails

    @contextlib.contextmanager
    def _opened(self, match: _Match, bases: dict[_Pattern, int]) -> Iterator[int]:
        """The root's directory, opened with no symlink on the way; closed when its turn ends.

        Raises ``_Gone`` for a glob's match that is no directory there any more, a
        ``RootError`` for a root that is there and cannot be opened.
        """
        try:
            if match.pattern.literal:
                fd = _open_absolute(match.pattern.resolved, _ROOT_FLAGS)
            else:
                fd = _open_below(bases[match.pattern], match.pattern.fixed, match.below, _ROOT_FLAGS)
        except _PathError as error:
            if not match.pattern.literal and error.gone:
                raise _Gone from None
            raise _root_error(match.path, error) from None
        try:
            yield fd
        finally:
            os.close(fd)

    def _still_matches(self, match: _Match, bases: dict[_Pattern, int]) -> bool:
        try:
            with self._opened(match, bases):
                return True
        except _Gone:
            return False
        except RootError:
            return True

    def _watch_root(self, match: _Match, bases: dict[_Pattern, int]) -> RootPass | None:
        """Scan (and reap) one root; None when it vanished under us."""
        root = match.path
        state = self._roots[root]
        attempted_at = self._clock()
        started = self._monotonic()
        tally = _Tally(self.config.top_engines)
        try:
            with self._opened(match, bases) as fd:
                self._pin(root, state, fd)
                removable = self._may_remove(root, state, fd)
                scanned = self._judge(root, state, fd, tally, removable=removable)
                usage = _usage(root, fd)
        except _Gone:
            self._vanish(root)  # no directory at the name any more: the glob does not match it
            return None
        except (KvOffloadError, OSError) as error:
            if not match.pattern.literal and not self._still_matches(match, bases):
                self._vanish(root)  # a pod deleted, its volume unmounted and removed mid-pass
                return None
            problem = _as_root_error(root, error)
            if problem.message != state.error:
                state.error = problem.message
                text = problem.message.removeprefix(f"{root}: ")
                self._emit(RootUnreadable(self._clock(), root, state.pod_uid, error=text))
            state.orphaned = _NO_REGIONS  # a gap in the evidence: nominations start over
            return RootPass(
                root,
                state.pod_uid,
                attempted_at,
                self._monotonic() - started,
                error=problem,
                last_success=state.last_success,
                reaped=tally.reaped(),
            )
        state.error = None
        state.last_success = scanned.scanned_at
        return RootPass(
            root,
            state.pod_uid,
            attempted_at,
            self._monotonic() - started,
            report=scanned,
            usage=usage,
            last_success=state.last_success,
            reaped=tally.reaped(),
        )

    def _judge(self, root: Path, state: _RootState, fd: int, tally: _Tally, *, removable: bool) -> RootScan:
        """Judge the root a region at a time (``ScanStream``), remove what was orphaned with the
        same files in the last pass too, and keep only numbers and the next nominations.

        A region goes to the library's removal (``reap``'s, which locks it and proves it dead
        again under its lease) in batches as the stream reaches it; nothing but the batch at
        hand and the keys of the regions is held, however many files the root has.
        """
        config = self.config
        before = state.orphaned
        # Where something may be removed, the verdicts rest on a /proc pass made now: the pass's
        # one walk for every root can be minutes old by the time a root's turn comes.
        fresh = removable and bool(before)
        orphaned: set[bytes] = set()
        unknown: set[bytes] = set()
        others: set[bytes] = set()
        held: set[bytes] = set()
        untrusted: set[bytes] = set()
        pending: list[tuple[ScanEntry, ...]] = []
        pending_files = 0
        with ScanStream(root, config.scan, holders=None if fresh else self._holders, root_fd=fd) as stream:
            judged = stream.parked()
            parks, parked = judged.parks, judged.parked
            self._tell_untrusted(root, state, judged.untrusted, untrusted)
            # What a dead reaper left parked is settled every pass (a live file must get its name
            # back now; a dead one was proven dead before it was parked, and is proven dead again
            # under its lease before it goes). A region with files parked (in a trusted park: no
            # other is even listed) is not nominated, if they are its own: same engine and owner.
            waiting = _parked_by(parked)
            if removable and any(p.running is False for p in parks) and not self._should_stop():
                self._settle(root, state, stream, parks, parked, tally)
            else:
                for entries in _by_engine(parked).values():
                    tally.count(entries)
            for region in stream.regions():
                if removable and all(e.status is Status.ORPHANED for e in region):
                    key = _region_key(region)
                    foreign = self._foreign_uids(region)
                    waits = _waiting_for(region, waiting)
                    if foreign:
                        self._tell_other_user(root, state, region, key, foreign, others)
                    elif waits:
                        self._tell_held(root, state, region, key, waits, held)
                        orphaned.add(key)
                    elif key in before and not self._should_stop():
                        pending.append(region)
                        pending_files += len(region)
                        if pending_files >= _REMOVAL_BATCH_FILES:
                            self._remove(root, state, stream, pending, tally, orphaned)
                            pending, pending_files = [], 0
                        continue
                    else:
                        orphaned.add(key)
                elif any(e.status is Status.UNKNOWN for e in region):
                    self._tell_unknown(root, state, region, unknown)
                tally.count(region)
            if pending:
                self._remove(root, state, stream, pending, tally, orphaned)
            scanned = tally.scan(root, stream)
        # Most roots have neither: one shared empty set, not two new ones per root and pass.
        state.orphaned = frozenset(orphaned) if orphaned else _NO_REGIONS
        state.unknown = frozenset(unknown) if unknown else _NO_REGIONS
        state.others = frozenset(others) if others else _NO_REGIONS
        state.held = frozenset(held) if held else _NO_REGIONS
        state.untrusted = frozenset(untrusted) if untrusted else _NO_REGIONS
        return scanned

    def _tell_held(
        self,
        root: Path,
        state: _RootState,
        region: tuple[ScanEntry, ...],
        key: bytes,
        waits: list[ScanEntry],
        told: set[bytes],
    ) -> None:
        """``kept_parked`` for an orphaned region whose own files wait parked, once."""
        told.add(key)
        if key in state.held:
            return
        first = waits[0]
        assert first.parked is not None
        state_word = "its reaper runs" if first.parked.reaper_running else "its reaper is dead"
        self._emit(
            KeptParked(
                self._clock(),
                root,
                state.pod_uid,
                engine_id=region[0].engine_id,
                bytes=sum(e.resident_bytes for e in region),
                files=len(region),
                reason=(
                    f"orphaned, but {len(waits)} file(s) of its region wait in {first.parked.directory} "
                    f"({state_word}): removed once they are settled"
                ),
            )
        )

    def _tell_untrusted(
        self, root: Path, state: _RootState, found: Sequence[UntrustedPark], told: set[bytes]
    ) -> None:
        """``park_untrusted`` for each look-alike park directory, once while it stays as it is."""
        for u in found:
            key = "\0".join((u.name, u.kind, str(u.uid), u.mode, u.reason)).encode("utf-8", "surrogatepass")
            told.add(key)
            if key in state.untrusted:
                continue
            self._emit(
                ParkUntrusted(
                    self._clock(),
                    root,
                    state.pod_uid,
                    name=u.name,
                    kind=u.kind,
                    uid=u.uid,
                    mode=u.mode,
                    reason=u.reason,
                )
            )

    def _foreign_uids(self, region: Sequence[ScanEntry]) -> tuple[int, ...]:
        """The uids of the region's files that keep it from being removed (none with ``all_users``)."""
        if self._remover is None:
            return ()
        return tuple(sorted({e.uid for e in region if e.uid != self._remover}))

    def _tell_other_user(
        self,
        root: Path,
        state: _RootState,
        region: tuple[ScanEntry, ...],
        key: bytes,
        uids: tuple[int, ...],
        told: set[bytes],
    ) -> None:
        """``kept_other_user`` for another user's orphaned region, once (again if its files change)."""
        told.add(key)
        if key in state.others:
            return
        owners = uids_text(uids)
        self._emit(
            KeptOtherUser(
                self._clock(),
                root,
                state.pod_uid,
                engine_id=region[0].engine_id,
                bytes=sum(e.resident_bytes for e in region),
                files=len(region),
                uids=uids,
                reason=f"orphaned, owned by {owners}: another user's region is removed only with --all-users",
            )
        )

    def _remove(
        self,
        root: Path,
        state: _RootState,
        stream: ScanStream,
        regions: list[tuple[ScanEntry, ...]],
        tally: _Tally,
        orphaned: set[bytes],
    ) -> None:
        """Remove nominated regions (``reap``'s protocol) and count what the removal kept."""
        # ``reap`` itself would scan the whole root again and hold every entry of it; its
        # removal takes the regions this stream has just judged, each proven dead again.
        done = reaping.remove_regions(
            stream.dir_fd,
            [list(r) for r in regions],
            self.config.scan.proc_root,
            self.config.scan.assume_not_holding,
            self._should_stop,
        )
        self._tell_removed(root, state, done.removed, tally)
        self._tell_failed(root, state, done.failed)
        for engine_id, entries in _by_engine(_still_there(stream.dir_fd, done.kept)).items():
            if all(e.status is Status.ORPHANED for e in entries):
                orphaned.add(_region_key(entries))  # kept as it was (stopped, say): next pass
            # The proof can find what the scan could not see (a file that cannot be opened now).
            unknown = [e for e in entries if e.status is Status.UNKNOWN]
            if unknown:
                self._emit(
                    KeptUnknown(
                        self._clock(),
                        root,
                        state.pod_uid,
                        engine_id=engine_id,
                        bytes=sum(e.resident_bytes for e in unknown),
                        files=len(unknown),
                        reason=unknown[0].reason,
                    )
                )
            tally.count(entries)

    def _settle(
        self,
        root: Path,
        state: _RootState,
        stream: ScanStream,
        parks: tuple[ParkView, ...],
        parked: tuple[ScanEntry, ...],
        tally: _Tally,
    ) -> None:
        """Settle what dead reapers left parked, as ``reap`` does before it removes anything."""
        dead = tuple(e for e in parked if e.parked is not None and not e.parked.reaper_running)
        done = reaping.Outcome()
        with park.ParkDir(stream.dir_fd, proc_root=self.config.scan.proc_root) as parking:
            reaping.settle_parked(
                stream.dir_fd,
                dead,
                parks=[p for p in parks if p.running is False],
                parking=parking,
                adopter=park.Adopter(os.geteuid(), self._remover is None),
                remove_engines=lambda engine_id: True,
                remove_others=self._remover is None,
                use_lease=stream.lease_enabled,
                outcome=done,
            )
        conflicts = [e for e in done.kept if e.status is Status.PARKED]
        for action, settled in (("restored", done.restored), ("conflict", conflicts)):
            for engine_id, entries in _by_engine(settled).items():
                self._emit(
                    ParkedSettled(
                        self._clock(),
                        root,
                        state.pod_uid,
                        engine_id=engine_id,
                        action=action,
                        bytes=sum(e.resident_bytes for e in entries),
                        files=len(entries),
                        reason=entries[0].reason,
                    )
                )
        for name in done.parks_removed:
            self._emit(ParkRemoved(self._clock(), root, state.pod_uid, name=name))
        tally.restored += len(done.restored)
        tally.conflicts += len(conflicts)
        tally.settled = True
        self._tell_removed(root, state, done.removed, tally)
        self._tell_failed(root, state, done.failed)
        # Given back, a file is at its name again; a conflict waits parked; the rest as judged.
        left = [e for e in parked if e.parked is None or e.parked.reaper_running]
        for entries in _by_engine([*done.restored, *conflicts, *left]).values():
            tally.count(entries)

    def _tell_failed(self, root: Path, state: _RootState, failed: Sequence[ScanEntry]) -> None:
        """``kept_unknown`` is for evidence; a file the agent failed on is told as ``removal_failed``."""
        for engine_id, entries in _by_engine(failed).items():
            self._emit(
                RemovalFailed(
                    self._clock(),
                    root,
                    state.pod_uid,
                    engine_id=engine_id,
                    bytes=sum(e.resident_bytes for e in entries),
                    files=len(entries),
                    reason=entries[0].reason,
                )
            )

    def _tell_removed(self, root: Path, state: _RootState, removed: list[ScanEntry], tally: _Tally) -> None:
        for engine_id, entries in _by_engine(removed).items():
            freed = sum(e.resident_bytes for e in entries)
            self._emit(
                Removed(
                    self._clock(), root, state.pod_uid, engine_id=engine_id, bytes=freed, files=len(entries)
                )
            )
            tally.remove(entries)

    def _tell_unknown(
        self, root: Path, state: _RootState, region: tuple[ScanEntry, ...], told: set[bytes]
    ) -> None:
        """``kept_unknown`` for a region that became unknown (or changed files since it was told)."""
        key = _region_key(region)
        told.add(key)
        if key in state.unknown:
            return  # told already, and nothing about it changed
        reason = next((e.reason for e in region if e.segment == 0), region[0].reason)
        self._emit(
            KeptUnknown(
                self._clock(),
                root,
                state.pod_uid,
                engine_id=region[0].engine_id,
                bytes=sum(e.resident_bytes for e in region),
                files=len(region),
                reason=reason,
            )
        )

    def _pin(self, root: Path, state: _RootState, fd: int) -> None:
        """Hold the root to the directory first seen at its path; another one there is a new root."""
        identity = root_identity(fd)
        if state.identity is not None and identity != state.identity:
            self._emit(RootReplaced(self._clock(), root, state.pod_uid, old=state.identity, new=identity))
            # Nothing seen in the old directory carries over: two passes over this one first.
            state.orphaned = _NO_REGIONS
            state.unknown = _NO_REGIONS
            state.others = _NO_REGIONS
        state.identity = identity

    def _may_remove(self, root: Path, state: _RootState, fd: int) -> bool:
        """Whether this pass may remove anything in the root; a refusal is told once per spell."""
        config = self.config
        if not config.reap:
            return False
        if config.any_filesystem or mounts.memory_filesystem(fd) is not None:
            state.refused = None
            return True
        kind = _filesystem_type(fd, state.identity.mnt_id if state.identity else None)
        reason = (
            f"not on a tmpfs or hugetlbfs ({kind}): region files are removed only where they live; "
            "scanned, nothing removed (pass --any-filesystem to remove anyway)"
        )
        if reason != state.refused:
            state.refused = reason
            self._emit(RemovalRefused(self._clock(), root, state.pod_uid, reason=reason))
        return False


#: Files handed to the removal at once: whole regions, about ``reap``'s own batch.
_REMOVAL_BATCH_FILES = reaping.MAX_BATCH_FILES


class _Tally:
    """One root's numbers, added up a region at a time as the pass leaves it (``RootScan``)."""

    def __init__(self, top_engines: int) -> None:
        self.files = dict.fromkeys(Status, 0)
        self.regions = dict.fromkeys(Status, 0)
        self.resident = dict.fromkeys(Status, 0)
        self.orphaned_size = 0
        self.region_size_max = 0
        self.top_engines = top_engines
        #: Candidates for the named engines, as (-bytes, engine id): at most twice the names kept.
        self._engines: list[tuple[int, str]] = []
        self._other = 0
        self.removed: list[RemovedFile] = []
        self.freed = 0
        self.restored = 0
        self.conflicts = 0
        #: A dead reaper's park was settled (the pass reaped, even if nothing went).
        self.settled = False
        self._reaped = False

    def count(self, entries: Sequence[ScanEntry]) -> None:
        """One engine's files as they stand after the pass."""
        size = 0
        orphaned: int | None = None
        for e in entries:
            self.files[e.status] += 1
            self.resident[e.status] += e.resident_bytes
            size += e.size_bytes
            if e.status is Status.ORPHANED:
                orphaned = (orphaned or 0) + e.resident_bytes
                self.orphaned_size += e.size_bytes
        for status in {e.status for e in entries}:
            self.regions[status] += 1
        self.region_size_max = max(self.region_size_max, size)
        if orphaned is not None:
            self._engines.append((-orphaned, entries[0].engine_id))
            if len(self._engines) > 2 * self.top_engines + 64:
                self._trim()

    def remove(self, entries: Sequence[ScanEntry]) -> None:
        self._reaped = True
        self.removed.extend(RemovedFile(e.name) for e in entries)
        self.freed += sum(e.resident_bytes for e in entries)

    def _trim(self) -> None:
        self._engines.sort()
        self._other += sum(-minus for minus, _ in self._engines[self.top_engines :])
        del self._engines[self.top_engines :]

    def reaped(self) -> RootReap | None:
        if not (self._reaped or self.settled):
            return None
        return RootReap(tuple(self.removed), self.freed, self.restored, self.conflicts)

    def scan(self, root: Path, stream: ScanStream) -> RootScan:
        self._trim()
        files, resident = self.files, self.resident
        summary = ScanSummary(
            total=sum(files.values()),
            live=files[Status.LIVE],
            orphaned=files[Status.ORPHANED],
            starting=files[Status.STARTING],
            unknown=files[Status.UNKNOWN],
            skipped=files[Status.SKIPPED],
            orphaned_size_bytes=self.orphaned_size,
            orphaned_resident_bytes=resident[Status.ORPHANED],
            resident_bytes=sum(b for status, b in resident.items() if status is not Status.SKIPPED),
            uninspected_processes=len(stream.uninspected),
            unknown_resident_bytes=resident[Status.UNKNOWN],
            parked=files[Status.PARKED],
            parked_resident_bytes=resident[Status.PARKED],
        )
        return RootScan(
            root=root,
            scanned_at=stream.scanned_at or time.time(),
            summary=summary,
            resident_bytes=dict(resident),
            orphaned_engines=tuple((engine_id, -minus) for minus, engine_id in self._engines),
            orphaned_other_bytes=self._other,
            region_size_max=self.region_size_max,
            unlinked_mapped_bytes=sum(d.mapped_bytes for d in stream.deleted),
            regions=dict(self.regions),
        )


def _by_engine(entries: Iterable[ScanEntry]) -> dict[str, list[ScanEntry]]:
    groups: dict[str, list[ScanEntry]] = {}
    for e in entries:
        groups.setdefault(e.engine_id, []).append(e)
    return groups


def _parked_by(parked: Iterable[ScanEntry]) -> dict[tuple[str, int], list[ScanEntry]]:
    """Parked files by (engine id, owner uid): a region is held back by the files of its own."""
    found: dict[tuple[str, int], list[ScanEntry]] = {}
    for e in parked:
        found.setdefault((e.engine_id, e.uid), []).append(e)
    return found


def _waiting_for(
    region: Sequence[ScanEntry], parked: Mapping[tuple[str, int], list[ScanEntry]]
) -> list[ScanEntry]:
    """The parked files that are ``region``'s own: its engine id, and an owner of its files."""
    if not parked:
        return []
    engine_id = region[0].engine_id
    return [p for uid in sorted({e.uid for e in region}) for p in parked.get((engine_id, uid), ())]


def _region_key(entries: Sequence[ScanEntry]) -> bytes:
    """A region in one bytes object: its engine id, NUL, and its files' ``(st_dev, st_ino)``
    sorted. Equal keys: the same engine with exactly the same files (no id holds a NUL)."""
    identities = sorted(e.identity for e in entries)
    packed = struct.pack(f"<{2 * len(identities)}Q", *itertools.chain.from_iterable(identities))
    return entries[0].engine_id.encode("utf-8", "surrogatepass") + b"\0" + packed


def _still_there(dir_fd: int, kept: list[ScanEntry]) -> list[ScanEntry]:
    """The kept entries whose file is still at its name (a file someone else removed meanwhile is
    not counted); a parked conflict waits in its park directory, and is."""
    there = []
    for e in kept:
        if e.status is Status.PARKED:
            there.append(e)
            continue
        try:
            st = os.stat(e.name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == e.identity:
            there.append(e)
    return there


def _usage(root: Path, fd: int) -> Usage:
    """What ``shutil.disk_usage`` gives, read from the root's fd (never its path again)."""
    try:
        vfs = os.fstatvfs(fd)
    except OSError as e:
        raise RootError(root, f"cannot read its filesystem's size: {e.strerror or e}") from None
    return Usage(vfs.f_blocks * vfs.f_frsize, vfs.f_bavail * vfs.f_frsize)


def _device(names: tuple[str, ...]) -> int | None:
    """``st_dev`` of ``/`` + ``names``, opened with no symlink on the way; None if it cannot be."""
    try:
        fd = _open_absolute(names, _PASS_FLAGS)
    except _PathError:
        return None
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def _as_root_error(root: Path, error: BaseException) -> RootError:
    if isinstance(error, RootError):
        return error
    if isinstance(error, OSError):
        return RootError(root, f"{error.strerror or error}")
    return RootError(root, str(error))
