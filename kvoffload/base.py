"""The offloading vocabulary shared by managers, tiers and workers (vLLM's ``kv_offload/base.py``).

Two sides talk through these types. The scheduler side owns an ``OffloadingManager``:
it decides where each KV block lives (``lookup``, ``prepare_store``, ``prepare_load``)
and hands ``LoadStoreSpec`` pairs to the workers. The worker side owns an
``OffloadingWorker``: it moves the bytes and reports a ``TransferResult`` per job.

A block is named by an ``OffloadKey``: the block hash followed by the KV-cache group
index as 4 bytes, big-endian, unsigned, so one hash stored for two groups is two keys.

Nothing here imports torch or numpy: the CLI imports this module on every Tab press.
Block ids are therefore plain tuples of ints, where vLLM keeps numpy arrays.
"""

from __future__ import annotations

import enum
import logging
import operator
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from types import TracebackType
from typing import ClassVar, NewType, Self

from kvoffload.errors import ConfigError

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


class OffloadPolicy(enum.Enum):
    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


@dataclass(frozen=True, slots=True)
class RequestOffloadingContext:
    """What a manager tells the scheduler about a new request."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


@dataclass(slots=True)
class ReqContext:
    """The request a manager call is made for (vLLM's, without the per-type scratch state)."""

    req_id: str
    kv_transfer_params: Mapping[str, object] | None = None


class LoadStoreSpec:
    """Where the blocks of one transfer side live. Subclasses name their medium."""

    __slots__ = ()
    MEDIUM: ClassVar[Medium]

    @classmethod
    def medium(cls) -> Medium:
        return cls.MEDIUM


@dataclass(frozen=True, slots=True)
class BlockIDsLoadStoreSpec(LoadStoreSpec):
    """A transfer side addressed by block ids, in transfer order."""

    block_ids: tuple[int, ...]

    def __init__(self, block_ids: Iterable[int]) -> None:
        ids = tuple(operator.index(b) for b in block_ids)
        negative = [b for b in ids if b < 0]
        if negative:
            raise ConfigError("block_ids", f"ids must be non-negative, got {negative[:4]}")
        object.__setattr__(self, "block_ids", ids)

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True, slots=True, init=False)
class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU KV-cache block ids (one per block of the transfer)."""

    MEDIUM: ClassVar[Medium] = Medium.GPU


@dataclass(frozen=True, slots=True, init=False)
class CPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """CPU region chunk ids; one chunk holds ``blocks_per_chunk`` GPU blocks."""

    MEDIUM: ClassVar[Medium] = Medium.CPU

    @property
    def chunk_ids(self) -> tuple[int, ...]:
        return self.block_ids


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided: which keys to write where, and what it evicted for them."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    """Blocks that became available (``removed=False``) or went away in ``medium``.

    ``metadata_only``: the blocks were never readable (a store that failed), so consumers
    that only track stored bytes can skip the event.
    """

    keys: tuple[OffloadKey, ...]
    medium: Medium
    removed: bool
    metadata_only: bool = False


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

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        return None

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Events since the last call (empty unless events are enabled)."""
        return ()

    def has_pending_work(self) -> bool:
        return False

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


__all__ = [
    "BlockIDsLoadStoreSpec",
    "CPULoadStoreSpec",
    "GPULoadStoreSpec",
    "LoadStoreSpec",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingEvent",
    "OffloadingManager",
    "OffloadingWorker",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestOffloadingContext",
    "TransferResult",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]
