"""Moved to ``kvoffload.bringup.participant`` (issue #29).

``kvoffload.engine.participant`` re-exports its public names for one release; new code imports
them from their new home.
"""

#: Moved to kvoffload.bringup.participant; kept here for one release (issue #29).
from kvoffload.bringup.participant import (
    SCHEDULER,
    WORKER,
    ParticipantArgs,
    main,
)

__all__ = [
    "SCHEDULER",
    "WORKER",
    "ParticipantArgs",
    "main",
]
