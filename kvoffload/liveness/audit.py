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
from pathlib import Path
from types import FrameType

from kvoffload.durations import MAX_DURATION_S
from kvoffload.errors import ConfigError
from kvoffload.liveness.holders import DeletedMapping
from kvoffload.liveness.scan import DEFAULT_ROOT, ScanEntry, scan


@dataclass(frozen=True, slots=True)
class AuditReport:
    """What a command left behind. Serialised as is for ``shmctl audit --json``."""

    root: Path
    command: tuple[str, ...]
    command_exit_code: int
    duration_s: float
    leaked: tuple[ScanEntry, ...]
    leaked_deleted: tuple[DeletedMapping, ...]
    leaked_resident_bytes: int
    preexisting: int
    #: The signal (``"SIGTERM"``) that stopped the audit while it ran, if one did.
    interrupted_by: str | None = None

    @property
    def clean(self) -> bool:
        return not self.leaked and not self.leaked_deleted


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
) -> AuditReport:
    """Run ``command`` (inheriting stdio) and report the region files it left in ``root``."""
    if not command:
        raise ConfigError(
            "command", "nothing to run", fix="write the command after --, e.g. shmctl audit -- pytest"
        )
    if not 0 <= settle_s <= MAX_DURATION_S:
        raise ConfigError("settle_s", f"{settle_s} is outside 0..{MAX_DURATION_S:g} seconds")
    before = scan(root, grace_s=0)
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
        started = time.monotonic()
        try:
            child = subprocess.Popen(list(command))
        except FileNotFoundError:
            raise ConfigError(
                "command", f"{command[0]!r} not found", fix="check the command's name and PATH"
            ) from None
        except PermissionError:
            raise ConfigError("command", f"{command[0]!r} is not executable") from None
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
        after = scan(root, grace_s=0)
    leaked = tuple(e for e in after.entries if e.identity not in known)
    leaked_deleted = tuple(d for d in after.deleted if _deleted_key(d) not in known_deleted)
    resident = sum(e.resident_bytes for e in leaked) + sum(d.resident_bytes or 0 for d in leaked_deleted)
    return AuditReport(
        root=Path(root),
        command=tuple(command),
        command_exit_code=returncode,
        duration_s=duration,
        leaked=leaked,
        leaked_deleted=leaked_deleted,
        leaked_resident_bytes=resident,
        preexisting=len(known),
        interrupted_by=received[0].name if received else None,
    )
