"""The inputs of ``shmctl init``: vLLM's ``--kv-transfer-config`` and the model's geometry.

Operators keep the engine's config in a file next to the deployment; ``--config FILE``
reads the same JSON, or TOML with the same keys, so the rehearsal runs exactly what vLLM
will run. The bytes per GPU block come from ``--kv-bytes-per-block`` or a model preset.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvoffload.errors import ConfigError
from kvoffload.kv_transfer_config import read_kv_transfer_config
from kvoffload.presets import PRESETS, get_preset
from kvoffload.settings import Lifetime, OffloadingSettings
from kvoffload.shm.names import DEFAULT_ROOT


def load_config(
    *,
    kv_transfer_config: str | None,
    config_file: Path | str | None,
    kv_bytes_per_block: int | None,
    model: str | None,
    world_size: int = 1,
    gpu_block_size: int = 16,
    replicated_layout: bool | None = None,
    root: Path | str = DEFAULT_ROOT,
    lifetime: Lifetime = "kvoffload",
) -> OffloadingSettings:
    """The ``OffloadingSettings`` ``shmctl init`` runs: vLLM's JSON (inline or from a file) plus
    the geometry vLLM would take from the model (given, or from a preset).

    Exactly one of ``kv_transfer_config``/``config_file`` and one of
    ``kv_bytes_per_block``/``model``. A preset's MLA layout implies the replicated layout
    unless ``replicated_layout`` says otherwise.
    """
    if (kv_transfer_config is None) == (config_file is None):
        raise ConfigError(
            "--kv-transfer-config",
            "give vLLM's JSON inline or --config FILE"
            if kv_transfer_config is None
            else "give only one source",
            fix='--kv-transfer-config \'{"kv_connector":"OffloadingConnector",...}\' or --config engine.json',
        )
    if (kv_bytes_per_block is None) == (model is None):
        raise ConfigError(
            "--kv-bytes-per-block",
            "give the KV bytes per GPU block per worker, or a --model preset"
            if model is None
            else "give --kv-bytes-per-block or --model, not both",
            fix="--model " + " | ".join(PRESETS),
        )
    if model is not None:
        preset = get_preset(model)
        _check_positive("--gpu-block-size", gpu_block_size)
        _check_positive("--world-size", world_size)
        kv_bytes_per_block = preset.worker_kv_bytes_per_block(gpu_block_size, world_size)
        if replicated_layout is None:
            replicated_layout = preset.mla
    assert kv_bytes_per_block is not None
    source: str | Mapping[str, Any] = (
        kv_transfer_config if kv_transfer_config is not None else read_kv_transfer_config(config_file or "")
    )
    return OffloadingSettings.from_kv_transfer_config(
        source,
        worker_kv_bytes_per_block=kv_bytes_per_block,
        world_size=world_size,
        gpu_block_size=gpu_block_size,
        replicated_layout=bool(replicated_layout),
        root=Path(root),
        lifetime=lifetime,
    )


def _check_positive(option: str, value: int) -> None:
    if value < 1:
        raise ConfigError(option, f"must be >= 1, got {value}")
