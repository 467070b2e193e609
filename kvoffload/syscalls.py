"""The Linux calls the standard library does not wrap (or wraps holding the GIL), through libc.

``renameat2`` and ``statx`` for park directories and root identities; ``fstatfs`` for the
filesystem's type; ``madvise``, ``fallocate`` and a ``MAP_FIXED`` ``mmap`` for the region's
mapping and its pre-fault, with ``address_of`` to name a mapping's address to them;
``pthread_sigmask`` (``SignalMask``) for the lease watchdog, which blocks job-control stops
while a lease is held.

Each is looked up once, on first use (``ctypes`` costs start-up time that ``shmctl --help``
must not pay: nothing here imports it before a call), and fails as ``OSError`` with the
kernel's errno, like ``os``'s own calls. A libc without the symbol (musl before 1.2.5 has no
``statx``) gives ``ENOSYS``. ctypes lets go of the GIL for every call, so threads that call
them (the pre-fault's) run in parallel.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: ``RENAME_NOREPLACE`` (linux/fs.h): fail with ``EEXIST`` rather than replace the target.
RENAME_NOREPLACE = 1

#: ``statx(2)`` masks and flags (linux/stat.h, linux/fcntl.h).
STATX_BTIME = 0x800
STATX_MNT_ID = 0x1000
AT_EMPTY_PATH = 0x1000
#: Offsets in ``struct statx``, the same on every ABI: the mask, the birth time and the mount id.
_STX_MASK = 0x00
_STX_BTIME = 0x50
_STX_MNT_ID = 0x90
_STATX_SIZE = 256

#: ``madvise(2)`` advice (linux/mman.h), where this Python's ``mmap`` does not name it.
MADV_HUGEPAGE: int = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: ``fallocate(2)`` mode (linux/falloc.h): allocate, keeping the file's size.
FALLOC_FL_KEEP_SIZE = 0x01
MAP_FIXED: int = getattr(mmap, "MAP_FIXED", 0x10)


@functools.cache
def _libc_function(name: str, *argtypes: Any, restype: Any = None) -> Callable[..., int] | None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    function = getattr(libc, name, None)
    if function is None:
        return None
    function.argtypes = list(argtypes)
    function.restype = ctypes.c_int if restype is None else restype
    found: Callable[..., int] = function
    return found


def _required(name: str, *argtypes: Any, restype: Any = None) -> Callable[..., int]:
    """``_libc_function`` for a call every Linux libc has; ``ENOSYS`` should one lack it."""
    function = _libc_function(name, *argtypes, restype=restype)
    if function is None:
        raise OSError(errno.ENOSYS, f"{name} is not in this libc")
    return function


def _raise_errno(what: str | None = None) -> None:
    import ctypes

    code = ctypes.get_errno()
    raise OSError(code, os.strerror(code), what)


#: ``renameat2`` from libc once looked up (a reap renames every file it removes twice over:
#: the lookup's cache key and argument types cost as much as the call).
_renameat2: Callable[..., int] | None = None


def renameat2(old_dir: int, old: str, new_dir: int, new: str, flags: int = RENAME_NOREPLACE) -> None:
    """``renameat2(2)``; ``RENAME_NOREPLACE`` by default: ``EEXIST`` rather than replace a file."""
    global _renameat2
    function = _renameat2
    if function is None:
        import ctypes

        function = _libc_function(
            "renameat2", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint
        )
        if function is None:
            raise OSError(errno.ENOSYS, "renameat2 is not in this libc", old)
        _renameat2 = function
    encoded = os.fsencode(old)
    if function(old_dir, encoded, new_dir, encoded if new == old else os.fsencode(new), flags) != 0:
        _raise_errno(old)


def madvise(address: int, length: int, advice: int) -> None:
    """``madvise(2)`` of ``[address, address + length)``.

    Not ``mmap.madvise``: CPython holds the GIL through that call, ctypes lets go of it, so
    threads that fault pages in with ``MADV_POPULATE_WRITE`` fault in parallel.
    """
    import ctypes

    if _required("madvise", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(address, length, advice) != 0:
        _raise_errno()


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """``fallocate(2)``: unlike ``os.posix_fallocate``, it takes a ``mode`` (``FALLOC_FL_KEEP_SIZE``)."""
    import ctypes

    function = _required("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    if function(fd, mode, offset, length) != 0:
        _raise_errno()


def mmap_fixed(address: int, length: int, prot: int, flags: int, fd: int, offset: int = 0) -> None:
    """``mmap(2)`` of ``fd`` at exactly ``address`` (``MAP_FIXED`` added to ``flags``).

    Whatever was mapped at ``[address, address + length)`` is replaced: the caller reserved
    that range itself. Python's ``mmap`` picks its own address, so it cannot do this.
    """
    import ctypes

    function = _required(
        "mmap",
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
        restype=ctypes.c_void_p,
    )
    if function(address, length, prot, flags | MAP_FIXED, fd, offset) != address:
        _raise_errno()


def address_of(mapping: mmap.mmap) -> int:
    """The address of ``mapping``'s first byte, for the calls above."""
    import ctypes

    # from_buffer exports the mapping; drop the export at once, or close() would refuse.
    anchor = ctypes.c_char.from_buffer(mapping)
    address = ctypes.addressof(anchor)
    del anchor
    return address


def fstatfs_type(fd: int) -> int:
    """``fstatfs(fd).f_type``: the magic number (linux/magic.h) of the filesystem ``fd`` is on.

    ``os.statvfs`` has no ``f_type``; ``struct statfs`` starts with it (a ``long`` on every
    Linux ABI), so the first word of the kernel's answer is all that is read.
    """
    import ctypes

    buffer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit ABIs
    if _required("fstatfs", ctypes.c_int, ctypes.c_void_p)(fd, buffer) != 0:
        _raise_errno()
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Statx:
    """What ``statx`` tells beyond ``fstat``; None where this kernel or filesystem does not say."""

    #: The mount the fd is reached through, as ``/proc/self/mountinfo`` numbers mounts (5.8+).
    mount_id: int | None
    #: When the inode was made, in ns since the epoch (tmpfs keeps it on 6.x kernels).
    birth_ns: int | None


def statx(fd: int) -> Statx:
    """``statx(fd, "", AT_EMPTY_PATH, STATX_MNT_ID|STATX_BTIME)`` of an open fd."""
    import ctypes

    function = _libc_function(
        "statx", ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p
    )
    if function is None:
        return Statx(_fdinfo_mount_id(fd), None)
    buffer = ctypes.create_string_buffer(_STATX_SIZE)
    if function(fd, b"", AT_EMPTY_PATH, STATX_MNT_ID | STATX_BTIME, buffer) != 0:
        return Statx(_fdinfo_mount_id(fd), None)
    mask = ctypes.c_uint32.from_buffer(buffer, _STX_MASK).value
    mount_id = ctypes.c_uint64.from_buffer(buffer, _STX_MNT_ID).value if mask & STATX_MNT_ID else None
    birth = None
    if mask & STATX_BTIME:
        seconds = ctypes.c_int64.from_buffer(buffer, _STX_BTIME).value
        birth = seconds * 1_000_000_000 + ctypes.c_uint32.from_buffer(buffer, _STX_BTIME + 8).value
    return Statx(mount_id if mount_id is not None else _fdinfo_mount_id(fd), birth)


def mount_id(fd: int) -> int | None:
    """The mount id of ``fd``; None where the kernel hides it."""
    return statx(fd).mount_id


def _fdinfo_mount_id(fd: int) -> int | None:
    # Kernels before 5.8 tell it only in the fd's info.
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as info:
            for line in info:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


# ---------------------------------------------------------------------------------------
# pthread_sigmask, for the lease watchdog (kvoffload.liveness.watchdog): its lease takers
# block job-control stops from a lease's hold to its release, a microsecond apart.
# ---------------------------------------------------------------------------------------


class SignalMask:
    """Block and restore ``signals`` in the calling thread: ``pthread_sigmask`` through libc,
    about 1 µs a call, or the standard library's (2 µs, and a set of signals built each time).

    Made once; raises ``OSError`` or ``AttributeError`` where libc cannot be loaded or has no
    ``pthread_sigmask`` (the caller then uses ``signal.pthread_sigmask``).
    """

    def __init__(self, signals: frozenset[int]) -> None:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        self._call = libc.pthread_sigmask
        self._call.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        self._call.restype = ctypes.c_int
        self._set_type = ctypes.c_ulong * (128 // ctypes.sizeof(ctypes.c_ulong))
        stops = self._set_type()
        bits = 8 * ctypes.sizeof(ctypes.c_ulong)
        for signum in signals:
            stops[(signum - 1) // bits] |= 1 << ((signum - 1) % bits)
        self._stops = stops
        self._addressof = ctypes.addressof
        self._block, self._setmask = signal.SIG_BLOCK, signal.SIG_SETMASK

    def block(self) -> object:
        """Add the signals to the thread's mask; the mask before, or None if the call failed."""
        old = self._set_type()
        if self._call(self._block, self._addressof(self._stops), self._addressof(old)) != 0:
            return None
        return old

    def restore(self, old: object) -> None:
        """Set the thread's mask back to ``old`` (what ``block`` returned)."""
        self._call(self._setmask, self._addressof(old), None)  # type: ignore[arg-type]
