"""vLLM's offloading config dataclasses, field for field (``vllm/v1/kv_offload/config.py``).

These are what vLLM's connector hands a spec: the KV cache groups, the model, the cache's
chunk geometry and the parallel layout. Like vLLM's own module this one imports only the
standard library, so any layer (``base``, the specs, the tiers) can name these types
without importing a registry.

Reading and checking vLLM's ``--kv-transfer-config`` into our ``OffloadingSettings``, and the
sizing vLLM derives from it, is ``kvoffload.settings``'s (which imports this module, never
the reverse).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OffloadingGroupConfig:
    """One KV cache group as vLLM's connector hands it to a spec."""

    tokens_per_block: int
    layer_names: tuple[str, ...]
    group_id: int
    # Chunks a tier keeps per request for a sliding-window group; None for full attention.
    sliding_window_size_in_chunks: int | None = None


@dataclass(frozen=True)
class OffloadingModelConfig:
    name: str
    dtype: str
    max_model_len: int = 0


@dataclass(frozen=True)
class OffloadingCacheConfig:
    tokens_per_hash: int
    blocks_per_chunk: int


@dataclass(frozen=True)
class OffloadingParallelConfig:
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    data_parallel_index: int
    data_parallel_size: int
    data_parallel_rank_local: int | None
    is_parallelism_agnostic: bool

    @classmethod
    def tensor_parallel(
        cls, rank: int, world_size: int, *, is_parallelism_agnostic: bool = False
    ) -> OffloadingParallelConfig:
        """One engine of ``world_size`` tensor-parallel workers: no PP, CP or DP."""
        return cls(
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=is_parallelism_agnostic,
        )


@dataclass(frozen=True)
class OffloadingConfig:
    """What vLLM 0.33's connector gives a spec, field for field (``vllm/v1/kv_offload/config.py``).

    A spec reads its own settings out of ``extra_config`` (``OffloadingSettings.from_offloading_config``,
    in ``kvoffload.settings``) the way vLLM's specs do; ``OffloadingSettings.from_kv_transfer_config``
    is the strict path the CLI takes from a JSON file.
    """

    groups: tuple[OffloadingGroupConfig, ...]
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: Mapping[str, Any]
    engine_id: str
    model: OffloadingModelConfig
    cache: OffloadingCacheConfig
    parallel: OffloadingParallelConfig
    replicated_layout: bool = False
    canonical_layout: bool = False
    kv_cache_layout: str | None = None


#: Moved to ``kvoffload.settings`` (and the bounded reader to ``kvoffload.kv_transfer_config``);
#: kept here for one release (issue #29).
_MOVED = {
    "PAGESIZE": "settings",
    "SPEC_NAMES": "settings",
    "CPU_SPEC_SEGMENTS": "settings",
    "MAX_CPU_BYTES": "settings",
    "MAX_BLOCKS_PER_CHUNK": "settings",
    "MAX_COUNT": "settings",
    "MAX_TIER_POLL_INTERVAL_S": "settings",
    "Lifetime": "settings",
    "OffloadingSizing": "settings",
    "OffloadingSettings": "settings",
    "MAX_CONFIG_BYTES": "kv_transfer_config",
    "read_kv_transfer_config": "kv_transfer_config",
}


def __getattr__(name: str) -> Any:
    """A name that moved out of this module, imported from its new home when first asked for.

    Lazily, because ``kvoffload.settings`` imports this module: importing it back at the top
    would make the import circle this split removed.
    """
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from kvoffload import kv_transfer_config, settings

    return getattr(settings if home == "settings" else kv_transfer_config, name)
