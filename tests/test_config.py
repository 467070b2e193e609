"""OffloadingConfig: vLLM's --kv-transfer-config verbatim, vLLM's sizing, errors naming the key."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvoffload.config import PAGESIZE, OffloadingConfig, OffloadingSizing
from kvoffload.errors import ConfigError


def kv(extra: dict[str, Any], **top: Any) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            **top,
            "kv_connector_extra_config": extra,
        }
    )


def test_sizing_matches_vllm_normalized_worker_layout() -> None:
    s = OffloadingSizing.compute(3 * PAGESIZE, 16, blocks_per_chunk=2, world_size=6, replicated_layout=False)
    assert (s.cpu_page_size_per_worker, s.kv_bytes_per_chunk, s.num_chunks) == (32, PAGESIZE, 3)
    assert s.row_padding == PAGESIZE - 6 * 32


def test_replicated_layout_keeps_one_copy_per_chunk() -> None:
    s = OffloadingSizing.compute(
        8 * PAGESIZE, PAGESIZE, blocks_per_chunk=1, world_size=4, replicated_layout=True
    )
    assert (s.num_copies, s.kv_bytes_per_chunk, s.num_chunks) == (1, PAGESIZE, 8)


def test_zero_worker_bytes_gives_an_empty_cache_like_vllm() -> None:
    assert OffloadingSizing.compute(1 << 20, 0, 1, 2, False).num_chunks == 0


def test_parses_vllm_json_verbatim() -> None:
    cfg = OffloadingConfig.from_kv_transfer_config(
        kv(
            {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 1 << 20,
                "block_size": 64,
                "secondary_tiers": [{"type": "example", "custom_param": 3}],
            },
            engine_id="e1",
        ),
        worker_kv_bytes_per_block=1024,
        world_size=2,
        gpu_block_size=16,
    )
    assert cfg.engine_id == "e1"
    assert cfg.is_tiering
    assert cfg.blocks_per_chunk == 4
    assert cfg.secondary_tiers == ({"type": "example", "custom_param": 3},)
    assert cfg.sizing.kv_bytes_per_chunk == 2 * 1024 * 4
    assert cfg.warnings == ()


def test_engine_id_defaults_to_a_uuid_like_vllm() -> None:
    cfg = OffloadingConfig.from_kv_transfer_config(
        kv({"cpu_bytes_to_use": 1 << 20}), worker_kv_bytes_per_block=64
    )
    assert len(cfg.engine_id) == 36


def test_unknown_keys_are_warnings_not_errors() -> None:
    cfg = OffloadingConfig.from_kv_transfer_config(
        kv({"cpu_bytes_to_use": 1 << 20, "my_plugin_knob": 1}, some_future_key=True),
        worker_kv_bytes_per_block=64,
    )
    assert any("my_plugin_knob" in w for w in cfg.warnings)
    assert any("some_future_key" in w for w in cfg.warnings)


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("{not json", "kv_transfer_config"),
        ("[1, 2]", "kv_transfer_config"),
        (kv({}), "cpu_bytes_to_use"),
        (kv({"cpu_bytes_to_use": "lots"}), "cpu_bytes_to_use"),
        (kv({"cpu_bytes_to_use": -5}), "cpu_bytes_to_use"),
        (kv({"cpu_bytes_to_use": 1 << 20, "block_size": 32, "blocks_per_chunk": 2}), "block_size"),
        (kv({"cpu_bytes_to_use": 1 << 20, "block_size": 24}), "block_size"),
        (kv({"cpu_bytes_to_use": 1 << 20, "blocks_per_chunk": 0}), "blocks_per_chunk"),
        (kv({"cpu_bytes_to_use": 1 << 20, "spec_name": "DiskSpec"}), "spec_name"),
        (kv({"cpu_bytes_to_use": 1 << 20, "eviction_policy": "fifo"}), "eviction_policy"),
        (
            kv({"cpu_bytes_to_use": 1 << 20, "spec_name": "TieringOffloadingSpec", "store_threshold": 2}),
            "store_threshold",
        ),
        (
            kv({"cpu_bytes_to_use": 1 << 20, "spec_name": "TieringOffloadingSpec", "secondary_tiers": {}}),
            "secondary_tiers",
        ),
        (
            kv(
                {
                    "cpu_bytes_to_use": 1 << 20,
                    "spec_name": "TieringOffloadingSpec",
                    "secondary_tiers": [{"type": "tape"}],
                }
            ),
            "secondary_tiers",
        ),
        (
            kv({"cpu_bytes_to_use": 1 << 20, "spec_name": "TieringOffloadingSpec", "secondary_tiers": [{}]}),
            "secondary_tiers",
        ),
        (kv({"cpu_bytes_to_use": 1 << 20, "canonical_layout": "yes"}), "canonical_layout"),
        (kv({"cpu_bytes_to_use": 1 << 20}, engine_id="a/b"), "engine_id"),
        (kv({"cpu_bytes_to_use": 1 << 20}, engine_id=7), "engine_id"),
        (kv({"cpu_bytes_to_use": 1 << 20}, kv_connector="NixlConnector"), "kv_connector"),
    ],
)
def test_invalid_config_names_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        OffloadingConfig.from_kv_transfer_config(text, worker_kv_bytes_per_block=64)
    assert key in info.value.key


@pytest.mark.parametrize(
    ("field", "value"),
    [("world_size", 0), ("worker_kv_bytes_per_block", 0), ("rank", 3), ("gpu_block_size", True)],
)
def test_invalid_geometry_names_the_field(field: str, value: Any) -> None:
    args: dict[str, Any] = {"worker_kv_bytes_per_block": 64, "world_size": 2, field: value}
    with pytest.raises(ConfigError) as info:
        OffloadingConfig.from_kv_transfer_config(kv({"cpu_bytes_to_use": 1 << 20}), **args)
    assert info.value.key == field
