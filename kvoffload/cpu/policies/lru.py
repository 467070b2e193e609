"""LRU: the least recently used ready chunk leaves first.

Recency is a rank, not a place in a list, so it can change while a chunk is pinned or
still being written: when the chunk becomes evictable it enters the eviction order at
the rank its requests gave it, not at the moment its transfer happened to complete.

A rank is a pair compared in order. A use made now gets ``(next counter, 0)``. A
running request gets one counter value for all its batches, and a key it stored or met
at end token ``p`` gets ``(that value, -p)``: its tail ranks below its head, so under
pressure the tail leaves first and the prefix that makes the head useful survives.
When the request finishes its keys are re-ranked tail first, head last, each with a
fresh counter value. Evictions take the evictable keys in ``(rank, key)`` order.

An evictable key waits in one of two places. Most ranks are handed out in increasing
order (a fresh counter value is the largest yet), so most keys are appended to a queue
of ``(rank, key, status)`` that stays sorted: evicting from its head and re-ranking to
its tail are O(1), with no heap of 100,000 entries to sift through cold memory. A key
whose rank is not above every rank queued so far when it becomes evictable (a running
request's provisional rank, or a chunk released after younger keys were used) goes to
a small heap instead. A key's rank and place live on its ``ChunkStatus``, which every
call reads anyway, so pinning or re-ranking a key touches no other per-key structure.
Both orders are invalidated lazily: an entry whose key no longer waits there at that
rank is skipped when it comes out, and each is rebuilt once stale entries outnumber
live ones. An eviction merges the two orders. A pinned or pending key is in neither,
so an eviction never walks over it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass

from kvoffload.base import OffloadKey, ReqContext
from kvoffload.cpu.policies.base import (
    CachePolicy,
    ChunkStatus,
    Eviction,
    offload_key_positions,
    order_request_keys,
)

Rank = tuple[int, int]
_HeapEntry = tuple[Rank, OffloadKey]
_QueueEntry = tuple[Rank, OffloadKey, ChunkStatus]

# ChunkStatus.place: where an evictable key waits; a pinned or pending one waits nowhere.
_NOWHERE, _QUEUED, _HEAPED = 0, 1, 2
# Below this many entries neither order is rebuilt: a rebuild would cost more than it saves.
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
        self._queue: deque[_QueueEntry] = deque()
        self._num_queued = 0
        self._queue_top: Rank | None = None  # the highest rank ever queued: one above it is appended
        self._heaped: set[OffloadKey] = set()
        self._heap: list[_HeapEntry] = []
        self._counter = 0
        # A request's rank from before clear() must not carry over to the new cache.
        self._generation = 0

    # ----------------------------------------------------------------- ranks

    @property
    def _ranks(self) -> Mapping[OffloadKey, Rank]:
        """Each stored key's rank, under the name vLLM's LRU keeps them by (its tests read it)."""
        return _RankView(self.chunks)

    def _request_rank(self, req_context: ReqContext) -> int:
        state = req_context.get_state(_RequestRank)
        if state is None or state.policy is not self or state.generation != self._generation:
            self._counter += 1
            state = _RequestRank(self, self._generation, self._counter)
            req_context.set_state(state)
        return state.value

    def _rerank(self, keys: Iterable[OffloadKey]) -> None:
        """Give each stored key a fresh rank, in order: the last one is the most recent."""
        get = self.chunks.get
        queue = self._queue
        counter = self._counter
        for key in keys:
            status = get(key)
            if status is None:
                continue
            counter += 1
            rank = status.rank = (counter, 0)
            if status.place:
                # A fresh rank is the largest yet: an evictable key goes to the tail.
                if status.place == _HEAPED:
                    self._heaped.discard(key)
                    status.place = _QUEUED
                    self._num_queued += 1
                queue.append((rank, key, status))
                self._queue_top = rank
        self._counter = counter
        self._compact()

    # ----------------------------------------------------------------- the eviction order

    def _enter(self, key: OffloadKey, status: ChunkStatus) -> None:
        """``key`` (waiting nowhere) just became evictable at its current rank."""
        rank = status.rank
        if self._queue_top is None or rank > self._queue_top:
            self._queue.append((rank, key, status))
            self._queue_top = rank
            status.place = _QUEUED
            self._num_queued += 1
        else:
            heapq.heappush(self._heap, (rank, key))
            self._heaped.add(key)
            status.place = _HEAPED

    def _leave(self, key: OffloadKey, status: ChunkStatus) -> None:
        """``key`` is no longer evictable (or its rank is about to change)."""
        if status.place == _QUEUED:
            self._num_queued -= 1
        elif status.place == _HEAPED:
            self._heaped.discard(key)
        status.place = _NOWHERE

    def _compact(self) -> None:
        if len(self._heap) >= max(_MIN_REBUILD, 2 * len(self._heaped)):
            chunks = self.chunks
            self._heap = [(chunks[key].rank, key) for key in self._heaped]
            heapq.heapify(self._heap)
        queue = self._queue
        while queue and not _is_queued(queue[0]):
            queue.popleft()
        if len(queue) >= max(_MIN_REBUILD, 2 * self._num_queued):
            self._queue = deque(entry for entry in queue if _is_queued(entry))
        if not self._queue:
            self._queue_top = None

    def _heap_entry_is_live(self, entry: _HeapEntry) -> bool:
        rank, key = entry
        status = self.chunks.get(key)
        return status is not None and status.place == _HEAPED and status.rank == rank

    # ----------------------------------------------------------------- CachePolicy

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.insert_many((key,), (chunk,), req_context)

    def insert_many(
        self, keys: Sequence[OffloadKey], chunks: Sequence[ChunkStatus], req_context: ReqContext
    ) -> None:
        all_chunks = self.chunks
        positions = offload_key_positions(req_context, keys)
        request_rank: int | None = None  # taken at the first positioned key, as one insert takes it
        for key, chunk, position in zip(keys, chunks, positions, strict=True):
            old = all_chunks.get(key)
            if old is not None:
                self._leave(key, old)
            all_chunks[key] = chunk
            chunk.place = _NOWHERE
            if position is None:
                self._counter += 1
                chunk.rank = (self._counter, 0)
            else:
                if request_rank is None:
                    request_rank = self._request_rank(req_context)
                chunk.rank = (request_rank, -position)
            if chunk.ref_cnt == 0:
                self._enter(key, chunk)

    def remove(self, key: OffloadKey) -> None:
        status = self.chunks.pop(key, None)
        if status is not None:
            self._leave(key, status)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        self._rerank(reversed(list(keys)))

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        # Every batch of a running request shares its rank, so a batch only places its
        # own keys: the prefix met earlier is already in order and is not walked again.
        request_rank = self._request_rank(req_context)
        get = self.chunks.get
        keys = list(keys)
        for key, position in zip(keys, offload_key_positions(req_context, keys), strict=True):
            status = get(key)
            if status is None or position is None:
                continue
            rank = (request_rank, -position)
            # Never demote: a newer request may already rank the key higher.
            if rank > status.rank:
                if status.place:
                    self._leave(key, status)
                    status.rank = rank
                    self._enter(key, status)
                else:
                    status.rank = rank
        self._compact()

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
        heap = self._heap
        # Victims are chosen before anything changes, so a shortfall changes nothing:
        # the queue is only read, and what the heap gave up is pushed back.
        in_order = _evictable(self._queue, protected)
        from_heap: list[_HeapEntry] = []
        taken_from_heap: set[OffloadKey] = set()
        skipped: list[_HeapEntry] = []  # protected: evictable again after this store
        victims: list[tuple[OffloadKey, ChunkStatus]] = []
        next_in_order = next(in_order, None)
        while len(victims) < n:
            while heap:
                entry = heap[0]
                key = entry[1]
                if not self._heap_entry_is_live(entry) or key in taken_from_heap:
                    # Stale, or a twin left by a pin and release without a rank change.
                    heapq.heappop(heap)
                elif key in protected or self.chunks[key].ref_cnt != 0:
                    skipped.append(heapq.heappop(heap))
                else:
                    break
            if heap and (next_in_order is None or heap[0] < next_in_order[:2]):
                entry = heapq.heappop(heap)
                from_heap.append(entry)
                taken_from_heap.add(entry[1])
                victims.append((entry[1], self.chunks[entry[1]]))
            elif next_in_order is not None:
                victims.append(next_in_order[1:])
                next_in_order = next(in_order, None)
            else:
                for entry in from_heap + skipped:
                    heapq.heappush(heap, entry)
                return None
        for entry in skipped:
            heapq.heappush(heap, entry)
        chunks = self.chunks
        for key, status in victims:
            self._leave(key, status)
            del chunks[key]
        self._compact()
        return victims

    def mark_evictable(self, key: OffloadKey) -> None:
        self.mark_evictable_many((key,))

    def mark_non_evictable(self, key: OffloadKey) -> None:
        self.mark_non_evictable_many((key,))

    def mark_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        get = self.chunks.get
        for key in keys:
            status = get(key)
            if status is not None and not status.place:
                self._enter(key, status)
        self._compact()

    def mark_non_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        get = self.chunks.get
        for key in keys:
            status = get(key)
            if status is not None and status.place:
                self._leave(key, status)

    def clear(self) -> None:
        for status in self.chunks.values():
            status.place = _NOWHERE
        self.chunks.clear()
        self._queue.clear()
        self._num_queued = 0
        self._queue_top = None
        self._heaped.clear()
        self._heap.clear()
        self._counter = 0
        self._generation += 1

    def __len__(self) -> int:
        return len(self.chunks)


class _RankView(Mapping[OffloadKey, Rank]):
    """key -> rank, read off the statuses."""

    def __init__(self, chunks: dict[OffloadKey, ChunkStatus]) -> None:
        self._chunks = chunks

    def __getitem__(self, key: OffloadKey) -> Rank:
        rank: Rank = self._chunks[key].rank
        return rank

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self._chunks)

    def __len__(self) -> int:
        return len(self._chunks)


def _is_queued(entry: _QueueEntry) -> bool:
    rank, _, status = entry
    return status.place == _QUEUED and status.rank == rank


def _evictable(queue: deque[_QueueEntry], protected: Set[OffloadKey]) -> Iterator[_QueueEntry]:
    """The queue's live, unprotected, unpinned entries, oldest first."""
    for entry in queue:
        rank, key, status = entry
        if status.place == _QUEUED and status.rank == rank and key not in protected and status.ref_cnt == 0:
            yield entry
