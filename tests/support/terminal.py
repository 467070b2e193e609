"""Run a command with some of its streams on a real pseudo-terminal, the others on pipes.

One runner for every test that needs "a terminal": the prompt of ``reap``, colour and
progress that appear only on a TTY, long lines at a given width. The terminal's line
discipline turns "\\n" into "\\r\\n"; ``text`` turns it back, nothing else is changed.
"""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from tests.support.procs import REPO

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass(frozen=True, slots=True)
class TerminalRun:
    code: int
    #: What the command wrote to the terminal (the streams in ``on``).
    text: str
    #: Its stdout and stderr, where they were pipes ("" where they were the terminal).
    out: str
    err: str
    #: The bytes the terminal received, undecoded ("\r\n" as the line discipline wrote it).
    raw: bytes = b""

    @property
    def plain(self) -> str:
        """``text`` without terminal escape sequences (colour, cursor movement)."""
        return ANSI.sub("", self.text)


def on_a_terminal(
    *argv: str,
    on: Collection[str] = ("stdout",),
    answer: bytes | None = None,
    env: Mapping[str, str] | None = None,
    columns: int = 80,
    timeout_s: float = 60,
) -> TerminalRun:
    """``python -m shmctl argv`` with the streams named in ``on`` (stdin, stdout, stderr) on a
    pty ``columns`` wide; ``answer`` is typed once a ``[y/N]`` prompt shows. ``NO_COLOR`` is
    cleared unless ``env`` sets it."""
    leader, follower = pty.openpty()
    environ = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    environ |= {"COLUMNS": str(columns), "LINES": "50", "TERM": "xterm-256color", **(env or {})}

    def stream(name: str, default: int) -> int:
        return follower if name in on else default

    proc = subprocess.Popen(
        [sys.executable, "-m", "shmctl", *argv],
        stdin=stream("stdin", subprocess.DEVNULL),
        stdout=stream("stdout", subprocess.PIPE),
        stderr=stream("stderr", subprocess.PIPE),
        cwd=REPO,
        env=environ,
    )
    os.close(follower)
    out_fd = proc.stdout.fileno() if proc.stdout is not None else None
    err_fd = proc.stderr.fileno() if proc.stderr is not None else None
    readers = {fd: b"" for fd in (leader, out_fd, err_fd) if fd is not None}
    answered = answer is None
    deadline = time.monotonic() + timeout_s
    open_fds = set(readers)
    while open_fds and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_fds), [], [], 0.1)
        for fd in ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                chunk = b""
            if not chunk:
                open_fds.discard(fd)
                continue
            readers[fd] += chunk
            if not answered and b"[y/N]" in readers[leader]:
                os.write(leader, answer or b"")
                answered = True
    os.close(leader)
    code = proc.wait(timeout_s)

    def decoded(fd: int | None) -> str:
        return "" if fd is None else readers[fd].decode("utf-8", "replace")

    run = TerminalRun(
        code, decoded(leader).replace("\r\n", "\n"), decoded(out_fd), decoded(err_fd), readers[leader]
    )
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return run
