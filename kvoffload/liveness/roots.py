"""The roots an agent watches: ``--root`` patterns, the directories they match, and what a root is.

A ``--root`` is a plain directory or a glob of them (``KUBELET_ROOTS``: every pod's memory
volume on a node). Roots have borders (``docs/watch-roots.md``):

* A path the operator gave is resolved once, when the agent starts (``Pattern.of``); every
  pass opens it again with no symlink allowed anywhere in it (``open_absolute``).
* Below a glob's fixed part no symlink is followed at all: each component is listed and
  opened relative to its parent's fd with ``O_NOFOLLOW`` (``walk``, ``open_below``), so a
  match that is a symlink (one an unprivileged user planted in a sticky world-writable
  directory, say) is never a root, and neither is a reaper's park directory.
* A glob whose fixed part does not exist when the agent starts is a ``ConfigError`` naming
  the kubelet directories of the common distributions (``KUBELET_DIRECTORIES``): it would
  match nothing, silently, forever.
* A root is pinned by ``root_identity``: its directory's inode and the mount it is reached
  through (``RootIdentity``), so that another directory at its path is a new root.

Nothing here scans: ``watch`` opens each root through these functions and hands its fd on.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import glob
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvoffload import syscalls
from kvoffload.errors import ConfigError, RootError
from kvoffload.liveness.park import PARK_PREFIX
from kvoffload.shm import mounts

__all__ = [
    "KUBELET_DIRECTORIES",
    "KUBELET_ROOTS",
    "Gone",
    "Match",
    "Pattern",
    "RootIdentity",
    "check_pattern",
    "device_of",
    "filesystem_type",
    "open_bases",
    "opened",
    "pod_uid_of",
    "root_identity",
    "still_matches",
    "walk",
]

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
#: A root itself: listed by the scan, so readable; never through a symlink.
_ROOT_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: A directory only passed through: search permission is enough, as for a path lookup.
_PASS_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def pod_uid_of(root: Path | str) -> str | None:
    """The pod UID of a kubelet volume path (``.../pods/<uid>/volumes/...``); None elsewhere."""
    match = _POD_UID.search(str(root))
    return match.group(1) if match else None


@dataclass(frozen=True, slots=True)
class RootIdentity:
    """What a root is, whatever its path names later: its directory's inode and its mount."""

    dev: int
    ino: int
    #: The mount's id (``statx``'s ``STATX_MNT_ID``, or ``/proc/self/fdinfo``); None if neither tells.
    mnt_id: int | None


def check_pattern(pattern: str) -> None:
    """A ``ConfigError`` for a ``--root`` that could name no root, or more than what it matches."""
    example = f"pass /dev/shm or a glob such as {KUBELET_ROOTS}"
    if not pattern.strip():
        raise ConfigError("--root", "is empty (it would mean the current directory)", fix=example)
    if "\0" in pattern:
        raise ConfigError("--root", f"{pattern!r} holds a NUL byte", fix=example)
    if not pattern.startswith("/"):
        # An agent's working directory means nothing: a relative glob would watch whatever it is.
        raise ConfigError("--root", f"{pattern!r} is not an absolute path", fix=example)
    names = _components(pattern)
    if any(name.startswith(PARK_PREFIX) for name in names):
        raise ConfigError(
            "--root",
            f"{pattern!r} names a reaper's private park directory ({PARK_PREFIX}*), never a root",
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


def _check_fixed_part(pattern: Pattern) -> None:
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
class Pattern:
    """One ``--root``: its fixed part, resolved once at start, and the glob components below it."""

    #: The fixed part as given: a plain root whole, or a glob's leading components without magic.
    fixed: Path
    #: The fixed part as ``realpath`` resolved it when the ``Watcher`` was made, as names from ``/``.
    resolved: tuple[str, ...]
    steps: tuple[_Step, ...]
    #: The ``--root`` as given, for ``root_no_match``.
    text: str = ""

    @classmethod
    def of(cls, text: str) -> Pattern:
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
class Match:
    """A root found in this pass: its name, and how to open it again without following a symlink."""

    path: Path
    pattern: Pattern
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


class Gone(Exception):
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


def walk(
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
        if name.startswith(PARK_PREFIX):
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
            yield from walk(child, rest, (*below, name))
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


def filesystem_type(fd: int, mount_id: int | None, mountinfo: Path = mounts.MOUNTINFO) -> str:
    """What ``fd``'s filesystem is, for a person: its type in the mount table, else its magic number."""
    if mount_id is not None:
        with contextlib.suppress(OSError):
            for mount in mounts.parse_mountinfo(mountinfo.read_bytes()):
                if mount.mount_id == mount_id:
                    return mount.fs_type
    magic = mounts.filesystem_magic(fd)
    return "an unknown filesystem" if magic is None else f"filesystem magic {magic:#x}"


def device_of(names: tuple[str, ...]) -> int | None:
    """``st_dev`` of ``/`` + ``names``, opened with no symlink on the way; None if it cannot be."""
    try:
        fd = _open_absolute(names, _PASS_FLAGS)
    except _PathError:
        return None
    try:
        return os.fstat(fd).st_dev
    finally:
        os.close(fd)


def open_bases(patterns: Iterable[Pattern], stack: contextlib.ExitStack) -> dict[Pattern, int]:
    """Each glob's fixed part, as resolved at start, opened with no symlink in its path; closed
    by ``stack``.

    One that cannot be opened matches nothing this pass, as a glob whose directory is
    missing matches nothing.
    """
    bases: dict[Pattern, int] = {}
    for pattern in patterns:
        if pattern.literal or pattern in bases:
            continue
        flags = _ROOT_FLAGS if pattern.steps[0].match is not None else _PASS_FLAGS
        with contextlib.suppress(_PathError):
            bases[pattern] = _open_absolute(pattern.resolved, flags)
            stack.callback(os.close, bases[pattern])
    return bases


@contextlib.contextmanager
def opened(match: Match, bases: dict[Pattern, int]) -> Iterator[int]:
    """The root's directory, opened with no symlink on the way; closed when its turn ends.

    Raises ``Gone`` for a glob's match that is no directory there any more, a
    ``RootError`` for a root that is there and cannot be opened.
    """
    try:
        if match.pattern.literal:
            fd = _open_absolute(match.pattern.resolved, _ROOT_FLAGS)
        else:
            fd = _open_below(bases[match.pattern], match.pattern.fixed, match.below, _ROOT_FLAGS)
    except _PathError as error:
        if not match.pattern.literal and error.gone:
            raise Gone from None
        raise _root_error(match.path, error) from None
    try:
        yield fd
    finally:
        os.close(fd)


def still_matches(match: Match, bases: dict[Pattern, int]) -> bool:
    try:
        with opened(match, bases):
            return True
    except Gone:
        return False
    except RootError:
        return True
