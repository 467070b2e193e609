"""ARC: Adaptive Replacement Cache (Megiddo and Modha), over the CPU chunk pool.

``t1`` holds keys stored and not yet reused, ``t2`` keys a later request reused; both
are least recent first. ``b1``/``b2`` are ghosts: keys recently evicted from each list,
without a chunk, each list bounded by the capacity. A miss on a ``b1`` ghost (the key is
stored again, or touched) says T1 was too small, so ``target_t1_size`` grows; a miss on
a ``b2`` ghost shrinks it. Eviction takes from T1 while it holds at least its target.

Frequency is counted per request, not per call: a request that reads a chunk twice, or
stores it and reads it back to cascade it to another tier, used it once. The manager
hands a finished request's accesses over in one ``on_request_finished``; a key the
request only stored stays in T1, a ready key it reused moves to T2.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence, Set

from kvoffload.base import OffloadKey, ReqContext
from kvoffload.cpu.policies.base import CachePolicy, ChunkStatus, Eviction, order_request_keys

_Candidate = tuple[OffloadKey, ChunkStatus]


def _evictable(
    entries: OrderedDict[OffloadKey, ChunkStatus], protected: Set[OffloadKey]
) -> Iterator[_Candidate]:
    """A list's evictable entries, least recent first, walked once however many are taken."""
    for key, chunk in entries.items():
        if chunk.ref_cnt == 0 and key not in protected:
            yield key, chunk


class ARCCachePolicy(CachePolicy):
    """Recency (T1) and frequency (T2) lists, balanced by what the ghost lists learn."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.target_t1_size = 0.0
        self.t1: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()
        # What get answers, T1's status before T2's, in one lookup: kept with every change to the lists.
        self.chunks: dict[OffloadKey, ChunkStatus] = {}

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self.chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        self.insert_many((key,), (chunk,), req_context)

    def insert_many(
        self, keys: Sequence[OffloadKey], chunks: Sequence[ChunkStatus], req_context: ReqContext
    ) -> None:
        # The ghost already taught its lesson in on_store_miss, before this insert.
        t1, all_chunks, b1, b2 = self.t1, self.chunks, self.b1, self.b2
        for key, chunk in zip(keys, chunks, strict=True):
            t1[key] = chunk
            all_chunks[key] = chunk
            if key in b1:
                del b1[key]
            if key in b2:
                del b2[key]

    def remove(self, key: OffloadKey) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)
        self._unlisted(key)

    def _unlisted(self, key: OffloadKey) -> None:
        """``key`` left a list; a key inserted again while in T2 may still be in the other."""
        chunk = self.t1.get(key)
        if chunk is None:
            chunk = self.t2.get(key)
        if chunk is None:
            self.chunks.pop(key, None)
        else:
            self.chunks[key] = chunk

    def _learn_from_ghost(self, key: OffloadKey) -> None:
        if key in self.b1:
            step = max(1.0, len(self.b2) / len(self.b1))
            self.target_t1_size = min(self.target_t1_size + step, float(self.cache_capacity))
            self.b1.move_to_end(key)
        elif key in self.b2:
            step = max(1.0, len(self.b1) / len(self.b2))
            self.target_t1_size = max(self.target_t1_size - step, 0.0)
            self.b2.move_to_end(key)

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        b1, b2 = self.b1, self.b2
        for key in reversed(list(keys)):
            if key in b1 or key in b2:
                self._learn_from_ghost(key)

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        for key in reversed(list(keys)):
            chunk = self.t1.pop(key, None)
            if chunk is not None:
                # A chunk still being written was stored, not used a second time.
                (self.t2 if chunk.is_ready else self.t1)[key] = chunk
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._learn_from_ghost(key)

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: Set[OffloadKey],
        reused_keys: Set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        t1, t2 = self.t1, self.t2
        # Head last, so the head ends up the most recent of its list.
        for key in reversed(order_request_keys(key_groups, req_context)):
            if key in insertion_only_keys:
                # A store is recency, not frequency: the key stays in whichever list holds it.
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused_keys:
                if key in t1:
                    t2[key] = t1.pop(key)
                elif key in t2:
                    t2.move_to_end(key)

    def evict(self, n: int, protected: Set[OffloadKey]) -> Eviction | None:
        if n <= 0:
            return []
        # Choose every victim before touching a list, so a shortfall changes nothing.
        recent = _evictable(self.t1, protected)
        frequent = _evictable(self.t2, protected)
        t1_size = len(self.t1)
        plan: list[tuple[_Candidate, bool]] = []  # (victim, came from T1)
        for _ in range(n):
            victim = next(recent, None) if t1_size >= int(self.target_t1_size) else None
            from_t1 = victim is not None
            if victim is None:
                victim = next(frequent, None)
            if victim is None:
                # T2 has nothing left to give: T1 does, whatever its target says.
                victim = next(recent, None)
                from_t1 = True
                if victim is None:
                    return None
            if from_t1:
                t1_size -= 1
            plan.append((victim, from_t1))
        victims: Eviction = []
        t1, t2, b1, b2, chunks = self.t1, self.t2, self.b1, self.b2, self.chunks
        for (key, chunk), from_t1 in plan:
            if from_t1:
                del t1[key]
                b1[key] = None
            else:
                del t2[key]
                b2[key] = None
            if key in t1 or key in t2:
                self._unlisted(key)
            else:
                del chunks[key]
            victims.append((key, chunk))
        for ghosts in (self.b1, self.b2):
            for _ in range(len(ghosts) - self.cache_capacity):
                ghosts.popitem(last=False)
        return victims

    def mark_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        """Nothing to do: eviction reads each chunk's ref_cnt as it walks T1 and T2."""

    def mark_non_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        """Nothing to do, as for ``mark_evictable_many``."""

    def clear(self) -> None:
        self.chunks.clear()
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
