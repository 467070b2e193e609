"""Moved to ``kvoffload.bringup.plan`` (issue #29).

``kvoffload.engine.plan`` re-exports its public names for one release; new code imports
them from their new home.
"""

#: Moved to kvoffload.bringup.plan; kept here for one release (issue #29).
from kvoffload.bringup.plan import (
    CREATOR_ONLY,
    DOCKER_DEFAULT_SHM,
    GIB,
    MAX_WORLD_SIZE,
    MIB,
    SCHEDULER,
    SCHEMA_VERSION,
    TIER_POINTS,
    TIERING_ONLY,
    WORKER,
    Capacity,
    CapacityError,
    Geometry,
    InitPlan,
    PlannedFile,
    PlanStage,
    SlotLayout,
    TierPlan,
    WorkerSlot,
    check_capacity,
    check_world_size,
    participant_names,
    plan,
    plan_stages,
    size_text,
    stage_sides,
)

__all__ = [
    "CREATOR_ONLY",
    "DOCKER_DEFAULT_SHM",
    "GIB",
    "MAX_WORLD_SIZE",
    "MIB",
    "SCHEDULER",
    "SCHEMA_VERSION",
    "TIERING_ONLY",
    "TIER_POINTS",
    "WORKER",
    "Capacity",
    "CapacityError",
    "Geometry",
    "InitPlan",
    "PlanStage",
    "PlannedFile",
    "SlotLayout",
    "TierPlan",
    "WorkerSlot",
    "check_capacity",
    "check_world_size",
    "participant_names",
    "plan",
    "plan_stages",
    "size_text",
    "stage_sides",
]
