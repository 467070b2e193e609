"""Pre-faulting a region: what each participant faults, in which order, on how many threads,
how a failure in one thread ends them all, and what huge pages change.

Regions are real tmpfs files (a private directory on /dev/shm, or a tmpfs the test mounts
as root); nothing here measures time.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.cpu.prefault import (
    DEFAULT_MAX_POPULATE_THREADS,
    MAX_POPULATE_THREADS,
    POPULATE_STEP,
    cut_steps,
    default_populate_threads,
    prefault,
    rotate,
    split_walk,
    widen_to_huge_pages,
)
from kvoffload.cpu.segments import plan_segments
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
from kvoffload.errors import ConfigError, InsufficientSpaceError
from tests.support.hostile import fill_after_the_space_check
from tests.support.mounts import mounted_tmpfs

MIB = 1 << 20
HUGE = 2 * MIB


def region(
    engine_id: str, root: Path, rows: int = 16, rank: int | None = None, **kwargs: Any
) -> SharedOffloadRegion:
    """``rows`` rows of 2 pages; a ranked worker owns one page of each."""
    return SharedOffloadRegion(engine_id, rows, rank, 2 * PAGESIZE, PAGESIZE, root=root, **kwargs)


def resident(path: Path) -> int:
    return os.stat(path).st_blocks * 512


# ----------------------------------------------------------------- the walk, as data


def test_a_walk_is_cut_into_consecutive_pieces_of_nearly_equal_bytes() -> None:
    assert split_walk([(0, 8 * PAGESIZE)], 2) == [[(0, 4 * PAGESIZE)], [(4 * PAGESIZE, 8 * PAGESIZE)]]
    ranges = [(0, PAGESIZE), (2 * PAGESIZE, 3 * PAGESIZE), (4 * PAGESIZE, 5 * PAGESIZE)]
    assert split_walk(ranges, 2) == [ranges[:2], ranges[2:]]


def test_a_walk_is_cut_on_whole_granules_and_never_into_empty_pieces() -> None:
    assert split_walk([(0, 3 * HUGE)], 2, HUGE) == [[(0, 2 * HUGE)], [(2 * HUGE, 3 * HUGE)]]
    assert split_walk([(0, PAGESIZE)], 4) == [[(0, PAGESIZE)]]
    assert split_walk([], 4) == []


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_the_pieces_of_a_walk_cover_it_exactly_in_order(parts: int) -> None:
    walk = [(10 * PAGESIZE, 17 * PAGESIZE), (0, 3 * PAGESIZE), (20 * PAGESIZE, 21 * PAGESIZE)]
    pieces = split_walk(walk, parts)
    assert len(pieces) <= parts
    flat = [r for piece in pieces for r in piece]
    assert [p for s, e in flat for p in range(s, e, PAGESIZE)] == [
        p for s, e in walk for p in range(s, e, PAGESIZE)
    ]


def test_a_piece_is_cut_into_steps_from_each_ranges_start_and_small_ranges_share_a_step() -> None:
    # Steps of 2 huge pages: a long range is cut every step from its own (aligned) start.
    assert cut_steps([(HUGE, 6 * HUGE)], 2 * HUGE) == [
        [(HUGE, 3 * HUGE)],
        [(3 * HUGE, 5 * HUGE)],
        [(5 * HUGE, 6 * HUGE)],
    ]
    # A worker's slots (one page per row) fill a step before the next one begins.
    slots = [(row * 2 * PAGESIZE, row * 2 * PAGESIZE + PAGESIZE) for row in range(5)]
    assert cut_steps(slots, 2 * PAGESIZE) == [slots[:2], slots[2:4], slots[4:]]
    # A range that does not fit what is left of a step begins a step of its own.
    assert cut_steps([(0, PAGESIZE), (HUGE, 3 * HUGE)], 2 * HUGE) == [[(0, PAGESIZE)], [(HUGE, 3 * HUGE)]]
    assert cut_steps([], HUGE) == []


def test_a_rotated_walk_starts_at_the_given_byte_and_wraps_around() -> None:
    assert rotate([(0, 10), (20, 30), (40, 50)], 25) == [(25, 30), (40, 50), (0, 10), (20, 25)]
    assert rotate([(0, 100)], 0) == [(0, 100)]
    assert rotate([(0, 100)], 40) == [(40, 100), (0, 40)]


def test_ranges_widen_to_the_huge_pages_of_their_own_file() -> None:
    # Three files of 4, 4 and 2 pages; "huge pages" of 4 pages, aligned in each file.
    segments = plan_segments("e", 5, 2 * PAGESIZE, 3, 2 * PAGESIZE)
    assert widen_to_huge_pages([(PAGESIZE, PAGESIZE + 1)], segments, 4 * PAGESIZE) == [(0, 4 * PAGESIZE)]
    assert widen_to_huge_pages([(5 * PAGESIZE, 6 * PAGESIZE)], segments, 4 * PAGESIZE) == [
        (4 * PAGESIZE, 8 * PAGESIZE)
    ]
    # A file's tail shorter than a huge page stays its own size.
    assert widen_to_huge_pages([(9 * PAGESIZE, 10 * PAGESIZE)], segments, 4 * PAGESIZE) == [
        (8 * PAGESIZE, 10 * PAGESIZE)
    ]


# ----------------------------------------------------------------- how many threads


def test_the_default_thread_count_is_the_cpus_shared_among_participants_and_capped() -> None:
    gib = 1 << 30
    assert default_populate_threads(gib, cpus=2) == 2
    assert default_populate_threads(gib, participants=2, cpus=2) == 1
    assert default_populate_threads(64 * gib, cpus=128) == DEFAULT_MAX_POPULATE_THREADS
    assert default_populate_threads(64 * gib, participants=8, cpus=32) == 4


def test_a_small_region_is_not_worth_a_thread_by_default() -> None:
    assert default_populate_threads(MIB, cpus=64) == 1
    assert default_populate_threads(128 * MIB, cpus=64) == 2


def test_the_default_follows_this_processs_cpu_affinity() -> None:
    assert default_populate_threads(1 << 40) == min(
        DEFAULT_MAX_POPULATE_THREADS, len(os.sched_getaffinity(0))
    )


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2", MAX_POPULATE_THREADS + 1])
def test_a_thread_count_that_is_not_one_is_a_config_error_before_any_file(
    engine_id: str, root: Path, value: object
) -> None:
    with pytest.raises(ConfigError, match=r"^populate_threads: .* is not a thread count in 1\.\.256"):
        region(engine_id, root, populate_threads=value)
    assert os.listdir(root) == []


# ----------------------------------------------------------------- what gets faulted


@pytest.mark.parametrize("threads", [1, 2, 5])
def test_every_page_of_the_region_is_faulted_on_any_number_of_threads(
    engine_id: str, root: Path, threads: int
) -> None:
    with region(engine_id, root, populate_threads=threads) as r:
        assert (r.populated_with, r.populate_threads) == ("madvise", threads)
        assert resident(r.path) == r.total_bytes


def test_pre_faulting_on_threads_keeps_the_bytes_already_written(engine_id: str, root: Path) -> None:
    creator = region(engine_id, root, populate=False, lifetime="vllm")
    try:
        view = creator.create_kv_memoryview()
        view[0, 5], view[15, 2 * PAGESIZE - 1] = 0x11, 0x22
        view.release()
        with region(engine_id, root, populate_threads=4, lifetime="vllm") as joiner:
            seen = joiner.create_kv_memoryview()
            assert (seen[0, 5], seen[15, 2 * PAGESIZE - 1]) == (0x11, 0x22)
            seen.release()
    finally:
        creator.cleanup()


def test_a_worker_on_4k_pages_faults_only_its_own_slot_of_every_row(engine_id: str, root: Path) -> None:
    with region(engine_id, root, rank=1, populate_threads=2) as worker:
        assert sorted(worker.populate_walk) == worker.slot_ranges()
        # Plus the page the probe for MADV_POPULATE_WRITE faults: the mapping's first, as in vLLM.
        assert resident(worker.path) == worker.total_bytes // 2 + PAGESIZE


def test_a_worker_starts_its_walk_at_its_own_fraction_of_the_rows_like_vllm(
    engine_id: str, root: Path
) -> None:
    # Four files of four rows. Two slots per row: worker 1 starts at row 16 // 2 = 8 (vLLM's
    # rank * rows // slots), the first row of the third file.
    files = {"num_segments": 4, "min_segment_bytes": PAGESIZE}
    with region(engine_id, root, rank=1, populate_threads=1, **files) as worker:
        assert worker.populate_walk[0] == (8 * 2 * PAGESIZE + PAGESIZE, 9 * 2 * PAGESIZE)
    # With two threads each, the four walkers (2 workers x 2 threads) start on rows 0, 4, 8, 12.
    with region(engine_id, root, rank=1, populate_threads=2, **files) as worker:
        assert worker.populate_walk[0][0] == 4 * 2 * PAGESIZE + PAGESIZE
    # On one file of 4 KiB pages every worker starts at row 0, as in vLLM.
    with region(engine_id, root, rank=1, populate_threads=1) as worker:
        assert worker.populate_walk[0] == (PAGESIZE, 2 * PAGESIZE)


def test_a_populate_shard_faults_only_its_share(engine_id: str, root: Path) -> None:
    with region(engine_id, root, rank=0, populate_shard=(1, 4), populate_threads=3) as r:
        quarter = r.total_bytes // 4
        assert r.populate_walk == ((quarter, 2 * quarter),)
        assert resident(r.path) == quarter + PAGESIZE  # and the probe's first page


# ----------------------------------------------------------------- progress


def test_progress_comes_from_the_calling_thread_and_ends_at_the_whole_walk(
    engine_id: str, root: Path
) -> None:
    seen: list[tuple[int, int, int]] = []
    progress = lambda done, total: seen.append((threading.get_ident(), done, total))  # noqa: E731
    with region(engine_id, root, rows=64, populate_threads=3, progress=progress) as r:
        total = r.total_bytes
    assert seen
    assert {ident for ident, _, _ in seen} == {threading.get_ident()}
    assert [done for _, done, _ in seen] == sorted({done for _, done, _ in seen})
    assert seen[-1][1:] == (total, total)


def test_a_worker_of_many_rows_reports_progress_a_few_times_not_once_per_row(
    engine_id: str, root: Path
) -> None:
    seen: list[tuple[int, int]] = []
    with region(engine_id, root, rows=4096, rank=0, populate_threads=1, progress=lambda *a: seen.append(a)):
        pass
    assert seen[-1] == (4096 * PAGESIZE, 4096 * PAGESIZE)
    assert len(seen) < 4096 // 16


# ----------------------------------------------------------------- failures


def test_the_first_error_of_a_thread_is_raised_after_every_thread_returned() -> None:
    calls: list[int] = []
    lock = threading.Lock()

    def fault(offset: int, length: int) -> None:
        with lock:
            calls.append(offset)
        if offset == 0:
            raise OSError(errno.EIO, "injected at offset 0")

    pieces = [[(0, 64 * MIB)], [(64 * MIB, 128 * MIB)], [(128 * MIB, 1024 * MIB)]]
    with pytest.raises(OSError, match="injected at offset 0"):
        prefault(pieces, fault)
    # The long third piece stopped early: it did not walk all its 896 MiB (in 16 MiB steps).
    assert len([c for c in calls if c >= 128 * MIB]) < 896 // 64


def test_a_thread_that_is_done_takes_the_steps_left_of_a_thread_held_back() -> None:
    # Piece 0's thread is held in its first step until every other step is done: the thread
    # of the short piece 1 must have faulted the rest of piece 0 by then, from its far end.
    step = POPULATE_STEP
    faulted: dict[int, str] = {}
    rest_done = threading.Event()

    def fault(offset: int, length: int) -> None:
        if offset == 0:
            rest_done.wait(timeout=30)
        faulted[offset] = threading.current_thread().name
        if len(faulted) == 5:  # all but (0, step)
            rest_done.set()

    prefault([[(0, 4 * step)], [(4 * step, 6 * step)]], fault)
    assert rest_done.is_set()
    assert faulted[0] == "kvoffload-populate-0"
    assert {faulted[at] for at in (step, 2 * step, 3 * step)} == {"kvoffload-populate-1"}


def test_an_interrupted_caller_stops_the_threads_and_the_region_unwinds(engine_id: str, root: Path) -> None:
    def interrupt(done: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        region(engine_id, root, rows=64, populate_threads=2, progress=interrupt)
    assert os.listdir(root) == []
    assert [t.name for t in threading.enumerate() if t.name.startswith("kvoffload-populate")] == []


@pytest.mark.parametrize("threads", [1, 2])
def test_a_file_cut_short_under_the_walk_fails_it_with_efault_and_the_joiner_unwinds(
    engine_id: str, root: Path, threads: int
) -> None:
    creator = region(engine_id, root, rows=64, populate=False, lifetime="vllm")
    try:
        # Once the joiner has mapped the file (its barrier: the step before the walk), the file
        # shrinks to a quarter.
        def cut() -> None:
            os.truncate(creator.path, creator.total_bytes // 4)

        with pytest.raises(OSError, match="MADV_POPULATE_WRITE of bytes") as info:
            region(engine_id, root, rows=64, lifetime="vllm", populate_threads=threads, barrier=cut)
        assert info.value.errno == errno.EFAULT
        assert str(creator.path) in str(info.value)
        assert os.listdir(root) == [creator.path.name]  # a joiner never removes the file
        assert os.stat(creator.path).st_size == creator.total_bytes // 4  # nor grows it back
    finally:
        creator.cleanup()


# ----------------------------------------------------------------- real mounts (root)


@pytest.fixture
def tmpfs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A tmpfs mounted with the options of ``request.param`` (needs root)."""
    with mounted_tmpfs(tmp_path / "tmpfs", request.param) as point:
        yield point


def pmd_mapped_bytes(path: Path) -> int:
    """ShmemPmdMapped of this process's mapping of ``path``: its bytes mapped as huge pages."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    total = 0
    for i, line in enumerate(lines):
        if line.endswith(str(path)) or line.endswith(f"{path} (deleted)"):
            for detail in lines[i + 1 : i + 30]:
                if detail.startswith("ShmemPmdMapped:"):
                    total += int(detail.split()[1]) * 1024
                    break
    return total


def shmem_allows_huge_pages() -> bool:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read_text()
    except OSError:
        return False
    return "[deny]" not in text


@pytest.mark.root
@pytest.mark.parametrize("tmpfs", ["size=64m,huge=within_size", "size=64m,huge=advise"], indirect=True)
def test_a_region_on_a_huge_page_tmpfs_is_mapped_in_huge_pages(engine_id: str, tmpfs: Path) -> None:
    if not shmem_allows_huge_pages():
        pytest.skip("shmem_enabled denies huge pages on this host")
    with SharedOffloadRegion(engine_id, 8, None, MIB, MIB, root=tmpfs, lifetime="vllm") as r:
        assert r.huge_pages in ("within_size", "advise")
        assert pmd_mapped_bytes(r.path) == 8 * MIB


@pytest.mark.root
@pytest.mark.parametrize("tmpfs", ["size=64m,huge=within_size"], indirect=True)
def test_a_worker_on_huge_pages_faults_the_whole_huge_pages_around_its_slots(
    engine_id: str, tmpfs: Path
) -> None:
    if not shmem_allows_huge_pages():
        pytest.skip("shmem_enabled denies huge pages on this host")
    # 8 MiB in rows of 64 KiB, two slots each: the worker's slots lie in every huge page.
    seen: list[tuple[int, int]] = []
    with SharedOffloadRegion(
        engine_id, 128, 1, 64 << 10, 32 << 10, root=tmpfs, progress=lambda *a: seen.append(a)
    ) as worker:
        assert worker.populate_walk == ((4 * MIB, 8 * MIB), (0, 4 * MIB))  # from row 64, wrapped
        assert resident(worker.path) == 8 * MIB
        assert seen[-1] == (8 * MIB, 8 * MIB)


@pytest.mark.root
@pytest.mark.parametrize("tmpfs", ["size=8m"], indirect=True)
@pytest.mark.parametrize(("threads", "cause"), [(1, errno.ENOSPC), (2, errno.EFAULT)])
def test_a_root_that_fills_up_before_the_pages_are_faulted_is_an_insufficient_space_error(
    engine_id: str, tmpfs: Path, threads: int, cause: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One thread reserves with fallocate (ENOSPC there); several fault without (EFAULT, mapped)."""
    filled = fill_after_the_space_check(monkeypatch, tmpfs)
    with pytest.raises(InsufficientSpaceError) as info:
        SharedOffloadRegion(
            engine_id, 64, None, 16 * PAGESIZE, PAGESIZE, root=tmpfs, populate_threads=threads
        )
    assert filled == [tmpfs / "filler"]  # the check passed: the error is the allocation's
    assert isinstance(info.value.__cause__, OSError)
    assert info.value.__cause__.errno in (cause, errno.ENOMEM)
    assert info.value.fix is not None
    assert os.listdir(tmpfs) == ["filler"]
