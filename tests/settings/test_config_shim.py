"""The names that moved out of ``kvoffload.config`` still import from there for one release (issue #29)."""

from __future__ import annotations

import importlib

import pytest

import kvoffload.config

MOVED = {
    "kvoffload.settings": [
        "PAGESIZE",
        "SPEC_NAMES",
        "CPU_SPEC_SEGMENTS",
        "MAX_CPU_BYTES",
        "MAX_BLOCKS_PER_CHUNK",
        "MAX_COUNT",
        "MAX_TIER_POLL_INTERVAL_S",
        "Lifetime",
        "OffloadingSizing",
        "OffloadingSettings",
    ],
    "kvoffload.kv_transfer_config": ["MAX_CONFIG_BYTES", "read_kv_transfer_config"],
}


@pytest.mark.parametrize(
    ("home", "name"), [(home, name) for home, names in MOVED.items() for name in names], ids=str
)
def test_a_moved_name_imports_from_config_as_the_same_object(home: str, name: str) -> None:
    assert getattr(kvoffload.config, name) is getattr(importlib.import_module(home), name)


def test_a_name_config_never_had_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'OffloadingSetting'"):
        kvoffload.config.OffloadingSetting  # noqa: B018
