"""What the CPU tier's manager, worker and spec share: its load/store spec, its metric names and
its info labels (vLLM's ``kv_offload/cpu/common.py``).

``CPUOffloadingInfo`` is computed once, by the spec, from the same sizing the region is
built with, so a label can never disagree with the memory behind it. The manager only
renders it (``config_info()``); the tiering spec hands the same facts to its primary tier,
so a CPU fact has one name whether the CPU cache stands alone or under a tiering manager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from kvoffload.base import BlockIDsLoadStoreSpec, ConfigInfo, Medium

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from kvoffload.config import OffloadingConfig


class CPUOffloadingMetrics:
    """Prometheus names of the CPU tier's metrics (the spec declares them, the manager fills them)."""

    STORES_SKIPPED = "vllm:kv_offload_stores_skipped"
    CPU_CACHE_USAGE_PERC = "vllm:kv_offload_cpu_cache_usage_perc"
    CPU_ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
    CPU_CACHE_WRITE_USAGE_PERC = "vllm:kv_offload_cpu_cache_write_usage_perc"
    CPU_CACHE_READ_USAGE_PERC = "vllm:kv_offload_cpu_cache_read_usage_perc"


@dataclass(frozen=True, slots=True, init=False, eq=False)
class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """CPU region chunk ids; one chunk holds ``blocks_per_chunk`` GPU blocks.

    ``chunk_ids`` is ``block_ids`` under the name the tiering layer uses: here the ids
    index chunks of the CPU region, not GPU blocks.
    """

    MEDIUM: ClassVar[Medium] = Medium.CPU

    @property
    def chunk_ids(self) -> NDArray[np.int32]:
        return self.block_ids


@dataclass(frozen=True)
class CPUOffloadingInfo(ConfigInfo):
    """The CPU tier's fixed facts, one info label each.

    ``cpu_kv_cache_size_tokens`` is the KV tokens the tier holds for requests of
    ``max_model_len`` tokens; ``None`` when that length or every KV cache group is unknown.
    """

    cpu_num_chunks: int
    cpu_blocks_per_chunk: int
    cpu_kv_cache_size_bytes: int
    cpu_kv_cache_size_tokens: int | None

    @classmethod
    def from_config(
        cls, config: OffloadingConfig, num_chunks: int, kv_bytes_per_chunk: int
    ) -> CPUOffloadingInfo:
        return cls(
            cpu_num_chunks=num_chunks,
            cpu_blocks_per_chunk=config.cache.blocks_per_chunk,
            cpu_kv_cache_size_bytes=num_chunks * kv_bytes_per_chunk,
            cpu_kv_cache_size_tokens=_capacity_tokens(config, num_chunks),
        )


def _capacity_tokens(config: OffloadingConfig, num_chunks: int) -> int | None:
    # A request of max_model_len tokens takes, in every group, one chunk per chunk of its
    # tokens (fewer for a sliding window); the tier holds num_chunks / that many requests.
    max_model_len = config.model.max_model_len
    if max_model_len <= 0 or not config.groups:
        return None
    chunks_per_request = 0
    for group in config.groups:
        tokens_per_chunk = group.tokens_per_block * config.cache.blocks_per_chunk
        chunks = -(-max_model_len // tokens_per_chunk)
        if group.sliding_window_size_in_chunks is not None:
            chunks = min(chunks, group.sliding_window_size_in_chunks)
        chunks_per_request += chunks
    return num_chunks * max_model_len // chunks_per_request


__all__ = ["CPULoadStoreSpec", "CPUOffloadingInfo", "CPUOffloadingMetrics"]
