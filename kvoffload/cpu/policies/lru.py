"""LRU: the least recently used ready chunk leaves first.

Recency is a rank, not a place in a list, so it can change while a chunk is pinned or
still being written: when the chunk becomes evictable it enters the eviction heap at
the rank its requests gave it, not at the moment its transfer happened to complete.

A rank is a pair compared in order. A use made now gets ``(next counter, 0)``. A
running request gets one counter value for all its batches, and a key it stored or met
at end token ``p`` gets ``(that value, -p)``: its tail ranks below its head, so under
pressure the tail leaves first and the prefix that makes the head useful survives.
When the request finishes its keys are re-ranked tail first, head last, each with a
fresh counter value.

The heap holds ``(rank, key)`` entries and is invalidated lazily: an entry whose key
is no longer evictable, or whose rank changed since it was pushed, is skipped when it
comes out. That keeps a pinned chunk from ever being walked over by an eviction, and
the heap is rebuilt once stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass

from kvoffload.base import OffloadKey, ReqContext
from kvoffload.cpu.policies.base import CachePolicy, ChunkStatus, Eviction, order_request_keys

Rank = tuple[int, int]
_Entry = tuple[Rank, OffloadKey]

# Below this many entries the heap is never rebuilt: a rebuild would cost more than it saves.
_MIN_REBUILD = 64


@dataclass(slots=True)
class _RequestRank:
    """The counter value one running request ranks its positioned keys with."""

    policy: object
    generation: int
    value: int


class LRUCachePolicy(CachePolicy):
    """Least recently used first; a prefix's tail before its head."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[OffloadKey, ChunkStatus] = {}
        self._ranks: dict[OffloadKey, Rank] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[_Entry] = []
        self._counter = 0
        # A request's rank from before clear() must not carry over to the new cache.
        self._generation = 0

    # ----------------------------------------------------------------- ranks

    def _tick(self) -> int:
        self._counter += 1
        return self._counter

    def _request_rank(self, req_context: ReqContext) -> int:
        state = req_context.get_state(_RequestRank)
        if state is None or state.policy is not self or state.generation != self._generation:
            state = _RequestRank(self, self._generation, self._tick())
            req_context.set_state(state)
        return state.value

    def _rerank(self, keys: Iterable[OffloadKey]) -> None:
        """Give each stored key a fresh rank, in order: the last one is the most recent."""
        moved: list[OffloadKey] = []
        for key in keys:
            if key in self.chunks:
                self._ranks[key] = (self._tick(), 0)
                if key in self._evictable:
                    moved.append(key)
        self._requeue(moved)

    def _requeue(self, keys: Sequence[OffloadKey]) -> None:
        """Evictable ``keys`` changed rank: give the heap their new entries."""
        if not keys:
            return
        if len(keys) >= max(_MIN_REBUILD, len(self._evictable) // 4):
            # A long prefix re-ranked at once: one linear rebuild beats k pushes.
            self._rebuild()
            return
        for key in keys:
            heapq.heappush(self._heap, (self._ranks[key], key))
        self._compact()

    def _rebuild(self) -> None:
        self._heap = [(self._ranks[key], key) for key in self._evictable]
        heapq.heapify(self._heap)

    def _compact(self) -> None:
        if len(self._heap) >= max(_MIN_REBUILD, 2 * len(self._evictable)):
            self._rebuild()

    def _is_live(self, entry: _Entry) -> bool:
        rank, key = entry
        return key in self._evictable and self._ranks.get(key) == rank

    # ----------------------------------------------------------------- CachePolicy

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.chunks[key] = chunk
        position = req_context.get_offload_key_position(key)
        if position is None:
            self._ranks[key] = (self._tick(), 0)
        else:
            self._ranks[key] = (self._request_rank(req_context), -position)
        if chunk.ref_cnt == 0:
            self._evictable.add(key)
            heapq.heappush(self._heap, (self._ranks[key], key))
        else:
            self._evictable.discard(key)

    def remove(self, key: OffloadKey) -> None:
        if self.chunks.pop(key, None) is not None:
            del self._ranks[key]
            self._evictable.discard(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._rerank(reversed(list(keys)))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # Every batch of a running request shares its rank, so a batch only places its
        # own keys: the prefix met earlier is already in order and is not walked again.
        request_rank = self._request_rank(req_context)
        moved: list[OffloadKey] = []
        for key in keys:
            if key not in self.chunks:
                continue
            position = req_context.get_offload_key_position(key)
            if position is None:
                continue
            rank = (request_rank, -position)
            # Never demote: a newer request may already rank the key higher.
            if rank > self._ranks[key]:
                self._ranks[key] = rank
                if key in self._evictable:
                    moved.append(key)
        self._requeue(moved)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: Set[OffloadKey],
        reused_keys: Set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        # Stored and reused keys alike are uses; the head is re-ranked last, so it is kept longest.
        self._rerank(reversed(order_request_keys(key_groups, req_context)))

    def evict(self, n: int, protected: Set[OffloadKey]) -> Eviction | None:
        if n <= 0:
            return []
        taken: list[_Entry] = []
        taken_keys: set[OffloadKey] = set()
        skipped: list[_Entry] = []  # protected: evictable again after this store
        heap = self._heap
        while heap and len(taken) < n:
            entry = heapq.heappop(heap)
            if not self._is_live(entry):
                continue
            key = entry[1]
            if key in taken_keys:
                # A pin and release without a rank change leaves a twin entry behind.
                continue
            if key in protected or self.chunks[key].ref_cnt != 0:
                skipped.append(entry)
                continue
            taken.append(entry)
            taken_keys.add(key)
        if len(taken) < n:
            for entry in taken + skipped:
                heapq.heappush(heap, entry)
            return None
        for entry in skipped:
            heapq.heappush(heap, entry)
        victims: Eviction = []
        for _, key in taken:
            self._evictable.discard(key)
            del self._ranks[key]
            victims.append((key, self.chunks.pop(key)))
        self._compact()
        return victims

    def mark_evictable(self, key: OffloadKey) -> None:
        if key in self.chunks:
            self._evictable.add(key)
            heapq.heappush(self._heap, (self._ranks[key], key))
            self._compact()

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self._evictable.discard(key)

    def clear(self) -> None:
        self.chunks.clear()
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._counter = 0
        self._generation += 1

    def __len__(self) -> int:
        return len(self.chunks)
