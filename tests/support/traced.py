"""The CLI under ``strace -e inject=``: held at the entry (or exit) of one syscall, or killed there.

Windows in the removal protocol are microseconds wide; ``strace``'s fault injection holds one
open on purpose (``delay_enter``/``delay_exit``), or SIGKILLs the reaper at an exact syscall,
so that a test can act in it as another process would.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.procs import REPO

_SYSCALLS = {
    "x86_64": {"renameat2": 316, "unlinkat": 263, "mkdirat": 258, "flock": 73, "openat": 257},
    "aarch64": {"renameat2": 276, "unlinkat": 35, "mkdirat": 34, "flock": 32, "openat": 56},
}.get(platform.machine())

needs_strace = pytest.mark.skipif(
    shutil.which("strace") is None or _SYSCALLS is None or os.geteuid() != 0,
    reason="needs strace, root (to trace and to lease any file) and x86_64/aarch64",
)

#: No bytecode written (its mkdir and rename would count among the traced syscalls), and no
#: lease watchdog: it exists to SIGKILL a lease holder that is stopped or traced, which is
#: exactly what strace does to the reaper here on purpose (docs/leases.md).
TRACED_ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "SHMCTL_LEASE_GUARD": "off"}


def cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "shmctl", *argv]


class Traced:
    """The CLI under ``strace``, pausing (or killed) at the ``when``-th entry of ``syscall``."""

    def __init__(self, syscall: str, when: int, action: str, *argv: str) -> None:
        assert _SYSCALLS is not None
        self.number = _SYSCALLS[syscall]
        inject = f"inject={syscall}:{action}:when={when}"
        self.proc = subprocess.Popen(
            [
                "strace",
                "-f",
                "-qq",
                "-o",
                os.environ.get("DBG_STRACE", "/dev/null"),
                "-e",
                f"trace={syscall}",
                "-e",
                inject,
                *cli(*argv),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=TRACED_ENV,
        )

    def pid(self, timeout: float = 30) -> int:
        """The traced CLI's pid (strace's child)."""
        deadline = time.monotonic() + timeout
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        strace = os.path.realpath(shutil.which("strace") or "strace")
        while time.monotonic() < deadline:
            for pid in children.read_text().split() if children.exists() else []:
                try:
                    exe = os.readlink(f"/proc/{pid}/exe")
                except OSError:
                    continue
                if exe != strace:  # exec'd: the CLI itself, not strace's child before its exec
                    return int(pid)
            time.sleep(0.002)
        raise AssertionError("strace started no process")

    def wait_in_syscall(self, timeout: float = 60) -> int:
        """Block until the CLI sits at the entry of the syscall (paused by strace); its pid."""
        pid = self.pid()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                current = Path(f"/proc/{pid}/syscall").read_text().split()
            except OSError:
                current = []  # gone: then strace is done too, and the loop ends
            if current and current[0] == str(self.number):
                return pid
            time.sleep(0.002)
        raise AssertionError(f"the reaper never reached syscall {self.number}: {self.finish()}")

    def finish(self, timeout: float = 120) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, out, err
