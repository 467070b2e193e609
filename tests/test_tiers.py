"""Secondary tiers (example, fs) and the factory that builds them from configuration."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from kvoffload.base import LookupResult, OffloadKey, make_offload_key
from kvoffload.errors import ConfigError
from kvoffload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from kvoffload.tiering.tiers import (
    KNOWN_TIER_TYPES,
    ExampleSecondaryTierManager,
    FileSystemTierManager,
    SecondaryTierFactory,
)

NUM_CHUNKS = 4
ROW = 256


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 1)


def write_chunk(view: memoryview, chunk: int, data: bytes) -> None:
    with view.cast("B") as flat:
        flat[chunk * ROW : (chunk + 1) * ROW] = data


def read_chunk(view: memoryview, chunk: int) -> bytes:
    with view.cast("B") as flat:
        return flat[chunk * ROW : (chunk + 1) * ROW].tobytes()


def pattern(seed: int) -> bytes:
    return bytes((seed * 31 + i) % 256 for i in range(ROW))


@pytest.fixture
def primary() -> Iterator[memoryview]:
    """A primary tier's (chunks, row) view. Closing the mapping afterwards proves no tier kept a slice."""
    mm = mmap.mmap(-1, NUM_CHUNKS * ROW)
    view = memoryview(mm).cast("B", (NUM_CHUNKS, ROW))
    yield view
    view.release()
    mm.close()


def example(primary: memoryview, **options: object) -> ExampleSecondaryTierManager:
    return ExampleSecondaryTierManager(offloading_spec=None, primary_kv_view=primary, **options)  # type: ignore[arg-type]


def finished(tier: SecondaryTierManager) -> list[JobResult]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


class OutOfTreeTier(ExampleSecondaryTierManager):
    """Loaded by name from this module in the factory tests."""


class TierTakingAnyOption(SecondaryTierManager):
    def __init__(
        self, offloading_spec: object, primary_kv_view: memoryview, tier_type: str, **options: object
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self.options = options

    def lookup(self, key: OffloadKey) -> LookupResult:
        return LookupResult.MISS

    def submit_store(self, job: TransferJob) -> bool:
        return False

    def submit_load(self, job: TransferJob) -> bool:
        return False

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return ()

    def drain_jobs(self) -> None:
        return None


NOT_A_TIER = object()


# ---------------------------------------------------------------- example tier


def test_example_tier_round_trips_chunk_bytes(primary: memoryview) -> None:
    tier = example(primary)
    write_chunk(primary, 1, pattern(1))
    assert tier.submit_store(TransferJob(7, (key(0),), (1,)))
    write_chunk(primary, 3, bytes(ROW))
    assert tier.submit_load(TransferJob(8, (key(0),), (3,)))
    assert read_chunk(primary, 3) == pattern(1)


def test_example_tier_reports_each_job_once(primary: memoryview) -> None:
    tier = example(primary)
    tier.submit_store(TransferJob(1, (key(0), key(1)), (0, 1)))
    assert finished(tier) == [JobResult(1, True)]
    assert finished(tier) == []


def test_example_tier_finds_only_stored_keys(primary: memoryview) -> None:
    tier = example(primary)
    tier.submit_store(TransferJob(1, (key(0),), (0,)))
    assert tier.lookup(key(0)) is LookupResult.HIT
    assert tier.lookup(key(1)) is LookupResult.MISS


def test_example_tier_fails_a_load_of_a_missing_key(primary: memoryview) -> None:
    tier = example(primary)
    write_chunk(primary, 0, pattern(5))
    assert tier.submit_load(TransferJob(3, (key(9),), (0,)))
    assert finished(tier) == [JobResult(3, False)]
    assert read_chunk(primary, 0) == pattern(5)


def test_example_tier_accepts_custom_param(primary: memoryview) -> None:
    assert example(primary, custom_param=5).custom_param == 5


@pytest.mark.parametrize("value", [True, "5", 1.5])
def test_example_tier_rejects_a_custom_param_that_is_not_an_integer(
    primary: memoryview, value: object
) -> None:
    with pytest.raises(ConfigError) as info:
        example(primary, custom_param=value)
    assert info.value.key == "custom_param"


def test_example_tier_rejects_unknown_options_by_name(primary: memoryview) -> None:
    with pytest.raises(ConfigError, match="unknown option") as info:
        example(primary, custom_parm=1)
    assert info.value.key == "custom_parm"


def test_example_tier_rejects_jobs_after_shutdown(primary: memoryview) -> None:
    tier = example(primary)
    tier.submit_store(TransferJob(1, (key(0),), (0,)))
    tier.shutdown()
    assert not tier.submit_store(TransferJob(2, (key(1),), (1,)))
    assert not tier.submit_load(TransferJob(3, (key(0),), (1,)))
    assert tier.num_stored == 0


def test_tier_keeps_no_export_of_the_primary_view_after_copies() -> None:
    mm = mmap.mmap(-1, NUM_CHUNKS * ROW)
    view = memoryview(mm).cast("B", (NUM_CHUNKS, ROW))
    tier = example(view)
    tier.submit_store(TransferJob(1, (key(0),), (0,)))
    tier.submit_load(TransferJob(2, (key(0),), (1,)))
    view.release()
    mm.close()
    assert mm.closed


# ---------------------------------------------------------------- base class rules


def test_chunk_outside_the_primary_is_a_config_error(primary: memoryview) -> None:
    tier = example(primary)
    with pytest.raises(ConfigError, match="outside") as info:
        tier.submit_store(TransferJob(1, (key(0),), (NUM_CHUNKS,)))
    assert info.value.key == "chunk_ids"


def test_primary_view_must_be_two_dimensional_bytes() -> None:
    with pytest.raises(ConfigError) as info:
        example(memoryview(bytearray(ROW)))
    assert info.value.key == "primary_kv_view"


def test_tier_learns_the_chunk_size_from_the_view_stride(primary: memoryview) -> None:
    tier = example(primary)
    assert (tier.num_chunks, tier.block_size_bytes) == (NUM_CHUNKS, ROW)


def test_transfer_job_needs_one_chunk_per_key() -> None:
    with pytest.raises(ConfigError) as info:
        TransferJob(1, (key(0), key(1)), (0,))
    assert info.value.key == "chunk_ids"


# ---------------------------------------------------------------- fs tier


def fs(primary: memoryview, root: Path) -> FileSystemTierManager:
    return FileSystemTierManager(None, primary, root_dir=str(root), n_read_threads=2, n_write_threads=2)


def test_fs_tier_round_trips_chunk_bytes_through_files(primary: memoryview, tmp_path: Path) -> None:
    tier = fs(primary, tmp_path)
    write_chunk(primary, 0, pattern(2))
    write_chunk(primary, 1, pattern(3))
    tier.submit_store(TransferJob(1, (key(0), key(1)), (0, 1)))
    assert finished(tier) == [JobResult(1, True)]
    write_chunk(primary, 0, bytes(ROW))
    write_chunk(primary, 1, bytes(ROW))
    tier.submit_load(TransferJob(2, (key(1), key(0)), (0, 1)))
    assert finished(tier) == [JobResult(2, True)]
    assert (read_chunk(primary, 0), read_chunk(primary, 1)) == (pattern(3), pattern(2))
    tier.shutdown()


def test_fs_tier_writes_one_complete_file_per_key_and_no_temporaries(
    primary: memoryview, tmp_path: Path
) -> None:
    tier = fs(primary, tmp_path)
    tier.submit_store(TransferJob(1, (key(0),), (0,)))
    finished(tier)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files == [tier.path_of(key(0))]
    assert files[0].name.endswith("_g1.bin")
    assert files[0].stat().st_size == ROW
    tier.shutdown()


def test_fs_tier_reports_a_store_pending_until_its_job_is_collected(
    primary: memoryview, tmp_path: Path
) -> None:
    tier = fs(primary, tmp_path)
    assert tier.lookup(key(0)) is LookupResult.MISS
    tier.submit_store(TransferJob(1, (key(0),), (0,)))
    assert tier.lookup(key(0)) is LookupResult.HIT_PENDING
    assert tier.has_pending_work()
    finished(tier)
    assert tier.lookup(key(0)) is LookupResult.HIT
    assert not tier.has_pending_work()
    tier.shutdown()


def test_fs_tier_fails_a_load_of_a_missing_file(primary: memoryview, tmp_path: Path) -> None:
    tier = fs(primary, tmp_path)
    tier.submit_load(TransferJob(4, (key(0),), (0,)))
    assert finished(tier) == [JobResult(4, False)]
    tier.shutdown()


def test_fs_tier_fails_a_load_of_a_file_written_with_another_layout(
    primary: memoryview, tmp_path: Path
) -> None:
    tier = fs(primary, tmp_path)
    path = tier.path_of(key(0))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"x" * (ROW // 2))
    write_chunk(primary, 0, pattern(1))
    tier.submit_load(TransferJob(4, (key(0),), (0,)))
    assert finished(tier) == [JobResult(4, False)]
    assert read_chunk(primary, 0) == pattern(1)
    tier.shutdown()


def test_fs_tier_rejects_jobs_after_shutdown(primary: memoryview, tmp_path: Path) -> None:
    tier = fs(primary, tmp_path)
    tier.shutdown()
    tier.shutdown()
    assert not tier.submit_store(TransferJob(1, (key(0),), (0,)))


@pytest.mark.parametrize("option", ["n_read_threads", "n_write_threads"])
def test_fs_tier_needs_positive_thread_counts(primary: memoryview, tmp_path: Path, option: str) -> None:
    with pytest.raises(ConfigError) as info:
        FileSystemTierManager(None, primary, root_dir=str(tmp_path), **{option: 0})  # type: ignore[arg-type]
    assert info.value.key == option


def test_fs_tier_root_that_cannot_be_created_is_a_config_error(primary: memoryview, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(ConfigError) as info:
        fs(primary, blocker / "sub")
    assert info.value.key == "root_dir"


# ---------------------------------------------------------------- factory


def test_known_tier_types_are_the_factory_types() -> None:
    assert KNOWN_TIER_TYPES == ("example", "fs")
    assert SecondaryTierFactory.get_tier_class({"type": "example"}) is ExampleSecondaryTierManager
    assert SecondaryTierFactory.get_tier_class({"type": "fs"}) is FileSystemTierManager


@pytest.mark.parametrize("config", [{}, {"type": ""}, {"type": 3}])
def test_tier_without_a_type_is_a_config_error_naming_its_index(config: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as info:
        SecondaryTierFactory.get_tier_class(config, index=2)
    assert info.value.key == "secondary_tiers[2].type"


def test_unknown_tier_type_without_module_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown secondary tier type 'nvme'") as info:
        SecondaryTierFactory.get_tier_class({"type": "nvme"})
    assert info.value.key == "secondary_tiers[0].type"
    assert info.value.fix is not None
    assert "module_path" in info.value.fix


def test_out_of_tree_tier_is_imported_from_its_module_path() -> None:
    config = {"type": "OutOfTreeTier", "module_path": "tests.test_tiers"}
    assert SecondaryTierFactory.get_tier_class(config) is OutOfTreeTier


def test_out_of_tree_module_that_cannot_be_imported_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        SecondaryTierFactory.get_tier_class({"type": "T", "module_path": "tests.no_such_module"}, index=1)
    assert info.value.key == "secondary_tiers[1].module_path"


def test_out_of_tree_name_that_is_not_a_tier_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not a SecondaryTierManager") as info:
        SecondaryTierFactory.get_tier_class({"type": "NOT_A_TIER", "module_path": "tests.test_tiers"})
    assert info.value.key == "secondary_tiers[0].type"


def test_created_tier_receives_its_options(primary: memoryview) -> None:
    tier = SecondaryTierFactory.create_secondary_tier({"type": "example", "custom_param": 5}, primary, None)
    assert isinstance(tier, ExampleSecondaryTierManager)
    assert (tier.custom_param, tier.tier_type, tier.offloading_spec) == (5, "example", None)


def test_creating_a_tier_leaves_its_configuration_unchanged(primary: memoryview) -> None:
    config: dict[str, object] = {"type": "example", "custom_param": 1, "backpressure": {}}
    SecondaryTierFactory.create_secondary_tier(config, primary, None)
    assert config == {"type": "example", "custom_param": 1, "backpressure": {}}


def test_unknown_tier_option_is_a_config_error_naming_the_key(primary: memoryview) -> None:
    with pytest.raises(ConfigError, match="unknown option") as info:
        SecondaryTierFactory.create_secondary_tier(
            {"type": "fs", "root_dir": "/nonexistent", "n_threads": 2}, primary, None, index=1
        )
    assert info.value.key == "secondary_tiers[1].n_threads"
    assert info.value.fix is not None
    assert "root_dir" in info.value.fix


def test_unknown_option_of_a_tier_taking_kwargs_is_the_tier_s_to_reject(primary: memoryview) -> None:
    with pytest.raises(ConfigError) as info:
        SecondaryTierFactory.create_secondary_tier({"type": "example", "bogus": 1}, primary, None, index=3)
    assert info.value.key == "secondary_tiers[3].bogus"


def test_bad_option_value_is_a_config_error_under_the_tier_s_key(primary: memoryview) -> None:
    with pytest.raises(ConfigError, match="must be an integer") as info:
        SecondaryTierFactory.create_secondary_tier({"type": "example", "custom_param": "x"}, primary, None)
    assert info.value.key == "secondary_tiers[0].custom_param"
    assert str(info.value).count("custom_param") == 1


def test_missing_required_option_is_a_config_error(primary: memoryview) -> None:
    with pytest.raises(ConfigError, match="required") as info:
        SecondaryTierFactory.create_secondary_tier({"type": "fs"}, primary, None)
    assert info.value.key == "secondary_tiers[0].root_dir"


def test_option_the_spec_provides_cannot_be_configured(primary: memoryview) -> None:
    with pytest.raises(ConfigError) as info:
        SecondaryTierFactory.create_secondary_tier({"type": "example", "tier_type": "x"}, primary, None)
    assert info.value.key == "secondary_tiers[0].tier_type"


def test_backpressure_settings_are_refused_rather_than_ignored(primary: memoryview) -> None:
    with pytest.raises(ConfigError, match="not implemented") as info:
        SecondaryTierFactory.create_secondary_tier(
            {"type": "example", "backpressure": {"backpressure_cls": "EMABackpressureDetector"}},
            primary,
            None,
        )
    assert info.value.key == "secondary_tiers[0].backpressure"


def test_out_of_tree_tier_taking_kwargs_gets_every_option(primary: memoryview) -> None:
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "TierTakingAnyOption", "module_path": "tests.test_tiers", "anything": [1]}, primary, "spec"
    )
    assert isinstance(tier, TierTakingAnyOption)
    assert tier.options == {"anything": [1]}
    assert tier.offloading_spec == "spec"


def test_fs_tier_created_from_configuration_uses_its_root(primary: memoryview, tmp_path: Path) -> None:
    root = tmp_path / "tier"
    tier = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root_dir": str(root)}, primary, None)
    assert isinstance(tier, FileSystemTierManager)
    assert root.is_dir()
    assert os.listdir(root) == []
    tier.shutdown()
