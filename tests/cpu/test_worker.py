"""CPUOffloadingWorker: bytes round-trip GPU -> region -> GPU, the block->chunk mapping, and shutdown."""

from __future__ import annotations

import logging
import mmap
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from kvoffload import faults
from kvoffload.base import GPULoadStoreSpec, TransferResult
from kvoffload.cpu import gpu_worker
from kvoffload.cpu.block_copy import (
    LONG_RUN_BYTES,
    PARALLEL_COPY_BYTES,
    TILE_BYTES,
    block_view,
    copy_on_host,
    copy_with_torch,
    make_copy_plan,
    plan_copy_runs,
    split_plan,
)
from kvoffload.cpu.common import CPULoadStoreSpec
from kvoffload.cpu.gpu_worker import CPUOffloadingWorker
from kvoffload.cpu.host_register import host_unregister
from kvoffload.cpu.shared_offload_region import PAGESIZE, SharedOffloadRegion
from kvoffload.errors import ConfigError, KvOffloadError
from kvoffload.platforms import current_platform

NUM_BLOCKS = 8
NUM_CHUNKS = 4
BPC = 2  # blocks per chunk

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class FakeWorkerRegion:
    """A worker-side region in anonymous memory with the real one's view and pinning API.

    ``cleanup`` records whether any tensor still used the memory: torch views do not
    pin an mmap, so a worker that cleans the region before dropping its views would
    leave them dangling. The fake then keeps the mapping instead of crashing the test.
    Like the real one, it unregisters what ``pin_mmap_region`` registered before it unmaps.
    """

    def __init__(
        self,
        num_chunks: int,
        cpu_page_size: int,
        *,
        workers: int = 1,
        rank: int = 0,
        log: list[str] | None = None,
    ) -> None:
        self.num_chunks = num_chunks
        self.cpu_page_size = cpu_page_size
        self.row_stride = self._row_stride = cpu_page_size * workers
        self.rank: int | None = rank
        self.page_size = PAGESIZE
        self.total_size_bytes = num_chunks * self.row_stride
        self.is_pinned = False
        self.pinned_addresses: list[int] = []
        self.mm = mmap.mmap(-1, self.total_size_bytes)
        self._idle_refs = sys.getrefcount(self.mm)
        self._base: torch.Tensor | None = torch.frombuffer(self.mm, dtype=torch.int8)
        self._worker_offset = rank * cpu_page_size
        self._canonical_offset = 0
        self.calls: list[str] = []
        self.cleanups = 0
        self.views_alive_at_cleanup: bool | None = None
        self.log = log if log is not None else []

    def iter_worker_slot_ranges(self) -> Iterator[tuple[int, int]]:
        assert self.rank is not None
        for row in range(self.num_chunks):
            yield row * self.row_stride + self.rank * self.cpu_page_size, self.cpu_page_size

    def _view(self, offset: int, size: int) -> torch.Tensor:
        assert self._base is not None
        return torch.as_strided(self._base, (self.num_chunks, size), (self.row_stride, 1), offset)

    def create_next_worker_view(self, tensor_page_size: int) -> torch.Tensor:
        self.calls.append("worker")
        assert self.rank is not None
        end = (self.rank + 1) * self.cpu_page_size
        if self._worker_offset + tensor_page_size > end:
            raise KvOffloadError(f"Worker offset {self._worker_offset} exceeds worker area end {end}")
        view = self._view(self._worker_offset, tensor_page_size)
        self._worker_offset += tensor_page_size
        return view

    def create_next_canonical_view(self, tensor_page_size: int) -> torch.Tensor:
        self.calls.append("canonical")
        view = self._view(self._canonical_offset, tensor_page_size)
        self._canonical_offset += tensor_page_size
        return view

    def tensors_alive(self) -> bool:
        """Whether any tensor still uses the memory, once our own base is dropped."""
        # torch keeps one reference to the buffer for as long as any view of it lives.
        return sys.getrefcount(self.mm) > self._idle_refs

    def drop_base(self) -> None:
        self._base = None

    def cleanup(self) -> None:
        self.cleanups += 1
        self.log.append("region")
        if self.mm.closed:
            return
        for address in self.pinned_addresses:
            host_unregister(address)
        self.pinned_addresses.clear()
        self.drop_base()
        self.views_alive_at_cleanup = self.tensors_alive()
        if not self.views_alive_at_cleanup:
            self.mm.close()

    def row(self, chunk: int) -> bytes:
        return self.mm[chunk * self.row_stride : (chunk + 1) * self.row_stride]


def kv_caches(device: str = "cpu") -> list[torch.Tensor]:
    """Two KV tensors of different dtypes and page sizes, filled with distinct values."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(NUM_BLOCKS, 2, 4, generator=gen).to(torch.bfloat16)  # 16-byte blocks
    values = torch.randint(
        -(2**31), 2**31 - 1, (NUM_BLOCKS, 12), generator=gen, dtype=torch.int32
    )  # 48 bytes
    return [keys.to(device), values.to(device)]


PAGE_BYTES = 16 + 48  # one block across both tensors


def block_bytes(tensors: list[torch.Tensor], block: int) -> list[bytes]:
    return [t[block].cpu().contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]


@pytest.fixture
def region() -> Iterator[FakeWorkerRegion]:
    fake = FakeWorkerRegion(NUM_CHUNKS, PAGE_BYTES * BPC)
    yield fake
    fake.drop_base()
    if not fake.mm.closed and not fake.tensors_alive():
        fake.mm.close()


def drain(worker: CPUOffloadingWorker) -> list[TransferResult]:
    results = worker.get_finished()
    assert all(r.success for r in results)
    return results


def round_trip(
    worker: CPUOffloadingWorker, tensors: list[torch.Tensor], blocks: list[int], chunks: list[int]
) -> None:
    """Store ``blocks``, zero them on the device, load them back, and compare."""
    before = [t.clone() for t in tensors]
    worker.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
    worker.wait({1})
    for t in tensors:
        t[blocks] = 0
    worker.submit_load(2, CPULoadStoreSpec(chunks), GPULoadStoreSpec(blocks))
    worker.wait({2})
    assert {r.job_id for r in drain(worker)} == {1, 2}
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t.cpu(), b.cpu())


# ---------------------------------------------------------------- block -> chunk mapping


def test_consecutive_blocks_fill_a_chunk_in_one_run() -> None:
    assert plan_copy_runs([4, 5], [3], 2) == [(4, 3, 0, 2)]


def test_blocks_fill_chunks_from_sub_block_zero_and_the_last_may_be_partial() -> None:
    assert plan_copy_runs([1, 2, 3], [7, 0], 2) == [(1, 7, 0, 2), (3, 0, 0, 1)]


def test_scattered_blocks_are_copied_one_by_one() -> None:
    assert plan_copy_runs([6, 2], [1], 2) == [(6, 1, 0, 1), (2, 1, 1, 1)]


@pytest.mark.parametrize("chunks", [[0], [0, 1, 2]])
def test_chunk_count_must_match_the_block_count(chunks: list[int]) -> None:
    with pytest.raises(ConfigError, match="need 2 chunks") as info:
        plan_copy_runs([0, 1, 2], chunks, 2)
    assert info.value.key == "chunk_ids"


def test_reversed_blocks_are_runs_of_one() -> None:
    assert plan_copy_runs([3, 2, 1, 0], [0, 1], 2) == [(3, 0, 0, 1), (2, 0, 1, 1), (1, 1, 0, 1), (0, 1, 1, 1)]


def test_a_run_never_crosses_into_the_next_chunk() -> None:
    # Consecutive chunk ids are not consecutive bytes: each row holds every tensor's slice.
    assert plan_copy_runs([0, 1, 2, 3], [5, 6], 2) == [(0, 5, 0, 2), (2, 6, 0, 2)]


def test_with_one_block_per_chunk_every_block_is_its_own_run() -> None:
    assert plan_copy_runs([4, 5, 6], [0, 1, 2], 1) == [(4, 0, 0, 1), (5, 1, 0, 1), (6, 2, 0, 1)]


def test_an_empty_transfer_has_no_runs() -> None:
    assert plan_copy_runs([], [], 2) == []


def test_runs_cover_every_block_of_a_long_mixed_transfer_in_order() -> None:
    blocks = [*range(100, 140), 7, 3, 9, *range(50, 57)]
    chunks = list(range(60, 60 + 13))
    runs = plan_copy_runs(blocks, chunks, 4)
    expanded = [(b + k, c, s + k) for b, c, s, n in runs for k in range(n)]
    assert expanded == [(b, chunks[i // 4], i % 4) for i, b in enumerate(blocks)]
    assert len(runs) == 10 + 3 + 3  # 10 full chunks, three strays, 50..56 cut at two chunk edges


@pytest.mark.parametrize(
    ("blocks", "chunks", "bad_key"),
    [([1, 2, 1], [0, 1], "block_ids"), ([0, 1, 2, 3], [3, 3], "chunk_ids")],
    ids=["block_twice", "chunk_twice"],
)
def test_an_id_named_twice_in_one_transfer_is_a_config_error(
    blocks: list[int], chunks: list[int], bad_key: str
) -> None:
    with pytest.raises(ConfigError, match="more than once") as info:
        plan_copy_runs(blocks, chunks, 2)
    assert info.value.key == bad_key


# ---------------------------------------------------------------- the copies, byte for byte

COPY_PATTERNS = {
    "consecutive": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
    "reversed": [9, 8, 7, 6, 5, 4, 3, 2, 1, 0],
    "shuffled": [13, 2, 7, 0, 11, 5, 14, 9, 3],
    "every_other": [0, 2, 4, 6, 8, 10, 12],
    "runs_and_strays": [4, 5, 6, 7, 8, 9, 15, 1, 10, 11, 12],
    "one_block": [6],
}
COPY_BLOCKS, COPY_CHUNKS, COPY_BPC = 16, 8, 3
#: (long_run_bytes, tile_bytes) in blocks of the page: the defaults, every run a slice,
#: every block its own tile, and a mix of slices and tiles of several blocks.
COPY_STRATEGIES = {
    "defaults": None,
    "all_slices": (1, 1),
    "all_tiles_of_one": (1 << 40, 1),
    "mixed": (2, 2),
}


def copy_layout(page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPU blocks, and a chunk view inside a wider row (another slot before it and after it)."""
    gen = torch.Generator().manual_seed(page)
    gpu = torch.randint(-128, 128, (COPY_BLOCKS, page), generator=gen, dtype=torch.int8)
    row = 3 * COPY_BPC * page + 5
    base = torch.full((COPY_CHUNKS * row,), 0x5A, dtype=torch.int8)
    cpu = torch.as_strided(base, (COPY_CHUNKS, COPY_BPC, page), (row, page, 1), COPY_BPC * page + 3)
    return gpu, base, cpu


def chunks_for(blocks: list[int]) -> list[int]:
    # Chunks handed out out of order, as a free list does.
    return [(5 * i + 3) % COPY_CHUNKS for i in range(-(-len(blocks) // COPY_BPC))]


def targets(blocks: list[int]) -> list[tuple[int, int, int]]:
    """(GPU block, chunk, sub-block) of each block of a transfer, as the module docstring says."""
    chunks = chunks_for(blocks)
    return [(block, chunks[i // COPY_BPC], i % COPY_BPC) for i, block in enumerate(blocks)]


def run_copy(
    path: str, gpu: torch.Tensor, cpu: torch.Tensor, blocks: list[int], to_cpu: bool, strategy: str
) -> None:
    page = gpu.shape[1]
    plan = make_copy_plan(blocks, chunks_for(blocks), COPY_BPC)
    if path == "torch":
        copy_with_torch(gpu, cpu, plan.runs(), to_cpu, non_blocking=False)
        return
    limits = COPY_STRATEGIES[strategy]
    long_run, tile = (LONG_RUN_BYTES, TILE_BYTES) if limits is None else (limits[0] * page, limits[1] * page)
    copy_on_host(
        block_view(gpu),
        block_view(cpu),
        plan,
        page,
        to_cpu,
        long_run_bytes=long_run,
        tile_bytes=tile,
    )


COPY_PATHS = [("host", s) for s in COPY_STRATEGIES] + [("torch", "runs")]


@pytest.mark.parametrize("page", [48, 4096])
@pytest.mark.parametrize(("path", "strategy"), COPY_PATHS, ids=[f"{p}-{s}" for p, s in COPY_PATHS])
@pytest.mark.parametrize("pattern", list(COPY_PATTERNS))
def test_a_store_writes_exactly_its_blocks_into_their_sub_blocks(
    page: int, path: str, strategy: str, pattern: str
) -> None:
    blocks = COPY_PATTERNS[pattern]
    gpu, base, cpu = copy_layout(page)
    gpu_before = gpu.clone()
    expected = base.clone()
    expected_cpu = torch.as_strided(expected, cpu.shape, cpu.stride(), cpu.storage_offset())
    for block, chunk, sub in targets(blocks):
        expected_cpu[chunk, sub] = gpu[block]
    run_copy(path, gpu, cpu, blocks, to_cpu=True, strategy=strategy)
    assert torch.equal(base, expected)  # every byte of every row, the other slots included
    assert torch.equal(gpu, gpu_before)


@pytest.mark.parametrize("page", [48, 4096])
@pytest.mark.parametrize(("path", "strategy"), COPY_PATHS, ids=[f"{p}-{s}" for p, s in COPY_PATHS])
@pytest.mark.parametrize("pattern", list(COPY_PATTERNS))
def test_a_load_writes_exactly_its_blocks_from_their_sub_blocks(
    page: int, path: str, strategy: str, pattern: str
) -> None:
    blocks = COPY_PATTERNS[pattern]
    gpu, base, cpu = copy_layout(page)
    base.copy_(
        torch.randint(-128, 128, base.shape, generator=torch.Generator().manual_seed(1), dtype=torch.int8)
    )
    base_before = base.clone()
    gpu.fill_(0x33)
    expected = gpu.clone()
    for block, chunk, sub in targets(blocks):
        expected[block] = cpu[chunk, sub]
    run_copy(path, gpu, cpu, blocks, to_cpu=False, strategy=strategy)
    assert torch.equal(gpu, expected)  # loaded blocks, and no other block touched
    assert torch.equal(base, base_before)


@pytest.mark.parametrize("pieces", [1, 2, 3, 5, 100])
def test_a_split_plan_covers_every_block_once_in_order(pieces: int) -> None:
    blocks = COPY_PATTERNS["runs_and_strays"]
    plan = make_copy_plan(blocks, chunks_for(blocks), COPY_BPC)
    parts = split_plan(plan, pieces)
    assert len(parts) == min(pieces, len(blocks))
    expanded = [(b + k, c, s + k) for part in parts for b, c, s, n in part.runs() for k in range(n)]
    assert expanded == targets(blocks)


def test_a_split_plan_moves_the_same_bytes_as_the_whole() -> None:
    blocks = COPY_PATTERNS["shuffled"]
    gpu, base, cpu = copy_layout(4096)
    whole_gpu, whole_base, whole_cpu = copy_layout(4096)
    plan = make_copy_plan(blocks, chunks_for(blocks), COPY_BPC)
    copy_on_host(block_view(whole_gpu), block_view(whole_cpu), plan, 4096, to_cpu=True)
    for part in split_plan(plan, 4):
        copy_on_host(block_view(gpu), block_view(cpu), part, 4096, to_cpu=True)
    assert torch.equal(base, whole_base)


@pytest.fixture
def two_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def copy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvoffload_copy")]


@pytest.mark.usefixtures("two_torch_threads")
def test_a_large_transfer_is_copied_by_threads_that_stop_at_shutdown() -> None:
    page, blocks, chunks = 64 << 10, 96, 48
    assert blocks * page >= PARALLEL_COPY_BYTES
    fake = FakeWorkerRegion(chunks, page * BPC)
    gen = torch.Generator().manual_seed(5)
    tensors = [torch.randint(-128, 128, (blocks, page), generator=gen, dtype=torch.int8)]
    worker = CPUOffloadingWorker(tensors, BPC, chunks, mmap_region=fake)
    order = torch.randperm(blocks, generator=gen).tolist()
    round_trip(worker, tensors, order, torch.randperm(chunks, generator=gen).tolist())
    assert copy_threads()  # the pool took the pieces
    worker.shutdown()
    assert copy_threads() == []
    assert fake.views_alive_at_cleanup is False


@pytest.mark.usefixtures("two_torch_threads")
def test_a_small_transfer_stays_on_the_callers_thread(region: FakeWorkerRegion) -> None:
    tensors = kv_caches()
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS, mmap_region=region)
    round_trip(worker, tensors, [3, 5, 6], [2, 0])
    assert copy_threads() == []
    worker.shutdown()


def test_block_views_keep_the_strides_and_the_memory_of_their_tensor() -> None:
    _, _, cpu = copy_layout(48)
    view = block_view(cpu)
    assert view.shape == (COPY_CHUNKS, COPY_BPC, 48)
    assert view.strides == cpu.stride()
    view[2, 1] = range(48)
    assert cpu[2, 1].tolist() == list(range(48))


# ---------------------------------------------------------------- transfers on CPU tensors


def test_blocks_round_trip_through_the_region(region: FakeWorkerRegion) -> None:
    tensors = kv_caches()
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS, mmap_region=region)
    round_trip(worker, tensors, [3, 5, 6], [2, 0])
    worker.shutdown()


def test_stored_block_lands_at_its_sub_block_of_the_worker_slot() -> None:
    region = FakeWorkerRegion(NUM_CHUNKS, PAGE_BYTES * BPC, workers=2, rank=1)
    tensors = kv_caches()
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS, mmap_region=region)
    worker.submit_store(1, GPULoadStoreSpec([3, 5, 6]), CPULoadStoreSpec([2, 0]))
    drain(worker)
    slot = region.cpu_page_size  # rank 1's slot starts after rank 0's
    row2, row0 = region.row(2), region.row(0)
    keys3, values3 = block_bytes(tensors, 3)
    keys5, values5 = block_bytes(tensors, 5)
    keys6, values6 = block_bytes(tensors, 6)
    # Within the slot: tensor 0's view (BPC sub-blocks of 16 bytes), then tensor 1's (48 bytes each).
    assert row2[slot : slot + 32] == keys3 + keys5
    assert row2[slot + 32 : slot + 128] == values3 + values5
    assert row0[slot : slot + 16] == keys6
    assert row0[slot + 32 : slot + 80] == values6
    assert row2[:slot] == bytes(slot)  # rank 0's slot is untouched
    worker.shutdown()
    assert region.mm.closed


def test_blocks_can_be_loaded_into_other_gpu_blocks(region: FakeWorkerRegion) -> None:
    tensors = kv_caches()
    expected = block_bytes(tensors, 1)
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS, mmap_region=region)
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([3]))
    worker.submit_load(2, CPULoadStoreSpec([3]), GPULoadStoreSpec([7]), expedited=True)
    drain(worker)
    assert block_bytes(tensors, 7) == expected
    worker.shutdown()


def test_blocks_round_trip_without_a_region() -> None:
    tensors = kv_caches()
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS)
    round_trip(worker, tensors, [0, 1, 2, 3, 4], [3, 2, 1])
    worker.shutdown()


def test_canonical_layout_takes_canonical_views(region: FakeWorkerRegion) -> None:
    tensors = kv_caches()
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS, mmap_region=region, canonical_layout=True)
    assert region.calls == ["canonical", "canonical"]
    round_trip(worker, tensors, [2, 3], [1])
    worker.shutdown()


def test_finished_jobs_report_size_and_time_once(region: FakeWorkerRegion) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    worker.submit_store(7, GPULoadStoreSpec([0, 1, 2]), CPULoadStoreSpec([0, 1]))
    [result] = worker.get_finished()
    assert (result.job_id, result.success, result.transfer_size) == (7, True, 3 * PAGE_BYTES)
    assert result.transfer_time is not None
    assert result.transfer_time >= 0
    assert worker.get_finished() == []
    worker.shutdown()


def test_job_id_still_unreported_cannot_be_reused(region: FakeWorkerRegion) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    worker.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
    with pytest.raises(KvOffloadError, match="already in flight"):
        worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    drain(worker)
    worker.submit_store(1, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    worker.shutdown()


@pytest.mark.parametrize(
    ("blocks", "chunks", "bad_key"),
    [([NUM_BLOCKS], [0], "block_ids"), ([0], [NUM_CHUNKS], "chunk_ids"), ([0, 1, 2], [0], "chunk_ids")],
)
def test_transfer_outside_the_caches_is_a_config_error(
    region: FakeWorkerRegion, blocks: list[int], chunks: list[int], bad_key: str
) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    with pytest.raises(ConfigError) as info:
        worker.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
    assert info.value.key == bad_key
    worker.shutdown()


@pytest.mark.parametrize(
    ("blocks", "chunks", "bad_key"),
    [([0, 1, 0], [0, 1], "block_ids"), ([0, 1, 2, 3], [1, 1], "chunk_ids")],
    ids=["block_twice", "chunk_twice"],
)
def test_transfer_naming_an_id_twice_is_refused_before_any_byte_moves(
    region: FakeWorkerRegion, blocks: list[int], chunks: list[int], bad_key: str
) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    with pytest.raises(ConfigError) as info:
        worker.submit_store(1, GPULoadStoreSpec(blocks), CPULoadStoreSpec(chunks))
    assert info.value.key == bad_key
    assert region.mm[:] == bytes(len(region.mm))
    worker.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))  # the job id was not taken
    drain(worker)
    worker.shutdown()


def test_a_long_transfer_of_shuffled_blocks_round_trips() -> None:
    blocks, chunks = 64, 32
    fake = FakeWorkerRegion(chunks, 4096 * 2 * BPC)
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randint(-128, 128, (blocks, 4096), generator=gen, dtype=torch.int8) for _ in range(2)]
    worker = CPUOffloadingWorker(tensors, BPC, chunks, mmap_region=fake)
    order = torch.randperm(blocks, generator=gen).tolist()[:40]
    round_trip(worker, tensors, order, torch.randperm(chunks, generator=gen).tolist()[:20])
    worker.shutdown()
    assert fake.views_alive_at_cleanup is False


def test_an_empty_transfer_finishes_having_moved_nothing() -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, 0)
    worker.submit_store(1, GPULoadStoreSpec([]), CPULoadStoreSpec([]))
    worker.submit_load(2, CPULoadStoreSpec([]), GPULoadStoreSpec([]))
    assert [(r.job_id, r.transfer_size) for r in drain(worker)] == [(1, 0), (2, 0)]
    with pytest.raises(ConfigError) as info:
        worker.submit_store(3, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
    assert info.value.key == "chunk_ids"
    worker.shutdown()


def test_transfer_needs_a_cpu_spec_on_the_other_side(region: FakeWorkerRegion) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    with pytest.raises(ConfigError, match="CPULoadStoreSpec"):
        worker.submit_load(1, GPULoadStoreSpec([0]), GPULoadStoreSpec([0]))
    worker.shutdown()


# ---------------------------------------------------------------- construction


@pytest.mark.parametrize(
    ("make", "bad_key"),
    [
        (lambda r: CPUOffloadingWorker(kv_caches(), 0, NUM_CHUNKS, mmap_region=r), "blocks_per_chunk"),
        (lambda r: CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS + 1, mmap_region=r), "num_cpu_chunks"),
        (lambda r: CPUOffloadingWorker([], BPC, NUM_CHUNKS, mmap_region=r), "kv_caches"),
        (
            lambda r: CPUOffloadingWorker(
                [torch.zeros(NUM_BLOCKS, 4), torch.zeros(NUM_BLOCKS + 1, 4)], BPC, NUM_CHUNKS, mmap_region=r
            ),
            "kv_caches[1]",
        ),
        (
            lambda r: CPUOffloadingWorker([torch.zeros(4, NUM_BLOCKS).t()], BPC, NUM_CHUNKS, mmap_region=r),
            "kv_caches[0]",
        ),
        (
            lambda r: CPUOffloadingWorker([torch.zeros(NUM_BLOCKS, 0)], BPC, NUM_CHUNKS, mmap_region=r),
            "kv_caches[0]",
        ),
    ],
    ids=["blocks_per_chunk", "chunk_count", "no_tensors", "block_counts", "non_contiguous", "empty_blocks"],
)
def test_bad_arguments_are_config_errors_that_leave_the_region_to_the_caller(
    region: FakeWorkerRegion, make: object, bad_key: str
) -> None:
    assert callable(make)
    with pytest.raises(ConfigError) as info:
        make(region)
    assert info.value.key == bad_key
    assert region.cleanups == 0


def test_slot_overflow_in_the_constructor_leaves_the_region_to_the_caller() -> None:
    region = FakeWorkerRegion(NUM_CHUNKS, PAGE_BYTES)  # room for one block per chunk, not BPC
    with pytest.raises(KvOffloadError, match="exceeds worker area end"):
        CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    assert region.cleanups == 0
    region.cleanup()


# ---------------------------------------------------------------- shutdown


def test_shutdown_drops_every_view_before_cleaning_the_region(region: FakeWorkerRegion) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    worker.shutdown()
    assert region.cleanups == 1
    assert region.views_alive_at_cleanup is False
    assert region.mm.closed


def test_shutdown_is_idempotent(region: FakeWorkerRegion) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    worker.shutdown()
    worker.shutdown()
    assert region.cleanups == 1


def test_a_failure_stopping_transfers_is_logged_and_the_region_still_released(
    region: FakeWorkerRegion, caplog: pytest.LogCaptureFixture
) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    with faults.scenario("cleanup.worker=raise"), caplog.at_level(logging.ERROR):
        worker.shutdown()  # vLLM's shutdown: a transfer-side failure does not fail the release
        assert faults.hits() == {"cleanup.worker": 1}
    assert "Failed to stop the offloading transfers" in caplog.text
    assert region.cleanups == 1
    assert region.views_alive_at_cleanup is False
    assert region.mm.closed


def test_a_handler_that_fails_to_drain_is_logged_and_the_rest_still_released(
    region: FakeWorkerRegion, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    worker.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))
    worker.submit_store(2, GPULoadStoreSpec([1]), CPULoadStoreSpec([1]))
    synced: list[bool] = []
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: synced.append(True))

    class LostEvent:
        def synchronize(self) -> None:
            raise RuntimeError("device lost")

    monkeypatch.setattr(worker._store_handler._transfers[0], "end_event", LostEvent())
    with caplog.at_level(logging.ERROR):
        worker.shutdown()
    assert "skipping 1 remaining transfers" in caplog.text
    assert "Failed to shut down store offloading handler" in caplog.text
    assert worker._store_handler.src_tensors == []  # released before it reported the failure
    assert worker._load_handler.src_tensors == []  # the handlers after it still shut down
    assert worker._expedited_load_handler.src_tensors == []
    assert synced == []  # host copies ended when they returned: no device to wait for
    assert region.views_alive_at_cleanup is False
    assert region.mm.closed


def test_a_device_worker_waits_for_the_device_before_unmapping_after_a_failed_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    order: list[str] = []
    region = FakeWorkerRegion(NUM_CHUNKS, PAGE_BYTES * BPC, log=order)
    # Meta tensors stand in for device ones: their copies may still be running.
    worker = CPUOffloadingWorker(kv_caches("meta"), BPC, NUM_CHUNKS, mmap_region=region)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: order.append("sync"))
    release = worker._store_handler.shutdown

    def lost_device() -> None:
        release()
        raise RuntimeError("device lost")

    monkeypatch.setattr(worker._store_handler, "shutdown", lost_device)
    worker.shutdown()
    assert order == ["sync", "region"]
    assert region.mm.closed


def test_ctrl_c_during_shutdown_still_releases_the_region_then_propagates(
    region: FakeWorkerRegion, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    load = worker._load_handler
    release = load.shutdown

    def interrupted() -> None:
        release()
        raise KeyboardInterrupt

    monkeypatch.setattr(load, "shutdown", interrupted)
    with pytest.raises(KeyboardInterrupt):
        worker.shutdown()
    assert worker._expedited_load_handler.src_tensors == []
    assert region.cleanups == 1
    assert region.mm.closed


def test_region_cleanup_failure_is_raised_and_not_retried(region: FakeWorkerRegion) -> None:
    class FailingRegion(FakeWorkerRegion):
        def cleanup(self) -> None:
            super().cleanup()
            raise OSError("unmap failed")

    failing = FailingRegion(NUM_CHUNKS, PAGE_BYTES * BPC)
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=failing)
    with pytest.raises(OSError, match="unmap failed"):
        worker.shutdown()
    worker.shutdown()
    assert failing.cleanups == 1


def test_worker_refuses_transfers_after_shutdown(region: FakeWorkerRegion) -> None:
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    worker.shutdown()
    with pytest.raises(KvOffloadError, match="shut down"):
        worker.submit_store(1, GPULoadStoreSpec([0]), CPULoadStoreSpec([0]))


def test_leaving_the_with_block_shuts_the_worker_down(region: FakeWorkerRegion) -> None:
    with CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region):
        pass
    assert region.mm.closed


# ---------------------------------------------------------------- over a real region


def real_region(engine_id: str) -> SharedOffloadRegion:
    return SharedOffloadRegion(engine_id, NUM_CHUNKS, 0, PAGESIZE, PAGESIZE)


def test_blocks_round_trip_through_a_real_region(engine_id: str) -> None:
    region = real_region(engine_id)
    tensors = kv_caches()
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS, mmap_region=region)
    round_trip(worker, tensors, [7, 0, 4], [3, 1])
    worker.shutdown()
    assert region.closed
    assert not region.path.exists()


def test_real_region_is_released_when_stopping_transfers_fails(engine_id: str) -> None:
    region = real_region(engine_id)
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    with faults.scenario("cleanup.worker=raise"):
        worker.shutdown()
    assert region.closed
    assert not region.path.exists()


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
@requires_cuda
def test_cuda_blocks_round_trip_through_the_region(region: FakeWorkerRegion) -> None:
    tensors = kv_caches("cuda")
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS, mmap_region=region)
    assert worker.is_cuda
    round_trip(worker, tensors, [3, 5, 6], [2, 0])
    worker.shutdown()
    assert region.mm.closed


@pytest.mark.cuda
@requires_cuda
def test_cuda_blocks_round_trip_through_pinned_memory_without_a_region() -> None:
    tensors = kv_caches("cuda")
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS)
    round_trip(worker, tensors, [0, 1, 2, 3, 4], [3, 2, 1])
    worker.shutdown()


@pytest.mark.cuda
@requires_cuda
def test_cuda_store_waits_for_kernels_queued_before_it(region: FakeWorkerRegion) -> None:
    tensors = kv_caches("cuda")
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS, mmap_region=region)
    # A long kernel on the compute stream, then a write queued after it.
    torch.cuda._sleep(50_000_000)  # type: ignore[no-untyped-call]
    tensors[1][2] = 12345
    worker.submit_store(1, GPULoadStoreSpec([2]), CPULoadStoreSpec([0]))
    worker.wait({1})
    [result] = drain(worker)
    assert result.transfer_time is not None
    assert result.transfer_time > 0
    values = torch.frombuffer(bytearray(region.row(0)[32 : 32 + 48]), dtype=torch.int32)
    assert bool((values == 12345).all())
    worker.shutdown()


@pytest.mark.cuda
@requires_cuda
def test_cuda_worker_shutdown_with_transfers_in_flight_releases_the_region(engine_id: str) -> None:
    region = real_region(engine_id)
    worker = CPUOffloadingWorker(kv_caches("cuda"), BPC, NUM_CHUNKS, mmap_region=region)
    worker.submit_store(1, GPULoadStoreSpec(range(NUM_BLOCKS)), CPULoadStoreSpec(range(NUM_CHUNKS)))
    worker.submit_load(2, CPULoadStoreSpec([0]), GPULoadStoreSpec([0, 1]), expedited=True)
    worker.shutdown()
    assert region.closed
    assert not region.path.exists()


@pytest.mark.cuda
@requires_cuda
@pytest.mark.parametrize("canonical", [False, True], ids=["worker_slot", "canonical"])
def test_cuda_worker_pins_the_region_and_its_cleanup_unpins_it(engine_id: str, canonical: bool) -> None:
    region = real_region(engine_id)
    tensors = kv_caches("cuda")
    worker = CPUOffloadingWorker(tensors, BPC, NUM_CHUNKS, mmap_region=region, canonical_layout=canonical)
    assert region.is_pinned
    round_trip(worker, tensors, [3, 5, 6], [2, 0])
    worker.shutdown()
    assert not region.is_pinned
    assert region.pinned_addresses == []
    assert region.closed


# ---------------------------------------------------------------- pinning, as vLLM's worker does


@pytest.fixture
def pinning_platform(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """A platform that pins host memory; the registrations ``pin_mmap_region`` makes, recorded."""
    registered: list[tuple[int, int]] = []

    def register(ptr: int, size: int) -> bool:
        registered.append((ptr, size))
        return True

    monkeypatch.setattr(current_platform, "is_pin_memory_available", lambda: True)
    monkeypatch.setattr(gpu_worker, "host_register", register)
    # Registering only the worker's slot saves a page a row here; vLLM wants 3 MiB.
    monkeypatch.setattr(gpu_worker, "MIN_HOST_REGISTER_SAVED_BYTES", PAGESIZE)
    return registered


def two_slot_region(engine_id: str) -> SharedOffloadRegion:
    return SharedOffloadRegion(engine_id, NUM_CHUNKS, 1, 2 * PAGESIZE, PAGESIZE)


def test_a_device_worker_pins_its_slot_of_every_row_through_pin_mmap_region(
    engine_id: str, pinning_platform: list[tuple[int, int]]
) -> None:
    region = two_slot_region(engine_id)
    # Meta tensors stand in for device ones: the worker pins for any accelerator's DMA.
    worker = CPUOffloadingWorker(kv_caches("meta"), BPC, NUM_CHUNKS, mmap_region=region)
    base = region._base_address()
    assert pinning_platform == [(base + row * 2 * PAGESIZE + PAGESIZE, PAGESIZE) for row in range(NUM_CHUNKS)]
    assert region.is_pinned
    worker.shutdown()
    assert not region.is_pinned


def test_a_device_worker_pins_the_whole_region_under_the_canonical_layout(
    engine_id: str, pinning_platform: list[tuple[int, int]]
) -> None:
    region = two_slot_region(engine_id)
    worker = CPUOffloadingWorker(
        kv_caches("meta"), BPC, NUM_CHUNKS, mmap_region=region, canonical_layout=True
    )
    assert pinning_platform == [(region._base_address(), NUM_CHUNKS * 2 * PAGESIZE)]
    worker.shutdown()


def test_a_worker_over_host_tensors_does_not_pin_where_the_platform_could(
    engine_id: str, pinning_platform: list[tuple[int, int]]
) -> None:
    region = two_slot_region(engine_id)
    worker = CPUOffloadingWorker(kv_caches(), BPC, NUM_CHUNKS, mmap_region=region)
    assert pinning_platform == []  # host-to-host copies gain nothing from DMA registration
    assert not region.is_pinned
    worker.shutdown()


def test_a_refused_registration_leaves_the_region_pageable_and_the_worker_working(
    engine_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(current_platform, "is_pin_memory_available", lambda: True)
    monkeypatch.setattr(gpu_worker, "host_register", lambda ptr, size: False)
    region = two_slot_region(engine_id)
    worker = CPUOffloadingWorker(kv_caches("meta"), BPC, NUM_CHUNKS, mmap_region=region)
    assert not region.is_pinned
    assert worker._load_handler.host_memory_is_pinned is False
    worker.shutdown()


# ---------------------------------------------------------------- HAS_TRITON, as vLLM's

FAKE_TRITON_BACKENDS = """
class Driver:
    def __init__(self, active):
        self.active = active

    def is_active(self):
        return self.active


class Backend:
    def __init__(self, active):
        self.driver = Driver(active)


backends = {{"cpu": Backend(True), {gpus}}}
"""


@pytest.mark.parametrize(
    ("gpus", "expected"),
    [
        ('"nvidia": Backend(True), "amd": Backend(False)', True),
        ('"nvidia": Backend(True), "amd": Backend(True)', False),
        ('"nvidia": Backend(False)', False),
    ],
    ids=["one_active_driver", "two_active_drivers", "none_active"],
)
def test_has_triton_asks_triton_for_exactly_one_active_gpu_driver_on_first_use(
    tmp_path: Path, gpus: str, expected: bool
) -> None:
    backends = tmp_path / "triton" / "backends"
    backends.mkdir(parents=True)
    (tmp_path / "triton" / "__init__.py").write_text("")
    (backends / "__init__.py").write_text(FAKE_TRITON_BACKENDS.format(gpus=gpus))
    probe = (
        "import sys\n"
        "from kvoffload.cpu import gpu_worker\n"
        "assert 'triton' not in sys.modules, 'importing the worker imported triton'\n"
        "print(gpu_worker.HAS_TRITON)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[2])])
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.strip() == str(expected)


@pytest.mark.skipif(find_spec("triton") is not None, reason="Triton is installed here")
def test_without_triton_has_triton_is_false() -> None:
    assert gpu_worker.HAS_TRITON is False
