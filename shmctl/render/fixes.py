"""The fix for a file shmctl could not write, true to the error the kernel gave.

One errno, one cause, one fix: "free space" answers ENOSPC and nothing else. A full disk, a
read-only mount, a directory this user may not write and a pseudo-filesystem that takes no
files from anyone (``/proc`` answers ENOENT, ``/sys`` EACCES, even to root) each get the
fix that would work for them; an errno with no fix of its own gets only the way around it
(``instead``: "pass another --textfile"), never a guess.

``where`` is the directory a file is created in (temp file and rename), or the file itself
when it is written in place (a device, a FIFO, an fd).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from kvoffload.shm import mounts

#: Filesystems the kernel makes up from its own state: no user creates a file there.
PSEUDO_FILESYSTEMS = frozenset(
    {
        "proc",
        "sysfs",
        "cgroup",
        "cgroup2",
        "debugfs",
        "tracefs",
        "securityfs",
        "pstore",
        "bpf",
        "configfs",
        "efivarfs",
        "binfmt_misc",
        "fusectl",
        "devpts",
        "nsfs",
        "selinuxfs",
    }
)
#: The errnos a pseudo-filesystem answers a new file with (and a real one, for other causes).
_PSEUDO_ANSWERS = frozenset({errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EINVAL})


def pseudo_filesystem(where: Path) -> str | None:
    """The type of the pseudo-filesystem that holds ``where`` (``"proc"``), or None."""
    info = mounts.root_mount(where)
    if info is None or info.fs_type not in PSEUDO_FILESYSTEMS:
        return None
    return info.fs_type


def unwritable_fix(error: OSError, where: Path, *, instead: str) -> str:
    """What to do about ``error``, raised writing into ``where``; ``instead`` is the way around it."""
    code = error.errno
    if _is_device(where):  # /dev/full is full by design: its filesystem has nothing to do with it
        return f"the device {where} refused the data: {instead}"
    if code in _PSEUDO_ANSWERS:
        kind = pseudo_filesystem(where)
        if kind is not None:
            return f"{where} is on {kind}, a pseudo-filesystem that takes no files: {instead} on a real one"
    path = error.filename or where
    fixes = {
        errno.ENOSPC: f"free space on the filesystem that holds {where} (df {where}), or {instead}",
        errno.EDQUOT: f"free space within this user's quota on {where}, or raise the quota, or {instead}",
        errno.EROFS: f"{where} is on a read-only mount: remount it read-write, or {instead}",
        errno.EACCES: f"give this user write access to {where} (or run as its owner), or {instead}",
        errno.EPERM: (
            f"{path} is protected (another user's file in a sticky directory, or immutable: lsattr): "
            f"remove it, or {instead}"
        ),
        errno.ENOENT: f"{where} was removed while shmctl ran: create it again, or {instead}",
        errno.ENOTDIR: f"{where} or a directory above it is not a directory: {instead}",
        errno.EISDIR: f"{path} is a directory: remove it, or {instead}",
        errno.ELOOP: f"{path} is a loop of symbolic links: {instead}",
        errno.ENAMETOOLONG: f"{instead}, with a shorter name",
        errno.EMFILE: "raise this process's open-file limit (ulimit -n), then run again",
        errno.ENFILE: "the system's open-file table is full (fs.file-max): close files, then run again",
        errno.EFBIG: f"raise the file-size limit (ulimit -f), or {instead}",
        errno.EIO: f"the storage under {where} failed (see dmesg): {instead} on another device",
        errno.ENXIO: f"nothing reads {path} (a FIFO with no reader): start its reader first, or {instead}",
        errno.EPIPE: f"the reader of {path} went away before the end: keep it reading, or {instead}",
        errno.ETXTBSY: f"{path} is a program that is running: {instead}",
    }
    return fixes.get(code, instead) if code is not None else instead


def _is_device(where: Path) -> bool:
    try:
        mode = os.stat(where).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
