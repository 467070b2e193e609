"""``ScanOptions``: the scan's settings as one value, and the separate keywords kept for one release."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.liveness.reap import reap
from kvoffload.liveness.scan import ScanOptions, ScanStream, Status, scan
from kvoffload.liveness.watch import DEFAULT_GRACE_S, WatchConfig
from tests.support.procs import region_path, write_file


def test_options_passed_whole_judge_as_the_separate_keywords_did(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    whole = scan(root, ScanOptions(grace_s=0, use_lease=True))
    apart = scan(root, grace_s=0, use_lease=True)
    assert [(e.name, e.status, e.reason) for e in whole.entries] == [
        (path.name, Status.ORPHANED, apart.entries[0].reason)
    ]
    assert (whole.grace_s, whole.lease_enabled) == (apart.grace_s, apart.lease_enabled) == (0.0, True)


def test_a_keyword_given_beside_options_is_laid_over_them() -> None:
    given = ScanOptions(grace_s=5, use_lease=False)
    assert ScanOptions.of(given, {"grace_s": 0}) == ScanOptions(grace_s=0, use_lease=False)
    assert ScanOptions.of(given, {}) is given
    assert ScanOptions.of(None, {}, default=given) is given


def test_vouched_pids_given_as_any_collection_are_held_as_a_set() -> None:
    apart = ScanOptions.of(None, {"assume_not_holding": [3, 1, 3]})
    assert apart == ScanOptions(assume_not_holding=frozenset({1, 3}))


def test_an_unknown_scan_keyword_is_a_type_error(root: Path) -> None:
    with pytest.raises(TypeError, match="grace"):
        scan(root, grace=0)  # type: ignore[call-arg]


def test_a_negative_grace_is_refused_however_it_is_given(root: Path) -> None:
    with pytest.raises(ConfigError) as whole:
        scan(root, ScanOptions(grace_s=-1))
    with pytest.raises(ConfigError) as apart:
        ScanStream(root, grace_s=-1)
    with pytest.raises(ConfigError) as agent:
        WatchConfig(roots=(str(root),), scan=ScanOptions(grace_s=-1))
    assert (whole.value.key, apart.value.key, agent.value.key) == ("grace", "grace", "--grace")


def test_reap_takes_the_options_whole(root: Path, engine_id: str) -> None:
    path = write_file(region_path(root, engine_id))
    done = reap(root, ScanOptions(grace_s=0))
    assert [e.name for e in done.removed] == [path.name]
    assert not path.exists()


def test_the_agent_judges_with_its_own_grace_unless_told(root: Path) -> None:
    config = WatchConfig(roots=(str(root),))
    assert config.scan == ScanOptions(grace_s=DEFAULT_GRACE_S)
    apart = WatchConfig(roots=(str(root),), grace_s=0, use_lease=False)
    whole = WatchConfig(roots=(str(root),), scan=ScanOptions(grace_s=0, use_lease=False))
    assert apart == whole
    # The settings read as attributes, as before they were one value: kept for one release.
    assert (apart.grace_s, apart.use_lease, apart.all_users) == (0, False, None)
