"""What the tiering manager measures: lookups, tier jobs and primary-chunk use, per tier.

Every series is labelled by tier: ``"0:primary"`` for the primary tier, ``"{i+1}:{type}"``
for secondary tier ``i``. Observations go into vLLM's ``OffloadingConnectorStats``, the
payload vLLM's scheduler ships to its Prometheus frontend; outside vLLM there is no such
payload, and the tracker keeps its bookkeeping but records nothing.

Lookup delays: the sync delay is how long a tier took to answer; when a tier first
answered ``RETRY``, the async delay is the time from that first answer until the key
resolved (``HIT`` or ``MISS``). Each key is counted once per request and tier, and only
until the request is allocated (after that a lookup is not part of admission).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvoffload.base import LookupResult, OffloadKey, ReqContext
from kvoffload.tiering.base import JobResult, TieringOffloadingMetrics, TransferJob

if TYPE_CHECKING:
    from kvoffload.tiering.base import SecondaryTierManager

TierLabel = tuple[str]
PRIMARY_TIER_LABEL: TierLabel = ("0:primary",)


class _NoStats:
    """Stands in for ``OffloadingConnectorStats`` where vLLM is not installed."""

    def increase_counter(self, name: str, value: float = 1, labelvalues: tuple[str, ...] = ()) -> None:
        return None

    def set_gauge(self, name: str, value: float, labelvalues: tuple[str, ...] = ()) -> None:
        return None

    def observe_histogram(self, name: str, value: float, labelvalues: tuple[str, ...] = ()) -> None:
        return None

    def is_empty(self) -> bool:
        return True


def new_connector_stats() -> Any:
    """An empty vLLM ``OffloadingConnectorStats``, or a recorder of nothing without vLLM."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-not-found]
            OffloadingConnectorStats,
        )
    except ImportError:
        return _NoStats()
    return OffloadingConnectorStats()


class _JobMetadataLike(Protocol):
    @property
    def transfer_job(self) -> TransferJob: ...

    @property
    def tier_idx(self) -> int: ...


@dataclass(slots=True)
class _RequestMetricsState:
    # tier label -> key -> when its first RETRY was (None: resolved, or never retried).
    # None as a whole once the request is allocated: its lookups are no longer timed.
    observed_lookups: dict[TierLabel, dict[OffloadKey, float | None]] | None = field(default_factory=dict)


@dataclass(slots=True)
class _TierState:
    active_promotion_count: int = 0
    active_cascade_count: int = 0
    primary_write_chunk_count: int = 0
    primary_read_chunk_count: int = 0


class TieringMetricsTracker:
    """The tiering manager's metrics; every method runs under the manager's lock."""

    def __init__(self, tier_types: list[str], num_primary_chunks: int, primary_chunk_size: int) -> None:
        self._tier_types = list(tier_types)
        self._num_primary_chunks = num_primary_chunks
        self._primary_chunk_size = primary_chunk_size
        self._request_states: dict[str, _RequestMetricsState] = {}
        self._tier_states = [_TierState() for _ in self._tier_types]
        self._stats = new_connector_stats()

    @functools.cache  # noqa: B019 - one tracker per manager, as many entries as tiers
    def tier_label(self, tier_idx: int) -> TierLabel:
        return (f"{tier_idx + 1}:{self._tier_types[tier_idx]}",)

    @property
    def primary_tier_label(self) -> TierLabel:
        return PRIMARY_TIER_LABEL

    # ----------------------------------------------------------------- requests and lookups

    def on_new_request(self, req_context: ReqContext) -> None:
        self._request_states[req_context.req_id] = _RequestMetricsState()

    def on_request_allocated(self, req_context: ReqContext) -> None:
        state = self._request_states.get(req_context.req_id)
        if state is not None:
            state.observed_lookups = None

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._request_states.pop(req_context.req_id, None)

    def on_lookup(
        self,
        req_context: ReqContext,
        key: OffloadKey,
        tier_label: TierLabel,
        result: LookupResult,
        lookup_duration: float,
    ) -> None:
        state = self._request_states.setdefault(req_context.req_id, _RequestMetricsState())
        observed_by_tier = state.observed_lookups
        if observed_by_tier is None:
            return
        observed = observed_by_tier.setdefault(tier_label, {})
        if result in (LookupResult.HIT, LookupResult.MISS):
            retried_at = observed.get(key)
            # A key resolved before is not counted again; one that was retried is, once.
            if key not in observed or retried_at is not None:
                observed[key] = None
                self._observe_resolved_lookup(tier_label, result, lookup_duration, retried_at)
        elif result is LookupResult.RETRY:
            observed.setdefault(key, time.monotonic() - lookup_duration)

    def _observe_resolved_lookup(
        self, tier_label: TierLabel, result: LookupResult, lookup_duration: float, retried_at: float | None
    ) -> None:
        self._stats.increase_counter(TieringOffloadingMetrics.CHUNK_QUERIES, labelvalues=tier_label)
        if result is LookupResult.HIT:
            self._stats.increase_counter(TieringOffloadingMetrics.CHUNK_HITS, labelvalues=tier_label)
        self._stats.observe_histogram(TieringOffloadingMetrics.LOOKUP_SYNC_DELAY, lookup_duration, tier_label)
        if retried_at is not None:
            self._stats.observe_histogram(
                TieringOffloadingMetrics.LOOKUP_ASYNC_DELAY, time.monotonic() - retried_at, tier_label
            )

    # ----------------------------------------------------------------- tier jobs

    def on_job_registered(self, job_metadata: _JobMetadataLike) -> None:
        job = job_metadata.transfer_job
        state = self._tier_states[job_metadata.tier_idx]
        if job.is_promotion:
            state.active_promotion_count += 1
            state.primary_write_chunk_count += len(job.chunk_ids)
        else:
            state.active_cascade_count += 1
            state.primary_read_chunk_count += len(job.chunk_ids)

    def on_job_finished(self, job_metadata: _JobMetadataLike, result: JobResult) -> None:
        self._observe_finished_job(job_metadata, result)
        if job_metadata.transfer_job.is_promotion:
            # From the job's creation, so the tier's queueing counts too (unlike transfer_time).
            self._stats.observe_histogram(
                TieringOffloadingMetrics.PROMOTION_LATENCY,
                time.monotonic() - job_metadata.transfer_job.submit_time,
                (*self.tier_label(job_metadata.tier_idx), "success" if result.success else "failure"),
            )
        self._forget_job(job_metadata)

    def _forget_job(self, job_metadata: _JobMetadataLike) -> None:
        job = job_metadata.transfer_job
        state = self._tier_states[job_metadata.tier_idx]
        chunks = len(job.chunk_ids)
        if job.is_promotion:
            if state.active_promotion_count <= 0 or state.primary_write_chunk_count < chunks:
                raise AssertionError(f"promotion job {job.job_id} finished twice or was never registered")
            state.active_promotion_count -= 1
            state.primary_write_chunk_count -= chunks
        else:
            if state.active_cascade_count <= 0 or state.primary_read_chunk_count < chunks:
                raise AssertionError(f"cascade job {job.job_id} finished twice or was never registered")
            state.active_cascade_count -= 1
            state.primary_read_chunk_count -= chunks

    def _observe_finished_job(self, job_metadata: _JobMetadataLike, result: JobResult) -> None:
        job = job_metadata.transfer_job
        label = self.tier_label(job_metadata.tier_idx)
        moved_keys = len(job.keys)
        if not result.success:
            failures = (
                TieringOffloadingMetrics.PROMOTION_JOB_FAILURES
                if job.is_promotion
                else TieringOffloadingMetrics.CASCADE_JOB_FAILURES
            )
            self._stats.increase_counter(failures, labelvalues=label)
            if not (job.is_promotion and result.successful_keys):
                return
            moved_keys = len(result.successful_keys)
        if job.is_promotion:
            bytes_metric, time_metric = (
                TieringOffloadingMetrics.READ_BYTES,
                TieringOffloadingMetrics.READ_TIME,
            )
        else:
            bytes_metric, time_metric = (
                TieringOffloadingMetrics.WRITE_BYTES,
                TieringOffloadingMetrics.WRITE_TIME,
            )
        self._stats.increase_counter(bytes_metric, moved_keys * self._primary_chunk_size, label)
        if result.transfer_time is not None:
            self._stats.increase_counter(time_metric, result.transfer_time, label)

    def on_promotion_allocation_failure(self) -> None:
        self._stats.increase_counter(TieringOffloadingMetrics.PROMOTION_ALLOCATION_FAILURES)

    def record_backpressure(self, tiers: Sequence[SecondaryTierManager]) -> None:
        for index, tier in enumerate(tiers):
            detector = tier.bp_detector
            if detector is None:
                continue
            label = self.tier_label(index)
            ema = detector.stats.get("store_latency_ema")
            if ema is not None:
                self._stats.set_gauge(
                    TieringOffloadingMetrics.BACKPRESSURE_STORE_LATENCY_EMA, ema, labelvalues=label
                )
            stores, blocks = detector.policy.pop_stores_dropped()
            if stores > 0:
                self._stats.increase_counter(
                    TieringOffloadingMetrics.BACKPRESSURE_STORES_DROPPED, stores, labelvalues=label
                )
            if blocks > 0:
                self._stats.increase_counter(
                    TieringOffloadingMetrics.BACKPRESSURE_BLOCKS_DROPPED, blocks, labelvalues=label
                )

    # ----------------------------------------------------------------- the payload

    def take_stats(self) -> Any | None:
        """Observations since the last call plus the current per-tier gauges, or ``None``."""
        stats = new_connector_stats()
        for index, state in enumerate(self._tier_states):
            label = self.tier_label(index)
            total = self._num_primary_chunks
            write_usage = state.primary_write_chunk_count / total if total > 0 else 0.0
            read_usage = state.primary_read_chunk_count / total if total > 0 else 0.0
            stats.set_gauge(TieringOffloadingMetrics.PRIMARY_WRITE_USAGE_PERC, write_usage, label)
            stats.set_gauge(TieringOffloadingMetrics.PRIMARY_READ_USAGE_PERC, read_usage, label)
            stats.set_gauge(
                TieringOffloadingMetrics.ACTIVE_PROMOTION_JOBS, state.active_promotion_count, label
            )
            stats.set_gauge(TieringOffloadingMetrics.ACTIVE_CASCADE_JOBS, state.active_cascade_count, label)
        if not self._stats.is_empty():
            stats = self._stats if stats.is_empty() else stats.aggregate(self._stats)
            self._stats = new_connector_stats()
        return None if stats.is_empty() else stats

    def assert_idle(self) -> None:
        """Raise unless no tier job is counted as active (after a drain)."""
        busy = [
            self.tier_label(i)[0]
            for i, s in enumerate(self._tier_states)
            if s.active_promotion_count
            or s.active_cascade_count
            or s.primary_write_chunk_count
            or s.primary_read_chunk_count
        ]
        if busy:
            raise AssertionError(f"tier jobs still counted as active after a drain: {busy}")
