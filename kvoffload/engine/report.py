"""Moved to ``kvoffload.bringup.report`` (issue #29).

``kvoffload.engine.report`` re-exports its public names for one release; new code imports
them from their new home.
"""

#: Moved to kvoffload.bringup.report; kept here for one release (issue #29).
from kvoffload.bringup.report import (
    LEFT_RUNNING_GRACE_S,
    SCHEMA_VERSION,
    CleanupStep,
    CrashInfo,
    EngineProcess,
    EngineRoundtrip,
    ErrorInfo,
    Footprint,
    HeldHandle,
    InitReport,
    InjectedFaultInfo,
    KeptFile,
    LogLine,
    MatrixCell,
    MatrixReport,
    MatrixStop,
    Residue,
    ResidueFile,
    StageResult,
    Verdict,
    VllmEngineInfo,
    held_handles,
    judge,
    left_running,
    measure_residue,
)

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
