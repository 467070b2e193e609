"""A real process's peak RSS: the kernel's high-water mark, ``VmHWM``, read while it runs.

Not ``wait4``'s ``ru_maxrss``: it keeps the high-water mark of the memory the child ran in
before its ``exec``, the forking test's own. ``VmHWM`` only grows, so the last reading before
the process exits is its peak (read every 10 ms).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tests.support.procs import REPO


def run_with_peak(
    argv: Sequence[str], stdout: Path, stderr: Path, *, timeout: float = 300
) -> tuple[int, int]:
    """Run ``argv`` (in the checkout, stdin empty, output to the two files): its exit status
    and its ``VmHWM`` in bytes. Killed, and the error raised, past ``timeout`` seconds."""
    with stdout.open("wb") as out, stderr.open("wb") as err:
        proc = subprocess.Popen(list(argv), cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=err)
    peak = [0]
    done = threading.Event()

    def look() -> None:
        status = Path(f"/proc/{proc.pid}/status")
        while not done.is_set():
            try:
                text = status.read_text()
            except OSError:
                return
            for line in text.splitlines():
                if line.startswith("VmHWM:"):
                    peak[0] = max(peak[0], int(line.split()[1]) * 1024)
            time.sleep(0.01)

    looker = threading.Thread(target=look, daemon=True)
    looker.start()
    try:
        proc.wait(timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        done.set()
        looker.join(5)
    return proc.returncode, peak[0]
