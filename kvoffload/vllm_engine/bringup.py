"""Moved to ``kvoffload.bringup.vllm_engine`` (issue #29).

``kvoffload.vllm_engine.bringup`` re-exports its public names for one release; new code imports
them from their new home.
"""

#: Moved to kvoffload.bringup.vllm_engine; kept here for one release (issue #29).
from kvoffload.bringup.vllm_engine import (
    CLIENT,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    SETTLE_S,
    bring_up_vllm,
    check_vllm_target,
    engine_kv_transfer_config,
    model_kv_bytes_per_block,
    require_vllm,
    vllm_usage,
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
