"""Evidence from kvoffload's lock: is a participant attached, in any PID namespace?

Every kvoffload participant holds ``flock(LOCK_SH)`` on each region file it maps, for as
long as it maps it; the kernel drops the lock when the last fd of that open file
description closes, SIGKILL included. A refused ``LOCK_EX|LOCK_NB`` therefore proves a
participant is attached, wherever it runs; a granted one proves none is (vLLM's own files
carry no lock, so for them a granted probe proves nothing). The probe is released at once:
the caller closes the fd.
"""

from __future__ import annotations

import errno
import fcntl


def probe(fd: int) -> tuple[bool | None, str | None]:
    """``(True, None)`` held by someone, ``(False, None)`` free, ``(None, why)`` no answer."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True, None
    except OSError as e:
        return None, f"lock probe failed ({errno.errorcode.get(e.errno or 0, e)})"
    return False, None
