"""The region behaves as vLLM 0.33's does where kvoffload used to differ, and keeps what it adds.

Each test names one behaviour: where each worker starts its pre-fault walk, how often the
populate probe runs, what the barrier does to the path, how a joiner's wait ends, the view
cursor's bound, host registrations at cleanup, and vLLM's attribute names. Regions live in a
private directory of /dev/shm (the ``root`` fixture) unless the test is about /dev/shm itself.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from kvoffload.cpu import prefault
from kvoffload.cpu import shared_offload_region as module
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion, _wait_for_file_size
from kvoffload.errors import (
    CreatorFailedError,
    InsufficientSpaceError,
    JoinTimeoutError,
    RegionError,
    ViewOverflowError,
)


def worker(
    engine_id: str, root: Path, rank: int, workers: int = 2, rows: int = 8, **kwargs: Any
) -> SharedOffloadRegion:
    """Worker ``rank`` of ``workers``, one page each in every row."""
    return SharedOffloadRegion(
        engine_id, rows, rank, workers * PAGESIZE, PAGESIZE, root=root, lifetime="vllm", **kwargs
    )


def record_first_faults(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Offsets of the first pre-fault after each probe, one per region constructed."""
    firsts: list[int] = []
    calls = {"n": 0}

    def write(mm: mmap.mmap, offset: int, length: int) -> None:
        calls["n"] += 1
        if calls["n"] == 2:  # the first call is the probe, on the mapping's first page
            firsts.append(offset)

    def probe(mm: mmap.mmap) -> prefault.PopulateWrite:
        calls["n"] = 0
        write(mm, 0, PAGESIZE)
        return write

    monkeypatch.setattr(module, "_get_populate_write_fn", probe)
    return firsts


# ----------------------------------------------------------------- where the walk starts


def test_each_worker_starts_its_pre_fault_walk_on_its_own_segment_file(
    engine_id: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    firsts = record_first_faults(monkeypatch)
    files = {"num_segments": 4, "min_segment_bytes": PAGESIZE, "populate_threads": 1}
    regions = [worker(engine_id, root, rank, workers=4, **files) for rank in range(4)]
    try:
        segments = regions[0]._segments
        assert len(segments) == 4

        def file_of(offset: int) -> int:
            return next(i for i, (_, at, length) in enumerate(segments) if at <= offset < at + length)

        assert [file_of(offset) for offset in firsts] == [0, 1, 2, 3]
        for region in regions:
            first_offset, _ = next(region.iter_worker_slot_ranges())
            assert file_of(first_offset) == region.rank
    finally:
        for region in regions:
            region.cleanup()


def test_the_threads_of_each_worker_start_on_files_no_other_walker_starts_on(
    engine_id: str, root: Path
) -> None:
    files = {"num_segments": 4, "min_segment_bytes": PAGESIZE, "populate": False}
    with worker(engine_id, root, 0, **files) as probe_only:
        rows_per_file = probe_only.segments[1].offset // probe_only.row_stride
    starts = set()
    for rank in range(2):
        with worker(engine_id, root, rank, **{**files, "populate": True, "populate_threads": 2}) as region:
            pieces = prefault.split_walk(region.populate_walk, region.populate_threads)
            starts |= {piece[0][0] // region.row_stride // rows_per_file for piece in pieces}
    assert starts == {0, 1, 2, 3}


def test_on_one_file_of_small_pages_every_worker_starts_at_the_first_row_like_vllm(
    engine_id: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    firsts = record_first_faults(monkeypatch)
    with worker(engine_id, root, 0) as first, worker(engine_id, root, 1) as second:
        assert len(first._segments) == 1
        assert firsts == [0, PAGESIZE]
        assert next(second.iter_worker_slot_ranges()) == (PAGESIZE, PAGESIZE)


# ----------------------------------------------------------------- the populate probe


def test_the_populate_probe_runs_once_for_every_mapping_not_once_per_process(
    engine_id: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probes: list[int] = []
    real = module._get_populate_write_fn

    def counting(mm: mmap.mmap) -> prefault.PopulateWrite:
        probes.append(id(mm))
        return real(mm)

    monkeypatch.setattr(module, "_get_populate_write_fn", counting)
    with worker(engine_id, root, 0) as first, worker(engine_id, root, 1) as second:
        assert probes == [id(first.mmap_obj), id(second.mmap_obj)]


def test_a_kernel_without_populate_write_pre_faults_by_touching_and_says_so(
    engine_id: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    def unsupported(mm: mmap.mmap, offset: int, length: int) -> None:
        raise OSError(errno.EINVAL, "not supported")

    monkeypatch.setattr(module, "_madvise_populate_write", unsupported)
    with worker(engine_id, root, None, rows=4) as region:  # type: ignore[arg-type]
        assert (region.populated_with, region.populate_threads) == ("touch", 1)
        assert os.stat(region.path).st_blocks * 512 == region.total_size_bytes


# ----------------------------------------------------------------- the barrier and the path


def test_after_the_barrier_the_path_is_gone_and_the_creator_no_longer_owns_a_name(
    engine_id: str, root: Path
) -> None:
    seen: list[bool] = []
    path = root / f"vllm_offload_{engine_id}.mmap"
    with worker(engine_id, root, 0, barrier=lambda: seen.append(path.exists())) as region:
        assert seen == [True]
        assert not path.exists()
        assert (region.creator, region._creator) == (True, False)
        region.create_kv_memoryview()[0, 0] = 7  # the mapping outlives the name
        assert region.mmap_obj is not None
        assert region.mmap_obj[0] == 7


def test_a_participant_that_fails_still_arrives_at_every_barrier_it_owes(
    engine_id: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    arrivals: list[bool] = []
    path = root / f"vllm_offload_{engine_id}.mmap"

    def fail(mm: mmap.mmap) -> prefault.PopulateWrite:
        raise ValueError("probe failed")

    monkeypatch.setattr(module, "_get_populate_write_fn", fail)
    with pytest.raises(ValueError, match="probe failed"):
        worker(engine_id, root, 0, barrier=lambda: arrivals.append(path.exists()), populate_shard=(0, 2))
    assert arrivals == [True, False]
    assert os.listdir(root) == []


# ----------------------------------------------------------------- a joiner's wait


def test_waiting_for_a_file_that_was_unlinked_is_a_creator_failure_and_a_runtime_error(root: Path) -> None:
    path = root / "stub"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        path.unlink()
        with pytest.raises(CreatorFailedError, match="creator failed") as info:
            _wait_for_file_size(fd, PAGESIZE, timeout=5)
        assert isinstance(info.value, RuntimeError)
    finally:
        os.close(fd)


def test_waiting_too_long_is_a_join_timeout_and_a_timeout_error(root: Path) -> None:
    fd = os.open(root / "stub", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        with pytest.raises(JoinTimeoutError, match="timed out") as info:
            _wait_for_file_size(fd, PAGESIZE, timeout=0.05)
        assert isinstance(info.value, TimeoutError)
    finally:
        os.close(fd)


def test_the_wait_ends_once_the_file_grows(root: Path) -> None:
    fd = os.open(root / "stub", os.O_CREAT | os.O_RDWR, 0o600)
    grow = threading.Timer(0.05, os.ftruncate, (fd, PAGESIZE))
    grow.start()
    try:
        _wait_for_file_size(fd, PAGESIZE, timeout=10)
        assert os.fstat(fd).st_size == PAGESIZE
    finally:
        grow.join()
        os.close(fd)


def test_a_joiner_that_finds_a_kvoffload_creator_dead_fails_at_once_not_at_the_timeout(
    engine_id: str, root: Path
) -> None:
    from kvoffload.shm.owner import OwnerRecord, write_owner

    # A creator's owner record on an unsized file nobody holds: its creator died before sizing.
    path = root / f"vllm_offload_{engine_id}.mmap"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        write_owner(fd, OwnerRecord.for_current_process(engine_id))
        with pytest.raises(CreatorFailedError, match="died before sizing"):
            _wait_for_file_size(fd, PAGESIZE, timeout=30, path=path)
    finally:
        os.close(fd)
        path.unlink()


# ----------------------------------------------------------------- views


def test_a_view_past_the_worker_slot_is_an_assertion_error_and_leaves_the_cursor(
    engine_id: str, root: Path
) -> None:
    with worker(engine_id, root, 1) as region:
        before = region._worker_offset
        with pytest.raises(ViewOverflowError, match="exceeds worker area end") as info:
            region.create_next_worker_view(PAGESIZE + 1)
        assert isinstance(info.value, AssertionError)
        assert isinstance(info.value, RegionError)
        assert region._worker_offset == before
        with pytest.raises(ViewOverflowError, match="exceeds the row stride"):
            region.create_next_canonical_view(2 * PAGESIZE + 1)


# ----------------------------------------------------------------- space, pinning, cleanup


def test_a_region_larger_than_the_free_space_is_refused_before_any_byte_is_sized(
    engine_id: str, root: Path
) -> None:
    free = os.statvfs(root).f_bavail * os.statvfs(root).f_frsize
    rows = free // PAGESIZE + 1
    with pytest.raises(InsufficientSpaceError, match="insufficient space"):
        SharedOffloadRegion(engine_id, rows, None, PAGESIZE, PAGESIZE, root=root)
    assert os.listdir(root) == []


def test_min_segment_bytes_is_read_when_the_region_is_made(
    engine_id: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(module, "_MIN_SEGMENT_BYTES", PAGESIZE)
    with worker(engine_id, root, 0, num_segments=2, populate=False) as region:
        assert [os.path.basename(path) for path, _, _ in region._segments] == [
            f"vllm_offload_{engine_id}.mmap",
            f"vllm_offload_{engine_id}.mmap.1",
        ]


def test_cleanup_unregisters_every_pinned_range_last_first_while_still_mapped(
    engine_id: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    undone: list[tuple[int, bool]] = []
    region = worker(engine_id, root, 0)
    mapping = region.mmap_obj
    assert mapping is not None
    monkeypatch.setattr(module, "host_unregister", lambda ptr: undone.append((ptr, mapping.closed)))
    region.pinned_addresses.extend([0x1000, 0x2000, 0x3000])
    region.is_pinned = True
    region.cleanup()
    assert undone == [(0x3000, False), (0x2000, False), (0x1000, False)]
    assert (region.is_pinned, region.pinned_addresses, mapping.closed) == (False, [], True)


def test_cleanup_keeps_a_mapping_a_native_user_still_exports_but_drops_the_name_and_fd(
    engine_id: str, root: Path
) -> None:
    import ctypes

    region = worker(engine_id, root, 0)
    assert region.mmap_obj is not None
    export = ctypes.c_char.from_buffer(region.mmap_obj)
    try:
        region.cleanup()
        assert region.mmap_obj is not None
        assert not region.mmap_obj.closed
        assert region.fd is None
        assert not os.path.exists(region.mmap_path)
    finally:
        del export
        region.mmap_obj.close()


def test_vllm_attribute_names_describe_the_region(engine_id: str, root: Path) -> None:
    with worker(engine_id, root, 1, rows=3) as region:
        assert region.mmap_path == str(root / f"vllm_offload_{engine_id}.mmap")
        assert (region.total_size_bytes, region._row_stride, region.page_size) == (
            3 * 2 * PAGESIZE,
            2 * PAGESIZE,
            PAGESIZE,
        )
        assert region._segments == [(region.mmap_path, 0, 3 * 2 * PAGESIZE)]
        assert region._base is not None
        assert region._base.data_ptr() == region.base_tensor.data_ptr()
        assert list(region.iter_worker_slot_ranges()) == [
            ((row * 2 + 1) * PAGESIZE, PAGESIZE) for row in range(3)
        ]
        assert region.fd is not None
        assert os.fstat(region.fd).st_size == region.total_size_bytes


def test_the_tiers_view_is_int8_rows_over_the_mapping_as_vllms(engine_id: str, root: Path) -> None:
    # vLLM hands secondary tiers numpy's int8 rows of its torch.int8 base: format "b", not bytes.
    with worker(engine_id, root, 1, rows=3) as region:
        view = region.create_kv_memoryview()
        try:
            assert (view.format, view.shape, view.itemsize) == ("b", (3, region._row_stride), 1)
            view[2, 5] = -1
            assert region.mmap_obj is not None
            assert region.mmap_obj[2 * region._row_stride + 5] == 0xFF
        finally:
            view.release()


# ----------------------------------------------------------------- pinning


def test_pinning_registers_whole_rows_in_chunks_and_cleanup_undoes_them(
    engine_id: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoffload.cpu import gpu_worker

    registered: list[tuple[int, int]] = []
    undone: list[int] = []
    monkeypatch.setattr(gpu_worker, "MAX_HOST_REGISTER_CHUNK_BYTES", 5 * PAGESIZE)

    def register(ptr: int, size: int) -> bool:
        registered.append((ptr, size))
        return True

    monkeypatch.setattr(gpu_worker, "host_register", register)
    monkeypatch.setattr(module, "host_unregister", undone.append)
    region = worker(engine_id, root, 0, rows=5)  # rows of 2 pages: chunks of 2 rows, then 1
    assert region._base is not None
    base = region._base.data_ptr()
    gpu_worker.pin_mmap_region(region)
    assert registered == [
        (base, 4 * PAGESIZE),
        (base + 4 * PAGESIZE, 4 * PAGESIZE),
        (base + 8 * PAGESIZE, 2 * PAGESIZE),
    ]
    assert region.is_pinned
    region.cleanup()
    assert undone == [base + 8 * PAGESIZE, base + 4 * PAGESIZE, base]


def test_a_refused_registration_leaves_the_region_wholly_pageable(
    engine_id: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvoffload.cpu import gpu_worker

    answers = iter([True, True, False])
    undone: list[int] = []
    monkeypatch.setattr(gpu_worker, "MIN_HOST_REGISTER_SAVED_BYTES", PAGESIZE)
    monkeypatch.setattr(gpu_worker, "host_register", lambda ptr, size: next(answers))
    monkeypatch.setattr(gpu_worker, "host_unregister", undone.append)
    with worker(engine_id, root, 1, workers=4, rows=3) as region:
        assert region._base is not None
        base = region._base.data_ptr()
        gpu_worker.pin_mmap_region(region, worker_slot_only=True)  # one slot of every row
        assert (region.is_pinned, region.pinned_addresses) == (False, [])
        assert undone == [base + 5 * PAGESIZE, base + PAGESIZE]
