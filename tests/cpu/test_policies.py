"""Cache policies: eviction order, the atomic-evict rule, ARC's lists, the factory.

How a request's accesses reach a policy (on_request_finished, store misses, ghosts) is in
tests/vllm/test_vllm_cache_behaviour.py.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.base import OffloadKey, ReqContext, make_offload_key
from kvoffload.cpu.policies import KNOWN_POLICIES
from kvoffload.cpu.policies.arc import ARCCachePolicy
from kvoffload.cpu.policies.base import CachePolicy, ChunkStatus, order_request_keys
from kvoffload.cpu.policies.factory import CachePolicyFactory
from kvoffload.cpu.policies.lru import LRUCachePolicy
from kvoffload.errors import ConfigError


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ctx() -> ReqContext:
    return ReqContext(req_id="test")


def filled(policy_cls: type[CachePolicy], n: int, capacity: int | None = None) -> CachePolicy:
    """A policy holding keys 0..n-1, all ready and unpinned, inserted in that order."""
    policy = policy_cls(capacity if capacity is not None else n)
    for i in range(n):
        policy.insert(key(i), ChunkStatus(i, ref_cnt=0), ctx())
    return policy


def evicted_keys(policy: CachePolicy, n: int, protected: frozenset[OffloadKey] = frozenset()) -> list[int]:
    victims = policy.evict(n, protected)
    assert victims is not None
    return [int.from_bytes(k[:8], "big") for k, _ in victims]


class OutOfTreePolicy(LRUCachePolicy):
    """Loaded by name from this module in the factory tests."""


NOT_A_POLICY = object()


@pytest.fixture(params=[LRUCachePolicy, ARCCachePolicy], ids=["lru", "arc"])
def policy_cls(request: pytest.FixtureRequest) -> type[CachePolicy]:
    cls: type[CachePolicy] = request.param
    return cls


# ---------------------------------------------------------------- rules every policy keeps


def test_evict_is_all_or_nothing(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 3)
    assert policy.evict(4, frozenset()) is None
    assert all(policy.get(key(i)) is not None for i in range(3))


def test_evict_skips_pending_writes_and_pinned_chunks(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 3)
    policy.insert(key(3), ChunkStatus(3), ctx())  # write pending
    status = policy.get(key(0))
    assert status is not None
    status.ref_cnt = 2  # pinned by two loads
    assert sorted(evicted_keys(policy, 2)) == [1, 2]
    assert policy.evict(1, frozenset()) is None


def test_evict_never_takes_protected_keys(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 3)
    assert evicted_keys(policy, 1, frozenset({key(0)})) == [1]


def test_evict_returns_the_chunks_it_frees(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 2)
    victims = policy.evict(2, frozenset())
    assert victims is not None
    assert sorted(chunk.chunk_id for _, chunk in victims) == [0, 1]
    assert policy.get(key(0)) is None
    assert policy.get(key(1)) is None


def test_get_does_not_change_eviction_order(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 3)
    policy.get(key(0))
    assert evicted_keys(policy, 1) == [0]


def test_remove_forgets_a_key_and_ignores_unknown_ones(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 2)
    policy.remove(key(0))
    policy.remove(key(99))
    assert policy.get(key(0)) is None
    assert evicted_keys(policy, 1) == [1]


def test_clear_forgets_everything(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 3)
    policy.clear()
    assert all(policy.get(key(i)) is None for i in range(3))
    assert policy.evict(1, frozenset()) is None


def test_touching_a_request_keeps_its_first_block_longest(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 4)
    policy.touch([key(0), key(1), key(2), key(3)], ctx())
    # Later blocks of a prefix are useless without the earlier ones: they go first.
    assert evicted_keys(policy, 4) == [3, 2, 1, 0]


def pin(policy: CachePolicy, i: int, ref_cnt: int = 1) -> ChunkStatus:
    """Set a chunk's ref_cnt and tell the policy, as the manager does."""
    status = policy.get(key(i))
    assert status is not None
    was_evictable, status.ref_cnt = status.ref_cnt == 0, ref_cnt
    if was_evictable and ref_cnt != 0:
        policy.mark_non_evictable(key(i))
    elif not was_evictable and ref_cnt == 0:
        policy.mark_evictable(key(i))
    return status


def test_a_held_chunk_stepped_over_by_an_eviction_is_oldest_again_when_released(
    policy_cls: type[CachePolicy],
) -> None:
    policy = filled(policy_cls, 4)
    pin(policy, 0)
    assert evicted_keys(policy, 1) == [1]
    pin(policy, 0, ref_cnt=0)
    assert evicted_keys(policy, 2) == [0, 2]


def test_a_chunk_pinned_without_the_hook_is_still_never_evicted(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 3)
    status = policy.get(key(0))
    assert status is not None
    status.ref_cnt = 1  # no mark_non_evictable: eviction still checks ref_cnt itself
    assert evicted_keys(policy, 2) == [1, 2]
    assert policy.evict(1, frozenset()) is None
    assert policy.get(key(0)) is status


def test_a_pending_chunk_stepped_over_keeps_its_key_and_status(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 2)
    pending = ChunkStatus(7)
    policy.insert(key(7), pending, ctx())
    pin(policy, 0, ref_cnt=-1)
    assert evicted_keys(policy, 1) == [1]
    assert policy.evict(1, frozenset()) is None
    assert policy.get(key(7)) is pending
    policy.remove(key(0))
    assert policy.get(key(0)) is None
    assert policy.get(key(7)) is pending


def test_touching_a_stepped_over_chunk_makes_it_the_most_recent(policy_cls: type[CachePolicy]) -> None:
    policy = filled(policy_cls, 3)
    pin(policy, 0)
    assert evicted_keys(policy, 1) == [1]
    pin(policy, 0, ref_cnt=0)
    policy.touch([key(0)], ctx())
    assert evicted_keys(policy, 2) == [2, 0]


def test_evictions_take_the_oldest_evictable_chunks_while_many_are_held(
    policy_cls: type[CachePolicy],
) -> None:
    policy = filled(policy_cls, 1000)
    for i in range(500):
        pin(policy, i)
    assert evicted_keys(policy, 10) == list(range(500, 510))
    assert evicted_keys(policy, 10) == list(range(510, 520))
    # Released youngest first: each returns ahead of the others, so the oldest leaves first.
    for i in range(499, -1, -1):
        pin(policy, i, ref_cnt=0)
    assert evicted_keys(policy, 3) == [0, 1, 2]


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "ready", "pin", "unpin", "touch", "remove", "evict"]),
            st.integers(0, 11),
        ),
        max_size=60,
    ),
    use_arc=st.booleans(),
)
def test_policies_evict_only_ready_unpinned_unprotected_keys(
    ops: list[tuple[str, int]], use_arc: bool
) -> None:
    capacity = 8
    policy: CachePolicy = ARCCachePolicy(capacity) if use_arc else LRUCachePolicy(capacity)
    model: dict[OffloadKey, ChunkStatus] = {}
    for op, i in ops:
        k = key(i)
        if op == "insert" and k not in model and len(model) < capacity:
            model[k] = ChunkStatus(i)
            policy.insert(k, model[k], ctx())
        elif op == "ready" and k in model and model[k].ref_cnt == -1:
            model[k].ref_cnt = 0
            policy.mark_evictable(k)
        elif op == "pin" and k in model and model[k].ref_cnt >= 0:
            if model[k].ref_cnt == 0:
                policy.mark_non_evictable(k)
            model[k].ref_cnt += 1
        elif op == "unpin" and k in model and model[k].ref_cnt > 0:
            model[k].ref_cnt -= 1
            if model[k].ref_cnt == 0:
                policy.mark_evictable(k)
        elif op == "touch":
            policy.touch([k], ctx())
        elif op == "remove" and k in model:
            del model[k]
            policy.remove(k)
        elif op == "evict":
            protected = frozenset({k})
            candidates = {c for c, s in model.items() if s.ref_cnt == 0 and c not in protected}
            n = i % 4
            victims = policy.evict(n, protected)
            if n > len(candidates):
                assert victims is None
                continue
            assert victims is not None
            assert len(victims) == n
            assert {v for v, _ in victims} <= candidates
            for v, status in victims:
                assert model.pop(v) is status
        assert all(policy.get(c) is s for c, s in model.items())
        assert all(policy.get(key(j)) is None for j in range(12) if key(j) not in model)


# ---------------------------------------------------------------- LRU


def test_lru_evicts_the_least_recently_stored_first() -> None:
    assert evicted_keys(filled(LRUCachePolicy, 3), 2) == [0, 1]


def test_lru_touch_makes_a_key_most_recent() -> None:
    policy = filled(LRUCachePolicy, 3)
    policy.touch([key(0)], ctx())
    assert evicted_keys(policy, 3) == [1, 2, 0]


class RankModel:
    """vLLM 0.33's LRU order, plainly: every key's rank, and evictions by sorting (rank, key)."""

    def __init__(self) -> None:
        self.ranks: dict[OffloadKey, tuple[int, int]] = {}
        self.counter = 0
        self.request_ranks: dict[str, int] = {}

    def fresh(self) -> tuple[int, int]:
        self.counter += 1
        return (self.counter, 0)

    def request_rank(self, c: ReqContext) -> int:
        if c.req_id not in self.request_ranks:
            self.request_ranks[c.req_id] = self.fresh()[0]
        return self.request_ranks[c.req_id]

    def insert(self, k: OffloadKey, c: ReqContext) -> None:
        position = c.get_offload_key_position(k)
        self.ranks[k] = self.fresh() if position is None else (self.request_rank(c), -position)

    def rerank(self, keys: list[OffloadKey]) -> None:
        for k in keys:
            if k in self.ranks:
                self.ranks[k] = self.fresh()

    def access(self, keys: list[OffloadKey], c: ReqContext) -> None:
        request_rank = self.request_rank(c)
        for k in keys:
            position = c.get_offload_key_position(k)
            if k in self.ranks and position is not None:
                self.ranks[k] = max(self.ranks[k], (request_rank, -position))

    def victims(self, candidates: set[OffloadKey], n: int) -> list[OffloadKey]:
        return sorted(candidates, key=lambda k: (self.ranks[k], k))[:n]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_lru_evicts_in_rank_order_wherever_a_key_waits(seed: int) -> None:
    # Ranks arrive out of order (a running request's, a chunk released after younger uses),
    # so keys wait in the ordered dict or in the heap; evictions must still follow the ranks.
    rng = random.Random(seed)
    policy, model = LRUCachePolicy(10), RankModel()
    statuses: dict[OffloadKey, ChunkStatus] = {}

    def request(n: int, step: int) -> ReqContext:
        c = ReqContext(req_id=f"r{n}-{step}")
        for i in range(10):
            if (i + n) % 3:  # some keys carry no position; some share one (two groups of a block)
                c.set_offload_key_position(key(i), 16 * ((i * (n + 2)) % 7 + 1))
        return c

    contexts = [request(n, 0) for n in range(3)]
    names = ["insert", "ready", "pin", "unpin", "touch", "access", "finish", "evict", "new request"]
    for step in range(300):
        op, ids, n = rng.choice(names), rng.sample(range(10), rng.randint(1, 4)), rng.randrange(3)
        ks, c = [key(i) for i in ids], contexts[n]
        if op == "new request":  # its rank is above every key's yet
            contexts[n] = request(n, step)
        elif op == "insert":
            new = [k for k in ks if k not in statuses]
            chunks = [ChunkStatus(int.from_bytes(k[:8], "big")) for k in new]
            policy.insert_many(new, chunks, c)
            for k, chunk in zip(new, chunks, strict=True):
                statuses[k] = chunk
                model.insert(k, c)
        elif op == "ready":
            done = [k for k in ks if k in statuses and statuses[k].ref_cnt == -1]
            for k in done:
                statuses[k].ref_cnt = 0
            policy.mark_evictable_many(done)
        elif op == "pin":
            pinned = [k for k in ks if k in statuses and statuses[k].ref_cnt == 0]
            for k in pinned:
                statuses[k].ref_cnt = 1
            policy.mark_non_evictable_many(pinned)
        elif op == "unpin":
            for k in ks:
                if k in statuses and statuses[k].ref_cnt == 1:
                    statuses[k].ref_cnt = 0
                    policy.mark_evictable(k)
        elif op == "touch":
            policy.touch(ks, c)
            model.rerank(list(reversed(ks)))
        elif op == "access":
            policy.on_request_access(ks, c)
            model.access(ks, c)
        elif op == "finish":
            policy.on_request_finished((tuple(ks),), set(), set(), c)
            model.rerank(list(reversed(order_request_keys((tuple(ks),), c))))
        else:
            protected = {key(ids[0])}
            candidates = {k for k, st_ in statuses.items() if st_.ref_cnt == 0 and k not in protected}
            victims = policy.evict(n + 1, protected)
            if n + 1 > len(candidates):
                assert victims is None
                continue
            assert victims is not None
            assert [k for k, _ in victims] == model.victims(candidates, n + 1)
            for k, chunk in victims:
                assert statuses.pop(k) is chunk
                del model.ranks[k]


# ---------------------------------------------------------------- ARC


def arc(n: int, capacity: int | None = None) -> ARCCachePolicy:
    policy = filled(ARCCachePolicy, n, capacity)
    assert isinstance(policy, ARCCachePolicy)
    return policy


def test_arc_puts_new_keys_in_the_recent_list() -> None:
    policy = arc(2)
    assert list(policy.t1) == [key(0), key(1)]
    assert list(policy.t2) == []


def test_arc_touch_moves_a_ready_key_to_the_frequent_list() -> None:
    policy = arc(2)
    policy.touch([key(0)], ctx())
    assert list(policy.t1) == [key(1)]
    assert list(policy.t2) == [key(0)]


def test_arc_touch_keeps_a_key_still_being_written_in_the_recent_list() -> None:
    policy = arc(2)
    policy.insert(key(2), ChunkStatus(2), ctx())
    policy.touch([key(2)], ctx())
    assert list(policy.t1) == [key(0), key(1), key(2)]
    assert list(policy.t2) == []


def test_arc_evicts_recent_keys_before_frequent_ones_while_t1_holds_its_target() -> None:
    policy = arc(3)
    policy.touch([key(0)], ctx())
    assert evicted_keys(policy, 2) == [1, 2]
    assert evicted_keys(policy, 1) == [0]


def test_arc_remembers_evicted_keys_as_ghosts() -> None:
    policy = arc(3)
    policy.touch([key(2)], ctx())
    evicted_keys(policy, 3)
    assert (list(policy.b1), list(policy.b2)) == ([key(0), key(1)], [key(2)])


def test_arc_storing_a_ghost_again_puts_it_in_the_recent_list_and_forgets_the_ghost() -> None:
    policy = arc(3)
    evicted_keys(policy, 1)
    policy.insert(key(0), ChunkStatus(0, ref_cnt=0), ctx())
    assert key(0) in policy.t1
    assert key(0) not in policy.b1


def test_arc_bounds_each_ghost_list_by_capacity() -> None:
    policy = arc(4, capacity=4)
    for round_ in range(5):
        policy.touch([key(100 * round_)], ctx())  # one key a round goes through T2
        evicted_keys(policy, 4)
        for i in range(4):
            policy.insert(key(100 * (round_ + 1) + i), ChunkStatus(i, ref_cnt=0), ctx())
    assert len(policy.b1) <= 4
    assert len(policy.b2) <= 4
    assert len(policy.b2) == 4


# ---------------------------------------------------------------- factory


def test_known_policies_are_the_factory_names() -> None:
    assert KNOWN_POLICIES == ("lru", "arc")
    assert CachePolicyFactory.get_cache_policy_cls("lru") is LRUCachePolicy
    assert CachePolicyFactory.get_cache_policy_cls("arc") is ARCCachePolicy


def test_unknown_policy_without_module_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Unknown cache policy 'fifo'") as info:
        CachePolicyFactory.get_cache_policy_cls("fifo")
    assert info.value.key == "eviction_policy"
    assert info.value.fix is not None
    assert "cache_policy_module_path" in info.value.fix


def test_a_registered_name_resolves_to_its_class_and_cannot_be_registered_twice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(CachePolicyFactory, "_registry", dict(CachePolicyFactory._registry))
    CachePolicyFactory.register_cache_policy("out-of-tree", "tests.cpu.test_policies", "OutOfTreePolicy")
    assert CachePolicyFactory.get_cache_policy_cls("out-of-tree") is OutOfTreePolicy
    with pytest.raises(ConfigError, match="is already registered") as info:
        CachePolicyFactory.register_cache_policy("out-of-tree", "tests.cpu.test_policies", "OutOfTreePolicy")
    assert info.value.key == "eviction_policy"


def test_a_registered_name_is_imported_only_when_it_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(CachePolicyFactory, "_registry", dict(CachePolicyFactory._registry))
    CachePolicyFactory.register_cache_policy("later", "tests.no_such_module", "Whatever")
    with pytest.raises(ConfigError) as info:
        CachePolicyFactory.get_cache_policy_cls("later")
    assert info.value.key == "cache_policy_module_path"


def test_out_of_tree_policy_is_imported_from_its_module_path() -> None:
    cls = CachePolicyFactory.get_cache_policy_cls("OutOfTreePolicy", "tests.cpu.test_policies")
    assert cls is OutOfTreePolicy


def test_out_of_tree_module_that_cannot_be_imported_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        CachePolicyFactory.get_cache_policy_cls("Whatever", "tests.no_such_module")
    assert info.value.key == "cache_policy_module_path"


@pytest.mark.parametrize("name", ["NOT_A_POLICY", "MissingPolicy"])
def test_out_of_tree_name_that_is_not_a_policy_is_a_config_error(name: str) -> None:
    with pytest.raises(ConfigError, match="is not a CachePolicy subclass") as info:
        CachePolicyFactory.get_cache_policy_cls(name, "tests.cpu.test_policies")
    assert info.value.key == "eviction_policy"
