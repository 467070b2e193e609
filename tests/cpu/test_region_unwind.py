"""The unwind and release branches of region init, ``create_worker`` and ``get_manager`` that the
cleanup-contract matrix does not reach: segment files, barriers owed to peers, hostile files at
the region's names, cleanup steps that fail, and buffers still exported at unmap.

Each test checks what the failing call leaves behind (the autouse fixture then checks this
process's fds and mappings).
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from kvoffload import faults
from kvoffload.cpu.shared_offload_region import SharedOffloadRegion
from kvoffload.cpu.spec import CPUOffloadingSpec
from kvoffload.errors import (
    ConfigError,
    InjectedFault,
    InsufficientSpaceError,
    JoinTimeoutError,
    RegionError,
    RegionReleasedError,
    RootError,
)
from kvoffload.release import Journal
from kvoffload.settings import PAGESIZE, OffloadingSettings
from kvoffload.shm import names
from kvoffload.shm.owner import OwnerRecord, write_owner
from tests.support.procs import write_file

SEGMENTS = 4


def make(engine_id: str, root: Path, **kwargs: Any) -> SharedOffloadRegion:
    """A one-file region: 4 rows of 2 pages, scheduler side."""
    return SharedOffloadRegion(engine_id, 4, None, 2 * PAGESIZE, PAGESIZE, root=root, **kwargs)


def segmented(engine_id: str, root: Path, **kwargs: Any) -> SharedOffloadRegion:
    """A region of 4 files, one row each (the minimum segment size lowered to a page)."""
    return SharedOffloadRegion(
        engine_id,
        SEGMENTS,
        None,
        PAGESIZE,
        PAGESIZE,
        num_segments=SEGMENTS,
        min_segment_bytes=PAGESIZE,
        root=root,
        **kwargs,
    )


def files(engine_id: str) -> list[str]:
    return [names.format_name(engine_id, i) for i in range(SEGMENTS)]


def steps(journal: Journal) -> list[tuple[str, bool]]:
    return [(s.what, s.ok) for s in journal.steps]


# --------------------------------------------------------------------- segment files


@pytest.mark.parametrize("point", ["region.mmap", "region.attach", "region.populate"])
def test_a_segmented_creator_that_fails_after_sizing_removes_every_file_it_created(
    root: Path, engine_id: str, point: str
) -> None:
    journal = Journal()
    with faults.scenario({point: "raise"}), pytest.raises(InjectedFault):
        segmented(engine_id, root, journal=journal)
    assert os.listdir(root) == []
    assert (f"unlink {files(engine_id)[0]} (creator)", True) in steps(journal)


@pytest.mark.parametrize("point", ["region.mmap", "region.attach", "region.populate"])
def test_a_segmented_joiner_that_fails_removes_nothing(root: Path, engine_id: str, point: str) -> None:
    creator = segmented(engine_id, root)
    try:
        before = {name: os.stat(root / name).st_ino for name in files(engine_id)}
        with faults.scenario({point: "raise"}), pytest.raises(InjectedFault):
            segmented(engine_id, root)
        assert {name: os.stat(root / name).st_ino for name in files(engine_id)} == before
    finally:
        creator.cleanup()
    assert os.listdir(root) == []


def test_a_segment_that_cannot_be_mapped_unwinds_the_joiner_and_the_creator_spares_the_impostor(
    root: Path, engine_id: str
) -> None:
    creator = segmented(engine_id, root)
    impostor = root / files(engine_id)[2]
    try:
        spare = root / "impostor"
        os.mkfifo(spare)
        os.replace(spare, impostor)  # segment 2 is a fifo now: it opens, but cannot be mapped
        with pytest.raises(OSError, match=rf"mmap of {impostor.name} failed"):
            segmented(engine_id, root)
    finally:
        creator.cleanup()
    # The creator removed its own files and left the name that no longer refers to its inode.
    assert os.listdir(root) == [impostor.name]
    impostor.unlink()


def test_a_segment_someone_else_removed_is_skipped_and_the_rest_are_removed(
    root: Path, engine_id: str
) -> None:
    journal = Journal()
    region = segmented(engine_id, root, journal=journal)
    (root / files(engine_id)[1]).unlink()
    region.cleanup()
    assert os.listdir(root) == []
    assert (f"unlink {files(engine_id)[0]} (creator)", True) in steps(journal)


def test_populating_reports_progress_up_to_the_whole_region(root: Path, engine_id: str) -> None:
    seen: list[tuple[int, int]] = []
    with make(engine_id, root, progress=lambda done, todo: seen.append((done, todo))):
        pass
    assert seen
    assert seen[-1] == (8 * PAGESIZE, 8 * PAGESIZE)


def test_a_segment_name_taken_before_creation_fails_the_creator_and_is_left_alone(
    root: Path, engine_id: str
) -> None:
    planted = write_file(root / files(engine_id)[2])
    journal = Journal()
    with pytest.raises(FileExistsError):
        segmented(engine_id, root, journal=journal)
    assert os.listdir(root) == [planted.name]
    assert planted.read_bytes()[:1] == b"x"
    assert (f"unlink {files(engine_id)[0]} (creator)", True) in steps(journal)


# -------------------------------------------------------------------------- barriers


class Barrier:
    """Counts arrivals; raises ``error`` from arrival ``fail_from`` on."""

    def __init__(self, error: BaseException | None = None, fail_from: int = 1) -> None:
        self.calls = 0
        self.error = error
        self.fail_from = fail_from

    def __call__(self) -> None:
        self.calls += 1
        if self.error is not None and self.calls >= self.fail_from:
            raise self.error


@pytest.mark.parametrize(("shard", "arrivals"), [(None, 1), ((0, 2), 2)])
def test_a_creator_behind_a_barrier_unlinks_once_its_peers_arrived(
    root: Path, engine_id: str, shard: tuple[int, int] | None, arrivals: int
) -> None:
    barrier = Barrier()
    with make(engine_id, root, barrier=barrier, populate_shard=shard) as region:
        assert barrier.calls == arrivals
        assert region.unlinked
        assert os.listdir(root) == []  # vLLM PR #52596: nothing to leak once everyone mapped it
        view = region.create_kv_memoryview()
        view[3, 0] = 7
        assert view[3, 0] == 7
        view.release()


@pytest.mark.parametrize(
    ("point", "shard", "arrivals", "released"),
    [
        ("region.open", None, 1, 1),
        ("region.mmap", None, 1, 1),
        ("region.populate", None, 1, 0),  # it had arrived at the attach barrier already
        ("region.open", (0, 2), 2, 2),
        ("region.attach", (0, 2), 2, 2),
        ("region.populate", (0, 2), 2, 1),
    ],
)
def test_a_participant_that_fails_still_arrives_at_every_barrier_it_owes(
    root: Path, engine_id: str, point: str, shard: tuple[int, int] | None, arrivals: int, released: int
) -> None:
    barrier = Barrier()
    journal = Journal()
    with faults.scenario({point: "raise"}), pytest.raises(InjectedFault):
        make(engine_id, root, barrier=barrier, populate_shard=shard, journal=journal)
    assert barrier.calls == arrivals  # peers blocked in the barrier are never left hanging
    assert steps(journal).count(("release peers at the barrier", True)) == released
    assert os.listdir(root) == []


def test_a_barrier_that_fails_while_releasing_peers_does_not_hide_the_original_error(
    root: Path, engine_id: str
) -> None:
    barrier = Barrier(RuntimeError("peer gone"))
    journal = Journal()
    with faults.scenario({"region.mmap": "raise"}), pytest.raises(InjectedFault):
        make(engine_id, root, barrier=barrier, journal=journal)
    [release] = [s for s in journal.steps if s.what == "release peers at the barrier"]
    assert (release.ok, release.error) == (False, "RuntimeError: peer gone")
    assert os.listdir(root) == []


def test_a_barrier_that_fails_at_attach_unwinds_the_creator_and_is_not_called_again(
    root: Path, engine_id: str
) -> None:
    barrier = Barrier(TimeoutError("peers never arrived"))
    with pytest.raises(TimeoutError, match="peers never arrived"):
        make(engine_id, root, barrier=barrier)
    assert barrier.calls == 1
    assert os.listdir(root) == []


# ------------------------------------------------------------- what the creator finds


def test_a_memory_check_that_refuses_unwinds_the_creator(root: Path, engine_id: str) -> None:
    def refuse(total: int) -> None:
        raise InsufficientSpaceError(root / "x", total, 0)

    journal = Journal()
    with pytest.raises(InsufficientSpaceError):
        make(engine_id, root, creator_memory_check=refuse, journal=journal)
    assert os.listdir(root) == []
    assert [what for what, ok in steps(journal) if ok] == [
        f"unlink {files(engine_id)[0]} (creator)",
        f"close fd of {files(engine_id)[0]}",
        f"close root fd of {files(engine_id)[0]}",
    ]


def test_a_region_larger_than_the_free_space_is_refused_before_it_is_sized(
    root: Path, engine_id: str
) -> None:
    vfs = os.statvfs(root)
    rows = (vfs.f_bavail * vfs.f_frsize) // (2 * PAGESIZE) + 1024
    with pytest.raises(InsufficientSpaceError, match="required") as info:
        SharedOffloadRegion(engine_id, rows, None, 2 * PAGESIZE, PAGESIZE, root=root)
    assert info.value.required > info.value.free
    assert os.listdir(root) == []


def test_a_fifo_at_the_region_name_is_refused_and_left_alone(root: Path, engine_id: str) -> None:
    fifo = root / files(engine_id)[0]
    os.mkfifo(fifo)
    with pytest.raises(RegionError, match="is not a regular file"):
        make(engine_id, root)
    assert os.listdir(root) == [fifo.name]
    fifo.unlink()


def test_a_root_that_is_a_file_is_a_root_error(tmp_path: Path, engine_id: str) -> None:
    with pytest.raises(RootError, match="is not a directory"):
        make(engine_id, write_file(tmp_path / "not-a-dir"))


def test_a_joiner_waiting_for_a_live_but_slow_creator_times_out_and_leaves_its_file(
    root: Path, engine_id: str
) -> None:
    path = root / files(engine_id)[0]
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # a creator that never sizes it
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        assert write_owner(fd, OwnerRecord.for_current_process(engine_id))
        with pytest.raises(JoinTimeoutError, match="timed out"):
            make(engine_id, root, join_timeout_s=0.3)
        assert os.fstat(fd).st_nlink == 1
    finally:
        os.close(fd)
        path.unlink()


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"num_chunks": 0}, "num_chunks"),
        ({"cpu_page_size": 0}, "cpu_page_size"),
        ({"cpu_page_size": 4 * PAGESIZE}, "cpu_page_size"),
        ({"rank": -1}, "rank"),
        ({"populate_shard": (2, 2)}, "populate_shard"),
        ({"participant": 0}, "participants"),
        ({"participant": 3, "participants": 2}, "participant"),
        ({"lifetime": "forever"}, "lifetime"),
    ],
)
def test_invalid_arguments_are_refused_before_anything_exists(
    root: Path, engine_id: str, kwargs: dict[str, Any], key: str
) -> None:
    args: dict[str, Any] = {
        "num_chunks": 4,
        "rank": None,
        "kv_bytes_per_chunk": 2 * PAGESIZE,
        "cpu_page_size": PAGESIZE,
        **kwargs,
    }
    with pytest.raises(ConfigError) as info:
        SharedOffloadRegion(engine_id, root=root, **args)
    assert info.value.key == key
    assert os.listdir(root) == []


# ---------------------------------------------------------------------- release steps


def test_every_release_step_runs_when_one_fails_and_the_first_failure_is_raised(
    root: Path, engine_id: str
) -> None:
    journal = Journal()
    region = make(engine_id, root, journal=journal)
    assert region.fd is not None
    os.close(region.fd)  # closed behind its back: its own close will fail with EBADF
    with pytest.raises(OSError, match="Bad file descriptor"):
        region.cleanup()
    name = files(engine_id)[0]
    assert steps(journal) == [
        (f"unmap {name}", True),
        (f"close fd of {name}", False),
        (f"unlink {name} (creator)", True),
        (f"close root fd of {name}", True),
    ]
    assert os.listdir(root) == []


def test_a_cleanup_fault_and_a_failing_step_are_both_reported(root: Path, engine_id: str) -> None:
    region = make(engine_id, root)
    assert region.fd is not None
    os.close(region.fd)
    faults.configure({"cleanup.region": "raise"})
    with pytest.raises(InjectedFault) as info:
        region.cleanup()
    assert any("Bad file descriptor" in note for note in getattr(info.value, "__notes__", []))
    assert os.listdir(root) == []


def test_a_creator_whose_file_someone_else_removed_journals_no_unlink(root: Path, engine_id: str) -> None:
    journal = Journal()
    region = make(engine_id, root, journal=journal)
    os.unlink(region.path)
    region.cleanup()
    assert [what for what, _ in steps(journal)] == [
        f"unmap {region.path.name}",
        f"close fd of {region.path.name}",
        f"close root fd of {region.path.name}",
    ]


def test_a_released_region_gives_no_views_and_no_identity(root: Path, engine_id: str) -> None:
    region = make(engine_id, root)
    assert region.identity is not None
    region.cleanup()
    assert region.identity is None
    with pytest.raises(RegionReleasedError):
        region.create_kv_memoryview()


def test_an_export_kept_alive_by_a_reference_cycle_is_collected_before_unmapping(
    root: Path, engine_id: str
) -> None:
    pytest.importorskip("torch")
    journal = Journal()
    region = make(engine_id, root, journal=journal)
    gc.disable()  # keep the cycle alive until cleanup collects it itself
    try:
        cycle: list[Any] = [region.base_tensor]
        cycle.append(cycle)
        del cycle
        region.cleanup()
    finally:
        gc.enable()
    assert steps(journal)[0] == (f"unmap {region.path.name}", True)
    assert os.listdir(root) == []


def test_a_buffer_still_exported_keeps_the_mapping_rather_than_leave_it_dangling(
    root: Path, engine_id: str, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("torch")
    region = make(engine_id, root)
    tensor = region.base_tensor
    tensor[5] = 9
    with caplog.at_level(logging.WARNING, logger="kvoffload.cpu.shared_offload_region"):
        region.cleanup()
    assert "buffers are still exported" in caplog.text
    assert int(tensor[5]) == 9  # still mapped: reading it is safe
    assert os.listdir(root) == []  # the file is gone; the memory goes with the last export
    del tensor, region
    gc.collect()


# ------------------------------------------------------------------------------ specs

KV_BYTES_PER_BLOCK = PAGESIZE // 2


def cpu_config(engine_id: str, root: Path, *, replicated_layout: bool = False) -> OffloadingSettings:
    settings = {"cpu_bytes_to_use": 8 * PAGESIZE, "blocks_per_chunk": 2}
    return OffloadingSettings.from_kv_transfer_config(
        json.dumps({"engine_id": engine_id, "kv_connector_extra_config": settings}),
        worker_kv_bytes_per_block=KV_BYTES_PER_BLOCK,
        replicated_layout=replicated_layout,
        root=root,
    )


def test_the_cpu_managers_are_built_once_and_allocate_no_region(root: Path, engine_id: str) -> None:
    spec = CPUOffloadingSpec.from_settings(cpu_config(engine_id, root))
    manager = spec.get_manager()
    assert spec.get_manager() is manager
    assert os.listdir(root) == []


def test_a_worker_whose_region_would_hold_no_chunk_maps_no_file(root: Path, engine_id: str) -> None:
    torch = pytest.importorskip("torch")
    config = OffloadingSettings.from_kv_transfer_config(
        json.dumps({"engine_id": engine_id, "kv_connector_extra_config": {"cpu_bytes_to_use": PAGESIZE}}),
        worker_kv_bytes_per_block=4 * PAGESIZE,
        root=root,
    )
    spec = CPUOffloadingSpec.from_settings(config)
    assert spec.num_chunks == 0
    worker = spec.create_worker([torch.zeros(2, 4 * PAGESIZE, dtype=torch.int8)])
    try:
        assert os.listdir(root) == []  # a zero-byte file cannot be mapped: empty private buffers, as vLLM
    finally:
        worker.shutdown()


def test_a_replicated_worker_populates_its_shard_between_two_barriers_and_is_built_once(
    root: Path, engine_id: str
) -> None:
    torch = pytest.importorskip("torch")
    config = cpu_config(engine_id, root, replicated_layout=True)
    barrier = Barrier()
    spec = CPUOffloadingSpec.from_settings(config, barrier=barrier)
    caches = [torch.zeros(16, KV_BYTES_PER_BLOCK, dtype=torch.int8)]
    worker = spec.get_worker(caches)
    try:
        assert spec.get_worker(caches) is worker
        assert barrier.calls == 2  # after mapping, and after populating its shard
        assert os.listdir(root) == []  # unlinked at the first barrier: nothing can leak
    finally:
        worker.shutdown()


def test_a_worker_that_fails_behind_a_barrier_still_releases_its_peers(root: Path, engine_id: str) -> None:
    torch = pytest.importorskip("torch")
    config = cpu_config(engine_id, root)
    barrier = Barrier()
    spec = CPUOffloadingSpec.from_settings(config, barrier=barrier)
    caches = [torch.zeros(16, KV_BYTES_PER_BLOCK, dtype=torch.int8)]
    with faults.scenario({"region.populate": "raise"}), pytest.raises(InjectedFault):
        spec.create_worker(caches)
    assert barrier.calls == 1
    assert os.listdir(root) == []
