"""Moved to ``kvoffload.bringup`` (issue #29).

``kvoffload.engine`` re-exports its public names for one release; new code imports
them from their new home.
"""

#: Moved to kvoffload.bringup; kept here for one release (issue #29).
from kvoffload.bringup import (
    DEFAULT_MODES,
    SKIP_RELEASE_ENV,
    FailMode,
    InitPlan,
    InitReport,
    LiveEngine,
    MatrixCell,
    MatrixReport,
    ProgressEvent,
    Target,
    build_fault_plan,
    parse_target,
    plan,
    run_matrix,
)

#: kvoffload.bringup.bring_up takes a BringUpRequest; the old signature is kept here for one
#: release (issue #29).
from kvoffload.engine.bringup import bring_up

#: Renamed kvoffload.bringup.BringUpOutcome; kept here for one release (issue #29).
from kvoffload.engine.report import Verdict

__all__ = [
    "DEFAULT_MODES",
    "SKIP_RELEASE_ENV",
    "FailMode",
    "InitPlan",
    "InitReport",
    "LiveEngine",
    "MatrixCell",
    "MatrixReport",
    "ProgressEvent",
    "Target",
    "Verdict",
    "bring_up",
    "build_fault_plan",
    "parse_target",
    "plan",
    "run_matrix",
]
