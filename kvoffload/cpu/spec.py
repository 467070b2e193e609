"""CPUOffloadingSpec: sizing, the scheduler-side manager and the worker-side region.

Constructing a spec allocates nothing. ``get_manager()`` and ``create_worker()`` build
resources lazily. ``create_worker()`` keeps PR #51227's contract: the region for the
worker's slot is created first, and if the worker cannot be built over it the region is
cleaned and the original exception re-raised. A failure inside the region's own
construction is unwound by the region itself.

Unlike vLLM (which uses the shared region only on CUDA/XPU), the region is used on
every device, so the CPU path is the same code that runs next to a GPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

from kvoffload import faults
from kvoffload.config import CPU_SPEC_SEGMENTS, Lifetime, OffloadingSettings, OffloadingSizing
from kvoffload.cpu.shared_offload_region import Progress, SharedOffloadRegion
from kvoffload.errors import ConfigError
from kvoffload.release import Journal

if TYPE_CHECKING:
    from kvoffload.base import OffloadingManager
    from kvoffload.cpu.gpu_worker import CPUOffloadingWorker

log = logging.getLogger(__name__)


class CPUOffloadingSpec:
    """vLLM's CPU offloading spec: one shared region, one slot per worker in every row."""

    #: Files of the region: segments for regions of >= 2 GiB, as vLLM's CPU spec does.
    region_segments = CPU_SPEC_SEGMENTS

    def __init__(
        self,
        config: OffloadingSettings,
        *,
        barrier: Callable[[], object] | None = None,
        progress: Progress | None = None,
        journal: Journal | None = None,
    ) -> None:
        self.config = config
        self.extra_config = config.extra_config
        sizing: OffloadingSizing = config.sizing
        self.sizing = sizing
        self.num_chunks = sizing.num_chunks
        self.kv_bytes_per_chunk = sizing.kv_bytes_per_chunk
        self.cpu_page_size_per_worker = sizing.cpu_page_size_per_worker
        self.blocks_per_chunk = config.blocks_per_chunk
        self.replicated_layout = config.replicated_layout
        self.eviction_policy = config.eviction_policy
        self.cache_policy_module_path = config.cache_policy_module_path
        self.barrier = barrier
        self.progress = progress
        #: What the last failure unwind released, in order (``shmctl init`` reports it).
        self.journal = journal if journal is not None else Journal()
        self._manager: OffloadingManager | None = None
        self._worker: CPUOffloadingWorker | None = None
        faults.point("validate")

    # ------------------------------------------------------------ scheduler side

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            from kvoffload.cpu.manager import CPUOffloadingManager

            faults.point("manager")
            self._manager = CPUOffloadingManager(
                self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                store_threshold=self.config.store_threshold,
                max_tracker_size=self.config.max_tracker_size,
            )
        return self._manager

    # ------------------------------------------------------------ worker side

    def expected_participants(self) -> int:
        """Processes that map the region: every worker (the tiering spec adds the scheduler)."""
        return self.config.world_size

    def region_lifetime(self) -> Lifetime:
        # vLLM 0.33's CPU spec already unlinks once every worker mapped (barrier, PR #52596),
        # so both lifetimes behave the same here; only the tiering spec differs.
        return "kvoffload"

    def worker_region_kwargs(self) -> dict[str, Any]:
        cfg = self.config
        kwargs: dict[str, Any] = {
            "num_segments": self.region_segments,
            "barrier": self.barrier,
        }
        if self.replicated_layout:
            kwargs["populate_shard"] = (cfg.rank, cfg.world_size)
        return kwargs

    def create_region(self, rank: int | None, **kwargs: Any) -> SharedOffloadRegion:
        cfg = self.config
        participant = cfg.world_size if rank is None else cfg.rank
        return SharedOffloadRegion(
            cfg.engine_id,
            self.num_chunks,
            rank,
            self.kv_bytes_per_chunk,
            self.cpu_page_size_per_worker,
            root=cfg.root,
            participant=participant,
            participants=self.expected_participants(),
            lifetime=self.region_lifetime(),
            progress=self.progress,
            journal=self.journal,
            **kwargs,
        )

    def create_worker(self, kv_caches: Sequence[Any]) -> CPUOffloadingWorker:
        """Map this worker's slot of the region, then build the worker over it (PR #51227)."""
        from kvoffload.cpu.gpu_worker import CPUOffloadingWorker

        if self.num_chunks <= 0:
            raise ConfigError(
                "cpu_bytes_to_use", "is smaller than one chunk: the region would be empty", fix="raise it"
            )
        rank = 0 if self.replicated_layout else self.config.rank
        region = self.create_region(rank, **self.worker_region_kwargs())
        with ExitStack() as undo:
            # The caller (we) owns the region until the worker's constructor returns.
            undo.callback(self.journal.quietly, f"clean worker region {region.path.name}", region.cleanup)
            faults.point("worker")
            worker = CPUOffloadingWorker(
                kv_caches,
                self.blocks_per_chunk,
                self.num_chunks,
                mmap_region=region,
                canonical_layout=self.config.canonical_layout,
            )
            undo.pop_all()
        return worker

    def get_worker(self, kv_caches: Sequence[Any]) -> CPUOffloadingWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker
