"""FileSystemTierManager: a secondary tier of one file per KV block under ``root_dir``.

Layout (``kvoffload.file_mapper``, vLLM's byte for byte)::

    <root_dir>/<model>_<digest>/config.json
    <root_dir>/<model>_<digest>_r<rank>/<h[:3]>/<h[3:5]>_g<group>/<h>.bin

so engines that share ``root_dir`` (a PVC, an NFS export), kvoffload's or vLLM's, share
blocks whenever their layouts agree. Block names are content hashes: a block is written
once and never changes. Sharing across engines needs the same chain-hash seed on each
(``PYTHONHASHSEED``, and a cryptographic prefix-caching hash).

The scheduler thread never touches the disk:

* ``lookup`` asks an ``AsyncLookupManager`` whose worker ``stat``s the block files: a
  key first asked this step reads ``RETRY``, then ``HIT`` or ``MISS`` from a later step;
* ``submit_store``/``submit_load`` queue one batched task per job on a
  ``DualQueueThreadPool`` (loads first on the read threads, stores first on the write
  threads); ``get_finished_jobs`` reports what the threads finished.

A promotion that fails part-way reports the keys loaded before the failing block as
``successful_keys``; the failing block and those after it are marked a miss in the
lookup cache, so the request recomputes them instead of asking for the same load again.

Direct I/O (``O_DIRECT``) is used when the directory takes it and the primary view is
page-aligned (its start and its row stride); otherwise buffered I/O, with one warning.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno as errno_
import functools
import json
import logging
import os
from collections.abc import Iterable
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, ClassVar

from kvoffload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from kvoffload.errors import ConfigError, TierIOError
from kvoffload.file_mapper import FileMapper
from kvoffload.tiering.async_lookup import AsyncLookupManager
from kvoffload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from kvoffload.tiering.fs.io import DIRECT_IO_ALIGNMENT, batch_load_block, batch_store_block, probe_o_direct
from kvoffload.tiering.fs.thread_pool import DualQueueThreadPool

if TYPE_CHECKING:
    from kvoffload.base import OffloadingSpec
    from kvoffload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

#: kvoffload has no C extension for lookups; kept so callers written for vLLM can ask.
_HAS_BATCH_LOOKUP_C = False


class FsAsyncLookupManager(AsyncLookupManager):
    """Probes block files for a ``FileSystemTierManager``, off the scheduler thread."""

    def __init__(self, tier: FileSystemTierManager, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        mapper = self._tier.file_mapper
        return [os.path.exists(mapper.get_file_name(key)) for key in keys]


def _locality(value: str | None) -> Locality | None:
    if value is None:
        return None
    try:
        return Locality(value)
    except ValueError:
        raise ConfigError(
            "locality",
            f"{value!r} is not a Locality",
            fix=f"use one of {', '.join(m.value for m in Locality)} (upper case)",
        ) from None


def _view_is_aligned(view: memoryview, block_size: int) -> bool:
    """Whether every block of ``view`` starts on a direct-I/O boundary and is a whole number of pages."""
    if block_size % DIRECT_IO_ALIGNMENT:
        return False
    try:
        with view.cast("B") as flat:
            anchor = ctypes.c_char.from_buffer(flat)
            address = ctypes.addressof(anchor)
            del anchor  # the export of the view goes with it
    except (TypeError, ValueError):
        return False  # read-only or not a plain buffer: no direct I/O
    return address % DIRECT_IO_ALIGNMENT == 0


class FileSystemTierManager(SecondaryTierManager):
    """Stores primary chunks as block files under ``root_dir`` (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec | Any,
        primary_kv_view: memoryview,
        tier_type: str,
        root_dir: str,
        n_read_threads: int = 16,
        n_write_threads: int = 16,
        enable_kv_events: bool = False,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        if not root_dir:
            # Checked here, not in FileMapper: vLLM's p2p and object tiers map names with an
            # empty root and never write; this tier would put its namespace at "/".
            raise ConfigError("root_dir", "must be a non-empty path", fix="point it at a writable directory")
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = _locality(locality)
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events:
            if offloading_spec.kv_events_config.enable_kv_cache_events:
                self.events = []
            else:
                log.warning(
                    "secondary tier %r: enable_kv_events is set but KV cache events are off "
                    "(kv_events_config); the tier emits none",
                    tier_type,
                )
        self._block_size: int = self.block_size_bytes
        # Per job in flight: its keys (stores only when events are on; every load, so a
        # failed one can mark its own keys a miss) and its block count, for transfer_bytes.
        self._store_job_keys: dict[JobId, list[OffloadKey]] = {}
        self._load_job_keys: dict[JobId, list[OffloadKey]] = {}
        self._job_block_counts: dict[JobId, int] = {}
        # Written by a pool thread before its job is published as finished, read by the
        # scheduler only for jobs get_finished returned: the pool's lock orders the two.
        self._load_progress: dict[JobId, int] = {}
        self._closed = False

        with ExitStack() as undo:
            # The pool first: it checks the thread counts before anything lands on disk.
            self._pool = DualQueueThreadPool(n_read_threads, n_write_threads, "kvoffload_fs")
            undo.callback(self._pool.shutdown)
            self.file_mapper = FileMapper.from_offloading_spec(
                root_dir=root_dir,
                offloading_spec=offloading_spec,
                blocks_per_file=offloading_spec.blocks_per_chunk,
                parallel_agnostic=True,
            )
            self._write_run_config()
            self._use_o_direct = self._choose_o_direct(root_dir)
            self._lookup_manager = FsAsyncLookupManager(tier=self, tier_type=tier_type)
            undo.pop_all()

    def _choose_o_direct(self, root_dir: str) -> bool:
        if not probe_o_direct(os.path.dirname(self.file_mapper.get_config_file_path())):
            log.warning(
                "secondary tier %r: %s takes no O_DIRECT; using buffered I/O", self.tier_type, root_dir
            )
            return False
        if not _view_is_aligned(self._primary_kv_view, self._block_size):
            log.warning(
                "secondary tier %r: the primary view is not page-aligned (block size %d); using buffered I/O",
                self.tier_type,
                self._block_size,
            )
            return False
        return True

    def _write_run_config(self) -> None:
        """Write ``config.json`` once per namespace, atomically (engines may start together)."""
        path = self.file_mapper.get_config_file_path()
        tmp = f"{path}.{os.getpid()}.{id(self):x}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.exists(path):
                return
            with open(tmp, "x", encoding="utf-8") as f:
                json.dump(self.file_mapper.get_run_config(), f, indent=2, sort_keys=True)
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise TierIOError(
                path,
                f"cannot create the fs tier's namespace: {e.strerror or e}",
                errno=e.errno,
                fix=_namespace_fix(e.errno, os.path.dirname(path)),
            ) from e

    # ----------------------------------------------------------------- lookups

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookup_manager.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookup_manager.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookup_manager.cleanup(req_context.req_id)

    # ----------------------------------------------------------------- copies

    def _offsets(self, job: TransferJob) -> list[int]:
        return [int(chunk_id) * self._block_size for chunk_id in job.chunk_ids]

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        if self.events is not None:
            self._store_job_keys[job_metadata.job_id] = keys
        self._job_block_counts[job_metadata.job_id] = len(keys)
        task = functools.partial(
            batch_store_block,
            [self.file_mapper.get_file_name(key) for key in keys],
            self._primary_kv_view,
            self._offsets(job_metadata),
            self._block_size,
            self._use_o_direct,
        )
        self._pool.enqueue_store(job_metadata.job_id, 1, [task])

    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        keys = list(job_metadata.keys)
        self._load_job_keys[job_id] = keys
        self._job_block_counts[job_id] = len(keys)
        paths = [self.file_mapper.get_file_name(key) for key in keys]
        offsets = self._offsets(job_metadata)

        def load() -> None:
            try:
                batch_load_block(paths, self._primary_kv_view, offsets, self._block_size, self._use_o_direct)
            except OSError as e:
                self._load_progress[job_id] = getattr(e, "num_succeeded", 0)
                raise

        self._pool.enqueue_load(job_id, 1, [load])

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id, success, transfer_time in self._pool.get_finished():
            blocks = self._job_block_counts.pop(job_id, 0)
            transfer_bytes = blocks * self._block_size if blocks else None
            stored = self._store_job_keys.pop(job_id, None)
            if self.events is not None and success and stored:
                self.events.append(
                    OffloadingEvent(keys=stored, medium=self.medium, removed=False, locality=self.locality)
                )
            loaded = self._load_job_keys.pop(job_id, None)
            num_succeeded = self._load_progress.pop(job_id, 0)
            successful_keys = None
            if loaded is not None and not success:
                # The blocks before the failing one are in the primary tier now: keep them.
                self._lookup_manager.mark_miss(loaded[num_succeeded:])
                successful_keys = tuple(loaded[:num_succeeded]) or None
            results.append(
                JobResult(
                    job_id=job_id,
                    success=success,
                    successful_keys=successful_keys,
                    transfer_time=transfer_time,
                    transfer_bytes=transfer_bytes,
                )
            )
        return results

    def has_pending_work(self) -> bool:
        # Chunks stay pinned until their job is reported: keep the engine stepping till then.
        return bool(self._job_block_counts)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def drain_jobs(self) -> None:
        self._pool.wait_idle()

    def shutdown(self) -> None:
        """Stop the lookups and the I/O threads; queued jobs are reported as failed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # Both always run: a failing lookup worker must not leave I/O threads copying.
        try:
            self._lookup_manager.shutdown()
        except Exception:
            log.exception("secondary tier %r: stopping the lookup worker failed", self.tier_type)
        finally:
            self._pool.shutdown(wait=True)


def _namespace_fix(code: int | None, directory: str) -> str:
    """The fix for the errno that refused the tier's namespace file (a full disk is not a
    permission problem, and a read-only mount is neither)."""
    if code in (errno_.ENOSPC, errno_.EDQUOT):
        return f"free space on the filesystem of {directory} (df {directory}), or point root_dir elsewhere"
    if code == errno_.EROFS:
        return f"{directory} is on a read-only mount: point root_dir at a writable filesystem"
    if code in (errno_.EACCES, errno_.EPERM):
        return f"give this user write access to {directory}, or point root_dir at a directory it owns"
    if code in (errno_.ENOTDIR, errno_.EEXIST):
        return f"a component of {directory} is a file, not a directory: point root_dir elsewhere"
    if code == errno_.EIO:
        return f"the storage under {directory} failed (see dmesg): point root_dir at another device"
    return "point root_dir at a writable directory on a working filesystem"
