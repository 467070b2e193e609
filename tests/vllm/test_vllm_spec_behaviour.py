"""The specs behave as vLLM 0.33's do where kvoffload used to differ.

Each test names one behaviour: where the worker's buffer lives and when replicated_layout
is honoured, empty caches, integral strings in the extra config, and the spec factory.
Every spec here is built from vLLM's ``OffloadingConfig``, as vLLM's connector builds it,
unless the test is about ``from_settings`` (``shmctl init``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvoffload import platforms
from kvoffload.base import OffloadingSpec
from kvoffload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvoffload.cpu.spec import CPUOffloadingSpec
from kvoffload.errors import ConfigError
from kvoffload.factory import OffloadingSpecFactory
from kvoffload.settings import PAGESIZE, OffloadingSettings
from kvoffload.tiering.spec import TieringOffloadingSpec


def vllm_config(
    engine_id: str,
    *,
    cpu_bytes_to_use: Any = 8 * PAGESIZE,
    worker_kv_bytes_per_block: int = PAGESIZE,
    world_size: int = 1,
    rank: int = 0,
    replicated_layout: bool = False,
    blocks_per_chunk: int = 1,
    **extra: Any,
) -> OffloadingConfig:
    """What vLLM's connector hands a spec (``build_offloading_config``), for one group."""
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer",), 0),),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": cpu_bytes_to_use, **extra},
        engine_id=engine_id,
        model=OffloadingModelConfig("model", "float16", max_model_len=1024),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig.tensor_parallel(rank, world_size),
        replicated_layout=replicated_layout,
    )


def settings(engine_id: str, root: Path, extra: dict[str, Any], **geometry: Any) -> OffloadingSettings:
    document = json.dumps({"engine_id": engine_id, "kv_connector_extra_config": extra})
    return OffloadingSettings.from_kv_transfer_config(
        document,
        worker_kv_bytes_per_block=geometry.pop("worker_kv_bytes_per_block", PAGESIZE),
        root=root,
        **geometry,
    )


@pytest.fixture
def rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process runs next to a ROCm GPU (current_platform is the documented seam)."""
    monkeypatch.setattr(platforms.current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(platforms.current_platform, "is_rocm", lambda: True)
    monkeypatch.setattr(platforms.current_platform, "is_xpu", lambda: False)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platforms.current_platform, "is_cuda_alike", lambda: True)
    monkeypatch.setattr(platforms.current_platform, "is_rocm", lambda: False)


# ------------------------------------------------------------------ replicated_layout


@pytest.mark.usefixtures("cuda")
def test_replicated_layout_keeps_one_copy_over_the_shared_region_on_cuda(engine_id: str) -> None:
    spec = CPUOffloadingSpec(vllm_config(engine_id, world_size=4, replicated_layout=True))
    assert spec.replicated_layout is True
    assert (spec.kv_bytes_per_chunk, spec.num_chunks) == (PAGESIZE, 8)


@pytest.mark.usefixtures("rocm")
def test_replicated_layout_is_dropped_where_workers_keep_private_buffers(engine_id: str) -> None:
    """Private buffers cannot be shared by one writer: every worker keeps its own copy."""
    spec = CPUOffloadingSpec(vllm_config(engine_id, world_size=4, replicated_layout=True))
    assert spec.replicated_layout is False
    assert spec.settings.replicated_layout is False
    assert (spec.kv_bytes_per_chunk, spec.num_chunks) == (4 * PAGESIZE, 2)


@pytest.mark.usefixtures("rocm")
def test_the_tiering_spec_honours_replicated_layout_on_every_platform(engine_id: str) -> None:
    spec = TieringOffloadingSpec(vllm_config(engine_id, world_size=4, replicated_layout=True))
    assert spec.replicated_layout is True
    assert spec.num_chunks == 8


@pytest.mark.usefixtures("rocm")
def test_from_settings_maps_the_shared_region_on_every_device(engine_id: str, root: Path) -> None:
    spec = CPUOffloadingSpec.from_settings(
        settings(engine_id, root, {"cpu_bytes_to_use": 8 * PAGESIZE}, world_size=4, replicated_layout=True)
    )
    assert spec.replicated_layout is True
    assert spec.num_chunks == 8


@pytest.mark.usefixtures("rocm")
def test_a_worker_without_the_shared_region_maps_no_file(engine_id: str, root: Path) -> None:
    torch = pytest.importorskip("torch")
    spec = CPUOffloadingSpec(vllm_config(engine_id, world_size=2, rank=1), root=root)
    worker = spec.create_worker([torch.zeros(2, PAGESIZE, dtype=torch.int8)])
    try:
        assert os.listdir(root) == []
        assert worker.num_cpu_chunks == spec.num_chunks == 4
    finally:
        worker.shutdown()


# ------------------------------------------------------------------ empty caches


def test_zero_bytes_per_block_builds_an_empty_cpu_cache(engine_id: str) -> None:
    spec = CPUOffloadingSpec(vllm_config(engine_id, worker_kv_bytes_per_block=0, world_size=4))
    assert (spec.num_chunks, spec.kv_bytes_per_chunk, spec.cpu_page_size_per_worker) == (0, 0, 0)
    (info,) = spec.get_manager().config_info()
    assert (info["cpu_num_chunks"], info["cpu_kv_cache_size_bytes"], info["cpu_kv_cache_size_tokens"]) == (
        0,
        0,
        0,
    )


def test_less_memory_than_one_chunk_gives_the_cpu_spec_zero_chunks_and_no_file(
    engine_id: str, root: Path
) -> None:
    torch = pytest.importorskip("torch")
    # from_settings maps the shared region on every device: zero chunks still map nothing.
    spec = CPUOffloadingSpec.from_settings(
        settings(engine_id, root, {"cpu_bytes_to_use": PAGESIZE}, worker_kv_bytes_per_block=2 * PAGESIZE)
    )
    assert spec.num_chunks == 0
    worker = spec.create_worker([torch.zeros(2, 2 * PAGESIZE, dtype=torch.int8)])
    try:
        assert os.listdir(root) == []
    finally:
        worker.shutdown()


def test_the_tiering_spec_refuses_less_memory_than_one_chunk_when_built(engine_id: str) -> None:
    with pytest.raises(ConfigError, match="smaller than one chunk") as info:
        TieringOffloadingSpec(
            vllm_config(engine_id, cpu_bytes_to_use=PAGESIZE, worker_kv_bytes_per_block=2 * PAGESIZE)
        )
    assert info.value.key == "kv_connector_extra_config.cpu_bytes_to_use"
    assert info.value.fix == f"give cpu_bytes_to_use at least {2 * PAGESIZE}"


def test_the_tiering_spec_refuses_zero_bytes_per_block_when_built(engine_id: str) -> None:
    with pytest.raises(ConfigError) as info:
        TieringOffloadingSpec(vllm_config(engine_id, worker_kv_bytes_per_block=0))
    assert info.value.key == "worker_kv_bytes_per_block"
    assert info.value.fix is not None


# ------------------------------------------------------------------ integral strings


@pytest.mark.parametrize(
    ("extra", "blocks_per_chunk"),
    [
        ({"blocks_per_chunk": "2"}, 2),
        ({"blocks_per_chunk": " 3 "}, 3),
        ({"blocks_per_chunk": 2.0}, 2),
        ({"block_size": "64"}, 4),
        ({"block_size": None, "blocks_per_chunk": "2"}, 2),  # None is absent, as in vLLM
    ],
)
def test_an_integral_string_or_float_is_read_as_vllm_int_reads_it(
    engine_id: str, root: Path, extra: dict[str, Any], blocks_per_chunk: int
) -> None:
    config = settings(engine_id, root, {"cpu_bytes_to_use": 1 << 20, **extra}, gpu_block_size=16)
    assert config.blocks_per_chunk == blocks_per_chunk


@pytest.mark.parametrize("key", ["store_threshold", "max_tracker_size"])
def test_a_spec_reads_integral_strings_in_its_extra_config(engine_id: str, key: str) -> None:
    extra: dict[str, Any] = {key: "3"}
    spec = CPUOffloadingSpec(vllm_config(engine_id, **extra))
    assert getattr(spec.settings, key) == 3


@pytest.mark.parametrize("value", ["two", "2.5", "0x10", "", "2 chunks", 2.5, [2], True])
@pytest.mark.parametrize("key", ["blocks_per_chunk", "block_size"])
def test_a_count_that_is_not_a_whole_number_names_the_key_and_the_fix_on_one_line(
    engine_id: str, root: Path, key: str, value: Any
) -> None:
    with pytest.raises(ConfigError) as info:
        settings(engine_id, root, {"cpu_bytes_to_use": 1 << 20, key: value})
    assert info.value.key == f"kv_connector_extra_config.{key}"
    assert info.value.fix == f'write it as a number, e.g. "{key}": {16 if key == "block_size" else 1}'
    assert "\n" not in str(info.value)


def test_a_missing_cpu_bytes_to_use_says_so_in_vllms_words(engine_id: str) -> None:
    with pytest.raises(ConfigError, match="cpu_bytes_to_use must be specified") as info:
        CPUOffloadingSpec(vllm_config(engine_id, cpu_bytes_to_use=None))
    assert info.value.fix is not None


# ------------------------------------------------------------------ settings and specs


def test_settings_read_back_from_their_offloading_config_are_the_same_settings(
    engine_id: str, root: Path
) -> None:
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 1 << 20,
        "block_size": 32,
        "eviction_policy": "arc",
        "max_tracker_size": 7,
        "secondary_tiers": [{"type": "example", "custom_param": 3}],
        "tier_poll_interval_s": 0.5,
    }
    original = settings(engine_id, root, extra, world_size=2, rank=1, replicated_layout=True, lifetime="vllm")
    original = dataclasses.replace(original, store_threshold=1)  # a replace survives the trip
    back = OffloadingSettings.from_offloading_config(
        original.to_offloading_config(), root=original.root, lifetime=original.lifetime
    )
    ignored = {"extra_config", "warnings"}
    fields = [f.name for f in dataclasses.fields(OffloadingSettings) if f.name not in ignored]
    assert {f: getattr(back, f) for f in fields} == {f: getattr(original, f) for f in fields}


# ------------------------------------------------------------------ the factory


def test_the_factory_builds_the_spec_named_in_the_extra_config(engine_id: str) -> None:
    spec = OffloadingSpecFactory.create_spec(vllm_config(engine_id, spec_name="TieringOffloadingSpec"))
    assert type(spec) is TieringOffloadingSpec


def test_an_unknown_spec_name_is_a_config_error_with_the_fix(engine_id: str) -> None:
    with pytest.raises(ConfigError, match="Unsupported spec type: DiskSpec") as info:
        OffloadingSpecFactory.create_spec(vllm_config(engine_id, spec_name="DiskSpec"))
    assert "spec_module_path" in str(info.value.fix)


def test_a_module_path_naming_something_other_than_a_spec_is_refused() -> None:
    with pytest.raises(ConfigError, match="is not an OffloadingSpec subclass"):
        OffloadingSpecFactory.get_spec_cls({"spec_name": "Path", "spec_module_path": "pathlib"})


def test_an_out_of_tree_spec_is_loaded_from_its_module_path() -> None:
    spec_cls = OffloadingSpecFactory.get_spec_cls(
        {"spec_name": "OutOfTreeSpec", "spec_module_path": __name__}
    )
    assert spec_cls is OutOfTreeSpec


class OutOfTreeSpec(OffloadingSpec):
    def get_manager(self) -> Any:
        raise NotImplementedError

    def get_worker(self, kv_caches: Any) -> Any:
        raise NotImplementedError
