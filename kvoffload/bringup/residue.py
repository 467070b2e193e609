"""What a bring-up left behind: files in the root, handles in a process, threads and sockets.

Residue is measured in the root after every participant has exited: the files named after
this engine's id (nothing else is looked at), their apparent size and their resident bytes
(``st_blocks * 512``, what tmpfs charges). A participant also looks at itself after its
release: the fds and mappings of the region it still has (``held_handles``: they die with
the process, so they are no residue of the root, but say a release step did not release
everything), and the threads and sockets it started since init (``Footprint`` before,
``left_running`` after: a tier's control plane and data plane are no file in the root).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvoffload.shm import names


@dataclass(frozen=True, slots=True)
class ResidueFile:
    path: Path
    size_bytes: int
    resident_bytes: int


@dataclass(frozen=True, slots=True)
class Residue:
    """This engine's files still in the root; ``bytes`` is resident memory."""

    paths: tuple[Path, ...]
    bytes: int
    size_bytes: int
    files: tuple[ResidueFile, ...]

    def __bool__(self) -> bool:
        return bool(self.paths)


def measure_residue(root: Path, engine_id: str) -> Residue:
    """This engine's region files (base and segments) in ``root``; nothing else is looked at."""
    files: list[ResidueFile] = []
    try:
        entries = sorted(os.listdir(root))
    except FileNotFoundError:
        entries = []
    for entry in entries:
        parsed = names.parse(entry)
        if parsed is None or parsed.engine_id != engine_id:
            continue
        try:
            st = os.lstat(root / entry)
        except FileNotFoundError:
            continue
        files.append(ResidueFile(root / entry, st.st_size, st.st_blocks * 512))
    return Residue(
        paths=tuple(f.path for f in files),
        bytes=sum(f.resident_bytes for f in files),
        size_bytes=sum(f.size_bytes for f in files),
        files=tuple(files),
    )


@dataclass(frozen=True, slots=True)
class HeldHandle:
    """An fd or mapping of this engine's region that a participant still had after its release.

    It dies with the process, so it is no residue of the root; it says a release step
    did not release everything (a skipped primary shutdown, a buffer still exported).
    """

    participant: str
    kind: str  # "fd" or "map"
    target: str


def held_handles(participant: str, engine_id: str, proc_self: Path = Path("/proc/self")) -> list[HeldHandle]:
    """This process's fds and mappings of ``engine_id``'s region files (deleted or not)."""
    base = names.format_name(engine_id)
    found: list[HeldHandle] = []
    try:
        fds = os.listdir(proc_self / "fd")
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(proc_self / "fd" / fd)
        except OSError:
            continue
        if _names_region(target, base):
            found.append(HeldHandle(participant, "fd", target))
    try:
        with open(proc_self / "maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and _names_region(fields[5].strip(), base):
                    found.append(HeldHandle(participant, "map", f"{fields[0]} {fields[5].strip()}"))
    except OSError:
        pass
    return found


def _names_region(target: str, base: str) -> bool:
    name = target.rsplit("/", 1)[-1].removesuffix(" (deleted)")
    return name == base or name.startswith(base + ".")


@dataclass(frozen=True, slots=True)
class Footprint:
    """This process's Python threads and socket fds, to tell what a bring-up left running.

    A tier's control plane binds sockets and its data plane runs threads (vLLM's p2p tier:
    a ZMQ router and a NIXL registration pool; its object tier: a lookup thread). Neither
    is a file in the root, so the root's residue check cannot see them: a participant takes
    its footprint before init and compares after its release (``left_running``).
    """

    threads: frozenset[threading.Thread]
    #: One per fd: "socket:[inode]", or "anon_inode:[eventfd] (fd N)" for the kernel event
    #: handles a library's native threads poll (a ZMQ context holds eventfds and an epoll; its
    #: I/O threads are native, invisible to ``threading``, and go with the context).
    handles: frozenset[str]
    #: Whether ``handles`` counts event fds (False: sockets only; see ``now``).
    event_fds: bool = True

    @classmethod
    def now(cls, proc_self: Path = Path("/proc/self"), *, event_fds: bool = True) -> Footprint:
        """``event_fds=False`` counts sockets only: a worker's accelerator runtime (CUDA) may keep
        event fds for the life of the process, and no tier runs there."""
        handles = frozenset(_handle_fds(proc_self, event_fds))
        return cls(frozenset(threading.enumerate()), handles, event_fds)


#: How long a thread or socket may take to go after the release returned (a thread told to
#: stop may still be on its way out), before it counts as left running.
LEFT_RUNNING_GRACE_S = 1.0


def left_running(
    before: Footprint, *, grace_s: float = LEFT_RUNNING_GRACE_S, proc_self: Path = Path("/proc/self")
) -> tuple[str, ...]:
    """Threads and sockets this process has now and did not have at ``before``, one line each.

    Waits up to ``grace_s`` for them to go; empty when nothing is left (and then at once).
    """
    deadline = time.monotonic() + grace_s
    while True:
        now = Footprint.now(proc_self, event_fds=before.event_fds)
        threads = [t for t in now.threads - before.threads if t.is_alive()]
        sockets = sorted(now.handles - before.handles)
        left = time.monotonic() - deadline
        if not (threads or sockets) or left >= 0:
            break
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        if not threads:
            time.sleep(min(0.05, -left))
    return (
        *(f"thread {t.name!r}{' (daemon)' if t.daemon else ''}" for t in sorted(threads, key=_name)),
        *(f"fd {s}" for s in sockets),
    )


def _name(thread: threading.Thread) -> str:
    return thread.name


def _handle_fds(proc_self: Path, event_fds: bool = True) -> list[str]:
    found: list[str] = []
    try:
        fds = os.listdir(proc_self / "fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(proc_self / "fd" / fd)
        except OSError:
            continue
        if target.startswith("socket:"):
            found.append(target)
        elif event_fds and target.startswith("anon_inode:"):
            found.append(f"{target} (fd {fd})")  # no inode to tell two apart: the fd does
    return found
