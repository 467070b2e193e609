"""A root's region files as a scan meets them: listed, lstat'ed, sorted into regions to judge.

Everything goes through a directory fd of the root with ``follow_symlinks=False``: a name is
listed and ``lstat``ed, never followed and never opened here (``probe`` opens a file, once,
to gather its own evidence). The names are sorted so that the files of a region (a base
file plus segments ``.mmap.N``) are adjacent, and each region is sorted into what is ours to
judge and what is ``skipped``, with the reason:

* symlinks (never followed), non-regular files, files with more than one link;
* other users' files where we may not judge them. Root judges every user's files (``ps``,
  ``lsof`` and ``ipcs`` show root everything too); any other user judges only its own, since
  it can prove another user's file neither dead nor alive (``Owners``).

A region is one unit: any file of it that is skipped keeps the whole group (a segment mapped
by a live engine keeps its base alive, and vice versa). Names of park directories are
listed apart, for ``park``.

Which names are listed is the scan's ``families`` (``kvoffload.shm.families``): the offload
regions unless told otherwise. A file of another family is a unit of its own, grouped under
its family and name, so it never shares a verdict with an offload region.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.errors import ConfigError, RootError
from kvoffload.liveness import park
from kvoffload.shm import families as shm_families
from kvoffload.shm import names

__all__ = [
    "Group",
    "Listed",
    "Owners",
    "Sorted",
    "child_path",
    "chunks",
    "file_kind",
    "list_names",
    "list_regions",
    "stat_names",
    "uids_text",
]


@dataclass(frozen=True, slots=True)
class Listed:
    """An entry of the root (or of a park directory) named like a region file, and its ``lstat``."""

    name: str
    region: names.RegionName
    st: os.stat_result
    #: Its family (``kvoffload.shm.families``): ``offload`` for a region file.
    family: str = shm_families.OFFLOAD

    @property
    def unit(self) -> tuple[str, str]:
        """What its verdict is shared with: its family's files of the same engine id."""
        return (self.family, self.region.engine_id)


@dataclass(frozen=True, slots=True)
class Owners:
    """Whose files are judged, from ``all_users`` and the caller's euid.

    ``all_users`` None (the default): every user's files as root, the caller's own otherwise.
    True: every user's, and only root may ask (a ``ConfigError`` for anyone else, as
    ``--all-users`` always was). False: the caller's own only, root included (``--own-only``).
    """

    #: The uids whose files are judged; None for every uid.
    uids: frozenset[int] | None
    #: Why a file of any other uid is skipped.
    why_not: str = ""

    @classmethod
    def of(cls, all_users: bool | None, euid: int) -> Owners:
        if all_users and euid != 0:
            raise ConfigError(
                "all_users", "only root may judge other users' files", fix="run as root, or drop --all-users"
            )
        if euid != 0:
            # Another user's file can be proven neither dead (no lease on it without CAP_LEASE)
            # nor alive (its holders' /proc is closed to us): judging it would only say unknown.
            return cls(frozenset({euid}), "only root can judge another user's file")
        if all_users is False:
            return cls(frozenset({euid}), "judging your own files only: --own-only")
        return cls(None)


Families = frozenset[str]
#: A name as listed: its sort key (engine id, segment), the name, its unit and family.
_Keyed = tuple[str, int, str, names.RegionName, str]


def list_names(
    root: Path, dir_fd: int, families: Families = shm_families.DEFAULT
) -> tuple[list[str], list[str]]:
    """The root's names of ``families``, the files of each region adjacent (by engine id, then
    segment), and the names of park directories. Names only: 100,000 of them are a few MiB."""
    keyed, park_names = _list_keyed(root, dir_fd, families)
    return [name for _, _, name, _, _ in keyed], park_names


def _list_keyed(root: Path, dir_fd: int, families: Families) -> tuple[list[_Keyed], list[str]]:
    """``list_names``, each name with its sort key and what it parsed to."""
    try:
        entry_names = os.listdir(dir_fd)
    except OSError as e:
        denied = e.errno in (errno.EACCES, errno.EPERM)
        fix = "run as root or the regions' owner" if denied else "check the root's filesystem (dmesg)"
        raise RootError(root, f"cannot list: {e.strerror}", fix=fix) from None
    keyed = []
    park_names = []
    for name in entry_names:
        found = shm_families.parse(name, families)
        if found is None:
            if park.is_park_name(name):
                park_names.append(name)
        else:
            family, region = found
            keyed.append((region.engine_id, region.segment, name, region, family))
    del entry_names
    # Sorted by name alone, the files of one engine can be apart: "E.mmap-x" (another engine's
    # base) sorts between "E.mmap" and "E.mmap.1". Names are unique: regions are never compared.
    keyed.sort()
    return keyed, sorted(park_names)


#: A listed name to ``lstat``: the name, its unit, its family.
Named = tuple[str, names.RegionName, str]


def chunks(region_names: list[str], size: int) -> Iterator[list[Named]]:
    """``region_names`` (sorted by ``list_names``) in runs of about ``size``, never splitting a region."""
    chunk: list[Named] = []
    for name in region_names:
        family, region = _parsed(name)
        if len(chunk) >= size and region.engine_id != chunk[-1][1].engine_id:
            yield chunk
            chunk = []
        chunk.append((name, region, family))
    if chunk:
        yield chunk


def stat_names(root: Path, dir_fd: int, chunk: list[Named]) -> list[Listed]:
    listed = []
    for name, region, family in chunk:
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed since the listing
        except PermissionError:
            raise RootError(
                root, "permission denied on its entries", fix="the directory needs search (x) permission"
            ) from None
        listed.append(Listed(name, region, st, family))
    return listed


def list_regions(
    root: Path, dir_fd: int, families: Families = shm_families.DEFAULT
) -> tuple[list[Listed], list[str]]:
    """The entries of ``families`` in the root (lstat'ed), and the names of park directories."""
    keyed, park_names = _list_keyed(root, dir_fd, families)
    named = [(name, region, family) for _, _, name, region, family in keyed]
    return stat_names(root, dir_fd, named), park_names


def _parsed(name: str) -> tuple[str, names.RegionName]:
    # The families' patterns are disjoint: a listed name parses to the family it was listed as.
    found = shm_families.parse(name)
    assert found is not None  # listed because it parses
    return found


_KINDS = {
    stat.S_IFREG: "file",
    stat.S_IFLNK: "symlink",
    stat.S_IFDIR: "directory",
    stat.S_IFIFO: "fifo",
    stat.S_IFSOCK: "socket",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
}


def file_kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "unknown type")


def _skip_reason(item: Listed, owners: Owners) -> str | None:
    st = item.st
    kind = file_kind(st.st_mode)
    if kind == "symlink":
        return "symlink: never followed"
    if kind != "file":
        return f"{kind}: not a region file"
    if st.st_nlink > 1:
        return f"{st.st_nlink} hard links: another name shares this inode"
    if owners.uids is not None and st.st_uid not in owners.uids:
        return f"owned by uid {st.st_uid}, not you ({owners.why_not})"
    return None


@dataclass(slots=True)
class Group:
    """The files of one engine's region that are ours to judge, and their shared evidence."""

    engine_id: str
    members: list[Listed] = field(default_factory=list)
    family: str = shm_families.OFFLOAD
    skipped: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Sorted:
    """The listing sorted into regions: what to probe, what is skipped and why."""

    #: By ``Listed.unit``: family and engine id.
    groups: dict[tuple[str, str], Group]
    skipped: dict[str, str]

    @classmethod
    def of(cls, listed: list[Listed], owners: Owners) -> Sorted:
        groups: dict[tuple[str, str], Group] = {}
        skipped: dict[str, str] = {}
        for item in listed:
            group = groups.get(item.unit)
            if group is None:
                group = groups[item.unit] = Group(item.region.engine_id, family=item.family)
            reason = _skip_reason(item, owners)
            if reason is not None:
                skipped[item.name] = reason
                group.skipped.append((item.name, reason))
            else:
                group.members.append(item)
        return cls(groups, skipped)

    def to_probe(self) -> list[Listed]:
        """Files of regions none of whose files is skipped: the only ones we open."""
        return [m for g in self.groups.values() if not g.skipped for m in g.members]


def child_path(root: Path, name: str) -> Path:
    """``root / name`` for a name from ``listdir`` (no slash to parse): a fifth of the judging
    time of a 10,000-file scan went to pathlib re-parsing names it had just been given."""
    make = getattr(root, "_make_child_relpath", None)
    return make(name) if make is not None else root / name


def uids_text(uids: Sequence[int]) -> str:
    """``uid 1000`` or ``uids 1000, 1001``: the owners a message names."""
    return f"uid {uids[0]}" if len(uids) == 1 else "uids " + ", ".join(map(str, uids))
