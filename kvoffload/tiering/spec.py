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

The region is used on every device (the scheduler maps it too), so ``replicated_layout``
is always honoured. A configuration of zero chunks is refused when the spec is built:
its region would be a zero-byte file, which vLLM's tiering spec fails to map only later,
in ``get_manager`` or ``create_worker``.

Lifetime: the scheduler is participant ``world_size`` of ``world_size + 1``; with our
lifetime the path disappears once the workers and the scheduler have all mapped it
(vLLM #57303 leaks it for the engine's whole life; ``lifetime="vllm"`` does that too).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from contextlib import ExitStack
from functools import partial
from typing import Any

from kvoffload import faults
from kvoffload.base import (
    CanonicalKVCaches,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
)
from kvoffload.cpu.gpu_worker import CPUOffloadingWorker
from kvoffload.cpu.shared_offload_region import SharedOffloadRegion
from kvoffload.cpu.spec import CPUOffloadingSpec
from kvoffload.errors import ConfigError, KvOffloadError, ReservedLabelError
from kvoffload.settings import Lifetime
from kvoffload.tiering.base import TIER_LABEL, SecondaryTierManager, TieringOffloadingMetrics
from kvoffload.tiering.factory import SecondaryTierFactory
from kvoffload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
    shutdown_primary,
    shutdown_secondary,
)

log = logging.getLogger(__name__)

_SYNC_LOOKUP_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1)
_ASYNC_LOOKUP_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10)
_PROMOTION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BY_TIER = (TIER_LABEL,)

M = TieringOffloadingMetrics
#: The tiering manager's own metrics, before the tiers' (name, metadata), in vLLM's order.
_MANAGER_METRICS: tuple[tuple[str, OffloadingMetricMetadata], ...] = (
    (
        M.LOOKUP_SYNC_DELAY,
        OffloadingHistogramMetadata(
            "Seconds a per-chunk tier lookup blocked before it answered hit or miss, by tier.",
            _BY_TIER,
            _SYNC_LOOKUP_BUCKETS,
        ),
    ),
    (
        M.LOOKUP_ASYNC_DELAY,
        OffloadingHistogramMetadata(
            "Seconds from a tier lookup's first retry to its hit or miss, by tier.",
            _BY_TIER,
            _ASYNC_LOOKUP_BUCKETS,
        ),
    ),
    (
        M.READ_BYTES,
        OffloadingCounterMetadata(
            "Bytes promoted from a secondary tier into the primary, by tier.", _BY_TIER
        ),
    ),
    (
        M.READ_TIME,
        OffloadingCounterMetadata(
            "Seconds spent promoting from a secondary tier, by tier (tiers that time their jobs only).",
            _BY_TIER,
        ),
    ),
    (
        M.WRITE_BYTES,
        OffloadingCounterMetadata(
            "Bytes cascaded from the primary into a secondary tier, by tier.", _BY_TIER
        ),
    ),
    (
        M.WRITE_TIME,
        OffloadingCounterMetadata(
            "Seconds spent cascading into a secondary tier, by tier (tiers that time their jobs only).",
            _BY_TIER,
        ),
    ),
    (M.PROMOTION_JOB_FAILURES, OffloadingCounterMetadata("Promotion jobs that failed, by tier.", _BY_TIER)),
    (M.CASCADE_JOB_FAILURES, OffloadingCounterMetadata("Cascade jobs that failed, by tier.", _BY_TIER)),
    (M.CHUNK_QUERIES, OffloadingCounterMetadata("Chunk lookups asked of a tier, by tier.", _BY_TIER)),
    (M.CHUNK_HITS, OffloadingCounterMetadata("Chunk lookups a tier answered with a hit, by tier.", _BY_TIER)),
    (
        M.PROMOTION_ALLOCATION_FAILURES,
        OffloadingCounterMetadata("Promotions given up because the primary tier had no room."),
    ),
    (
        M.PRIMARY_WRITE_USAGE_PERC,
        OffloadingGaugeMetadata("Share of the primary tier held by cascades in flight, by tier.", _BY_TIER),
    ),
    (
        M.PRIMARY_READ_USAGE_PERC,
        OffloadingGaugeMetadata("Share of the primary tier held by promotions in flight, by tier.", _BY_TIER),
    ),
    (M.ACTIVE_PROMOTION_JOBS, OffloadingGaugeMetadata("Promotion jobs in flight, by tier.", _BY_TIER)),
    (M.ACTIVE_CASCADE_JOBS, OffloadingGaugeMetadata("Cascade jobs in flight, by tier.", _BY_TIER)),
    (
        M.PROMOTION_LATENCY,
        OffloadingHistogramMetadata(
            "Seconds from a promotion job's creation until the manager saw it end (failures too), "
            "by tier and result.",
            (TIER_LABEL, "result"),
            _PROMOTION_BUCKETS,
        ),
    ),
)
#: The back-pressure metrics, after the tiers'.
_BACKPRESSURE_METRICS: tuple[tuple[str, OffloadingMetricMetadata], ...] = (
    (
        M.BACKPRESSURE_STORE_LATENCY_EMA,
        OffloadingGaugeMetadata("Moving average of a tier's store latency, in s/MiB, by tier.", _BY_TIER),
    ),
    (
        M.BACKPRESSURE_STORES_DROPPED,
        OffloadingCounterMetadata("Stores dropped under back-pressure, by tier.", _BY_TIER),
    ),
    (
        M.BACKPRESSURE_BLOCKS_DROPPED,
        OffloadingCounterMetadata("Blocks dropped under back-pressure, by tier.", _BY_TIER),
    ),
)
del M


class TieringOffloadingSpec(CPUOffloadingSpec):
    #: vLLM's tiering regions are always one file.
    region_segments = 1

    @classmethod
    def build_metric_definitions(cls, extra_config: Mapping[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        metrics = super().build_metric_definitions(extra_config)
        metrics.update(_MANAGER_METRICS)
        for tier_config, tier_cls in cls._get_secondary_tiers(extra_config):
            metrics.update(tier_cls.build_metric_definitions(tier_config))
        metrics.update(_BACKPRESSURE_METRICS)
        return metrics

    @classmethod
    def config_info_keys(cls, extra_config: Mapping[str, Any]) -> tuple[str, ...]:
        """The CPU labels, ``TIER_LABEL``, then every tier's labels, each name once."""
        keys = dict.fromkeys(super().config_info_keys(extra_config))
        keys[TIER_LABEL] = None
        for tier_config, tier_cls in cls._get_secondary_tiers(extra_config):
            tier_keys = tier_cls.config_info_keys(tier_config)
            if TIER_LABEL in tier_keys:
                # The manager writes this label over the tier's value: fail at start-up, not silently.
                raise ReservedLabelError(
                    f"{tier_cls.__name__} must not declare the reserved label {TIER_LABEL!r}",
                    fix=f"drop {TIER_LABEL!r} from {tier_cls.__name__}.config_info_keys()",
                )
            keys.update(dict.fromkeys(tier_keys))
        return tuple(keys)

    @classmethod
    def _get_secondary_tiers(
        cls, extra_config: Mapping[str, Any]
    ) -> list[tuple[dict[str, Any], type[SecondaryTierManager]]]:
        """Each configured tier with its class, in configuration order (the tier index)."""
        configs = extra_config.get("secondary_tiers", [])
        if not isinstance(configs, list):
            raise ConfigError(
                "kv_connector_extra_config.secondary_tiers",
                "secondary_tiers must be a list of tier configurations",
            )
        return [
            (tier_config, SecondaryTierFactory.get_tier_class(tier_config, index=index))
            for index, tier_config in enumerate(configs)
        ]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.num_chunks <= 0:
            raise _no_chunk_error(self.settings.cpu_bytes_to_use, self.kv_bytes_per_chunk)
        self.secondary_tier_configs = [
            _with_backpressure(t, self.extra_config) for t in self.settings.secondary_tiers
        ]
        self.tier_poll_interval_s = self.settings.tier_poll_interval_s
        self._scheduler_mmap: SharedOffloadRegion | None = None
        #: Set by ``create_worker`` under ``canonical_layout``: whether every layer's canonical
        #: bytes are the same under any parallelism (portable), or some are exact-topology only.
        self.all_layers_portable: bool | None = None
        self._engine_id = self.settings.engine_id

    def _uses_shared_region(self) -> bool:
        return True

    def expected_participants(self) -> int:
        return self.settings.world_size + 1

    def region_lifetime(self) -> Lifetime:
        return self.settings.lifetime

    def worker_region_kwargs(self) -> dict[str, Any]:
        # vLLM's tiering spec passes no barrier, no segments and no populate shard.
        return {}

    def _new_region(self, **kwargs: Any) -> SharedOffloadRegion:
        return SharedOffloadRegion(**kwargs)

    def _new_worker(self, **kwargs: Any) -> CPUOffloadingWorker:
        return CPUOffloadingWorker(**kwargs)

    def _check_worker_caches(self, kv_caches: Any) -> None:
        """Under ``canonical_layout``, every layer must have a certified mapping (else the
        direct bytes would be stored under the canonical format's name)."""
        if not self.settings.canonical_layout or not isinstance(kv_caches, CanonicalKVCaches):
            return
        refs = [ref for group in kv_caches.group_data_refs for ref in group]
        if any(ref.mapping is None for ref in refs):
            raise KvOffloadError(
                "canonical_layout was asked for, but the KV cache layout could not be certified for it "
                "(the offload workers must be exactly the TP group; "
                "packed and cross-layer layouts are not supported)",
                fix="remove canonical_layout from kv_connector_extra_config",
            )
        self.all_layers_portable = all(
            ref.mapping is not None and ref.mapping.parallelism_agnostic for ref in refs
        )
        if self.config.parallel.is_parallelism_agnostic and not self.all_layers_portable:
            # The scheduler already shares one storage namespace across topologies.
            raise KvOffloadError(
                "canonical_layout could not certify every layer as parallelism-agnostic, "
                "but the storage namespace is shared across topologies",
                fix="remove canonical_layout, or turn off the parallelism-agnostic secondary tiers",
            )

    def get_manager(self) -> OffloadingManager:
        if self._manager is not None:
            return self._manager
        if self.settings.store_threshold >= 2:
            raise ConfigError(
                "kv_connector_extra_config.store_threshold",
                "store_threshold is not supported for TieringOffloadingSpec",
                fix="remove store_threshold or set it below 2",
            )
        with ExitStack() as undo:
            undo.callback(self._forget_scheduler_region)
            faults.point("scheduler.region")
            region = self.create_region(None)
            self._scheduler_mmap = region
            undo.callback(self.journal.quietly, f"clean scheduler region {region.path.name}", region.cleanup)

            faults.point("primary")
            primary = CPUPrimaryTierOffloadingManager(
                num_chunks=self.num_chunks,
                mmap_region=region,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                info=self.cpu_info,
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
                primary_tier=primary,
                secondary_tiers=secondaries,
                tier_poll_interval_s=self.tier_poll_interval_s,
            )
            undo.pop_all()
        log.info(
            "tiering manager: primary tier (%s, %d chunks) and %d secondary tier(s)",
            self.eviction_policy,
            self.num_chunks,
            len(secondaries),
        )
        self._manager = manager
        return manager

    def _forget_scheduler_region(self) -> None:
        self._scheduler_mmap = None


def _with_backpressure(tier_config: Mapping[str, Any], extra_config: Mapping[str, Any]) -> dict[str, Any]:
    """``tier_config`` with its ``backpressure`` resolved field by field: the tier's own fields
    over the top-level ``backpressure`` defaults. A tier with neither stays unconfigured."""
    resolved = dict(tier_config)
    merged: dict[str, Any] = {}
    for source in (extra_config.get("backpressure"), tier_config.get("backpressure")):
        if source:
            merged.update(source)
    if merged or "backpressure" in tier_config:
        resolved["backpressure"] = merged
    return resolved


def _no_chunk_error(cpu_bytes_to_use: int, kv_bytes_per_chunk: int) -> ConfigError:
    if kv_bytes_per_chunk <= 0:
        return ConfigError(
            "worker_kv_bytes_per_block",
            "is 0, so the tiering spec's region would be empty",
            fix="use CPUOffloadingSpec for a model without KV cache blocks",
        )
    return ConfigError(
        "kv_connector_extra_config.cpu_bytes_to_use",
        f"{cpu_bytes_to_use} bytes is smaller than one chunk of {kv_bytes_per_chunk} bytes, "
        "so the tiering spec's region would be empty",
        fix=f"give cpu_bytes_to_use at least {kv_bytes_per_chunk}",
    )
