"""Park directories as real reapers leave them, for the tests of what later reapers do with them.

A park directory is trusted only with its reaper's mark (``kvoffload.liveness.park``), so a
test cannot fake one with ``mkdir``: ``dead_park`` has a real ``ParkDir`` made in a child
process, which moves the given files into it and dies without cleaning up (``os._exit``,
as a SIGKILL leaves it: unlocked, marked, holding them). ``running_park`` keeps the child
alive, its lock held, until the block ends. ``as_uid`` runs the child as another user.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.procs import REPO

_REAPER = r"""
import os, sys
from kvoffload.liveness.park import ParkDir
from kvoffload.syscalls import renameat2
root_fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
parking = ParkDir(root_fd)
park_fd = parking.open()
for name in sys.argv[3:]:
    renameat2(root_fd, name, park_fd, name)
print(parking.name, flush=True)
if sys.argv[2] == "hold":
    sys.stdin.read()
os._exit(0)  # no close(): the directory stays, as a killed reaper leaves it
"""


def _argv(root: Path, mode: str, files: tuple[Path, ...], uid: int | None) -> list[str]:
    prefix = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    for f in files:
        assert f.parent == root, f"{f} is not in {root}"
    return [*prefix, sys.executable, "-c", _REAPER, str(root), mode, *(f.name for f in files)]


def dead_park(root: Path, *files: Path, uid: int | None = None) -> Path:
    """A dead reaper's park directory in ``root``, holding ``files`` (moved from ``root``)."""
    done = subprocess.run(
        _argv(root, "exit", files, uid), capture_output=True, text=True, cwd=REPO, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return root / done.stdout.strip()


@contextmanager
def running_park(root: Path, *files: Path, uid: int | None = None) -> Iterator[Path]:
    """A running reaper's park directory (its lock held) holding ``files``, until the block ends."""
    child = subprocess.Popen(
        _argv(root, "hold", files, uid), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert child.stdout is not None
        yield root / child.stdout.readline().strip()
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
        if child.stdout is not None:
            child.stdout.close()


def parks(root: Path) -> list[str]:
    from kvoffload.liveness.park import PARK_PREFIX

    return sorted(n for n in os.listdir(root) if n.startswith(PARK_PREFIX))
