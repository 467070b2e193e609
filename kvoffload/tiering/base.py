"""Secondary tiers: where the tiering manager copies CPU chunks to, and promotes them from.

A tier sees the primary (CPU) tier's region as one ``(num_chunks, row_stride)`` byte
memoryview. A ``TransferJob`` names keys and, for each, the primary chunk to copy from
(``submit_store``) or into (``submit_load``). The tiering manager keeps those chunks
pinned (store) or write-pending (load) until the tier reports the job's ``JobResult``,
so a tier may copy on its own threads and finish whenever it likes.

What a tier promises:

* every accepted job (``submit_*`` returned True) is reported by ``get_finished_jobs``
  exactly once; a rejected job (False) is never reported;
* after ``shutdown`` it holds no export of ``primary_kv_view``: the primary region can
  only be unmapped once nothing exports its buffer, which ``chunk_buffer`` makes easy by
  releasing its slice as soon as the copy is done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

from kvoffload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    ShutdownOnExit,
)
from kvoffload.errors import ConfigError


@dataclass(frozen=True, slots=True)
class TransferJob:
    """Copy ``keys[i]`` from or to primary chunk ``chunk_ids[i]``."""

    job_id: int
    keys: tuple[OffloadKey, ...]
    chunk_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.chunk_ids):
            raise ConfigError(
                "chunk_ids", f"job {self.job_id} has {len(self.keys)} keys but {len(self.chunk_ids)} chunks"
            )


@dataclass(frozen=True, slots=True)
class JobResult:
    job_id: int
    success: bool


class SecondaryTierManager(ShutdownOnExit, ABC):
    """One secondary tier under a ``TieringOffloadingManager``.

    Tiers are called with the tiering manager's lock held. A tier that may be polled
    from the manager's background thread sets ``tolerates_off_thread_polling``.
    """

    tolerates_off_thread_polling: ClassVar[bool] = False
    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: object, primary_kv_view: memoryview, tier_type: str) -> None:
        shape, strides = primary_kv_view.shape, primary_kv_view.strides
        if (
            shape is None
            or strides is None
            or len(shape) != 2
            or primary_kv_view.format != "B"
            or not primary_kv_view.c_contiguous
        ):
            raise ConfigError(
                "primary_kv_view",
                f"expected a C-contiguous (num_chunks, row_stride) byte view, got shape "
                f"{shape} format {primary_kv_view.format!r}",
            )
        self.offloading_spec = offloading_spec
        self.primary_kv_view = primary_kv_view
        self.tier_type = tier_type
        self.num_chunks: int = shape[0]
        self.block_size_bytes: int = strides[0]

    @contextmanager
    def chunk_buffer(self, chunk_id: int) -> Iterator[memoryview]:
        """The bytes of primary chunk ``chunk_id``, writable, released on exit."""
        if not 0 <= chunk_id < self.num_chunks:
            raise ConfigError("chunk_ids", f"chunk {chunk_id} is outside 0..{self.num_chunks - 1}")
        start = chunk_id * self.block_size_bytes
        # A 2-D memoryview cannot hand out rows; a flat cast can, and both are released here.
        with self.primary_kv_view.cast("B") as flat, flat[start : start + self.block_size_bytes] as chunk:
            yield chunk

    @abstractmethod
    def lookup(self, key: OffloadKey) -> LookupResult:
        """``HIT``: loadable now; ``HIT_PENDING``/``RETRY``: ask again later; ``MISS``: not here."""

    @abstractmethod
    def submit_store(self, job: TransferJob) -> bool:
        """Copy the job's primary chunks into this tier; False rejects the job."""

    @abstractmethod
    def submit_load(self, job: TransferJob) -> bool:
        """Copy the job's keys into their primary chunks; False rejects the job."""

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call, each reported once."""

    @abstractmethod
    def drain_jobs(self) -> None:
        """Block until every accepted job has finished (results stay for ``get_finished_jobs``)."""

    def has_pending_work(self) -> bool:
        return False

    def take_events(self) -> Iterable[OffloadingEvent]:
        return ()

    def touch(self, keys: Collection[OffloadKey]) -> None:
        return None

    def on_request_finished(self, req_context: ReqContext) -> None:
        return None

    def shutdown(self) -> None:
        """Stop and release everything, the exports of ``primary_kv_view`` first. Idempotent."""
