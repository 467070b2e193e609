"""Moved to ``kvoffload.bringup.faultplan`` (issue #29).

``kvoffload.engine.faultplan`` re-exports its public names for one release; new code imports
them from their new home.
"""

#: Moved to kvoffload.bringup.faultplan; kept here for one release (issue #29).
from kvoffload.bringup.faultplan import (
    CLEANUP_POINTS,
    MARKER,
    MODE_HELP,
    MODE_KINDS,
    RAISE_KINDS,
    FailMode,
    FaultPlan,
    Target,
    build_fault_plan,
    markers_only,
    parse_target,
)

__all__ = [
    "CLEANUP_POINTS",
    "MARKER",
    "MODE_HELP",
    "MODE_KINDS",
    "RAISE_KINDS",
    "FailMode",
    "FaultPlan",
    "Target",
    "build_fault_plan",
    "markers_only",
    "parse_target",
]
