"""Tiering: the primary tier over a region, write-through, promotion, a shutdown that always releases."""

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
    make_offload_key,
)
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
from kvoffload.errors import ConfigError, InjectedFault, KvOffloadError
from kvoffload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from kvoffload.tiering.manager import (
    POLL_THREAD_NAME,
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)
from kvoffload.tiering.tiers import ExampleSecondaryTierManager

NUM_CHUNKS = 4
ROW = 128


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
        return memoryview(self.mm).cast("B", (self.num_chunks, self.row_stride))

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

    def __init__(
        self,
        primary_kv_view: memoryview,
        *,
        accept: bool = True,
        raise_on_submit: bool = False,
        holds: Iterable[OffloadKey] = (),
        log: list[str] | None = None,
        name: str = "manual",
    ) -> None:
        super().__init__(None, primary_kv_view, name)
        self.accept = accept
        self.raise_on_submit = raise_on_submit
        self.held: dict[OffloadKey, bytes] = {k: pattern(9) for k in holds}
        self.writing: set[OffloadKey] = set()
        self.jobs: list[tuple[TransferJob, bool]] = []
        self.done: list[JobResult] = []
        self.log = log if log is not None else []
        self.shutdowns = 0

    def lookup(self, key: OffloadKey) -> LookupResult:
        if key in self.writing:
            return LookupResult.HIT_PENDING
        return LookupResult.HIT if key in self.held else LookupResult.MISS

    def _take(self, job: TransferJob, is_store: bool) -> bool:
        if self.raise_on_submit:
            raise RuntimeError("tier is broken")
        if self.accept:
            self.jobs.append((job, is_store))
        return self.accept

    def submit_store(self, job: TransferJob) -> bool:
        return self._take(job, True)

    def submit_load(self, job: TransferJob) -> bool:
        return self._take(job, False)

    def finish(self, success: bool = True) -> None:
        for job, is_store in self.jobs:
            for k, chunk in zip(job.keys, job.chunk_ids, strict=True):
                with self.chunk_buffer(chunk) as buf:
                    if is_store and success:
                        self.held[k] = buf.tobytes()
                    elif not is_store and success:
                        buf[:] = self.held[k]
            self.done.append(JobResult(job.job_id, success))
        self.jobs = []

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done, self.done = self.done, []
        return done

    def drain_jobs(self) -> None:
        return None

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.log.append(f"tier {self.tier_type}")


TierMaker = Callable[[memoryview], SecondaryTierManager]


def example_tier(view: memoryview) -> SecondaryTierManager:
    return ExampleSecondaryTierManager(None, view)


@pytest.fixture
def region() -> Iterator[FakeRegion]:
    fake = FakeRegion()
    yield fake
    fake.close_for_test()


def build(region: FakeRegion, *makers: TierMaker, **kwargs: float) -> TieringOffloadingManager:
    primary = CPUPrimaryTierOffloadingManager(region.num_chunks, region, enable_events=True)
    view = primary.get_kv_memoryview()
    return TieringOffloadingManager(primary, [make(view) for make in makers], **kwargs)


def store(manager: TieringOffloadingManager, *ids: int) -> tuple[int, ...]:
    """Store keys through the primary as a worker would: prepare, write the bytes, complete."""
    out = manager.prepare_store(keys(*ids))
    assert out is not None
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    view = manager.primary_tier.get_kv_memoryview()
    for i, chunk in zip(ids, out.store_spec.chunk_ids, strict=True):
        write_chunk(view, chunk, pattern(i))
    manager.complete_store(keys(*ids))
    return out.store_spec.chunk_ids


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


@pytest.mark.parametrize(
    ("num_chunks", "policy", "bad_key"),
    [(NUM_CHUNKS + 1, "lru", "num_chunks"), (NUM_CHUNKS, "mru", "eviction_policy")],
)
def test_primary_constructor_failure_leaves_the_region_to_its_caller(
    region: FakeRegion, num_chunks: int, policy: str, bad_key: str
) -> None:
    with pytest.raises(ConfigError) as info:
        CPUPrimaryTierOffloadingManager(num_chunks, region, cache_policy=policy)
    assert info.value.key == bad_key
    assert (region.views_created, region.cleanups) == (0, 0)


# ---------------------------------------------------------------- write-through


def test_completed_store_is_copied_to_every_secondary_tier(region: FakeRegion) -> None:
    with build(region, example_tier, example_tier) as manager:
        store(manager, 1)
        for t in manager.secondary_tiers:
            assert t.lookup(key(1)) is LookupResult.HIT
            assert isinstance(t, ExampleSecondaryTierManager)
        assert not manager.has_pending_work()


def test_failed_store_is_not_copied_down(region: FakeRegion) -> None:
    with build(region, example_tier) as manager:
        manager.prepare_store(keys(1))
        manager.complete_store(keys(1), success=False)
        assert manager.secondary_tiers[0].lookup(key(1)) is LookupResult.MISS


def test_cascade_pins_the_primary_chunk_until_the_tier_finishes(region: FakeRegion) -> None:
    with build(region, ManualTier) as manager:
        store(manager, 0, 1, 2, 3)
        assert manager.has_pending_work()
        assert manager.prepare_store(keys(9)) is None  # every chunk is pinned by the copy
        tier(manager, 0).finish()
        assert not manager.has_pending_work()
        out = manager.prepare_store(keys(9))
        assert out is not None
        assert out.evicted_keys == keys(0)


def test_cascade_copies_the_primary_bytes(region: FakeRegion) -> None:
    with build(region, ManualTier) as manager:
        store(manager, 5)
        tier(manager, 0).finish()
        assert tier(manager, 0).held[key(5)] == pattern(5)


def test_cascade_skips_tiers_that_already_hold_the_key(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(1))) as manager:
        store(manager, 1, 2)
        [(job, is_store)] = tier(manager, 0).jobs
        assert is_store
        assert job.keys == (key(2),)


def test_rejected_cascade_unpins_the_primary_chunk(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, accept=False)) as manager:
        store(manager, 0, 1, 2, 3)
        assert not manager.has_pending_work()
        assert manager.prepare_store(keys(9)) is not None


def test_tier_that_raises_on_submit_does_not_fail_the_primary_store(
    region: FakeRegion, caplog: pytest.LogCaptureFixture
) -> None:
    with build(region, lambda v: ManualTier(v, raise_on_submit=True), ManualTier) as manager:
        with caplog.at_level(logging.ERROR, logger="kvoffload.tiering.manager"):
            store(manager, 1)
        assert manager.lookup(key(1)) is LookupResult.HIT
        assert "raised accepting job" in caplog.text
        assert len(tier(manager, 1).jobs) == 1


# ---------------------------------------------------------------- lookup and promotion


def test_primary_hit_is_a_hit(region: FakeRegion) -> None:
    with build(region, example_tier) as manager:
        store(manager, 1)
        assert manager.lookup(key(1)) is LookupResult.HIT


def test_key_in_no_tier_is_a_miss(region: FakeRegion) -> None:
    with build(region, example_tier) as manager:
        assert manager.lookup(key(1)) is LookupResult.MISS


def test_secondary_hit_is_promoted_and_answered_retry_until_loaded(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7))) as manager:
        assert manager.lookup(key(7)) is LookupResult.RETRY
        assert manager.lookup(key(7)) is LookupResult.RETRY
        assert len(tier(manager, 0).jobs) == 1  # asking again does not start a second load
        tier(manager, 0).finish()
        assert manager.lookup(key(7)) is LookupResult.HIT
        chunk = manager.prepare_load(keys(7))
        assert isinstance(chunk, CPULoadStoreSpec)
        assert read_chunk(manager.primary_tier.get_kv_memoryview(), chunk.chunk_ids[0]) == pattern(9)
        manager.complete_load(keys(7))


def test_promotion_round_trips_bytes_through_the_example_tier(region: FakeRegion) -> None:
    with build(region, example_tier) as manager:
        store(manager, 0, 1, 2, 3)
        store(manager, 4)  # evicts key 0 from the primary; the tier still has it
        assert manager.primary_tier.lookup(key(0)) is LookupResult.MISS
        assert manager.lookup(key(0)) is LookupResult.RETRY
        assert manager.lookup(key(0)) is LookupResult.HIT
        spec = manager.prepare_load(keys(0))
        assert isinstance(spec, CPULoadStoreSpec)
        assert read_chunk(manager.primary_tier.get_kv_memoryview(), spec.chunk_ids[0]) == pattern(0)
        manager.complete_load(keys(0))


def test_failed_promotion_is_a_miss_once_then_tried_again(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7))) as manager:
        assert manager.lookup(key(7)) is LookupResult.RETRY
        tier(manager, 0).finish(success=False)
        assert manager.lookup(key(7)) is LookupResult.MISS
        assert manager.primary_tier.num_free_chunks == NUM_CHUNKS
        assert manager.lookup(key(7)) is LookupResult.RETRY


def test_promotion_without_room_in_the_primary_is_a_miss(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7))) as manager:
        manager.prepare_store(keys(0, 1, 2, 3))  # every chunk write-pending
        assert manager.lookup(key(7)) is LookupResult.MISS
        assert tier(manager, 0).jobs == []


def test_rejected_promotion_frees_its_chunk_and_is_a_miss(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7), accept=False)) as manager:
        assert manager.lookup(key(7)) is LookupResult.MISS
        assert manager.primary_tier.num_free_chunks == NUM_CHUNKS


def test_key_a_tier_is_still_writing_is_answered_retry(region: FakeRegion) -> None:
    def writing(view: memoryview) -> SecondaryTierManager:
        t = ManualTier(view)
        t.writing.add(key(7))
        return t

    with build(region, writing) as manager:
        assert manager.lookup(key(7)) is LookupResult.RETRY
        assert tier(manager, 0).jobs == []


def test_complete_store_does_not_finish_a_promotion_in_flight(region: FakeRegion) -> None:
    with build(region, lambda v: ManualTier(v, holds=keys(7))) as manager:
        manager.lookup(key(7))
        manager.complete_store(keys(7))
        assert manager.lookup(key(7)) is LookupResult.RETRY


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
        while manager.num_jobs_in_flight and time.monotonic() < deadline:
            time.sleep(0.001)
        assert manager.num_jobs_in_flight == 0


def test_shutdown_stops_the_poll_thread(region: FakeRegion) -> None:
    manager = build(region, PolledTier)
    thread = manager.poll_thread
    assert thread is not None
    manager.shutdown()
    assert not thread.is_alive()


def test_stuck_poll_thread_does_not_stop_the_release(region: FakeRegion) -> None:
    release = threading.Event()

    class StuckTier(PolledTier):
        def get_finished_jobs(self) -> Iterable[JobResult]:
            release.wait(10)
            return ()

    manager = build(region, StuckTier, shutdown_timeout_s=0.05)
    time.sleep(0.02)
    try:
        with pytest.raises(KvOffloadError, match="did not stop"):
            manager.shutdown()
        assert tier(manager, 0).shutdowns == 1
        assert region.cleanups == 1
    finally:
        release.set()
        assert manager.poll_thread is not None
        manager.poll_thread.join(5)


# ---------------------------------------------------------------- shutdown


def logging_tiers(log: list[str]) -> tuple[TierMaker, TierMaker]:
    return (lambda v: ManualTier(v, log=log, name="a")), (lambda v: ManualTier(v, log=log, name="b"))


def test_shutdown_releases_secondaries_in_order_then_the_primary() -> None:
    log: list[str] = []
    region = FakeRegion(log=log)
    build(region, *logging_tiers(log)).shutdown()
    assert log == ["tier a", "tier b", "region"]
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
    with faults.scenario("cleanup.secondary.0=raise"), pytest.raises(InjectedFault) as info:
        manager.shutdown()
    assert info.value.point == "cleanup.secondary.0"
    # The failing tier is still shut down (the point reports a failure after it), and its
    # failure stops neither the next tier nor the primary's region.
    assert log == ["tier a", "tier b", "region"]


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
    manager = TieringOffloadingManager(primary, [ExampleSecondaryTierManager(None, view)])
    out = manager.prepare_store(keys(1))
    assert out is not None
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    write_chunk(view, out.store_spec.chunk_ids[0], pattern(1, PAGESIZE))
    manager.complete_store(keys(1))
    assert manager.secondary_tiers[0].lookup(key(1)) is LookupResult.HIT
    with faults.scenario("cleanup.secondary=raise"), pytest.raises(InjectedFault):
        manager.shutdown()
    assert region.closed
    assert not region.path.exists()
