"""The tiering managers: a CPU primary tier in the shared region, and the manager over all tiers.

``CPUPrimaryTierOffloadingManager`` is the CPU chunk pool of ``cpu/manager.py`` plus the
scheduler-side mapping of the region: it owns ``mmap_region`` once its constructor
returns, and its ``shutdown`` releases the memoryview and then cleans the region.

``TieringOffloadingManager`` keeps it simple and correct:

* write-through: when a store to the primary completes, its keys are copied to every
  secondary tier that does not hold them yet; the primary chunks stay pinned (like a
  load) until the tier reports the job, so they cannot be evicted mid-copy;
* promotion: a key the primary misses is looked up in the secondaries in order; the
  first that has it loads it into a freshly allocated primary chunk (write pending),
  and ``lookup`` answers ``RETRY`` until that job finishes. A failed promotion answers
  ``MISS`` once, so the waiting request recomputes instead of retrying forever;
* a secondary tier that raises while accepting a job is logged and skipped: the
  primary path never fails because of a lower tier.

Shutdown releases everything even when a step fails: every secondary tier, then
ALWAYS the primary tier (its region included), then the first error is raised with
the others as notes. vLLM (PR #52290) skips the primary when a secondary fails, to
keep the mapping alive for a tier that might still use it, and so leaks the region
(#57303). Here that protection comes from the kernel-facing side instead: a tier that
still exports the primary view makes ``mmap.close`` refuse (``BufferError``), and the
region keeps that mapping while still closing its fd and unlinking its file.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Protocol, cast

from kvoffload import faults
from kvoffload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.manager import CPUOffloadingManager
from kvoffload.errors import ConfigError, KvOffloadError
from kvoffload.release import release_all
from kvoffload.tiering.base import SecondaryTierManager, TransferJob

log = logging.getLogger(__name__)

POLL_THREAD_NAME = "vllm_offload_tier_poll"


class KVMemoryRegion(Protocol):
    """What the primary tier needs of a region (``SharedOffloadRegion`` with ``rank=None``)."""

    @property
    def num_chunks(self) -> int: ...

    def create_kv_memoryview(self) -> memoryview: ...

    def cleanup(self) -> None: ...


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """The CPU chunk pool of the tiering manager, over the scheduler's mapping of the region.

    The caller owns ``mmap_region`` until this constructor returns (a failure here leaves
    it to the caller to clean); afterwards ``shutdown`` releases it.
    """

    def __init__(
        self,
        num_chunks: int,
        mmap_region: KVMemoryRegion,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
    ) -> None:
        super().__init__(num_chunks, cache_policy, cache_policy_module_path, enable_events)
        if mmap_region.num_chunks != num_chunks:
            raise ConfigError(
                "num_chunks", f"{num_chunks} does not match the region's {mmap_region.num_chunks} chunks"
            )
        self._kv_memoryview: memoryview | None = mmap_region.create_kv_memoryview()
        self._mmap_region: KVMemoryRegion | None = mmap_region
        self._shut_down = False

    def get_kv_memoryview(self) -> memoryview:
        if self._kv_memoryview is None:
            raise KvOffloadError("the primary tier has been shut down; its region is released")
        return self._kv_memoryview

    # The tiering manager's names for the same operations: a "read" copies a chunk out to
    # a secondary tier, a "write" fills a chunk from one.
    def prepare_read(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        return self.prepare_load(keys, req_context)

    def complete_read(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self.complete_load(keys, req_context)

    def prepare_write(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        return self.prepare_store(keys, req_context)

    def complete_write(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, success: bool = True
    ) -> None:
        self.complete_store(keys, req_context, success)

    def shutdown(self) -> None:
        """Release the memoryview, then clean the region; both run even if one fails."""
        if self._shut_down:
            return
        self._shut_down = True
        view, self._kv_memoryview = self._kv_memoryview, None
        region, self._mmap_region = self._mmap_region, None
        steps: list[tuple[str, Callable[[], object]]] = [("shut down the CPU chunk pool", super().shutdown)]
        if view is not None:
            # Before the region: an exported memoryview keeps the mapping from closing.
            steps.append(("release the primary kv memoryview", view.release))
        if region is not None:
            steps.append(("clean up the primary tier's region", region.cleanup))
        release_all(steps)


@dataclass(frozen=True, slots=True)
class _Job:
    tier_index: int
    keys: tuple[OffloadKey, ...]
    is_store: bool  # True: primary -> tier (cascade); False: tier -> primary (promotion)


class TieringOffloadingManager(OffloadingManager):
    """A primary CPU tier with write-through secondary tiers and promotion on a primary miss.

    Callers hold ``lock`` around every call except ``shutdown``. Finished tier jobs are
    collected at the start of each call, and by a background thread named
    ``vllm_offload_tier_poll`` when a tier sets ``tolerates_off_thread_polling`` and
    ``tier_poll_interval_s > 0``.
    """

    def __init__(
        self,
        primary_tier: CPUPrimaryTierOffloadingManager,
        secondary_tiers: Sequence[SecondaryTierManager] | None = None,
        tier_poll_interval_s: float = 0.001,
        *,
        shutdown_timeout_s: float = 5.0,
    ) -> None:
        self.primary_tier = primary_tier
        self.secondary_tiers = list(secondary_tiers or ())
        self.tier_poll_interval_s = float(tier_poll_interval_s)
        self.shutdown_timeout_s = shutdown_timeout_s
        self._lock = threading.Lock()
        self._job_ids = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._promoting: set[OffloadKey] = set()
        self._failed_promotions: set[OffloadKey] = set()
        self._shut_down = False
        self._stop_polling = threading.Event()
        self._poll_thread: threading.Thread | None = None
        if self.tier_poll_interval_s > 0 and any(
            t.tolerates_off_thread_polling for t in self.secondary_tiers
        ):
            self._poll_thread = threading.Thread(target=self._poll_loop, name=POLL_THREAD_NAME, daemon=True)
            self._poll_thread.start()

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    @property
    def poll_thread(self) -> threading.Thread | None:
        return self._poll_thread

    # ----------------------------------------------------------------- tier jobs

    def _poll_loop(self) -> None:
        while not self._stop_polling.wait(self.tier_poll_interval_s):
            with self._lock:
                if self._stop_polling.is_set():
                    return
                try:
                    self._poll_tiers()
                except Exception:
                    # Dying here would leave every later job unreported; log and keep polling.
                    log.exception("tier poll failed")

    def _poll_tiers(self) -> None:
        for index, tier in enumerate(self.secondary_tiers):
            try:
                results = list(tier.get_finished_jobs())
            except Exception:
                log.exception(
                    "secondary tier %d (%s): collecting finished jobs failed", index, tier.tier_type
                )
                continue
            for result in results:
                job = self._jobs.pop(result.job_id, None)
                if job is None:
                    log.warning("secondary tier %d reported unknown job %d", index, result.job_id)
                    continue
                self._finish(job, result.success)

    def _finish(self, job: _Job, success: bool) -> None:
        if job.is_store:
            self.primary_tier.complete_read(job.keys)
            if not success:
                log.warning("secondary tier %d failed to store %d keys", job.tier_index, len(job.keys))
            return
        self.primary_tier.complete_write(job.keys, success=success)
        self._promoting.difference_update(job.keys)
        if not success:
            self._failed_promotions.update(job.keys)

    def _submit(
        self, index: int, keys: tuple[OffloadKey, ...], chunk_ids: Iterable[int], is_store: bool
    ) -> bool:
        """Hand a job to tier ``index``; False if it was rejected or raised (logged)."""
        tier = self.secondary_tiers[index]
        job = TransferJob(next(self._job_ids), keys, tuple(chunk_ids))
        try:
            accepted = tier.submit_store(job) if is_store else tier.submit_load(job)
        except Exception:
            log.exception("secondary tier %d (%s) raised accepting job %d", index, tier.tier_type, job.job_id)
            return False
        if accepted:
            self._jobs[job.job_id] = _Job(index, keys, is_store)
        return accepted

    def _cascade(self, keys: list[OffloadKey]) -> None:
        for index, tier in enumerate(self.secondary_tiers):
            missing = tuple(key for key in keys if tier.lookup(key) is LookupResult.MISS)
            if not missing:
                continue
            spec = self.primary_tier.prepare_read(missing)
            if not self._submit(index, missing, spec.chunk_ids, is_store=True):
                self.primary_tier.complete_read(missing)

    def _promote(self, index: int, key: OffloadKey) -> bool:
        prepared = self.primary_tier.prepare_write([key])
        if prepared is None or not prepared.keys_to_store:
            return False  # no evictable room in the primary
        # The primary tier is a CPU chunk pool: its store specs are always chunk ids.
        spec = cast(CPULoadStoreSpec, prepared.store_spec)
        if not self._submit(index, (key,), spec.chunk_ids, is_store=False):
            self.primary_tier.complete_write([key], success=False)
            return False
        self._promoting.add(key)
        return True

    # ----------------------------------------------------------------- OffloadingManager

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        self._poll_tiers()
        if key in self._promoting:
            return LookupResult.RETRY
        found = self.primary_tier.lookup(key)
        if found is not LookupResult.MISS:
            return found
        if key in self._failed_promotions:
            self._failed_promotions.discard(key)
            return LookupResult.MISS
        for index, tier in enumerate(self.secondary_tiers):
            in_tier = tier.lookup(key)
            if in_tier is LookupResult.MISS:
                continue
            if in_tier is not LookupResult.HIT:
                return LookupResult.RETRY  # the tier is still writing or looking it up
            return LookupResult.RETRY if self._promote(index, key) else LookupResult.MISS
        return LookupResult.MISS

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> LoadStoreSpec:
        return self.primary_tier.prepare_load(keys, req_context)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self.primary_tier.touch(keys, req_context)
        for tier in self.secondary_tiers:
            tier.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self.primary_tier.complete_load(keys, req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        self._poll_tiers()
        return self.primary_tier.prepare_store(keys, req_context)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, success: bool = True
    ) -> None:
        # Promotions are write-pending in the primary too; only the tier job may finish them.
        written = [
            key
            for key in dict.fromkeys(keys)
            if key not in self._promoting and self.primary_tier.lookup(key) is LookupResult.HIT_PENDING
        ]
        self.primary_tier.complete_store(written, req_context, success)
        if success and written:
            self._cascade(written)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return self.primary_tier.on_new_request(req_context)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.primary_tier.on_request_finished(req_context)
        for tier in self.secondary_tiers:
            tier.on_request_finished(req_context)

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._poll_tiers()
        events = list(self.primary_tier.take_events())
        for tier in self.secondary_tiers:
            events.extend(tier.take_events())
        return events

    def has_pending_work(self) -> bool:
        self._poll_tiers()
        return bool(self._jobs) or any(tier.has_pending_work() for tier in self.secondary_tiers)

    @property
    def num_jobs_in_flight(self) -> int:
        return len(self._jobs)

    # ----------------------------------------------------------------- shutdown

    def _stop_poll_thread(self) -> None:
        thread = self._poll_thread
        if thread is None:
            return
        self._stop_polling.set()
        thread.join(self.shutdown_timeout_s)
        if thread.is_alive():
            raise KvOffloadError(
                f"the tier-poll thread did not stop within {self.shutdown_timeout_s:g}s; "
                "the tiers were shut down anyway"
            )

    @staticmethod
    def _shutdown_secondary(index: int, tier: SecondaryTierManager) -> None:
        shutdown_secondary(index, tier)

    def _shutdown_primary(self) -> None:
        shutdown_primary(self.primary_tier)

    def shutdown(self) -> None:
        """Stop polling, shut down every secondary tier, then always the primary. Idempotent.

        Call without holding ``lock``. The first failure is raised after everything is
        released; the others are attached to it as notes.
        """
        if self._shut_down:
            return
        self._shut_down = True
        steps: list[tuple[str, Callable[[], object]]] = [
            ("stop the tier-poll thread", self._stop_poll_thread)
        ]
        for index, tier in enumerate(self.secondary_tiers):
            steps.append(
                (
                    f"shut down secondary tier {index} ({tier.tier_type})",
                    partial(self._shutdown_secondary, index, tier),
                )
            )
        steps.append(("shut down the primary tier", self._shutdown_primary))
        release_all(steps)


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
