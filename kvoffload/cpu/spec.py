"""CPUOffloadingSpec: sizing, the scheduler-side manager and the worker-side region.

A spec is built from vLLM's ``OffloadingConfig`` (``CPUOffloadingSpec(config)``, as vLLM's
connector and ``OffloadingSpecFactory`` build it), or from our ``OffloadingSettings`` with
``from_settings`` (``shmctl init``); both read the config through
``OffloadingSettings.from_offloading_config``, so there is one parse and one sizing.

Constructing a spec allocates nothing. ``get_manager()`` and ``create_worker()`` build
resources lazily. ``create_worker()`` keeps PR #51227's contract: the region for the
worker's slot is created first, and if the worker cannot be built over it the region is
cleaned and the original exception re-raised. A failure inside the region's own
construction is unwound by the region itself.

Where the worker's CPU buffer lives: the shared region where vLLM uses it (CUDA but not
ROCm, and XPU), else a private tensor per worker, as vLLM does. ``replicated_layout`` (one
copy for every worker) is honoured only over the shared region: with private buffers the
rank-0 writer would leave the other ranks' copies empty. ``from_settings`` asks for the
region on every device, so ``shmctl init`` on a CPU machine rehearses the real layout.

An empty cache (a zero-byte block, or less memory than one chunk) has zero chunks and no
region file: the worker gets empty private buffers, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Self

from kvoffload import faults
from kvoffload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
)
from kvoffload.config import OffloadingConfig
from kvoffload.cpu.common import CPUOffloadingInfo, CPUOffloadingMetrics
from kvoffload.cpu.gpu_worker import CPUOffloadingWorker
from kvoffload.cpu.manager import CPUOffloadingManager
from kvoffload.cpu.prefault import Progress
from kvoffload.cpu.shared_offload_region import SharedOffloadRegion
from kvoffload.platforms import current_platform
from kvoffload.release import Journal
from kvoffload.settings import CPU_SPEC_SEGMENTS, Lifetime, OffloadingSettings
from kvoffload.shm.names import DEFAULT_ROOT

log = logging.getLogger(__name__)

#: Sizes of the prepare_store batches the allocation histogram counts, in chunks.
_ALLOCATION_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class CPUOffloadingSpec(OffloadingSpec):
    """vLLM's CPU offloading spec: one shared region, one slot per worker in every row."""

    #: Rows are padded to this, as the region maps them (vLLM's name).
    BLOCK_SIZE_ALIGNMENT = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    #: Files of the region: segments for regions of >= 2 GiB, as vLLM's CPU spec does.
    region_segments = CPU_SPEC_SEGMENTS

    @classmethod
    def build_metric_definitions(cls, extra_config: Mapping[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        definitions: dict[str, OffloadingMetricMetadata] = {
            CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Share of the CPU KV cache held by transfers in flight (1.0: full)."
            ),
            CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Share of the CPU KV cache held by stores not yet completed (1.0: full)."
            ),
            CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Share of the CPU KV cache held by loads not yet completed (1.0: full)."
            ),
            CPUOffloadingMetrics.CPU_ALLOCATION_SIZE: OffloadingHistogramMetadata(
                documentation="CPU chunks asked for by each prepare_store call.",
                buckets=_ALLOCATION_BUCKETS,
            ),
        }
        if _store_threshold(extra_config) >= 2:
            definitions[CPUOffloadingMetrics.STORES_SKIPPED] = OffloadingCounterMetadata(
                documentation="Stores skipped because the block had not been offered store_threshold times."
            )
        return definitions

    @classmethod
    def config_info_keys(cls, extra_config: Mapping[str, Any]) -> tuple[str, ...]:
        return CPUOffloadingInfo.config_info_keys()

    def __init__(
        self,
        config: OffloadingConfig,
        *,
        root: Path | str = DEFAULT_ROOT,
        lifetime: Lifetime = "kvoffload",
        shared_region: bool | None = None,
        barrier: Callable[[], object] | None = None,
        progress: Progress | None = None,
        journal: Journal | None = None,
    ) -> None:
        """``shared_region``: ``None`` maps the region where vLLM does; ``True`` on every device."""
        super().__init__(config)
        self._shared_region = shared_region
        settings = OffloadingSettings.from_offloading_config(config, root=root, lifetime=lifetime)
        self.replicated_layout = settings.replicated_layout and self._uses_shared_region()
        if settings.replicated_layout and not self.replicated_layout:
            settings = dataclasses.replace(settings, replicated_layout=False)
        #: The checked settings every size and every call below is taken from.
        self.settings = settings
        sizing = settings.sizing
        self.sizing = sizing
        self.num_chunks = sizing.num_chunks
        self.kv_bytes_per_chunk = sizing.kv_bytes_per_chunk
        self.cpu_page_size_per_worker = sizing.cpu_page_size_per_worker
        self.cpu_info = CPUOffloadingInfo.from_config(config, self.num_chunks, self.kv_bytes_per_chunk)
        self.eviction_policy = settings.eviction_policy
        self.cache_policy_module_path = settings.cache_policy_module_path
        self.barrier = barrier
        self.progress = progress
        #: What the last failure unwind released, in order (``shmctl init`` reports it).
        self.journal = journal if journal is not None else Journal()
        self._manager: OffloadingManager | None = None
        self._worker: CPUOffloadingWorker | None = None
        faults.point("validate")

    @classmethod
    def from_settings(
        cls,
        settings: OffloadingSettings,
        *,
        barrier: Callable[[], object] | None = None,
        progress: Progress | None = None,
        journal: Journal | None = None,
    ) -> Self:
        """The spec of ``settings`` (``shmctl init``): the shared region on every device."""
        return cls(
            settings.to_offloading_config(),
            root=settings.root,
            lifetime=settings.lifetime,
            shared_region=True,
            barrier=barrier,
            progress=progress,
            journal=journal,
        )

    # ------------------------------------------------------------ scheduler side

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            faults.point("manager")
            self._manager = CPUOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=self.settings.store_threshold,
                max_tracker_size=self.settings.max_tracker_size,
                info=self.cpu_info,
            )
        return self._manager

    # ------------------------------------------------------------ worker side

    def _uses_shared_region(self) -> bool:
        """Whether a worker's buffer is the shared region rather than a private tensor."""
        if self._shared_region is not None:
            return self._shared_region
        platform = current_platform
        return (platform.is_cuda_alike() and not platform.is_rocm()) or platform.is_xpu()

    def expected_participants(self) -> int:
        """Processes that map the region: every worker (the tiering spec adds the scheduler)."""
        return self.settings.world_size

    def region_lifetime(self) -> Lifetime:
        # vLLM 0.33's CPU spec already unlinks once every worker mapped (barrier, PR #52596),
        # so both lifetimes behave the same here; only the tiering spec differs.
        return "kvoffload"

    def worker_region_kwargs(self) -> dict[str, Any]:
        cfg = self.settings
        return {
            "barrier": self.barrier,
            "num_segments": self.region_segments,
            "populate_shard": (cfg.rank, cfg.world_size) if self.replicated_layout else None,
        }

    def create_region(self, rank: int | None, **kwargs: Any) -> SharedOffloadRegion:
        """This engine's region, as worker ``rank`` (``None``: the scheduler's whole mapping)."""
        cfg = self.settings
        return self._new_region(
            engine_id=cfg.engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
            root=cfg.root,
            participant=cfg.world_size if rank is None else cfg.rank,
            participants=self.expected_participants(),
            lifetime=self.region_lifetime(),
            progress=self.progress,
            journal=self.journal,
            **kwargs,
        )

    def create_worker(self, kv_caches: Any) -> CPUOffloadingWorker:
        """Map this worker's slot of the region, then build the worker over it (PR #51227)."""
        region: SharedOffloadRegion | None = None
        # Zero chunks would be a zero-byte file, which cannot be mapped: empty private buffers.
        if self._uses_shared_region() and self.num_chunks > 0:
            region = self.create_region(
                0 if self.replicated_layout else self.settings.rank, **self.worker_region_kwargs()
            )
        with ExitStack() as undo:
            # The caller (we) owns the region until the worker's constructor returns.
            if region is not None:
                undo.callback(self.journal.quietly, f"clean worker region {region.path.name}", region.cleanup)
            self._check_worker_caches(kv_caches)
            faults.point("worker")
            worker = self._new_worker(
                kv_caches=kv_caches,
                blocks_per_chunk=self.blocks_per_chunk,
                num_cpu_chunks=self.num_chunks,
                mmap_region=region,
                canonical_layout=self.settings.canonical_layout,
            )
            undo.pop_all()
        return worker

    def get_worker(self, kv_caches: Any) -> CPUOffloadingWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    # The constructors are this module's names, looked up at each call: vLLM's tests replace
    # them per spec module, and the tiering spec's module has its own.
    def _new_region(self, **kwargs: Any) -> SharedOffloadRegion:
        return SharedOffloadRegion(**kwargs)

    def _new_worker(self, **kwargs: Any) -> CPUOffloadingWorker:
        return CPUOffloadingWorker(**kwargs)

    def _check_worker_caches(self, kv_caches: Any) -> None:
        """Refuse caches no worker may be built over; the region is cleaned (tiering: canonical refs)."""


def _store_threshold(extra_config: Mapping[str, Any]) -> int:
    try:
        return int(extra_config.get("store_threshold", 0))
    except (TypeError, ValueError):
        return 0  # the spec's own parse names the key; metrics only need to know it is not set
