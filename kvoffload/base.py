"""The offloading vocabulary shared by managers, tiers and workers (vLLM's ``kv_offload/base.py``).

Two sides talk through these types. The scheduler side owns an ``OffloadingManager``:
it decides where each KV block lives (``lookup``, ``prepare_store``, ``prepare_load``)
and hands ``LoadStoreSpec`` pairs to the workers. The worker side owns an
``OffloadingWorker``: it moves the bytes and reports a ``TransferResult`` per job.

A block is named by an ``OffloadKey``: the block hash followed by the KV-cache group
index as 4 bytes, big-endian, unsigned, so one hash stored for two groups is two keys.

Nothing here imports torch or numpy at import time: the CLI imports this module on every Tab
press. Block ids are still vLLM's ``np.int32`` arrays: numpy is imported when the first
``BlockIDsLoadStoreSpec`` is built, which only the paths that move KV data do.
"""

from __future__ import annotations

import enum
import logging
import operator
import sys
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass, field, fields
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, NewType, Self, TypeVar

from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from kvoffload.config import OffloadingConfig

log = logging.getLogger(__name__)

OffloadKey = NewType("OffloadKey", bytes)

_GROUP_IDX_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """The key of ``block_hash`` in KV-cache group ``group_idx``."""
    if not 0 <= group_idx < 1 << (8 * _GROUP_IDX_BYTES):
        raise ConfigError("group_idx", f"{group_idx} does not fit in {_GROUP_IDX_BYTES} unsigned bytes")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_IDX_BYTES, "big"))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    return key[:-_GROUP_IDX_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    return int.from_bytes(key[-_GROUP_IDX_BYTES:], "big")


class LookupResult(enum.Enum):
    """Where a lookup found a block.

    ``HIT_PENDING``: the block is being written and cannot be loaded yet. ``RETRY``: the
    answer is not known yet (a lower tier is promoting the block); ask again next step.
    """

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"


class Medium(enum.Enum):
    GPU = "GPU"
    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(enum.Enum):
    """Where a tier's storage is, seen from the engine that publishes it."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class TierMatcher(NamedTuple):
    """One (medium, locality) pattern; ``None`` on either side matches anything."""

    medium: Medium | None = None
    locality: Locality | None = None

    def matches(self, medium: Medium | None, locality: Locality | None) -> bool:
        return (self.medium is None or medium is None or self.medium == medium) and (
            self.locality is None or locality is None or self.locality == locality
        )


@dataclass(frozen=True)
class TierFilter:
    """Which tiers a request may load from: any matcher that matches lets a tier in."""

    matchers: tuple[TierMatcher, ...] = ()

    ALL: ClassVar[TierFilter]

    def allows(self, medium: Medium | None, locality: Locality | None) -> bool:
        return self is TierFilter.ALL or any(m.matches(medium, locality) for m in self.matchers)


TierFilter.ALL = TierFilter(matchers=(TierMatcher(),))


class CacheHitSource(enum.StrEnum):
    """The tier a cache hit came from, nearest the accelerator first (vLLM's values)."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


# Inside a vLLM process the members must be vLLM's own: its scheduler and tests compare hit
# sources by identity. vLLM's enum is taken only when vLLM is already loaded; importing vLLM
# for it would load torch on every CLI start.
if "vllm" in sys.modules:
    with suppress(ImportError):
        from vllm.v1.metrics.cache_hit_source import (  # type: ignore[import-not-found, no-redef, unused-ignore]
            CacheHitSource,
        )


class OffloadPolicy(enum.Enum):
    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


@dataclass(slots=True)
class RequestOffloadingContext:
    """What a manager tells the scheduler about a new request."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


class ScheduleEndContext(NamedTuple):
    """What one scheduler step did, given to ``on_schedule_end``."""

    new_req_ids: Collection[str]
    preempted_req_ids: Collection[str]


_T = TypeVar("_T")


@dataclass(slots=True)
class ReqContext:
    """The request a manager call is made for.

    ``set_state``/``get_state`` keep one value per type, so a tier parses a request's
    parameters once (in ``on_new_request``) and reads them back later. The key positions
    (end token of each key) let a manager recover prefix order when stores arrive out of
    order.
    """

    req_id: str
    kv_transfer_params: Mapping[str, Any] | None = None
    kv_hints: Any = None
    load_tier_filter: TierFilter = TierFilter.ALL
    _state: dict[type, Any] = field(default_factory=dict, repr=False, init=False)
    _offload_key_positions: dict[OffloadKey, int] = field(default_factory=dict, repr=False, init=False)

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls: type[_T]) -> _T | None:
        value: _T | None = self._state.get(cls)
        return value

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self._offload_key_positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self._offload_key_positions.get(key)

    def get_offload_key_positions(self, keys: Iterable[OffloadKey]) -> list[int | None]:
        """``get_offload_key_position`` of each key, in one call: a manager orders every key
        of a request by them, and a method call per key would cost more than the lookups."""
        return list(map(self._offload_key_positions.get, keys))


class LoadStoreSpec:
    """Where the blocks of one transfer side live. Subclasses name their medium."""

    __slots__ = ()
    MEDIUM: ClassVar[Medium]

    @classmethod
    def medium(cls) -> Medium:
        return cls.MEDIUM


_INT32_MAX = (1 << 31) - 1


def _block_id_array(block_ids: Iterable[int]) -> NDArray[np.int32]:
    """``block_ids`` as vLLM keeps them: a new ``np.int32`` array, each id checked first.

    vLLM's ``np.array(ids, dtype=np.int32)`` truncates a float and wraps an int64 id; here a
    float is a ``TypeError`` (``operator.index``) and an id outside int32, or an array that is
    not one-dimensional integers, a ``ConfigError``: a transfer never names a block nobody asked for.
    """
    import numpy as np

    if isinstance(block_ids, np.ndarray):
        if block_ids.ndim != 1 or block_ids.dtype.kind not in "iu":
            raise ConfigError(
                "block_ids", f"a {block_ids.ndim}-D {block_ids.dtype} array; give one id per block"
            )
        ids: Sequence[int] = block_ids.tolist()
    else:
        ids = [operator.index(b) for b in block_ids]
    outside = [b for b in ids if not 0 <= b <= _INT32_MAX]
    if outside:
        raise ConfigError("block_ids", f"ids must be in 0..{_INT32_MAX}, got {outside[:4]}")
    return np.array(ids, dtype=np.int32)


# eq=False: vLLM's specs compare by identity, and arrays have no truth value to compare by.
@dataclass(frozen=True, slots=True, eq=False)
class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """A transfer side addressed by block ids, in transfer order.

    ``block_ids`` is the spec's own ``np.int32`` array (vLLM's type, so code written for vLLM,
    such as its connector's ``block_ids.tolist()``, runs unchanged); the ids are copied when
    the spec is built, so the caller's list can change afterwards without moving the transfer.
    """

    block_ids: NDArray[np.int32]

    def __init__(self, block_ids: Iterable[int]) -> None:
        object.__setattr__(self, "block_ids", _block_id_array(block_ids))

    @classmethod
    def from_checked_ids(cls, block_ids: list[int]) -> Self:
        """A spec of ids the caller made itself and knows to be in int32's range (a pool's
        own chunk ids), without checking each again: a manager builds one per call.

        Only for a spec whose one field is ``block_ids``: one with more fields has its own ``__init__``.
        """
        import numpy as np

        if cls.__init__ is not BlockIDsLoadStoreSpec.__init__:
            raise TypeError(f"{cls.__name__} has fields of its own: build it with {cls.__name__}(...)")
        spec = cls.__new__(cls)
        object.__setattr__(spec, "block_ids", np.array(block_ids, dtype=np.int32))
        return spec

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True, init=False, eq=False)
class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU KV-cache block ids (one per block of the transfer), ordered by KV-cache group.

    ``group_sizes[i]`` blocks belong to group ``i`` and ``block_indices[i]`` is the index,
    in its request, of that group's first block (so a worker can skip into the first
    chunk when chunks are larger than GPU blocks). Left out: one group starting at 0.
    Both are kept as given, as vLLM keeps them (its connector hands over lists and its tests
    compare them with lists), after checking that they describe ``block_ids``.
    """

    MEDIUM: ClassVar[Medium] = Medium.GPU
    group_sizes: Sequence[int]
    block_indices: Sequence[int]

    def __init__(
        self,
        block_ids: Iterable[int],
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
    ) -> None:
        BlockIDsLoadStoreSpec.__init__(self, block_ids)
        sizes = [len(self.block_ids)] if group_sizes is None else group_sizes
        starts = [0] * len(sizes) if block_indices is None else block_indices
        if sum(operator.index(n) for n in sizes) != len(self.block_ids):
            raise ConfigError("group_sizes", f"sum to {sum(sizes)}, not the {len(self.block_ids)} block ids")
        if len(starts) != len(sizes):
            raise ConfigError(
                "block_indices", f"{len(starts)} given for {len(sizes)} groups; give one per group"
            )
        for i in starts:
            operator.index(i)
        object.__setattr__(self, "group_sizes", sizes)
        object.__setattr__(self, "block_indices", starts)


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided: which keys to write where, and what it evicted for them."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(slots=True)
class OffloadingEvent:
    """Blocks that became available (``removed=False``) or went away in ``medium``.

    ``ownership`` names the secondary tier that emitted it (``None``: the primary tier).
    ``metadata_only``: the blocks were never readable (a store that failed), so consumers
    that only track stored bytes can skip the event.
    """

    keys: list[OffloadKey]
    medium: Medium
    removed: bool
    locality: Locality | None = None
    ownership: str | None = None
    removal_expected: bool = False
    metadata_only: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.keys, list):
            self.keys = list(self.keys)


@dataclass(frozen=True)
class OffloadingMetricMetadata:
    documentation: str
    labelnames: tuple[str, ...] = ()


@dataclass(frozen=True)
class OffloadingCounterMetadata(OffloadingMetricMetadata):
    pass


@dataclass(frozen=True)
class OffloadingGaugeMetadata(OffloadingMetricMetadata):
    # Each engine reports a whole snapshot per step: the newest sample is the value.
    multiprocess_mode: str = "mostrecent"


@dataclass(frozen=True)
class OffloadingHistogramMetadata(OffloadingMetricMetadata):
    buckets: tuple[float, ...] | None = None


@dataclass(frozen=True)
class OffloadingKVEventsConfig:
    enable_kv_cache_events: bool
    self_describing_kv_events: bool


#: One info-metric series: label name -> value.
ConfigInfoMapping = Mapping[str, str | int | float | bool]


@dataclass(frozen=True)
class ConfigInfo:
    """Fixed facts a component publishes as labels of one info metric, one field per label."""

    @classmethod
    def config_info_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def as_config_info(self) -> ConfigInfoMapping:
        """The label values; ``None`` reads "None", not empty."""
        return {f.name: "None" if (v := getattr(self, f.name)) is None else v for f in fields(self)}


@dataclass
class CanonicalKVCacheTensor:
    """One KV cache tensor viewed as (num_blocks, page bytes), int8."""

    tensor: Any
    page_size_bytes: int


@dataclass(frozen=True)
class CopyRun:
    """A strided run of fragments between this worker's page and the canonical page."""

    local_offset: int
    canonical_offset: int
    fragment_size: int
    num_fragments: int
    local_stride: int
    canonical_stride: int


@dataclass(frozen=True)
class CanonicalPageMapping:
    """How this worker's page maps into a page that does not depend on parallelism."""

    canonical_page_size_bytes: int
    local_page_size_bytes: int
    runs: tuple[CopyRun, ...]
    num_writers: int
    writer_index: int
    parallelism_agnostic: bool

    def is_writer(self, block_id: int) -> bool:
        """Ranks holding the same bytes take turns, block by block, writing them."""
        return block_id % self.num_writers == self.writer_index


@dataclass
class CanonicalKVCacheRef:
    """A layer (or layers) of a group: which tensor, and its unpadded page size."""

    tensor_idx: int
    page_size_bytes: int
    mapping: CanonicalPageMapping | None = None


@dataclass
class CanonicalKVCaches:
    """The KV caches as block-level tensors, and how each KV-cache group maps onto them."""

    tensors: list[CanonicalKVCacheTensor]
    group_data_refs: list[list[CanonicalKVCacheRef]]


@dataclass(frozen=True, slots=True)
class TransferResult:
    """The outcome of one worker job; size in bytes, time in seconds."""

    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


class ShutdownOnExit:
    """``with`` support for objects whose ``shutdown`` releases everything they own."""

    def shutdown(self) -> None:
        return None

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.shutdown()
            return
        # The error in flight is the one the caller needs; a shutdown failure rides along.
        try:
            self.shutdown()
        except Exception as cleanup_error:
            log.exception("shutdown failed while handling %r", exc)
            exc.add_note(f"shutdown also failed: {cleanup_error!r}")


class OffloadingManager(ShutdownOnExit, ABC):
    """Scheduler-side bookkeeping of offloaded blocks.

    Every call except ``shutdown`` must be made while holding ``lock`` (which is not
    reentrant); ``shutdown`` must be called without it.
    """

    @property
    def lock(self) -> AbstractContextManager[object]:
        return nullcontext()

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        """Whether ``key`` can be loaded now, later, or not at all."""

    @abstractmethod
    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> LoadStoreSpec:
        """Pin ``keys`` (all ``HIT``) until ``complete_load`` and say where they are."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        """Mark ``keys`` recently used."""

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext | None = None) -> None:
        """Unpin ``keys`` pinned by ``prepare_load``."""

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None
    ) -> PrepareStoreOutput | None:
        """Allocate room for the keys not stored yet (evicting if needed); ``None``: no room."""

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext | None = None, success: bool = True
    ) -> None:
        """Make stored keys readable, or forget them if the transfer failed."""

    def get_load_source(self, key: OffloadKey, req_context: ReqContext | None = None) -> CacheHitSource:
        """The tier a ``HIT`` came from; unknown unless a manager says otherwise."""
        return CacheHitSource.EXTERNAL_UNSPECIFIED

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """No more submit-side calls come for this request; transfers may still be in flight."""
        return None

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events since the last call (empty unless events are enabled)."""
        return ()

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The last call of a scheduler step: flush work deferred during the step."""
        return None

    def has_pending_work(self) -> bool:
        return False

    def reset_cache(self) -> None:
        """Forget every tracked block."""
        return None

    def on_reset_flushed(self) -> None:
        """Workers finished every job in flight at the last ``reset_cache``."""
        return None

    def get_stats(self) -> Any:
        """Metrics since the last call, or ``None`` when disabled."""
        return None

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """Info-metric labels, one mapping per series (see ``ConfigInfo``)."""
        return [{}]

    def shutdown(self) -> None:
        """Release everything this manager owns. Idempotent; call without holding ``lock``."""


class OffloadingWorker(ShutdownOnExit, ABC):
    """Worker-side mover of KV bytes between the GPU cache and an offload medium."""

    @abstractmethod
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        """Start copying GPU blocks out; the outcome comes from ``get_finished``."""

    @abstractmethod
    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec, expedited: bool = False
    ) -> bool:
        """Start copying blocks back into the GPU cache."""

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs that completed since the last call, each reported once."""

    @abstractmethod
    def wait(self, job_ids: set[int]) -> None:
        """Block until the given jobs have completed (they are still reported by ``get_finished``)."""

    def shutdown(self) -> None:
        """Stop transfers and release every buffer and region. Idempotent."""


class OffloadingSpec(ABC):
    """What a connector builds from an ``OffloadingConfig``: the manager and the workers."""

    @classmethod
    def build_metric_definitions(cls, extra_config: Mapping[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {}

    @classmethod
    def config_info_keys(cls, extra_config: Mapping[str, Any]) -> tuple[str, ...]:
        """The info-metric labels the manager fills (see ``ConfigInfo``)."""
        return ()

    def __init__(self, config: OffloadingConfig) -> None:
        self.config = config
        self.extra_config = config.extra_config
        self.replicated_layout: bool = False
        self.kv_events_config = OffloadingKVEventsConfig(
            enable_kv_cache_events=config.enable_kv_cache_events,
            self_describing_kv_events=bool(self.extra_config.get("self_describing_kv_events", False)),
        )
        self.offload_prompt_only: bool = bool(self.extra_config.get("offload_prompt_only", True))
        self.tokens_per_block = tuple(group.tokens_per_block for group in config.groups)
        self.tokens_per_hash = config.cache.tokens_per_hash
        self.blocks_per_chunk = config.cache.blocks_per_chunk

    @abstractmethod
    def get_manager(self) -> OffloadingManager:
        """The scheduler side's manager."""

    @abstractmethod
    def get_worker(self, kv_caches: Any) -> OffloadingWorker:
        """One worker's mover of KV bytes."""


__all__ = [
    "BlockIDsLoadStoreSpec",
    "CacheHitSource",
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "CanonicalPageMapping",
    "ConfigInfo",
    "ConfigInfoMapping",
    "CopyRun",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "Locality",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingCounterMetadata",
    "OffloadingEvent",
    "OffloadingGaugeMetadata",
    "OffloadingHistogramMetadata",
    "OffloadingKVEventsConfig",
    "OffloadingManager",
    "OffloadingMetricMetadata",
    "OffloadingSpec",
    "OffloadingWorker",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestOffloadingContext",
    "ScheduleEndContext",
    "TierFilter",
    "TierMatcher",
    "TransferResult",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]
