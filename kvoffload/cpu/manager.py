"""CPUOffloadingManager: scheduler-side bookkeeping of the CPU chunk pool.

The pool has ``num_chunks`` chunks, each holding ``blocks_per_chunk`` GPU blocks of every
worker. A key's chunk goes through three states, kept in its ``ref_cnt``:

    prepare_store      -> -1  write pending: lookup says HIT_PENDING, not evictable
    complete_store(ok) ->  0  ready: lookup says HIT, evictable
    prepare_load       -> +1  pinned by each load in flight, not evictable
    complete_load      -> -1 per load, back to 0

``complete_store(success=False)`` forgets a pending key and frees its chunk. Fresh chunk
ids are handed out in order (0, 1, 2, ...) before freed ones are reused, so a young
pool touches as few pages of the region as possible.

The manager holds no resource: ``shutdown`` only forgets the bookkeeping.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable

from kvoffload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
)
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.policies import WRITE_PENDING, CachePolicyFactory, ChunkStatus
from kvoffload.errors import ConfigError, KvOffloadError


class CPUOffloadingManager(OffloadingManager):
    """Chunk pool, reference counts and a cache policy over ``num_chunks`` CPU chunks.

    ``store_threshold >= 2`` stores a key only on its ``store_threshold``-th store
    request (keys seen fewer times are remembered in a tracker of at most
    ``max_tracker_size`` keys, oldest dropped first); 0 and 1 store on the first.
    """

    medium = Medium.CPU

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
    ) -> None:
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < 0:
            raise ConfigError("num_chunks", f"must be a non-negative integer, got {num_chunks!r}")
        if isinstance(store_threshold, bool) or not isinstance(store_threshold, int) or store_threshold < 0:
            raise ConfigError("store_threshold", f"must be a non-negative integer, got {store_threshold!r}")
        if store_threshold >= 2 and (not isinstance(max_tracker_size, int) or max_tracker_size < 1):
            raise ConfigError(
                "max_tracker_size",
                f"must be a positive integer when store_threshold >= 2, got {max_tracker_size!r}",
            )
        policy_cls = CachePolicyFactory.get_cache_policy_cls(cache_policy, cache_policy_module_path)
        self.num_chunks = num_chunks
        self.store_threshold = store_threshold
        self.max_tracker_size = max_tracker_size
        self._policy = policy_cls(cache_capacity=num_chunks)
        self._next_fresh_chunk = 0
        self._free_chunks: list[int] = []
        # Chunks with ref_cnt 0: a store that needs more than these (less its own keys)
        # is refused without asking the policy, which would walk every held chunk to say no.
        self._num_evictable = 0
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        # Keys asked to be stored fewer than store_threshold times, with their counts.
        self._store_requests: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold >= 2 else None
        )

    # ----------------------------------------------------------------- pool

    @property
    def num_free_chunks(self) -> int:
        return len(self._free_chunks) + self.num_chunks - self._next_fresh_chunk

    @property
    def num_stored(self) -> int:
        """Keys holding a chunk (pending writes included)."""
        return len(self._policy)

    def _allocate(self, n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n and self._next_fresh_chunk < self.num_chunks:
            ids.append(self._next_fresh_chunk)
            self._next_fresh_chunk += 1
        while len(ids) < n:
            ids.append(self._free_chunks.pop())
        return ids

    def _status(self, key: OffloadKey, action: str) -> ChunkStatus:
        status = self._policy.get(key)
        if status is None:
            raise KvOffloadError(f"{action}: key {key.hex()} is not stored in the CPU tier")
        return status

    def _emit(self, keys: Iterable[OffloadKey], removed: bool, metadata_only: bool = False) -> None:
        if self._events is None:
            return
        keys = list(keys)
        if keys:
            self._events.append(OffloadingEvent(keys, self.medium, removed, metadata_only=metadata_only))

    # ----------------------------------------------------------------- lookups and loads

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        status = self._policy.get(key)
        if status is None:
            return LookupResult.MISS
        return LookupResult.HIT if status.is_ready else LookupResult.HIT_PENDING

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        statuses = [self._status(key, "prepare_load") for key in keys]
        pending = [key.hex() for key, status in zip(keys, statuses, strict=True) if not status.is_ready]
        if pending:
            raise KvOffloadError(f"prepare_load: keys still being written: {', '.join(pending[:4])}")
        policy = self._policy
        for key, status in zip(keys, statuses, strict=True):
            if status.ref_cnt == 0:
                self._num_evictable -= 1
                policy.mark_non_evictable(key)
            status.ref_cnt += 1
        return CPULoadStoreSpec(status.chunk_id for status in statuses)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self._policy.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        statuses = [self._status(key, "complete_load") for key in keys]
        freed: list[OffloadKey] = []  # keys whose last load this is
        for i, (key, status) in enumerate(zip(keys, statuses, strict=True)):
            status.ref_cnt -= 1
            if status.ref_cnt == 0:
                freed.append(key)
            elif status.ref_cnt < 0:
                # Not pinned, or listed more often than it was loaded: undo, all or nothing.
                for undone in statuses[: i + 1]:
                    undone.ref_cnt += 1
                unpinned = [k.hex() for k, s in zip(keys, statuses, strict=True) if s.ref_cnt <= 0]
                raise KvOffloadError(
                    f"complete_load: keys not pinned by a load: {', '.join((unpinned or [key.hex()])[:4])}"
                )
        policy = self._policy
        for key in freed:
            policy.mark_evictable(key)
        self._num_evictable += len(freed)

    # ----------------------------------------------------------------- stores

    def _admit(self, keys: list[OffloadKey]) -> list[OffloadKey]:
        """Keys that reached ``store_threshold`` store requests (all keys without a threshold)."""
        tracker = self._store_requests
        if tracker is None:
            return keys
        admitted = []
        for key in keys:
            count = tracker.pop(key, 0) + 1
            if count >= self.store_threshold:
                admitted.append(key)
            else:
                tracker[key] = count
        while len(tracker) > self.max_tracker_size:
            tracker.popitem(last=False)
        return admitted

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        new_keys: list[OffloadKey] = []
        protected_evictable = 0  # keys of this store that are stored and evictable
        for key in dict.fromkeys(keys):
            status = self._policy.get(key)
            if status is None:
                new_keys.append(key)
            elif status.ref_cnt == 0:
                protected_evictable += 1
        keys_to_store = self._admit(new_keys)
        evicted_keys: list[OffloadKey] = []
        shortfall = len(keys_to_store) - self.num_free_chunks
        if shortfall > 0:
            # Never evict a key of this very store: the caller is about to rely on it.
            enough = shortfall <= self._num_evictable - protected_evictable
            evicted = self._policy.evict(shortfall, protected=frozenset(keys)) if enough else None
            if evicted is None:
                if self._store_requests is not None:
                    # They earned their place; the pool being full is not their fault.
                    for key in keys_to_store:
                        self._store_requests[key] = self.store_threshold - 1
                return None
            for key, status in evicted:
                self._free_chunks.append(status.chunk_id)
                evicted_keys.append(key)
            self._num_evictable -= len(evicted)
            self._emit(evicted_keys, removed=True)
        chunk_ids = self._allocate(len(keys_to_store))
        for key, chunk_id in zip(keys_to_store, chunk_ids, strict=True):
            self._policy.insert(key, ChunkStatus(chunk_id, WRITE_PENDING))
        return PrepareStoreOutput(keys_to_store, CPULoadStoreSpec(chunk_ids), evicted_keys)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, success: bool = True
    ) -> None:
        # Only keys whose write is pending are this store's; ready keys belong to an earlier one.
        finished: list[tuple[OffloadKey, ChunkStatus]] = []
        for key in dict.fromkeys(keys):
            status = self._policy.get(key)
            if status is not None and status.ref_cnt == WRITE_PENDING:
                finished.append((key, status))
        if success:
            policy = self._policy
            for key, status in finished:
                status.ref_cnt = 0
                policy.mark_evictable(key)
            self._num_evictable += len(finished)
            self._emit((key for key, _ in finished), removed=False)
            return
        for key, status in finished:
            self._policy.remove(key)
            self._free_chunks.append(status.chunk_id)
        self._emit((key for key, _ in finished), removed=True, metadata_only=True)

    # ----------------------------------------------------------------- requests and events

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._policy.on_request_finished(req_context)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self._events:
            return ()
        events, self._events = self._events, []
        return events
