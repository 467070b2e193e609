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

Cache accesses are counted per request. Each call made for a request records the keys
it met on the request's ``ReqContext`` (which ones it stored, which ready ones it
reused); ``on_request_finished`` hands them to the policy at once, in prefix order. So
the order in which transfers complete, a request offering the same keys twice, or a
tier reading back what the request just stored never count as extra uses. A call made
without a request (``req_context=None``: a tier's own transfer) records nothing.

The manager holds no resource: ``shutdown`` only forgets the bookkeeping.

Every call runs once per scheduler step per request, so the hot paths read a policy's
key -> status dict directly where it has one (``CachePolicy.chunks``), test ``ref_cnt``
rather than call a property per key, and build the chunk ids' spec without re-checking
ids the pool itself handed out.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

from kvoffload.base import (
    CacheHitSource,
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from kvoffload.cpu.common import CPULoadStoreSpec, CPUOffloadingInfo, CPUOffloadingMetrics
from kvoffload.cpu.policies.base import CachePolicy, ChunkStatus, offload_key_positions
from kvoffload.cpu.policies.factory import CachePolicyFactory
from kvoffload.errors import ConfigError, KvOffloadError

_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING
# A key's last 4 bytes are its group index, big-endian: as bytes they sort as the ints do.
_GROUP_BYTES = 4


@dataclass(slots=True)
class _RequestAccess:
    """The keys one request met in one manager's cache, kept on its ``ReqContext``."""

    manager: object
    generation: int
    key_groups: dict[bytes, list[OffloadKey]] = field(default_factory=dict)  # group -> keys, first met first
    seen: set[OffloadKey] = field(default_factory=set)
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_misses: set[OffloadKey] = field(default_factory=set)
    finished: bool = False


@dataclass(frozen=True, slots=True)
class CPUOffloadingStats:
    """The pool's use now, and what happened since the last ``take_stats``.

    Usages are fractions of the pool: ``usage`` counts every chunk that is not evictable
    (write pending or pinned by a load), ``write_usage`` the pending writes and
    ``read_usage`` the rest. ``stores_skipped`` is ``None`` without a store threshold.
    """

    usage: float
    write_usage: float
    read_usage: float
    allocation_sizes: tuple[int, ...]
    stores_skipped: int | None


def _chunk_spec(chunk_ids: list[int]) -> CPULoadStoreSpec:
    # The pool handed these ids out itself: they need none of the checks a caller's ids get.
    return CPULoadStoreSpec.from_checked_ids(chunk_ids)


def _no_request() -> ReqContext:
    # The policies always get a context; one made for a single call carries no history.
    return ReqContext(req_id="")


class CPUOffloadingManager(OffloadingManager):
    """Chunk pool, reference counts and a cache policy over ``num_chunks`` CPU chunks.

    ``store_threshold >= 2`` stores a key only once it has been offered
    ``store_threshold`` times (resident or not: every offer counts). The counts live in
    ``counts``, at most ``max_tracker_size`` keys, the least recently offered dropped
    first, though never for a key of the offer being counted; 0 and 1 store on the
    first offer. ``info`` is what ``config_info`` publishes.
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
        info: CPUOffloadingInfo | None = None,
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
        self._config_info: ConfigInfoMapping = info.as_config_info() if info is not None else {}
        self._policy: CachePolicy = policy_cls(cache_capacity=num_chunks)
        # A builtin dict lookup where the policy keeps one dict of every key, its method otherwise.
        chunks = self._policy.chunks
        self._get_status = chunks.get if chunks is not None else self._policy.get
        self._next_fresh_chunk = 0
        self._free_chunks: list[int] = []
        # Chunks with ref_cnt 0: a store that needs more than these (less its own keys)
        # is refused without asking the policy, which would walk every held chunk to say no.
        self._num_evictable_cache_chunks = 0
        self._num_write_pending_chunks = 0
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        # Offers per key, least recently offered first.
        self.counts: OrderedDict[OffloadKey, int] | None = OrderedDict() if store_threshold >= 2 else None
        self.stores_skipped_in_current_batch = 0
        self.allocation_sizes_in_current_batch: list[int] = []
        # Bumped by reset_cache: a request's record from before it describes another cache.
        self._cache_generation = 0

    # ----------------------------------------------------------------- pool

    @property
    def num_free_chunks(self) -> int:
        return len(self._free_chunks) + self.num_chunks - self._next_fresh_chunk

    def _allocate_chunks(self, keys: Sequence[OffloadKey]) -> list[ChunkStatus]:
        """One chunk, write pending, per key: fresh ones first, then the last freed."""
        n = len(keys)
        first_fresh = self._next_fresh_chunk
        self._next_fresh_chunk = min(first_fresh + n, self.num_chunks)
        ids = list(range(first_fresh, self._next_fresh_chunk))
        reused = n - len(ids)
        if reused:
            free = self._free_chunks
            ids += reversed(free[-reused:])
            del free[-reused:]
        return [ChunkStatus(chunk_id) for chunk_id in ids]

    def _statuses(self, keys: Collection[OffloadKey], action: str) -> list[ChunkStatus]:
        get = self._get_status
        statuses = [get(key) for key in keys]
        for key, status in zip(keys, statuses, strict=True):
            if status is None:
                raise KvOffloadError(f"{action}: key {key.hex()} is not stored in the CPU tier")
        return statuses  # type: ignore[return-value]

    def _emit(self, keys: list[OffloadKey], removed: bool, metadata_only: bool = False) -> None:
        if self._events is not None and keys:
            self._events.append(OffloadingEvent(keys, self.medium, removed, metadata_only=metadata_only))

    # ----------------------------------------------------------------- request accesses

    def _request_access(self, req_context: ReqContext) -> _RequestAccess:
        access = req_context.get_state(_RequestAccess)
        if access is None or access.manager is not self or access.generation != self._cache_generation:
            access = _RequestAccess(self, self._cache_generation)
            req_context.set_state(access)
        return access

    def _record_request_cache_access(
        self,
        keys: Iterable[OffloadKey],
        req_context: ReqContext,
        reused_keys: Collection[OffloadKey] = (),
    ) -> None:
        """Note the keys ``req_context``'s request met; the policy hears of each once."""
        access = self._request_access(req_context)
        seen = access.seen
        first_met = [key for key in dict.fromkeys(keys) if key not in seen]
        if first_met:
            if access.finished:
                raise KvOffloadError(
                    f"request {req_context.req_id!r} met key {first_met[0].hex()} after on_request_finished"
                )
            seen.update(first_met)
            key_groups = access.key_groups
            for key in first_met:
                group = key[-_GROUP_BYTES:]
                if group in key_groups:
                    key_groups[group].append(key)
                else:
                    key_groups[group] = [key]
            self._policy.on_request_access(first_met, req_context)
        if reused_keys:
            # Reading back a chunk this request stored (a tier cascading it) is not a reuse.
            inserted = access.inserted
            if inserted:
                access.reused.update(key for key in reused_keys if key not in inserted)
            else:
                access.reused.update(reused_keys)

    def _count_offers(self, keys: Sequence[OffloadKey]) -> None:
        """One more offer of each key, for the store threshold."""
        counts = self.counts
        assert counts is not None
        offered_known = 0
        for key in keys:
            if key in counts:
                counts[key] += 1
                counts.move_to_end(key)
                offered_known += 1
        # Only keys outside this offer may be dropped to make room: dropping one of its
        # own keys would let an offer larger than the tracker never make progress.
        droppable = len(counts) - offered_known
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_tracker_size:
                if droppable == 0:
                    continue
                counts.popitem(last=False)
                droppable -= 1
            counts[key] = 1

    # ----------------------------------------------------------------- lookups and loads

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._request_access(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        status = self._get_status(key)
        if status is None:
            return _MISS
        return _HIT if status.ref_cnt >= 0 else _HIT_PENDING

    def get_load_source(self, key: OffloadKey, req_context: ReqContext | None = None) -> CacheHitSource:
        return CacheHitSource.HOST

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> CPULoadStoreSpec:
        return self._prepare_load(keys, req_context, record_access=True)

    def _prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None, *, record_access: bool
    ) -> CPULoadStoreSpec:
        """Pin ``keys``; ``record_access=False`` for a tier's own read, which is no request's use."""
        statuses = self._statuses(keys, "prepare_load")
        pending = [key.hex() for key, status in zip(keys, statuses, strict=True) if status.ref_cnt < 0]
        if pending:
            raise KvOffloadError(f"prepare_load: keys still being written: {', '.join(pending[:4])}")
        pinned: list[OffloadKey] = []  # keys this load takes out of the eviction order
        for key, status in zip(keys, statuses, strict=True):
            if status.ref_cnt == 0:
                pinned.append(key)
            status.ref_cnt += 1
        self._num_evictable_cache_chunks -= len(pinned)
        if pinned:
            self._policy.mark_non_evictable_many(pinned)
        if record_access and req_context is not None:
            self._record_request_cache_access(keys, req_context, reused_keys=keys)
        return _chunk_spec([status.chunk_id for status in statuses])

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        self._policy.touch(keys, req_context if req_context is not None else _no_request())

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        statuses = self._statuses(keys, "complete_load")
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
        if freed:
            self._policy.mark_evictable_many(freed)
        self._num_evictable_cache_chunks += len(freed)

    # ----------------------------------------------------------------- stores

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        offered = list(dict.fromkeys(keys))  # a key listed twice still gets one chunk
        if self.counts is not None:
            self._count_offers(offered)
        get = self._get_status
        missing: list[OffloadKey] = []
        ready: list[OffloadKey] = []  # resident and readable: this offer reuses them
        protected_evictable = 0  # keys of this store that are stored and evictable
        for key in offered:
            status = get(key)
            if status is None:
                missing.append(key)
            elif status.ref_cnt >= 0:
                ready.append(key)
                if status.ref_cnt == 0:
                    protected_evictable += 1
        keys_to_store = missing
        if self.counts is not None:
            counts, threshold = self.counts, self.store_threshold
            keys_to_store = [key for key in missing if counts.get(key, 0) >= threshold]
            self.stores_skipped_in_current_batch += len(missing) - len(keys_to_store)

        context = req_context if req_context is not None else _no_request()
        access = self._request_access(req_context) if req_context is not None else None
        misses = keys_to_store
        if access is not None:
            store_misses = access.store_misses
            misses = [key for key in keys_to_store if key not in store_misses]
            store_misses.update(misses)
        if misses:
            # Before insert: ARC learns from a ghost that insert is about to drop.
            self._policy.on_store_miss(misses, context)
        if req_context is not None:
            # Recorded before the pool can refuse the store: the request met these keys
            # either way. Keys held back by the threshold, or still being written by
            # another store, were not met as cache entries.
            met: Iterable[OffloadKey] = offered
            if len(keys_to_store) + len(ready) < len(offered):
                met_keys = set(keys_to_store).union(ready)
                met = [key for key in offered if key in met_keys]
            self._record_request_cache_access(met, req_context, reused_keys=ready)

        if not keys_to_store:
            return PrepareStoreOutput([], _chunk_spec([]), [])
        self.allocation_sizes_in_current_batch.append(len(keys_to_store))
        evicted_keys: list[OffloadKey] = []
        shortfall = len(keys_to_store) - self.num_free_chunks
        if shortfall > 0:
            # Never evict a key of this very store: the caller is about to rely on it.
            if shortfall > self._num_evictable_cache_chunks - protected_evictable:
                return None
            evicted = self._policy.evict(shortfall, set(offered))
            if evicted is None:
                return None
            free = self._free_chunks
            for key, status in evicted:
                free.append(status.chunk_id)
                evicted_keys.append(key)
            self._num_evictable_cache_chunks -= len(evicted)
            if self._events is not None:
                self._emit(evicted_keys, removed=True)
        chunks = self._allocate_chunks(keys_to_store)
        self._policy.insert_many(keys_to_store, chunks, context)
        self._num_write_pending_chunks += len(chunks)
        if access is not None:
            access.inserted.update(keys_to_store)
        return PrepareStoreOutput(keys_to_store, _chunk_spec([c.chunk_id for c in chunks]), evicted_keys)

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, success: bool = True
    ) -> None:
        # Only keys whose write is pending are this store's; ready keys belong to an earlier one.
        get = self._get_status
        finished: list[tuple[OffloadKey, ChunkStatus]] = []
        for key in dict.fromkeys(keys):
            status = get(key)
            if status is not None and status.ref_cnt < 0:
                finished.append((key, status))
        self._num_write_pending_chunks -= len(finished)
        if success:
            for _, status in finished:
                status.ref_cnt = 0
            stored = [key for key, _ in finished]
            if stored:
                self._policy.mark_evictable_many(stored)
            self._num_evictable_cache_chunks += len(finished)
            self._emit(stored, removed=False)
            return
        for key, status in finished:
            self._policy.remove(key)
            self._free_chunks.append(status.chunk_id)
        if self._events is not None:
            self._emit([key for key, _ in finished], removed=True, metadata_only=True)

    # ----------------------------------------------------------------- requests, events, reset

    def on_request_finished(self, req_context: ReqContext) -> None:
        access = req_context.get_state(_RequestAccess)
        if (
            access is None
            or access.manager is not self
            or access.generation != self._cache_generation
            or access.finished
        ):
            return
        access.finished = True
        key_groups: list[tuple[OffloadKey, ...]] = []
        for group_idx in sorted(access.key_groups):
            group = access.key_groups[group_idx]
            ends = offload_key_positions(req_context, group)
            if None not in ends:
                # Stores may arrive out of order (a backfill); the end tokens do not.
                group = [key for _, key in sorted(zip(ends, group, strict=True), key=itemgetter(0))]
            key_groups.append(tuple(group))
        self._policy.on_request_finished(
            tuple(key_groups), access.inserted - access.reused, set(access.reused), req_context
        )

    def take_events(self) -> list[OffloadingEvent]:
        """Every event since the last call, taken at once.

        A failed write's removal is metadata only; a key stored again before the drain
        (a retry) is left out of it, or the consumer would drop the retry's chunk.
        """
        if not self._events:
            return []
        events, self._events = self._events, []
        drained: list[OffloadingEvent] = []
        for event in events:
            if not event.metadata_only:
                drained.append(event)
                continue
            gone = [key for key in event.keys if self._get_status(key) is None]
            if gone:
                drained.append(dataclasses.replace(event, keys=gone))
        return drained

    def reset_cache(self) -> None:
        """Forget every chunk, pinned or pending alike.

        The scheduler guarantees no ``complete_*`` call arrives for a job from before the
        reset, and flushes the loads in flight before any new store, so no chunk is
        written while it is read. Requests that span the reset start a fresh record.
        """
        self._policy.clear()
        self._cache_generation += 1
        self._num_evictable_cache_chunks = 0
        self._num_write_pending_chunks = 0
        self._free_chunks.clear()
        self._next_fresh_chunk = 0

    # ----------------------------------------------------------------- metrics

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def take_stats(self) -> CPUOffloadingStats:
        """The pool's use now, and the allocations and skipped stores since the last call."""
        num_chunks = self.num_chunks
        held = self._next_fresh_chunk - len(self._free_chunks) - self._num_evictable_cache_chunks
        usage = held / num_chunks if num_chunks else 0.0
        write_usage = self._num_write_pending_chunks / num_chunks if num_chunks else 0.0
        sizes, self.allocation_sizes_in_current_batch = tuple(self.allocation_sizes_in_current_batch), []
        skipped: int | None = None
        if self.counts is not None:
            skipped, self.stores_skipped_in_current_batch = self.stores_skipped_in_current_batch, 0
        return CPUOffloadingStats(usage, write_usage, max(usage - write_usage, 0.0), sizes, skipped)

    def get_stats(self) -> Any:
        """``take_stats`` as vLLM's ``OffloadingConnectorStats``; ``None`` where vLLM is not installed."""
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # type: ignore[import-not-found]
                OffloadingConnectorStats,
            )
        except ImportError:
            return None
        taken = self.take_stats()
        stats = OffloadingConnectorStats()
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, taken.usage)
        for size in taken.allocation_sizes:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, taken.write_usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, taken.read_usage)
        if taken.stores_skipped is not None:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, taken.stores_skipped)
        return stats
