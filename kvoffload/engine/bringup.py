"""Moved to ``kvoffload.bringup.kvoffload_engine`` (issue #29).

``kvoffload.engine.bringup`` re-exports its public names for one release; new code imports
them from their new home.
"""

#: Moved to kvoffload.bringup.kvoffload_engine; kept here for one release (issue #29).
from kvoffload.bringup.kvoffload_engine import (
    DEFAULT_IDLE_TIMEOUT_S,
    SKIP_RELEASE_ENV,
    SKIP_RELEASE_ROLES,
    LiveEngine,
    ProgressEvent,
    bring_up,
    mp_context,
    require_torch,
)

__all__ = [
    "DEFAULT_IDLE_TIMEOUT_S",
    "SKIP_RELEASE_ENV",
    "SKIP_RELEASE_ROLES",
    "LiveEngine",
    "ProgressEvent",
    "bring_up",
    "mp_context",
    "require_torch",
]
