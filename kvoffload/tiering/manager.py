"""The tiering managers: a CPU primary tier in the shared region, and the manager over all tiers.

``CPUPrimaryTierOffloadingManager`` is the CPU chunk pool of ``cpu/manager.py`` plus the
scheduler-side mapping of the region: it owns ``mmap_region`` once its constructor
returns, and its ``shutdown`` releases the memoryview and then cleans the region.

``TieringOffloadingManager`` behaves as vLLM 0.33's:

* cascade: when a GPU->primary store completes, its keys go to every secondary tier
  (each tier skips what it holds); the primary chunks stay pinned until the tier reports
  the job, so they cannot be evicted mid-copy. A tier that asked for request-level
  offloading also gets, at ``prepare_store``, the request's keys the primary already
  held; a key whose primary write is still in flight is parked until it lands;
* promotion: a key the primary misses is looked up in the secondaries in order; the first
  ``HIT`` gets a primary chunk allocated at once (write pending, so the lookup answers
  ``HIT_PENDING`` and nobody promotes it twice), and the step's promotions are submitted
  at ``on_schedule_end`` as one job per (tier, request);
* a request's secondary tiers hear ``on_request_finished`` only once no cascade for it
  can still be submitted;
* ``reset_cache`` drains every tier, resets the primary, and holds promotions until
  ``on_reset_flushed`` (a worker may still write a freed chunk);
* tiers that set ``tolerates_off_thread_polling`` are also polled and served by a thread
  named ``vllm_offload_tier_poll`` between steps, under ``lock``.

Where kvoffload is stricter, so a lower tier can never take the primary path down:

* a tier that raises in ``submit_*``, ``get_finished_jobs``, ``touch``, a lifecycle call
  or its per-step hooks is logged and its job is finished as failed (the pinned or
  write-pending primary chunks are released); vLLM lets the exception through;
* a tier reporting a job it does not own, or keys outside its job, is logged and
  ignored rather than asserted on;
* a promotion that failed answers ``MISS`` once for each failed key, so the waiting
  request recomputes instead of promoting the same key forever;
* ``complete_store`` never completes a key whose write belongs to a promotion.

Shutdown always releases everything, even when a step fails: the tier-poll thread, every
secondary tier (last built first, PR #51227's order), then ALWAYS the primary tier (its
region included); the first error is raised with the others as notes. vLLM (PR #52290)
skips the primary when a secondary fails, to keep the mapping alive for a tier that
might still use it, and so leaks the region (#57303). Here that protection comes from the
kernel-facing side instead: a tier that still exports the primary view makes
``mmap.close`` refuse (``BufferError``), and the region keeps that mapping while still
closing its fd and unlinking its file.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvoffload import faults
from kvoffload.base import (
    CacheHitSource,
    ConfigInfoMapping,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.manager import CPUOffloadingManager
from kvoffload.errors import ConfigError
from kvoffload.release import release_all
from kvoffload.tiering.base import (
    TIER_LABEL,
    JobId,
    JobResult,
    ParentManager,
    SecondaryTierManager,
    TransferJob,
)
from kvoffload.tiering.metrics import TieringMetricsTracker

if TYPE_CHECKING:
    from kvoffload.cpu.common import CPUOffloadingInfo

log = logging.getLogger(__name__)

POLL_THREAD_NAME = "vllm_offload_tier_poll"

#: The default pause between tier-poll rounds (``tier_poll_interval_s``): a round is a
#: non-blocking sweep, and 1 ms is far below the model step it hides.
DEFAULT_TIER_POLL_INTERVAL_S = 0.001
# How long a round waits for the lock before trying again: bounded, so the thread still
# notices a stop request while a caller holds the lock for long (or leaked it).
_TIER_POLL_LOCK_TIMEOUT_S = 1.0
# Warn after this long without the lock (longer than drain_jobs' own 5 s warning).
_TIER_POLL_STALL_WARN_S = 30.0
# Stop after rounds have failed for this long without a break. Time, not a round count:
# at 1 ms a round budget would end the thread on a brief fault (a peer reconnecting).
# on_schedule_end still serves the tiers, so stopping degrades to per-step servicing.
_TIER_POLL_GIVE_UP_AFTER_S = 30.0
# At most one logged traceback per this long during a run of failing rounds.
_TIER_POLL_ERROR_LOG_INTERVAL_S = 1.0
# How long shutdown waits for the thread to finish its round.
_TIER_POLL_JOIN_TIMEOUT_S = 5.0

# The context of calls made without one (kvoffload's managers accept that; vLLM's pass one).
_NO_REQUEST = ReqContext(req_id="")


def _chunk_array(chunk_ids: Iterable[int]) -> Any:
    # Tiers get int32 numpy arrays, as in vLLM (its CPU specs hold int32 ids, and NIXL takes
    # int32 indices: vLLM's object tier asserts it); numpy is imported only when a job is built.
    import numpy as np

    return np.asarray(list(chunk_ids), dtype=np.int32)


class KVMemoryRegion(Protocol):
    """What the primary tier needs of a region (``SharedOffloadRegion`` with ``rank=None``)."""

    def create_kv_memoryview(self) -> memoryview: ...

    def cleanup(self) -> None: ...


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """The CPU chunk pool of the tiering manager, over the scheduler's mapping of the region.

    The caller owns ``mmap_region`` until this constructor returns (a failure here leaves
    it to the caller to clean); afterwards ``shutdown`` releases it. ``read``/``write``
    name the copies between this tier and a secondary one (a cascade reads a chunk, a
    promotion writes one), so the tiering manager never calls ``prepare_load`` on a store
    path.
    """

    def __init__(
        self,
        num_chunks: int,
        mmap_region: KVMemoryRegion,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        info: CPUOffloadingInfo | None = None,
    ) -> None:
        super().__init__(
            num_chunks=num_chunks,
            cache_policy=cache_policy,
            cache_policy_module_path=cache_policy_module_path,
            enable_events=enable_events,
            info=info,
        )
        self._kv_memoryview: memoryview | None = mmap_region.create_kv_memoryview()
        self._mmap_region: KVMemoryRegion | None = mmap_region
        self._primary_shut_down = False

    # vLLM's names for the pool's state, which code written against its primary tier reads.
    @property
    def _num_allocated_chunks(self) -> int:
        return self._next_fresh_chunk

    @property
    def _free_list(self) -> list[int]:
        return self._free_chunks

    def get_kv_memoryview(self) -> memoryview:
        """The ``(num_chunks, row_stride)`` view of the region; secondary tiers use row ``c``."""
        if self._kv_memoryview is None:
            raise ConfigError(
                "primary_kv_view", "the primary tier has been shut down; its region is released"
            )
        return self._kv_memoryview

    def prepare_read(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin chunks for a copy to a secondary tier.

        Not a use of the chunks by the request: a cascade is tiering's own work, so it
        must not move the request's keys in the eviction order.
        """
        return self._prepare_load(keys, req_context, record_access=False)

    def complete_read(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.complete_load(keys, req_context)

    def prepare_write(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        return self.prepare_store(keys, req_context)

    def complete_write(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.complete_store(keys, req_context, success)

    def shutdown(self) -> None:
        """Release the memoryview, then clean the region; both run even if one fails."""
        if self._primary_shut_down:
            return
        self._primary_shut_down = True
        view, self._kv_memoryview = self._kv_memoryview, None
        region, self._mmap_region = self._mmap_region, None
        steps: list[tuple[str, Callable[[], object]]] = [("shut down the CPU chunk pool", super().shutdown)]
        if view is not None:
            # Before the region: an exported memoryview keeps the mapping from closing.
            steps.append(("release the primary kv memoryview", view.release))
        if region is not None:
            steps.append(("clean up the primary tier's region", region.cleanup))
        release_all(steps)


@dataclass
class PendingPromotion:
    """The keys of one (tier, request) waiting for this step's ``submit_load``."""

    req_context: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)
    chunk_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class RequestState:
    req_context: ReqContext
    # GPU->primary stores prepared and not completed yet: each may still cascade.
    pending_primary_stores: int = 0
    is_finished: bool = False
    # Tiers that asked for request-level offloading of this request (None: none did).
    request_level_tiers: set[int] | None = None
    # Request-level cascade keys whose primary write was still in flight.
    pending_cascade_keys: list[OffloadKey] = field(default_factory=list)


class JobMetadata(NamedTuple):
    transfer_job: TransferJob
    tier_idx: int


class _SecondaryTierFacingParent(ParentManager):
    """The manager as tier ``tier_idx`` sees it while serving: itself left out of fan-outs."""

    __slots__ = ("_manager", "_origin_idx")

    def __init__(self, manager: TieringOffloadingManager, tier_idx: int) -> None:
        self._manager = manager
        self._origin_idx = tier_idx

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self._manager.on_new_request(req_context, exclude_tier_idx=self._origin_idx)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._manager.lookup(key, req_context, exclude_tier_idx=self._origin_idx)

    def create_store_job(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TransferJob:
        return self._manager.create_store_job(keys, req_context, self._origin_idx)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._manager.on_request_finished(req_context, exclude_tier_idx=self._origin_idx)


class TieringOffloadingManager(OffloadingManager):
    """A primary CPU tier with cascading secondary tiers and promotion on a primary miss.

    Callers hold ``lock`` around every call except ``shutdown``; the lock guards this
    manager and every tier it holds, the primary included.
    """

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: Sequence[SecondaryTierManager] | None = None,
        tier_poll_interval_s: float = DEFAULT_TIER_POLL_INTERVAL_S,
    ) -> None:
        self._lock = threading.Lock()
        self.primary_tier = primary_tier
        self.secondary_tiers: list[SecondaryTierManager] = list(secondary_tiers or ())
        self._job_id_counter = 0
        self._jobs: dict[JobId, JobMetadata] = {}
        self._promotions_held = False  # from reset_cache() until on_reset_flushed()
        # Keys whose primary chunk is being written by a promotion (pending or submitted).
        self._promoting: set[OffloadKey] = set()
        # req_id -> keys whose promotion for that request failed: the request's next
        # lookup of each answers MISS, once, so it recomputes rather than promote again.
        self._failed_promotions: dict[str, set[OffloadKey]] = {}
        view = primary_tier.get_kv_memoryview()
        shape, strides = view.shape, view.strides
        self._metrics = TieringMetricsTracker(
            tier_types=[tier.tier_type for tier in self.secondary_tiers],
            num_primary_chunks=int(shape[0]) if shape else 0,
            primary_chunk_size=int(strides[0]) if strides else 0,
        )
        # tier index -> req_id -> the promotions of that request this step.
        self._pending_load_submissions: dict[int, dict[str, PendingPromotion]] = {}
        # Set by the step's first poll of finished jobs; on_schedule_end() clears it.
        self._processed_jobs_this_step = False
        self._req_state: dict[str, RequestState] = {}
        # Per request: where promoted keys came from, so a disk hit is not counted as host.
        self._request_load_sources: dict[str, dict[OffloadKey, CacheHitSource]] = {}
        self._tier_parents = {
            tier: _SecondaryTierFacingParent(self, index) for index, tier in enumerate(self.secondary_tiers)
        }
        self._tier_index = {tier: index for index, tier in enumerate(self.secondary_tiers)}
        self._polled_tiers = [tier for tier in self.secondary_tiers if tier.tolerates_off_thread_polling]
        self._tier_poll_interval_s = float(tier_poll_interval_s)
        self._tier_poll_stop = threading.Event()
        self._tier_poll_thread: threading.Thread | None = None
        self._secondaries_shut_down = False
        self._start_tier_poll_thread()

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @property
    def poll_thread(self) -> threading.Thread | None:
        return self._tier_poll_thread

    # ----------------------------------------------------------------- the tier-poll thread

    def _start_tier_poll_thread(self) -> None:
        if not self._polled_tiers or self._tier_poll_interval_s <= 0:
            return
        self._tier_poll_thread = threading.Thread(
            target=self._tier_poll_loop, name=POLL_THREAD_NAME, daemon=True
        )
        self._tier_poll_thread.start()
        log.info(
            "tier-poll thread started for tier(s) %s, every %.3fs",
            [tier.tier_type for tier in self._polled_tiers],
            self._tier_poll_interval_s,
        )

    def _stop_tier_poll_thread(self) -> None:
        """Stop and join the thread; it stays recorded if it did not exit in time."""
        self._tier_poll_stop.set()
        thread = self._tier_poll_thread
        if thread is None:
            return
        thread.join(timeout=_TIER_POLL_JOIN_TIMEOUT_S)
        if thread.is_alive():
            log.error("the tier-poll thread did not exit within %.1fs", _TIER_POLL_JOIN_TIMEOUT_S)
        else:
            self._tier_poll_thread = None

    def _tier_poll_loop(self) -> None:
        stalled_since: float | None = None
        failing_since: float | None = None
        last_error_log = 0.0
        while not self._tier_poll_stop.is_set():
            if not self._lock.acquire(timeout=_TIER_POLL_LOCK_TIMEOUT_S):
                now = time.monotonic()
                if stalled_since is None:
                    stalled_since = now
                elif now - stalled_since > _TIER_POLL_STALL_WARN_S:
                    log.warning(
                        "the tier-poll thread has not had the manager lock for %.0fs; "
                        "peers are served at step boundaries only",
                        now - stalled_since,
                    )
                    stalled_since = None
                continue
            stalled_since = None
            try:
                self.poll_tiers()
                failing_since = None
            except Exception:
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - last_error_log >= _TIER_POLL_ERROR_LOG_INTERVAL_S:
                    last_error_log = now
                    log.exception("tier-poll round failed")
            finally:
                self._lock.release()
            if failing_since is not None and time.monotonic() - failing_since >= _TIER_POLL_GIVE_UP_AFTER_S:
                log.error(
                    "tier-poll thread stopping after %.0fs of failing rounds; tiers are served per step",
                    _TIER_POLL_GIVE_UP_AFTER_S,
                )
                return
            # Always pause after releasing: Python's lock is not fair, and without this a
            # release-and-reacquire loop could keep the scheduler out.
            self._tier_poll_stop.wait(self._tier_poll_interval_s)

    def poll_tiers(self) -> None:
        """One round for the opted-in tiers: collect finished jobs, serve their peers.

        Call with ``lock`` held. Promotions and request-level cascades are not flushed
        here: they are batched per step, and a promotion started from a round is
        submitted at the next ``on_schedule_end``. The per-step gate is held shut for the
        round and put back as it was, so a lookup made while serving neither polls every
        tier off-thread nor makes the next step skip its poll.
        """
        gate = self._processed_jobs_this_step
        self._processed_jobs_this_step = True
        try:
            self._process_finished_jobs(self._polled_tiers)
            for tier in self._polled_tiers:
                tier.serve_external_requests(self._tier_parents[tier])
        finally:
            self._processed_jobs_this_step = gate

    # ----------------------------------------------------------------- tier jobs

    @property
    def _transfer_jobs(self) -> dict[JobId, JobMetadata]:
        """The jobs in flight, under vLLM's name for them (its tier tests read it)."""
        return self._jobs

    def _next_job_id(self) -> JobId:
        job_id = self._job_id_counter
        self._job_id_counter += 1
        return job_id

    def _register_job(self, transfer_job: TransferJob, tier_idx: int) -> None:
        metadata = JobMetadata(transfer_job, tier_idx)
        self._jobs[transfer_job.job_id] = metadata
        self._metrics.on_job_registered(metadata)

    def _pop_job(self, job_id: JobId) -> JobMetadata | None:
        return self._jobs.pop(job_id, None)

    def _maybe_process_finished_jobs(self) -> None:
        """Collect finished jobs, at most once per step."""
        if self._processed_jobs_this_step:
            return
        self._processed_jobs_this_step = True
        self._process_finished_jobs()

    def _process_finished_jobs(self, tiers: Sequence[SecondaryTierManager] | None = None) -> None:
        """Collect finished jobs from ``tiers`` (default: all) and release their primary chunks."""
        for tier in self.secondary_tiers if tiers is None else tiers:
            index = self._tier_index[tier]
            try:
                results = list(tier.get_finished_jobs())
            except Exception:
                log.exception(
                    "secondary tier #%d (%s): collecting finished jobs failed", index, tier.tier_type
                )
                continue
            for result in results:
                metadata = self._jobs.get(result.job_id)
                if metadata is None:
                    log.warning(
                        "secondary tier #%d (%s) reported unknown job %d",
                        index,
                        tier.tier_type,
                        result.job_id,
                    )
                    continue
                if metadata.tier_idx != index:
                    log.warning(
                        "secondary tier #%d (%s) reported job %d of tier #%d; ignored",
                        index,
                        tier.tier_type,
                        result.job_id,
                        metadata.tier_idx,
                    )
                    continue
                del self._jobs[result.job_id]
                self._finish_job(metadata, result)

    def _finish_job(self, metadata: JobMetadata, result: JobResult) -> None:
        self._metrics.on_job_finished(metadata, result)
        job = metadata.transfer_job
        if job.is_promotion:
            self._complete_promotion(metadata, result)
            return
        self.primary_tier.complete_read(job.keys, job.req_context)
        self._update_backpressure(self.secondary_tiers[metadata.tier_idx], metadata, result)

    def _complete_promotion(self, job_metadata: JobMetadata, completed_job: JobResult) -> None:
        job = job_metadata.transfer_job
        succeeded: Collection[OffloadKey]
        failed: Collection[OffloadKey]
        if completed_job.success:
            succeeded, failed = job.keys, ()
        elif completed_job.successful_keys:
            landed = set(completed_job.successful_keys)
            foreign = landed.difference(job.keys)
            if foreign:
                log.warning(
                    "promotion job %d reported %d keys it was not given; ignored", job.job_id, len(foreign)
                )
            succeeded = [key for key in job.keys if key in landed]
            failed = [key for key in job.keys if key not in landed]
        else:
            succeeded, failed = (), job.keys
        self._promoting.difference_update(job.keys)
        if failed and job.req_context.req_id in self._req_state:
            self._failed_promotions.setdefault(job.req_context.req_id, set()).update(failed)
        sources = self._request_load_sources.get(job.req_context.req_id)
        if sources is not None:
            source = self.secondary_tiers[job_metadata.tier_idx].cache_hit_source
            for key in failed:
                if sources.get(key) == source:
                    del sources[key]
        if succeeded:
            self.primary_tier.complete_write(succeeded, job.req_context, True)
        if failed:
            self.primary_tier.complete_write(failed, job.req_context, False)

    def _should_store_to_tier(self, tier: SecondaryTierManager, num_blocks: int) -> bool:
        detector = tier.bp_detector
        return detector is None or detector.should_store(num_blocks)

    def _update_backpressure(
        self, tier: SecondaryTierManager, job_metadata: JobMetadata, result: JobResult
    ) -> None:
        detector = tier.bp_detector
        if detector is None:
            return
        before = detector.is_under_pressure()
        if result.success:
            job = job_metadata.transfer_job
            moved = result.transfer_bytes
            detector.update(
                job.submit_time, len(job.keys) * tier.block_size_bytes if moved is None else moved
            )
        else:
            detector.on_store_failed()
        if detector.is_under_pressure() != before:
            log.info(
                "tier #%d (%s) back-pressure %s (stats=%s)",
                self._tier_index[tier],
                tier.tier_type,
                "activated" if detector.is_under_pressure() else "cleared",
                detector.stats,
            )

    def _submit(self, tier: SecondaryTierManager, job: TransferJob) -> None:
        """Hand a registered job to its tier; a tier that raises has the job finished as failed."""
        try:
            if job.is_promotion:
                tier.submit_load(job)
            else:
                tier.submit_store(job)
        except Exception:
            log.exception(
                "secondary tier %s raised accepting job %d; finished as failed", tier.tier_type, job.job_id
            )
            metadata = self._pop_job(job.job_id)
            if metadata is not None:
                self._finish_job(metadata, JobResult(job_id=job.job_id, success=False))

    def create_store_job(
        self, keys: Collection[OffloadKey], req_context: ReqContext, tier_idx: int = 0
    ) -> TransferJob:
        """Pin ``keys`` in the primary tier and register a cascade job for tier ``tier_idx``.

        The caller submits it (or, for a tier serving a peer, copies it) and the tier
        reports it through ``get_finished_jobs``.
        """
        spec = self.primary_tier.prepare_read(keys, req_context)
        if not isinstance(spec, CPULoadStoreSpec):
            raise ConfigError(
                "primary_tier", f"a primary tier must give CPU chunk ids, not {type(spec).__name__}"
            )
        job = TransferJob(
            job_id=self._next_job_id(),
            keys=keys,
            chunk_ids=_chunk_array(spec.chunk_ids),
            is_promotion=False,
            req_context=req_context,
        )
        self._register_job(job, tier_idx)
        return job

    def _cascade(
        self, keys: Collection[OffloadKey], req_context: ReqContext, tier_indices: Iterable[int]
    ) -> None:
        for index in tier_indices:
            tier = self.secondary_tiers[index]
            if not self._should_store_to_tier(tier, len(keys)):
                continue
            self._submit(tier, self.create_store_job(keys, req_context, index))

    # ----------------------------------------------------------------- lookups and promotion

    def lookup(
        self, key: OffloadKey, req_context: ReqContext | None = None, *, exclude_tier_idx: int | None = None
    ) -> LookupResult:
        """``HIT`` in the primary; ``HIT_PENDING`` while written (a promotion included);
        ``RETRY`` while a secondary tier is finding out; ``MISS`` otherwise, including
        when the primary has no room to promote into and while promotions are held.
        """
        ctx = _NO_REQUEST if req_context is None else req_context
        # Finished promotions first, so one that landed reads as HIT, and chunks freed by
        # finished jobs can be evicted for a promotion this lookup starts.
        self._maybe_process_finished_jobs()
        primary = self._timed_lookup(ctx, key, self._metrics.primary_tier_label, self.primary_tier.lookup)
        if primary in (LookupResult.HIT, LookupResult.HIT_PENDING):
            return primary
        failed = self._failed_promotions.get(ctx.req_id)
        if failed is not None and key in failed:
            failed.discard(key)
            return LookupResult.MISS
        if self._promotions_held:
            return LookupResult.MISS
        any_retry = False
        for index, tier in enumerate(self.secondary_tiers):
            if index == exclude_tier_idx or not ctx.load_tier_filter.allows(tier.medium, tier.locality):
                continue
            found = self._timed_lookup(ctx, key, self._metrics.tier_label(index), tier.lookup)
            if found is LookupResult.HIT:
                return (
                    LookupResult.HIT_PENDING
                    if self._initiate_promotion(index, key, ctx)
                    else LookupResult.MISS
                )
            any_retry = any_retry or found is LookupResult.RETRY
        return LookupResult.RETRY if any_retry else LookupResult.MISS

    def _timed_lookup(
        self,
        ctx: ReqContext,
        key: OffloadKey,
        label: tuple[str],
        lookup: Callable[[OffloadKey, ReqContext], LookupResult],
    ) -> LookupResult:
        start = time.monotonic()
        result = lookup(key, ctx)
        if ctx is not _NO_REQUEST:
            self._metrics.on_lookup(ctx, key, label, result, time.monotonic() - start)
        return result

    def _initiate_promotion(self, tier_idx: int, key: OffloadKey, req_context: ReqContext) -> bool:
        """Allocate a primary chunk for ``key`` now; its ``submit_load`` waits for the step's end.

        False when the primary has no room: the key is then a miss, not a retry forever.
        """
        prepared = self.primary_tier.prepare_write([key], req_context)
        if prepared is None:
            self._metrics.on_promotion_allocation_failure()
            return False
        spec = prepared.store_spec
        if not isinstance(spec, CPULoadStoreSpec):
            raise ConfigError(
                "primary_tier", f"a primary tier must give CPU chunk ids, not {type(spec).__name__}"
            )
        sources = self._request_load_sources.setdefault(req_context.req_id, {})
        source = self.secondary_tiers[tier_idx].cache_hit_source
        for promoted in prepared.keys_to_store:
            sources[promoted] = source
        self._promoting.update(prepared.keys_to_store)
        pending = self._pending_load_submissions.setdefault(tier_idx, {})
        entry = pending.setdefault(req_context.req_id, PendingPromotion(req_context=req_context))
        entry.keys.extend(prepared.keys_to_store)
        entry.chunk_ids.extend(spec.chunk_ids)
        return True

    def _flush_pending_promotions(self) -> None:
        """Submit the step's promotions: one ``submit_load`` per (tier, request)."""
        pending, self._pending_load_submissions = self._pending_load_submissions, {}
        for tier_idx, by_request in pending.items():
            tier = self.secondary_tiers[tier_idx]
            for entry in by_request.values():
                job = TransferJob(
                    job_id=self._next_job_id(),
                    keys=entry.keys,
                    chunk_ids=_chunk_array(entry.chunk_ids),
                    is_promotion=True,
                    req_context=entry.req_context,
                )
                self._register_job(job, tier_idx)
                self._submit(tier, job)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext | None = None) -> CacheHitSource:
        ctx = _NO_REQUEST if req_context is None else req_context
        sources = self._request_load_sources.get(ctx.req_id)
        if sources is not None and key in sources:
            return sources[key]
        return self.primary_tier.get_load_source(key, ctx)

    # ----------------------------------------------------------------- GPU <-> primary

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> LoadStoreSpec:
        return self.primary_tier.prepare_load(keys, _NO_REQUEST if req_context is None else req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        ctx = _NO_REQUEST if req_context is None else req_context
        self.primary_tier.touch(keys, ctx)
        for tier in self.secondary_tiers:
            self._call_tier(tier, "touch", tier.touch, keys, ctx)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self.primary_tier.complete_load(keys, _NO_REQUEST if req_context is None else req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        ctx = _NO_REQUEST if req_context is None else req_context
        # Always poll here, not once per step: eviction must see every chunk a finished
        # cascade unpinned or a finished promotion made evictable.
        self._processed_jobs_this_step = True
        self._process_finished_jobs()
        prepared = self.primary_tier.prepare_store(keys, ctx)
        if prepared is None:
            return None
        state = self._request_state(ctx)
        if prepared.keys_to_store:
            state.pending_primary_stores += 1
        if state.request_level_tiers:
            new = set(prepared.keys_to_store)
            present = tuple(key for key in keys if key not in new)
            if present:
                self._cascade_existing_chunks_to_request_level_tiers(present, ctx, state.request_level_tiers)
        return prepared

    def _cascade_existing_chunks_to_request_level_tiers(
        self, keys: Sequence[OffloadKey], req_context: ReqContext, request_level_tiers: set[int]
    ) -> None:
        """Hand keys the primary already holds to the request-level tiers.

        ``HIT``: now. ``HIT_PENDING`` (another request is writing it): parked until the
        write lands, since the scheduler has moved past the chunk and never offers it
        again. ``MISS``: dropped, nothing to read. ``RETRY`` cannot come from a primary
        tier and would park with no guarantee of draining, so it is refused.
        """
        state = self._request_state(req_context)
        ready = []
        for key in keys:
            found = self.primary_tier.lookup(key, req_context)
            if found is LookupResult.HIT:
                ready.append(key)
            elif found is LookupResult.HIT_PENDING:
                state.pending_cascade_keys.append(key)
            elif found is not LookupResult.MISS:
                raise AssertionError(f"the primary tier answered {found} for a cascade key")
        if ready:
            self._cascade(ready, req_context, sorted(request_level_tiers))

    def _flush_pending_cascades(self) -> None:
        """Retry parked request-level cascades; each key resolves to HIT or MISS, so this drains."""
        for req_id, state in list(self._req_state.items()):
            if not state.pending_cascade_keys or not state.request_level_tiers:
                state.pending_cascade_keys.clear()
                continue
            keys, state.pending_cascade_keys = state.pending_cascade_keys, []
            self._cascade_existing_chunks_to_request_level_tiers(
                keys, state.req_context, state.request_level_tiers
            )
            self._maybe_finalize_request(req_id)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, success: bool = True
    ) -> None:
        """Finish a GPU->primary store; on success cascade its keys to every secondary tier."""
        ctx = _NO_REQUEST if req_context is None else req_context
        # A promotion's chunk is write-pending too, but only its tier job may finish it.
        written = [key for key in keys if key not in self._promoting] if self._promoting else keys
        self.primary_tier.complete_store(written, ctx, success)
        if success and written:
            self._cascade(written, ctx, range(len(self.secondary_tiers)))
        state = self._request_state(ctx)
        if state.pending_primary_stores > 0:
            state.pending_primary_stores -= 1
        else:
            log.warning("complete_store for request %r without a prepared store", ctx.req_id)
        self._maybe_finalize_request(ctx.req_id)

    # ----------------------------------------------------------------- the request lifecycle

    def _request_state(self, req_context: ReqContext) -> RequestState:
        state = self._req_state.get(req_context.req_id)
        if state is None:
            # A request the scheduler never announced; tracked from here so it still finalizes.
            state = self._req_state[req_context.req_id] = RequestState(req_context=req_context)
        return state

    def _call_tier(self, tier: SecondaryTierManager, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:
            log.exception("secondary tier #%d (%s): %s failed", self._tier_index[tier], tier.tier_type, what)
            return None

    def on_new_request(
        self, req_context: ReqContext, *, exclude_tier_idx: int | None = None
    ) -> RequestOffloadingContext:
        """Ask each tier for its policy: request-level if any tier wants it."""
        state = RequestState(req_context=req_context)
        self._metrics.on_new_request(req_context)
        for index, tier in enumerate(self.secondary_tiers):
            if index == exclude_tier_idx:
                continue
            wanted = self._call_tier(tier, "on_new_request", tier.on_new_request, req_context)
            if isinstance(wanted, RequestOffloadingContext) and wanted.policy is OffloadPolicy.REQUEST_LEVEL:
                if state.request_level_tiers is None:
                    state.request_level_tiers = set()
                state.request_level_tiers.add(index)
        self._req_state[req_context.req_id] = state
        level = OffloadPolicy.REQUEST_LEVEL if state.request_level_tiers else OffloadPolicy.CHUNK_LEVEL
        return RequestOffloadingContext(policy=level)

    def on_request_finished(self, req_context: ReqContext, *, exclude_tier_idx: int | None = None) -> None:
        """The primary hears it now; the secondary tiers once no cascade can follow."""
        self.primary_tier.on_request_finished(req_context)
        self._request_state(req_context).is_finished = True
        self._maybe_finalize_request(req_context.req_id, exclude_tier_idx)

    def _maybe_finalize_request(self, req_id: str, exclude_tier_idx: int | None = None) -> None:
        state = self._req_state.get(req_id)
        if (
            state is None
            or not state.is_finished
            or state.pending_primary_stores
            or state.pending_cascade_keys
        ):
            return
        for index, tier in enumerate(self.secondary_tiers):
            if index != exclude_tier_idx:
                self._call_tier(tier, "on_request_finished", tier.on_request_finished, state.req_context)
        self._metrics.on_request_finished(state.req_context)
        self._request_load_sources.pop(req_id, None)
        self._failed_promotions.pop(req_id, None)
        del self._req_state[req_id]

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The step's last call: poll, serve peers, submit promotions, retry parked cascades."""
        # Polls even on a step with no lookup or store (a tier may still have work).
        self._maybe_process_finished_jobs()
        for tier in self.secondary_tiers:
            self._call_tier(
                tier, "serve_external_requests", tier.serve_external_requests, self._tier_parents[tier]
            )
        # Cleared after serving, so lookups made while serving did not poll again.
        self._processed_jobs_this_step = False
        self._flush_pending_promotions()
        # Keys parked this step cannot have landed yet; they are parked again and retried
        # next step, and their request does not finalize meanwhile.
        self._flush_pending_cascades()
        for tier in self.secondary_tiers:
            self._call_tier(tier, "on_schedule_end", tier.on_schedule_end, context)
        for req_id in context.new_req_ids:
            state = self._req_state.get(req_id)
            if state is not None:
                self._metrics.on_request_allocated(state.req_context)

    def has_pending_work(self) -> bool:
        return (
            bool(self._jobs)
            or bool(self._pending_load_submissions)
            or any(state.pending_cascade_keys for state in self._req_state.values())
            or any(tier.has_pending_work() for tier in self.secondary_tiers)
        )

    def take_events(self) -> Iterator[OffloadingEvent]:
        yield from self.primary_tier.take_events()
        for tier in self.secondary_tiers:
            yield from tier.take_events()

    # ----------------------------------------------------------------- reset

    def reset_cache(self) -> None:
        """Drain every tier, finish its jobs, reset the primary; hold promotions until flushed.

        Secondary tiers keep their data (that is what they are for). Active requests keep
        their state, without pending stores or parked cascades; finished ones finalize.
        Until ``on_reset_flushed`` a late worker write may still land in a freed primary
        chunk, so no promotion may fill one meanwhile: a primary miss is then a ``MISS``.
        """
        for tier in self.secondary_tiers:
            tier.drain_jobs()
        self._process_finished_jobs()
        if self._jobs:
            # A tier that drained without reporting: its chunks are reset below anyway.
            log.error("%d tier jobs unreported after drain_jobs; finished as failed", len(self._jobs))
            for job_id, metadata in list(self._jobs.items()):
                del self._jobs[job_id]
                self._finish_job(metadata, JobResult(job_id=job_id, success=False))
        self._pending_load_submissions.clear()
        self._request_load_sources.clear()
        self._promoting.clear()
        self._failed_promotions.clear()
        self._metrics.assert_idle()
        finished = []
        for req_id, state in self._req_state.items():
            state.pending_primary_stores = 0
            state.pending_cascade_keys.clear()
            if state.is_finished:
                for tier in self.secondary_tiers:
                    self._call_tier(tier, "on_request_finished", tier.on_request_finished, state.req_context)
                self._metrics.on_request_finished(state.req_context)
                finished.append(req_id)
        self.primary_tier.reset_cache()
        for req_id in finished:
            del self._req_state[req_id]
        self._processed_jobs_this_step = False
        for tier in self.secondary_tiers:
            if tier.bp_detector is not None:
                tier.bp_detector.reset()
        self._promotions_held = bool(self.secondary_tiers)

    def on_reset_flushed(self) -> None:
        self._promotions_held = False

    # ----------------------------------------------------------------- metrics

    def get_stats(self) -> Any:
        stats = self.primary_tier.get_stats()
        if stats is not None and stats.is_empty():
            stats = None
        self._metrics.record_backpressure(self.secondary_tiers)
        for more in (self._metrics.take_stats(), *(tier.get_stats() for tier in self.secondary_tiers)):
            if more is None or more.is_empty():
                continue
            stats = more if stats is None else stats.aggregate(more)
        return stats

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """One mapping per tier, the primary first, each with ``TIER_LABEL``."""
        primary_infos = list(self.primary_tier.config_info())
        if len(primary_infos) != 1:
            raise ConfigError(
                "primary_tier", f"config_info() gave {len(primary_infos)} mappings; one tier has one series"
            )
        infos: list[ConfigInfoMapping] = [
            {**primary_infos[0], TIER_LABEL: self._metrics.primary_tier_label[0]}
        ]
        for index, tier in enumerate(self.secondary_tiers):
            infos.append({**tier.config_info(), TIER_LABEL: self._metrics.tier_label(index)[0]})
        return infos

    # ----------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        """Stop the tier-poll thread, shut down the secondary tiers (last first), then the primary.

        Call without holding ``lock``. If the thread will not stop, the tiers are shut
        down under the lock so no round is running meanwhile; if even the lock cannot be
        had (the caller holds it), the secondary tiers are left alone, since tearing one
        down under a live round can crash the process, and ``RuntimeError`` says so; a
        later ``shutdown`` finishes them. The primary tier is released in every case.
        Idempotent. The first failure is raised after everything else is released.
        """
        self._stop_tier_poll_thread()
        if self._tier_poll_thread is None:
            self._shutdown_tiers()
            return
        if not self._lock.acquire(timeout=_TIER_POLL_JOIN_TIMEOUT_S):
            release_all([("shut down the primary tier", self._shutdown_primary)])
            raise RuntimeError(
                "the tier-poll thread is still running and the manager lock is unavailable: the "
                "secondary tiers were not shut down (the primary tier was). shutdown() must be "
                "called without holding manager.lock."
            )
        try:
            self._shutdown_tiers()
        finally:
            self._lock.release()

    def _shutdown_tiers(self) -> None:
        steps: list[tuple[str, Callable[[], object]]] = []
        if not self._secondaries_shut_down:
            self._secondaries_shut_down = True
            for index in reversed(range(len(self.secondary_tiers))):
                tier = self.secondary_tiers[index]
                steps.append(
                    (
                        f"shut down secondary tier #{index} ({tier.tier_type}, {type(tier).__name__})",
                        partial(shutdown_secondary, index, tier),
                    )
                )
        steps.append(("shut down the primary tier", self._shutdown_primary))
        release_all(steps)

    def _shutdown_primary(self) -> None:
        shutdown_primary(self.primary_tier)


# The cleanup fault points model a shutdown step that reports a failure: the release
# itself still happens (``finally``), so what a test checks is that the failure is
# surfaced and that it stops nothing from being released (as with ``cleanup.region``).
def shutdown_secondary(index: int, tier: SecondaryTierManager) -> None:
    """Shut down secondary tier ``index``; fault point ``cleanup.secondary[.index]``."""
    try:
        faults.point("cleanup.secondary", index=index)
    finally:
        tier.shutdown()


def shutdown_primary(primary: CPUPrimaryTierOffloadingManager) -> None:
    """Shut down the primary tier (which cleans its region); fault point ``cleanup.primary``."""
    try:
        faults.point("cleanup.primary")
    finally:
        primary.shutdown()
