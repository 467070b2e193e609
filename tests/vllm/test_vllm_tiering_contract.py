"""vLLM 0.33's secondary-tier contract, as kvoffload keeps it, and where kvoffload is stricter.

The tier here is written the way a vLLM user writes one: vLLM's constructor signature,
``super().__init__`` with a back-pressure detector, the primary view read through numpy
(vLLM's region view is an int8 numpy memoryview), ``submit_*`` returning nothing and
completions reported later. It is loaded by ``module_path``, as an out-of-tree tier is.
"""

from __future__ import annotations

import gc
import importlib.util
import logging
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import pytest

from kvoffload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TierFilter,
    TierMatcher,
    make_offload_key,
)
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
from kvoffload.tiering.backpressure import BackpressureDetector
from kvoffload.tiering.base import JobResult, ParentManager, SecondaryTierManager, TransferJob
from kvoffload.tiering.factory import SecondaryTierFactory
from kvoffload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

NUM_CHUNKS = 4
ROW = 64
CTX = ReqContext(req_id="r")
STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


class NumpyRegion:
    """A region whose view is vLLM's: ``memoryview`` of a 2-D int8 numpy array."""

    def __init__(self) -> None:
        self.array = np.zeros((NUM_CHUNKS, ROW), dtype=np.int8)
        self.cleaned = 0

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.array)  # type: ignore[arg-type]  # numpy arrays export buffers

    def cleanup(self) -> None:
        self.cleaned += 1


class VllmStyleTier(SecondaryTierManager):
    """An out-of-tree tier as written for vLLM 0.33 (kept in memory, finishing at the next poll)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        capacity: int = 16,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        self.capacity = capacity
        self.blocks: dict[OffloadKey, bytes] = {}
        self.queued: list[TransferJob] = []
        self.finished_requests: list[str] = []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.blocks else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self.queued.append(job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self.queued.append(job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        rows = np.asarray(self._primary_kv_view)
        results = []
        for job in self.queued:
            for k, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
                if job.is_promotion:
                    rows[chunk_id] = np.frombuffer(self.blocks[k], dtype=np.int8)
                elif len(self.blocks) < self.capacity:
                    self.blocks[k] = rows[chunk_id].tobytes()
            results.append(JobResult(job.job_id, True, transfer_time=0.0))
        del rows  # no export of the primary view outlives the call
        self.queued = []
        return results

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.finished_requests.append(req_context.req_id)

    def drain_jobs(self) -> None:
        return None


class PeerServingTier(VllmStyleTier):
    """Serves a peer's request through the parent manager, as vLLM's p2p tier does."""

    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.peer_keys: list[OffloadKey] = []
        self.peer_jobs: list[TransferJob] = []
        self.peer_lookups: list[LookupResult] = []

    def serve_external_requests(self, parent: ParentManager) -> None:
        if not self.peer_keys:
            return
        peer = ReqContext(req_id="peer")
        parent.on_new_request(peer)
        found = [k for k in self.peer_keys if parent.lookup(k, peer) is LookupResult.HIT]
        self.peer_lookups = [parent.lookup(k, peer) for k in self.peer_keys]
        if found:
            self.peer_jobs.append(parent.create_store_job(found, peer))
        parent.on_request_finished(peer)
        self.peer_keys = []


def from_config(view: memoryview, cls: str = "VllmStyleTier", **options: Any) -> SecondaryTierManager:
    config = {"type": cls, "module_path": __name__, **options}
    return SecondaryTierFactory.create_secondary_tier(config, view, None)


@pytest.fixture
def region() -> NumpyRegion:
    return NumpyRegion()


def build(region: NumpyRegion, *tier_classes: str, **options: Any) -> TieringOffloadingManager:
    primary = CPUPrimaryTierOffloadingManager(NUM_CHUNKS, region)
    view = primary.get_kv_memoryview()
    tiers = [from_config(view, cls, **options) for cls in tier_classes or ("VllmStyleTier",)]
    manager = TieringOffloadingManager(primary, tiers, tier_poll_interval_s=0)
    manager.on_new_request(CTX)
    return manager


def store(manager: TieringOffloadingManager, *ids: int, fill: int = 0) -> list[int]:
    out = manager.prepare_store([key(i) for i in ids], CTX)
    assert out is not None
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    rows = np.asarray(manager.primary_tier.get_kv_memoryview())
    for i, chunk in zip(ids, out.store_spec.chunk_ids, strict=True):
        rows[chunk] = fill or i
    del rows
    manager.complete_store([key(i) for i in ids], CTX)
    return list(out.store_spec.chunk_ids)


# ---------------------------------------------------------------- an out-of-tree vLLM tier


def test_a_tier_written_for_vllm_is_built_from_its_module_path(region: NumpyRegion) -> None:
    with build(region, capacity=3) as manager:
        [tier] = manager.secondary_tiers
        assert isinstance(tier, VllmStyleTier)
        assert (tier.capacity, tier.tier_type, tier.block_size_bytes) == (3, "VllmStyleTier", ROW)
        assert tier.cache_hit_source == "disk"


def test_a_tier_written_for_vllm_round_trips_chunks_through_cascade_and_promotion(
    region: NumpyRegion,
) -> None:
    with build(region) as manager:
        store(manager, 1, 2, 3, 4)
        manager.on_schedule_end(STEP)  # the step's poll ran at prepare_store; this one is gated
        manager.on_schedule_end(STEP)  # collects the cascade: the tier holds all four
        store(manager, 5)  # evicts key 1 from the primary
        assert manager.primary_tier.lookup(key(1), CTX) is LookupResult.MISS
        assert manager.lookup(key(1), CTX) is LookupResult.HIT_PENDING
        manager.on_schedule_end(STEP)  # submits the promotion
        manager.on_schedule_end(STEP)  # collects it
        assert manager.lookup(key(1), CTX) is LookupResult.HIT
        spec = manager.prepare_load([key(1)], CTX)
        assert isinstance(spec, CPULoadStoreSpec)
        assert set(np.asarray(manager.primary_tier.get_kv_memoryview())[spec.chunk_ids[0]]) == {1}
        manager.complete_load([key(1)], CTX)
        assert manager.get_load_source(key(1), CTX) == "disk"


def test_a_tier_hears_a_request_finish_only_after_its_cascade_was_submitted(region: NumpyRegion) -> None:
    with build(region) as manager:
        [tier] = manager.secondary_tiers
        assert isinstance(tier, VllmStyleTier)
        assert manager.prepare_store([key(1)], CTX) is not None
        manager.on_request_finished(CTX)
        assert tier.finished_requests == []
        manager.complete_store([key(1)], CTX)
        assert [list(job.keys) for job in tier.queued] == [[key(1)]]
        assert tier.finished_requests == [CTX.req_id]


def test_a_request_whose_tier_filter_excludes_storage_never_asks_the_storage_tier(
    region: NumpyRegion,
) -> None:
    with build(region) as manager:
        [tier] = manager.secondary_tiers
        assert isinstance(tier, VllmStyleTier)
        tier.blocks[key(9)] = bytes(ROW)
        cpu_only = ReqContext(
            req_id="cpu-only", load_tier_filter=TierFilter(matchers=(TierMatcher(Medium.CPU),))
        )
        manager.on_new_request(cpu_only)
        assert manager.lookup(key(9), cpu_only) is LookupResult.MISS
        assert manager.lookup(key(9), CTX) is LookupResult.HIT_PENDING


# ---------------------------------------------------------------- serving a peer


def test_a_tier_serving_a_peer_is_left_out_of_its_own_fan_out_and_pins_what_it_copies(
    region: NumpyRegion,
) -> None:
    with build(region, "PeerServingTier", "VllmStyleTier") as manager:
        server, other = manager.secondary_tiers
        assert isinstance(server, PeerServingTier)
        assert isinstance(other, VllmStyleTier)
        store(manager, 1)
        manager.on_schedule_end(STEP)
        manager.on_schedule_end(STEP)
        server.blocks[key(2)] = bytes(ROW)  # only the serving tier holds key 2
        other.finished_requests.clear()
        server.peer_keys = [key(1), key(2)]
        manager.on_schedule_end(STEP)
        # Key 2 is in no tier but the server itself, which the fan-out skips: a miss.
        assert server.peer_lookups == [LookupResult.HIT, LookupResult.MISS]
        [job] = server.peer_jobs
        assert list(job.keys) == [key(1)]
        assert other.finished_requests == ["peer"]
        chunk = manager.primary_tier._policy.get(key(1))
        assert chunk is not None
        assert chunk.ref_cnt == 1  # pinned for the peer's copy until the server reports it
        server.queued.append(job)
        manager.on_schedule_end(STEP)
        assert chunk.ref_cnt == 0


# ---------------------------------------------------------------- where kvoffload is stricter


class RaisingTier(VllmStyleTier):
    def submit_store(self, job_metadata: TransferJob) -> None:
        raise ConnectionError("backend down")


def test_a_tier_that_raises_on_submit_leaves_nothing_pinned_and_the_store_readable(
    region: NumpyRegion, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM lets the exception out of complete_store; kvoffload finishes the job as failed."""
    with build(region, "RaisingTier") as manager, caplog.at_level(logging.ERROR):
        store(manager, 1, 2, 3, 4)
        assert manager.lookup(key(1), CTX) is LookupResult.HIT
        assert not manager.has_pending_work()
        assert manager.prepare_store([key(9)], CTX) is not None  # nothing stayed pinned
        assert "backend down" in caplog.text


class WrongJobTier(VllmStyleTier):
    def get_finished_jobs(self) -> Iterable[JobResult]:
        return [JobResult(job_id=12345, success=True)]


def test_a_tier_reporting_a_job_it_was_never_given_is_ignored(
    region: NumpyRegion, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM asserts, which takes the scheduler down; kvoffload logs the tier's mistake."""
    with build(region, "WrongJobTier") as manager, caplog.at_level(logging.WARNING):
        manager.on_schedule_end(STEP)
        assert "unknown job 12345" in caplog.text


def test_shutdown_releases_the_region_even_when_a_tier_keeps_a_numpy_view_of_it(engine_id: str) -> None:
    """vLLM's view.release() raises BufferError here, before the region is cleaned; kvoffload
    unlinks the name at once and keeps only the mapping, for as long as the array lives."""
    region = SharedOffloadRegion(engine_id, NUM_CHUNKS, None, PAGESIZE, PAGESIZE)
    primary = CPUPrimaryTierOffloadingManager(NUM_CHUNKS, region)
    tier = from_config(primary.get_kv_memoryview())
    held = np.asarray(tier._primary_kv_view)  # a tier caching an array over the view
    TieringOffloadingManager(primary, [tier], tier_poll_interval_s=0).shutdown()
    assert not region.path.exists()
    assert region.mmap_obj is not None  # still mapped: `held` reads it
    held[0, 0] = 1
    # Once the last user lets go the mapping goes with it (the autouse fixture checks).
    del held, tier, primary, region
    gc.collect()


def test_without_vllm_there_is_no_stats_payload_and_the_manager_still_runs(region: NumpyRegion) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed: its OffloadingConnectorStats is the payload")
    with build(region) as manager:
        store(manager, 1)
        assert manager.lookup(key(1), CTX) is LookupResult.HIT
        assert manager.get_stats() is None
