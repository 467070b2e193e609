"""Moved to ``kvoffload.bringup.vllm_engine``, ``vllm_inputs`` and ``vllm_evidence`` (issue #29).

``kvoffload.vllm_engine.bringup`` re-exports its public names for one release; new code
imports them from their new home. ``bring_up_vllm`` here keeps its old signature (the
request's fields as keywords) and calls ``kvoffload.bringup.bring_up_vllm`` with one
``BringUpRequest``. (``kvoffload.vllm_engine`` keeps what a vLLM engine loads: ``specs``,
``translate``, ``child``.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvoffload.bringup import vllm_engine
from kvoffload.bringup.faultplan import FailMode, Target
from kvoffload.bringup.report import InitReport

#: DEFAULT_IDLE_TIMEOUT_S moved to kvoffload.bringup.request; kept here for one release (issue #29).
from kvoffload.bringup.request import DEFAULT_IDLE_TIMEOUT_S, BringUpRequest, LiveEngine

#: Moved to kvoffload.bringup.vllm_engine; kept here for one release (issue #29).
from kvoffload.bringup.vllm_engine import DEFAULT_START_TIMEOUT_S, SETTLE_S

#: Moved to kvoffload.bringup.vllm_evidence; kept here for one release (issue #29).
from kvoffload.bringup.vllm_evidence import CLIENT

#: Moved to kvoffload.bringup.vllm_inputs; kept here for one release (issue #29).
from kvoffload.bringup.vllm_inputs import (
    check_vllm_target,
    engine_kv_transfer_config,
    model_kv_bytes_per_block,
    require_vllm,
    vllm_usage,
)
from kvoffload.settings import OffloadingSettings


#: Moved to kvoffload.bringup.bring_up_vllm, which takes a BringUpRequest; this signature is
#: kept here for one release (issue #29).
def bring_up_vllm(
    config: OffloadingSettings,
    *,
    model: Path | str,
    fail_at: Sequence[str] = (),
    fail_mode: FailMode | str = "raise",
    target_rank: Target = None,
    seed: int | None = None,
    roundtrip: bool = True,
    hold: Callable[[LiveEngine], None] | None = None,
    hold_s: float | None = None,
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    settle_s: float = SETTLE_S,
    command: Sequence[str] | None = None,
) -> InitReport:
    """``kvoffload.bringup.bring_up_vllm`` with the request's fields as keywords."""
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
    return vllm_engine.bring_up_vllm(
        request, model=model, start_timeout_s=start_timeout_s, settle_s=settle_s, command=command
    )


__all__ = [
    "CLIENT",
    "DEFAULT_IDLE_TIMEOUT_S",
    "DEFAULT_START_TIMEOUT_S",
    "SETTLE_S",
    "bring_up_vllm",
    "check_vllm_target",
    "engine_kv_transfer_config",
    "model_kv_bytes_per_block",
    "require_vllm",
    "vllm_usage",
]
