"""Audit: did a command leave shared memory behind?

A CI step wraps the command it runs (``shmctl audit -- pytest -x``). Before, we record the
identities ``(st_dev, st_ino)`` of the region files already in the root and the deleted
regions already mapped by some process; after the command exits, every region file that
was not there before is a leak, whatever its verdict (a file still held by a daemon the
command left running is as much a leak as an orphan), and so is a deleted region newly
mapped by a process that outlived the command. The verdicts come from ``scan``.

A SIGINT, SIGTERM or SIGHUP to the audit is passed on to the command, which is waited for
and then audited as usual: a CI runner that cancels a job stops the audit and the command
it runs, never the audit alone (which would leave the command running, unwatched), and the
report of a cancelled run is still the one worth having. The report says which signal
came; the previous handlers are back when ``audit`` returns. Handlers can only be
installed from the main thread: from any other, the command runs without forwarding.

A command that cannot be started (not found, not executable) is reported, not raised: the
CI step gets the status a shell would give it and the report and JUnit file it asked for,
which say why (``command_start_error``). Nothing ran, so nothing is scanned after.

The report decides the exit status a wrapper should give (``exit_status``, and why:
``exit_reason``), so that wrapping a command changes its CI step only by the leak check:

1. a signal stopped the audit (it was passed on): 128 + its number, as a shell reports it;
2. the command could not be started: 127 when it was not found, 126 when it was found but
   could not be executed (permission, not a program the kernel runs), as a shell reports it;
3. the command was killed by signal N: 128 + N; it exited N != 0: N (a failing test suite
   stays the failure it was, whether or not it also leaked: the report records both);
4. the command succeeded but left something: 1;
5. otherwise 0.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from enum import StrEnum
from errno import errorcode
from pathlib import Path
from types import FrameType

from kvoffload.durations import MAX_DURATION_S
from kvoffload.errors import ConfigError
from kvoffload.liveness.holders import DeletedMapping
from kvoffload.liveness.reap import reap_command
from kvoffload.liveness.report import ScanEntry
from kvoffload.liveness.scan import DEFAULT_ROOT, ScanOptions, scan

#: 1: the first versioned document (``command_signal``, ``exit_status``, ``exit_reason``,
#: ``started_at`` and ``reap_commands`` came with it; ``command_exit_code`` is null when a
#: signal killed the command, never negative).
#: 2: ``command_start_error`` and the exit reason ``command-not-started`` (126, 127).
SCHEMA_VERSION = 2
#: How ``audit`` scans the root before and after the command unless told otherwise: no grace
#: period (a file the command left is a leak whatever its verdict).
AUDIT_SCAN = ScanOptions(grace_s=0.0)
#: The status of a command that succeeded but left shared memory behind (shmctl's FINDINGS).
LEAKED_EXIT_STATUS = 1
#: The statuses a POSIX shell gives a command it cannot run: found but not executable, not found.
NOT_EXECUTABLE_EXIT_STATUS = 126
NOT_FOUND_EXIT_STATUS = 127


class ExitReason(StrEnum):
    """Why ``exit_status`` is what it is, in the order the rules are tried."""

    INTERRUPTED = "interrupted"  # a signal stopped the audit: 128 + its number
    COMMAND_NOT_STARTED = "command-not-started"  # not found: 127; not executable: 126
    COMMAND_KILLED = "command-killed"  # a signal killed the command: 128 + its number
    COMMAND_FAILED = "command-failed"  # the command's own nonzero exit code
    LEAKED = "leaked"  # the command succeeded and left something: 1
    CLEAN = "clean"  # 0


@dataclass(frozen=True, slots=True)
class StartFailure:
    """Why the command could not be started: the ``execve`` error, and whether its file exists."""

    #: The errno's name: ``ENOENT`` (not found), ``EACCES``, ``ENOEXEC``, ...
    errno: str
    message: str
    #: Whether the command's file exists (searched on PATH when its name has no ``/``): an
    #: ENOENT for a file that exists is its ``#!`` interpreter missing, not the command.
    found: bool

    @classmethod
    def of(cls, error: OSError, name: str) -> StartFailure:
        number = error.errno or 0
        return cls(errorcode.get(number, f"E{number}"), error.strerror or str(error), _exists(name))

    @property
    def exit_status(self) -> int:
        """127 for a command that is not there, 126 for one that is but cannot be run (a shell's)."""
        if self.errno == "ENOENT" and not self.found:
            return NOT_FOUND_EXIT_STATUS
        return NOT_EXECUTABLE_EXIT_STATUS


def _exists(name: str) -> bool:
    """Whether ``execvp`` would find a file named ``name``, executable or not."""
    if os.sep in name:
        return os.path.lexists(name)
    directories = os.environ.get("PATH", os.defpath).split(os.pathsep)
    return any(os.path.lexists(os.path.join(d or ".", name)) for d in directories)


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What a command left behind and the status to exit with. Serialised for ``--report``."""

    schema_version: int
    root: Path
    command: tuple[str, ...]
    #: Wall-clock time (seconds since the epoch) when the command started.
    started_at: float
    duration_s: float
    #: The command's exit code; None when a signal killed it (``command_signal`` names it).
    command_exit_code: int | None
    command_signal: str | None
    leaked: tuple[ScanEntry, ...]
    leaked_deleted: tuple[DeletedMapping, ...]
    leaked_resident_bytes: int
    preexisting: int
    #: One ``shmctl reap`` command per engine that left region files (orphans go; held files stay).
    reap_commands: tuple[str, ...]
    exit_status: int
    exit_reason: ExitReason
    #: The signal (``"SIGTERM"``) that stopped the audit while it ran, if one did.
    interrupted_by: str | None = None
    #: Why the command could not be started; None when it ran (``command_exit_code`` is then
    #: None too: there was no process to exit).
    command_start_error: StartFailure | None = None

    @property
    def clean(self) -> bool:
        return not self.leaked and not self.leaked_deleted


def signal_name(signum: int) -> str:
    """``SIGTERM`` for 15; real-time signals, which ``signal.Signals`` does not name, as ``SIGRTMIN+N``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"SIGRTMIN+{signum - signal.SIGRTMIN}" if signum > signal.SIGRTMIN else f"SIG{signum}"


def exit_for(
    *,
    returncode: int | None,
    leaked: bool,
    interrupted_by: signal.Signals | None,
    start_failure: StartFailure | None = None,
) -> tuple[int, ExitReason]:
    """The status to exit with, and why (the rules of the module docstring, in order).

    ``returncode`` is Popen's (negative: killed by that signal), None when the command never
    started (``start_failure`` says why).
    """
    if interrupted_by is not None:
        return 128 + interrupted_by.value, ExitReason.INTERRUPTED
    if start_failure is not None or returncode is None:
        status = start_failure.exit_status if start_failure is not None else NOT_EXECUTABLE_EXIT_STATUS
        return status, ExitReason.COMMAND_NOT_STARTED
    if returncode < 0:  # Popen's spelling of "killed by signal -returncode"
        return 128 - returncode, ExitReason.COMMAND_KILLED
    if returncode != 0:
        return returncode, ExitReason.COMMAND_FAILED
    if leaked:
        return LEAKED_EXIT_STATUS, ExitReason.LEAKED
    return 0, ExitReason.CLEAN


def _reap_commands(root: Path, leaked: tuple[ScanEntry, ...]) -> tuple[str, ...]:
    engines = dict.fromkeys(e.engine_id for e in leaked)
    return tuple(reap_command(root, engine) for engine in engines)


#: Signals that stop an audit: each is passed on to the command.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_SETTLE_SLICE_S = 0.05


def _deleted_key(d: DeletedMapping) -> tuple[int, int, int]:
    return (d.pid, d.dev, d.ino)


def _catch(stack: ExitStack, handler: Callable[[int, FrameType | None], None]) -> None:
    """Install ``handler`` for ``FORWARDED_SIGNALS``; ``stack`` puts the previous ones back."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in FORWARDED_SIGNALS:
        previous = signal.getsignal(signum)
        # Ignored stays ignored, for us and (across exec) for the command: `nohup shmctl audit`
        # must not start forwarding SIGHUP. None: installed outside Python, cannot be put back.
        if previous is signal.SIG_IGN or previous is None:
            continue
        try:
            signal.signal(signum, handler)
        except ValueError:  # not the main thread of the main interpreter after all
            return
        stack.callback(signal.signal, signum, previous)


def _terminal_signalled_the_group() -> bool:
    """True when we are the foreground process group of our terminal.

    The command shares our process group, so a Ctrl-C typed there reached it already; a
    second SIGINT from us would land in the middle of its own cleanup (pytest's, say). A
    SIGINT sent to this process alone cannot be told apart from that here; a SIGTERM or
    SIGHUP always is passed on.
    """
    for fd in (0, 1, 2):
        try:
            return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:  # not a terminal
            continue
    return False


def audit(
    command: Sequence[str],
    root: Path | str = DEFAULT_ROOT,
    *,
    settle_s: float = 0.0,
    options: ScanOptions = AUDIT_SCAN,
) -> AuditReport:
    """Run ``command`` (inheriting stdio) and report the region files it left in ``root``,
    scanned before and after by ``options``."""
    if not command:
        raise ConfigError(
            "command", "nothing to run", fix="write the command after --, e.g. shmctl audit -- pytest"
        )
    if not 0 <= settle_s <= MAX_DURATION_S:
        raise ConfigError("settle_s", f"{settle_s} is outside 0..{MAX_DURATION_S:g} seconds")
    before = scan(root, options)
    known = {e.identity for e in before.entries}
    known_deleted = {_deleted_key(d) for d in before.deleted}
    received: list[signal.Signals] = []
    early: list[int] = []  # came while there was no child yet to pass them to
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum))
        if child is None:
            early.append(signum)
        elif signum != signal.SIGINT or not _terminal_signalled_the_group():
            child.send_signal(signum)  # a no-op once the child has been waited for

    with ExitStack() as handlers:
        _catch(handlers, forward)
        started_at = time.time()
        started = time.monotonic()
        try:
            child = subprocess.Popen(list(command))
        except OSError as e:  # execve refused it: reported as a shell would, with the report
            return _not_started(
                command, root, e, started_at, time.monotonic() - started, len(known), received
            )
        try:
            for signum in early:
                child.send_signal(signum)
            returncode = child.wait()
        finally:
            if child.returncode is None:  # only if wait() itself failed: leave nothing running
                child.kill()
                child.wait()
        duration = time.monotonic() - started
        # Let processes the command signalled finish exiting; a stopped audit reports at once.
        settle_until = time.monotonic() + settle_s
        while not received and (left := settle_until - time.monotonic()) > 0:
            time.sleep(min(left, _SETTLE_SLICE_S))
        after = scan(root, options)
    leaked = tuple(e for e in after.entries if e.identity not in known)
    leaked_deleted = tuple(d for d in after.deleted if _deleted_key(d) not in known_deleted)
    resident = sum(e.resident_bytes for e in leaked) + sum(d.resident_bytes or 0 for d in leaked_deleted)
    interrupted_by = received[0] if received else None
    exit_status, exit_reason = exit_for(
        returncode=returncode, leaked=bool(leaked or leaked_deleted), interrupted_by=interrupted_by
    )
    return AuditReport(
        schema_version=SCHEMA_VERSION,
        root=Path(root),
        command=tuple(command),
        started_at=started_at,
        duration_s=duration,
        command_exit_code=returncode if returncode >= 0 else None,
        command_signal=signal_name(-returncode) if returncode < 0 else None,
        leaked=leaked,
        leaked_deleted=leaked_deleted,
        leaked_resident_bytes=resident,
        preexisting=len(known),
        reap_commands=_reap_commands(Path(root), leaked) if leaked else (),
        exit_status=exit_status,
        exit_reason=exit_reason,
        interrupted_by=interrupted_by.name if interrupted_by is not None else None,
    )


def _not_started(
    command: Sequence[str],
    root: Path | str,
    error: OSError,
    started_at: float,
    duration: float,
    preexisting: int,
    received: Sequence[signal.Signals],
) -> AuditReport:
    """The report of a command ``execve`` refused: nothing ran, so nothing was left."""
    failure = StartFailure.of(error, command[0])
    interrupted_by = received[0] if received else None
    exit_status, exit_reason = exit_for(
        returncode=None, leaked=False, interrupted_by=interrupted_by, start_failure=failure
    )
    return AuditReport(
        schema_version=SCHEMA_VERSION,
        root=Path(root),
        command=tuple(command),
        started_at=started_at,
        duration_s=duration,
        command_exit_code=None,
        command_signal=None,
        leaked=(),
        leaked_deleted=(),
        leaked_resident_bytes=0,
        preexisting=preexisting,
        reap_commands=(),
        exit_status=exit_status,
        exit_reason=exit_reason,
        interrupted_by=interrupted_by.name if interrupted_by is not None else None,
        command_start_error=failure,
    )
