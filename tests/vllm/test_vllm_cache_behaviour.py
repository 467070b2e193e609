"""The CPU cache behaves as vLLM 0.33's: one test per behaviour kvoffload used to get differently.

ARC learns from ghosts wherever a miss meets one, keeps up to a capacity of ghosts per list,
counts a request's reuse once, when it finishes, and takes its victim from T1 while T1 holds
at least its target. LRU commits a request's recency when it finishes, head last, whatever
order its transfers completed in. The manager's store threshold counts every offer, and a
failed write's removal is not announced for a key a retry has already stored again.
"""

from __future__ import annotations

from kvoffload.base import LookupResult, OffloadKey, PrepareStoreOutput, ReqContext, make_offload_key
from kvoffload.cpu.manager import CPUOffloadingManager
from kvoffload.cpu.policies.arc import ARCCachePolicy
from kvoffload.cpu.policies.base import ChunkStatus
from kvoffload.cpu.policies.lru import LRUCachePolicy


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def request(name: str, *positioned: int) -> ReqContext:
    """A request whose keys ``positioned`` end at tokens 16, 32, ... in that order."""
    ctx = ReqContext(req_id=name)
    for n, i in enumerate(positioned, 1):
        ctx.set_offload_key_position(key(i), 16 * n)
    return ctx


def stored(manager: CPUOffloadingManager, ids: list[int], ctx: ReqContext | None = None) -> None:
    assert manager.prepare_store(keys(*ids), ctx) is not None
    manager.complete_store(keys(*ids), ctx)


def evicted_by(manager: CPUOffloadingManager, *ids: int) -> list[OffloadKey]:
    out = manager.prepare_store(keys(*ids), request("pressure"))
    assert out is not None
    return out.evicted_keys


def arc_manager(num_chunks: int) -> tuple[CPUOffloadingManager, ARCCachePolicy]:
    manager = CPUOffloadingManager(num_chunks, cache_policy="arc")
    policy = manager._policy
    assert isinstance(policy, ARCCachePolicy)
    return manager, policy


# ---------------------------------------------------------------- ARC: ghosts


def test_arc_touching_a_recent_ghost_grows_the_t1_target() -> None:
    manager, policy = arc_manager(2)
    stored(manager, [1, 2])
    assert evicted_by(manager, 3) == keys(1)
    manager.touch(keys(1))
    assert policy.target_t1_size == 1.0
    assert manager.lookup(key(1)) is LookupResult.MISS


def test_arc_touching_a_frequent_ghost_shrinks_the_t1_target() -> None:
    manager, policy = arc_manager(2)
    stored(manager, [1, 2])
    manager.touch(keys(1))  # T2
    policy.target_t1_size = 2.0  # T1 (one key) is under target: the victim comes from T2
    assert evicted_by(manager, 3) == keys(1)
    assert key(1) in policy.b2
    manager.touch(keys(1))
    assert policy.target_t1_size == 1.0


def test_arc_a_store_miss_on_a_ghost_adapts_once_per_request_and_lands_in_t1() -> None:
    manager, policy = arc_manager(2)
    stored(manager, [1, 2])
    assert evicted_by(manager, 3) == keys(1)
    manager.complete_store(keys(3))
    ctx = request("returns")
    out = manager.prepare_store(keys(1), ctx)
    assert out is not None
    assert out.keys_to_store == keys(1)
    assert policy.target_t1_size == 1.0
    manager.complete_store(keys(1), ctx)
    # A second offer in the same request is the same miss, and 1 is no ghost any more.
    assert manager.prepare_store(keys(1), ctx) is not None
    assert policy.target_t1_size == 1.0
    manager.on_request_finished(ctx)
    assert key(1) in policy.t1
    assert key(1) not in policy.t2
    assert key(1) not in policy.b1


def test_arc_keeps_ghosts_of_a_full_t1() -> None:
    # T1 holds the whole cache; a bound of |T1| + |B1| <= capacity would keep no ghost.
    manager, policy = arc_manager(2)
    stored(manager, [1, 2])
    for i in range(3, 7):
        stored(manager, [i])
    assert list(policy.t1) == keys(5, 6)
    assert list(policy.b1) == keys(3, 4)


# ---------------------------------------------------------------- ARC: reuse counted per request


def test_arc_a_load_promotes_only_when_its_request_finishes() -> None:
    manager, policy = arc_manager(4)
    stored(manager, [1, 2], request("writer"))
    reader = request("reader")
    manager.prepare_load(keys(1), reader)
    manager.complete_load(keys(1), reader)
    assert key(1) in policy.t1
    manager.on_request_finished(reader)
    assert list(policy.t2) == keys(1)


def test_arc_a_request_reading_a_key_twice_uses_it_once() -> None:
    manager, policy = arc_manager(4)
    stored(manager, [1], request("writer"))
    reader = request("reader")
    for _ in range(2):
        manager.prepare_load(keys(1), reader)
        manager.complete_load(keys(1), reader)
    manager.on_request_finished(reader)
    assert list(policy.t2) == keys(1)
    # One use in T2: with T1 empty and at its target, T2's LRU key is the victim.
    stored(manager, [2, 3, 4])
    assert evicted_by(manager, 5) == keys(2)


def test_arc_keys_a_request_only_stored_stay_in_t1_even_if_it_reads_them_back() -> None:
    manager, policy = arc_manager(4)
    writer = request("writer")
    stored(manager, [1, 2], writer)
    assert manager.prepare_store(keys(1, 2), writer) is not None  # offered again
    manager.prepare_load(keys(1, 2), writer)  # read back, as a cascade to a tier does
    manager.complete_load(keys(1, 2), writer)
    manager.on_request_finished(writer)
    assert list(policy.t1) == keys(2, 1)  # head last: the most recent
    assert not policy.t2


# ---------------------------------------------------------------- ARC: victim choice


def arc_with_t1_and_t2() -> ARCCachePolicy:
    """T1 = [1, 2], T2 = [0], all ready."""
    policy = ARCCachePolicy(3)
    ctx = request("seed")
    for i in range(3):
        policy.insert(key(i), ChunkStatus(i, ref_cnt=0), ctx)
    policy.touch(keys(0), ctx)
    return policy


def test_arc_takes_the_victim_from_t1_when_t1_is_exactly_at_its_target() -> None:
    policy = arc_with_t1_and_t2()
    policy.target_t1_size = 2.0
    victims = policy.evict(1, frozenset())
    assert victims is not None
    assert [k for k, _ in victims] == keys(1)


def test_arc_compares_t1_with_the_whole_part_of_its_target() -> None:
    policy = arc_with_t1_and_t2()
    policy.target_t1_size = 2.9
    victims = policy.evict(1, frozenset())
    assert victims is not None
    assert [k for k, _ in victims] == keys(1)


def test_arc_takes_the_victim_from_t2_when_t1_is_under_its_target() -> None:
    policy = arc_with_t1_and_t2()
    policy.target_t1_size = 3.0
    victims = policy.evict(1, frozenset())
    assert victims is not None
    assert [k for k, _ in victims] == keys(0)


# ---------------------------------------------------------------- LRU: recency per request


def test_lru_a_load_makes_keys_recent_only_when_its_request_finishes() -> None:
    manager = CPUOffloadingManager(3)
    stored(manager, [1, 2, 3])
    reader = request("reader")
    manager.prepare_load(keys(1), reader)
    manager.complete_load(keys(1), reader)
    assert evicted_by(manager, 4) == keys(1)

    manager = CPUOffloadingManager(3)
    stored(manager, [1, 2, 3])
    reader = request("reader")
    manager.prepare_load(keys(1), reader)
    manager.complete_load(keys(1), reader)
    manager.on_request_finished(reader)
    assert evicted_by(manager, 4) == keys(2)


def test_lru_a_finished_request_keeps_its_head_longest_whatever_the_completion_order() -> None:
    manager = CPUOffloadingManager(3)
    ctx = ReqContext(req_id="prefix")  # no positions: the order offered is the prefix order
    assert manager.prepare_store(keys(1, 2, 3), ctx) is not None
    for i in (1, 2, 3):  # the head's write completes first, the tail's last
        manager.complete_store(keys(i), ctx)
    manager.on_request_finished(ctx)
    assert evicted_by(manager, 4, 5) == keys(3, 2)


def test_lru_a_store_offered_again_by_a_request_is_a_use_when_it_finishes() -> None:
    manager = CPUOffloadingManager(3)
    stored(manager, [1, 2, 3])
    again = request("again")
    out = manager.prepare_store(keys(1), again)
    assert out is not None
    assert out.keys_to_store == []
    manager.on_request_finished(again)
    assert evicted_by(manager, 4) == keys(2)


def test_lru_a_late_completion_does_not_make_an_older_request_newer() -> None:
    manager = CPUOffloadingManager(4)
    old = request("old")
    assert manager.prepare_store(keys(1, 2), old) is not None
    manager.on_request_finished(old)
    stored(manager, [3, 4], request("new"))
    manager.complete_store(keys(1, 2), old)  # the old request's writes land last
    assert evicted_by(manager, 5) == keys(2)


def test_lru_a_running_request_loses_its_tail_first() -> None:
    manager = CPUOffloadingManager(3)
    ctx = request("running", 1, 2, 3)
    for i in (1, 3, 2):  # a backfill: the tail is stored before the middle
        stored(manager, [i], ctx)
    assert evicted_by(manager, 4) == keys(3)


def test_lru_policy_insert_places_positioned_keys_tail_first() -> None:
    policy = LRUCachePolicy(3)
    ctx = request("insert", 1, 2, 3)
    for i in (1, 3, 2):
        policy.insert(key(i), ChunkStatus(i, ref_cnt=0), ctx)
    victims = policy.evict(2, frozenset())
    assert victims is not None
    assert [k for k, _ in victims] == keys(3, 2)


# ---------------------------------------------------------------- manager


def offered(manager: CPUOffloadingManager, i: int) -> PrepareStoreOutput:
    out = manager.prepare_store(keys(i))
    assert out is not None
    return out


def test_store_threshold_counts_offers_of_a_resident_key() -> None:
    manager = CPUOffloadingManager(1, store_threshold=2)
    assert offered(manager, 1).keys_to_store == []
    assert offered(manager, 1).keys_to_store == keys(1)
    manager.complete_store(keys(1))
    skipped = manager.stores_skipped_in_current_batch
    assert manager.prepare_store(keys(1)) is not None  # resident, and counted
    assert manager.counts is not None
    assert manager.counts[key(1)] == 3
    assert manager.stores_skipped_in_current_batch == skipped  # not a skipped store
    assert offered(manager, 2).keys_to_store == []
    assert offered(manager, 2).evicted_keys == keys(1)
    manager.complete_store(keys(2))
    # Back after an eviction, key 1 has been offered often enough already.
    assert offered(manager, 1).keys_to_store == keys(1)


def test_a_failed_writes_removal_is_dropped_for_keys_a_retry_stored_again() -> None:
    manager = CPUOffloadingManager(4, enable_events=True)
    assert manager.prepare_store(keys(1, 2)) is not None
    manager.complete_store(keys(1, 2), success=False)
    assert manager.prepare_store(keys(1)) is not None  # the retry, before the drain
    [removal] = manager.take_events()
    assert removal.removed
    assert removal.metadata_only
    assert removal.keys == keys(2)


def test_a_failed_writes_removal_is_dropped_whole_when_every_key_was_stored_again() -> None:
    manager = CPUOffloadingManager(4, enable_events=True)
    assert manager.prepare_store(keys(1)) is not None
    manager.complete_store(keys(1), success=False)
    stored(manager, [1])
    events = manager.take_events()
    assert [(e.keys, e.removed) for e in events] == [(keys(1), False)]
