"""How a scan report shows park directories, the files waiting in them, and look-alikes.

``ParkView`` is a trusted park directory (``trust.judge``), ``ParkedView`` what becomes of a
file in one, ``UntrustedPark`` an entry named like a park that is not a reaper's. They are
values of ``ScanReport`` (``parks``, ``untrusted_parks``) and ``ScanEntry`` (``parked``),
serialised as they are for ``scan --json``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.liveness.verdict import Status

__all__ = ["ParkView", "ParkedView", "UntrustedPark"]


@dataclass(frozen=True, slots=True)
class ParkedView:
    """A file a reaper moved into its park directory (``park``), and what becomes of it.

    ``action``: ``left to its reaper`` (its reaper runs: it removes the file or gives it
    back itself), ``restore`` (in use, or not provably dead: ``reap`` renames it back to its
    name), ``remove`` (proven dead: ``reap`` removes it, as its region), ``conflict`` (not
    provably dead and its name now holds another file, ``name_taken_by``: both are kept,
    nothing is removed; see the reap protocol in docs).
    """

    directory: str
    reaper_pid: int | None
    reaper_start_ticks: int | None
    reaper_running: bool
    #: What the evidence says of the file itself (no grace period: it was proven dead once).
    verdict: Status
    action: str
    #: ``(st_dev, st_ino)`` of whatever holds the original name now, if anything does.
    name_taken_by: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class ParkView:
    """A reaper's park directory in the root (``.shmctl-park-<pid>-<start ticks>-<random>``),
    trusted as one (``park.judge``: its name, owner, mode 0700, mount and its reaper's mark)."""

    name: str
    uid: int
    reaper_pid: int | None
    reaper_start_ticks: int | None
    #: True while its lock is held (its reaper, or another reap adopting it, is at work).
    running: bool | None
    files: int
    problem: str | None = None
    #: Empty and unmarked, the caller's own: a reaper killed as it made or removed it. ``reap``
    #: removes it.
    unfinished: bool = False
    #: Entries in it that no reaper of ours parks (other names; files of another uid in a park
    #: that is not root's): never touched, and they keep the directory.
    strangers: int = 0


@dataclass(frozen=True, slots=True)
class UntrustedPark:
    """An entry named like a park directory that is not a reaper's (``park.judge``): never
    entered, renamed or removed. Listed so that nothing can hide behind one."""

    name: str
    #: ``directory``, ``symlink``, ``file``, ``fifo``, ``socket`` or ``device``.
    kind: str
    uid: int
    #: Its permission bits in octal, as ``ls`` and ``chmod`` write them (``"0755"``).
    mode: str
    reason: str
