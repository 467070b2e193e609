"""Names moved by issue #29 still import from their old modules, for one release, as the same objects."""

from __future__ import annotations

import importlib

import pytest

#: old module -> the modules its public names moved to.
MOVED = {
    "kvoffload.liveness.guard": ("kvoffload.liveness.watchdog",),
    "kvoffload.liveness.park": (
        "kvoffload.liveness.park.directory",
        "kvoffload.liveness.park.trust",
        "kvoffload.liveness.park.views",
    ),
    "kvoffload.liveness.scan": (
        "kvoffload.liveness.listing",
        "kvoffload.liveness.park.views",
        "kvoffload.liveness.probe",
        "kvoffload.liveness.report",
    ),
    "kvoffload.liveness.watch": ("kvoffload.liveness.events", "kvoffload.liveness.roots"),
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_every_name_an_old_module_exports_is_its_new_homes_own(old: str) -> None:
    module = importlib.import_module(old)
    homes = [importlib.import_module(new) for new in MOVED[old]]
    moved = [name for name in module.__all__ if any(hasattr(home, name) for home in homes)]
    assert moved
    for name in moved:
        assert all(getattr(module, name) is getattr(h, name) for h in homes if hasattr(h, name)), name


def test_the_old_watch_module_still_exports_what_it_did() -> None:
    from kvoffload.liveness import watch

    before = {
        "DEFAULT_GRACE_S", "DEFAULT_INTERVAL_S", "DEFAULT_TOP_ENGINES", "KUBELET_ROOTS", "Event",
        "KeptOtherUser", "KeptParked", "KeptUnknown", "ParkRemoved", "ParkUntrusted", "ParkedSettled",
        "PassReport", "PassSummary", "RemovalFailed", "RemovalRefused", "Removed", "RemovedFile",
        "RootAppeared", "RootIdentity", "RootNoMatch", "RootPass", "RootReap", "RootReplaced",
        "RootResolved", "RootScan", "RootUnreadable", "RootVanished", "Usage", "WatchConfig",
        "Watcher", "pod_uid_of", "root_identity", "KUBELET_DIRECTORIES",
    }  # fmt: skip
    assert before <= set(watch.__all__)
    assert all(hasattr(watch, name) for name in before)


def test_the_old_guard_module_still_exports_what_it_did() -> None:
    from kvoffload.liveness import guard

    before = {
        "DISABLE_ENV",
        "POLL_S",
        "HOLD_LIMIT_S",
        "SLOTS",
        "GuardStatus",
        "start",
        "status",
        "hold",
        "adopt",
        "drop",
    }
    assert all(hasattr(guard, name) for name in before)


def test_the_park_package_still_exports_what_the_park_module_did() -> None:
    from kvoffload.liveness import park

    before = {
        "MARK_PREFIX", "PARK_PREFIX", "RENAME_NOREPLACE", "Adopter", "FoundPark", "Moved", "ParkDir",
        "ParkName", "ParkOutcome", "RootId", "Untrusted", "adopt", "is_park_name", "judge", "mark_name",
        "parse_park_name", "remove_dead", "renameat2", "unlink_proven", "NO_MARK", "Identity",
        "format_park_name", "lock_held", "open_park",
    }  # fmt: skip
    assert all(hasattr(park, name) for name in before)


def test_the_old_scan_module_still_exports_what_it_did() -> None:
    from kvoffload.liveness import scan

    before = {
        "DEFAULT_GRACE_S", "DEFAULT_ROOT", "SCHEMA_VERSION", "Evidence", "OwnerView", "ParkView",
        "ParkedView", "ScanEntry", "ScanReport", "ScanStream", "ScanSummary", "Status", "UntrustedPark",
        "open_root", "scan", "STREAM_CHUNK_FILES", "open_probe_fd", "uids_text",
    }  # fmt: skip
    assert before <= set(scan.__all__)
    assert all(hasattr(scan, name) for name in before)
