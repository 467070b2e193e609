"""OffloadingSettings: vLLM's --kv-transfer-config verbatim, vLLM's sizing, errors naming the key."""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvoffload.errors import ConfigError
from kvoffload.kv_transfer_config import MAX_CONFIG_BYTES, read_kv_transfer_config
from kvoffload.settings import MAX_CPU_BYTES, PAGESIZE, OffloadingSettings, OffloadingSizing


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
    cfg = OffloadingSettings.from_kv_transfer_config(
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
    cfg = OffloadingSettings.from_kv_transfer_config(
        kv({"cpu_bytes_to_use": 1 << 20}), worker_kv_bytes_per_block=64
    )
    # vLLM's default is str(uuid.uuid4()): a version-4 UUID in its canonical spelling, new each time.
    parsed = uuid.UUID(cfg.engine_id)
    assert (parsed.version, str(parsed)) == (4, cfg.engine_id)
    again = OffloadingSettings.from_kv_transfer_config(
        kv({"cpu_bytes_to_use": 1 << 20}), worker_kv_bytes_per_block=64
    )
    assert again.engine_id != cfg.engine_id


def test_unknown_keys_are_warnings_not_errors() -> None:
    cfg = OffloadingSettings.from_kv_transfer_config(
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
        OffloadingSettings.from_kv_transfer_config(text, worker_kv_bytes_per_block=64)
    assert key in info.value.key


@pytest.mark.parametrize(
    ("field", "value"),
    [("world_size", 0), ("worker_kv_bytes_per_block", 0), ("rank", 3), ("gpu_block_size", True)],
)
def test_invalid_geometry_names_the_field(field: str, value: Any) -> None:
    args: dict[str, Any] = {"worker_kv_bytes_per_block": 64, "world_size": 2, field: value}
    with pytest.raises(ConfigError) as info:
        OffloadingSettings.from_kv_transfer_config(kv({"cpu_bytes_to_use": 1 << 20}), **args)
    assert info.value.key == field


# ------------------------------------------------------------------------------ hostile input

DIGITS_4000 = "1" + "0" * 4000  # within Python's int() limit: parses, then overflows a float
DIGITS_5000 = "1" + "0" * 5000  # past it: json.loads itself raises ValueError


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"cpu_bytes_to_use": MAX_CPU_BYTES + 1}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 10**4000}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": 10**5000}, "cpu_bytes_to_use"),  # str() of it raises ValueError
        ({"cpu_bytes_to_use": 1e300}, "cpu_bytes_to_use"),
        ({"cpu_bytes_to_use": DIGITS_5000}, "cpu_bytes_to_use"),  # vLLM int()-converts strings
        ({"cpu_bytes_to_use": 1 << 20, "blocks_per_chunk": 10**4000}, "blocks_per_chunk"),
        ({"cpu_bytes_to_use": 1 << 20, "block_size": 16 << 30}, "block_size"),
        ({"cpu_bytes_to_use": 1 << 20, "max_tracker_size": 10**4000}, "max_tracker_size"),
        ({"cpu_bytes_to_use": 1 << 20, "store_threshold": 10**4000}, "store_threshold"),
        ({"cpu_bytes_to_use": 1 << 20, "tier_poll_interval_s": 1e300}, "tier_poll_interval_s"),
    ],
)
def test_a_number_past_its_sane_maximum_is_a_config_error_naming_the_key(
    extra: dict[str, Any], key: str
) -> None:
    with pytest.raises(ConfigError, match="at most") as info:
        OffloadingSettings.from_kv_transfer_config(
            {"kv_connector_extra_config": extra}, worker_kv_bytes_per_block=64
        )
    assert info.value.key == f"kv_connector_extra_config.{key}"
    assert info.value.fix is not None


def test_the_largest_cpu_bytes_to_use_is_1_eib() -> None:
    cfg = OffloadingSettings.from_kv_transfer_config(
        kv({"cpu_bytes_to_use": MAX_CPU_BYTES}), worker_kv_bytes_per_block=64
    )
    assert cfg.cpu_bytes_to_use == MAX_CPU_BYTES == 1 << 60


@pytest.mark.parametrize(
    ("field", "value"), [("worker_kv_bytes_per_block", 10**4000), ("gpu_block_size", 10**30)]
)
def test_geometry_past_its_sane_maximum_names_the_field(field: str, value: int) -> None:
    args: dict[str, Any] = {"worker_kv_bytes_per_block": 64, field: value}
    with pytest.raises(ConfigError, match="at most") as info:
        OffloadingSettings.from_kv_transfer_config(kv({"cpu_bytes_to_use": 1 << 20}), **args)
    assert info.value.key == field
    assert info.value.fix is not None


def test_json_holding_an_integer_longer_than_python_converts_is_a_config_error() -> None:
    document = '{"kv_connector_extra_config": {"cpu_bytes_to_use": ' + DIGITS_5000 + "}}"
    with pytest.raises(ConfigError, match="longer than 4300 digits") as info:
        OffloadingSettings.from_kv_transfer_config(document, worker_kv_bytes_per_block=64)
    assert info.value.key == "kv_transfer_config"


def test_kv_transfer_config_text_past_1_mib_is_refused_before_it_is_parsed() -> None:
    document = kv({"cpu_bytes_to_use": 1 << 20}) + " " * MAX_CONFIG_BYTES
    with pytest.raises(ConfigError, match="1 MiB") as info:
        OffloadingSettings.from_kv_transfer_config(document, worker_kv_bytes_per_block=64)
    assert info.value.key == "kv_transfer_config"


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "engine.json"
    os.mkfifo(path)
    return path


def _big(tmp_path: Path) -> Path:
    path = tmp_path / "engine.json"
    path.write_text(kv({"cpu_bytes_to_use": 1 << 20}) + " " * MAX_CONFIG_BYTES)
    return path


@pytest.mark.timeout(20)  # the FIFO used to block in open() forever, /dev/zero to read forever
@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda tmp: Path("/dev/zero"), "/dev/zero is a character device, not a regular file"),
        (_fifo, "is a FIFO, not a regular file"),
        (lambda tmp: tmp, "is a directory, not a regular file"),
        (_big, "is larger than the 1 MiB a configuration may have"),
    ],
    ids=["dev-zero", "fifo", "directory", "over-1-MiB"],
)
def test_a_config_file_must_be_a_regular_file_of_at_most_1_mib(
    tmp_path: Path, make: Callable[[Path], Path], says: str
) -> None:
    path = make(tmp_path)
    with pytest.raises(ConfigError, match=re.escape(says)) as info:
        read_kv_transfer_config(path)
    assert info.value.key == "--config"
    assert str(path) in str(info.value)
    assert info.value.fix is not None


def test_a_config_file_of_exactly_1_mib_is_read(tmp_path: Path) -> None:
    path = tmp_path / "engine.json"
    document = kv({"cpu_bytes_to_use": 1 << 20})
    path.write_text(document + " " * (MAX_CONFIG_BYTES - len(document)))
    assert path.stat().st_size == MAX_CONFIG_BYTES
    assert read_kv_transfer_config(path)["kv_connector_extra_config"] == {"cpu_bytes_to_use": 1 << 20}


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        ("deep.json", "[" * 100_000, "JSON nested too deeply"),
        ("deep.toml", "a = " + "[" * 100_000, "TOML nested too deeply"),
        ("digits.json", '{"a": ' + DIGITS_5000 + "}", "JSON holds an integer longer than 4300 digits"),
        ("digits.toml", "a = " + DIGITS_5000, "TOML holds an integer longer than 4300 digits"),
    ],
)
def test_a_config_file_too_deep_or_with_too_many_digits_is_a_config_error_naming_it(
    tmp_path: Path, name: str, text: str, says: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {says}")) as info:
        read_kv_transfer_config(path)
    assert info.value.key == "--config"
    assert info.value.fix is not None
