"""Cache policies: which ready, unpinned chunk leaves first when the CPU pool is full.

A policy maps keys to their ``ChunkStatus`` and keeps them in eviction order; the
manager owns the chunk pool and the reference counts. Every policy keeps three rules:

* ``evict(n, protected)`` is atomic: it removes exactly ``n`` entries, or none and
  returns ``None``. A half-done eviction would free chunks the caller cannot use.
* Only entries with ``ref_cnt == 0`` (written and not pinned by a load) that are not
  in ``protected`` are eviction candidates.
* ``get`` never reorders (a lookup is not a use); ``touch`` and ``insert`` do.

``lru`` and ``arc`` are built in; any other name is imported from
``cache_policy_module_path`` (an out-of-tree policy, as in vLLM).
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Set
from dataclasses import dataclass
from typing import ClassVar

from kvoffload.base import OffloadKey, ReqContext
from kvoffload.errors import ConfigError

log = logging.getLogger(__name__)

#: The names ``eviction_policy`` accepts without a module path.
KNOWN_POLICIES = ("lru", "arc")

WRITE_PENDING = -1


@dataclass(slots=True)
class ChunkStatus:
    """One stored key's chunk and its reference count.

    ``ref_cnt``: -1 while the write is pending, 0 when ready and evictable, n > 0 while
    n loads have it pinned.
    """

    chunk_id: int
    ref_cnt: int = WRITE_PENDING

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0

    @property
    def is_evictable(self) -> bool:
        return self.ref_cnt == 0


Eviction = list[tuple[OffloadKey, ChunkStatus]]


class CachePolicy(ABC):
    """Eviction order over at most ``cache_capacity`` stored keys."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: OffloadKey) -> ChunkStatus | None:
        """The key's status, without changing its position."""

    @abstractmethod
    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        """Track a key that was just allocated a chunk (it is the most recent)."""

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget a key (its store failed); a missing key is not an error."""

    @abstractmethod
    def touch(self, keys: Iterable[OffloadKey]) -> None:
        """Mark keys used; the first key of a request ends up the most recent."""

    @abstractmethod
    def evict(self, n: int, protected: Set[OffloadKey]) -> Eviction | None:
        """Remove and return ``n`` evictable entries, or remove nothing and return ``None``."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key."""

    @abstractmethod
    def __len__(self) -> int: ...

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Hook for policies that rank by request; the built-in ones do not."""
        return None

    def mark_evictable(self, key: OffloadKey) -> None:
        """Hook: ``key``'s chunk just became evictable (its write completed, its last load did).

        The manager calls it; eviction still checks ``ref_cnt`` itself. The built-in
        policies use it to give a chunk that an eviction stepped over while it was held
        its place back: without the call it stays evictable, but only after every chunk
        that was never stepped over.
        """
        return None

    def mark_non_evictable(self, key: OffloadKey) -> None:
        """Hook: ``key``'s chunk was just pinned by a load. A hint, like ``mark_evictable``."""
        return None


def _touch_order(keys: Iterable[OffloadKey]) -> list[OffloadKey]:
    # A request's later blocks are useless without its earlier ones (prefix caching), so
    # the first block is touched last and becomes the most recent: a request's tail is
    # evicted before its head.
    return list(keys)[::-1]


class _EvictionOrder:
    """One recency list, least recent first, where an eviction steps over a held chunk once.

    An eviction walks the list from its old end. A chunk it may not take (write pending
    or pinned) would be stepped over again by every later eviction, which makes each
    eviction cost as much as the chunks held at the old end: a long load of cold
    blocks, or chunks pinned while a secondary tier copies them, made it O(pool). So the
    walk parks held chunks aside. A parked chunk is still older than every chunk left
    in the list (the walk only parks from the old end), so the list's true order is
    "parked, then listed"; a parked chunk returns to the old end when ``release`` says it
    became evictable, and to the recent end when it is used (``move_to_end``).

    Among chunks released that way the last released is the oldest; all of them stay
    older than every chunk that was listed when they were parked. ``release`` is an
    optimisation, not a condition: ``reclaim`` finds parked chunks that
    became evictable without one (a caller that sets ``ref_cnt`` itself), and ``evict``
    calls it before giving up.
    """

    __slots__ = ("listed", "parked")

    def __init__(self) -> None:
        self.listed: OrderedDict[OffloadKey, ChunkStatus] = OrderedDict()
        self.parked: dict[OffloadKey, ChunkStatus] = {}  # in the order they were parked

    def __len__(self) -> int:
        return len(self.listed) + len(self.parked)

    def __iter__(self) -> Iterator[OffloadKey]:
        """Least recent first."""
        yield from self.parked
        yield from self.listed

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        chunk = self.listed.get(key)
        if chunk is None and self.parked:
            chunk = self.parked.get(key)
        return chunk

    def pop(self, key: OffloadKey) -> ChunkStatus | None:
        chunk = self.listed.pop(key, None)
        if chunk is None and self.parked:
            chunk = self.parked.pop(key, None)
        return chunk

    def append(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        """Add ``key`` as the most recent (it must not be in the list)."""
        self.listed[key] = chunk

    def move_to_end(self, key: OffloadKey) -> bool:
        """Make ``key`` the most recent; False if it is not in the list."""
        if key in self.listed:
            self.listed.move_to_end(key)
            return True
        chunk = self.parked.pop(key, None) if self.parked else None
        if chunk is None:
            return False
        self.listed[key] = chunk
        return True

    def release(self, key: OffloadKey) -> None:
        """``key`` became evictable: a parked key returns to the old end."""
        if self.parked:
            chunk = self.parked.pop(key, None)
            if chunk is not None:
                self.listed[key] = chunk
                self.listed.move_to_end(key, last=False)

    def reclaim(self) -> None:
        """Return every parked key that became evictable to the old end, oldest first."""
        ready = [(key, chunk) for key, chunk in self.parked.items() if chunk.ref_cnt == 0]
        for key, chunk in reversed(ready):
            del self.parked[key]
            self.listed[key] = chunk
            self.listed.move_to_end(key, last=False)

    def candidates(self, n: int, protected: Set[OffloadKey]) -> Eviction:
        """Up to ``n`` evictable entries, oldest first, without removing them.

        Held chunks met on the way are parked. Protected ones stay listed: they are at
        most the keys of one store, and evictable again after it.
        """
        found: Eviction = []
        held: list[OffloadKey] = []
        if n > 0:
            for key, chunk in self.listed.items():
                if chunk.ref_cnt != 0:
                    held.append(key)
                elif key not in protected:
                    found.append((key, chunk))
                    if len(found) == n:
                        break
        for key in held:
            self.parked[key] = self.listed.pop(key)
        return found

    def clear(self) -> None:
        self.listed.clear()
        self.parked.clear()


class LRUCachePolicy(CachePolicy):
    """Least recently used first."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._chunks = _EvictionOrder()

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        return self._chunks.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        self._chunks.pop(key)
        self._chunks.append(key, chunk)

    def remove(self, key: OffloadKey) -> None:
        self._chunks.pop(key)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in _touch_order(keys):
            self._chunks.move_to_end(key)

    def evict(self, n: int, protected: Set[OffloadKey]) -> Eviction | None:
        victims = self._chunks.candidates(n, protected)
        if len(victims) < n:
            self._chunks.reclaim()
            victims = self._chunks.candidates(n, protected)
            if len(victims) < n:
                return None
        for key, _ in victims:
            del self._chunks.listed[key]
        return victims

    def mark_evictable(self, key: OffloadKey) -> None:
        self._chunks.release(key)

    def clear(self) -> None:
        self._chunks.clear()

    def __len__(self) -> int:
        return len(self._chunks)


class ARCCachePolicy(CachePolicy):
    """Adaptive Replacement Cache (Megiddo and Modha).

    ``T1`` holds keys used once recently, ``T2`` keys used at least twice. ``B1``/``B2``
    remember keys recently evicted from each (no chunk, only the key): storing a key
    again that ``B1`` remembers means T1 was too small, so ``target_t1_size`` grows; a
    hit in ``B2`` shrinks it. Eviction takes from T1 while it is over its target.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._t1 = _EvictionOrder()
        self._t2 = _EvictionOrder()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.target_t1_size = 0.0

    def get(self, key: OffloadKey) -> ChunkStatus | None:
        chunk = self._t1.get(key)
        return chunk if chunk is not None else self._t2.get(key)

    def insert(self, key: OffloadKey, chunk: ChunkStatus) -> None:
        if key in self._b1:
            delta = max(1.0, len(self._b2) / len(self._b1))
            self.target_t1_size = min(self.target_t1_size + delta, float(self.cache_capacity))
            del self._b1[key]
            self._t2.append(key, chunk)
        elif key in self._b2:
            delta = max(1.0, len(self._b1) / len(self._b2))
            self.target_t1_size = max(self.target_t1_size - delta, 0.0)
            del self._b2[key]
            self._t2.append(key, chunk)
        else:
            self._t1.append(key, chunk)
        self._trim_ghosts()

    def remove(self, key: OffloadKey) -> None:
        if self._t1.pop(key) is None:
            self._t2.pop(key)

    def touch(self, keys: Iterable[OffloadKey]) -> None:
        for key in _touch_order(keys):
            chunk = self._t1.pop(key)
            if chunk is not None:
                self._t2.append(key, chunk)
            else:
                self._t2.move_to_end(key)

    def _plan(self, n: int, protected: Set[OffloadKey]) -> list[tuple[OffloadKey, ChunkStatus, bool]] | None:
        from_t1 = iter(self._t1.candidates(n, protected))
        from_t2 = iter(self._t2.candidates(n, protected))
        next_t1, next_t2 = next(from_t1, None), next(from_t2, None)
        t1_size = len(self._t1)
        plan: list[tuple[OffloadKey, ChunkStatus, bool]] = []  # (key, chunk, came from T1)
        while len(plan) < n:
            if next_t1 is not None and (t1_size > self.target_t1_size or next_t2 is None):
                plan.append((*next_t1, True))
                t1_size -= 1
                next_t1 = next(from_t1, None)
            elif next_t2 is not None:
                plan.append((*next_t2, False))
                next_t2 = next(from_t2, None)
            else:
                return None
        return plan

    def evict(self, n: int, protected: Set[OffloadKey]) -> Eviction | None:
        # Plan first, mutate after: the eviction must be all or nothing.
        plan = self._plan(n, protected)
        if plan is None:
            self._t1.reclaim()
            self._t2.reclaim()
            plan = self._plan(n, protected)
            if plan is None:
                return None
        for key, _, in_t1 in plan:
            if in_t1:
                del self._t1.listed[key]
                self._b1[key] = None
            else:
                del self._t2.listed[key]
                self._b2[key] = None
        self._trim_ghosts()
        return [(key, chunk) for key, chunk, _ in plan]

    def mark_evictable(self, key: OffloadKey) -> None:
        self._t1.release(key)
        self._t2.release(key)

    def _trim_ghosts(self) -> None:
        # ARC's bounds: |T1| + |B1| <= c and the four lists together <= 2c.
        capacity = self.cache_capacity
        while self._b1 and len(self._t1) + len(self._b1) > capacity:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * capacity:
            self._b2.popitem(last=False)

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self.target_t1_size = 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    @property
    def recent_keys(self) -> list[OffloadKey]:
        """T1, least recent first (for introspection and tests)."""
        return list(self._t1)

    @property
    def frequent_keys(self) -> list[OffloadKey]:
        """T2, least recent first."""
        return list(self._t2)

    @property
    def ghost_keys(self) -> tuple[list[OffloadKey], list[OffloadKey]]:
        """(B1, B2): keys evicted from T1 and from T2 that are still remembered."""
        return list(self._b1), list(self._b2)


class CachePolicyFactory:
    """Resolves ``eviction_policy`` (and ``cache_policy_module_path``) to a policy class."""

    _registry: ClassVar[dict[str, type[CachePolicy]]] = {
        "lru": LRUCachePolicy,
        "arc": ARCCachePolicy,
    }

    @classmethod
    def get_cache_policy_cls(cls, name: str, module_path: str | None = None) -> type[CachePolicy]:
        known = cls._registry.get(name)
        if known is not None:
            return known
        if not module_path:
            raise ConfigError(
                "eviction_policy",
                f"unknown cache policy {name!r}",
                fix=f"use one of {', '.join(KNOWN_POLICIES)}; for an out-of-tree policy "
                "also set cache_policy_module_path",
            )
        log.warning("Loading out-of-tree cache policy %s from %s", name, module_path)
        try:
            module = importlib.import_module(module_path)
        except (ImportError, TypeError) as e:  # TypeError: a relative name such as ".x"
            raise ConfigError(
                "cache_policy_module_path",
                f"cannot import {module_path!r}: {e}",
                fix="name an importable module that defines the policy class",
            ) from e
        policy_cls = getattr(module, name, None)
        if not (isinstance(policy_cls, type) and issubclass(policy_cls, CachePolicy)):
            raise ConfigError(
                "eviction_policy",
                f"{module_path}.{name} is not a CachePolicy subclass",
                fix=f"define class {name}(kvoffload.cpu.policies.CachePolicy) in {module_path}",
            )
        return policy_cls
