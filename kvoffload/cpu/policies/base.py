"""What every cache policy is: which ready, unpinned chunk leaves first when the CPU pool is full.

A policy maps keys to their ``ChunkStatus`` and keeps them in eviction order; the
manager owns the chunk pool and the reference counts. Every policy keeps three rules:

* ``evict(n, protected)`` is atomic: it removes exactly ``n`` entries, or none and
  returns ``None``. A half-done eviction would free chunks the caller cannot use.
* Only entries with ``ref_cnt == 0`` (written and not pinned by a load) that are not
  in ``protected`` are eviction candidates.
* ``get`` never reorders: a lookup is not a use.

A request's uses reach a policy in two steps. While the request runs, the manager
reports each key the first time the request meets it (``on_request_access``); when it
finishes, the manager hands over everything it met, grouped by KV-cache group and in
prefix order (``on_request_finished``). Recency and frequency are committed then, once
per request, in the order of the prefix rather than the order transfers completed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from kvoffload.base import OffloadKey, ReqContext

WRITE_PENDING = -1


@dataclass(slots=True)
class ChunkStatus:
    """One stored key's chunk and its reference count.

    ``ref_cnt``: -1 while the write is pending, 0 when ready and evictable, n > 0 while
    n loads have it pinned.

    ``rank`` and ``place`` belong to the cache policy holding the key (the LRU keeps the
    key's recency rank and which of its eviction orders the key waits in), so the policy
    reads them off the status it already holds rather than from a dict of its own per
    field: at 100,000 keys every extra dict is one more cold cache line per key and call.
    The manager never reads them; they take no part in equality.
    """

    chunk_id: int
    ref_cnt: int = WRITE_PENDING
    rank: Any = field(default=None, compare=False, repr=False)
    place: int = field(default=0, compare=False, repr=False)

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    @property
    def is_evictable(self) -> bool:
        return self.ref_cnt == 0


Eviction = list[tuple[OffloadKey, ChunkStatus]]


def offload_key_positions(req_context: ReqContext, keys: Iterable[OffloadKey]) -> list[int | None]:
    """The end token the scheduler recorded for each key (``None`` where it recorded none)."""
    if type(req_context) is ReqContext:
        return req_context.get_offload_key_positions(keys)
    # Another library's context (vLLM's own, in a vLLM scheduler), or one that overrides the lookup.
    return list(map(req_context.get_offload_key_position, keys))


def order_request_keys(
    key_groups: Sequence[Sequence[OffloadKey]], req_context: ReqContext
) -> list[OffloadKey]:
    """One head-to-tail order over every group's keys.

    Keys are sorted by the end token the scheduler recorded for them, so a group's head
    comes before every group's tail. Without a position for every key the groups are
    simply chained, each already in its own prefix order.
    """
    keys = [key for group in key_groups for key in group]
    positions = offload_key_positions(req_context, keys)
    if None in positions:
        return keys
    return [key for _, key in sorted(zip(positions, keys, strict=True), key=itemgetter(0))]


class CachePolicy(ABC):
    """Eviction order over at most ``cache_capacity`` stored keys.

    ``chunks``: a policy that keeps every stored key's status in one dict (the same
    object for its whole life, cleared in place) names it here, and the manager reads
    it directly instead of calling ``get`` per key; ``None`` where there is no such dict.

    The manager calls the ``*_many`` hooks with a whole call's keys; by default they call
    the per-key hook once per key, in order. A policy that overrides them does the same
    work in one pass (a subclass that overrides a per-key hook overrides its batch too).
    """

    chunks: dict[OffloadKey, ChunkStatus] | None = None

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """The key's status, without changing its position."""

    @abstractmethod
    def insert(self, key: OffloadKey, chunk: ChunkStatus, req_context: ReqContext) -> None:
        """Track a key that was just allocated a chunk by ``req_context``'s store."""

    def insert_many(
        self, keys: Sequence[OffloadKey], chunks: Sequence[ChunkStatus], req_context: ReqContext
    ) -> None:
        """``insert`` of each key with its chunk, in order."""
        for key, chunk in zip(keys, chunks, strict=True):
            self.insert(key, chunk, req_context)

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget a key (its store failed); a missing key is not an error."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Mark keys used now; the first key ends up the most recent."""

    def on_store_miss(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keys about to be stored because they were missing, before ``insert``.

        The manager reports a key once per request. A policy that learns from misses
        (ARC's ghost lists) overrides this; the default treats a miss as a use.
        """
        self.touch(keys, req_context)

    def on_request_access(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:
        """Keys the request met for the first time; some may not be stored yet.

        Nothing is committed here: a policy may only keep a running request's prefix in
        order. The default does nothing.
        """
        return None

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[OffloadKey]],
        insertion_only_keys: Set[OffloadKey],
        reused_keys: Set[OffloadKey],
        req_context: ReqContext,
    ) -> None:
        """Commit one request's accesses.

        ``key_groups``: the keys met, per KV-cache group, head to tail.
        ``insertion_only_keys``: keys this request stored and never read back.
        ``reused_keys``: ready keys it read (or offered again) that someone else stored.
        The default touches each group, which suits a policy blind to the difference.
        """
        for keys in key_groups:
            self.touch(keys, req_context)

    @abstractmethod
    def evict(self, n: int, protected: Set[OffloadKey]) -> Eviction | None:
        """Remove and return ``n`` evictable entries, or remove nothing and return ``None``."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key, and any state learnt from them."""

    def mark_evictable(self, key: OffloadKey) -> None:
        """``key``'s ref_cnt just became 0 (its write completed, or its last load)."""
        return None

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """``key``'s ref_cnt just left 0 (a load pinned it)."""
        return None

    def mark_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        """``mark_evictable`` of each key, in order."""
        for key in keys:
            self.mark_evictable(key)

    def mark_non_evictable_many(self, keys: Iterable[OffloadKey]) -> None:
        """``mark_non_evictable`` of each key, in order."""
        for key in keys:
            self.mark_non_evictable(key)
