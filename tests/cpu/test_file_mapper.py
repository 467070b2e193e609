"""FileMapper: the on-disk namespace and block paths a file-backed tier shares with vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import pytest

from kvoffload.base import make_offload_key
from kvoffload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from kvoffload.errors import ConfigError
from kvoffload.file_mapper import FileMapper, canonical_format_id

if TYPE_CHECKING:
    from kvoffload.base import OffloadingSpec

KEY = make_offload_key(bytes.fromhex("abcdef0123456789"), 1)


@dataclass
class _Spec:
    """The one attribute ``from_offloading_spec`` reads."""

    config: OffloadingConfig


def mapper(
    *,
    root_dir: str = "/srv/kv",
    tp_size: int = 1,
    rank: int = 0,
    is_parallelism_agnostic: bool = False,
    replicated_layout: bool = False,
    canonical_layout: bool = False,
    kv_cache_layout: str | None = "LBNHC",
    parallel_agnostic: bool = False,
    model: str = "org/llama-8b",
) -> FileMapper:
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="file-mapper-test",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=2),
        parallel=OffloadingParallelConfig.tensor_parallel(
            rank, tp_size, is_parallelism_agnostic=is_parallelism_agnostic
        ),
        replicated_layout=replicated_layout,
        canonical_layout=canonical_layout,
        kv_cache_layout=kv_cache_layout,
    )
    return FileMapper.from_offloading_spec(
        root_dir,
        cast("OffloadingSpec", _Spec(config)),
        blocks_per_file=2,
        parallel_agnostic=parallel_agnostic,
    )


def test_block_path_matches_vllms_layout_byte_for_byte() -> None:
    # Computed with vLLM 0.33's FileMapper for the same fields: the two engines share a mount.
    fm = mapper(tp_size=2, rank=1)
    assert fm.base_path == "/srv/kv/org_llama-8b_87e8a648aec6"
    assert fm.get_file_name(KEY) == "/srv/kv/org_llama-8b_87e8a648aec6_r1/abc/de_g1/abcdef0123456789.bin"


def test_model_name_slash_does_not_nest_the_namespace() -> None:
    fm = mapper(model="a/b/c")
    assert fm.base_path.startswith("/srv/kv/a_b_c_")
    assert fm.base_path.count("/") == 3


def test_config_file_sits_inside_the_namespace_directory() -> None:
    fm = mapper()
    assert fm.get_config_file_path() == f"{fm.base_path}/config.json"


def test_run_config_is_a_copy() -> None:
    fm = mapper()
    config: dict[str, Any] = fm.get_run_config()
    config["tp_size"] = 99
    assert fm.fields["tp_size"] == 1


@pytest.mark.parametrize(
    "changed",
    [
        {"tp_size": 2},
        {"model": "org/other"},
        {"canonical_layout": True},
        {"replicated_layout": True, "parallel_agnostic": True},
    ],
)
def test_a_field_that_changes_the_bytes_changes_the_namespace(changed: dict[str, Any]) -> None:
    assert mapper(**changed).base_path != mapper().base_path


def test_the_same_fields_give_the_same_namespace_on_every_rank() -> None:
    ranks = [mapper(tp_size=4, rank=r) for r in range(4)]
    assert len({fm.base_path for fm in ranks}) == 1
    assert len({fm.get_file_name(KEY) for fm in ranks}) == 4


def test_parallel_agnostic_is_granted_when_the_layout_allows_it() -> None:
    fm = mapper(tp_size=4, rank=3, is_parallelism_agnostic=True, parallel_agnostic=True)
    assert fm.rank == 0
    assert (fm.fields["tp_size"], "parallel_agnostic" in fm.fields) == (1, False)
    assert fm.get_file_name(KEY).startswith(f"{fm.base_path}_r0/")


def test_parallel_agnostic_is_refused_when_the_bytes_depend_on_the_layout() -> None:
    fm = mapper(tp_size=4, rank=3, parallel_agnostic=True)
    assert (fm.rank, fm.fields["tp_size"], fm.fields["parallel_agnostic"]) == (3, 4, False)


def test_replicated_layouts_of_different_tp_sizes_share_blocks() -> None:
    tp2 = mapper(tp_size=2, rank=1, replicated_layout=True, parallel_agnostic=True)
    tp4 = mapper(tp_size=4, rank=2, replicated_layout=True, parallel_agnostic=True)
    assert tp2.get_file_name(KEY) == tp4.get_file_name(KEY)
    assert tp2.fields["replicated_layout"] is True


def test_replicated_layout_without_the_callers_request_keeps_the_old_namespace() -> None:
    assert mapper(tp_size=2, rank=1, replicated_layout=True).base_path == mapper(tp_size=2, rank=1).base_path


@pytest.mark.parametrize(
    ("layout", "expected"), [("LBNHC", "v1-nhd"), ("LBHNC", "v1-hnd"), ("BLHNC", "v1-blhnc")]
)
def test_canonical_format_id_names_the_layout_family(layout: str, expected: str) -> None:
    assert canonical_format_id(layout) == expected


def test_unknown_layout_is_a_config_error_with_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="NHD") as caught:
        canonical_format_id("NHD")
    assert caught.value.fix is not None
    assert "LBNHC" in caught.value.fix


def test_canonical_layout_without_a_kv_cache_layout_is_refused() -> None:
    with pytest.raises(ConfigError, match="kv_cache_layout"):
        mapper(canonical_layout=True, kv_cache_layout=None)


def test_an_empty_root_names_a_run_without_a_directory_as_vllms_p2p_and_object_tiers_do() -> None:
    named = mapper(root_dir="")
    assert named.base_path == "/" + mapper(root_dir="root").base_path.removeprefix("root/")
    assert named.get_run_config() == mapper(root_dir="root").get_run_config()
