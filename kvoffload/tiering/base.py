"""Secondary tiers: where the tiering manager copies CPU chunks to, and promotes them from.

This is vLLM 0.33's secondary-tier contract, so a tier written for vLLM runs here
unchanged. A tier sees the primary (CPU) tier's region as one ``(num_chunks, row)``
memoryview, one chunk per row (int8 in vLLM; any item type works). A ``TransferJob``
names keys and, for each, the primary chunk to copy from (``submit_store``, a cascade)
or into (``submit_load``, a promotion). The tiering manager keeps those chunks pinned
(cascade) or write-pending (promotion) until the tier reports the job's ``JobResult``,
so a tier may copy on its own threads and finish whenever it likes.

What a tier promises:

* every submitted job is reported by ``get_finished_jobs`` exactly once, a failure
  included (``success=False``); ``submit_*`` return nothing and never block on the copy;
* ``drain_jobs`` returns only once no copy touches the primary view;
* after ``shutdown`` it holds no export of the primary view: the region can only be
  unmapped once nothing exports its buffer, which ``chunk_buffer`` makes easy by
  releasing its slice as soon as the copy is done.

What the manager promises a tier: every call is made with the manager's lock held (so
never two at once), per-request calls for a request stop before its
``on_request_finished``, and ``shutdown`` comes after the tier-poll thread has stopped.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from kvoffload.base import (
    CacheHitSource,
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    ShutdownOnExit,
)
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

    from kvoffload.base import OffloadingSpec
    from kvoffload.tiering.backpressure import BackpressureDetector

JobId = int

#: The label naming a tier on every tiering metric and info series.
TIER_LABEL = "tier"


class TieringOffloadingMetrics:
    """The names of the metrics the tiering manager emits (vLLM's names, for its dashboards)."""

    LOOKUP_SYNC_DELAY = "vllm:kv_offload_tiering_lookup_sync_delay_seconds"
    LOOKUP_ASYNC_DELAY = "vllm:kv_offload_tiering_lookup_async_delay_seconds"
    READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
    READ_TIME = "vllm:kv_offload_tiering_read_time"
    WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
    WRITE_TIME = "vllm:kv_offload_tiering_write_time"
    PROMOTION_JOB_FAILURES = "vllm:kv_offload_tiering_promotion_job_failures"
    CASCADE_JOB_FAILURES = "vllm:kv_offload_tiering_cascade_job_failures"
    CHUNK_QUERIES = "vllm:kv_offload_tiering_chunk_queries"
    CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
    PRIMARY_WRITE_USAGE_PERC = "vllm:kv_offload_tiering_primary_write_usage_perc"
    PRIMARY_READ_USAGE_PERC = "vllm:kv_offload_tiering_primary_read_usage_perc"
    PROMOTION_ALLOCATION_FAILURES = "vllm:kv_offload_tiering_promotion_allocation_failures"
    ACTIVE_PROMOTION_JOBS = "vllm:kv_offload_tiering_active_promotion_jobs"
    ACTIVE_CASCADE_JOBS = "vllm:kv_offload_tiering_active_cascade_jobs"
    BACKPRESSURE_STORE_LATENCY_EMA = "vllm:kv_offload_tiering_backpressure_store_latency_ema"
    BACKPRESSURE_STORES_DROPPED = "vllm:kv_offload_tiering_backpressure_stores_dropped"
    BACKPRESSURE_BLOCKS_DROPPED = "vllm:kv_offload_tiering_backpressure_blocks_dropped"
    PROMOTION_LATENCY = "vllm:kv_offload_tiering_promotion_latency_seconds"


@dataclass
class TransferJob:
    """Copy ``keys[i]`` from (cascade) or to (promotion) primary chunk ``chunk_ids[i]``.

    ``chunk_ids`` is a numpy integer array (vLLM's type; numpy is not imported to make
    one here). ``submit_time`` is when the job was made, for latency metrics and
    back-pressure.
    """

    job_id: JobId
    keys: Collection[OffloadKey]
    chunk_ids: np.ndarray
    is_promotion: bool
    req_context: ReqContext
    submit_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        # A mismatch would copy one key's bytes under another key: refuse it at the source.
        if len(self.keys) != len(self.chunk_ids):
            raise ConfigError(
                "chunk_ids",
                f"job {self.job_id} has {len(self.keys)} keys but {len(self.chunk_ids)} chunk ids",
            )


@dataclass(frozen=True)
class JobResult:
    """How one job ended.

    ``success``: every key made it. For a promotion that failed part-way,
    ``successful_keys`` names the keys that did land (a subset of the job's keys);
    ``None`` means all keys share ``success``. ``transfer_time`` and ``transfer_bytes``
    are optional measurements of the copy itself, for metrics and back-pressure.
    """

    job_id: JobId
    success: bool
    successful_keys: Collection[OffloadKey] | None = None
    transfer_time: float | None = None
    transfer_bytes: int | None = None


class ParentManager(ABC):
    """The tiering manager as a tier serving remote requests sees it.

    Handed to ``serve_external_requests`` and valid only for that call, with the
    manager's lock held throughout, so a ``HIT`` from ``lookup`` stays valid until
    ``create_store_job`` pins it. The calling tier is left out of every fan-out. For
    each remote request, in order: ``on_new_request``, then ``lookup`` per chunk and
    ``create_store_job`` (interleaved as needed), then always ``on_request_finished``,
    even when nothing was found, so per-request state never leaks.
    """

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext: ...

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult: ...

    @abstractmethod
    def create_store_job(self, keys: Collection[OffloadKey], req_context: ReqContext) -> TransferJob: ...

    @abstractmethod
    def on_request_finished(self, req_context: ReqContext) -> None: ...


class SecondaryTierManager(ShutdownOnExit, ABC):
    """One secondary tier under a ``TieringOffloadingManager``.

    Every method runs on the scheduler side, under the manager's lock, and must not
    block on I/O: ``submit_*`` start a copy, ``get_finished_jobs`` reports it. A tier
    that sets ``tolerates_off_thread_polling`` is also polled and served from the
    manager's tier-poll thread between steps, so no tier may keep per-thread state.
    """

    medium: ClassVar[Medium | None] = None
    #: What a hit served from this tier counts as; derived from ``medium`` unless set.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    #: Opt in to being polled and served from the tier-poll thread, between steps.
    tolerates_off_thread_polling: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "cache_hit_source" not in cls.__dict__ and cls.medium is not None:
            derived = {Medium.CPU: CacheHitSource.HOST, Medium.STORAGE: CacheHitSource.DISK}.get(cls.medium)
            if derived is not None:
                cls.cache_hit_source = derived

    def __init__(
        self,
        offloading_spec: OffloadingSpec | Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        # A real memoryview is checked now, so a wrong layout fails at start-up and not
        # in the first copy; anything else (a stand-in in a test) is taken as it is. Only
        # the layout matters: a row is one chunk, whatever the item type (int8 in vLLM).
        if isinstance(primary_kv_view, memoryview):
            shape = primary_kv_view.shape
            if shape is None or len(shape) != 2 or not primary_kv_view.c_contiguous:
                raise ConfigError(
                    "primary_kv_view",
                    f"expected a C-contiguous (num_chunks, row) view, got shape {shape} "
                    f"{'' if primary_kv_view.c_contiguous else 'non-contiguous '}"
                    f"format {primary_kv_view.format!r}",
                )
        strides = primary_kv_view.strides
        if strides is None:
            raise ConfigError("primary_kv_view", "the view has no strides")
        self._offloading_spec = offloading_spec
        self._primary_kv_view = primary_kv_view
        self._block_size_bytes: int = strides[0]
        self.tier_type = tier_type
        self.locality: Locality | None = None
        self._bp_detector = backpressure_detector

    @property
    def block_size_bytes(self) -> int:
        """Bytes in one primary chunk (the view's row stride)."""
        return self._block_size_bytes

    @property
    def bp_detector(self) -> BackpressureDetector | None:
        return self._bp_detector

    @property
    def num_chunks(self) -> int:
        """Chunks in the primary view."""
        shape = self._primary_kv_view.shape
        return int(shape[0]) if shape else 0

    @contextmanager
    def chunk_buffer(self, chunk_id: int) -> Iterator[memoryview]:
        """The bytes of primary chunk ``chunk_id``, writable, released on exit."""
        chunk_id = int(chunk_id)
        if not 0 <= chunk_id < self.num_chunks:
            raise ConfigError("chunk_ids", f"chunk {chunk_id} is outside 0..{self.num_chunks - 1}")
        start = chunk_id * self._block_size_bytes
        # A 2-D memoryview cannot hand out rows; a flat cast can, and both are released here.
        with (
            self._primary_kv_view.cast("B") as flat,
            flat[start : start + self._block_size_bytes] as chunk,
        ):
            yield chunk

    # ----------------------------------------------------------------- the copies

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """``HIT``: loadable now; ``RETRY``: being written or looked up, ask later; ``MISS``."""

    @abstractmethod
    def submit_store(self, job_metadata: TransferJob) -> None:
        """Start copying the job's primary chunks into this tier (skipping keys it holds)."""

    @abstractmethod
    def submit_load(self, job_metadata: TransferJob) -> None:
        """Start copying the job's keys into their (allocated, write-pending) primary chunks."""

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs finished since the last call, loads and stores, each reported once."""

    @abstractmethod
    def drain_jobs(self) -> None:
        """Block until every submitted job has finished; results stay for ``get_finished_jobs``.

        A copy in flight is never cut short (half a chunk would corrupt one side); a
        queued one may be cancelled, and is then reported as failed.
        """

    def has_pending_work(self) -> bool:
        """True while the engine must keep stepping for this tier's sake."""
        return False

    def take_events(self) -> Iterable[OffloadingEvent]:
        """KV events for what this tier stores."""
        return ()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Mark ``keys`` recently used."""
        return None

    # ----------------------------------------------------------------- the request lifecycle

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """This tier's offload policy for a request the scheduler has just seen."""

    def on_request_finished(self, req_context: ReqContext) -> None:
        """No more ``submit_*``/``touch`` for this request (its jobs may still be in flight)."""
        return None

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Serve requests from a counterpart the engine does not drive (a peer) via ``parent``.

        Called once per step, before that step's promotions are submitted, and per
        tier-poll round when the tier opted in. Must not release the manager's lock.
        """
        return None

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        """The end of a scheduler step."""
        return None

    def shutdown(self) -> None:
        """Stop and release everything, the exports of the primary view first. Idempotent."""
        return None

    # ----------------------------------------------------------------- metrics

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The metrics this tier emits, by name."""
        return {}

    def get_stats(self) -> Any:
        """Metric observations since the last call (vLLM's ``OffloadingConnectorStats``), or ``None``."""
        return None

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        """The info-metric label names this tier fills; never ``TIER_LABEL``, which the manager adds."""
        return ()

    def config_info(self) -> ConfigInfoMapping:
        """This tier's info-metric labels, for its one series."""
        return {}
