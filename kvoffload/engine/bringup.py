"""Moved to ``kvoffload.bringup.kvoffload_engine`` and ``kvoffload.bringup.request`` (issue #29).

``kvoffload.engine.bringup`` re-exports its public names for one release; new code imports
them from their new home. ``bring_up`` here keeps its old signature (the request's fields as
keywords) and calls ``kvoffload.bringup.bring_up`` with one ``BringUpRequest``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvoffload.bringup import kvoffload_engine
from kvoffload.bringup.faultplan import FailMode, Target

#: Moved to kvoffload.bringup.kvoffload_engine; kept here for one release (issue #29).
from kvoffload.bringup.kvoffload_engine import (
    SKIP_RELEASE_ENV,
    SKIP_RELEASE_ROLES,
    ProgressEvent,
    mp_context,
    require_torch,
)
from kvoffload.bringup.report import InitReport

#: Moved to kvoffload.bringup.request; kept here for one release (issue #29).
from kvoffload.bringup.request import DEFAULT_IDLE_TIMEOUT_S, BringUpRequest, LiveEngine
from kvoffload.settings import OffloadingSettings


#: Moved to kvoffload.bringup.bring_up, which takes a BringUpRequest; this signature is kept
#: here for one release (issue #29).
def bring_up(
    config: OffloadingSettings,
    *,
    fail_at: Sequence[str] = (),
    fail_mode: FailMode | str = "raise",
    target_rank: Target = None,
    seed: int | None = None,
    roundtrip: bool = True,
    hold: Callable[[LiveEngine], None] | None = None,
    hold_s: float | None = None,
    progress: Callable[[ProgressEvent], None] | None = None,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    skip_release: str | None = None,
    start_method: str = "forkserver",
) -> InitReport:
    """``kvoffload.bringup.bring_up`` with the request's fields as keywords."""
    request = BringUpRequest(
        config,
        fail_at=fail_at,
        fail_mode=fail_mode,
        target_rank=target_rank,
        seed=seed,
        roundtrip=roundtrip,
        hold=hold,
        hold_s=hold_s,
        idle_timeout_s=idle_timeout_s,
    )
    return kvoffload_engine.bring_up(
        request, progress=progress, skip_release=skip_release, start_method=start_method
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
