"""Secondary tier types and the factory that builds them from ``secondary_tiers`` entries.

An entry is a JSON object: ``type`` picks the class (``example``, ``fs``, or an
out-of-tree class name together with ``module_path``); every other key is a constructor
option of that class. Options are checked against the constructor before it runs, so
a typo is a ``ConfigError`` naming ``secondary_tiers[i].<key>``, not a ``TypeError``.

Built in:

* ``example``: an in-memory dict of chunk bytes (``custom_param: int = 0``), vLLM's
  reference tier; everything completes inside ``submit_*``.
* ``fs``: one file per key under ``root_dir``, written by a thread pool to a temporary
  name and ``os.replace``-d into place, so a reader never sees half a chunk.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import tempfile
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import ClassVar

from kvoffload.base import LookupResult, OffloadKey, get_offload_block_hash, get_offload_group_idx
from kvoffload.errors import ConfigError
from kvoffload.tiering.base import JobResult, SecondaryTierManager, TransferJob

log = logging.getLogger(__name__)

#: The ``type`` values accepted without a ``module_path``.
KNOWN_TIER_TYPES = ("example", "fs")


class ExampleSecondaryTierManager(SecondaryTierManager):
    """An in-memory tier: a dict from key to a copy of the chunk's bytes."""

    def __init__(
        self,
        offloading_spec: object,
        primary_kv_view: memoryview,
        tier_type: str = "example",
        custom_param: int = 0,
        **unknown: object,
    ) -> None:
        if unknown:
            raise ConfigError(
                sorted(unknown)[0],
                f"unknown option for secondary tier type {tier_type!r}",
                fix="the example tier accepts only custom_param",
            )
        if isinstance(custom_param, bool) or not isinstance(custom_param, int):
            raise ConfigError("custom_param", f"must be an integer, got {custom_param!r}")
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self.custom_param = custom_param
        self._chunks: dict[OffloadKey, bytes] = {}
        self._finished: list[JobResult] = []
        self._closed = False

    @property
    def num_stored(self) -> int:
        return len(self._chunks)

    def lookup(self, key: OffloadKey) -> LookupResult:
        return LookupResult.HIT if key in self._chunks else LookupResult.MISS

    def submit_store(self, job: TransferJob) -> bool:
        if self._closed:
            return False
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            with self.chunk_buffer(chunk_id) as chunk:
                self._chunks[key] = chunk.tobytes()
        self._finished.append(JobResult(job.job_id, True))
        return True

    def submit_load(self, job: TransferJob) -> bool:
        if self._closed:
            return False
        if any(key not in self._chunks for key in job.keys):
            self._finished.append(JobResult(job.job_id, False))
            return True
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            with self.chunk_buffer(chunk_id) as chunk:
                chunk[:] = self._chunks[key]
        self._finished.append(JobResult(job.job_id, True))
        return True

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished, self._finished = self._finished, []
        return finished

    def drain_jobs(self) -> None:
        return None  # every job finished inside submit_*

    def shutdown(self) -> None:
        self._closed = True
        self._chunks.clear()


class FileSystemTierManager(SecondaryTierManager):
    """A directory of chunk files: ``{root_dir}/{hash[:2]}/{hash}_g{group}.bin``.

    Stores and loads run on separate thread pools. A file is complete or absent: it is
    written under a temporary name in the same directory and renamed over the final
    name. A file whose size is not the chunk size (another layout wrote it) fails the load.
    """

    def __init__(
        self,
        offloading_spec: object,
        primary_kv_view: memoryview,
        tier_type: str = "fs",
        *,
        root_dir: str,
        n_read_threads: int = 4,
        n_write_threads: int = 4,
    ) -> None:
        if not isinstance(root_dir, str) or not root_dir:
            raise ConfigError("root_dir", "must be a non-empty path", fix="point it at a writable directory")
        for name, value in (("n_read_threads", n_read_threads), ("n_write_threads", n_write_threads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self.root_dir = Path(root_dir)
        try:
            self.root_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError("root_dir", f"cannot create {self.root_dir}: {e.strerror}") from e
        self._jobs: dict[int, tuple[Future[bool], frozenset[OffloadKey]]] = {}
        # Only the manager's thread (holding its lock) touches these; the pools only copy.
        self._storing: dict[OffloadKey, int] = {}  # key -> stores in flight
        self._readers = ThreadPoolExecutor(n_read_threads, thread_name_prefix="kvoffload_fs_read")
        self._writers = ThreadPoolExecutor(n_write_threads, thread_name_prefix="kvoffload_fs_write")
        self._closed = False

    def path_of(self, key: OffloadKey) -> Path:
        digest = get_offload_block_hash(key).hex()
        return self.root_dir / digest[:2] / f"{digest}_g{get_offload_group_idx(key)}.bin"

    def lookup(self, key: OffloadKey) -> LookupResult:
        if key in self._storing:
            return LookupResult.HIT_PENDING
        return LookupResult.HIT if self.path_of(key).is_file() else LookupResult.MISS

    def _write(self, job: TransferJob) -> bool:
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            path = self.path_of(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f, self.chunk_buffer(chunk_id) as chunk:
                    f.write(chunk)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return True

    def _read(self, job: TransferJob) -> bool:
        for key, chunk_id in zip(job.keys, job.chunk_ids, strict=True):
            path = self.path_of(key)
            with open(path, "rb") as f, self.chunk_buffer(chunk_id) as chunk:
                if os.fstat(f.fileno()).st_size != len(chunk):
                    log.warning("%s is not %d bytes: written with another layout", path, len(chunk))
                    return False
                if f.readinto(chunk) != len(chunk):
                    return False
        return True

    def _submit(self, job: TransferJob, store: bool) -> bool:
        if self._closed:
            return False
        keys = frozenset(job.keys) if store else frozenset()
        for key in keys:
            self._storing[key] = self._storing.get(key, 0) + 1
        pool, fn = (self._writers, self._write) if store else (self._readers, self._read)
        self._jobs[job.job_id] = (pool.submit(fn, job), keys)
        return True

    def submit_store(self, job: TransferJob) -> bool:
        return self._submit(job, store=True)

    def submit_load(self, job: TransferJob) -> bool:
        return self._submit(job, store=False)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id, (future, keys) in list(self._jobs.items()):
            if not future.done():
                continue
            del self._jobs[job_id]
            for key in keys:
                left = self._storing.pop(key) - 1
                if left:
                    self._storing[key] = left
            error = None if future.cancelled() else future.exception()
            if error is not None:
                log.warning("fs tier job %d failed: %r", job_id, error)
            results.append(JobResult(job_id, not future.cancelled() and error is None and future.result()))
        return results

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        wait([future for future, _ in self._jobs.values()])

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Copies in flight hold slices of the primary view; wait for them so none outlives us.
        self._writers.shutdown(wait=True, cancel_futures=True)
        self._readers.shutdown(wait=True, cancel_futures=True)


class SecondaryTierFactory:
    """Builds secondary tiers from their ``secondary_tiers`` configuration entries."""

    _registry: ClassVar[dict[str, type[SecondaryTierManager]]] = {
        "example": ExampleSecondaryTierManager,
        "fs": FileSystemTierManager,
    }

    @classmethod
    def get_tier_class(
        cls, tier_config: Mapping[str, object], *, index: int = 0
    ) -> type[SecondaryTierManager]:
        where = f"secondary_tiers[{index}]"
        if not isinstance(tier_config, Mapping):
            raise ConfigError(where, f"must be an object, got {type(tier_config).__name__}")
        tier_type = tier_config.get("type")
        if not isinstance(tier_type, str) or not tier_type:
            raise ConfigError(
                f"{where}.type",
                "missing" if tier_type is None else f"must be a non-empty string, got {tier_type!r}",
                fix=f"set type to one of {', '.join(KNOWN_TIER_TYPES)}, or a class name with module_path",
            )
        known = cls._registry.get(tier_type)
        if known is not None:
            return known
        module_path = tier_config.get("module_path")
        if not module_path:
            raise ConfigError(
                f"{where}.type",
                f"unknown secondary tier type {tier_type!r}",
                fix=f"use one of {', '.join(KNOWN_TIER_TYPES)}; for an out-of-tree tier also set module_path",
            )
        if not isinstance(module_path, str):
            raise ConfigError(f"{where}.module_path", f"must be a string, got {module_path!r}")
        log.warning("Loading out-of-tree secondary tier %s from %s", tier_type, module_path)
        try:
            module = importlib.import_module(module_path)
        except (ImportError, TypeError) as e:  # TypeError: a relative name such as ".x"
            raise ConfigError(f"{where}.module_path", f"cannot import {module_path!r}: {e}") from e
        tier_cls = getattr(module, tier_type, None)
        if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTierManager)):
            raise ConfigError(
                f"{where}.type",
                f"{module_path}.{tier_type} is not a SecondaryTierManager subclass",
                fix=f"define class {tier_type}(kvoffload.tiering.base.SecondaryTierManager)",
            )
        return tier_cls

    @classmethod
    def create_secondary_tier(
        cls,
        tier_config: Mapping[str, object],
        primary_kv_view: memoryview,
        offloading_spec: object,
        *,
        index: int = 0,
    ) -> SecondaryTierManager:
        """Build entry ``index`` of ``secondary_tiers`` over the primary tier's view."""
        where = f"secondary_tiers[{index}]"
        tier_cls = cls.get_tier_class(tier_config, index=index)
        options = dict(tier_config)
        tier_type = str(options.pop("type"))
        options.pop("module_path", None)
        if options.pop("backpressure", None):
            raise ConfigError(
                f"{where}.backpressure",
                "backpressure detection is not implemented by kvoffload",
                fix="remove backpressure from the tier (and the top-level extra_config)",
            )
        cls._check_options(tier_cls, options, where)
        try:
            return tier_cls(
                offloading_spec=offloading_spec,
                primary_kv_view=primary_kv_view,
                tier_type=tier_type,
                **options,
            )
        except ConfigError as e:
            if e.key.startswith(where):
                raise
            raise ConfigError(f"{where}.{e.key}", e.message.removeprefix(f"{e.key}: "), fix=e.fix) from e

    @staticmethod
    def _check_options(
        tier_cls: type[SecondaryTierManager], options: Mapping[str, object], where: str
    ) -> None:
        params = inspect.signature(tier_cls).parameters
        reserved = {"offloading_spec", "primary_kv_view", "tier_type"}
        clashing = sorted(reserved & set(options))
        if clashing:
            raise ConfigError(
                f"{where}.{clashing[0]}", "is set by the tiering spec, not the tier configuration"
            )
        settable = [
            p.name
            for p in params.values()
            if p.name not in reserved and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        unknown = [] if takes_any else sorted(set(options) - set(settable))
        if unknown:
            raise ConfigError(
                f"{where}.{unknown[0]}",
                f"unknown option for secondary tier {tier_cls.__name__}",
                fix="accepted options: " + (", ".join(settable) or "none"),
            )
        missing = [p.name for p in params.values() if p.name in settable and p.default is p.empty]
        missing = [name for name in missing if name not in options]
        if missing:
            raise ConfigError(f"{where}.{missing[0]}", f"required by secondary tier {tier_cls.__name__}")
