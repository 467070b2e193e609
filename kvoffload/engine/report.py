"""Moved to ``kvoffload.bringup.report`` and ``kvoffload.bringup.residue`` (issue #29).

``kvoffload.engine.report`` re-exports its public names for one release; new code imports
them from their new home. ``Verdict``, the outcome of a bring-up, is now ``BringUpOutcome``
(``kvoffload.liveness`` has a ``Verdict`` of its own, a region's status and reason).
"""

#: Moved to kvoffload.bringup.report; kept here for one release (issue #29).
from kvoffload.bringup.report import (
    SCHEMA_VERSION,
    BringUpOutcome,
    CleanupStep,
    CrashInfo,
    EngineProcess,
    EngineRoundtrip,
    ErrorInfo,
    InitReport,
    InjectedFaultInfo,
    KeptFile,
    LogLine,
    MatrixCell,
    MatrixReport,
    MatrixStop,
    StageResult,
    VllmEngineInfo,
    judge,
)

#: Moved to kvoffload.bringup.residue; kept here for one release (issue #29).
from kvoffload.bringup.residue import (
    LEFT_RUNNING_GRACE_S,
    Footprint,
    HeldHandle,
    Residue,
    ResidueFile,
    held_handles,
    left_running,
    measure_residue,
)

#: Renamed kvoffload.bringup.report.BringUpOutcome; kept here for one release (issue #29).
Verdict = BringUpOutcome

__all__ = [
    "LEFT_RUNNING_GRACE_S",
    "SCHEMA_VERSION",
    "CleanupStep",
    "CrashInfo",
    "EngineProcess",
    "EngineRoundtrip",
    "ErrorInfo",
    "Footprint",
    "HeldHandle",
    "InitReport",
    "InjectedFaultInfo",
    "KeptFile",
    "LogLine",
    "MatrixCell",
    "MatrixReport",
    "MatrixStop",
    "Residue",
    "ResidueFile",
    "StageResult",
    "Verdict",
    "VllmEngineInfo",
    "held_handles",
    "judge",
    "left_running",
    "measure_residue",
]
