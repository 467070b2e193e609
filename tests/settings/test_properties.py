"""Hostile input, generated: the name parser, the duration parser, the fault grammar and the
config loader either accept an input or raise the project's own error, never anything else.

Hypothesis runs derandomized (the same examples every run) with modest example counts.
Explicit ``@example``s pin the inputs that once escaped as a raw Python error.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from kvoffload import faults
from kvoffload.cpu.spec import CPUOffloadingSpec
from kvoffload.durations import MAX_DURATION_S, parse_duration
from kvoffload.errors import ConfigError, FaultSpecError, InjectedFault
from kvoffload.settings import MAX_CPU_BYTES, OffloadingSettings
from kvoffload.shm import names
from kvoffload.tiering.spec import TieringOffloadingSpec
from tests.conftest import region_fds
from tests.support.procs import shm_dir

T = TypeVar("T")
SETTINGS = settings(max_examples=200, derandomize=True, deadline=None, database=None)

#: Any code point, surrogates included: JSON's "\ud800" and os.listdir's "\udcff" are both str.
ANY_CHAR = st.characters(exclude_categories=())
TRICKY = st.sampled_from(
    [
        "/",
        "\0",
        "\n",
        "\t",
        "\x1b",
        ".",
        ".mmap",
        ".mmap.",
        "vllm_offload_",
        "\udcff",
        "\ud800",
        "é",
        "🚀",
        "²",
    ]
)
TEXT = st.lists(st.one_of(ANY_CHAR, TRICKY), max_size=24).map("".join)


# ------------------------------------------------------------------------------ names


def attempt(fn: Callable[[], T], *errors: type[BaseException]) -> tuple[T | None, BaseException | None]:
    """``fn()``'s value, or the error of one of ``errors`` it raised (anything else propagates)."""
    try:
        return fn(), None
    except errors as e:
        return None, e


def valid_engine_id(text: str) -> bool:
    try:
        names.validate_engine_id(text)
    except ConfigError:
        return False
    return True


@SETTINGS
@given(engine_id=TEXT, segment=st.integers(0, names.MAX_SEGMENTS - 1))
@example(engine_id="x.mmap.5", segment=0)
@example(engine_id="x.mmap", segment=5)
@example(engine_id=".mmap", segment=31)
@example(engine_id="a\nb", segment=1)
@example(engine_id="\udcff", segment=0)
def test_parse_inverts_format_for_every_valid_engine_id(engine_id: str, segment: int) -> None:
    assume(valid_engine_id(engine_id))
    assert names.parse(names.format_name(engine_id, segment)) == names.RegionName(engine_id, segment)


@SETTINGS
@given(engine_id=TEXT)
@example(engine_id="\ud800")  # JSON "\ud800": a lone surrogate with no bytes on disk
@example(engine_id="x" * 300)
@example(engine_id="")
def test_validating_any_engine_id_raises_only_config_error(engine_id: str) -> None:
    _, error = attempt(lambda: names.validate_engine_id(engine_id), ConfigError)
    if error is not None:
        assert isinstance(error, ConfigError)
        assert error.key == "engine_id"


NAME_PIECES = st.lists(
    st.sampled_from(
        ["vllm_offload_", ".mmap", ".", "0", "1", "3", "31", "32", "x", "\n", "\udcff", "é", "/"]
    ),
    max_size=8,
).map("".join)


@SETTINGS
@given(name=st.one_of(TEXT, NAME_PIECES, st.builds(lambda s: f"vllm_offload_{s}", NAME_PIECES)))
@example(name="vllm_offload_" + "x" * 235 + ".mmap.1")  # 255 bytes; its .mmap.31 would not fit
@example(name="vllm_offload_x.mmap.01")
@example(name="vllm_offload_.mmap")
def test_a_name_parse_accepts_formats_back_to_itself(name: str) -> None:
    parsed = names.parse(name)
    if parsed is None:
        return
    assert parsed.name == name
    assert 0 <= parsed.segment < names.MAX_SEGMENTS
    assert parsed.base_name == f"{names.PREFIX}{parsed.engine_id}{names.SUFFIX}"
    assert "/" not in parsed.engine_id
    assert "\0" not in parsed.engine_id


# -------------------------------------------------------------------------- durations

UNITS = ("w", "d", "h", "m", "s", "ms")
SECONDS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
DURATION_PIECES = st.lists(
    st.sampled_from([*UNITS, "0", "1", "12", ".", ".5", " ", "-", "e3", "nan", "inf", "1" * 400, "\u0663"]),
    max_size=8,
).map("".join)


@SETTINGS
@given(text=st.one_of(TEXT, DURATION_PIECES))
@example(text="1" * 400)  # a float that overflows to inf
@example(text="1" * 400 + "w")
@example(text="99999999999d")  # finite, but past what time.sleep and a deadline can hold
def test_any_text_is_a_bounded_duration_or_a_config_error_naming_the_option(text: str) -> None:
    seconds, error = attempt(lambda: parse_duration(text, option="--older-than"), ConfigError)
    if error is not None:
        assert isinstance(error, ConfigError)
        assert error.key == "--older-than"
        assert str(error).startswith("--older-than: ")
        return
    assert seconds is not None
    assert math.isfinite(seconds)
    assert 0 <= seconds <= MAX_DURATION_S


@SETTINGS
@given(
    terms=st.lists(st.tuples(st.sampled_from(UNITS), st.integers(0, 10_000)), min_size=1, max_size=6),
    spaced=st.booleans(),
)
def test_units_from_largest_to_smallest_add_up_to_at_most_the_bound(
    terms: list[tuple[str, int]], spaced: bool
) -> None:
    chosen = {unit: value for unit, value in terms}  # each unit at most once
    ordered = [(unit, chosen[unit]) for unit in UNITS if unit in chosen]
    text = (" " if spaced else "").join(f"{value}{unit}" for unit, value in ordered)
    expected = sum(value * SECONDS[unit] for unit, value in ordered)
    if expected > MAX_DURATION_S:
        with pytest.raises(ConfigError, match="at most 366d"):
            parse_duration(text)
        return
    assert math.isclose(parse_duration(text), expected, rel_tol=1e-12, abs_tol=1e-9)


@pytest.mark.parametrize("text", ["366d", "52w2d", "31622400", "31622400s"])
def test_the_longest_duration_is_366_days(text: str) -> None:
    assert parse_duration(text) == MAX_DURATION_S == 366 * 86400


@pytest.mark.parametrize("text", ["366d1ms", "53w", "31622401", "99999999999d", "1" * 300])
def test_a_duration_past_366_days_is_refused_naming_the_option_and_the_bound(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^--settle: .*at most 366d") as info:
        parse_duration(text, option="--settle")
    assert info.value.key == "--settle"
    assert info.value.fix is not None


# ---------------------------------------------------------------------- fault grammar

ACTION_PIECES = st.lists(
    st.sampled_from(
        [
            "off", "raise", "oserror", "crash", "sleep", "(", ")", "%", "*", "->", "1", "50", "100",
            "100.5", "ENOSPC", "14", "0", "nan", "inf", "1e400", "99999999999999999999", "²", " ", "bogus",
        ]
    ),
    max_size=8,
).map("".join)  # fmt: skip


def _check_terms(terms: list[faults.Term]) -> None:
    for term in terms:
        assert term.action in ("off", "raise", "oserror", "crash", "sleep")
        assert term.probability is None or 0 <= term.probability <= 1
        assert term.count is None or term.count >= 0
        if term.action == "oserror":
            assert term.errno is not None
            assert 1 <= term.errno <= 4095
        if term.action == "sleep":
            assert term.sleep_ms is not None
            assert math.isfinite(term.sleep_ms)
            assert term.sleep_ms >= 0


@SETTINGS
@given(spec=st.one_of(TEXT, ACTION_PIECES))
@example(spec="sleep(nan)")
@example(spec="sleep(inf)")
@example(spec="oserror(99999999999999999999)")
@example(spec="oserror(²)")
@example(spec="oserror(0)")
def test_any_action_spec_parses_to_sane_terms_or_raises_fault_spec_error(spec: str) -> None:
    try:
        terms = faults.parse_actions(spec)
    except FaultSpecError:
        return
    _check_terms(terms)


@SETTINGS
@given(spec=ACTION_PIECES)
@example(spec="sleep(nan)")
@example(spec="oserror(99999999999999999999)")
def test_a_point_configured_from_any_accepted_spec_raises_only_the_fault_it_names(spec: str) -> None:
    try:
        terms = faults.parse_actions(spec)
    except FaultSpecError:
        return
    # Never fire a crash (it would SIGKILL the test run) or a long sleep.
    assume(all(t.action != "crash" and (t.sleep_ms or 0) < 5 for t in terms))
    with faults.scenario({"validate": spec}, seed=1):
        _, error = attempt(lambda: faults.point("validate"), InjectedFault, OSError)
    if isinstance(error, InjectedFault):
        assert error.point == "validate"
    elif error is not None:
        assert "injected at validate" in str(error)


TERMS = st.builds(
    lambda action, pct, count, arg: f"{pct}{count}{action}{arg}",
    action=st.sampled_from(["off", "raise", "crash"]),
    pct=st.one_of(st.just(""), st.integers(0, 10_000).map(lambda n: f"{n / 100:g}%")),
    count=st.one_of(st.just(""), st.integers(0, 1000).map(lambda n: f"{n}*")),
    arg=st.just(""),
) | st.builds(
    lambda action, arg: f"{action}({arg})",
    action=st.just("oserror"),
    arg=st.one_of(st.integers(1, 4095).map(str), st.sampled_from(["ENOSPC", "EFAULT", "enomem"])),
)


@SETTINGS
@given(chain=st.lists(TERMS, min_size=1, max_size=4).map("->".join))
def test_the_reported_configuration_parses_back_to_the_same_terms(chain: str) -> None:
    first = faults.parse_actions(chain)
    with faults.scenario({"validate": chain}):
        reported = faults.configured()["validate"]
    again = faults.parse_actions(reported)
    assert [(t.action, t.count, t.errno, t.sleep_ms) for t in again] == [
        (t.action, t.count, t.errno, t.sleep_ms) for t in first
    ]
    for a, b in zip(again, first, strict=True):
        assert (a.probability is None) == (b.probability is None)
        if a.probability is not None and b.probability is not None:
            assert math.isclose(a.probability, b.probability, rel_tol=1e-9, abs_tol=1e-12)


@SETTINGS
@given(
    text=st.one_of(
        TEXT,
        st.lists(st.sampled_from(["validate", "secondary.3", "=", ";", "raise", "nope", " "])).map("".join),
    )
)
def test_any_environment_value_is_a_configuration_or_a_fault_spec_error(text: str) -> None:
    try:
        parsed = faults.parse_config(text)
    except FaultSpecError:
        return
    for name, terms in parsed.items():
        assert faults.validate_name(name) == name
        _check_terms(terms)


# ---------------------------------------------------------------------- config loader

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    TEXT,
    st.sampled_from(["²", "１２", " 4096 ", "0", "-1", "1e3", "lru", "arc", "example"]),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=12,
)
TIERS = st.lists(
    st.one_of(
        JSON,
        st.fixed_dictionaries(
            {"type": st.one_of(st.sampled_from(["example", "fs", "Nope", ""]), JSON)},
            optional={
                "module_path": st.sampled_from(["", ".x", "..", "kvoffload.no_such_module", "os"]),
                "custom_param": JSON,
                "root": JSON,
                "backpressure": JSON,
            },
        ),
    ),
    max_size=3,
)
EXTRA = st.fixed_dictionaries(
    {},
    optional={
        "spec_name": st.one_of(st.sampled_from(["CPUOffloadingSpec", "TieringOffloadingSpec", "Nope"]), JSON),
        "cpu_bytes_to_use": st.one_of(st.integers(-1, 1 << 40), st.floats(allow_nan=True), SCALARS),
        "block_size": st.one_of(st.integers(-1, 256), SCALARS),
        "blocks_per_chunk": st.one_of(st.integers(-1, 64), SCALARS),
        "eviction_policy": st.one_of(st.sampled_from(["lru", "arc", "nope"]), JSON),
        "cache_policy_module_path": st.one_of(st.sampled_from([".x", "kvoffload.no_such_module"]), JSON),
        "store_threshold": st.one_of(st.integers(-1, 4), SCALARS),
        "max_tracker_size": st.one_of(st.integers(-1, 10), SCALARS),
        "offload_prompt_only": SCALARS,
        "canonical_layout": SCALARS,
        "secondary_tiers": st.one_of(TIERS, JSON),
        "tier_poll_interval_s": st.one_of(st.floats(allow_nan=True, allow_infinity=True), SCALARS),
        "spec_module_path": JSON,
        "unknown_key": JSON,
    },
)
TOP = st.fixed_dictionaries(
    {},
    optional={
        "kv_connector": st.one_of(st.just("OffloadingConnector"), JSON),
        "engine_id": st.one_of(TEXT, JSON, st.just("\ud800"), st.just("a/b")),
        "kv_role": JSON,
        "kv_connector_extra_config": st.one_of(EXTRA, JSON),
        "something_else": JSON,
    },
)


#: 4000 digits pass int() and then overflowed the sizing; 5000 fail int() inside json.loads.
HUGE_CPU_BYTES = '{"kv_connector_extra_config": {"cpu_bytes_to_use": 1' + "0" * 4000 + "}}"
INFINITE_POLL = '{"kv_connector_extra_config": {"cpu_bytes_to_use": 4096, "tier_poll_interval_s": 1e999}}'


def _load(document: str, root: Path) -> OffloadingSettings | None:
    try:
        return OffloadingSettings.from_kv_transfer_config(
            document, worker_kv_bytes_per_block=4096, world_size=2, root=root
        )
    except ConfigError:
        return None


def test_any_json_is_a_config_or_a_config_error_and_nothing_is_allocated_before_it_is_valid() -> None:
    with shm_dir() as root:
        fds_before = region_fds()

        @SETTINGS
        @given(document=st.one_of(JSON, TOP).map(lambda d: json.dumps(d, allow_nan=True)))
        @example(document='{"kv_connector_extra_config": {"cpu_bytes_to_use": "²"}}')
        @example(document='{"engine_id": "\\ud800", "kv_connector_extra_config": {"cpu_bytes_to_use": 4096}}')
        @example(document="[" * 100_000)
        @example(
            document=json.dumps(
                {
                    "kv_connector_extra_config": {
                        "cpu_bytes_to_use": 1 << 20,
                        "spec_name": "TieringOffloadingSpec",
                        "secondary_tiers": [{"type": "Mine", "module_path": ".x"}],
                    }
                }
            )
        )
        @example(document=INFINITE_POLL)
        @example(document=HUGE_CPU_BYTES)
        @example(document=HUGE_CPU_BYTES.replace("1" + "0" * 4000, "1" + "0" * 5000))
        def check(document: str) -> None:
            config = _load(document, root)
            if config is not None:
                spec_class = TieringOffloadingSpec if config.is_tiering else CPUOffloadingSpec
                spec_class.from_settings(config)  # a spec allocates nothing until get_manager/create_worker
                assert math.isfinite(config.tier_poll_interval_s)
                assert 0 < config.cpu_bytes_to_use <= MAX_CPU_BYTES
            assert os.listdir(root) == []
            assert region_fds() == fds_before

        check()


@pytest.mark.parametrize("document", ["[" * 100_000, '{"a": ' * 100_000])
def test_json_nested_past_the_recursion_limit_is_a_config_error(document: str) -> None:
    with pytest.raises(ConfigError, match="nested too deeply"):
        OffloadingSettings.from_kv_transfer_config(document, worker_kv_bytes_per_block=4096)


@pytest.mark.parametrize("module_path", [".x", "..", ".kvoffload"])
def test_a_relative_module_path_is_a_config_error_for_policies_and_tiers(module_path: str) -> None:
    from kvoffload.cpu.policies import CachePolicyFactory
    from kvoffload.tiering.factory import SecondaryTierFactory

    with pytest.raises(ConfigError, match="cannot import"):
        CachePolicyFactory.get_cache_policy_cls("Mine", module_path)
    with pytest.raises(ConfigError, match="cannot import"):
        SecondaryTierFactory.get_tier_class({"type": "Mine", "module_path": module_path})
