"""The files a command writes when asked: ``audit --report``/``--junit``, ``metrics --textfile``.

How an output is written depends on what its name is (``write_output``); nothing that is
not a regular file is ever replaced:

* a regular file, or a name that does not exist yet: written whole or not at all, a temp
  file in the same directory renamed over the name (mode 0644);
* a symbolic link to one: the same, for the file the link names; the link stays a link;
* one of this process's open files by name (``/dev/stdout``, ``/dev/stderr``, ``/dev/fd/N``,
  ``/proc/self/fd/N``): written through that fd, at its offset, as a shell's ``>&N`` writes
  (reopening the name would start a regular file over from its first byte, and a socket,
  journald's stdout, cannot be opened at all);
* a character device, a FIFO (or a link to one): opened and written in place, as a shell's
  ``>`` would. A socket, a block device and a directory are refused before the command runs
  (``check_output``).

A FIFO is never waited on for ever (a shell's ``>`` would block until a reader came, and an
audit would hang after its command had run): its write end is opened without blocking,
trying again for ``FIFO_READER_WAIT_S`` while nothing reads it (``cmd & cat FIFO`` may open
it a moment late), then refused with ENXIO's fix. ``hold_output`` opens it before the
command runs and keeps it open until the report is written: the reader that was there is
the one that gets the data (opening it only to look would hand ``cat`` its end of file).

Refusals are ``OutputError``, exit 3 as for any path the system refuses (an unreadable
``--root``, a missing ``--textfile`` directory); ``-`` is a usage error (exit 2).

``write_atomically`` is shmctl's one temp file and rename: a reader of the name (a CI job, the
node_exporter textfile collector) sees the whole old file or the whole new one, never part of
either. The temp file is made beside the name (the same filesystem: the rename is atomic), as
``.NAME.XXXXXXXX.tmp`` (a name node_exporter, which reads ``*.prom``, never reads), is given
mode 0644 before it takes the name (node_exporter usually runs as another user, and a root
cron job's umask may be 077), and is removed if anything fails.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import select
import stat
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

from kvoffload.errors import ConfigError, KvOffloadError
from shmctl.render.fixes import unwritable_fix

_STD_STREAMS = {"/dev/stdin": 0, "/dev/stdout": 1, "/dev/stderr": 2}
_FD_NAME = re.compile(r"^/(?:dev/fd|proc/self/fd|proc/thread-self/fd|proc/(\d+)/fd)/(\d+)$")
#: The way around a path that cannot be written, in the fixes of the refusals.
INSTEAD = "name another file"
#: How long a FIFO's write end is tried for before it is refused: a reader started beside
#: shmctl (``shmctl audit --report p -- cmd & cat p``) opens it within this.
FIFO_READER_WAIT_S = 3.0
_FIFO_RETRY_S = 0.05


class OutputError(KvOffloadError):
    """An output file the system will not let this user write (exit 3, as an unreadable root).

    ``option`` is the flag that named it (``--report``).
    """

    def __init__(self, option: str, message: str, *, fix: str | None = None) -> None:
        super().__init__(f"{option}: {message}", fix=fix)
        self.option = option


def own_fd(path: Path) -> int | None:
    """The fd number when ``path`` names one of this process's open files (``/dev/stdout``)."""
    name = os.path.normpath(os.path.abspath(path))
    if name in _STD_STREAMS:
        return _STD_STREAMS[name]
    match = _FD_NAME.match(name)
    if match is None or (match[1] is not None and int(match[1]) != os.getpid()):
        return None
    return int(match[2])


def check_output(path: Path | None, option: str) -> None:
    """Refuse, before the command runs, a ``--report``/``--junit`` path that cannot be written.

    A name that will be replaced (a regular file, a new name, a link to either): a temp file
    is created and removed in the directory of the file it names: that directory exists and
    takes new files (permissions, read-only mounts, a full inode table), which is what the
    final rename needs. A device or FIFO: this user may write it. An fd by name: it is open
    for writing. ``-`` is refused: stdout belongs to the command (``/dev/stdout`` says so on
    purpose).
    """
    if path is None:
        return
    if str(path) == "-":
        raise ConfigError(
            option, "'-' (stdout) is the command's own output", fix=f"name a file, e.g. {option} audit.out"
        )
    fd = own_fd(path)
    if fd is not None:
        _check_own_fd(path, fd, option)
        return
    try:
        mode: int | None = os.stat(path).st_mode
    except FileNotFoundError:  # a new name, or a link to one
        mode = None
    except OSError as e:
        raise OutputError(
            option, f"cannot use {path}: {e.strerror or e}", fix=unwritable_fix(e, path, instead=INSTEAD)
        ) from None
    if mode is not None and stat.S_ISDIR(mode):
        raise OutputError(
            option, f"{path} is a directory", fix=f"name a file in it, e.g. {path / 'audit.out'}"
        )
    if mode is not None and not stat.S_ISREG(mode):
        _check_in_place(path, mode, option)
        return
    directory = replaced_path(path).parent
    if not directory.is_dir():
        raise OutputError(
            option, f"{directory} is not a directory", fix="create it first, or name another file"
        )
    try:
        probe_fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise OutputError(
            option,
            f"cannot create files in {directory}: {e.strerror or e}",
            fix=unwritable_fix(e, directory, instead=INSTEAD),
        ) from None
    os.close(probe_fd)
    os.unlink(probe)


def _check_own_fd(path: Path, fd: int, option: str) -> None:
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError:
        raise OutputError(
            option,
            f"{path}: fd {fd} is not open",
            fix=f"open it for writing ({fd}>FILE in the shell), or {INSTEAD}",
        ) from None
    if flags & os.O_ACCMODE == os.O_RDONLY:
        raise OutputError(
            option, f"{path}: fd {fd} is open read-only", fix=f"open it for writing, or {INSTEAD}"
        )


def _check_in_place(path: Path, mode: int, option: str) -> None:
    if stat.S_ISSOCK(mode):
        raise OutputError(
            option,
            f"{path} is a socket, which cannot be opened as a file",
            fix="name a file, a FIFO or a device",
        )
    if stat.S_ISBLK(mode):
        raise OutputError(
            option, f"{path} is a block device: the report would overwrite what it stores", fix=INSTEAD
        )
    if not os.access(path, os.W_OK):
        raise OutputError(
            option, f"{path}: permission denied", fix=f"give this user write access to it, or {INSTEAD}"
        )


class HeldOutput:
    """An output that passed ``check_output``; a FIFO's write end is held open from then on.

    ``write`` writes the data as ``write_output`` does, through the held end where there is
    one, and closes it. ``close`` is idempotent: a run that fails before writing lets the
    reader see its end of file.
    """

    def __init__(self, path: Path, fd: int | None = None) -> None:
        self.path = path
        self._fd = fd

    def write(self, data: bytes) -> None:
        if self._fd is None:
            write_output(self.path, data)
            return
        try:
            _write_all(self._fd, data)
        finally:
            self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> HeldOutput:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def hold_output(path: Path, option: str) -> HeldOutput:
    """``check_output``, and a FIFO's write end opened now and held: refused (``OutputError``)
    when no reader opens the FIFO within ``FIFO_READER_WAIT_S``, so nothing runs."""
    check_output(path, option)
    if own_fd(path) is not None or not _is_fifo(path):
        return HeldOutput(path)
    try:
        fd = open_in_place(path)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OutputError(
                option,
                f"{path} is a FIFO that nothing reads (waited {FIFO_READER_WAIT_S:g}s for a reader)",
                fix=f"start its reader first (cat {path} &), or {INSTEAD}",
            ) from None
        raise OutputError(
            option, f"cannot open {path}: {e.strerror or e}", fix=unwritable_fix(e, path, instead=INSTEAD)
        ) from None
    return HeldOutput(path, fd)


def _is_fifo(path: Path) -> bool:
    try:
        return stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        return False


def open_in_place(path: Path) -> int:
    """A write fd of the device or FIFO at ``path``, opened as a shell's ``>`` would, except
    that a FIFO with no reader is tried again for ``FIFO_READER_WAIT_S``, then ENXIO is raised
    (a blocking open would wait for ever). The fd blocks on write, as a shell's would."""
    flags = os.O_WRONLY | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK
    deadline = time.monotonic() + FIFO_READER_WAIT_S
    while True:
        try:
            fd = os.open(path, flags)
            break
        except OSError as e:
            if e.errno != errno.ENXIO or time.monotonic() >= deadline:
                raise
            time.sleep(_FIFO_RETRY_S)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def same_file(a: Path, b: Path) -> bool:
    """One name twice, or two names of one file that would be replaced (the second rename wins)."""
    if os.path.abspath(a) == os.path.abspath(b):
        return True
    return own_fd(a) is None and own_fd(b) is None and os.path.realpath(a) == os.path.realpath(b)


def write_output(path: Path, data: bytes) -> None:
    """``data`` to ``path``, in the way its kind of file asks (the module docstring): replaced
    whole when it is (or links to) a regular file or is new, else written where it stands."""
    fd = own_fd(path)
    if fd is not None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()  # anything of ours buffered for that fd goes first
        _write_all(fd, data)
    elif not write_in_place(path, data):
        write_atomically(replaced_path(path), data)


def replaced_path(path: Path) -> Path:
    """The name the rename replaces: ``path``, or the file a symbolic link at ``path`` names."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def in_place(path: Path) -> bool:
    """Whether ``path`` is written where it stands: it is (or links to) a device or a FIFO."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def write_in_place(path: Path, data: bytes) -> bool:
    """Write ``data`` into the device or FIFO at ``path`` (following links); False, writing
    nothing, when ``path`` is missing or a regular file (the caller replaces it instead).

    The type is checked again on the open fd: a regular file that took the name meanwhile is
    closed untouched, never written over from its first byte.
    """
    if not in_place(path):
        return False
    fd = open_in_place(path)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        _write_all(fd, data)
    finally:
        os.close(fd)
    return True


def _write_all(fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd``: a pipe takes a large write in parts, and a pipe its
    reader made non-blocking answers EAGAIN while full."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [])
            continue
        view = view[written:]


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, never part of it (temp file + rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
