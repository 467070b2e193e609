"""The ``kv_transfer_config`` a scenario gives its engine, for each spec it runs.

``cpu`` and ``tiering`` are kvoffload's specs, loaded by vLLM's factory as out-of-tree specs
(``spec_module_path`` is ``kvoffload.vllm_engine.specs``, the path users' configs name) under
the names of ``kvoffload.vllm_engine.SPEC_NAMES``; ``vllm`` is vLLM's own ``CPUOffloadingSpec``.
"""

from __future__ import annotations

from typing import Any

SPEC_MODULE_PATH = "kvoffload.vllm_engine.specs"
CPU_BYTES = 8 << 20


def kv_transfer_config(spec: str, engine_id: str, **extra: Any) -> dict[str, Any]:
    if spec == "vllm":
        extra_config: dict[str, Any] = {"spec_name": "CPUOffloadingSpec", "cpu_bytes_to_use": CPU_BYTES}
    else:
        from kvoffload.vllm_engine import SPEC_NAMES

        extra_config = {
            "spec_name": SPEC_NAMES["TieringOffloadingSpec" if spec == "tiering" else "CPUOffloadingSpec"],
            "spec_module_path": SPEC_MODULE_PATH,
            "cpu_bytes_to_use": CPU_BYTES,
        }
        if spec == "tiering":
            extra_config["secondary_tiers"] = [{"type": "example"}]
    extra_config.update(extra)
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": extra_config,
    }
