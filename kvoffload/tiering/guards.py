"""Moved to ``kvoffload.tiering.hosted_wrappers`` (issue #29): this module re-exports its names.

The old name read like ``liveness``'s lease guard; the new one says what the module holds, the
wrappers put around the hosted tiers' methods.
"""

#: Moved to kvoffload.tiering.hosted_wrappers; kept here for one release (issue #29).
from kvoffload.tiering.hosted_wrappers import GUARDS, Guard, apply, guard

__all__ = ["GUARDS", "Guard", "apply", "guard"]
