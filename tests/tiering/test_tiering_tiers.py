"""Secondary tiers: the base class's rules, the example tier, and the factory that builds tiers."""

from __future__ import annotations

import mmap
from collections.abc import Iterable, Iterator

import numpy as np
import pytest

from kvoffload.base import LookupResult, OffloadKey, ReqContext, RequestOffloadingContext, make_offload_key
from kvoffload.errors import ConfigError
from kvoffload.tiering.backpressure import (
    DropStorePolicy,
    EMABackpressureDetector,
    ThrottledDropPolicy,
)
from kvoffload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from kvoffload.tiering.example.manager import ExampleSecondaryTierManager
from kvoffload.tiering.factory import SecondaryTierFactory

NUM_CHUNKS = 4
ROW = 256
CTX = ReqContext(req_id="r")


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


def job(
    job_id: int, keys: Iterable[OffloadKey], chunks: Iterable[int], promotion: bool = False
) -> TransferJob:
    return TransferJob(job_id, list(keys), np.array(list(chunks), dtype=np.int64), promotion, CTX)


@pytest.fixture
def primary() -> Iterator[memoryview]:
    """A primary tier's int8 (chunks, row) view, as vLLM's region makes it.

    Closing the mapping afterwards proves no tier kept a slice.
    """
    mm = mmap.mmap(-1, NUM_CHUNKS * ROW)
    view = memoryview(mm).cast("b", (NUM_CHUNKS, ROW))
    yield view
    view.release()
    mm.close()


def example(primary: memoryview, **options: object) -> ExampleSecondaryTierManager:
    return ExampleSecondaryTierManager(None, primary, "example", **options)  # type: ignore[arg-type]


def finished(tier: SecondaryTierManager) -> list[JobResult]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


class OutOfTreeTier(ExampleSecondaryTierManager):
    """Loaded by name from this module in the factory tests."""


class TierTakingAnyOption(SecondaryTierManager):
    def __init__(
        self, offloading_spec: object, primary_kv_view: memoryview, tier_type: str, **options: object
    ) -> None:
        options.pop("backpressure_detector", None)
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self.options = options

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        return None

    def submit_load(self, job_metadata: TransferJob) -> None:
        return None

    def get_finished_jobs(self) -> Iterable[JobResult]:
        return ()

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        return None


NOT_A_TIER = object()


# ---------------------------------------------------------------- example tier


def test_example_tier_round_trips_chunk_bytes(primary: memoryview) -> None:
    tier = example(primary)
    write_chunk(primary, 1, pattern(1))
    tier.submit_store(job(7, [key(0)], [1]))
    write_chunk(primary, 3, bytes(ROW))
    tier.submit_load(job(8, [key(0)], [3], promotion=True))
    assert read_chunk(primary, 3) == pattern(1)
    assert [r.success for r in finished(tier)] == [True, True]


def test_example_tier_reports_each_job_once(primary: memoryview) -> None:
    tier = example(primary)
    tier.submit_store(job(1, [key(0), key(1)], [0, 1]))
    assert [r.job_id for r in finished(tier)] == [1]
    assert finished(tier) == []


def test_example_tier_finds_only_stored_keys(primary: memoryview) -> None:
    tier = example(primary)
    tier.submit_store(job(1, [key(0)], [0]))
    assert tier.lookup(key(0), CTX) is LookupResult.HIT
    assert tier.lookup(key(1), CTX) is LookupResult.MISS
    assert tier.get_num_chunks() == 1


def test_example_tier_fails_a_load_of_a_missing_key(primary: memoryview) -> None:
    tier = example(primary)
    write_chunk(primary, 0, pattern(5))
    tier.submit_load(job(3, [key(9)], [0], promotion=True))
    assert finished(tier) == [JobResult(3, False)]
    assert read_chunk(primary, 0) == pattern(5)


def test_example_tier_key_marked_present_by_hand_loads_without_touching_the_chunk(
    primary: memoryview,
) -> None:
    tier = example(primary)
    tier.chunks[key(2)] = True
    write_chunk(primary, 1, pattern(4))
    tier.submit_load(job(5, [key(2)], [1], promotion=True))
    assert [r.success for r in finished(tier)] == [True]
    assert read_chunk(primary, 1) == pattern(4)


def test_example_tier_publishes_its_custom_param_as_info(primary: memoryview) -> None:
    tier = example(primary, custom_param=5)
    assert tier.custom_param == 5
    assert tier.config_info() == {"example_info": 5}
    assert ExampleSecondaryTierManager.config_info_keys({}) == ("example_info",)


@pytest.mark.parametrize("value", [True, "5", 1.5])
def test_example_tier_rejects_a_custom_param_that_is_not_an_integer(
    primary: memoryview, value: object
) -> None:
    with pytest.raises(ConfigError) as info:
        example(primary, custom_param=value)
    assert info.value.key == "custom_param"


def test_example_tier_reports_jobs_after_shutdown_as_failed(primary: memoryview) -> None:
    tier = example(primary)
    tier.submit_store(job(1, [key(0)], [0]))
    finished(tier)
    tier.shutdown()
    tier.submit_store(job(2, [key(1)], [1]))
    tier.submit_load(job(3, [key(0)], [1], promotion=True))
    assert finished(tier) == [JobResult(2, False), JobResult(3, False)]
    assert tier.num_stored == 0


def test_example_tier_counts_as_a_host_hit() -> None:
    assert ExampleSecondaryTierManager.cache_hit_source == "host"


def test_tier_keeps_no_export_of_the_primary_view_after_copies() -> None:
    mm = mmap.mmap(-1, NUM_CHUNKS * ROW)
    view = memoryview(mm).cast("b", (NUM_CHUNKS, ROW))
    tier = example(view)
    tier.submit_store(job(1, [key(0)], [0]))
    tier.submit_load(job(2, [key(0)], [1], promotion=True))
    view.release()
    mm.close()
    assert mm.closed


# ---------------------------------------------------------------- base class rules


def test_chunk_outside_the_primary_is_a_config_error(primary: memoryview) -> None:
    tier = example(primary)
    with pytest.raises(ConfigError, match="outside") as info:
        tier.submit_store(job(1, [key(0)], [NUM_CHUNKS]))
    assert info.value.key == "chunk_ids"


@pytest.mark.parametrize(
    "view",
    [
        memoryview(bytearray(ROW)),
        memoryview(np.zeros((NUM_CHUNKS, 2 * ROW), dtype=np.int8)[:, ::2]),  # type: ignore[arg-type]
    ],
    ids=["one-dimensional", "strided"],
)
def test_primary_view_must_be_a_contiguous_two_dimensional_view(view: memoryview) -> None:
    with pytest.raises(ConfigError) as info:
        example(view)
    assert info.value.key == "primary_kv_view"


def test_primary_view_of_any_item_type_has_one_chunk_per_row() -> None:
    view = memoryview(np.zeros((NUM_CHUNKS, ROW // 4), dtype=np.float32))  # type: ignore[arg-type]
    tier = example(view)
    assert (tier.num_chunks, tier.block_size_bytes) == (NUM_CHUNKS, ROW)
    with tier.chunk_buffer(1) as chunk:
        assert len(chunk) == ROW


@pytest.mark.parametrize("signed", [True, False], ids=["int8", "uint8"])
def test_tier_learns_the_chunk_size_from_the_view_stride(signed: bool) -> None:
    flat = memoryview(bytearray(NUM_CHUNKS * ROW))
    with flat.cast("b", (NUM_CHUNKS, ROW)) if signed else flat.cast("B", (NUM_CHUNKS, ROW)) as view:
        tier = example(view)
        assert (tier.num_chunks, tier.block_size_bytes) == (NUM_CHUNKS, ROW)


def test_transfer_job_needs_one_chunk_per_key() -> None:
    with pytest.raises(ConfigError) as info:
        job(1, [key(0), key(1)], [0])
    assert info.value.key == "chunk_ids"


def test_tier_cache_hit_source_follows_its_medium_unless_set() -> None:
    from kvoffload.base import CacheHitSource, Medium

    class Disk(TierTakingAnyOption):
        medium = Medium.STORAGE

    class Peer(TierTakingAnyOption):
        cache_hit_source = CacheHitSource.P2P

    assert Disk.cache_hit_source is CacheHitSource.DISK
    assert Peer.cache_hit_source is CacheHitSource.P2P
    assert TierTakingAnyOption.cache_hit_source is CacheHitSource.EXTERNAL_UNSPECIFIED


# ---------------------------------------------------------------- factory


def test_registered_tier_types_load_their_classes() -> None:
    assert set(SecondaryTierFactory._registry) >= {"example", "fs"}
    assert SecondaryTierFactory.get_tier_class({"type": "example"}) is ExampleSecondaryTierManager
    assert SecondaryTierFactory.get_tier_class({"type": "fs"}).__module__ == "kvoffload.tiering.fs.manager"


@pytest.mark.parametrize("config", [{}, {"type": ""}, {"type": 3}])
def test_tier_without_a_type_is_a_config_error_naming_its_index(config: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as info:
        SecondaryTierFactory.get_tier_class(config, index=2)
    assert info.value.key == "secondary_tiers[2].type"


def test_unknown_tier_type_without_module_path_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="Unknown secondary tier type 'nvme'") as info:
        SecondaryTierFactory.get_tier_class({"type": "nvme"})
    assert info.value.key == "secondary_tiers[0].type"
    assert "module_path" in str(info.value)


def test_registering_a_type_twice_is_refused() -> None:
    with pytest.raises(ConfigError, match="already registered"):
        SecondaryTierFactory.register_tier("example", "tests.tiering.test_tiering_tiers", "OutOfTreeTier")


def test_out_of_tree_tier_is_imported_from_its_module_path() -> None:
    config = {"type": "OutOfTreeTier", "module_path": "tests.tiering.test_tiering_tiers"}
    assert SecondaryTierFactory.get_tier_class(config) is OutOfTreeTier


def test_out_of_tree_module_that_cannot_be_imported_is_a_config_error_and_module_not_found() -> None:
    with pytest.raises(ConfigError) as info:
        SecondaryTierFactory.get_tier_class({"type": "T", "module_path": "tests.no_such_module"}, index=1)
    assert info.value.key == "secondary_tiers[1].module_path"
    assert isinstance(info.value, ModuleNotFoundError)  # what vLLM raises


def test_out_of_tree_name_that_is_not_a_tier_is_a_config_error_and_assertion_error() -> None:
    with pytest.raises(ConfigError, match="not a SecondaryTierManager") as info:
        SecondaryTierFactory.get_tier_class(
            {"type": "NOT_A_TIER", "module_path": "tests.tiering.test_tiering_tiers"}
        )
    assert info.value.key == "secondary_tiers[0].type"
    assert isinstance(info.value, AssertionError)  # what vLLM raises


def test_created_tier_receives_its_options(primary: memoryview) -> None:
    tier = SecondaryTierFactory.create_secondary_tier({"type": "example", "custom_param": 5}, primary, None)
    assert isinstance(tier, ExampleSecondaryTierManager)
    assert (tier.custom_param, tier.tier_type, tier.bp_detector) == (5, "example", None)


def test_creating_a_tier_leaves_its_configuration_unchanged(primary: memoryview) -> None:
    config: dict[str, object] = {
        "type": "example",
        "custom_param": 1,
        "backpressure": {"backpressure_cls": "EMABackpressureDetector"},
    }
    SecondaryTierFactory.create_secondary_tier(config, primary, None)
    assert config == {
        "type": "example",
        "custom_param": 1,
        "backpressure": {"backpressure_cls": "EMABackpressureDetector"},
    }


def test_unknown_tier_option_is_a_config_error_naming_the_key(primary: memoryview) -> None:
    with pytest.raises(ConfigError, match="unknown option") as info:
        SecondaryTierFactory.create_secondary_tier(
            {"type": "example", "custom_parm": 2}, primary, None, index=1
        )
    assert info.value.key == "secondary_tiers[1].custom_parm"
    assert info.value.fix is not None
    assert "custom_param" in info.value.fix


def test_bad_option_value_is_a_config_error_under_the_tier_s_key(primary: memoryview) -> None:
    with pytest.raises(ConfigError, match="must be an integer") as info:
        SecondaryTierFactory.create_secondary_tier({"type": "example", "custom_param": "x"}, primary, None)
    assert info.value.key == "secondary_tiers[0].custom_param"
    assert str(info.value).count("custom_param") == 1


def test_option_the_spec_provides_cannot_be_configured(primary: memoryview) -> None:
    with pytest.raises(ConfigError) as info:
        SecondaryTierFactory.create_secondary_tier({"type": "example", "tier_type": "x"}, primary, None)
    assert info.value.key == "secondary_tiers[0].tier_type"


def test_out_of_tree_tier_taking_kwargs_gets_every_option(primary: memoryview) -> None:
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "TierTakingAnyOption", "module_path": "tests.tiering.test_tiering_tiers", "anything": [1]},
        primary,
        "spec",
    )
    assert isinstance(tier, TierTakingAnyOption)
    assert tier.options == {"anything": [1]}


# ---------------------------------------------------------------- back-pressure configuration


def test_backpressure_builds_the_named_detector_with_the_tier_type_s_defaults(primary: memoryview) -> None:
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "example", "backpressure": {"backpressure_cls": "EMABackpressureDetector", "alpha": 0.5}},
        primary,
        None,
    )
    detector = tier.bp_detector
    assert isinstance(detector, EMABackpressureDetector)
    assert (detector._alpha, detector._high, detector._low) == (0.5, 0.010, 0.002)
    assert isinstance(detector.policy, ThrottledDropPolicy)


def test_backpressure_policy_is_chosen_by_name(primary: memoryview) -> None:
    tier = SecondaryTierFactory.create_secondary_tier(
        {
            "type": "example",
            "backpressure": {"backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy"},
        },
        primary,
        None,
    )
    assert tier.bp_detector is not None
    assert isinstance(tier.bp_detector.policy, DropStorePolicy)


@pytest.mark.parametrize(
    ("backpressure", "bad_key"),
    [
        ({}, "secondary_tiers[0].backpressure.backpressure_cls"),
        ({"backpressure_cls": "NoSuchDetector"}, "secondary_tiers[0].backpressure.backpressure_cls"),
        ({"backpressure_cls": "DropStorePolicy"}, "secondary_tiers[0].backpressure.backpressure_cls"),
        ({"backpressure_cls": "EMABackpressureDetector", "alpha": 2}, "secondary_tiers[0].backpressure"),
        ({"backpressure_cls": "EMABackpressureDetector", "bogus": 1}, "secondary_tiers[0].backpressure"),
    ],
)
def test_bad_backpressure_settings_are_config_errors_naming_the_key(
    primary: memoryview, backpressure: dict[str, object], bad_key: str
) -> None:
    with pytest.raises(ConfigError) as info:
        SecondaryTierFactory.create_secondary_tier(
            {"type": "example", "backpressure": backpressure}, primary, None
        )
    assert info.value.key == bad_key
