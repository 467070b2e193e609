"""The lease watchdog, under its old name: it lives in ``kvoffload.liveness.watchdog`` now.

Named like ``kvoffload.tiering.guards`` (fault wrappers), which it has nothing to do with.
Nothing in kvoffload imports this module.
"""

from __future__ import annotations

#: Moved to ``kvoffload.liveness.watchdog``; kept here for one release (issue #29).
from kvoffload.liveness.watchdog import (
    DISABLE_ENV,
    HOLD_LIMIT_S,
    POLL_S,
    SLOTS,
    GuardStatus,
    adopt,
    drop,
    hold,
    start,
    status,
)

__all__ = [
    "DISABLE_ENV",
    "HOLD_LIMIT_S",
    "POLL_S",
    "SLOTS",
    "GuardStatus",
    "adopt",
    "drop",
    "hold",
    "start",
    "status",
]
