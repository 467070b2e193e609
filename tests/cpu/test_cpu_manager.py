"""CPUOffloadingManager: the chunk pool, reference counts, eviction, store threshold, events."""

from __future__ import annotations

from collections.abc import Set

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    make_offload_key,
)
from kvoffload.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo
from kvoffload.cpu.manager import CPUOffloadingManager
from kvoffload.cpu.policies import Eviction, LRUCachePolicy
from kvoffload.errors import ConfigError, KvOffloadError


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def prepared(manager: CPUOffloadingManager, *ids: int) -> PrepareStoreOutput:
    out = manager.prepare_store(keys(*ids))
    assert out is not None
    return out


def chunk_ids(out: PrepareStoreOutput) -> tuple[int, ...]:
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    return tuple(out.store_spec.chunk_ids.tolist())


def stored(manager: CPUOffloadingManager, *ids: int) -> PrepareStoreOutput:
    out = prepared(manager, *ids)
    manager.complete_store(keys(*ids))
    return out


# ---------------------------------------------------------------- lookup and the write lifecycle


def test_unknown_key_is_a_miss() -> None:
    assert CPUOffloadingManager(4).lookup(key(0)) is LookupResult.MISS


def test_key_is_hit_pending_while_its_write_is_in_flight() -> None:
    manager = CPUOffloadingManager(4)
    prepared(manager, 0)
    assert manager.lookup(key(0)) is LookupResult.HIT_PENDING


def test_key_is_a_hit_once_its_store_completes() -> None:
    manager = CPUOffloadingManager(4)
    stored(manager, 0)
    assert manager.lookup(key(0)) is LookupResult.HIT


def test_fresh_chunks_are_handed_out_in_order() -> None:
    manager = CPUOffloadingManager(4)
    assert chunk_ids(prepared(manager, 10, 11, 12)) == (0, 1, 2)
    assert manager.num_free_chunks == 1


def test_prepare_store_skips_keys_already_stored_or_repeated() -> None:
    manager = CPUOffloadingManager(4)
    stored(manager, 0)
    out = prepared(manager, 0, 1, 1)
    assert out.keys_to_store == keys(1)
    assert chunk_ids(out) == (1,)


def test_failed_store_forgets_the_keys_and_frees_their_chunks() -> None:
    manager = CPUOffloadingManager(2)
    prepared(manager, 0, 1)
    manager.complete_store(keys(0, 1), success=False)
    assert manager.lookup(key(0)) is LookupResult.MISS
    assert manager.num_free_chunks == 2
    assert sorted(chunk_ids(prepared(manager, 2, 3))) == [0, 1]


def test_complete_store_leaves_keys_of_earlier_stores_alone() -> None:
    manager = CPUOffloadingManager(4)
    stored(manager, 0)
    prepared(manager, 1)
    manager.complete_store(keys(0, 1), success=False)
    assert manager.lookup(key(0)) is LookupResult.HIT
    assert manager.lookup(key(1)) is LookupResult.MISS


# ---------------------------------------------------------------- eviction


def test_full_pool_evicts_the_least_recently_used_key() -> None:
    manager = CPUOffloadingManager(2)
    stored(manager, 0, 1)
    manager.touch(keys(0))
    out = prepared(manager, 2)
    assert out.evicted_keys == keys(1)
    assert chunk_ids(out) == (1,)
    assert manager.lookup(key(1)) is LookupResult.MISS


def test_full_pool_of_pending_writes_cannot_store() -> None:
    manager = CPUOffloadingManager(2)
    prepared(manager, 0, 1)
    assert manager.prepare_store(keys(2)) is None
    assert manager.lookup(key(2)) is LookupResult.MISS


def test_pinned_chunks_are_not_evicted() -> None:
    manager = CPUOffloadingManager(1)
    stored(manager, 0)
    manager.prepare_load(keys(0))
    assert manager.prepare_store(keys(1)) is None
    manager.complete_load(keys(0))
    assert prepared(manager, 1).evicted_keys == keys(0)


def test_a_store_never_evicts_its_own_keys() -> None:
    manager = CPUOffloadingManager(2)
    stored(manager, 0, 1)
    # Key 0 is the oldest, but it is part of this store: key 1 must go instead.
    out = prepared(manager, 0, 2)
    assert out.evicted_keys == keys(1)
    assert manager.lookup(key(0)) is LookupResult.HIT


def test_store_larger_than_the_pool_is_refused_without_evicting() -> None:
    manager = CPUOffloadingManager(2)
    stored(manager, 0, 1)
    assert manager.prepare_store(keys(2, 3, 4)) is None
    assert manager.lookup(key(0)) is LookupResult.HIT
    assert manager.lookup(key(1)) is LookupResult.HIT


def test_arc_policy_is_selected_by_name() -> None:
    manager = CPUOffloadingManager(2, cache_policy="arc")
    stored(manager, 0, 1)
    manager.touch(keys(0))  # key 0 becomes frequent
    assert prepared(manager, 2).evicted_keys == keys(1)


def test_manager_without_chunks_cannot_store_anything() -> None:
    manager = CPUOffloadingManager(0)
    assert manager.prepare_store(keys(0)) is None
    out = manager.prepare_store([])
    assert out is not None
    assert out.keys_to_store == []


def test_a_load_stepped_over_by_an_eviction_is_evicted_next_once_it_completes() -> None:
    manager = CPUOffloadingManager(3)
    stored(manager, 0, 1, 2)
    manager.prepare_load(keys(0))  # a load without a touch (a tier copying the chunk out)
    assert prepared(manager, 3).evicted_keys == keys(1)
    manager.complete_load(keys(0))
    assert prepared(manager, 4).evicted_keys == keys(0)


def test_a_write_stepped_over_by_an_eviction_is_evicted_next_once_it_completes() -> None:
    manager = CPUOffloadingManager(3)
    prepared(manager, 0)
    stored(manager, 1, 2)
    assert prepared(manager, 3).evicted_keys == keys(1)
    manager.complete_store(keys(0))
    assert prepared(manager, 4).evicted_keys == keys(0)


class CountingPolicy(LRUCachePolicy):
    """Loaded by name from this module: counts the evictions the manager asks for."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.evict_calls = 0

    def evict(self, n: int, protected: Set[OffloadKey]) -> Eviction | None:
        self.evict_calls += 1
        return super().evict(n, protected)


def counting_manager(num_chunks: int) -> tuple[CPUOffloadingManager, CountingPolicy]:
    manager = CPUOffloadingManager(num_chunks, "CountingPolicy", "tests.cpu.test_cpu_manager")
    policy = manager._policy
    assert isinstance(policy, CountingPolicy)
    return manager, policy


def test_a_store_the_held_chunks_leave_no_room_for_is_refused_without_asking_the_policy() -> None:
    manager, policy = counting_manager(100)
    stored(manager, *range(100))
    manager.prepare_load(keys(*range(99)))
    assert manager.prepare_store(keys(100, 101)) is None
    assert policy.evict_calls == 0
    assert prepared(manager, 100).evicted_keys == keys(99)
    assert policy.evict_calls == 1


def test_the_keys_of_a_store_do_not_count_as_room_for_it() -> None:
    manager, policy = counting_manager(2)
    stored(manager, 0, 1)
    manager.prepare_load(keys(1))
    # Key 0 is evictable, but it is part of this store.
    assert manager.prepare_store(keys(0, 2)) is None
    assert policy.evict_calls == 0
    assert manager.lookup(key(0)) is LookupResult.HIT


# ---------------------------------------------------------------- loads


def test_prepare_load_returns_the_chunks_in_key_order() -> None:
    manager = CPUOffloadingManager(4)
    stored(manager, 0, 1, 2)
    assert manager.prepare_load(keys(2, 0)).chunk_ids.tolist() == [2, 0]


def test_loading_a_key_still_being_written_is_refused() -> None:
    manager = CPUOffloadingManager(4)
    stored(manager, 0)
    prepared(manager, 1)
    with pytest.raises(KvOffloadError, match="still being written"):
        manager.prepare_load(keys(0, 1))
    # Atomic: key 0 was not pinned by the refused call.
    assert prepared(manager, 2, 3, 4).evicted_keys == keys(0)


def test_loading_a_missing_key_is_refused() -> None:
    with pytest.raises(KvOffloadError, match="not stored"):
        CPUOffloadingManager(4).prepare_load(keys(0))


def test_completing_a_load_that_was_never_prepared_is_refused() -> None:
    manager = CPUOffloadingManager(4)
    stored(manager, 0)
    with pytest.raises(KvOffloadError, match="not pinned"):
        manager.complete_load(keys(0))


def test_completing_more_loads_of_a_key_than_were_prepared_is_refused() -> None:
    manager = CPUOffloadingManager(1)
    stored(manager, 0)
    manager.prepare_load(keys(0))
    with pytest.raises(KvOffloadError, match="not pinned"):
        manager.complete_load(keys(0, 0))
    # Atomic: the one load still pins the chunk.
    assert manager.prepare_store(keys(1)) is None
    manager.complete_load(keys(0))
    assert prepared(manager, 1).evicted_keys == keys(0)


def test_a_key_listed_twice_in_a_load_is_pinned_twice() -> None:
    manager = CPUOffloadingManager(1)
    stored(manager, 0)
    manager.prepare_load(keys(0, 0))
    manager.complete_load(keys(0))
    assert manager.prepare_store(keys(1)) is None
    manager.complete_load(keys(0))
    assert prepared(manager, 1).evicted_keys == keys(0)


def test_each_load_pins_until_its_own_completion() -> None:
    manager = CPUOffloadingManager(1)
    stored(manager, 0)
    manager.prepare_load(keys(0))
    manager.prepare_load(keys(0))
    manager.complete_load(keys(0))
    assert manager.prepare_store(keys(1)) is None
    manager.complete_load(keys(0))
    assert prepared(manager, 1).evicted_keys == keys(0)


# ---------------------------------------------------------------- store threshold


def test_store_threshold_stores_a_key_on_its_nth_request() -> None:
    manager = CPUOffloadingManager(4, store_threshold=3)
    assert prepared(manager, 0).keys_to_store == []
    assert prepared(manager, 0).keys_to_store == []
    assert prepared(manager, 0).keys_to_store == keys(0)


@pytest.mark.parametrize("threshold", [0, 1])
def test_store_threshold_below_two_stores_on_the_first_request(threshold: int) -> None:
    manager = CPUOffloadingManager(4, store_threshold=threshold)
    assert prepared(manager, 0).keys_to_store == keys(0)


def test_store_threshold_tracker_forgets_the_oldest_keys() -> None:
    manager = CPUOffloadingManager(4, store_threshold=2, max_tracker_size=2)
    prepared(manager, 0)
    prepared(manager, 1)
    prepared(manager, 2)  # the tracker drops key 0
    assert prepared(manager, 0).keys_to_store == []
    assert prepared(manager, 2).keys_to_store == keys(2)


def test_store_threshold_keeps_admitted_keys_when_the_pool_is_full() -> None:
    manager = CPUOffloadingManager(1, store_threshold=2)
    prepared(manager, 9)
    manager.prepare_store(keys(9))  # key 9 stored, write pending: nothing is evictable
    prepared(manager, 0)
    assert manager.prepare_store(keys(0)) is None
    manager.complete_store(keys(9))
    assert prepared(manager, 0).keys_to_store == keys(0)


# ---------------------------------------------------------------- events


def test_events_are_off_by_default() -> None:
    manager = CPUOffloadingManager(1)
    stored(manager, 0)
    stored(manager, 1)
    assert list(manager.take_events()) == []


def test_events_report_stores_evictions_and_failed_stores() -> None:
    manager = CPUOffloadingManager(1, enable_events=True)
    stored(manager, 0)
    prepared(manager, 1)
    manager.complete_store(keys(1), success=False)
    assert list(manager.take_events()) == [
        OffloadingEvent([key(0)], Medium.CPU, removed=False),
        OffloadingEvent([key(0)], Medium.CPU, removed=True),
        OffloadingEvent([key(1)], Medium.CPU, removed=True, metadata_only=True),
    ]


def test_take_events_drains_them() -> None:
    manager = CPUOffloadingManager(1, enable_events=True)
    stored(manager, 0)
    assert len(list(manager.take_events())) == 1
    assert list(manager.take_events()) == []


# ---------------------------------------------------------------- construction and lifetime


@pytest.mark.parametrize(
    ("kwargs", "bad_key"),
    [
        ({"num_chunks": -1}, "num_chunks"),
        ({"num_chunks": 4, "store_threshold": -1}, "store_threshold"),
        ({"num_chunks": 4, "store_threshold": 2, "max_tracker_size": 0}, "max_tracker_size"),
        ({"num_chunks": 4, "cache_policy": "mru"}, "eviction_policy"),
    ],
)
def test_bad_arguments_are_config_errors_naming_the_key(kwargs: dict[str, object], bad_key: str) -> None:
    with pytest.raises(ConfigError) as info:
        CPUOffloadingManager(**kwargs)  # type: ignore[arg-type]
    assert info.value.key == bad_key


def test_manager_is_a_context_manager_whose_shutdown_is_idempotent() -> None:
    with CPUOffloadingManager(2) as manager:
        stored(manager, 0)
    manager.shutdown()
    assert manager.lookup(key(0)) is LookupResult.HIT


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "ok", "fail", "load", "unload", "touch"]), st.integers(0, 9)),
        max_size=80,
    )
)
def test_no_chunk_is_ever_shared_and_none_is_lost(ops: list[tuple[str, int]]) -> None:
    manager = CPUOffloadingManager(4)
    loads: list[OffloadKey] = []
    for op, i in ops:
        k = key(i)
        if op == "store":
            manager.prepare_store([k, key(i + 1)])
        elif op in ("ok", "fail"):
            manager.complete_store([k], success=op == "ok")
        elif op == "load" and manager.lookup(k) is LookupResult.HIT:
            manager.prepare_load([k])
            loads.append(k)
        elif op == "unload" and loads:
            manager.complete_load([loads.pop()])
        elif op == "touch":
            manager.touch([k])
        held = [manager._policy.get(key(j)) for j in range(11)]
        chunks = [status.chunk_id for status in held if status is not None]
        assert len(chunks) == len(set(chunks))
        assert len(chunks) + manager.num_free_chunks == 4
        # The count that lets a full pool refuse a store at once is the true one.
        assert manager._num_evictable_cache_chunks == sum(1 for s in held if s is not None and s.ref_cnt == 0)


# ---------------------------------------------------------------- requests, reset and stats


def test_a_request_that_meets_new_keys_after_it_finished_is_refused() -> None:
    manager = CPUOffloadingManager(4)
    ctx = ReqContext(req_id="done")
    assert manager.prepare_store(keys(0), ctx) is not None
    manager.on_request_finished(ctx)
    with pytest.raises(KvOffloadError, match="after on_request_finished"):
        manager.prepare_store(keys(1), ctx)
    # Keys it already met are not new: offering them again is harmless.
    assert manager.prepare_store(keys(0), ctx) is not None


def test_a_call_without_a_request_records_no_use() -> None:
    manager = CPUOffloadingManager(2)
    stored(manager, 0, 1)
    manager.prepare_load(keys(0))  # a tier copying the chunk out, say
    manager.complete_load(keys(0))
    assert prepared(manager, 2).evicted_keys == keys(0)


def test_reset_cache_forgets_every_chunk_and_starts_the_pool_afresh() -> None:
    manager = CPUOffloadingManager(2)
    stored(manager, 0)
    prepared(manager, 1)
    manager.prepare_load(keys(0))
    manager.reset_cache()
    assert manager.lookup(key(0)) is LookupResult.MISS
    assert manager.lookup(key(1)) is LookupResult.MISS
    assert manager.num_free_chunks == 2
    assert chunk_ids(prepared(manager, 2, 3)) == (0, 1)


def test_take_stats_reports_the_pool_use_and_drains_the_batch_figures() -> None:
    manager = CPUOffloadingManager(4, store_threshold=2)
    prepared(manager, 0, 1)  # first offers: skipped
    prepared(manager, 0, 1)  # stored, write pending
    manager.complete_store(keys(0))
    manager.prepare_load(keys(0))
    stats = manager.take_stats()
    assert stats.write_usage == 0.25
    assert stats.read_usage == 0.25
    assert stats.usage == 0.5
    assert stats.allocation_sizes == (2,)
    assert stats.stores_skipped == 2
    again = manager.take_stats()
    assert (again.allocation_sizes, again.stores_skipped) == ((), 0)
    assert again.usage == 0.5


def test_take_stats_without_a_threshold_has_no_skipped_count() -> None:
    assert CPUOffloadingManager(0).take_stats().stores_skipped is None
    assert CPUOffloadingManager(0).take_stats().usage == 0.0


def test_get_stats_is_none_where_vllm_is_not_installed() -> None:
    try:
        import vllm  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is installed")
    manager = CPUOffloadingManager(2)
    prepared(manager, 0)
    assert manager.get_stats() is None
    # Nothing was taken: the figures wait for a caller that can publish them.
    assert manager.take_stats().allocation_sizes == (1,)


def test_config_info_publishes_the_info_it_was_given() -> None:
    info = CPUOffloadingInfo(
        cpu_num_chunks=4, cpu_blocks_per_chunk=2, cpu_kv_cache_size_bytes=64, cpu_kv_cache_size_tokens=None
    )
    assert CPUOffloadingManager(4, info=info).config_info() == [
        {
            "cpu_num_chunks": 4,
            "cpu_blocks_per_chunk": 2,
            "cpu_kv_cache_size_bytes": 64,
            "cpu_kv_cache_size_tokens": "None",
        }
    ]
    assert CPUOffloadingManager(4).config_info() == [{}]
