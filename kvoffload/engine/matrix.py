"""Moved to ``kvoffload.bringup.matrix`` (issue #29).

``kvoffload.engine.matrix`` re-exports its public names for one release; new code imports
them from their new home.
"""

#: Moved to kvoffload.bringup.matrix; kept here for one release (issue #29).
from kvoffload.bringup.matrix import DEFAULT_MODES, run_matrix

__all__ = [
    "DEFAULT_MODES",
    "run_matrix",
]
