"""TieringOffloadingSpec: the CPU spec plus a scheduler-side region, a primary tier and
secondary tiers, with PR #51227's init-failure cleanup on every branch.

``get_manager()`` builds, in vLLM's order: the scheduler's whole-region mapping, the
primary (CPU) tier over it, each secondary tier from the factory, the tiering manager.
Each acquisition registers its undo at once, so any exception unwinds in reverse:
secondary tiers (last built first), then the primary tier (which cleans the region),
then the bare region (a no-op if the primary already cleaned it; it matters when the
primary was never built, or when its shutdown failed half-way), then the saved region is
reset. The original exception is re-raised unchanged; a failing release step is logged
and recorded in the journal, never raised in its place.

Lifetime: the scheduler is participant ``world_size`` of ``world_size + 1``; with our
lifetime the path disappears once the workers and the scheduler have all mapped it
(vLLM #57303 leaks it for the engine's whole life; ``lifetime="vllm"`` does that too).
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import TYPE_CHECKING, Any

from kvoffload import faults
from kvoffload.config import Lifetime
from kvoffload.cpu.spec import CPUOffloadingSpec
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from kvoffload.base import OffloadingManager
    from kvoffload.cpu.shared_offload_region import SharedOffloadRegion
    from kvoffload.tiering.base import SecondaryTierManager


class TieringOffloadingSpec(CPUOffloadingSpec):
    #: vLLM's tiering regions are always one file.
    region_segments = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.secondary_tier_configs = [dict(t) for t in self.config.secondary_tiers]
        self.tier_poll_interval_s = self.config.tier_poll_interval_s
        self._scheduler_mmap: SharedOffloadRegion | None = None

    def expected_participants(self) -> int:
        return self.config.world_size + 1

    def region_lifetime(self) -> Lifetime:
        return self.config.lifetime

    def worker_region_kwargs(self) -> dict[str, Any]:
        # vLLM's tiering spec passes no barrier, no segments and no populate shard.
        return {}

    def get_manager(self) -> OffloadingManager:
        if self._manager is not None:
            return self._manager
        if self.config.store_threshold >= 2:
            raise ConfigError(
                "kv_connector_extra_config.store_threshold",
                "store_threshold is not supported for TieringOffloadingSpec",
            )
        from kvoffload.tiering.manager import (
            CPUPrimaryTierOffloadingManager,
            TieringOffloadingManager,
            shutdown_primary,
            shutdown_secondary,
        )
        from kvoffload.tiering.tiers import SecondaryTierFactory

        with ExitStack() as undo:
            undo.callback(self._forget_scheduler_region)
            faults.point("scheduler.region")
            region = self.create_region(None)
            self._scheduler_mmap = region
            undo.callback(self.journal.quietly, f"clean scheduler region {region.path.name}", region.cleanup)

            faults.point("primary")
            primary = CPUPrimaryTierOffloadingManager(
                self.num_chunks,
                region,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
            )
            undo.callback(self.journal.quietly, "shut down primary tier", partial(shutdown_primary, primary))
            view = primary.get_kv_memoryview()

            secondaries: list[SecondaryTierManager] = []
            for index, tier_config in enumerate(self.secondary_tier_configs):
                faults.point("secondary", index=index)
                tier = SecondaryTierFactory.create_secondary_tier(dict(tier_config), view, self, index=index)
                secondaries.append(tier)
                kind = tier_config.get("type", "?")
                undo.callback(
                    self.journal.quietly,
                    f"shut down secondary tier {index} ({kind})",
                    partial(shutdown_secondary, index, tier),
                )

            faults.point("manager")
            manager = TieringOffloadingManager(
                primary, secondaries, tier_poll_interval_s=self.tier_poll_interval_s
            )
            undo.pop_all()
        self._manager = manager
        return manager

    def _forget_scheduler_region(self) -> None:
        self._scheduler_mmap = None
