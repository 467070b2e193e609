"""Tiering: the primary tier over a region, cascade, promotion, a shutdown that always releases."""

from __future__ import annotations

import ctypes
import logging
import mmap
import pickle
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import pytest

from kvoffload import faults
from kvoffload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    make_offload_key,
)
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
from kvoffload.errors import ConfigError, InjectedFault, KvOffloadError
from kvoffload.tiering import manager as tiering_manager
from kvoffload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from kvoffload.tiering.example.manager import ExampleSecondaryTierManager
from kvoffload.tiering.manager import (
    POLL_THREAD_NAME,
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

NUM_CHUNKS = 4
ROW = 128
CTX = ReqContext(req_id="r")


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def pattern(seed: int, size: int = ROW) -> bytes:
    return bytes((seed * 37 + i) % 256 for i in range(size))


def write_chunk(view: memoryview, chunk: int, data: bytes) -> None:
    with view.cast("B") as flat:
        flat[chunk * len(data) : (chunk + 1) * len(data)] = data


def read_chunk(view: memoryview, chunk: int) -> bytes:
    assert view.strides is not None
    row = view.strides[0]
    with view.cast("B") as flat:
        return flat[chunk * row : (chunk + 1) * row].tobytes()


class FakeRegion:
    """A scheduler-side region in anonymous memory that records its cleanup.

    Unlike the real region it does not release the memoryviews it handed out, so a
    primary tier that forgets to release its view makes ``cleanup`` keep the mapping.
    """

    def __init__(
        self, num_chunks: int = NUM_CHUNKS, row_stride: int = ROW, log: list[str] | None = None
    ) -> None:
        self.num_chunks = num_chunks
        self.row_stride = row_stride
        self.mm = mmap.mmap(-1, num_chunks * row_stride)
        self.views_created = 0
        self.cleanups = 0
        self.kept_mapped = False
        self.log = log if log is not None else []

    def create_kv_memoryview(self) -> memoryview:
        self.views_created += 1
        return memoryview(self.mm).cast("b", (self.num_chunks, self.row_stride))

    def cleanup(self) -> None:
        self.cleanups += 1
        self.log.append("region")
        try:
            self.mm.close()
        except BufferError:
            self.kept_mapped = True

    def close_for_test(self) -> None:
        if not self.mm.closed:
            self.mm.close()


class ManualTier(SecondaryTierManager):
    """An asynchronous tier double: jobs finish only when ``finish`` is called."""

    medium = Medium.STORAGE

    def __init__(
        self,
        primary_kv_view: memoryview,
        *,
        raise_on_submit: bool = False,
        holds: Iterable[OffloadKey] = (),
        log: list[str] | None = None,
        name: str = "manual",
    ) -> None:
        super().__init__(None, primary_kv_view, name)
        self.raise_on_submit = raise_on_submit
        self.held: dict[OffloadKey, bytes] = {k: pattern(9) for k in holds}
        self.writing: set[OffloadKey] = set()
        self.jobs: list[TransferJob] = []
        self.done: list[JobResult] = []
        self.log = log if log is not None else []
        self.finished_requests: list[str] = []
        self.shutdowns = 0

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key in self.writing:
            return LookupResult.RETRY
        return LookupResult.HIT if key in self.held else LookupResult.MISS

    def _take(self, job: TransferJob) -> None:
        if self.raise_on_submit:
            raise RuntimeError("tier is broken")
        self.jobs.append(job)

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._take(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._take(job_metadata)

    def finish(self, success: bool = True, landed: Iterable[OffloadKey] | None = None) -> None:
        """Finish every job; ``landed``: a promotion that failed part-way loaded only these."""
        for job in self.jobs:
            ok_keys = set(job.keys) if success else set(landed or ())
            for k, chunk in zip(job.keys, job.chunk_ids, strict=True):
                if k not in ok_keys:
                    continue
                with self.chunk_buffer(chunk) as buf:
                    if job.is_promotion:
                        buf[:] = self.held[k]
                    else:
                        self.held[k] = buf.tobytes()
            partial_keys = None if success or landed is None else tuple(landed)
            self.done.append(JobResult(job.job_id, success, successful_keys=partial_keys))
        self.jobs = []

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done, self.done = self.done, []
        return done

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.finished_requests.append(req_context.req_id)

    def drain_jobs(self) -> None:
        self.finish(success=False)

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.log.append(f"tier {self.tier_type}")


TierMaker = Callable[[memoryview], SecondaryTierManager]


def example_tier(view: memoryview) -> SecondaryTierManager:
    return ExampleSecondaryTierManager(None, view, "example")


@pytest.fixture
def region() -> Iterator[FakeRegion]:
    fake = FakeRegion()
    yield fake
    fake.close_for_test()


def build(region: FakeRegion, *makers: TierMaker, **kwargs: float) -> TieringOffloadingManager:
    primary = CPUPrimaryTierOffloadingManager(region.num_chunks, region, enable_events=True)
    view = primary.get_kv_memoryview()
    manager = TieringOffloadingManager(primary, [make(view) for make in makers], **kwargs)
    manager.on_new_request(CTX)
    return manager


def store(manager: TieringOffloadingManager, *ids: int, ctx: ReqContext = CTX) -> tuple[int, ...]:
    """Store keys through the primary as a worker would: prepare, write the bytes, complete."""
    out = manager.prepare_store(keys(*ids), ctx)
    assert out is not None
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    view = manager.primary_tier.get_kv_memoryview()
    for i, chunk in zip(ids, out.store_spec.chunk_ids, strict=True):
        write_chunk(view, chunk, pattern(i))
    manager.complete_store(keys(*ids), ctx)
    return tuple(out.store_spec.chunk_ids.tolist())


def end_step(manager: TieringOffloadingManager) -> None:
    manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def tier(manager: TieringOffloadingManager, index: int) -> ManualTier:
    t = manager.secondary_tiers[index]
    assert isinstance(t, ManualTier)
    return t


# ---------------------------------------------------------------- primary tier


def test_primary_tier_maps_the_region_eagerly(region: FakeRegion) -> None:
    primary = CPUPrimaryTierOffloadingManager(NUM_CHUNKS, region)
    view = primary.get_kv_memoryview()
    assert region.views_created == 1
    assert (view.shape, view.strides) == ((NUM_CHUNKS, ROW), (ROW, 1))
    primary.shutdown()


def test_primary_tier_needs_nothing_of_the_region_but_its_view() -> None:
    class ViewOnly:
        def __init__(self) -> None:
            self.mm = mmap.mmap(-1, NUM_CHUNKS * ROW)
            self.cleaned = False

        def create_kv_memoryview(self) -> memoryview:
            return memoryview(self.mm).cast("b", (NUM_CHUNKS, ROW))

        def cleanup(self) -> None:
            self.cleaned = True
            self.mm.close()

    region = ViewOnly()
    CPUPrimaryTierOffloadingManager(NUM_CHUNKS, region).shutdown()
    assert region.cleaned
    assert region.mm.closed


def test_primary_shutdown_releases_its_view_before_cleaning_the_region(region: FakeRegion) -> None:
    primary = CPUPrimaryTierOffloadingManager(NUM_CHUNKS, region)
    view = primary.get_kv_memoryview()
    primary.shutdown()
    with pytest.raises(ValueError, match="released"):
        view.tobytes()
    assert region.cleanups == 1
    assert region.mm.closed


def test_primary_shutdown_is_idempotent(region: FakeRegion) -> None:
    primary = CPUPrimaryTierOffloadingManager(NUM_CHUNKS, region)
    primary.shutdown()
    primary.shutdown()
    assert region.cleanups == 1
    with pytest.raises(KvOffloadError, match="shut down"):
        primary.get_kv_memoryview()


def test_primary_cleans_the_region_even_when_its_view_cannot_be_released(region: FakeRegion) -> None:
    primary = CPUPrimaryTierOffloadingManager(NUM_CHUNKS, region)
    view = primary.get_kv_memoryview()
    holder = pickle.PickleBuffer(view)  # holds the view's buffer itself
    with pytest.raises(BufferError, match="exported"):
        primary.shutdown()
    assert region.cleanups == 1
    assert region.kept_mapped  # the region refuses to unmap memory someone still uses
    holder.release()
    view.release()


def test_native_user_of_the_region_keeps_it_mapped_without_failing_shutdown(region: FakeRegion) -> None:
    primary = CPUPrimaryTierOffloadingManager(NUM_CHUNKS, region)
    native_user = ctypes.c_char.from_buffer(primary.get_kv_memoryview())
    primary.shutdown()
    assert region.cleanups == 1
    assert region.kept_mapped
    del native_user


def test_primary_constructor_failure_leaves_the_region_to_its_caller(region: FakeRegion) -> None:
    with pytest.raises(ConfigError) as info:
        CPUPrimaryTierOffloadingManager(NUM_CHUNKS, region, cache_policy="mru")
    assert "policy" in info.value.key
    assert (region.views_created, region.cleanups) == (0, 0)


# ---------------------------------------------------------------- cascade


def test_completed_store_is_copied_to_every_secondary_tier(region: FakeRegion) -> None:
    with build(region, example_tier, example_tier) as manager:
        store(manager, 1)
        for t in manager.secondary_tiers:
            assert t.lookup(key(1), CTX) is LookupResult.HIT
        end_step(manager)
        end_step(manager)
        assert not manager.has_pending_work()


def test_failed_store_is_not_copied_down(region: FakeRegion) -> None:
    with build(region, example_tier) as manager:
        manager.prepare_store(keys(1), CTX)
        manager.complete_store(keys(1), CTX, success=False)
        assert manager.secondary_tiers[0].lookup(key(1), CTX) is LookupResult.MISS


def test_cascade_pins_the_primary_chunk_until_the_tier_reports_it(region: FakeRegion) -> None:
    with build(region, ManualTier) as manager:
        store(manager, 0, 1, 2, 3)
        assert manager.has_pending_work()
        assert manager.prepare_store(keys(9), CTX) is None  # every chunk is pinned by the copy
        tier(manager, 0).finish()
        out = manager.prepare_store(keys(9), CTX)  # a store always collects finished jobs first
        assert out is not None
        assert out.evicted_keys == keys(0)
        assert not manager.has_pending_work()


def test_cascade_copies_the_primary_bytes(region: FakeRegion) -> None:
    with build(region, ManualTier) as manager:
        store(manager, 5)
        tier(manager, 0).finish()
        assert tier(manager, 0).held[key(5)] == pattern(5)


def test_cascade_job_carries_numpy_chunk_ids_and_the_request(region: FakeRegion) -> None:
    with build(region, ManualTier) as manager:
        chunks = store(manager, 1, 2)
        [job] = tier(manager, 0).jobs
        assert not job.is_promotion
        assert job.req_context is CTX
        assert list(job.chunk_ids) == list(chunks)
        assert str(job.chunk_ids.dtype) == "int32"  # vLLM's (NIXL's index type; its obj tier asserts it)
        # vLLM's name for the jobs in flight, which its tier tests read.
        assert manager._transfer_jobs == {job.job_id: manager._jobs[job.job_id]}


def test_promotion_job_carries_int32_chunk_ids_as_vllms_does(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7))) as manager:
        manager.lookup(key(7), CTX)
        end_step(manager)
        [job] = tier(manager, 0).jobs
        assert job.is_promotion
        assert str(job.chunk_ids.dtype) == "int32"


def test_cascade_reported_failed_unpins_the_primary_chunk(region: FakeRegion) -> None:
    with build(region, ManualTier) as manager:
        store(manager, 0, 1, 2, 3)
        tier(manager, 0).finish(success=False)
        assert manager.prepare_store(keys(9), CTX) is not None


def test_tier_that_raises_on_submit_does_not_fail_the_primary_store(
    region: FakeRegion, caplog: pytest.LogCaptureFixture
) -> None:
    with build(region, lambda v: ManualTier(v, raise_on_submit=True), ManualTier) as manager:
        with caplog.at_level(logging.ERROR, logger="kvoffload.tiering.manager"):
            store(manager, 0, 1, 2, 3)
        assert manager.lookup(key(1), CTX) is LookupResult.HIT
        assert "raised accepting job" in caplog.text
        assert len(tier(manager, 1).jobs) == 1
        tier(manager, 1).finish()
        # The broken tier's job was finished as failed at once: nothing stays pinned for it.
        assert manager.prepare_store(keys(9), CTX) is not None


def test_secondary_tiers_hear_a_finished_request_only_after_its_last_store(region: FakeRegion) -> None:
    with build(region, ManualTier) as manager:
        assert manager.prepare_store(keys(1), CTX) is not None
        manager.on_request_finished(CTX)
        assert tier(manager, 0).finished_requests == []
        manager.complete_store(keys(1), CTX)
        assert tier(manager, 0).finished_requests == [CTX.req_id]
        assert [job.keys for job in tier(manager, 0).jobs] == [keys(1)]


# ---------------------------------------------------------------- lookup and promotion


def test_primary_hit_is_a_hit(region: FakeRegion) -> None:
    with build(region, example_tier) as manager:
        store(manager, 1)
        assert manager.lookup(key(1), CTX) is LookupResult.HIT


def test_key_in_no_tier_is_a_miss(region: FakeRegion) -> None:
    with build(region, example_tier) as manager:
        assert manager.lookup(key(1), CTX) is LookupResult.MISS


def test_secondary_hit_is_promoted_at_the_step_s_end_and_pending_until_loaded(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7))) as manager:
        assert manager.lookup(key(7), CTX) is LookupResult.HIT_PENDING
        assert manager.lookup(key(7), CTX) is LookupResult.HIT_PENDING
        assert tier(manager, 0).jobs == []  # submitted at the end of the step, once
        end_step(manager)
        [job] = tier(manager, 0).jobs
        assert job.is_promotion
        assert list(job.keys) == keys(7)
        tier(manager, 0).finish()
        assert manager.lookup(key(7), CTX) is LookupResult.HIT
        chunk = manager.prepare_load(keys(7), CTX)
        assert isinstance(chunk, CPULoadStoreSpec)
        assert read_chunk(manager.primary_tier.get_kv_memoryview(), chunk.chunk_ids[0]) == pattern(9)
        manager.complete_load(keys(7), CTX)
        assert manager.get_load_source(key(7), CTX) == "disk"


def test_promotion_round_trips_bytes_through_the_example_tier(region: FakeRegion) -> None:
    with build(region, example_tier) as manager:
        store(manager, 0, 1, 2, 3)
        end_step(manager)
        store(manager, 4)  # evicts key 0 from the primary; the tier still has it
        assert manager.primary_tier.lookup(key(0), CTX) is LookupResult.MISS
        assert manager.lookup(key(0), CTX) is LookupResult.HIT_PENDING
        end_step(manager)
        assert manager.lookup(key(0), CTX) is LookupResult.HIT
        spec = manager.prepare_load(keys(0), CTX)
        assert isinstance(spec, CPULoadStoreSpec)
        assert read_chunk(manager.primary_tier.get_kv_memoryview(), spec.chunk_ids[0]) == pattern(0)
        manager.complete_load(keys(0), CTX)


def test_failed_promotion_is_a_miss_once_for_its_request_then_tried_again(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7))) as manager:
        assert manager.lookup(key(7), CTX) is LookupResult.HIT_PENDING
        end_step(manager)
        tier(manager, 0).finish(success=False)
        assert manager.lookup(key(7), CTX) is LookupResult.MISS
        assert manager.primary_tier.num_free_chunks == NUM_CHUNKS
        assert manager.lookup(key(7), CTX) is LookupResult.HIT_PENDING


def test_partly_failed_promotion_keeps_the_keys_that_landed(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(6, 7))) as manager:
        for i in (6, 7):
            assert manager.lookup(key(i), CTX) is LookupResult.HIT_PENDING
        end_step(manager)
        tier(manager, 0).finish(success=False, landed=keys(7))
        assert manager.lookup(key(7), CTX) is LookupResult.HIT
        assert manager.lookup(key(6), CTX) is LookupResult.MISS


def test_promotion_without_room_in_the_primary_is_a_miss(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7))) as manager:
        manager.prepare_store(keys(0, 1, 2, 3), CTX)  # every chunk write-pending
        assert manager.lookup(key(7), CTX) is LookupResult.MISS
        end_step(manager)
        assert tier(manager, 0).jobs == []


def test_promotion_a_tier_raises_on_frees_its_chunk_and_is_a_miss(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7), raise_on_submit=True)) as manager:
        assert manager.lookup(key(7), CTX) is LookupResult.HIT_PENDING
        end_step(manager)
        assert manager.primary_tier.num_free_chunks == NUM_CHUNKS
        assert manager.lookup(key(7), CTX) is LookupResult.MISS


def test_key_a_tier_is_still_looking_up_is_answered_retry(region: FakeRegion) -> None:
    def writing(view: memoryview) -> SecondaryTierManager:
        t = ManualTier(view)
        t.writing.add(key(7))
        return t

    with build(region, writing) as manager:
        assert manager.lookup(key(7), CTX) is LookupResult.RETRY
        end_step(manager)
        assert tier(manager, 0).jobs == []


def test_complete_store_does_not_finish_a_promotion_in_flight(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7))) as manager:
        assert manager.lookup(key(7), CTX) is LookupResult.HIT_PENDING
        manager.complete_store(keys(7), CTX)
        assert manager.lookup(key(7), CTX) is LookupResult.HIT_PENDING


def test_reset_cache_drains_the_tiers_and_holds_promotions_until_flushed(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7))) as manager:
        store(manager, 1)
        assert manager.has_pending_work()
        manager.reset_cache()  # ManualTier's drain fails the cascade still in flight
        assert not manager.has_pending_work()
        assert manager.primary_tier.num_free_chunks == NUM_CHUNKS
        assert manager.lookup(key(7), CTX) is LookupResult.MISS
        manager.on_reset_flushed()
        assert manager.lookup(key(7), CTX) is LookupResult.HIT_PENDING


def test_primary_events_pass_through(region: FakeRegion) -> None:
    with build(region, example_tier) as manager:
        store(manager, 1)
        assert list(manager.take_events()) == [OffloadingEvent([key(1)], Medium.CPU, removed=False)]


# ---------------------------------------------------------------- the tier-poll thread


class PolledTier(ManualTier):
    tolerates_off_thread_polling = True


def test_no_poll_thread_unless_a_tier_tolerates_off_thread_polling(region: FakeRegion) -> None:
    with build(region, ManualTier) as manager:
        assert manager.poll_thread is None


def test_poll_thread_collects_finished_jobs_under_the_lock(region: FakeRegion) -> None:
    with build(region, PolledTier) as manager:
        assert manager.poll_thread is not None
        assert manager.poll_thread.name == POLL_THREAD_NAME
        with manager.lock:
            store(manager, 1)
            tier(manager, 0).finish()
        deadline = time.monotonic() + 5
        while manager.has_pending_work() and time.monotonic() < deadline:
            time.sleep(0.001)
        with manager.lock:
            assert not manager.has_pending_work()


def test_shutdown_stops_the_poll_thread(region: FakeRegion) -> None:
    manager = build(region, PolledTier)
    thread = manager.poll_thread
    assert thread is not None
    manager.shutdown()
    assert not thread.is_alive()


def test_poll_thread_stuck_in_a_round_leaves_the_tiers_but_the_region_is_released(
    region: FakeRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    entered = threading.Event()

    class StuckTier(PolledTier):
        def get_finished_jobs(self) -> Iterable[JobResult]:
            entered.set()
            release.wait(10)
            return ()

    monkeypatch.setattr(tiering_manager, "_TIER_POLL_JOIN_TIMEOUT_S", 0.05)
    manager = build(region, StuckTier)
    assert entered.wait(5)
    try:
        with pytest.raises(RuntimeError, match="without holding"):
            manager.shutdown()
        # Tearing the tier down under a live round could crash; the region is safe to release.
        assert tier(manager, 0).shutdowns == 0
        assert region.cleanups == 1
    finally:
        release.set()
    manager.shutdown()  # the thread is gone now: the tier is shut down at last, once
    assert tier(manager, 0).shutdowns == 1
    assert region.cleanups == 1


# ---------------------------------------------------------------- shutdown


def logging_tiers(log: list[str]) -> tuple[TierMaker, TierMaker]:
    return (lambda v: ManualTier(v, log=log, name="a")), (lambda v: ManualTier(v, log=log, name="b"))


def test_shutdown_releases_secondaries_last_built_first_then_the_primary() -> None:
    log: list[str] = []
    region = FakeRegion(log=log)
    build(region, *logging_tiers(log)).shutdown()
    assert log == ["tier b", "tier a", "region"]
    assert region.mm.closed


def test_primary_is_released_even_when_every_secondary_shutdown_raises(region: FakeRegion) -> None:
    manager = build(region, ManualTier, ManualTier)
    view = manager.primary_tier.get_kv_memoryview()
    with faults.scenario("cleanup.secondary=raise"), pytest.raises(InjectedFault) as info:
        manager.shutdown()
    assert info.value.point == "cleanup.secondary"
    assert region.cleanups == 1
    assert region.mm.closed
    with pytest.raises(ValueError, match="released"):
        view.tobytes()
    assert any("also failed while releasing" in note for note in info.value.__notes__)


def test_one_failing_secondary_does_not_skip_the_others() -> None:
    log: list[str] = []
    region = FakeRegion(log=log)
    manager = build(region, *logging_tiers(log))
    with faults.scenario("cleanup.secondary.1=raise"), pytest.raises(InjectedFault) as info:
        manager.shutdown()
    assert info.value.point == "cleanup.secondary.1"
    # The failing tier is still shut down (the point reports a failure after it), and its
    # failure stops neither the next tier nor the primary's region.
    assert log == ["tier b", "tier a", "region"]


def test_secondary_shutdown_error_is_raised_after_the_primary_is_released(region: FakeRegion) -> None:
    class BrokenTier(ManualTier):
        def shutdown(self) -> None:
            raise OSError("tier device gone")

    manager = build(region, BrokenTier)
    with pytest.raises(OSError, match="tier device gone"):
        manager.shutdown()
    assert region.mm.closed


def test_failing_primary_shutdown_still_shuts_every_secondary(region: FakeRegion) -> None:
    manager = build(region, ManualTier, ManualTier)
    with faults.scenario("cleanup.primary=raise"), pytest.raises(InjectedFault, match=r"cleanup\.primary"):
        manager.shutdown()
    assert [tier(manager, i).shutdowns for i in (0, 1)] == [1, 1]
    assert region.cleanups == 1
    assert region.mm.closed


def test_shutdown_is_idempotent_even_after_a_failure(region: FakeRegion) -> None:
    manager = build(region, ManualTier)
    with faults.scenario("cleanup.secondary=raise"), pytest.raises(InjectedFault):
        manager.shutdown()
    manager.shutdown()
    assert region.cleanups == 1
    assert tier(manager, 0).shutdowns == 1


def test_leaving_the_with_block_on_an_error_keeps_that_error(region: FakeRegion) -> None:
    manager = build(region, ManualTier)
    with faults.scenario("cleanup.secondary=raise"), pytest.raises(KeyError) as info, manager:
        raise KeyError("the original error")
    assert region.mm.closed
    assert any("shutdown also failed" in note for note in info.value.__notes__)


# ---------------------------------------------------------------- over a real region


def test_real_region_is_released_even_when_a_secondary_shutdown_raises(engine_id: str) -> None:
    region = SharedOffloadRegion(engine_id, NUM_CHUNKS, None, PAGESIZE, PAGESIZE)
    primary = CPUPrimaryTierOffloadingManager(NUM_CHUNKS, region)
    view = primary.get_kv_memoryview()
    manager = TieringOffloadingManager(primary, [ExampleSecondaryTierManager(None, view, "example")])
    manager.on_new_request(CTX)
    out = manager.prepare_store(keys(1), CTX)
    assert out is not None
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    write_chunk(view, out.store_spec.chunk_ids[0], pattern(1, PAGESIZE))
    manager.complete_store(keys(1), CTX)
    assert manager.secondary_tiers[0].lookup(key(1), CTX) is LookupResult.HIT
    with faults.scenario("cleanup.secondary=raise"), pytest.raises(InjectedFault):
        manager.shutdown()
    assert region.closed
    assert not region.path.exists()
