"""``ExampleSecondaryTierManager``: vLLM's reference tier, an in-memory dict.

Every job finishes inside ``submit_*``, so the tier is the smallest complete instance of
the contract in ``tiering/base.py`` and a convenient tier for tests. Unlike vLLM's, which
records only that a key is present, it keeps a copy of each chunk's bytes and writes them
back on promotion, so a round trip through it can be checked byte for byte. A key marked
present by hand (``chunks[key] = True``, as vLLM's tests do) has no copy; loading it
succeeds and leaves the primary chunk as it was, as vLLM's tier does for every key.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from kvoffload.base import (
    ConfigInfo,
    ConfigInfoMapping,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from kvoffload.errors import ConfigError
from kvoffload.tiering.base import JobResult, SecondaryTierManager, TransferJob

if TYPE_CHECKING:
    from kvoffload.base import OffloadingSpec
    from kvoffload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExampleTierInfo(ConfigInfo):
    """The example tier's one info label (the manager adds the tier label)."""

    example_info: int


class ExampleSecondaryTierManager(SecondaryTierManager):
    """An in-memory tier: ``chunks`` says what it holds, a private dict holds the bytes."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: OffloadingSpec | Any,
        primary_kv_view: memoryview,
        tier_type: str,
        custom_param: int = 0,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        if isinstance(custom_param, bool) or not isinstance(custom_param, int):
            raise ConfigError("custom_param", f"must be an integer, got {custom_param!r}")
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        self.custom_param = custom_param
        self._config_info = ExampleTierInfo(example_info=custom_param)
        self.chunks: dict[OffloadKey, bool] = {}
        self._copies: dict[OffloadKey, bytes] = {}
        self.completed_jobs: list[JobResult] = []
        self._closed = False
        log.info("ExampleSecondaryTierManager initialized with custom_param=%d", custom_param)

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ExampleTierInfo.config_info_keys()

    def config_info(self) -> ConfigInfoMapping:
        return self._config_info.as_config_info()

    def get_num_chunks(self) -> int:
        """How many keys the tier holds."""
        return len(self.chunks)

    @property
    def num_stored(self) -> int:
        return len(self.chunks)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.chunks else LookupResult.MISS

    def _has_views(self) -> bool:
        # A stand-in view (a test's mock) has no bytes to copy; presence is all it keeps.
        return isinstance(self._primary_kv_view, memoryview)

    def submit_store(self, job_metadata: TransferJob) -> None:
        if self._closed:  # still reported: every job is, exactly once
            self.completed_jobs.append(JobResult(job_id=job_metadata.job_id, success=False))
            return
        copy = self._has_views()
        for key, chunk_id in zip(job_metadata.keys, job_metadata.chunk_ids, strict=True):
            if copy:
                with self.chunk_buffer(chunk_id) as chunk:
                    self._copies[key] = chunk.tobytes()
            self.chunks[key] = True
        self.completed_jobs.append(JobResult(job_id=job_metadata.job_id, success=True, transfer_time=0.0))

    def submit_load(self, job_metadata: TransferJob) -> None:
        if self._closed or any(key not in self.chunks for key in job_metadata.keys):
            self.completed_jobs.append(JobResult(job_id=job_metadata.job_id, success=False))
            return
        copy = self._has_views()
        for key, chunk_id in zip(job_metadata.keys, job_metadata.chunk_ids, strict=True):
            data = self._copies.get(key)
            if copy and data is not None:
                with self.chunk_buffer(chunk_id) as chunk:
                    chunk[:] = data
        self.completed_jobs.append(JobResult(job_id=job_metadata.job_id, success=True, transfer_time=0.0))

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self.completed_jobs = self.completed_jobs, []
        return finished

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        return None  # every job finished inside submit_*

    def shutdown(self) -> None:
        self._closed = True
        self.chunks.clear()
        self._copies.clear()
